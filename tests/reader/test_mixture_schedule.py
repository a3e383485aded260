"""Scheduled weights of a mixture (`shardkit.reader.mixture`: `WeightSchedule`, `Weights.realize`, eras):
the constant schedule's bound in every window along a schedule, a resume on another number of shards
mid-schedule, a reweight mid-epoch that keeps every source's passes, bad input, the job config and
``shardkit inspect``; with real readers."""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardkit
import shardkit.reader.mixture as mixture
from shardkit.errors import ReaderError
from shardkit.job.config.sections import DataConfig
from shardkit.reader.mixture import (
    RAMP_STEP,
    Era,
    Mixture,
    Stream,
    Weights,
    WeightSchedule,
    check_weights,
)
from tests.reader.test_mixture import (  # the autouse fixture closes the readers each test makes
    OFFSET,
    Item,
    _readers_closed,  # noqa: F401
    items,
    open_shards,
    stream_reference,
    write_sources,
)

# ---- the schedule alone ---------------------------------------------------------------------------------


@st.composite
def schedules(draw: st.DrawFn, top: int = 20_000) -> dict[str, Any]:
    """Weights of 2-4 sources, each a constant or (samples, weight) pairs, linear or in steps."""
    n = draw(st.integers(2, 4))
    out: dict[str, Any] = {}
    for i in range(n):
        if draw(st.booleans()):
            out[f"s{i}"] = draw(st.integers(0, 5))
            continue
        xs = sorted(draw(st.sets(st.integers(0, top), min_size=1, max_size=4)))
        pairs = [(x, draw(st.integers(0, 5))) for x in xs]
        out[f"s{i}"] = pairs if draw(st.booleans()) else {"steps": pairs}
    return out


def stream_of(weights: Mapping[str, Any]) -> tuple[Stream, Mixture]:
    mixture = Mixture.of(list(weights), [1] * len(weights), weights, 1)
    return Stream([Era.first(mixture.plan)]), mixture


def realized_shares(mixture: Mixture, length: int) -> np.ndarray:
    """The shares the stream is read at, per position ``0 .. length - 1`` (float ``(length, sources)``)."""
    pieces = mixture.pieces
    out = np.empty((length, len(mixture.names)))
    stops = [*pieces.offsets[1:].tolist(), length]
    for start, stop, schedule in zip(pieces.offsets.tolist(), stops, pieces.schedules, strict=True):
        if start < length:
            out[start:min(stop, length)] = np.array(schedule.quotas) / schedule.period
    return out


def wanted(weights: Mapping[str, Any], samples: float) -> np.ndarray:
    """The shares the user's schedule says at ``samples`` (the weights normalized), without shardkit."""
    def at(value: Any) -> float:
        kind, pairs = ("steps", [(0, value)]) if isinstance(value, int) else \
            ("steps", value["steps"]) if isinstance(value, dict) else ("linear", value)
        before = [p for p in pairs if p[0] <= samples]
        if not before:
            return float(pairs[0][1])
        x0, w0 = before[-1]
        if kind == "steps" or len(before) == len(pairs):
            return float(w0)
        x1, w1 = pairs[len(before)]
        return w0 + (w1 - w0) * (samples - x0) / (x1 - x0)

    w = np.array([at(v) for v in weights.values()])
    return w / w.sum()


@settings(max_examples=60, deadline=None)
@given(weights=schedules())
def test_every_window_along_a_schedule_holds_each_source_within_the_constant_bound(
        weights: dict[str, Any]) -> None:
    """Every prefix of the stream holds each source within the constant schedule's bound of the sum of the
    shares it is read at, so every window of W samples holds it within twice that of the shares' sum
    over the window (the constant case: ``share * W``, within ``2 - 1/(n-1)``); and those shares are the
    schedule's: a constant stretch's exactly (its ends moved by less than half a period), a ramp's within
    ``1 / RAMP_STEP`` of its value within a step."""
    try:
        stream, mixture = stream_of(weights)
    except ReaderError:
        assume(False)
        raise
    n = len(weights)
    length = 24_000
    sources = stream.sources(0, length)
    shares = realized_shares(mixture, length)
    counts = np.vstack([np.zeros(n), np.cumsum(np.eye(n)[sources], axis=0)])
    ideal = np.vstack([np.zeros(n), np.cumsum(shares, axis=0)])
    bound = 1 - 1 / (2 * n - 2)
    assert stream.bound <= bound
    assert np.abs(counts - ideal).max() <= bound + 1e-6
    for w in (7, 64, 1000):  # windows: differences of two prefixes
        deviation = (counts[w:] - counts[:-w]) - (ideal[w:] - ideal[:-w])
        assert np.abs(deviation).max() <= 2 * bound + 1e-6
    checks = np.arange(0, length, 997)
    assert np.array_equal(stream.counts_at(checks), counts[checks].astype(np.int64))
    assert [stream.counts(int(p)).tolist() for p in checks[:5]] == counts[checks[:5]].astype(int).tolist()
    reach = RAMP_STEP  # a step's middle, or a stretch's end moved by half a period, is within it
    for p in range(0, length, 499):
        near = np.array([wanted(weights, q) for q in np.linspace(max(0, p - reach), p + reach, 65)])
        lo, hi = near.min(axis=0), near.max(axis=0)
        assert np.all(shares[p] >= lo - n / RAMP_STEP - 1e-9), (p, shares[p], lo)
        assert np.all(shares[p] <= hi + n / RAMP_STEP + 1e-9), (p, shares[p], hi)


@settings(max_examples=200, deadline=None)
@given(a=st.integers(1, 5000), b=st.integers(1, 5000), zeros=st.lists(st.booleans(), max_size=3))
def test_two_sources_take_the_slots_the_heaps_of_tijdemans_rule_give(a: int, b: int, zeros: list[bool]
                                                                       ) -> None:
    """Two sources' periods (a ramp reads hundreds of them) come in closed form: the same as the heaps."""
    quotas = tuple([0] * len(zeros) + [a] + [0] * sum(zeros) + [b])
    assert np.array_equal(mixture._tijdeman.__wrapped__(quotas), mixture._tijdeman_heaps(quotas))


def test_constant_stretches_are_read_at_their_exact_shares() -> None:
    weights = {"web": {"steps": [(0, 3), (10_000, 1)]}, "code": 1}
    mixture = Mixture.of(["web", "code"], [1, 1], weights, 1)
    assert mixture.shares_at(0) == (Fraction(3, 4), Fraction(1, 4))
    assert mixture.shares_at(9_999) == (Fraction(3, 4), Fraction(1, 4))
    assert mixture.shares_at(10_000) == (Fraction(1, 2), Fraction(1, 2))  # 10,000 is whole periods of 4
    ramp = Mixture.of(["web", "code"], [1, 1], {"web": [(0, 3), (100_000, 1)], "code": 1}, 1)
    assert abs(float(ramp.shares_at(50_000)[0]) - 2 / 3) < 2 / RAMP_STEP
    assert ramp.shares_at(200_000) == (Fraction(1, 2), Fraction(1, 2))
    assert ramp.to_json()[0]["weight"] == [[0, 3], [100_000, 1]]
    assert [p["samples"] for p in ramp.schedule_json()] == [0, 100_000]


def test_a_function_of_the_samples_read_is_taken_as_breakpoints() -> None:
    anneal = WeightSchedule.sampled(lambda n: 1 if n < 500 else 0.25, stop=1000, count=4, kind="steps")
    assert anneal.points == ((0, 1), (250, 1), (500, Fraction(1, 4)), (750, Fraction(1, 4)),
                             (1000, Fraction(1, 4)))
    mixture = Mixture.of(["a", "b"], [1, 1], {"a": anneal, "b": 1}, 1)
    assert mixture.shares_at(0) == (Fraction(1, 2), Fraction(1, 2))
    assert mixture.shares_at(600) == (Fraction(1, 5), Fraction(4, 5))


# ---- reading ---------------------------------------------------------------------------------------------

@st.composite
def small_schedules(draw: st.DrawFn, names: Sequence[str], top: int) -> dict[str, Any]:
    """Weights that change within ``top`` samples (steps: a ramp shorter than a step is one step)."""
    out: dict[str, Any] = {}
    for name in names:
        xs = sorted(draw(st.sets(st.integers(0, top), min_size=1, max_size=3)))
        out[name] = {"steps": [(x, draw(st.integers(1, 4))) for x in xs]}
    return out


@st.composite
def resumes(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(2, 3))
    samples = draw(st.integers(8, 50))
    return {
        "layouts": [draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)) for _ in range(n)],
        "weights": draw(small_schedules([f"s{i}" for i in range(n)], 2 * samples)),
        "samples": samples,
        "world": draw(st.integers(1, 4)),
        "final": draw(st.integers(1, 4)),
        "steps": draw(st.integers(0, 10)),
        "batch_size": draw(st.integers(1, 6)),
        "remainder": draw(st.sampled_from(["drop", "uneven"])),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }


def run(sources: Mapping[str, str], job: Mapping[str, Any], *, weights: Mapping[str, Any],
        resume: Mapping[str, Any] | None, reweight: bool = False, epochs: int = 2
        ) -> tuple[list[Item], list[list[Item]], list[shardkit.Reader]]:
    """``job["steps"]`` steps on ``job["world"]`` shards, then its state (rank 0's) loaded on
    ``job["final"]`` shards at ``resume``'s weights (none: no stop), read to the end of ``epochs``
    epochs: what was read before the stop, what each resumed shard read, and the resumed readers."""
    kw = {"samples_per_epoch": job["samples"], "num_epochs": epochs, "batch_size": job["batch_size"],
          "remainder": job["remainder"], "shuffle": job["shuffle"], "seed": job["seed"]}
    before: list[Item] = []
    readers = open_shards(sources, job["world"], weights=weights, **kw)
    if resume is None:
        return [], [[i for b in r for i in items(b)] for r in readers], readers
    its = [iter(r) for r in readers]
    for _ in range(job["steps"]):
        for it in its:
            batch = next(it, None)
            if batch is not None:
                before += items(batch)
    states = {json.dumps(r.state_dict(), sort_keys=True) for r in readers}
    assume(len(states) == 1)  # uneven: a shard a batch ahead has no state of the job's (see Reader)
    state = json.loads(states.pop())
    for r in readers:
        r.close()
    readers = open_shards(sources, job["final"], weights=resume, **kw)
    for r in readers:
        r.load_state_dict(state, reweight=reweight)
    return before, [[i for b in r for i in items(b)] for r in readers], readers


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=resumes())
def test_a_resume_on_another_number_of_shards_mid_schedule_reads_what_the_uninterrupted_run_would(
        job: dict[str, Any]) -> None:
    """Stopped after ``steps`` steps on ``world`` shards and resumed from the state on ``final`` shards,
    a mixture whose weights change reads, with what it read before, the stream of its schedule: each
    position once, none skipped (those the last epoch leaves out are the next one's), as the run that
    never stopped; and each resumed shard holds every source within the bound of its shares."""
    assume(max(job["world"], job["final"]) <= job["samples"])
    with tempfile.TemporaryDirectory() as tmp:
        sources = write_sources(Path(tmp), job["layouts"])
        weights = dict(zip(sources, job["weights"].values(), strict=True))
        before, after, readers = run(sources, job, weights=weights, resume=weights)
        carry = {p for a, b in readers[0].state_dict()["start"]["carry"] for p in range(a, b)}
        seen = before + [i for shard in after for i in shard]
        stream, _ = stream_of(weights)
        which = stream.sources(0, len(seen) + len(carry)).tolist()
        want = [item for p, item in enumerate(stream_reference(sources, which, seed=job["seed"],
                                                                shuffle=job["shuffle"]))
                if p not in carry]
        _, whole, _ = run(sources, job, weights=weights, resume=None)
    assert Counter(seen) == Counter(want)
    if job["remainder"] == "uneven":
        assert Counter(seen) == Counter(i for shard in whole for i in shard)


def read_counts(stream: Sequence[Item], source: int) -> Counter[int]:
    return Counter(i for s, i in stream if s == source)


def holes_left(reader: Any) -> list[int]:
    """Per source, how many samples of the last era's holes (an era reads them first) are still unread."""
    era = reader.stream.eras[-1]
    start = reader.state_dict()["start"]
    reached = era.plan.counts(start["fresh"]).copy()
    for a, b in start["carry"]:  # positions the last epoch left to the next one
        reached -= np.bincount(reader.stream.sources(a, b), minlength=len(era.holes))
    return [max(0, sum(b - a for a, b in h) - int(k)) for h, k in zip(era.holes, reached, strict=True)]


@st.composite
def reweights(draw: st.DrawFn) -> dict[str, Any]:
    job = draw(resumes())
    names = [f"s{i}" for i in range(len(job["layouts"]))]
    job["new"] = draw(st.one_of(small_schedules(names, 2 * job["samples"]),
                                st.fixed_dictionaries({n: st.integers(1, 4) for n in names})))
    job["steps"] = draw(st.integers(1, 8))
    return job


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=reweights())
def test_a_reweight_mid_epoch_keeps_every_pass_of_every_source_once(job: dict[str, Any]) -> None:
    """A state continued at other weights (``reweight=True``), on another number of shards, mid-epoch:
    the job reads as many samples as without the reweight; each source's rows come once per pass (once
    the holes the reweight left are read: every row of a pass before any repeats); and each resumed
    shard holds every source within the bound of the new shares."""
    assume(max(job["world"], job["final"]) <= job["samples"])
    with tempfile.TemporaryDirectory() as tmp:
        sources = write_sources(Path(tmp), job["layouts"])
        weights = dict(zip(sources, job["weights"].values(), strict=True))
        new = dict(zip(sources, job["new"].values(), strict=True))
        before, after, readers = run(sources, job, weights=weights, resume=new, reweight=True, epochs=3)
        left = holes_left(readers[0])
        state = readers[0].state_dict()
        _, kept, _ = run(sources, job, weights=weights, resume=weights, epochs=3)
    seen = before + [i for shard in after for i in shard]
    assert len(seen) == len(before) + sum(map(len, kept))
    last = Weights.from_json(list(sources), state["schedule"][-1]["weights"])
    assert last.key() == check_weights(new, list(sources)).key()  # (3:1 and 6:2 are one: no new era)
    for s, layout in enumerate(job["layouts"]):
        counts = read_counts(seen, s)
        assert set(counts) <= set(range(s * OFFSET, s * OFFSET + sum(layout)))
        if not left[s]:
            rows = sum(layout)
            full = sum(counts.values()) // rows
            assert all(full <= counts.get(i, 0) <= full + 1 for i in range(s * OFFSET, s * OFFSET + rows))


def test_a_reweight_to_zero_and_back_reads_the_rows_it_left_first(tmp_path: Path) -> None:
    """Annealed away from a source mid-epoch, the rest of the stream has none of it; weighed in again,
    its rows that the first weights had left unread come first, so each of its passes is every row once."""
    sources = write_sources(tmp_path, [[6, 5], [4, 4]])
    kw: dict[str, Any] = {"samples_per_epoch": 40, "batch_size": 3, "seed": 4, "num_epochs": None}

    def step(readers: list[shardkit.Reader], batches: int) -> list[Item]:
        its = [r.iter_epoch() for r in readers]
        return [i for _ in range(batches) for it in its for i in items(next(it))]

    readers = open_shards(sources, 2, weights={"s0": 1, "s1": 1}, **kw)
    seen = step(readers, 2)
    state = readers[0].state_dict()
    with pytest.raises(ReaderError, match="reweight=True"):
        open_shards(sources, 3, weights={"s0": 0, "s1": 1}, **kw)[0].load_state_dict(state)
    readers = open_shards(sources, 3, weights={"s0": 0, "s1": 1}, **kw)
    for r in readers:
        r.load_state_dict(state, reweight=True)
    none = step(readers, 3)
    assert none
    assert all(s == 1 for s, _ in none)
    state = readers[0].state_dict()
    readers = open_shards(sources, 1, weights={"s0": [(0, 1), (10_000, 3)], "s1": 1}, **kw)
    readers[0].reweight = True  # as where the state is loaded for the script (ctx.checkpoint.restore)
    readers[0].load_state_dict(state)
    again = [i for b in readers[0].iter_epoch() for i in items(b)] + \
        [i for _ in range(3) for b in readers[0].iter_epoch() for i in items(b)]
    everything = seen + none + again
    assert holes_left(readers[0]) == [0, 0]
    for s, rows in ((0, 11), (1, 8)):
        counts = read_counts(everything, s)
        full = sum(counts.values()) // rows
        assert all(full <= counts.get(i, 0) <= full + 1 for i in range(s * OFFSET, s * OFFSET + rows))
    resumed = open_shards(sources, 2, weights={"s0": [(0, 1), (10_000, 3)], "s1": 1}, **kw)
    resumed[0].load_state_dict(readers[0].state_dict())  # the eras are in the state: no reweight now
    assert len(resumed[0].stream.eras) == 3


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's call, not ours
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on 2 CPUs: fine
def test_a_reweight_reaches_dataloader_workers_on_another_layout(tmp_path: Path) -> None:
    """``ShardkitIterableDataset(..., reweight=True)``: a ``StatefulDataLoader`` state saved at 1:1 by 2
    workers, continued at 3:1 by 3 workers through ``job_state``, reads one epoch's samples, at the new
    weights after the cut, and each source's rows once per pass."""
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    import shardkit.torch as skt

    sources = write_sources(tmp_path, [[20, 20, 10], [30, 20]])
    kw: dict[str, Any] = {"batch_size": 4, "seed": 2, "num_epochs": 1, "rank": 0, "world_size": 1}
    loader = StatefulDataLoader(skt.ShardkitIterableDataset(sources, weights={"s0": 1, "s1": 1}, **kw),
                                batch_size=None, num_workers=2)
    it = iter(loader)
    before = [i for _ in range(6) for i in items(next(it))]
    saved = loader.state_dict()
    del it
    dataset = skt.ShardkitIterableDataset(sources, weights={"s0": 3, "s1": 1}, **kw)
    dataset.load_state_dict(skt.job_state(saved))
    with pytest.raises(ReaderError, match="reweight=True"):  # the reader that loads it refuses other weights
        next(iter(StatefulDataLoader(dataset, batch_size=None, num_workers=0)))
    dataset = skt.ShardkitIterableDataset(sources, weights={"s0": 3, "s1": 1}, reweight=True, **kw)
    dataset.load_state_dict(skt.job_state(saved))
    after = [i for b in StatefulDataLoader(dataset, batch_size=None, num_workers=3) for i in items(b)]
    # samples_per_epoch (the sources' rows) but what does not divide among the 3 new shards ("drop"; a
    # mixture reads those positions first in the next epoch)
    assert 100 - 2 <= len(before) + len(after) <= 100
    assert sum(read_counts(after, 0).values()) / len(after) >= 0.7  # read at 3:1 (the cut's holes first)
    for source, rows in ((0, 50), (1, 50)):
        counts = read_counts(before + after, source)
        full = sum(counts.values()) // rows
        ids = range(source * OFFSET, source * OFFSET + rows)
        assert all(full <= counts.get(i, 0) <= full + 1 for i in ids)


def test_a_ramp_resumed_on_fewer_shards_reads_the_uninterrupted_stream(tmp_path: Path) -> None:
    """A linear ramp over several steps (`RAMP_STEP`): 3 shards stopped inside it and 2 resumed read what
    one shard reads without a stop."""
    sources = write_sources(tmp_path, [[40, 30], [50]])
    weights = {"s0": [(0, 4), (3 * RAMP_STEP, 1)], "s1": 1}
    kw: dict[str, Any] = {"samples_per_epoch": 4 * RAMP_STEP, "batch_size": 64, "seed": 1, "num_epochs": 1,
                          "remainder": "uneven"}
    whole = [i for b in open_shards(sources, 1, weights=weights, **kw)[0] for i in items(b)]
    readers = open_shards(sources, 3, weights=weights, **kw)
    its = [iter(r) for r in readers]
    seen = [i for _ in range(9) for it in its for i in items(next(it))]
    state = readers[0].state_dict()
    for r in open_shards(sources, 2, weights=weights, **kw):
        r.load_state_dict(state)
        seen += [i for b in r for i in items(b)]
    assert Counter(seen) == Counter(whole)
    first = Counter(s for s, _ in whole[:RAMP_STEP])
    last = Counter(s for s, _ in whole[3 * RAMP_STEP:])
    assert first[0] > 3 * first[1] - 30
    assert abs(last[0] - last[1]) <= 1


def test_a_state_saved_before_schedules_resumes(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[5, 5], [4]])
    kw: dict[str, Any] = {"weights": {"s0": 3, "s1": 1}, "batch_size": 2, "seed": 3, "num_epochs": 1}
    reader = open_shards(sources, 1, **kw)[0]
    it = iter(reader)
    next(it)
    state = reader.state_dict()
    rest = [items(b) for b in it]
    legacy = {k: v for k, v in state.items() if k != "schedule"}
    legacy["fingerprint"] = open_shards(sources, 1, **kw)[0]._fingerprint(state["shares"])
    resumed = open_shards(sources, 1, **kw)[0]
    resumed.load_state_dict(legacy)
    assert [items(b) for b in resumed] == rest


# ---- bad input ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("weights", "words"), [
    ({"s0": [(0, 1), (100, -2)], "s1": 1}, ["weights['s0'][1] weight=-2", "negative"]),
    ({"s0": [(0, 1), (100, 0)], "s1": [(0, 1), (100, 0)]}, ["all zero at 100 samples", "positive weight"]),
    ({"s0": {"steps": [(0, 0), (50, 1)]}, "s1": 0}, ["all zero at 0 samples"]),
    ({"s0": [(0, 1), (100, 2), (100, 3)], "s1": 1}, ["weights['s0'][2] is at 100", "increase strictly"]),
    ({"s0": [(50, 1), (10, 2)], "s1": 1}, ["weights['s0'][1] is at 10", "increase strictly"]),
    ({"s0": [(0, 1), (1.5, 2)], "s1": 1}, ["weights['s0'][1] has samples=1.5", "int >= 0"]),
    ({"s0": [(0, 1), (-5, 2)], "s1": 1}, ["samples=-5"]),
    ({"s0": [(0, 1, 2)], "s1": 1}, ["weights['s0'][0]=(0, 1, 2)", "not a (samples, weight) pair"]),
    ({"s0": [], "s1": 1}, ["weights['s0']=[]", "not a schedule"]),
    ({"s0": {"ramp": [(0, 1)]}, "s1": 1}, ["'linear' or 'steps'"]),
    ({"s0": [(0, 1), (100, 2)]}, ["no weight for the source(s) ['s1']"]),
    ({"s0": lambda n: 1, "s1": 1}, ["is the function", "WeightSchedule.sampled"]),
])
def test_bad_schedules_are_refused_naming_the_value_and_the_fix(weights: dict[str, Any],
                                                                words: list[str]) -> None:
    with pytest.raises(ReaderError) as e:
        check_weights(weights, ["s0", "s1"])
    for w in words:
        assert w in str(e.value)


def test_a_weight_function_that_gives_two_values_at_one_point_is_refused() -> None:
    calls = iter(range(1000))
    with pytest.raises(ReaderError, match=r"gave 0 and then 1 at 0 samples.*one value per point"):
        WeightSchedule.sampled(lambda n: next(calls), stop=100)
    with pytest.raises(ReaderError, match="stop >= count >= 1"):
        WeightSchedule.sampled(lambda n: 1, stop=0)
    with pytest.raises(ReaderError, match="kind='cosine'"):
        WeightSchedule([(0, 1)], kind="cosine")  # type: ignore[arg-type]


def test_a_state_of_another_schedule_is_refused_unless_reweighted(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[5, 5], [4]])
    kw: dict[str, Any] = {"batch_size": 2, "samples_per_epoch": 20}
    reader = open_shards(sources, 1, weights={"s0": [(0, 1), (10, 3)], "s1": 1}, **kw)[0]
    next(iter(reader))
    state = reader.state_dict()
    for other in ({"s0": [(0, 1), (12, 3)], "s1": 1}, {"s0": 1, "s1": 1},
                  {"s0": {"steps": [(0, 1), (10, 3)]}, "s1": 1}):
        with pytest.raises(ReaderError, match=r"saved with the weights .*reweight=True"):
            open_shards(sources, 1, weights=other, **kw)[0].load_state_dict(state)
    same = open_shards(sources, 2, weights={"s0": [(0, 2), (10, 6)], "s1": 2}, **kw)[0]
    with pytest.raises(ReaderError, match="reweight=True"):  # a schedule is compared as written
        same.load_state_dict(state)
    scaled = open_shards(sources, 2, weights={"s0": 6, "s1": 2}, **kw)[0]
    constant = open_shards(sources, 2, weights={"s0": 3, "s1": 1}, **kw)[0]
    constant.load_state_dict(json.loads(json.dumps(scaled.state_dict())))  # 6:2 and 3:1: one stream
    broken = {**state, "schedule": [{"start": 0}]}
    with pytest.raises(ReaderError, match="malformed"):
        open_shards(sources, 1, weights={"s0": [(0, 1), (10, 3)], "s1": 1}, **kw)[0].load_state_dict(broken)


# ---- the job config and the command line ------------------------------------------------------------------

def test_a_job_config_takes_schedules_and_the_reader_reads_them(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[5, 5], [4]])
    data = DataConfig.model_validate({
        "sources": {"s0": {"url": sources["s0"], "weight": [[0, 3], [1000, 1]]},
                    "s1": {"url": sources["s1"], "weight": {"steps": [[0, 1], [500, 2]]}}},
        "samples_per_epoch": 30, "batch_size": 4})
    kwargs = data.reader_kwargs()
    assert kwargs["weights"] == {"s0": [[0, 3], [1000, 1]], "s1": {"steps": [[0, 1], [500, 2]]}}
    with shardkit.make_reader(kwargs.pop("url"), **kwargs) as reader:
        assert reader.mixture.plan.schedules[1].kind == "steps"
        assert sum(len(b["id"]) for b in reader) == 30


@pytest.mark.parametrize(("weight", "other", "words"), [
    ([[0, 3], [0, 1]], 1, ["sources.s0.weight.1.0", "must increase"]),
    ([[0, -1]], 1, ["sources.s0.weight.0.1", "negative"]),
    ({"cosine": [[0, 1]]}, 1, ["sources.s0.weight", "linear or steps"]),
    ([[0, 1], [10, 0]], 0, ["every source's weight is 0 at 10 samples"]),
    ([[0.5, 1]], 1, ["sources.s0.weight.0.0", "int >= 0"]),
])
def test_a_job_config_refuses_bad_schedules_with_the_key_path(tmp_path: Path, weight: Any, other: Any,
                                                              words: list[str]) -> None:
    from shardkit.job.config import load_config

    config = tmp_path / "job.yaml"
    config.write_text(json.dumps({
        "entrypoint": "train.py", "framework": "torch",
        "roles": {"worker": {"count": 1}},
        "data": {"sources": {"s0": {"url": "s3://lake/a", "weight": weight},
                             "s1": {"url": "s3://lake/b", "weight": other}}}}))
    (tmp_path / "train.py").write_text("")
    with pytest.raises(shardkit.errors.ConfigError) as e:
        load_config(config)
    for w in words:
        assert w in str(e.value)


def test_inspect_prints_the_shares_along_a_schedule(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from shardkit.cli import main

    sources = write_sources(tmp_path, [[50, 50], [30]])
    weights = json.dumps({"web": [[0, 3], [1_000_000, 1]], "code": 1})
    args = ["inspect", f"web={sources['s0']}", f"code={sources['s1']}", "--weights", weights]
    assert main([*args, "--at", "0,1_000_000"]) == 0
    out = capsys.readouterr().out
    assert "0:3 -> 1000000:1" in out
    assert "shares along the schedule" in out
    assert "1,000,000  50.00%" in out
    assert main([*args, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    points = info["mixture"]["shares_at"]
    assert [p["samples"] for p in points] == [0, 1_000_000]
    assert math.isclose(points[0]["shares"]["web"], 0.75)
