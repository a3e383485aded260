"""Resume with real readers: N readers step together, one rank's state goes to M readers, nothing repeats."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.errors import ReaderError
from tests.reader.datasets import assert_exactly_once, write_ids, write_layout

row_groups = st.lists(st.one_of(st.integers(1, 3), st.integers(1, 30)), min_size=1, max_size=25)


def open_readers(url: str, world: int, state: dict[str, Any] | None, **kw: Any) -> list[shardkit.Reader]:
    readers = [shardkit.make_reader(url, shard=s, num_shards=world, workers=1, prefetch=2, **kw)
               for s in range(world)]
    if state is not None:
        for r in readers:
            r.load_state_dict(state)
    return readers


def step_together(readers: list[shardkit.Reader], steps: int | None, seen: list[Counter[int]]) -> list[int]:
    """Every reader takes ``steps`` batches (None: to the end); ids go to ``seen[epoch]``. Returns the
    number of batches each reader yielded."""
    iters = [iter(r) for r in readers]
    counts = [0] * len(readers)
    step = 0
    while steps is None or step < steps:
        live = False
        for k, (reader, it) in enumerate(zip(readers, iters, strict=True)):
            batch = next(it, None)
            if batch is None:
                continue
            live = True
            counts[k] += 1
            seen[reader.epoch].update(int(i) for i in batch["id"])  # epoch moves on only after its last batch
        if not live:
            break
        step += 1
    return counts


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(state))
    assert out == state
    return out


# Row groups of more than one 256-row slice (`SLICE_ROWS`): streamed slice by slice, shared by tasks.
big_row_groups = st.lists(st.integers(1, 1200), min_size=1, max_size=4)
small_batches, small_windows = st.integers(1, 8), st.integers(1, 60)


@st.composite
def jobs(draw: st.DrawFn, layouts: st.SearchStrategy[list[int]] = row_groups,
         batch_sizes: st.SearchStrategy[int] = small_batches,
         windows: st.SearchStrategy[int] = small_windows) -> dict[str, Any]:
    layout = draw(layouts)
    n = sum(layout)
    stages = [(draw(st.integers(1, min(n, 4))), draw(st.integers(0, 12)), draw(st.integers(0, 3)))
              for _ in range(draw(st.integers(1, 3)))]  # (world, steps, rank whose state is saved)
    final = draw(st.integers(1, min(n, 4)))
    if all(w == final for w, _, _ in stages):
        final = final % min(n, 4) + 1 if min(n, 4) > 1 else final
    return {
        "layout": layout, "stages": stages, "final": final,
        "batch_size": draw(batch_sizes),
        "remainder": draw(st.sampled_from(["uneven", "drop"])),
        "shuffle": draw(st.booleans()),
        "shuffle_buffer": draw(windows),
        "seed": draw(st.integers(0, 2**31)),
        "num_epochs": draw(st.sampled_from([1, 2])),
    }


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=jobs())
def test_resume_with_other_world_sizes_reads_every_sample_once(job: dict[str, Any]) -> None:
    check_resume(job)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=jobs(big_row_groups, st.integers(16, 96), st.sampled_from([100, 700, 3000])))
def test_resume_over_row_groups_of_many_slices_reads_every_sample_once(job: dict[str, Any]) -> None:
    check_resume(job)


def check_resume(job: dict[str, Any]) -> None:
    """Run ``job``'s stages, each resumed from one rank's state of the one before, then read to the end:
    every epoch has every sample once (``uneven``) or none twice (``drop``)."""
    n = sum(job["layout"])
    kw = {k: job[k] for k in ("batch_size", "remainder", "shuffle", "shuffle_buffer", "seed", "num_epochs")}
    seen: list[Counter[int]] = [Counter() for _ in range(job["num_epochs"] + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        url = write_layout(Path(tmp) / "ds", job["layout"])
        state = None
        for world, steps, rank in job["stages"]:
            readers = open_readers(url, world, state, **kw)
            step_together(readers, steps, seen)
            # The contract: ranks that step together share one position, so every rank's state is the
            # same. With remainder="uneven" a shard that runs out first moves on to the next epoch
            # while the others finish this one, and stays a batch ahead: then no single rank's state
            # describes the job (the documented hazard of "uneven").
            assume(len({json.dumps(r.state_dict(), sort_keys=True) for r in readers}) == 1)
            state = roundtrip(readers[rank % world].state_dict())
            for r in readers:
                r.close()
        readers = open_readers(url, job["final"], state, **kw)
        counts = step_together(readers, None, seen)
        for r in readers:
            r.close()
    assert not seen[job["num_epochs"]], "read past the last epoch"
    for epoch in range(job["num_epochs"]):
        if job["remainder"] == "uneven":
            assert_exactly_once(seen[epoch].elements(), n)
        else:
            assert max(seen[epoch].values(), default=1) == 1, f"epoch {epoch}: a sample read twice"
            assert all(0 <= i < n for i in seen[epoch])
    if job["remainder"] == "drop":
        assert len(set(counts)) == 1, f"unequal batch counts after the resume: {counts}"


@pytest.fixture(scope="module")
def ids_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", 500, row_group_size=23)


def test_resume_in_the_same_world_gives_the_same_stream(ids_ds: str) -> None:
    kw: dict[str, Any] = {"batch_size": 16, "seed": 11, "shuffle_buffer": 64, "num_epochs": 2}
    with shardkit.make_reader(ids_ds, shard=1, num_shards=3, **kw) as reader:
        it = iter(reader)
        for _ in range(5):
            next(it)
        state = roundtrip(reader.state_dict())
        rest = list(it)
    with shardkit.make_reader(ids_ds, shard=1, num_shards=3, **kw) as resumed:
        resumed.load_state_dict(state)
        again = list(resumed)
    assert len(again) == len(rest)
    for a, b in zip(rest, again, strict=True):
        assert np.array_equal(a["id"], b["id"])
        assert np.array_equal(a["x"], b["x"])


def test_a_state_saved_before_the_spread_order_goes_on_in_the_order_its_epoch_started_in(ids_ds: str) -> None:
    """A state saved by shardkit before a window's row groups were spread over the dataset
    (`spread_order`; such a state has no ``order``) resumes in the plain permutation its epoch started
    in, and one saved before the quick start (``order: 2``) in the spread order without leads: the rest
    of that epoch, every sample once; it saves that order from then on. A state of an order this
    shardkit does not know, or with a malformed lead, is refused, naming it."""
    from shardkit.reader._plan import EpochOrder, piece_starts
    from tests.reader.test_plan import sample_ids_of_pi

    kw: dict[str, Any] = {"batch_size": 16, "seed": 5, "shuffle_buffer": 92}  # 4 of the 22 row groups
    with shardkit.make_reader(ids_ds, shard=0, num_shards=1, **kw) as reader:
        fresh = np.concatenate([b["id"] for b in reader])
        state = roundtrip(reader.state_dict())
        layout = reader.rows_per_group
    assert state["order"] == 3
    assert state["lead"] == [1, 16]
    n = int(layout.sum())

    def pi(order: int) -> np.ndarray:
        leads = {"starts": piece_starts(n, 1), "lead": 16} if order == 3 else {}
        return sample_ids_of_pi(EpochOrder(layout, 5, 0, True, 92, order, **leads), np.arange(n))

    np.testing.assert_array_equal(fresh, pi(3))
    for order in (1, 2):
        old = {k: v for k, v in state.items() if k not in ("order", "lead")}
        old |= {"epoch": 0, "history": [[1, 96]]}
        if order == 2:
            old["order"] = 2
        with shardkit.make_reader(ids_ds, shard=0, num_shards=1, **kw) as resumed:
            resumed.load_state_dict(old)
            rest = np.concatenate([b["id"] for b in resumed])
            assert resumed.state_dict()["order"] == order
        np.testing.assert_array_equal(rest, pi(order)[96:])
    assert len({pi(o).tobytes() for o in (1, 2, 3)}) == 3
    for bad, words in (({"order": 7}, r"order=7, which this shardkit does not know"),
                       ({"lead": [0, 16]}, r"lead=\[0, 16\] must be its epoch's first stage")):
        with shardkit.make_reader(ids_ds, shard=0, num_shards=1, **kw) as other, \
                pytest.raises(ReaderError, match=words):
            other.load_state_dict({**state, **bad})


def test_resume_across_an_epoch_boundary(ids_ds: str) -> None:
    kw: dict[str, Any] = {"batch_size": 32, "seed": 2, "shuffle_buffer": 100, "num_epochs": 3,
                          "remainder": "uneven"}
    seen: list[Counter[int]] = [Counter() for _ in range(4)]
    old = open_readers(ids_ds, 2, None, **kw)
    per_epoch = len(old[0])
    step_together(old, per_epoch + 3, seen)  # into the second epoch
    assert old[0].epoch == 1
    state = roundtrip(old[1].state_dict())
    assert state["epoch"] == 1
    new = open_readers(ids_ds, 3, state, **kw)
    step_together(new, None, seen)
    for epoch in range(3):
        assert_exactly_once(seen[epoch].elements(), 500)
    assert not seen[3]


def test_state_after_the_last_batch_points_at_the_next_epoch(ids_ds: str) -> None:
    with shardkit.make_reader(ids_ds, shard=0, num_shards=2, batch_size=100, num_epochs=2) as reader:
        it = iter(reader)
        for _ in range(len(reader)):
            next(it)
        assert reader.epoch == 0  # the generator has not moved on yet
        state = reader.state_dict()
    assert state["epoch"] == 1
    assert state["history"] == []


@pytest.mark.parametrize("remainder", ["uneven", "drop", "pad"])
def test_any_ranks_state_describes_the_job(tmp_path: Path, remainder: str) -> None:
    """Uneven shards differ by one sample: the shorter ones may end a step early, the state must not care."""
    url = write_layout(tmp_path / "ds", [5, 9, 2, 7, 8])  # 31 rows; 3 shards of 11/10/10 (uneven)
    for batch_size in (1, 2, 5, 10, 11):
        kw: dict[str, Any] = {"batch_size": batch_size, "remainder": remainder, "shuffle_buffer": 7,
                              "seed": 1}
        for steps in range(12):
            seen: list[Counter[int]] = [Counter(), Counter()]
            readers = open_readers(url, 3, None, **kw)
            step_together(readers, steps, seen)
            states = [r.state_dict() for r in readers]
            assert all(s == states[0] for s in states), (batch_size, steps, states)
            step_together(open_readers(url, 2, states[2], **kw), None, seen)
            if remainder == "uneven":
                assert_exactly_once(seen[0].elements(), 31)
            elif remainder == "drop":
                assert max(seen[0].values()) == 1


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_padded_epoch_resumes_as_it_would_have_gone_on(tmp_path: Path, shuffle: bool) -> None:
    """remainder="pad": 31 samples, 4 shards of 8 (one repeat). Resumed with 4 shards after any step,
    each shard reads what it reads uninterrupted (the last shard read other repeats before: the
    resumed stage padded anew from its own first samples)."""
    url = write_layout(tmp_path / "ds", [5, 9, 2, 7, 8])
    kw: dict[str, Any] = {"batch_size": 3, "remainder": "pad", "shuffle": shuffle, "shuffle_buffer": 7,
                          "seed": 4}
    readers = open_readers(url, 4, None, **kw)
    whole = [[b["id"].tolist() for b in r] for r in readers]
    for steps in range(1, 3):
        readers = open_readers(url, 4, None, **kw)
        step_together(readers, steps, [Counter(), Counter()])
        state = roundtrip(readers[0].state_dict())
        resumed = open_readers(url, 4, state, **kw)
        assert [[b["id"].tolist() for b in r] for r in resumed] == [w[steps:] for w in whole], steps


# ---- states that do not fit ------------------------------------------------------------------------
def test_state_of_another_dataset_seed_or_filter_is_refused(ids_ds: str, tmp_path: Path) -> None:
    def state_of(url: str, **kw: Any) -> dict[str, Any]:
        reader = shardkit.make_reader(url, batch_size=10, shuffle_buffer=50, **kw)
        next(iter(reader))
        return reader.state_dict()

    other = write_ids(tmp_path / "other", 400, row_group_size=23)
    reader = shardkit.make_reader(ids_ds, batch_size=10, shuffle_buffer=50, seed=0)
    reader.load_state_dict(state_of(ids_ds, seed=0))  # the same configuration loads
    with pytest.raises(ReaderError, match="another dataset"):
        reader.load_state_dict(state_of(other, seed=0))
    with pytest.raises(ReaderError, match="seed=1"):
        reader.load_state_dict(state_of(ids_ds, seed=1))
    with pytest.raises(ReaderError, match="another dataset or filter"):
        reader.load_state_dict(state_of(ids_ds, seed=0, filter=pc.field("label") < 5))
    with pytest.raises(ReaderError, match="remainder"):
        reader.load_state_dict(state_of(ids_ds, seed=0, remainder="uneven"))
    with pytest.raises(ReaderError, match=r"shuffle_buffer=49.*pass shuffle_buffer=49"):
        reader.load_state_dict({**state_of(ids_ds, seed=0), "shuffle_buffer": 49})
    filtered = shardkit.make_reader(ids_ds, batch_size=10, shuffle_buffer=50, filter=pc.field("label") < 5)
    filtered.load_state_dict(state_of(ids_ds, seed=0, filter=pc.field("label") < 5))
    with pytest.raises(ReaderError, match="another dataset or filter"):
        filtered.load_state_dict(state_of(ids_ds, seed=0, filter=pc.field("label") < 6))


def test_a_state_of_a_bigger_stage_is_refused(ids_ds: str) -> None:
    reader = shardkit.make_reader(ids_ds, batch_size=10, shuffle_buffer=50)
    state = {**reader.state_dict(), "history": [[2, 251]]}  # 2 shards hold 250 each
    with pytest.raises(ReaderError, match="more than the stage holds"):
        reader.load_state_dict(state)
