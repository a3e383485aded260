"""Mixtures (`shardkit.reader.mixture`): the schedule's bound, every pass of every source once, shares in
every window, resume across a change of shards, bad input, and the adapters, with real readers."""

from __future__ import annotations

import json
import math
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardkit
import shardkit.reader.mixture as mixture
from shardkit.errors import ReaderError, SchemaMismatchError
from shardkit.reader import SOURCE, MixedReader
from shardkit.reader.adapters.collate import jump_to_epoch
from shardkit.reader.mixture import MAX_PERIOD, Mixture, Schedule, source_seed
from tests.reader.datasets import corrupt_ids, write_all_codecs

OFFSET = 10_000  # source i holds ids i * OFFSET, i * OFFSET + 1, ...
Item = tuple[int, int]  # (source, id)


def write_source(folder: Path, layout: Sequence[int], offset: int = 0, *, x_type: pa.DataType | None = None
                 ) -> str:
    """A Parquet dataset of ``sum(layout)`` rows in row groups of ``layout`` (ids from ``offset``, and
    ``x = id / 2``), with its ``_metadata`` summary."""
    folder.mkdir(parents=True)
    x_type = pa.float32() if x_type is None else x_type
    schema = pa.schema([("id", pa.int64()), ("x", x_type)])
    start = offset
    with pq.ParquetWriter(folder / "part-00000.parquet", schema) as writer:
        for size in layout:
            ids = np.arange(start, start + size, dtype=np.int64)
            writer.write_table(pa.table({"id": ids, "x": pa.array(ids / 2).cast(x_type)}),
                               row_group_size=size)
            start += size
    shardkit.write_summary(str(folder))
    return str(folder)


@pytest.fixture(autouse=True)
def _readers_closed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every reader a test makes is closed after it (its threads stop): the later tests of the session
    fork DataLoader workers, which must not inherit this file's reading threads."""
    made: list[Any] = []
    make = shardkit.make_reader

    def tracked(*args: Any, **kwargs: Any) -> Any:
        made.append(make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(shardkit, "make_reader", tracked)
    yield
    for reader in made:
        reader.close()


def write_sources(tmp: Path, layouts: Sequence[Sequence[int]]) -> dict[str, str]:
    return {f"s{i}": write_source(tmp / f"s{i}", layout, i * OFFSET) for i, layout in enumerate(layouts)}


def items(batch: Mapping[str, Any]) -> list[Item]:
    return list(zip(np.asarray(batch[SOURCE]).tolist(), np.asarray(batch["id"]).tolist(), strict=True))


def open_shards(sources: Mapping[str, str], world: int, *, small_blocks: bool = False, **kw: Any
                ) -> list[shardkit.Reader]:
    """Shards of the mixture; ``small_blocks``: the memory the sources' workers place their rows in is cut
    in blocks of one batch, so that most windows cross a block (`shardkit.reader._pipeline.placing`)."""
    with mock.patch.object(mixture, "BLOCK_BYTES", 1 if small_blocks else mixture.BLOCK_BYTES):
        return [shardkit.make_reader(dict(sources), shard=k, num_shards=world, workers=1, prefetch=2, **kw)
                for k in range(world)]


def read_epochs(sources: Mapping[str, str], world: int, epochs: int, **kw: Any
                ) -> tuple[list[list[list[Item]]], list[int]]:
    """Per epoch, per shard, what it read; and how many batches each shard yielded in each epoch."""
    readers = open_shards(sources, world, num_epochs=epochs, **kw)
    out: list[list[list[Item]]] = []
    counts: list[int] = []
    try:
        for _ in range(epochs):
            out.append([])
            for r in readers:
                batches = list(r.iter_epoch())
                assert len(batches) == len(r) or kw.get("remainder") == "uneven"
                counts.append(len(batches))
                out[-1].append([i for b in batches for i in items(b)])
                for b in batches:  # every value came with its row
                    assert np.array_equal(b["x"], b["id"] / 2)
    finally:
        for r in readers:
            r.close()
    return out, counts


def reference(sources: Mapping[str, str], weights: Sequence[Fraction], length: int, *, seed: int,
              shuffle: bool, on_error: str = "raise") -> list[Item]:
    """The first ``length`` items of the mixed stream, made without a mixture: the schedule's sources,
    each source's samples in the order of its passes, each pass the epoch of a one-shard `Reader` of the
    source with its seed (`source_seed`)."""
    schedule = Mixture.of(list(sources), [1] * len(sources), dict(zip(sources, weights, strict=True)),
                          length).schedule
    return stream_reference(sources, schedule.sources(0, length).tolist(), seed=seed, shuffle=shuffle,
                            on_error=on_error)


def stream_reference(sources: Mapping[str, str], which: Sequence[int], *, seed: int, shuffle: bool,
                     on_error: str = "raise") -> list[Item]:
    """The items of the positions whose sources are ``which``, made without a mixture: each source's
    samples in the order of its passes, each pass the epoch of a one-shard `Reader` of the source
    (without a quick start)."""
    need = Counter(which)
    passes: list[list[int]] = []
    for i, (name, url) in enumerate(sources.items()):
        ids: list[int] = []
        with shardkit.make_reader(url, seed=source_seed(seed, name), shuffle=shuffle, num_epochs=None,
                                  batch_size=1024, columns=["id"], workers=1, on_error=on_error,
                                  quick_start=False) as r:  # a source's passes have no lead
            for batch in r:
                if len(ids) >= need[i]:
                    break
                ids.extend(batch["id"].tolist())
        passes.append(ids)
    at = [0] * len(sources)
    out = []
    for s in which:
        out.append((s, passes[s][at[s]]))
        at[s] += 1
    return out


def shares_of(weights: Sequence[int]) -> list[Fraction]:
    return [Fraction(w, sum(weights)) for w in weights]


def check_windows(stream: Sequence[Item], shares: Sequence[Fraction], bound: float) -> None:
    """Every window of ``stream`` holds each source within ``2 * bound`` of its share (through the prefix
    counts: a window's count is the difference of two of them)."""
    for s, share in enumerate(shares):
        d, lo, hi = Fraction(0), Fraction(0), Fraction(0)
        for src, _ in stream:
            d += (src == s) - share
            lo, hi = min(lo, d), max(hi, d)
        assert hi - lo <= 2 * bound + 1e-12, (s, float(hi - lo), bound)


# ---- the schedule ------------------------------------------------------------------------------------

quotas = st.lists(st.integers(0, 40), min_size=1, max_size=7).filter(any)


@settings(max_examples=200, deadline=None)
@given(q=quotas)
def test_every_prefix_of_the_schedule_is_within_the_bound(q: list[int]) -> None:
    schedule = Schedule(tuple(q))
    w = schedule.period
    shares = [Fraction(x, w) for x in q]
    n = sum(1 for x in q if x)
    assert schedule.bound == (0 if n == 1 else 1 - 1 / (2 * n - 2))
    seq = schedule.sources(0, 2 * w).tolist()
    counts = [0] * len(q)
    for p, s in enumerate(seq, 1):
        counts[s] += 1
        for i, share in enumerate(shares):
            assert abs(counts[i] - share * p) <= Fraction(schedule.bound).limit_denominator(1000), (q, p, i)
        if p % w == 0:
            assert counts == [x * p // w for x in q]  # a period holds each source exactly its quota
    assert all(q[s] for s in seq)  # a source of weight 0 never comes


@settings(max_examples=100, deadline=None)
@given(q=quotas, start=st.integers(0, 10**12), length=st.integers(0, 300))
def test_counts_and_sources_agree_anywhere_in_the_stream(q: list[int], start: int, length: int) -> None:
    schedule = Schedule(tuple(q))
    which = schedule.sources(start, start + length)
    got = schedule.counts(start + length) - schedule.counts(start)
    assert got.tolist() == np.bincount(which, minlength=len(q)).tolist()
    assert (schedule.counts(start + schedule.period) - schedule.counts(start)).tolist() == q
    many = [start, start + length, start + schedule.period, 0]  # counts_at: the same, many at a time
    assert schedule.counts_at(np.array(many)).tolist() == [schedule.counts(p).tolist() for p in many]


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.one_of(st.integers(0, 10**9), st.floats(0, 1e6, allow_nan=False)),
                        min_size=1, max_size=6).filter(any))
def test_shares_are_the_weights_exactly_or_rounded_to_the_longest_period(weights: list[float]) -> None:
    names = [f"s{i}" for i in range(len(weights))]
    mixture = Mixture.of(names, [1] * len(weights), dict(zip(names, weights, strict=True)), 10)
    exact = [Fraction(str(w)) if isinstance(w, float) else Fraction(w) for w in weights]
    exact = [w / sum(exact) for w in exact]
    assert sum(mixture.shares) == 1
    assert mixture.schedule.period <= MAX_PERIOD
    tiny = sum(1 for w in exact if 0 < w < Fraction(1, MAX_PERIOD))  # raised to 1/MAX_PERIOD
    for share, want in zip(mixture.shares, exact, strict=True):
        assert abs(share - want) <= Fraction(1 + tiny, MAX_PERIOD)
        assert (share > 0) == (want > 0)
    if math.lcm(*(w.denominator for w in exact)) <= MAX_PERIOD:
        assert list(mixture.shares) == exact


def test_the_defaults_weigh_the_sources_by_their_rows_and_read_them_once_per_epoch() -> None:
    mixture = Mixture.of(["a", "b"], [30, 10], None, None)
    assert mixture.shares == (Fraction(3, 4), Fraction(1, 4))
    assert mixture.samples_per_epoch == 40
    assert [m["passes_per_epoch"] for m in mixture.to_json()] == [1.0, 1.0]
    assert Mixture.of(["a", "b"], [30, 10], {"a": 1, "b": 0}, None).samples_per_epoch == 30


# ---- real readers: passes, shares, order --------------------------------------------------------------

layouts = st.lists(st.integers(1, 9), min_size=1, max_size=4)


@st.composite
def mixtures(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 3))
    weights = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n).filter(any))
    return {
        "layouts": [draw(layouts) for _ in range(n)],
        "weights": weights,
        "samples": draw(st.integers(1, 60)),
        "world": draw(st.integers(1, 4)),
        "batch_size": draw(st.integers(1, 7)),
        "remainder": draw(st.sampled_from(["drop", "uneven"])),
        "drop_last": draw(st.booleans()),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
        "small_blocks": draw(st.booleans()),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=mixtures())
def test_every_pass_of_every_source_comes_once_at_its_share_in_one_order(job: dict[str, Any]) -> None:
    """What all shards read, epoch after epoch, is the mixed stream from its start: the schedule's sources,
    each source's passes in their orders, whatever the number of shards (positions an epoch leaves out
    start the next); each shard's epoch holds each source within the bound of its share in every window."""
    world, samples = job["world"], job["samples"]
    assume(world <= samples)
    kw = {k: job[k] for k in ("batch_size", "remainder", "drop_last", "shuffle", "seed", "small_blocks")}
    per_shard = samples // world if job["remainder"] == "drop" else -(-samples // world)
    assume(not job["drop_last"] or (samples // world) // job["batch_size"] > 0)
    with tempfile.TemporaryDirectory() as tmp:
        sources = write_sources(Path(tmp), job["layouts"])
        weights = dict(zip(sources, job["weights"], strict=True))
        epochs, counts = read_epochs(sources, world, 3, weights=weights, samples_per_epoch=samples, **kw)
        stream = [i for epoch in epochs for shard in epoch for i in shard]
        want = reference(sources, shares_of(job["weights"]), len(stream), seed=job["seed"],
                         shuffle=job["shuffle"])
    assert stream == want
    assert len(stream) >= 3 * samples - 3 * (world * job["batch_size"] + world)  # little is left to the next
    assert per_shard >= 1
    bound = Schedule(tuple(job["weights"])).bound
    for epoch in epochs:
        for shard in epoch:
            check_windows(shard, shares_of(job["weights"]), bound)
    if job["remainder"] == "drop":
        assert len(set(counts)) == 1, counts
    for s, layout in enumerate(job["layouts"]):  # each pass: every row once, before any repeats
        ids = [i for src, i in stream if src == s]
        n = sum(layout)
        for start in range(0, len(ids), n):
            chunk = ids[start : start + n]
            assert len(set(chunk)) == len(chunk)
            assert set(chunk) <= set(range(s * OFFSET, s * OFFSET + n))


def test_a_batch_says_which_source_each_row_came_from(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[5, 7], [3, 3, 3]])
    with shardkit.make_reader(sources, weights={"s0": 2, "s1": 1}, batch_size=6, seed=1) as reader:
        assert isinstance(reader, MixedReader)
        assert reader.schema.names == ["id", "x", SOURCE]
        assert reader.sources == ("s0", "s1")
        for batch in reader:
            assert batch[SOURCE].dtype == np.int32
            assert np.array_equal(batch["id"] // OFFSET, batch[SOURCE])
            assert np.array_equal(batch["x"], (batch["id"] / 2).astype(np.float32))
            assert batch[SOURCE].tolist() == Schedule((2, 1)).sources(0, len(batch["id"])).tolist()


def test_pad_gives_every_shard_as_many_batches_and_repeats_only_the_epochs_first_samples(
        tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[6, 5], [4]])
    epochs, counts = read_epochs(sources, 3, 1, weights={"s0": 1, "s1": 1}, samples_per_epoch=13,
                                 batch_size=2, remainder="pad", seed=4)
    assert len(set(counts)) == 1
    got = Counter(i for shard in epochs[0] for i in shard)
    want = reference(sources, shares_of([1, 1]), 15, seed=4, shuffle=True)
    assert got == Counter(want[:13]) + Counter(want[:2])  # 13 samples, padded to 3 x 5 with the first two


def test_a_source_of_weight_zero_is_opened_and_checked_but_never_read(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[5], [4]])
    with shardkit.make_reader(sources, weights={"s0": 1, "s1": 0}, num_epochs=3, batch_size=4) as reader:
        assert reader.num_samples == 5
        seen = [i for b in reader for i in items(b)]
    assert Counter(s for s, _ in seen) == {0: 15}


def test_the_default_weights_and_epoch_read_each_source_once_per_epoch(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[7, 5], [3, 2]])
    with shardkit.make_reader(sources, batch_size=5, num_epochs=2, seed=9) as reader:
        assert reader.num_samples == 17
        for _ in range(2):
            seen = [i for b in reader.iter_epoch() for i in items(b)]
            assert sorted(seen) == sorted([(0, i) for i in range(12)] + [(1, OFFSET + i) for i in range(5)])


def test_filters_and_columns_per_source(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[10, 10], [8]])
    with shardkit.make_reader(sources, filter={"s0": [("id", "<", 5)]}, columns=["id"],
                              weights={"s0": 1, "s1": 1}, samples_per_epoch=10, batch_size=10) as reader:
        assert reader.schema.names == ["id", SOURCE]
        batch = next(iter(reader))
    assert sorted(batch["id"][batch[SOURCE] == 0].tolist()) == [0, 1, 2, 3, 4]
    with shardkit.make_reader(sources, filter=[("id", ">=", 17)], samples_per_epoch=12,
                              weights={"s0": 1, "s1": 1}, batch_size=12) as reader:  # one filter for all
        batch = next(iter(reader))
    assert sorted(batch["id"][batch[SOURCE] == 0].tolist()) == [17, 17, 18, 18, 19, 19]


def test_every_codec_mixes_values_and_nulls_as_each_source_reads_them(tmp_path: Path) -> None:
    a, cols = write_all_codecs(tmp_path / "a", 40, row_group_size=7)
    b, _ = write_all_codecs(tmp_path / "b", 40, row_group_size=5)
    with shardkit.make_reader(a, shuffle=False, batch_size=100) as plain:
        truth = next(iter(plain))
    with shardkit.make_reader({"a": a, "b": b}, weights={"a": 2, "b": 1}, batch_size=9, seed=3) as reader:
        for batch in reader:
            for name in ("score", "vec", "img", "maybe", "maybe_vec", "note", "var", "name"):
                want = truth[name][batch["id"]]
                got = batch[name]
                if isinstance(want, np.ma.MaskedArray):
                    assert np.array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(want)), name
                    assert np.array_equal(np.ma.filled(got, 0), np.ma.filled(want, 0)), name
                elif want.dtype == object:
                    assert all(np.array_equal(g, w) if isinstance(w, np.ndarray) else g == w
                               for g, w in zip(got, want, strict=True)), name
                else:
                    assert np.array_equal(got, want), name
    assert len(cols["id"]) == 40


# ---- resume -------------------------------------------------------------------------------------------

@st.composite
def resumes(draw: st.DrawFn) -> dict[str, Any]:
    job = draw(mixtures())
    samples = job["samples"]
    job["world"] = draw(st.integers(1, min(4, samples)))
    job["final"] = draw(st.integers(1, min(4, samples)))
    job["steps"] = draw(st.integers(0, 12))
    job["rank"] = draw(st.integers(0, 3))
    return job


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=resumes())
def test_a_resume_on_another_number_of_shards_reads_what_the_uninterrupted_run_would(
        job: dict[str, Any]) -> None:
    """A job stopped after ``steps`` steps on ``world`` shards and resumed from one rank's state on
    ``final`` shards reads, with what it read before, a prefix of the stream: nothing twice, nothing
    skipped (positions its last epoch leaves out are the next epoch's first). Where no epoch leaves
    samples out (uneven, no drop_last), each epoch is exactly the uninterrupted run's."""
    world, final, samples = job["world"], job["final"], job["samples"]
    kw = {k: job[k] for k in ("batch_size", "remainder", "drop_last", "shuffle", "seed", "small_blocks")}
    for shards in (world, final):
        assume(not job["drop_last"] or (samples // shards) // job["batch_size"] > 0)
    with tempfile.TemporaryDirectory() as tmp:
        sources = write_sources(Path(tmp), job["layouts"])
        weights = dict(zip(sources, job["weights"], strict=True))
        mix = {"weights": weights, "samples_per_epoch": samples, "num_epochs": 2, **kw}
        seen: list[Item] = []
        epoch_of: list[Counter[Item]] = [Counter(), Counter(), Counter()]
        readers = open_shards(sources, world, **mix)
        its = [iter(r) for r in readers]
        for _ in range(job["steps"]):
            for r, it in zip(readers, its, strict=True):
                batch = next(it, None)
                if batch is not None:  # the epoch moves on only after its last batch
                    seen += items(batch)
                    epoch_of[r.epoch].update(items(batch))
        states = {json.dumps(r.state_dict(), sort_keys=True) for r in readers}
        assume(len(states) == 1)  # uneven: a shard a batch ahead has no state of the job's (see Reader)
        state = json.loads(json.dumps(readers[job["rank"] % world].state_dict()))
        for r in readers:
            r.close()
        readers = open_shards(sources, final, **mix)
        for r in readers:
            r.load_state_dict(state)
        for r in readers:
            for _ in range(3):
                epoch = r.epoch
                for batch in r.iter_epoch() if r.epoch < 2 else []:
                    seen += items(batch)
                    epoch_of[epoch].update(items(batch))
        # positions the last epoch left to the next one (``drop`` on fewer samples than shards after
        # the resize): not read, not skipped either; the next epoch starts with them
        carry = [p for a, b in readers[0].state_dict()["start"]["carry"] for p in range(a, b)]
        for r in readers:
            r.close()
        stream = reference(sources, shares_of(job["weights"]), len(seen) + len(carry), seed=job["seed"],
                           shuffle=job["shuffle"])
        want = [item for p, item in enumerate(stream) if p not in set(carry)]
        if job["remainder"] == "uneven" and not job["drop_last"]:
            whole, _ = read_epochs(sources, world, 2, **{k: v for k, v in mix.items() if k != "num_epochs"})
    assert Counter(seen) == Counter(want)
    if job["remainder"] == "uneven" and not job["drop_last"]:
        for e in range(2):
            assert epoch_of[e] == Counter(i for shard in whole[e] for i in shard)


def test_a_state_whose_epoch_was_moved_starts_that_epoch_as_the_shards_would(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[7, 5], [4, 4]])
    kw: dict[str, Any] = {"weights": {"s0": 2, "s1": 1}, "samples_per_epoch": 37, "batch_size": 4, "seed": 3}
    with shardkit.make_reader(sources, shard=1, num_shards=3, num_epochs=None, **kw) as reader:
        epochs = [[i for b in reader.iter_epoch() for i in items(b)] for _ in range(4)]
    with shardkit.make_reader(sources, shard=1, num_shards=3, num_epochs=None, **kw) as reader:
        for epoch in (2, 1, 3):
            jump_to_epoch(reader, epoch)  # what the adapters do (a new tf.data pass, set_epoch)
            assert [i for b in reader.iter_epoch() for i in items(b)] == epochs[epoch]


def test_a_resumed_reader_gives_the_same_batches(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[9, 9], [5]])
    kw: dict[str, Any] = {"weights": {"s0": 3, "s1": 1}, "batch_size": 5, "seed": 8, "num_epochs": 2,
                          "shard": 0, "num_shards": 2}
    with shardkit.make_reader(sources, **kw) as reader:
        it = iter(reader)
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(reader.state_dict()))
        rest = [items(b) for b in it]
    with shardkit.make_reader(sources, **kw) as resumed:
        resumed.load_state_dict(state)
        assert [items(b) for b in resumed] == rest
    assert state["kind"] == "shardkit.mixture"
    assert set(state["sources"]) == {"s0", "s1"}


# ---- bad input ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_sources(tmp_path_factory.mktemp("two"), [[5, 5], [4]])


@pytest.mark.parametrize(("weights", "words"), [
    ({"s0": -1, "s1": 1}, ["weights['s0']=-1", "negative"]),
    ({"s0": 0, "s1": 0.0}, ["all zero", "positive weight"]),
    ({"s0": "3", "s1": 1}, ["weights['s0']='3'", "not a number"]),
    ({"s0": True, "s1": 1}, ["weights['s0']=True", "not a number"]),
    ({"s0": float("nan"), "s1": 1}, ["weights['s0']=nan", "not a number"]),
    ({"s0": float("inf"), "s1": 1}, ["weights['s0']=inf", "not a number"]),
    ({"s0": 1, "s1": 1, "web": 2}, ["['web']", "not sources", "['s0', 's1']"]),
    ({"s0": 1}, ["no weight for the source(s) ['s1']", "leave weights= out"]),
    ([3, 1], ["weights=[3, 1]", "dict of source name"]),
])
def test_bad_weights_are_refused_naming_the_weight_and_the_fix(two: dict[str, str], weights: Any,
                                                                words: list[str]) -> None:
    with pytest.raises(ReaderError) as e:
        shardkit.make_reader(two, weights=weights)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("samples", [0, -3, 2.5, "10", True])
def test_bad_samples_per_epoch_are_refused(two: dict[str, str], samples: Any) -> None:
    with pytest.raises(ReaderError, match=r"samples_per_epoch=.* must be an int >= 1"):
        shardkit.make_reader(two, samples_per_epoch=samples)


@pytest.mark.parametrize("key", ["weights", "samples_per_epoch"])
def test_mixture_arguments_with_one_dataset_are_refused(two: dict[str, str], key: str) -> None:
    value = {"s0": 1} if key == "weights" else 10
    with pytest.raises(ReaderError, match=f"{key}=.* is for a mixture of several datasets"):
        shardkit.make_reader(two["s0"], **{key: value})


@pytest.mark.parametrize(("sources", "words"), [
    ({}, ["empty dict of sources"]),
    ({1: "x"}, ["source names must be non-empty strings", "[1]"]),
    ({"web": {"url": "x", "weight": 3}}, ["source 'web' is {", "weights go in weights="]),
])
def test_bad_sources_are_refused(sources: dict[Any, Any], words: list[str]) -> None:
    with pytest.raises(ReaderError) as e:
        shardkit.make_reader(sources)
    for word in words:
        assert word in str(e.value)


def test_an_empty_source_or_one_its_filter_empties_is_named(tmp_path: Path, two: dict[str, str]) -> None:
    empty = tmp_path / "empty"
    shardkit.write_dataset(pa.table({"id": pa.array([], pa.int64()), "x": pa.array([], pa.float32())}),
                           str(empty))
    with pytest.raises(ReaderError, match=r"source 'gone' of the mixture: .* has 0 rows"):
        shardkit.make_reader({**two, "gone": str(empty)})
    with pytest.raises(ReaderError, match=r"source 's1' of the mixture: .* no samples matching the filter"):
        shardkit.make_reader(two, filter={"s1": [("id", "<", 0)]})
    with pytest.raises(ReaderError, match=r"filter= is a dict.*names \['web'\], which are not sources"):
        shardkit.make_reader(two, filter={"web": [("id", "<", 0)]})


def test_sources_whose_fields_differ_are_refused_naming_source_field_and_types(tmp_path: Path) -> None:
    a = write_source(tmp_path / "a", [4])
    b = write_source(tmp_path / "b", [4], x_type=pa.float64())
    with pytest.raises(SchemaMismatchError) as e:
        shardkit.make_reader({"a": a, "b": b})
    assert "field 'x' is float64 in source 'b' and float32 in source 'a'" in str(e.value)
    assert "columns=" in str(e.value)
    with shardkit.make_reader({"a": a, "b": b}, columns=["id"]) as reader:  # the fix
        assert reader.schema.names == ["id", SOURCE]
    c = tmp_path / "c"
    shardkit.write_dataset(pa.table({"id": pa.array([1, 2], pa.int64())}), str(c))
    with pytest.raises(SchemaMismatchError, match=r"source 'c' has no field\(s\) \['x'\] of source 'a'.*"
                                                  r"columns=\['id'\]"):
        shardkit.make_reader({"a": a, "c": str(c)})
    d = tmp_path / "d"
    shardkit.write_dataset(pa.table({"id": pa.array([1, 2], pa.int64()), SOURCE: [1, 2]}), str(d))
    with pytest.raises(ReaderError, match=f"has a field named '{SOURCE}'"):
        shardkit.make_reader({"d": str(d), "a": a})


def test_more_shards_than_samples_per_epoch_are_refused(two: dict[str, str]) -> None:
    with pytest.raises(ReaderError, match=r"num_shards=5 is more than samples_per_epoch=4"):
        shardkit.make_reader(two, samples_per_epoch=4, shard=0, num_shards=5)


def test_states_of_another_reader_or_mixture_are_refused(two: dict[str, str], tmp_path: Path) -> None:
    with shardkit.make_reader(two, weights={"s0": 1, "s1": 1}) as reader:
        state = reader.state_dict()
    with shardkit.make_reader(two["s0"]) as plain:
        with pytest.raises(ReaderError, match="saved with another dataset"):
            plain.load_state_dict(state)
        with shardkit.make_reader(two) as mixed, pytest.raises(ReaderError, match="mixture resumes from"):
            mixed.load_state_dict(plain.state_dict())
    cases = [
        ({"weights": {"s0": 2, "s1": 1}}, "shares="),
        ({"weights": {"s0": 1, "s1": 1}, "samples_per_epoch": 7}, "samples_per_epoch=14"),
        ({"weights": {"s0": 1, "s1": 1}, "seed": 5}, "seed=0"),
    ]
    for kwargs, words in cases:
        with shardkit.make_reader(two, **kwargs) as other, pytest.raises(ReaderError, match=words):
            other.load_state_dict(state)
    three = {**two, "s2": write_source(tmp_path / "s2", [3], 2 * OFFSET)}
    with shardkit.make_reader(three) as other, pytest.raises(ReaderError, match=r"sources \['s0', 's1'\]"):
        other.load_state_dict(state)
    broken = {**state, "history": [["x", 1]]}
    with shardkit.make_reader(two, weights={"s0": 1, "s1": 1}) as other, \
            pytest.raises(ReaderError, match="malformed"):
        other.load_state_dict(broken)


# ---- the adapters -------------------------------------------------------------------------------------

def stream_of(sources: Mapping[str, str], world: int, **kw: Any) -> Counter[Item]:
    epochs, _ = read_epochs(sources, world, 1, **kw)
    return Counter(i for shard in epochs[0] for i in shard)


def test_the_torch_loader_takes_a_mixed_reader(two: dict[str, str]) -> None:
    import shardkit.torch as skt

    kw: dict[str, Any] = {"weights": {"s0": 3, "s1": 1}, "samples_per_epoch": 24, "batch_size": 4, "seed": 2}
    with skt.make_loader(shardkit.make_reader(two, **kw)) as loader:
        got = Counter(i for b in loader for i in items({k: v.numpy() for k, v in b.items()}))
        state = loader.state_dict()
    assert got == stream_of(two, 1, **kw)
    assert state["epoch"] == 1


def test_dataloader_workers_read_a_mixture_as_shards_of_it(two: dict[str, str]) -> None:
    import torch

    import shardkit.torch as skt

    kw: dict[str, Any] = {"weights": {"s0": 3, "s1": 1}, "samples_per_epoch": 24, "batch_size": 3, "seed": 2}
    ds = skt.ShardkitIterableDataset(two, rank=0, world_size=1, workers=1, **kw)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    got = Counter(i for b in loader for i in items({k: v.numpy() for k, v in b.items()}))
    assert got == stream_of(two, 2, **kw)


@pytest.mark.tf
def test_tf_data_takes_a_mixed_reader(two: dict[str, str]) -> None:
    import shardkit.tf as stf

    kw: dict[str, Any] = {"weights": {"s0": 1, "s1": 1}, "samples_per_epoch": 20, "batch_size": 4, "seed": 6}
    ds = stf.make_dataset(shardkit.make_reader(two, **kw))
    got = Counter(i for b in ds for i in items({k: v.numpy() for k, v in b.items()}))
    assert got == stream_of(two, 1, **kw)


def test_the_schedules_sources_are_the_same_from_its_repeated_periods_and_past_them() -> None:
    schedule = Schedule((3, 1, 2))
    w = schedule.period
    for start, stop in [(0, 7), (5, 300), (w * 1000 + 1, w * 1000 + 900), (3, 20_000)]:
        want = np.array([schedule.sequence[p % w] for p in range(start, stop)])
        assert np.array_equal(schedule.sources(start, stop), want)


# ---- the sources' workers place their rows in the mixed batches ---------------------------------------

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=mixtures(), lost=st.lists(st.integers(0, 3), min_size=1, max_size=2))
def test_rows_lost_in_a_source_are_its_own_readers_substitutes_in_the_mixed_stream(
        job: dict[str, Any], lost: list[int]) -> None:
    """A corrupt row group of a source (``on_error="skip"``) costs the mixture no position: where its rows
    were, the source's one-shard reader puts readable rows in their place (its window is then put
    together by the consuming thread, not placed by the workers), and the mixed stream holds those."""
    first = job["layouts"][0]
    bad = sorted({g for g in lost if g < len(first) - 1})  # one row group of the source stays readable
    assume(bad and job["weights"][0])
    job["world"] = 1
    kw = {k: job[k] for k in ("batch_size", "remainder", "drop_last", "shuffle", "seed", "small_blocks")}
    assume(not job["drop_last"] or job["samples"] // job["batch_size"] > 0)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "skipped N corrupt row group(s)"
        sources = write_sources(Path(tmp), job["layouts"])
        corrupt_ids(sources["s0"], bad)
        weights = dict(zip(sources, job["weights"], strict=True))
        epochs, _ = read_epochs(sources, 1, 2, weights=weights, samples_per_epoch=job["samples"],
                                on_error="skip", **kw)
        stream = [i for epoch in epochs for shard in epoch for i in shard]
        want = reference(sources, shares_of(job["weights"]), len(stream), seed=job["seed"],
                         shuffle=job["shuffle"], on_error="skip")
    assert stream == want


def test_the_small_blocks_of_these_tests_are_one_batch_long(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[40, 30], [50]])
    small = open_shards(sources, 1, small_blocks=True, batch_size=4)[0]
    large = open_shards(sources, 1, batch_size=4)[0]
    assert small._block_rows == 4
    assert large._block_rows >= 2 * 1024  # two windows of the shuffle buffer's least


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_a_mixture_of_a_table_that_moved_on_resumes_on_the_saved_snapshot(tmp_path: Path, fmt: str) -> None:
    """A source's reader reopened on the snapshot a state names keeps the mixture's share of the shuffle
    window, the threads and the read-ahead: the resumed mixture reads what the uninterrupted one would."""
    from tests.dataset.tables import make_history

    history = make_history(fmt, tmp_path / "t", [("append", 60), ("append", 40)])
    table = shardkit.open_dataset(history.url)
    sources = {"table": table, "folder": write_source(tmp_path / "f", [30, 20], OFFSET)}
    kw: dict[str, Any] = {"weights": {"table": 2, "folder": 1}, "batch_size": 7, "seed": 4, "num_epochs": 1,
                          "shuffle_buffer": 30, "columns": ["id"]}
    with shardkit.make_reader(sources, **kw) as reader:
        it = iter(reader)
        head = [items(next(it)) for _ in range(4)]
        state = json.loads(json.dumps(reader.state_dict()))
        rest = [items(b) for b in it]
    history.apply(("append", 25))  # the table moves on: a new reader opens the new version
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with shardkit.make_reader({**sources, "table": history.url}, **kw) as resumed:
            resumed.load_state_dict(state)
            assert [items(b) for b in resumed] == rest
            assert resumed.readers["table"].shuffle_buffer == reader.readers["table"].shuffle_buffer
    assert len(head) + len(rest) == len(reader)


@settings(max_examples=100, deadline=None)
@given(q=quotas, cuts=st.lists(st.integers(0, 400), min_size=2, max_size=8, unique=True),
       batch_size=st.integers(1, 40), group=st.integers(1, 5))
def test_the_samples_each_batch_needs_of_each_source_add_up_its_rows(
        q: list[int], cuts: list[int], batch_size: int, group: int) -> None:
    """What each batch needs of each source, looked up ``group`` batches at a time, is what counting the
    sources of every batch so far gives (the segments: runs of the stream with gaps between them)."""
    schedule = Schedule(tuple(q))
    cuts = sorted(cuts)
    segments = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False)]
    held = np.zeros(len(q), dtype=np.int64)
    batches = list(mixture._batches(segments, batch_size, 0))
    got = list(mixture._needs(iter(batches), schedule, group))
    assert [(spans, consumed) for spans, consumed, _ in got] == batches
    for spans, _, needed in got:
        for a, b in spans:
            held += np.bincount(schedule.sources(a, b), minlength=len(q))
        assert needed == held.tolist()
