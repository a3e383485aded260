"""The transform stage (`shardkit.reader._pipeline.transform`): per-sample transforms in a thread or in
real worker processes, seeded from (seed, epoch, key), with the errors a bad transform gets."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.errors import ReaderError, TransformError
from shardkit.reader._pipeline.transform import SampleStage, sample_seeds, takes_rng

# -- transforms (module level: worker processes get them by pickle) ------------------------------------


def augment(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Draws from every generator the stage seeds, so any that is not seeded per sample shows."""
    x = sample["x"]
    return {"x": (x * rng.random() + random.random() + np.random.random()).astype(np.float32),
            "i": sample["i"], "draw": rng.integers(0, 1 << 40)}


def with_torch(sample: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {"t": torch.rand(3), "i": sample["i"]}


def plain(sample: dict[str, Any]) -> dict[str, Any]:
    return {"i": sample["i"]}


def scaled(sample: dict[str, Any], factor: int) -> dict[str, Any]:
    return {"i": sample["i"] * factor}


def raising(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["i"] % 5 == 3:
        raise ValueError(f"bad sample {sample['i']}")
    return {"i": sample["i"]}


def shape_varies(sample: dict[str, Any]) -> dict[str, Any]:
    return {"x": np.zeros(1 if sample["i"] < 6 else 2, np.float32), "i": sample["i"]}


def not_a_dict(sample: dict[str, Any]) -> Any:
    return [sample["i"]]


def hangs(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["i"] == 7:
        time.sleep(120)
    return {"i": sample["i"]}


def kills_itself(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["i"] == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"i": sample["i"]}


def slow(sample: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.2)
    return {"i": sample["i"]}


def image(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    img = sample["img"]
    top, left = rng.integers(0, 5, size=2)
    return {"img": np.ascontiguousarray(img[top : top + 8, left : left + 8][:, ::-1]), "i": sample["i"]}


def _batch(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"i": np.arange(n), "x": r.random((n, 3))}


def _where(n: int) -> list[str]:
    return [f"dataset d, row group 3, row {i}" for i in range(n)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(") ")[-1][0] != "Z"


def _pids(stage: SampleStage) -> list[int]:
    return [w.process.pid for w in stage._workers if w.process.pid is not None]


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name, values in a.items():
        assert values.dtype == b[name].dtype, name
        np.testing.assert_array_equal(values, b[name], err_msg=name)


@pytest.fixture(scope="module")
def stages() -> Iterator[dict[int, SampleStage]]:
    made = {p: SampleStage(augment, seed=11, processes=p, timeout=60, on_error="raise") for p in (0, 1, 2)}
    yield made
    for stage in made.values():
        stage.close()


# -- reproducible, whatever the processes and the cuts ------------------------------------------------


@pytest.mark.timeout(240)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 40), epoch=st.integers(0, 3), data=st.data())
def test_output_does_not_depend_on_processes_or_cuts(stages: dict[int, SampleStage], n: int, epoch: int,
                                                     data: st.DataObject) -> None:
    keys = np.array(data.draw(st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n, unique=True)))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3)) - {n})
    batch = _batch(n, seed=n)
    whole = stages[0].submit(batch, epoch, keys).result()
    assert whole["x"].shape == (n, 3)
    assert whole["draw"].shape == (n,)
    np.testing.assert_array_equal(whole["i"], np.arange(n))
    for _p, stage in stages.items():
        _equal(stage.submit(batch, epoch, keys).result(), whole)
        bounds = [0, *cuts, n]
        futures = [stage.submit({k: v[a:b] for k, v in batch.items()}, epoch, keys[a:b])
                   for a, b in itertools.pairwise(bounds)]
        pieces = [f.result() for f in futures]
        _equal({k: np.concatenate([piece[k] for piece in pieces]) for k in whole}, whole)
    # a row's output depends on its key, not on where in the batch it is
    order = np.random.default_rng(n).permutation(n)
    moved = stages[2].submit({k: v[order] for k, v in batch.items()}, epoch, keys[order]).result()
    _equal({k: v[np.argsort(order)] for k, v in moved.items() if k != "i"},
           {k: v for k, v in whole.items() if k != "i"})


@pytest.mark.timeout(60)
def test_seeding_is_reproducible_across_stages_and_differs_by_seed_epoch_and_key() -> None:
    batch, keys = _batch(16), np.arange(100, 116)
    with SampleStage(augment, seed=5, processes=1, timeout=None, on_error="raise") as one, \
            SampleStage(augment, seed=5, processes=0, timeout=None, on_error="raise") as two, \
            SampleStage(augment, seed=6, processes=0, timeout=None, on_error="raise") as other:
        a = one.submit(batch, 0, keys).result()
        _equal(a, two.submit(batch, 0, keys).result())
        assert (a["draw"] != other.submit(batch, 0, keys).result()["draw"]).all()
        assert (a["draw"] != two.submit(batch, 1, keys).result()["draw"]).all()
        assert len(set(a["draw"].tolist())) == 16  # every key its own stream
    words = sample_seeds(5, 0, keys)
    assert len({tuple(w) for w in words.tolist()}) == 16
    assert len(set(words.ravel().tolist())) == 16 * 7


@pytest.mark.timeout(120)
def test_torch_generator_is_seeded_and_tensors_become_arrays() -> None:
    torch = pytest.importorskip("torch")
    batch, keys = _batch(8), np.arange(8)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    py_before, np_before = random.getstate(), np.random.get_state()[1].copy()
    with SampleStage(with_torch, seed=1, processes=0, timeout=None, on_error="raise") as here, \
            SampleStage(with_torch, seed=1, processes=2, timeout=None, on_error="raise") as there:
        a = here.submit(batch, 0, keys).result()
        b = there.submit(batch, 0, keys).result()
    assert a["t"].dtype == np.float32
    assert a["t"].shape == (8, 3)
    _equal(a, b)
    # in this process the training's own generators go on where they were
    assert torch.equal(torch.get_rng_state(), before)
    assert random.getstate() == py_before
    assert (np.random.get_state()[1] == np_before).all()


def test_how_fn_takes_the_generator() -> None:
    def keyword(sample: Any, *, rng: Any = None) -> Any: ...

    def defaulted(sample: Any, scale: float = 2.0) -> Any: ...

    assert takes_rng(augment) == "positional"
    assert takes_rng(plain) == "no"
    assert takes_rng(keyword) == "keyword"
    assert takes_rng(defaulted) == "no"
    assert takes_rng(functools.partial(scaled, factor=2)) == "no"
    assert takes_rng(len) == "no"


@pytest.mark.timeout(60)
def test_images_scalars_and_partials_through_workers() -> None:
    n = 12
    imgs = np.random.default_rng(0).integers(0, 255, (n, 12, 12, 3), dtype=np.uint8)
    keys = np.arange(n)
    with SampleStage(image, seed=0, processes=2, timeout=30, on_error="raise") as stage:
        outs = [stage.submit({"img": imgs, "i": np.arange(n)}, e, keys).result() for e in range(3)]
    for out in outs:
        assert out["img"].shape == (n, 8, 8, 3)
        assert out["img"].dtype == np.uint8
        assert out["i"].shape == (n,)
    with SampleStage(functools.partial(scaled, factor=3), seed=0, processes=2, timeout=30,
                     on_error="raise") as stage:
        out = stage.submit(_batch(5), 0, np.arange(5)).result()
    np.testing.assert_array_equal(out["i"], np.arange(5) * 3)


# -- bad transforms -------------------------------------------------------------------------------


def test_a_transform_that_does_not_pickle_is_refused_when_made() -> None:
    def local(sample: Any) -> Any:
        return sample

    for fn, name in ((lambda s: s, "<lambda>"), (local, "local")):
        with pytest.raises(ReaderError) as e:
            SampleStage(fn, seed=0, processes=1, timeout=None, on_error="raise")
        text = str(e.value)
        assert name in text
        assert "functools.partial" in text
        assert "transform_workers=0" in text
    with SampleStage(lambda s: {"i": s["i"]}, seed=0, processes=0, timeout=None, on_error="raise") as here:
        assert here.submit(_batch(2), 0, np.arange(2)).result()["i"].tolist() == [0, 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("processes", [0, 2])
def test_a_raising_transform_names_the_sample(processes: int) -> None:
    with SampleStage(raising, seed=0, processes=processes, timeout=30, on_error="raise") as stage:
        with pytest.raises(TransformError) as e:
            stage.submit(_batch(10), 0, np.arange(10), _where(10)).result()
        text = str(e.value)
        assert "dataset d, row group 3, row 3" in text
        assert "ValueError: bad sample 3" in text
        assert "on_error='skip'" in text
        assert isinstance(e.value.__cause__, ValueError)
        if processes:
            assert "in raising" in str(e.value.__cause__.__cause__)  # the worker's traceback
        # the stage goes on
        assert stage.submit(_batch(3), 0, np.arange(3)).result()["i"].tolist() == [0, 1, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("processes", [0, 2])
def test_skip_leaves_raising_samples_out_in_order_and_warns_once(processes: int) -> None:
    with SampleStage(raising, seed=0, processes=processes, timeout=30, on_error="skip") as stage, \
            warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a = stage.submit(_batch(10), 0, np.arange(10), _where(10)).result()
        b = stage.submit(_batch(14), 0, np.arange(14), _where(14)).result()
        none = stage.submit({"i": np.array([3, 8, 13]), "x": np.zeros((3, 3))}, 0, np.arange(3)).result()
    assert a["i"].tolist() == [0, 1, 2, 4, 5, 6, 7, 9]
    assert none["i"].shape == (0,)  # every sample skipped: empty
    assert none["i"].dtype == a["i"].dtype
    assert b["i"].tolist() == [0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 12]
    assert stage.stats["skipped_samples"] == 8
    assert len(seen) == 1
    assert "row 3" in str(seen[0].message)
    assert "on_error='skip'" in str(seen[0].message)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("processes", [0, 2])
def test_shapes_that_differ_name_the_field_both_shapes_and_samples(processes: int) -> None:
    with SampleStage(shape_varies, seed=0, processes=processes, timeout=30, on_error="skip") as stage, \
            pytest.raises(TransformError) as e:
        stage.submit(_batch(10), 0, np.arange(10), _where(10)).result()
    text = str(e.value)
    assert "'x'" in text
    assert "shape (2,)" in text
    assert "shape (1,)" in text
    assert "float32" in text
    # the other sample: the first of the batch, or of the worker's slice (rows 5-9 with 2 workers)
    assert "for dataset d, row group 3, row 6, but as shape (1,) dtype float32 for dataset d, row group 3, " \
        f"row {5 if processes else 0}:" in text
    assert "variable={'x'}" in text
    assert "resize or crop" in text
    with SampleStage(shape_varies, seed=0, processes=processes, timeout=30, on_error="raise",
                     variable={"x"}) as stage:
        out = stage.submit(_batch(10), 0, np.arange(10)).result()
    assert out["x"].dtype == object
    assert out["x"].shape == (10,)
    assert out["x"][7].shape == (2,)
    assert out["i"].dtype == np.int64


@pytest.mark.timeout(60)
@pytest.mark.parametrize("processes", [0, 2])
def test_a_shape_that_changes_in_a_later_batch_is_an_error(processes: int) -> None:
    with SampleStage(shape_varies, seed=0, processes=processes, timeout=30, on_error="raise") as stage:
        stage.submit({"i": np.arange(5)}, 0, np.arange(5), _where(5)).result()
        with pytest.raises(TransformError, match=r"'x' as shape \(2,\).*row 6.*shape \(1,\).*row 0"):
            stage.submit({"i": np.arange(5) + 5}, 0, np.arange(5) + 5, _where(10)[5:]).result()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("processes", [0, 1])
def test_a_transform_that_returns_no_dict_names_the_type(processes: int) -> None:
    with SampleStage(not_a_dict, seed=0, processes=processes, timeout=30, on_error="skip") as stage, \
            pytest.raises(TransformError, match=r"returned a list for dataset d, row group 3, row 0, not a"):
        stage.submit(_batch(4), 0, np.arange(4), _where(4)).result()


@pytest.mark.timeout(120)
def test_a_hanging_transform_times_out_and_the_workers_start_again() -> None:
    with SampleStage(hangs, seed=0, processes=2, timeout=1.0, on_error="raise") as stage:
        first = _pids(stage)
        with pytest.raises(TransformError) as e:
            stage.submit(_batch(10), 0, np.arange(10), _where(10)).result()
        assert "transform_timeout=1.0" in str(e.value)
        assert "killed and started again" in str(e.value)
        assert not any(_alive(pid) for pid in first)
        assert stage.stats["worker_restarts"] == 1
        assert stage.submit({"i": np.arange(5)}, 0, np.arange(5)).result()["i"].tolist() == list(range(5))


@pytest.mark.timeout(120)
def test_a_worker_killed_by_a_signal_fails_its_batch_not_hangs() -> None:
    with SampleStage(kills_itself, seed=0, processes=2, timeout=None, on_error="raise") as stage:
        with pytest.raises(TransformError, match=r"killed by SIGKILL while transforming 5 samples from "
                                                 r"dataset d, row group 3, row 5 to"):
            stage.submit(_batch(10), 0, np.arange(10), _where(10)).result()
        assert stage.submit({"i": np.arange(5)}, 0, np.arange(5)).result()["i"].tolist() == list(range(5))
    with SampleStage(slow, seed=0, processes=2, timeout=None, on_error="raise") as stage:
        future = stage.submit(_batch(20), 0, np.arange(20))
        time.sleep(0.5)  # mid-batch: each worker has 10 samples of 0.2 s
        os.kill(_pids(stage)[1], signal.SIGKILL)
        with pytest.raises(TransformError, match="killed by SIGKILL"):
            future.result()


def _memfd_maps() -> set[str]:
    """This process's maps of the stage's shared memory (address range and inode: one line each)."""
    return {line for line in Path("/proc/self/maps").read_text().splitlines()
            if "memfd:shardkit-transform" in line}


def _memfd_fds() -> set[tuple[int, int]]:
    """This process's open descriptors of the stage's shared memory, as (fd, inode)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if "memfd:shardkit-transform" in os.readlink(f"/proc/self/fd/{fd}"):
                found.add((int(fd), os.stat(int(fd)).st_ino))
    return found


@pytest.mark.timeout(120)
def test_shared_memory_is_reused_and_let_go() -> None:
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    base_maps, base_fds = _memfd_maps(), _memfd_fds()
    stage = SampleStage(augment, seed=0, processes=2, timeout=60, on_error="raise")
    held = stage.submit(_batch(32), 0, np.arange(32)).result()
    for epoch in range(12):
        out = stage.submit(_batch(32), epoch, np.arange(32)).result()
        assert out["x"].shape == (32, 3)
    del out
    assert len(stage._segments) <= 4  # reused, not one per batch
    kept = held["x"].copy()
    pids = _pids(stage)
    stage.close()
    stage.close()  # idempotent
    with pytest.raises(ReaderError, match="closed"):
        stage.submit(_batch(2), 0, np.arange(2))
    assert not any(_alive(pid) for pid in pids)
    assert len(_memfd_fds() - base_fds) == 1  # the map of the batch still held (a map keeps an fd)
    np.testing.assert_array_equal(held["x"], kept)  # a batch handed out keeps its memory after close
    del held
    gc.collect()
    assert _memfd_maps() - base_maps == set()
    assert _memfd_fds() - base_fds == set()
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) - shm == set()


@pytest.mark.timeout(60)
def test_prepare_runs_first_in_the_workers_and_can_leave_rows_out() -> None:
    with SampleStage(plain, prepare=Halve(), seed=0, processes=2, timeout=30, on_error="raise") as stage:
        out = stage.submit({"i": np.arange(10)}, 0, np.arange(10)).result()
    assert out["i"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    with SampleStage(None, prepare=Halve(drop_odd=True), seed=0, processes=2, timeout=30,
                     on_error="raise") as stage:
        outs = [stage.submit({"i": np.arange(10) * 2}, 0, np.arange(10)).result() for _ in range(3)]
    for out in outs:
        assert out["i"].tolist() == [0, 2, 4, 6, 8]
        assert out["half"].dtype == np.float64
    assert stage.stats["skipped_samples"] == 15


class Halve:
    """A prepare step: a column computed in the worker (as the reader decodes images there)."""

    def __init__(self, drop_odd: bool = False) -> None:
        self.drop_odd = drop_odd

    def __call__(self, batch: dict[str, np.ndarray]) -> Any:
        out = {"i": batch["i"] // 2, "half": batch["i"] / 2}
        if not self.drop_odd:
            return {"i": batch["i"]}
        keep = out["i"] % 2 == 0
        return {k: v[keep] for k, v in out.items()}, keep


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ReaderError, match="transform_workers=-1"):
        SampleStage(plain, seed=0, processes=-1, timeout=None, on_error="raise")
    with pytest.raises(ReaderError, match="transform_timeout=0"):
        SampleStage(plain, seed=0, processes=0, timeout=0, on_error="raise")
    with pytest.raises(ReaderError, match="not callable"):
        SampleStage(3, seed=0, processes=0, timeout=None, on_error="raise")  # type: ignore[arg-type]


def null_flag(sample: dict[str, Any]) -> dict[str, Any]:
    return {"null": sample["m"] is None, "v": np.zeros(2) if sample["v"] is None else sample["v"]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("processes", [0, 2])
def test_a_null_comes_as_none(processes: int) -> None:
    m = np.ma.masked_array(np.arange(4.0), mask=[False, True, False, True])
    v = np.ma.masked_array(np.ones((4, 2)), mask=[[True, True], [False, False]] * 2)
    with SampleStage(null_flag, seed=0, processes=processes, timeout=30, on_error="raise") as stage:
        out = stage.submit({"m": m, "v": v}, 0, np.arange(4)).result()
    assert out["null"].tolist() == [False, True, False, True]
    assert out["v"].tolist() == [[0, 0], [1, 1], [0, 0], [1, 1]]


@pytest.mark.timeout(120)
def test_batches_kept_by_the_user_do_not_take_a_segment_each() -> None:
    base_fds = _memfd_fds()
    with SampleStage(augment, seed=0, processes=2, timeout=60, on_error="raise") as stage:
        kept = [stage.submit(_batch(8), e, np.arange(8)).result() for e in range(60)]
        assert len(stage._segments) <= 16 + 2 * 2 + 4
        assert len(_memfd_fds() - base_fds) <= 2 * len(stage._segments) + 1
        again = [stage.submit(_batch(8), e, np.arange(8)).result() for e in range(60)]
    for a, b in zip(kept, again, strict=True):
        _equal(a, b)


@pytest.mark.timeout(60)
def test_closing_with_batches_in_flight_ends_them_without_a_hang() -> None:
    stage = SampleStage(slow, seed=0, processes=2, timeout=None, on_error="raise")
    pids = _pids(stage)
    running = stage.submit(_batch(20), 0, np.arange(20))
    queued = stage.submit(_batch(20), 0, np.arange(20))
    time.sleep(0.3)
    stage.close()
    with pytest.raises(TransformError, match="closed while this batch"):
        running.result(timeout=10)
    assert queued.cancelled()
    assert not any(_alive(pid) for pid in pids)
    assert stage._workers == []


_ORPHAN = """
import sys, time
import numpy as np
from shardkit.reader._pipeline.transform import SampleStage
from tests.reader.test_transform_stage import plain
stage = SampleStage(plain, seed=0, processes=2, timeout=None, on_error="raise")
stage.submit({"i": np.arange(4)}, 0, np.arange(4)).result()
print(*[w.process.pid for w in stage._workers], flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(90)
def test_workers_end_when_their_parent_is_killed() -> None:
    root = Path(__file__).resolve().parents[2]
    with subprocess.Popen([sys.executable, "-c", _ORPHAN], cwd=root, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, start_new_session=True) as child:
        try:
            assert child.stdout is not None
            pids = [int(p) for p in child.stdout.readline().split()]
            assert len(pids) == 2
            child.send_signal(signal.SIGKILL)
            child.wait(30)
            deadline = time.monotonic() + 30
            while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(_alive(pid) for pid in pids)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
