"""``remainder="mask"``: every sample exactly once per epoch, through resizes, and every shard the same steps.

The plan's properties run on the pure plan (`shardkit.reader._plan`: many cases, no data); the reader's
run on real readers over real Parquet files, stepped together as ranks are, stopped and resumed on other
shard counts several times within an epoch. Mixtures: `tests.reader.test_mixture_mask`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.dataset import Dataset
from shardkit.errors import ReaderError
from shardkit.reader._plan import mask_ranges, shard_ranges, stage_steps, take, total
from tests.reader.datasets import write_ids, write_layout

VALID = "__valid__"
layouts = st.lists(st.one_of(st.integers(1, 3), st.integers(1, 40)), min_size=1, max_size=12)


def pis(ranges: list[tuple[int, int]]) -> list[int]:
    return [i for a, b in ranges for i in range(a, b)]


# ---- the plan -------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 400), b=st.integers(1, 16),
       stages=st.lists(st.tuples(st.integers(1, 16), st.floats(0, 1)), min_size=1, max_size=4),
       final=st.integers(1, 16))
@example(n=9, b=2, stages=[(4, 0.0)], final=4)            # pieces 3, 2, 2, 2: three shards one batch short
@example(n=10, b=2, stages=[(4, 0.5)], final=3)           # 2 samples left for 3 shards: one piece empty
def test_the_plan_reads_every_sample_once_in_equal_steps(n: int, b: int, stages: list[tuple[int, float]],
                                                         final: int) -> None:
    """Each stage: every shard reads its piece plus masked rows in exactly the stage's steps; the samples
    consumed across the stages (and the rest, in the last one) are every sample once."""
    history: list[tuple[int, int]] = []
    read: Counter[int] = Counter()
    for world, fraction in [*stages, (final, 1.0)]:
        k = min(world, n)
        steps = stage_steps(n, num_shards=k, history=history, remainder="mask", batch_size=b)
        pieces = [shard_ranges(n, shard=s, num_shards=k, history=history, remainder="mask", batch_size=b)
                  for s in range(k)]
        for piece in pieces:
            rows = mask_ranges(piece, start=0, steps_left=steps, batch_size=b, first=pieces[0])
            assert -(-total(rows) // b) == steps, (piece, rows, steps)  # filled up to b: one step each
            assert rows[: len(piece)] == piece
            assert set(pis(rows)) <= set(range(n))
        stepped = int(fraction * steps)
        consumed = min(stepped * b, max(total(p) for p in pieces))
        for piece in pieces:
            read.update(pis(take(piece, 0, consumed)))  # masked rows are past the piece: never consumed
        history.append((k, consumed))
    assert read == Counter(range(n)), "a sample read twice or never"


# ---- real readers ---------------------------------------------------------------------------------
def open_readers(ds: Dataset, world: int, state: dict[str, Any] | None, **kw: Any) -> list[shardkit.Reader]:
    readers = [shardkit.make_reader(ds, shard=s, num_shards=world, remainder="mask", workers=1, prefetch=2,
                                    **kw) for s in range(world)]
    for r in readers:
        if state is not None:
            r.load_state_dict(state)
    return readers


def valid_ids(batch: Mapping[str, Any], batch_size: int) -> list[int]:
    """The ids of a batch's samples, after checking its shape: ``batch_size`` rows with the mask, samples
    first, then masked rows."""
    assert batch[VALID].dtype == np.bool_
    assert len(batch[VALID]) == len(batch["id"]) == batch_size
    assert (np.diff(batch[VALID].astype(np.int8)) <= 0).all(), "samples first, then masked rows"
    return [int(i) for i in batch["id"][batch[VALID]]]


def step_together(readers: list[shardkit.Reader], steps: int | None, batch_size: int, seen: list[Any],
                  samples: Callable[[Mapping[str, Any], int], list[Any]] = valid_ids) -> int:
    """Every reader takes ``steps`` batches of the current epoch (None: to its end); ``samples(batch,
    batch_size)`` of each batch (default: its valid ids, its shape checked) go to ``seen``. Returns the
    steps taken (the same for every reader)."""
    iters = [r.iter_epoch() for r in readers]
    taken = 0
    while steps is None or taken < steps:
        batches = [next(it, None) for it in iters]
        if all(batch is None for batch in batches):
            break
        assert all(batch is not None for batch in batches), "shards ran different numbers of steps"
        for batch in batches:
            assert batch is not None
            seen += samples(batch, batch_size)
        taken += 1
    for it in iters:
        it.close()  # type: ignore[attr-defined]
    return taken


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=layouts, b=st.integers(1, 8), shuffle=st.booleans(), window=st.integers(1, 64),
       stages=st.lists(st.tuples(st.integers(1, 16), st.floats(0, 0.9)), min_size=0, max_size=3),
       final=st.integers(1, 16))
@example(rows=[9], b=2, shuffle=False, window=4, stages=[], final=4)
@example(rows=[4, 6], b=2, shuffle=True, window=3, stages=[(4, 0.5)], final=3)
def test_readers_resized_within_an_epoch_read_every_sample_once(rows: list[int], b: int, shuffle: bool,
                                                                 window: int, stages: list[tuple[int, float]],
                                                                 final: int) -> None:
    """Stopped after some steps, rank 0's state loaded by readers of another shard count (several times),
    then read to the epoch's end: the valid rows are every sample once, every batch has ``batch_size``
    rows and the mask, and all shards step alike (each stage, and ``len`` per epoch)."""
    n = sum(rows)
    with tempfile.TemporaryDirectory() as tmp:
        ds = shardkit.open_dataset(write_layout(Path(tmp) / "ds", rows))
        kw = {"batch_size": b, "shuffle": shuffle, "shuffle_buffer": window, "seed": 3}
        seen: list[int] = []
        state: dict[str, Any] | None = None
        for world, fraction in [*stages, (final, None)]:
            if state is not None and state["epoch"] == 1:
                break  # the epoch ended in an earlier stage
            readers = open_readers(ds, min(world, n), state, **kw)
            try:
                if state is None:
                    assert len({len(r) for r in readers}) == 1
                stage = stage_steps(n, num_shards=len(readers), history=readers[0].state_dict()["history"],
                                    remainder="mask", batch_size=b)
                step_together(readers, None if fraction is None else int(fraction * stage), b, seen)
                states = [r.state_dict() for r in readers]
                assert all(s == states[0] for s in states), "ranks disagree on the position"
                state = states[0]
            finally:
                for r in readers:
                    r.close()
        assert state is not None
        assert state["epoch"] == 1
        assert state["history"] == []
        assert sorted(seen) == list(range(n)), f"{Counter(seen) - Counter(range(n))} twice, " \
            f"{sorted(set(range(n)) - set(seen))} never"


def test_every_epoch_reads_every_sample_once_in_equal_steps(tmp_path: Path) -> None:
    ds = shardkit.open_dataset(write_layout(tmp_path / "ds", [5, 17, 3, 9]))  # 34 samples
    readers = open_readers(ds, 4, None, batch_size=4, num_epochs=2, seed=1)
    for epoch in range(2):
        seen: list[int] = []
        assert step_together(readers, None, 4, seen) == len(readers[0]) == 3  # pieces 9, 9, 8, 8
        assert sorted(seen) == list(range(34)), epoch
    assert all(r.state_dict()["epoch"] == 2 for r in readers)


def test_the_same_seed_gives_the_same_batches_masks_included(tmp_path: Path) -> None:
    ds = shardkit.open_dataset(write_layout(tmp_path / "ds", [7, 3, 11, 5]))

    def batches(seed: int) -> list[tuple[list[int], list[bool]]]:
        with shardkit.make_reader(ds, shard=2, num_shards=3, batch_size=4, remainder="mask", seed=seed,
                                  shuffle_buffer=6) as r:
            return [(b["id"].tolist(), b[VALID].tolist()) for b in r]

    first = batches(5)
    assert first == batches(5)
    assert first != batches(6)
    assert [sum(v) for _, v in first] == [4, 4, 0]  # pieces 9, 9, 8: shard 2's last batch is all masked


def samples_and_masks(batches: Any) -> list[tuple[list[int], list[bool]]]:
    """Each batch's samples (its valid ids) and its mask: what a masked loss sees of it."""
    return [(b["id"][b[VALID]].tolist(), b[VALID].tolist()) for b in batches]


@pytest.mark.parametrize("stop", [0, 1, 2])
def test_a_resume_on_as_many_shards_yields_what_the_uninterrupted_reader_does(tmp_path: Path,
                                                                              stop: int) -> None:
    """The same samples and masks, batch by batch. The values of masked rows may differ: a stage of fewer
    samples than shards fills an empty piece's batch from another piece's sample."""
    ds = shardkit.open_dataset(write_layout(tmp_path / "ds", [7, 3, 11, 5]))  # 26 samples, 3 steps of 4
    kw = {"batch_size": 4, "shuffle_buffer": 5}
    for shard in range(3):
        with shardkit.make_reader(ds, shard=shard, num_shards=3, remainder="mask", **kw) as whole:
            expected = samples_and_masks(whole)
        with shardkit.make_reader(ds, shard=shard, num_shards=3, remainder="mask", **kw) as first:
            it = iter(first)
            got = samples_and_masks(next(it) for _ in range(stop))
            state = first.state_dict()
        with shardkit.make_reader(ds, shard=shard, num_shards=3, remainder="mask", **kw) as second:
            second.load_state_dict(state)
            got += samples_and_masks(second)
        assert got == expected, shard


def test_rows_leaves_the_masked_rows_out(tmp_path: Path) -> None:
    ds = shardkit.open_dataset(write_layout(tmp_path / "ds", [10]))
    ids = []
    for shard in range(4):
        with shardkit.make_reader(ds, shard=shard, num_shards=4, batch_size=2, remainder="mask") as r:
            rows = list(r.rows())
            assert all(set(row) == {"id"} for row in rows)
            ids += [int(row["id"]) for row in rows]
    assert sorted(ids) == list(range(10))


def test_a_transform_sees_no_mask_and_batches_get_it(tmp_path: Path) -> None:
    url = write_ids(tmp_path / "ds", 10, row_group_size=4)

    def double(sample: dict[str, Any]) -> dict[str, Any]:
        assert VALID not in sample
        return {"id": sample["id"], "twice": sample["id"] * 2}

    with shardkit.make_reader(url, shard=1, num_shards=3, batch_size=2, remainder="mask",
                              transform=double) as r:
        assert r.schema.names == ["id", "twice", VALID]
        batches = list(r)
    assert [b[VALID].tolist() for b in batches] == [[True, True], [True, False]]  # pieces 4, 3, 3
    assert all((b["twice"] == b["id"] * 2).all() for b in batches)


def test_samples_a_transform_leaves_out_become_masked_rows(tmp_path: Path) -> None:
    """``on_error="skip"`` leaves a sample whose transform raises out of its batch: the batch keeps its
    ``batch_size`` rows, the missing ones masked."""
    url = write_ids(tmp_path / "ds", 10, row_group_size=4)

    def fail(sample: dict[str, Any]) -> dict[str, Any]:
        if int(sample["id"]) in (5, 9):
            raise ValueError("bad sample")
        return {"id": sample["id"]}

    with pytest.warns(UserWarning, match="on_error='skip'"), \
            shardkit.make_reader(url, batch_size=4, shuffle=False, remainder="mask", transform=fail,
                                 on_error="skip") as r:
        batches = [(b["id"][b[VALID]].tolist(), len(b[VALID]), len(b["id"])) for b in r]
    assert batches == [([0, 1, 2, 3], 4, 4), ([4, 6, 7], 4, 4), ([8], 4, 4)]


# ---- adapters -------------------------------------------------------------------------------------
def test_torch_gets_a_bool_tensor(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import shardkit.torch

    url = write_ids(tmp_path / "ds", 50, row_group_size=7)
    with shardkit.torch.make_loader(url, shard=1, num_shards=3, batch_size=8, remainder="mask",
                                    columns=["id", "label"]) as loader:
        batches = list(loader)
    assert len(batches) == 3  # pieces 17, 17, 16
    for batch in batches:
        assert batch[VALID].dtype == torch.bool
        assert tuple(batch[VALID].shape) == (8,)
    last = batches[-1]
    assert int(last[VALID].sum()) == 1
    per_sample_loss = last["id"].float()
    loss = (per_sample_loss * last[VALID]).sum() / last[VALID].sum().clamp(min=1)
    assert float(loss) == float(last["id"][0])


@pytest.mark.tf
def test_tensorflow_gets_a_bool_tensor_and_keras_a_sample_weight(tmp_path: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    import shardkit.tf

    url = write_ids(tmp_path / "ds", 50, row_group_size=7)
    ds = shardkit.tf.make_dataset(url, shard=1, num_shards=3, batch_size=8, remainder="mask",
                                  columns=["id", "label"])
    assert ds.element_spec[VALID] == tf.TensorSpec((None,), tf.bool)
    assert [int(b[VALID].numpy().sum()) for b in ds] == [8, 8, 1]
    pairs = shardkit.tf.make_dataset(url, shard=1, num_shards=3, batch_size=8, remainder="mask",
                                     features="x", label="label")
    weights = [w.numpy().tolist() for _, _, w in pairs]
    assert weights[-1] == [1.0] + [0.0] * 7
    with pytest.raises(shardkit.errors.AdapterError, match="__valid__"):
        shardkit.tf.make_dataset(url, batch_size=8, remainder="mask", features="x")


def test_jax_gets_a_bool_array(tmp_path: Path) -> None:
    """In a child process: jax's threads must not be running in this one when later tests fork."""
    pytest.importorskip("jax")
    url = write_ids(tmp_path / "ds", 50, row_group_size=7)
    code = (
        "import shardkit.jax, jax, numpy as np\n"
        f"with shardkit.jax.make_loader({str(url)!r}, shard=1, num_shards=3, batch_size=8, remainder='mask',"
        " columns=['id', 'label']) as loader:\n"
        "    batches = list(loader)\n"
        "v = batches[-1]['__valid__']\n"
        "assert isinstance(v, jax.Array) and v.dtype == np.bool_ and v.shape == (8,), v\n"
        "print([int(b['__valid__'].sum()) for b in batches])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[8, 8, 1]"


# ---- bad input ------------------------------------------------------------------------------------
def test_drop_last_with_mask_is_refused(tmp_path: Path) -> None:
    url = write_ids(tmp_path / "ds", 20)
    with pytest.raises(ReaderError, match=r"drop_last=True with remainder='mask'.*leave drop_last out"):
        shardkit.make_reader(url, remainder="mask", drop_last=True)


def test_an_unknown_remainder_names_mask(tmp_path: Path) -> None:
    url = write_ids(tmp_path / "ds", 20)
    with pytest.raises(ReaderError, match=r"remainder='masked' must be .*'mask'"):
        shardkit.make_reader(url, remainder="masked")  # type: ignore[arg-type]


def test_a_field_named_like_the_mask_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    shardkit.write_dataset(pd.DataFrame({"id": np.arange(10), VALID: np.ones(10, dtype=bool)}), url)
    with pytest.raises(ReaderError, match=rf"has a field named '{VALID}'.*columns=\['id'\]"):
        shardkit.make_reader(url, remainder="mask")
    with shardkit.make_reader(url, remainder="mask", columns=["id"], batch_size=4) as r:  # left out: fine
        assert r.schema.names == ["id", VALID]
    with shardkit.make_reader(url, batch_size=4) as r:  # another remainder: an ordinary field
        assert VALID in next(iter(r))


def test_a_transform_returning_the_mask_field_is_refused(tmp_path: Path) -> None:
    url = write_ids(tmp_path / "ds", 10)

    def sneaky(sample: dict[str, Any]) -> dict[str, Any]:
        return {"id": sample["id"], VALID: True}

    with shardkit.make_reader(url, remainder="mask", transform=sneaky) as r, \
            pytest.raises(ReaderError, match=rf"transform .* returns a field named '{VALID}'"):
        _ = r.schema
    with shardkit.make_reader(url, remainder="mask", transform=sneaky) as r, \
            pytest.raises(ReaderError, match=rf"returns a field named '{VALID}'"):
        next(iter(r))


def test_a_state_saved_with_drop_does_not_resume_a_mask_reader(tmp_path: Path) -> None:
    url = write_ids(tmp_path / "ds", 20)
    with shardkit.make_reader(url, batch_size=4) as r:
        next(iter(r))
        state = r.state_dict()
    with shardkit.make_reader(url, batch_size=4, remainder="mask") as r, \
            pytest.raises(ReaderError, match="remainder='drop'"):
        r.load_state_dict(state)
