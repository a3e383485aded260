"""shardkit.torch on CPU (real torch): values vs the reader, collate, devices, resume, DataLoader workers."""

from __future__ import annotations

import copy
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
import shardkit.torch as skt
from shardkit.errors import AdapterError, MissingDependencyError, require
from shardkit.reader.adapters import torch as reader_torch
from tests.reader.datasets import assert_exactly_once, ids_of, write_all_codecs, write_ids

N_IDS = 480  # divisible by every world x workers below: "drop" leaves nothing out


@pytest.fixture(scope="module")
def codecs_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_all_codecs(tmp_path_factory.mktemp("codecs") / "ds")[0]


@pytest.fixture(scope="module")
def ids_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", N_IDS, row_group_size=37)




def assert_same(reader_batch: dict[str, Any], batch: dict[str, Any]) -> None:
    """A loader batch holds the reader batch's values and dtypes under the default `Collate` policy."""
    for name, want in reader_batch.items():
        got = batch[name]
        if isinstance(want, np.ma.MaskedArray):
            valid = ~np.ma.getmaskarray(want).reshape(len(want), -1).any(axis=1)
            np.testing.assert_array_equal(batch[name + "__valid"].numpy(), valid)
            np.testing.assert_array_equal(got.numpy()[valid], want.data[valid])
            assert got.numpy().dtype == want.dtype
        elif want.dtype == object and want.size and isinstance(next((v for v in want if v is not None), ""),
                                                               np.ndarray):
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert (g is None) == (w is None)
                if w is not None:
                    assert g.numpy().dtype == w.dtype
                    np.testing.assert_array_equal(g.numpy(), w)
        elif want.dtype == object:
            assert got == list(want)
        else:
            assert isinstance(got, torch.Tensor)
            assert got.numpy().dtype == want.dtype
            np.testing.assert_array_equal(got.numpy(), want)
        if name + "__valid" in batch and want.dtype == object:  # nullable text: None where not valid
            assert batch[name + "__valid"].tolist() == [v is not None for v in want]


@pytest.mark.parametrize("shuffle", [False, True])
def test_values_and_dtypes_equal_the_readers_for_every_codec(codecs_ds: str, shuffle: bool) -> None:
    kw = {"batch_size": 16, "shuffle": shuffle, "seed": 5}
    with shardkit.make_reader(codecs_ds, **kw) as reader, skt.make_loader(codecs_ds, **kw) as loader:
        want = list(reader)
        got = list(loader)
        assert len(loader) == len(reader) == len(got) == len(want)
    for w, g in zip(want, got, strict=True):
        assert_same(w, g)
        for t in g.values():
            if isinstance(t, torch.Tensor):
                assert t.device.type == "cpu"
                # writable in place: the reader's read-only buffers were copied
                t.add_(0) if t.dtype != torch.bool else t.logical_not_()


def test_host_tensors_share_writable_memory_and_copy_read_only_memory() -> None:
    shared = np.arange(6, dtype=np.float32)
    frozen = np.arange(6, dtype=np.float32)
    frozen.flags.writeable = False
    out = reader_torch.to_torch({"a": shared, "b": frozen})
    assert out["a"].data_ptr() == shared.ctypes.data  # zero-copy
    assert out["b"].data_ptr() != frozen.ctypes.data
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about non-writable arrays: writable=False must not
        kept = reader_torch.to_torch({"b": frozen}, writable=False)
    assert kept["b"].data_ptr() == frozen.ctypes.data


def test_pad_policy_gives_dense_tensors_and_masks(codecs_ds: str) -> None:
    kw = {"batch_size": 32, "shuffle": False, "columns": ["var", "var2", "id"]}
    with shardkit.make_reader(codecs_ds, **kw) as reader:
        want = next(iter(reader))
    with skt.make_loader(codecs_ds, collate=skt.Collate(variable="pad", pad_value=-1), **kw) as loader:
        got = next(iter(loader))
    assert got["var"].shape == (32, max(len(r) for r in want["var"]))
    assert got["var2"].shape == (32, max(r.shape[0] for r in want["var2"]), 2)
    assert got["var2__mask"].shape == got["var2"].shape[:2]
    for i, (row, row2) in enumerate(zip(want["var"], want["var2"], strict=True)):
        n = len(row)
        np.testing.assert_array_equal(got["var"][i, :n].numpy(), row)
        assert (got["var"][i, n:] == -1).all()
        assert got["var__mask"][i].sum() == n
        assert got["var2__mask"][i].sum() == row2.shape[0]
        np.testing.assert_array_equal(got["var2"][i, : row2.shape[0]].numpy(), row2)


def _odd_dtypes(path: Path) -> str:
    n = 40
    cols = {"id": np.arange(n), "depth": np.arange(n, dtype=np.uint16) * 1000,
            "big": np.arange(n, dtype=np.uint32), "when": np.arange(n).astype("datetime64[s]")}
    shardkit.write_dataset(cols, os.fspath(path), row_group_size=10)
    return os.fspath(path)


def test_a_field_torch_cannot_represent_fails_with_the_options(tmp_path: Path) -> None:
    url = _odd_dtypes(tmp_path / "odd")
    for field, hint in (("depth", "int32"), ("big", "int64"), ("when", "int64")):
        with pytest.raises(AdapterError, match=rf"field '{field}' is .*cast=.*columns=.*{hint}"):
            skt.make_loader(url, columns=["id", field])
        with pytest.raises(AdapterError, match=field):
            skt.ShardkitIterableDataset(url, columns=["id", field])
    cast = skt.Collate(cast={"depth": "int32", "big": "int64", "when": "int64"})
    with shardkit.make_reader(url, shuffle=False, batch_size=8) as reader, \
            skt.make_loader(url, shuffle=False, batch_size=8, collate=cast) as loader:
        for want, got in zip(reader, loader, strict=True):
            assert got["depth"].dtype == torch.int32
            assert got["when"].dtype == torch.int64
            np.testing.assert_array_equal(got["depth"].numpy(), want["depth"].astype(np.int32))
            np.testing.assert_array_equal(got["when"].numpy(), want["when"].astype(np.int64))
    with pytest.raises(AdapterError, match="nope"):
        skt.make_loader(url, collate=skt.Collate(cast={"nope": "int32"}))
    with pytest.raises(AdapterError, match="uint16"):
        skt.make_loader(url, collate=skt.Collate(cast={"big": "uint16"}), columns=["big"])
    with pytest.raises(AdapterError, match="variable"):
        skt.Collate(variable="ragged")  # type: ignore[arg-type]
    none: Any = None
    with pytest.raises(AdapterError, match=r"cast=\{'depth': None\}.*not a numpy dtype"):
        skt.make_loader(url, collate=skt.Collate(cast={"depth": none}), columns=["depth"])


@pytest.mark.parametrize(("pad_value", "ok"),
                         [(-1, False), (256, False), (0.5, False), (255, True), (0, True)])
def test_a_pad_value_the_field_cannot_hold_is_refused_up_front(codecs_ds: str, pad_value: float,
                                                               ok: bool) -> None:
    """var2 is int32 (-1 fits), a uint8 cast of it holds 0..255: the adapter is refused when it is made,
    naming the field and the value (it used to fail on the first batch with numpy's OverflowError, or
    pad 0.5 silently as 0)."""
    collate = skt.Collate(variable="pad", pad_value=pad_value, cast={"var2": "uint8"})
    kw = {"columns": ["var2"], "batch_size": 16, "collate": collate}
    if ok:
        with skt.make_loader(codecs_ds, **kw) as loader:
            batch = next(iter(loader))
        assert (batch["var2"][~batch["var2__mask"]] == pad_value).all()
        return
    with pytest.raises(AdapterError, match=rf"pad_value={pad_value!r}\) is not a value of field 'var2'"):
        skt.make_loader(codecs_ds, **kw)


def test_an_added_key_that_collides_with_a_field_is_refused(tmp_path: Path) -> None:
    schema = shardkit.Schema([shardkit.Field("x", "float32", nullable=True),
                              shardkit.Field("x__valid", "bool")])
    shardkit.write_dataset({"x": [1.0, None], "x__valid": [True, False]}, os.fspath(tmp_path / "d"),
                           schema=schema)
    with pytest.raises(AdapterError, match="x__valid"):
        skt.make_loader(os.fspath(tmp_path / "d"))


@pytest.mark.parametrize("device", ["bogus", "cuda:7", "mps", "cuda"])
def test_a_device_that_does_not_exist_fails_before_reading(device: str, tmp_path: Path) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: 'cuda' exists here")
    # the URL does not exist either: the device error comes first, so nothing was opened
    with pytest.raises(AdapterError, match=repr(device)):
        skt.make_loader(os.fspath(tmp_path / "missing"), device=device)


def test_pinning_on_a_machine_without_cuda_says_so_once(ids_ds: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so pinning is on (see test_gpu.py)")
    monkeypatch.setattr(reader_torch, "_warned", set())
    with pytest.warns(UserWarning, match="pinning is off"), skt.make_loader(ids_ds, pin_memory=True,
                                                                            device="cpu") as loader:
        batch = next(iter(loader))
    assert not batch["id"].is_pinned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        skt.make_loader(ids_ds, pin_memory=True).close()


def test_bad_arguments(ids_ds: str) -> None:
    with shardkit.make_reader(ids_ds) as reader:
        with pytest.raises(AdapterError, match="batch_size"):
            skt.make_loader(reader, batch_size=3)
        with pytest.raises(AdapterError, match="collate"):
            skt.make_loader(reader, collate=42)  # type: ignore[arg-type]
    with pytest.raises(AdapterError, match="URL"):
        skt.make_loader(42)
    with pytest.raises(AdapterError, match="rank="):
        skt.ShardkitIterableDataset(ids_ds, shard=0, num_shards=2)


def test_a_collate_function_replaces_the_policy(ids_ds: str) -> None:
    def collate(batch: dict[str, np.ndarray]) -> dict[str, Any]:
        return {"id": torch.from_numpy(batch["id"] * 2), "n": len(batch["id"])}

    with skt.make_loader(ids_ds, batch_size=50, shuffle=False, collate=collate) as loader:
        batch = next(iter(loader))
    assert batch["n"] == 50
    assert batch["id"][:3].tolist() == [0, 2, 4]


def test_missing_dependencies_name_the_extra() -> None:
    with pytest.raises(MissingDependencyError, match=r"pip install 'shardkit\[torch\]'"):
        require("shardkit_no_such_module", extra="torch", purpose="shardkit.torch")
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import shardkit.torch\nexcept ImportError as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "MissingDependencyError" in out.stdout
    assert "shardkit[torch]" in out.stdout


# ---- passes, resume ----------------------------------------------------------------------------------

def test_each_pass_is_the_next_epoch(ids_ds: str) -> None:
    with skt.make_loader(ids_ds, batch_size=64, seed=1) as loader:
        epochs = [ids_of(list(loader)) for _ in range(2)]
    with shardkit.make_reader(ids_ds, batch_size=64, seed=1, num_epochs=2) as reader:
        want = [ids_of(list(reader.iter_epoch())) for _ in range(2)]
    for got, expected in zip(epochs, want, strict=True):
        np.testing.assert_array_equal(got, expected)
        assert_exactly_once(got, N_IDS)
    assert not np.array_equal(epochs[0], epochs[1])


class _HostStager:
    """The loader's look-ahead without CUDA: staging is the identity (the CUDA copy is in test_gpu.py)."""

    def stage(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    def hand(self, staged: dict[str, Any]) -> dict[str, Any]:
        return staged


def _loader(url: str, lookahead: bool, **kw: Any) -> reader_torch.Loader:
    """make_loader's Loader, on the CUDA path's look-ahead (`_HostStager`) or on the host path."""
    return reader_torch.Loader(shardkit.make_reader(url, **kw), _stager=_HostStager() if lookahead else None)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_new_pass_or_a_loaded_state_ends_the_pass_in_progress(ids_ds: str, lookahead: bool) -> None:
    with _loader(ids_ds, lookahead, batch_size=48, shuffle=False, columns=["id"]) as loader:
        first = iter(loader)
        a = next(first)
        second = iter(loader)
        b = next(second)  # goes on after `a`
        assert next(first, None) is None  # the older pass ended; it took nothing from the newer one
        loader.load_state_dict(loader.state_dict())
        assert next(second, None) is None
        rest = list(loader)
    np.testing.assert_array_equal(ids_of([a, b, *rest]), np.arange(N_IDS))


@pytest.mark.parametrize("lookahead", [False, True])
def test_loading_an_earlier_state_mid_pass_goes_back_to_it(ids_ds: str, lookahead: bool) -> None:
    """A rollback (say, the loss blew up): the pass ends where the state was loaded, and the next pass
    starts at the saved position; the batch the look-ahead read meanwhile is not handed out."""
    with _loader(ids_ds, lookahead, batch_size=16, shuffle=False, columns=["id"]) as loader:
        seen = []
        for i, batch in enumerate(loader):
            seen.append(int(batch["id"][0]))
            if i == 2:
                saved = loader.state_dict()
            if i == 6:
                loader.load_state_dict(saved)
        after = ids_of(list(loader))
    assert seen == [16 * i for i in range(7)]
    np.testing.assert_array_equal(after, np.arange(48, N_IDS))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stop=st.integers(0, 9), lookahead=st.booleans(), world=st.sampled_from([1, 2, 3]))
def test_resume_through_the_loader_continues_at_the_next_batch(ids_ds: str, stop: int, lookahead: bool,
                                                               world: int) -> None:
    kw = {"batch_size": 48, "seed": 3, "columns": ["id"]}
    with shardkit.make_reader(ids_ds, **kw) as reader:
        whole = list(reader)
    reader = shardkit.make_reader(ids_ds, **kw)
    loader = reader_torch.Loader(reader, _stager=_HostStager() if lookahead else None)
    it = iter(loader)
    first = [next(it) for _ in range(stop)]
    state = loader.state_dict()
    for i, batch in enumerate(first):
        np.testing.assert_array_equal(batch["id"].numpy(), whole[i]["id"])
    if stop % 2:  # a pass that stops early and goes on: the batch read ahead is not lost
        del it
        rest = list(loader)
        np.testing.assert_array_equal(ids_of(first + rest), ids_of(whole))
    loader.close()
    # the state resumes the job on `world` shards: what they read completes the epoch, each id once
    later = []
    for shard in range(world):
        with skt.make_loader(ids_ds, shard=shard, num_shards=world, **kw) as resumed:
            resumed.load_state_dict(state)
            later.append(ids_of(list(resumed)))
            if world == 1:
                np.testing.assert_array_equal(later[0], ids_of(whole[stop:]))
    assert_exactly_once(np.concatenate([ids_of(first), *later]), N_IDS)



@pytest.mark.parametrize("stop_epoch", [0, 1, 2])
def test_a_restored_loader_reads_only_the_epochs_left(ids_ds: str, stop_epoch: int) -> None:
    """A job restarted from its checkpoint trains the rest of its ``num_epochs``, not ``num_epochs`` more:
    restored after the last step it reads nothing (a regression: it used to read 3 more epochs)."""
    kw = {"batch_size": 64, "seed": 5, "columns": ["id"], "num_epochs": 3}
    with skt.make_loader(ids_ds, **kw) as loader:
        whole = [b["id"].numpy() for b in loader]
        steps = len(loader)
    assert len(whole) == 3 * steps
    with skt.make_loader(ids_ds, **kw) as loader:
        it = iter(loader)
        for _ in range(stop_epoch * steps + (steps // 2 if stop_epoch < 2 else steps)):
            next(it)
        state = loader.state_dict()
        done = stop_epoch * steps + (steps // 2 if stop_epoch < 2 else steps)
    with skt.make_loader(ids_ds, **kw) as resumed:
        resumed.load_state_dict(state)
        rest = [b["id"].numpy() for b in resumed]
        assert len(rest) == 3 * steps - done
        np.testing.assert_array_equal(np.concatenate([np.zeros(0, np.int64), *rest]),
                                      np.concatenate([np.zeros(0, np.int64), *whole[done:]]))
        again = [b["id"].numpy() for b in resumed]  # a later pass is relative again: 3 more epochs
        assert len(again) == 3 * steps

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(passes=st.integers(1, 3), num_epochs=st.sampled_from([1, 2]), cut=st.integers(0, 10_000),
       after_pass=st.booleans(), lookahead=st.booleans())
def test_an_epoch_loop_resumed_from_any_batch_reads_what_the_uninterrupted_loop_reads(
        ids_ds: str, passes: int, num_epochs: int, cut: int, after_pass: bool, lookahead: bool) -> None:
    """``for p in range(passes): for batch in loader``, saved at any batch (inside the inner loop) or
    after any pass (outside it), then a new loader continues the outer loop where it was: the batches
    equal the uninterrupted loop's, in order. A regression: a state saved in the second pass resumed
    with nothing (the rest of that epoch was lost), and one saved after a pass read nothing next."""
    kw = {"batch_size": 64, "seed": 7, "columns": ["id"], "num_epochs": num_epochs}
    with _loader(ids_ds, False, **kw) as loader:
        whole = [[b["id"].numpy().copy() for b in loader] for _ in range(passes)]
    flat = [b for p in whole for b in p]
    if after_pass:  # saved between passes: after pass `at`, the loop goes on with pass at + 1
        at = cut % passes
        done, first_pass = sum(len(p) for p in whole[: at + 1]), at + 1
        with _loader(ids_ds, lookahead, **kw) as loader:
            for _ in range(at + 1):
                for _ in loader:
                    pass
            state = loader.state_dict()
    else:  # saved after batch `done` of the loop, in pass `first_pass`, which then goes on
        done = 1 + cut % len(flat)
        first_pass = next(p for p in range(passes) if sum(len(q) for q in whole[: p + 1]) >= done)
        with _loader(ids_ds, lookahead, **kw) as loader:
            it = (b for _ in range(passes) for b in loader)
            for _ in range(done):
                next(it)
            state = loader.state_dict()
    state = json.loads(json.dumps(state))  # as a checkpoint keeps it
    with _loader(ids_ds, lookahead, **kw) as resumed:
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state  # saved again before reading: the same position
        rest = [b["id"].numpy().copy() for _ in range(first_pass, passes) for b in resumed]
    assert len(rest) == len(flat) - done
    for got, want in zip(rest, flat[done:], strict=True):
        np.testing.assert_array_equal(got, want)


# ---- DataLoader workers ------------------------------------------------------------------------------

def _dl_ids(ds: Any, workers: int, steps: int | None = None, loader: Any = None) -> list[np.ndarray]:
    from torch.utils.data import DataLoader

    dl = loader if loader is not None else DataLoader(ds, batch_size=None, num_workers=workers)
    return [batch["id"].numpy().copy() for batch in itertools.islice(dl, steps)]  # pulls `steps`, no more


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("reap")
def test_two_workers_on_two_ranks_cover_every_id_once(ids_ds: str) -> None:
    per_rank = []
    for rank in range(2):
        ds = skt.ShardkitIterableDataset(ids_ds, rank=rank, world_size=2, batch_size=16, columns=["id"],
                                         workers=1)
        assert ds.shard_of(1, 2) == (rank * 2 + 1, 4)
        batches = _dl_ids(ds, workers=2)
        per_rank.append(np.concatenate(batches))
        assert [len(b) for b in batches] == [16] * 14 + [8] * 2  # 120 ids a worker: 7 batches and 8 ids
    assert len(per_rank[0]) == len(per_rank[1])  # ranks step together
    assert_exactly_once(np.concatenate(per_rank), N_IDS)


def _epoch_of_workers(url: str, epoch: int, num_workers: int, **kw: Any) -> list[np.ndarray]:
    """The batches ``num_workers`` DataLoader workers yield in ``epoch``: each its reader's, in turn."""
    per_worker = []
    for w in range(num_workers):
        with shardkit.make_reader(url, shard=w, num_shards=num_workers, num_epochs=epoch + 1, **kw) as reader:
            for _ in range(epoch):
                list(reader.iter_epoch())
            per_worker.append([b["id"].copy() for b in reader.iter_epoch()])
    return [b for group in zip(*per_worker, strict=True) for b in group]


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("reap")
@pytest.mark.parametrize("set_epoch", [True, False])
def test_persistent_workers_read_the_next_epoch_each_pass(ids_ds: str, set_epoch: bool) -> None:
    """A persistent worker's copy of the dataset is made once: set_epoch() calls made later in the main
    process do not reach it, and its reader goes on to its next epoch each pass (it used to jump back
    to the epoch its copy was made with, replaying one shuffle every pass)."""
    from torch.utils.data import DataLoader

    kw = {"batch_size": 16, "columns": ["id"], "seed": 5, "workers": 1}
    ds = skt.ShardkitIterableDataset(ids_ds, **kw)
    dl = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    for epoch in range(3):
        if set_epoch:
            ds.set_epoch(epoch)
        got = [b["id"].numpy().copy() for b in dl]
        want = _epoch_of_workers(ids_ds, epoch, 2, **kw)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    del dl


@pytest.mark.timeout(60)
def test_set_epoch_picks_the_epoch_of_the_next_pass(ids_ds: str) -> None:
    ds = skt.ShardkitIterableDataset(ids_ds, batch_size=32, columns=["id"], seed=4)
    with shardkit.make_reader(ids_ds, batch_size=32, columns=["id"], seed=4, num_epochs=3) as reader:
        want = [ids_of(list(reader.iter_epoch())) for _ in range(3)]
    ds.set_epoch(2)
    np.testing.assert_array_equal(np.concatenate(_dl_ids(ds, 0)), want[2])
    np.testing.assert_array_equal(np.concatenate(_dl_ids(ds, 0)), want[2])  # a pass again from set_epoch's
    ds.set_epoch(1)
    np.testing.assert_array_equal(np.concatenate(_dl_ids(ds, 0)), want[1])


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("reap")
def test_worker_batches_equal_the_readers_and_cross_as_one_shared_tensor(codecs_ds: str) -> None:
    from torch.utils.data import DataLoader

    kw = {"batch_size": 16, "seed": 5}
    with shardkit.make_reader(codecs_ds, **kw) as reader, skt.make_loader(codecs_ds, **kw) as loader:
        want = list(reader)
        keys = list(next(iter(loader)))
    ds = skt.ShardkitIterableDataset(codecs_ds, rank=0, world_size=1, **kw)
    got = list(DataLoader(ds, batch_size=None, num_workers=1))  # one worker: the reader's own shard
    assert len(got) == len(want)
    for w, g in zip(want, got, strict=True):
        assert type(g) is dict
        assert list(g) == keys  # in order
        assert_same(w, g)
        tensors = [t for t in g.values() if isinstance(t, torch.Tensor)]
        assert len(tensors) > 3
        # packed: every tensor of the batch is a view of one shared-memory storage
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        assert _in_segment(tensors[0]) or tensors[0].is_shared()


def _in_segment(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in a worker's shared-memory segment mapped by this process."""
    from shardkit.reader.adapters.torch_workers import _MAPPED

    start = t.data_ptr()
    return any(seg.__array_interface__["data"][0] <= start < seg.__array_interface__["data"][0] + seg.nbytes
               for seg in list(_MAPPED.values()))


def _tokens() -> set[str]:
    from shardkit.reader.adapters.torch_workers import _MAPPED

    return {token for token, _ in list(_MAPPED)}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("reap")
def test_worker_segments_are_reused_once_released_and_never_while_held(ids_ds: str) -> None:
    from torch.utils.data import DataLoader

    from shardkit.reader.adapters.torch_workers import _MAPPED, _Segments

    kw = {"batch_size": 16, "seed": 6, "columns": ["id"]}
    with shardkit.make_reader(ids_ds, **kw) as reader:
        want = [b["id"].copy() for b in reader]  # 30 batches
    ds = skt.ShardkitIterableDataset(ids_ds, rank=0, world_size=1, **kw)
    before = _tokens()
    held = list(DataLoader(ds, batch_size=None, num_workers=1))  # every batch kept: no segment is freed
    in_segments = [_in_segment(b["id"]) for b in held]
    assert sum(in_segments) == _Segments.MAX_SEGMENTS  # then the worker sends them torch's way
    assert all(b["id"].is_shared() for b, seg in zip(held, in_segments, strict=True) if not seg)
    for b, w in zip(held, want, strict=True):  # none was overwritten while held
        np.testing.assert_array_equal(b["id"].numpy(), w)
    del held

    seen = []
    for i, b in enumerate(DataLoader(ds, batch_size=None, num_workers=1)):  # each batch dropped at once
        assert _in_segment(b["id"])
        np.testing.assert_array_equal(b["id"].numpy(), want[i])
        seen.append(i)
    assert len(seen) == len(want)
    token = [key for key in list(_MAPPED) if key[0] not in before][-1][0]  # the second pass's worker
    assert 1 <= len([key for key in list(_MAPPED) if key[0] == token]) <= _Segments.MAX_SEGMENTS
    assert len(want) > _Segments.MAX_SEGMENTS  # so segments were reused


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("reap")
def test_segments_of_exited_workers_are_unmapped(ids_ds: str) -> None:
    ds = skt.ShardkitIterableDataset(ids_ds, rank=0, world_size=1, batch_size=64, columns=["id"])
    for _ in range(3):  # workers that are not persistent: new processes every pass
        assert_exactly_once(np.concatenate(_dl_ids(ds, 2)), N_IDS)
    assert len(_tokens()) <= 2  # the last pass's two workers; earlier ones' segments were let go


def test_a_worker_batch_pickles_to_views_of_one_tensor() -> None:
    from multiprocessing.reduction import ForkingPickler

    from torch.utils.data._utils.collate import default_convert

    from shardkit.reader.adapters.torch_workers import _WorkerBatch

    rows = [torch.arange(3), None, torch.ones(2, 2)]
    batch = _WorkerBatch({
        "f16": torch.tensor([1.5, -2.0], dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
        "text": ["a", None, "é"],
        "empty": torch.zeros((0, 4), dtype=torch.int32),
        "strided": torch.arange(24, dtype=torch.int64).reshape(4, 6)[:, ::2],  # not contiguous
        "rows": rows,
        "image": torch.randint(0, 255, (3, 5, 5, 3), dtype=torch.uint8),
    })
    out = pickle.loads(ForkingPickler.dumps(batch))
    assert type(out) is dict
    assert list(out) == list(batch)
    assert out["text"] == ["a", None, "é"]
    assert out["rows"][1] is None
    torch.testing.assert_close(out["rows"][2], rows[2])
    for key in ("f16", "mask", "empty", "strided", "image"):
        assert out[key].dtype == batch[key].dtype
        assert out[key].shape == batch[key].shape
        assert torch.equal(out[key], batch[key])
        assert out[key].data_ptr() % 64 == 0
    packed = {out[k].untyped_storage().data_ptr() for k in ("f16", "mask", "strided", "image")}
    assert len(packed) == 1
    assert type(copy.copy(batch)) is _WorkerBatch  # DataLoader's default_convert copies it in the worker
    text = np.array(["a", None, "é"], dtype=object)  # the reader's text: a list in the main process
    worker = _WorkerBatch({"name": text, "kept": text, "x": torch.arange(3)}, frozenset({"name"}))
    converted = default_convert(worker)  # what the DataLoader worker does to it
    assert converted.lists == {"name"}
    assert converted["name"] is text  # passed through, not walked string by string
    out = pickle.loads(ForkingPickler.dumps(converted))
    assert out["name"] == ["a", None, "é"]
    assert isinstance(out["kept"], np.ndarray)  # not a text field of the reader's: left as it is
    assert out["x"].tolist() == [0, 1, 2]


def test_a_worker_batchs_bytes_cross_in_its_block_and_come_out_as_bytes() -> None:
    """An encoded image field read with ``decode=False`` (a list of bytes per batch, MiBs) crosses in the
    batch's shared-memory block, not pickled through the DataLoader's pipe; it comes out as the same
    bytes objects, None and empty values kept. A list mixing bytes and str goes the usual way."""
    from multiprocessing.reduction import ForkingPickler

    from shardkit.reader.adapters.torch_workers import _WorkerBatch

    rng = np.random.default_rng(0)
    blobs = [rng.bytes(int(n)) for n in rng.integers(1, 50_000, 40)]
    blobs[3], blobs[7] = None, b""
    mixed = np.array([b"x", "y", None], dtype=object)
    batch = _WorkerBatch({"id": torch.arange(40), "image": np.array(blobs, dtype=object), "mixed": mixed,
                          "nulls": np.array([None, None], dtype=object)},
                         frozenset({"image", "mixed", "nulls"}))
    sent = ForkingPickler.dumps(batch)
    assert len(sent) < 10_000 < sum(len(b or b"") for b in blobs)  # the bytes did not go through the pipe
    out = pickle.loads(sent)
    assert list(out) == ["id", "image", "mixed", "nulls"]
    assert out["image"] == blobs
    assert all(type(b) is bytes for b in out["image"] if b is not None)
    assert out["mixed"] == [b"x", "y", None]
    assert out["nulls"] == [None, None]
    assert out["id"].tolist() == list(range(40))


def test_a_worker_state_refuses_another_layout(ids_ds: str) -> None:
    ds = skt.ShardkitIterableDataset(ids_ds, batch_size=32, columns=["id"])
    state = ds.state_dict()
    assert state["num_workers"] == 1
    assert state["worker"] == 0
    with pytest.raises(AdapterError, match="job_state"):
        ds.load_state_dict({**state, "num_workers": 2})
    with pytest.raises(AdapterError, match="no ShardkitIterableDataset state"):
        skt.job_state({"nothing": 1})


# ---- torchdata's StatefulDataLoader ------------------------------------------------------------------

# torchdata 0.11 (its latest) calls torch.set_vital, which torch 2.13 deprecates: their warning, not ours
_TORCHDATA_WARNING = "ignore:'set_vital' is deprecated:UserWarning"


def _stateful(ds: Any, state: dict[str, Any] | None = None) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    dl = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    if state is not None:
        dl.load_state_dict(state)
    return dl


def _rank_ds(url: str, rank: int, world: int = 2) -> Any:
    return skt.ShardkitIterableDataset(url, rank=rank, world_size=world, batch_size=16, columns=["id"],
                                       seed=7, workers=1)


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings(_TORCHDATA_WARNING)
@pytest.mark.usefixtures("reap")
@pytest.mark.parametrize("steps", [3, 4, 15])  # 15 of 16: worker 0 has read its last batch, worker 1 not
def test_stateful_dataloader_resumes_each_rank_exactly(ids_ds: str, steps: int) -> None:
    whole = [_dl_ids(None, 2, loader=_stateful(_rank_ds(ids_ds, rank))) for rank in range(2)]
    dl = _stateful(_rank_ds(ids_ds, 0))
    first = _dl_ids(None, 2, steps=steps, loader=dl)
    saved = dl.state_dict()
    del dl
    for rank in range(2):  # rank 0's own state, and rank 0's state loaded on rank 1: ranks step together
        rest = _dl_ids(None, 2, loader=_stateful(_rank_ds(ids_ds, rank), saved))
        got = [*first, *rest] if rank == 0 else [*whole[1][:steps], *rest]
        assert len(got) == len(whole[rank])
        for g, w in zip(got, whole[rank], strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings(_TORCHDATA_WARNING)
@pytest.mark.usefixtures("reap")
@pytest.mark.parametrize("steps", [3, 4])
def test_job_state_resumes_on_another_world_size_and_worker_count(ids_ds: str, steps: int) -> None:
    seen: Counter[int] = Counter()
    saved = None
    for rank in range(2):  # the old job: 2 ranks x 2 workers, `steps` steps each
        dl = _stateful(_rank_ds(ids_ds, rank))
        seen.update(int(i) for b in _dl_ids(None, 2, steps=steps, loader=dl) for i in b)
        saved = saved or dl.state_dict()
        del dl
    state = skt.job_state(saved)
    for rank in range(2):  # the new job: 2 ranks x no workers (2 shards instead of 4; both divide the rest)
        ds = _rank_ds(ids_ds, rank, world=2)
        ds.load_state_dict(state)
        seen.update(int(i) for b in _dl_ids(ds, 0) for i in b)
    assert_exactly_once(seen.elements(), N_IDS)  # what each worker delivered is left out: exact


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("reap")
def test_workers_forked_after_this_process_sent_a_batch_use_segments_of_their_own(ids_ds: str) -> None:
    from multiprocessing.reduction import ForkingPickler

    from shardkit.reader.adapters.torch_workers import _WorkerBatch

    sent = pickle.loads(ForkingPickler.dumps(_WorkerBatch({"x": torch.arange(10)})))  # this process's segment
    assert sent["x"].tolist() == list(range(10))
    ds = skt.ShardkitIterableDataset(ids_ds, rank=0, world_size=1, batch_size=8, columns=["id"])
    for _ in range(2):
        assert_exactly_once(np.concatenate(_dl_ids(ds, 2)), N_IDS)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("reap")
def test_a_worker_killed_mid_epoch_fails_the_loader_and_leaves_its_batches_whole(ids_ds: str) -> None:
    from torch.utils.data import DataLoader

    kw = {"batch_size": 16, "seed": 8, "columns": ["id"]}
    with shardkit.make_reader(ids_ds, **kw) as reader:
        want = [b["id"].copy() for b in reader]
    ds = skt.ShardkitIterableDataset(ids_ds, rank=0, world_size=1, **kw)
    it = iter(DataLoader(ds, batch_size=None, num_workers=1))
    got = [next(it) for _ in range(3)]
    assert all(_in_segment(b["id"]) for b in got)
    (worker,) = it._workers  # the DataLoader's own worker process

    def kill_then_read_on(batches: Any) -> None:  # torch's SIGCHLD handler raises, at once or next batch
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        for _ in batches:
            pass

    # "worker (pid N) is killed by signal" or "worker (pid(s) N) exited unexpectedly", as it happens
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid(\(s\))? {worker.pid}\)"):
        kill_then_read_on(it)
    for b, w in zip(got, want, strict=False):  # the dead worker's segments stay mapped while in use
        np.testing.assert_array_equal(b["id"].numpy(), w)
    del it
    assert_exactly_once(np.concatenate(_dl_ids(ds, 2)), N_IDS)  # a new pass reads everything again
    assert str(worker.pid) not in {t.split("-")[0] for t in _tokens()}  # and its segments were let go


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3 << 20), offset=st.integers(0, 7))
def test_the_staging_host_copy_copies_every_byte_in_pieces_or_whole(n: int, offset: int) -> None:
    """The CUDA stager's host copy into pinned memory (numpy's, split over threads past 2 MiB)."""
    src = np.random.default_rng(n).integers(0, 256, n + offset, dtype=np.uint8)[offset:]
    dst = np.zeros(n + 3, np.uint8)
    reader_torch._host_copy(dst[:n], src)
    np.testing.assert_array_equal(dst[:n], src)
    assert not dst[n:].any()  # nothing past the end


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8, torch.bool, torch.float16])
def test_the_stager_sends_numpy_dtypes_as_bytes_and_leaves_the_rest_to_torch(dtype: torch.dtype) -> None:
    t = torch.arange(24).reshape(2, 3, 4).to(dtype)
    flat = reader_torch._flat_bytes(t)
    assert flat is not None
    assert flat.dtype == np.uint8
    assert flat.nbytes == t.numel() * t.element_size()
    assert flat.tobytes() == t.numpy().tobytes()
    assert reader_torch._flat_bytes(t.transpose(0, 2)) is None  # strided: torch's copy_
    assert reader_torch._flat_bytes(t.to(torch.bfloat16)) is None  # no numpy dtype


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("reap")
@pytest.mark.parametrize(("world", "workers", "fits"), [(1, 6, "num_workers <= 5"),
                                                        (2, 3, "num_workers <= 2 (or fewer ranks)")])
def test_more_dataloader_workers_than_rows_names_num_workers_the_ranks_and_what_fits(
        tmp_path: Path, world: int, workers: int, fits: str) -> None:
    url = str(tmp_path / "five")
    shardkit.write_dataset({"id": np.arange(5)}, url)
    ds = skt.ShardkitIterableDataset(url, rank=0, world_size=world, batch_size=1)
    with warnings.catch_warnings():  # more workers than this machine's suggested maximum: the point here
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        iterator = iter(loader)
    with pytest.raises(AdapterError) as caught:
        list(iterator)
    iterator._shutdown_workers()  # the others, still waiting for work (reap would SIGKILL them)
    message = str(caught.value)
    assert f"num_workers={workers}" in message
    assert f"on {world} rank(s)" in message
    assert f"{world * workers} shards" in message
    assert "5 samples" in message
    assert fits in message
    assert "num_workers=0" in message


def test_forked_workers_read_a_plain_parquet_folder_with_the_schema_hints_given_once(tmp_path: Path) -> None:
    """The workers read the dataset the main process opened with its ``schema=`` hints: a list column
    hinted as a (2, 3) tensor comes as one, every row once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "plain"
    folder.mkdir()
    ids = np.arange(120, dtype=np.int64)
    emb = [list(np.arange(6, dtype=np.float32) + i) for i in ids]
    pq.write_table(pa.table({"id": ids, "emb": pa.array(emb, pa.list_(pa.float32()))}),
                   folder / "part-0.parquet", row_group_size=30)
    shardkit.write_summary(str(folder))
    hints = [shardkit.Field("emb", "float32", (2, 3))]
    ds = skt.ShardkitIterableDataset(str(folder), batch_size=10, seed=0, schema=hints)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    seen = []
    for batch in loader:
        assert tuple(batch["emb"].shape[1:]) == (2, 3)
        np.testing.assert_array_equal(batch["emb"].numpy().reshape(-1, 6)[:, 0], batch["id"].numpy())
        seen += batch["id"].tolist()
    assert sorted(seen) == list(range(120))
