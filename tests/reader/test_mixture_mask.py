"""``remainder="mask"`` on a mixture: every position of the epoch's stream exactly once, through resizes.

Real mixtures of real Parquet sources, their shards stepped together as ranks are, stopped and resumed on
other shard counts (1..16) several times within an epoch, at constant weights and on a schedule: the valid
rows of all shards are the epoch's positions of the mixed stream, each once, and nothing goes on to the
next epoch; every shard steps the same batches, each of ``batch_size`` rows with the mask. DataLoader
workers resumed on another layout through `shardkit.torch.job_state` do the same.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.errors import ReaderError
from shardkit.reader import SOURCE
from shardkit.reader._plan import stage_steps
from tests.reader.test_mixture import (  # the autouse fixture closes the readers each test makes
    OFFSET,
    Item,
    _readers_closed,  # noqa: F401
    items,
    open_shards,
    stream_reference,
    write_sources,
)
from tests.reader.test_mixture_schedule import stream_of
from tests.reader.test_remainder_mask import step_together

VALID = "__valid__"
_SETTINGS: dict[str, Any] = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


def valid_items(batch: Mapping[str, Any], batch_size: int) -> list[Item]:
    """The samples of a batch, after checking its shape: ``batch_size`` rows, samples first, then masked
    rows, each masked row a copy of a row of the data (its ``__source__`` and values agree)."""
    valid = np.asarray(batch[VALID])
    assert valid.dtype == np.bool_
    assert len(valid) == len(batch["id"]) == len(batch[SOURCE]) == batch_size
    assert (np.diff(valid.astype(np.int8)) <= 0).all(), "samples first, then masked rows"
    assert np.array_equal(np.asarray(batch["id"]) // OFFSET, batch[SOURCE])
    assert np.array_equal(batch["x"], (np.asarray(batch["id"]) / 2).astype(np.float32))
    return [i for i, v in zip(items(batch), valid.tolist(), strict=True) if v]


@st.composite
def weights_of(draw: st.DrawFn, n: int, top: int) -> list[Any]:
    """Constant weights, or a schedule in steps within ``top`` samples (some source positive at 0)."""
    if draw(st.booleans()):
        return draw(st.lists(st.integers(0, 4), min_size=n, max_size=n).filter(any))
    out: list[Any] = []
    for _ in range(n):
        xs = sorted(draw(st.sets(st.integers(0, top), min_size=1, max_size=3)))
        out.append({"steps": [(x, draw(st.integers(1, 4))) for x in xs]})
    return out


@st.composite
def jobs(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 3))
    samples = draw(st.integers(1, 60))
    worlds = st.one_of(st.integers(1, 4), st.integers(1, 16))
    return {
        "layouts": [draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)) for _ in range(n)],
        "weights": draw(weights_of(n, 2 * samples)),
        "samples": samples,
        "batch_size": draw(st.integers(1, 7)),
        "stages": draw(st.lists(st.tuples(worlds, st.floats(0, 0.9)), max_size=3)),
        "final": draw(worlds),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
        "small_blocks": draw(st.booleans()),
    }


def epoch_reference(sources: Mapping[str, str], weights: Mapping[str, Any], samples: int, *, seed: int,
                    shuffle: bool) -> list[Item]:
    """The items of the stream's first ``samples`` positions (epoch 0 of an unmasked mixture that leaves
    nothing out), made without a mixture."""
    stream, _ = stream_of(weights)
    return stream_reference(sources, stream.sources(0, samples).tolist(), seed=seed, shuffle=shuffle)


def run_job(sources: Mapping[str, str], job: Mapping[str, Any], weights: Mapping[str, Any]
            ) -> tuple[list[Item], dict[str, Any]]:
    """Epoch 0 read in the job's stages (each resumed from the JSON state of one shard of the stage
    before), the last one to the epoch's end: the valid items of all shards, and the last state."""
    samples, b = job["samples"], job["batch_size"]
    kw = {"weights": weights, "samples_per_epoch": samples, "batch_size": b, "remainder": "mask",
          "shuffle": job["shuffle"], "seed": job["seed"], "num_epochs": 2}
    seen: list[Item] = []
    state: dict[str, Any] | None = None
    for i, (world, fraction) in enumerate([*job["stages"], (job["final"], None)]):
        if state is not None and state["epoch"] == 1:
            break  # the epoch ended in an earlier stage
        readers = open_shards(sources, min(world, samples), small_blocks=job["small_blocks"], **kw)
        try:
            for r in readers:
                if state is not None:
                    r.load_state_dict(state)
            if state is None:
                assert len({len(r) for r in readers}) == 1, "shards of one epoch step alike"
            history = [tuple(s) for s in readers[0].state_dict()["history"]]
            steps = stage_steps(samples, num_shards=len(readers), history=history, remainder="mask",
                                batch_size=b)
            taken = step_together(readers, None if fraction is None else int(fraction * steps), b, seen,
                                  valid_items)
            if fraction is None:
                assert taken == steps
            states = [r.state_dict() for r in readers]
            assert all(s == states[0] for s in states), "shards disagree on the position"
            state = json.loads(json.dumps(states[i % len(states)]))
        finally:
            for r in readers:
                r.close()
    assert state is not None
    return seen, state


@settings(max_examples=50, **_SETTINGS)
@given(job=jobs())
@example(job={"layouts": [[5, 4], [3]], "weights": [2, 1], "samples": 9, "batch_size": 2,  # pieces 5, 4
              "stages": [], "final": 2, "shuffle": True, "seed": 1, "small_blocks": False})
@example(job={"layouts": [[4], [6]], "weights": [{"steps": [(0, 1), (6, 3)]}, 1], "samples": 13,
              "batch_size": 3, "stages": [(3, 0.5), (16, 0.5)], "final": 5, "shuffle": False, "seed": 2,
              "small_blocks": True})  # 16 shards on the few samples left: empty pieces
def test_the_valid_rows_of_all_shards_are_every_position_of_the_epoch_once(job: dict[str, Any]) -> None:
    """Stopped after some steps and resumed from a shard's state on another number of shards (several
    times), then read to the epoch's end: the valid rows are the unmasked mixture's epoch, each position
    once; every shard steps the stage's batches; and the next epoch starts past the epoch, nothing
    carried over."""
    with tempfile.TemporaryDirectory() as tmp:
        sources = write_sources(Path(tmp), job["layouts"])
        weights = dict(zip(sources, job["weights"], strict=True))
        seen, state = run_job(sources, job, weights)
        want = epoch_reference(sources, weights, job["samples"], seed=job["seed"], shuffle=job["shuffle"])
    assert Counter(seen) == Counter(want), (f"{Counter(seen) - Counter(want)} twice, "
                                            f"{Counter(want) - Counter(seen)} never")
    assert state["epoch"] == 1
    assert state["history"] == []
    assert state["start"] == {"epoch": 1, "fresh": job["samples"], "carry": []}


def test_every_epoch_is_the_next_run_of_the_stream_in_equal_full_steps(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[7, 5], [4, 4]])
    weights = {"s0": 2, "s1": 1}
    readers = open_shards(sources, 4, weights=weights, samples_per_epoch=30, batch_size=4, remainder="mask",
                          num_epochs=2, seed=3)
    seen: list[Item] = []
    for _ in range(2):
        assert step_together(readers, None, 4, seen, valid_items) == len(readers[0]) == 2  # pieces 8, 8, 7, 7
    stream, _ = stream_of(weights)
    assert Counter(seen) == Counter(stream_reference(sources, stream.sources(0, 60).tolist(), seed=3,
                                                     shuffle=True))
    assert all(r.state_dict()["epoch"] == 2 for r in readers)


def test_a_shard_one_batch_short_steps_a_batch_of_masked_copies_of_the_first_sources_first_row(
        tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[5, 4], [3]])
    readers = open_shards(sources, 2, weights={"s0": 2, "s1": 1}, samples_per_epoch=9, batch_size=2,
                          remainder="mask", seed=1)
    batches = [list(r) for r in readers]
    assert [[int(b[VALID].sum()) for b in shard] for shard in batches] == [[2, 2, 1], [2, 2, 0]]
    last = batches[1][-1]
    assert last["id"].tolist() == [0, 0]  # s0's first row: id 0
    assert last[SOURCE].tolist() == [0, 0]
    partial = batches[0][-1]
    assert partial["id"][1] == partial["id"][0]
    assert partial[SOURCE][1] == partial[SOURCE][0]


@pytest.mark.parametrize("stop", [0, 1, 2, 3])
def test_a_resume_on_as_many_shards_yields_what_the_uninterrupted_reader_does(tmp_path: Path,
                                                                              stop: int) -> None:
    """The same batches, masked rows included (their row does not depend on where the reader started)."""
    sources = write_sources(tmp_path, [[9, 9], [5]])
    kw: dict[str, Any] = {"weights": {"s0": 3, "s1": 1}, "samples_per_epoch": 17, "batch_size": 3,
                          "remainder": "mask", "seed": 8, "num_shards": 3}  # pieces 6, 6, 5

    def seen(batches: Any) -> list[tuple[list[Item], list[bool]]]:
        return [(items(b), b[VALID].tolist()) for b in batches]

    for shard in range(3):
        with shardkit.make_reader(sources, shard=shard, **kw) as whole:
            expected = seen(whole)
        with shardkit.make_reader(sources, shard=shard, **kw) as first:
            it = iter(first)
            got = seen(next(it) for _ in range(min(stop, len(expected))))
            state = json.loads(json.dumps(first.state_dict()))
        with shardkit.make_reader(sources, shard=shard, **kw) as second:
            second.load_state_dict(state)
            got += seen(second)
        assert got == expected, shard


def test_a_resume_on_another_number_of_shards_mid_epoch_reads_the_rest_once(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[9, 9], [5]])
    weights = {"s0": [(0, 1), (20, 3)], "s1": 1}
    job = {"layouts": [], "samples": 41, "batch_size": 4, "stages": [(3, 0.5)], "final": 7,
           "shuffle": True, "seed": 5, "small_blocks": False}
    seen, state = run_job(sources, job, weights)
    assert Counter(seen) == Counter(epoch_reference(sources, weights, 41, seed=5, shuffle=True))
    assert state["start"]["carry"] == []


def test_rows_leave_the_masked_rows_out(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[6], [5]])
    got: list[Item] = []
    for shard in range(4):
        with shardkit.make_reader(sources, shard=shard, num_shards=4, batch_size=2, samples_per_epoch=11,
                                  remainder="mask", num_epochs=1) as r:
            rows = list(r.rows())
            assert all(set(row) == {"id", "x", SOURCE} for row in rows)
            got += [(int(row[SOURCE]), int(row["id"])) for row in rows]
    assert len(got) == len(set(got)) == 11


# ---- DataLoader workers ---------------------------------------------------------------------------

def _worker_job(sources: Mapping[str, str], world: int, workers: int, state: Any, steps: int | None,
                batch_size: int) -> tuple[list[list[Item]], list[dict[str, Any]]]:
    """A job of ``world`` ranks x ``workers`` DataLoader workers, each worker a `ShardkitIterableDataset`
    in this process (shard ``rank * workers + worker``, as `tests.reader.test_worker_resume` does),
    resumed from ``state``; each rank takes ``steps`` batches from its workers in turn (None: all)."""
    import shardkit.torch as skt

    shards = world * workers
    read, states = [], []
    for rank in range(world):
        datasets = [skt.ShardkitIterableDataset(sources, rank=rank * workers + w, world_size=shards,
                                                batch_size=batch_size, weights={"s0": 2, "s1": 1},
                                                samples_per_epoch=53, remainder="mask", seed=3, workers=1)
                    for w in range(workers)]
        for ds in datasets:
            if state is not None:
                ds.load_state_dict(state)
        iters = [iter(ds) for ds in datasets]
        live, got, turn, taken = list(range(workers)), [], 0, 0
        while live and (steps is None or taken < steps):
            w = live[turn % len(live)]
            batch = next(iters[w], None)
            if batch is None:
                live.remove(w)
                continue
            assert len(batch[VALID]) == batch_size
            got += valid_items({k: v.numpy() for k, v in batch.items()}, batch_size)
            turn += 1
            taken += 1
        read.append(got)
        states += [{**ds.state_dict(), "rank": rank, "world_size": world, "num_workers": workers, "worker": w}
                   for w, ds in enumerate(datasets)]
    return read, states


@pytest.mark.timeout(120)
@settings(max_examples=6, **_SETTINGS)
@given(layouts=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=2, max_size=3),
       cuts=st.lists(st.floats(0, 1, exclude_max=True), min_size=2, max_size=2))
def test_dataloader_workers_resumed_on_another_layout_read_every_position_once(
        layouts: list[tuple[int, int]], cuts: list[float]) -> None:
    """`shardkit.torch.job_state` of the workers' states (some a batch ahead of others) resumes a mixture
    with ``"mask"`` on another world size and worker count: the valid rows of all the jobs are the epoch's
    positions, each once."""
    pytest.importorskip("torch")
    import shardkit.torch as skt

    with tempfile.TemporaryDirectory() as tmp:
        sources = write_sources(Path(tmp), [[9, 9, 7], [6, 5]])
        seen: list[Item] = []
        state: Any = None
        for i, (world, workers) in enumerate(layouts):
            if state is not None and state["epoch"] == 1:
                break  # every worker finished the epoch in an earlier job
            last = i == len(layouts) - 1
            steps = None if last else int(cuts[i] * workers * 3)
            read, states = _worker_job(sources, world, workers, state, steps, 4)
            seen += [item for rank in read for item in rank]
            state = skt.job_state(states)
        stream, _ = stream_of({"s0": 2, "s1": 1})
        want = stream_reference(sources, stream.sources(0, 53).tolist(), seed=3, shuffle=True)
    assert Counter(seen) == Counter(want), (f"{Counter(seen) - Counter(want)} twice, "
                                            f"{Counter(want) - Counter(seen)} never")


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's, not ours
@pytest.mark.usefixtures("reap")
def test_a_stateful_dataloader_over_a_mixture_resumes_on_another_layout(tmp_path: Path) -> None:
    """Real DataLoader worker processes: 2 workers stop after 3 batches (one worker a batch ahead), and
    the job goes on in the main process (``num_workers=0``) from `job_state`."""
    pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    import shardkit.torch as skt

    sources = write_sources(tmp_path, [[9, 9, 7], [6, 5]])
    kw: dict[str, Any] = {"batch_size": 4, "weights": {"s0": 2, "s1": 1}, "samples_per_epoch": 53,
                          "remainder": "mask", "seed": 3, "workers": 1}

    def valid(batch: Mapping[str, Any]) -> list[Item]:
        return valid_items({k: v.numpy() for k, v in batch.items()}, 4)

    dl = stateful.StatefulDataLoader(skt.ShardkitIterableDataset(sources, rank=0, world_size=1, **kw),
                                     batch_size=None, num_workers=2)
    seen = [i for b in itertools.islice(dl, 3) for i in valid(b)]
    state = skt.job_state(dl.state_dict())
    del dl
    ds = skt.ShardkitIterableDataset(sources, rank=0, world_size=1, **kw)
    ds.load_state_dict(state)
    seen += [i for b in ds for i in valid(b)]
    stream, _ = stream_of({"s0": 2, "s1": 1})
    want = stream_reference(sources, stream.sources(0, 53).tolist(), seed=3, shuffle=True)
    assert Counter(seen) == Counter(want)


# ---- bad input ------------------------------------------------------------------------------------

def test_drop_last_with_mask_is_refused_for_a_mixture(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[5], [5]])
    with pytest.raises(ReaderError, match=r"drop_last=True with remainder='mask'"):
        shardkit.make_reader(sources, remainder="mask", drop_last=True)


def test_a_source_field_named_like_the_mask_is_refused(tmp_path: Path) -> None:
    import pandas as pd

    a = str(tmp_path / "a")
    shardkit.write_dataset(pd.DataFrame({"id": np.arange(10), VALID: np.ones(10, dtype=bool)}), a)
    b = str(tmp_path / "b")
    shardkit.write_dataset(pd.DataFrame({"id": np.arange(10), VALID: np.ones(10, dtype=bool)}), b)
    with pytest.raises(ReaderError, match=rf"source 'a' of the mixture .* field named '{VALID}'.*"
                                          r"columns=\['id'\]"):
        shardkit.make_reader({"a": a, "b": b}, remainder="mask")
    with shardkit.make_reader({"a": a, "b": b}, remainder="mask", columns=["id"], batch_size=4) as r:
        assert r.schema.names == ["id", SOURCE, VALID]
    with shardkit.make_reader({"a": a, "b": b}, batch_size=4) as r:  # another remainder: an ordinary field
        assert VALID in next(iter(r))


def test_a_mask_state_does_not_resume_a_drop_mixture(tmp_path: Path) -> None:
    sources = write_sources(tmp_path, [[5], [5]])
    with shardkit.make_reader(sources, batch_size=2, remainder="mask") as r:
        next(iter(r))
        state = r.state_dict()
    with shardkit.make_reader(sources, batch_size=2) as r, pytest.raises(ReaderError, match="remainder="):
        r.load_state_dict(state)
