"""Checkpoints: bitwise resume, local and memory URLs, keep, every corruption, hostile pickles, SIGKILL
mid-save, TensorFlow, and the save schedule."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardkit
from shardkit.errors import CheckpointError, CheckpointWarning, ConfigError, CorruptCheckpointError
from shardkit.trainer.checkpoint import CheckpointManager, _load
from tests.reader import conftest as s3_fixtures
from tests.reader.conftest import S3Server
from tests.trainer.helpers import Counter, linear, weight_of

REPO = Path(__file__).resolve().parents[2]
# the moto S3 server on loopback and a fresh bucket per test (tests/reader/conftest.py)
s3_server, s3_bucket, no_internet = s3_fixtures.s3_server, s3_fixtures.s3_bucket, s3_fixtures.no_internet


# ---------------------------------------------------------------------------------------------- helpers


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterator[dict[str, Any]],
          steps: int) -> list[int]:
    """``steps`` steps that draw from all three global RNGs (noise, scale, dropout); returns the ids seen."""
    seen: list[int] = []
    for _ in range(steps):
        batch = next(batches)
        seen.extend(batch["id"].tolist())
        x = torch.from_numpy(batch["x"]) + 0.05 * torch.randn(len(batch["id"]), 4)
        x = x * float(np.random.uniform(0.9, 1.1)) * (1.0 + 0.01 * random.random())
        loss = nn.functional.cross_entropy(model(x), torch.from_numpy(batch["y"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return seen


def same_tensors(a: Any, b: Any) -> bool:
    """Bitwise equality of nested state dicts."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """96 rows, 6 row groups: ``id``, ``x`` (float32[4]) and a label ``y`` in 0..2."""
    url = str(tmp_path_factory.mktemp("ckpt-data") / "ds")
    rng = np.random.default_rng(0)
    n = 96
    shardkit.write_dataset({"id": np.arange(n), "x": rng.normal(size=(n, 4)).astype(np.float32),
                            "y": (np.arange(n) % 3).astype(np.int64)}, url, row_group_size=16, progress=False)
    return url


@pytest.fixture(params=["local", "memory"])
def ckpt_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    yield url
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


# ------------------------------------------------------------------------------------- resume, bitwise


@pytest.mark.parametrize(("ckpt_url", "rng"), [("local", True), ("memory", True), ("local", False)],
                         indirect=["ckpt_url"])
def test_resume_continues_bitwise_like_an_uninterrupted_run(dataset: str, ckpt_url: str, rng: bool) -> None:
    total, cut = 30, 17  # 12 steps per epoch: the cut is mid-epoch 2
    seed_all(0)
    model, reader = tiny_model(), shardkit.make_reader(dataset, batch_size=8, seed=3, num_epochs=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ids_full = train(model, opt, iter(reader), total)
    reader.close()

    seed_all(0)
    first, reader = tiny_model(), shardkit.make_reader(dataset, batch_size=8, seed=3, num_epochs=3)
    first_opt = torch.optim.Adam(first.parameters(), lr=0.01)
    ids_before = train(first, first_opt, iter(reader), cut)
    ckpt = CheckpointManager(ckpt_url)
    url = ckpt.save(cut, model=first, optimizer=first_opt, reader=reader, extra={"note": "mid-epoch"})
    reader.close()
    assert url == f"{ckpt_url}/step-{cut:09d}"

    seed_all(12345)  # another process: other weights, other RNG states, a fresh reader
    model2, reader2 = tiny_model(), shardkit.make_reader(dataset, batch_size=8, seed=3, num_epochs=3)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    restored = CheckpointManager(ckpt_url).restore(model=model2, optimizer=opt2, reader=reader2, rng=rng)
    assert restored is not None
    assert (restored.step, restored.url, dict(restored.extra)) == (cut, url, {"note": "mid-epoch"})
    ids_after = train(model2, opt2, iter(reader2), total - cut)
    reader2.close()

    assert ids_before + ids_after == ids_full  # the data stream continues where it stopped
    bitwise = same_tensors(model.state_dict(), model2.state_dict()) and same_tensors(
        opt.state_dict()["state"], opt2.state_dict()["state"])
    # Without the RNG states the dropout masks and noise differ: the check above can fail.
    assert bitwise is rng


def test_ddp_style_wrapper_saves_plain_keys(tmp_path: Path) -> None:
    wrapped = nn.DataParallel(linear(1.5))  # has `.module`, like DistributedDataParallel
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(1, model=wrapped)
    keys = torch.load(tmp_path / "step-000000001" / "model.pt", weights_only=True).keys()
    assert sorted(keys) == ["bias", "weight"]
    bare = linear(0.0)
    ckpt.restore(model=bare)
    assert weight_of(bare) == 1.5


class _Backbone(nn.Module):
    """An ordinary model that names a submodule ``module`` (no wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)


def test_only_real_wrappers_are_unwrapped(tmp_path: Path) -> None:
    from torch.optim.swa_utils import AveragedModel

    trained = _Backbone()
    with torch.no_grad():
        for p in trained.parameters():
            p.fill_(0.5)
    ckpt = CheckpointManager(tmp_path / "a")
    ckpt.save(1, model=trained)
    saved = torch.load(tmp_path / "a" / "step-000000001" / "model.pt", weights_only=True)
    assert sorted(saved) == ["head.bias", "head.weight", "module.bias", "module.weight"]
    fresh = _Backbone()
    ckpt.restore(model=fresh)
    assert same_tensors(fresh.state_dict(), trained.state_dict())

    swa = AveragedModel(nn.Linear(3, 3))  # `.module` inside, its `n_averaged` buffer on the wrapper
    for _ in range(5):
        swa.update_parameters(swa.module)
    CheckpointManager(tmp_path / "b").save(5, model=swa)
    fresh_swa = AveragedModel(nn.Linear(3, 3))
    CheckpointManager(tmp_path / "b").restore(model=fresh_swa)
    assert int(fresh_swa.n_averaged) == 5
    assert same_tensors(fresh_swa.state_dict(), swa.state_dict())

    with warnings.catch_warnings():  # importing dynamo imports torch's own deprecated jit code
        warnings.filterwarnings("ignore", r".*torch\.jit\.script_method.* is deprecated", DeprecationWarning)
        compiled = torch.compile(nn.DataParallel(linear(2.5)))  # a compiled wrapper of a wrapper: both opened
    CheckpointManager(tmp_path / "c").save(1, model=compiled)
    keys = torch.load(tmp_path / "c" / "step-000000001" / "model.pt", weights_only=True).keys()
    assert sorted(keys) == ["bias", "weight"]
    bare = linear(0.0)
    CheckpointManager(tmp_path / "c").restore(model=bare)
    assert weight_of(bare) == 2.5


def test_commit_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    model = linear(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    CheckpointManager(tmp_path).save(7, model=model, optimizer=opt, extra={"a": [1, 2]})
    folder = tmp_path / "step-000000007"
    commit = json.loads((folder / "COMMIT").read_text())
    assert (commit["version"], commit["step"], commit["framework"]) == (1, 7, "torch")
    assert sorted(commit["files"]) == ["model.pt", "optimizer.pt", "state.json"]
    for name, meta in commit["files"].items():
        data = (folder / name).read_bytes()
        assert meta == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert sorted(p.name for p in folder.iterdir()) == ["COMMIT", "model.pt", "optimizer.pt", "state.json"]
    state = json.loads((folder / "state.json").read_text())
    assert state["step"] == 7
    assert state["extra"] == {"a": [1, 2]}
    assert set(state["rng"]) >= {"python", "numpy", "torch"}


def test_a_save_without_commit_is_restored_only_once_committed(tmp_path: Path) -> None:
    """``ctx.step``'s saves: written at the step, committed when the script is done with it; until then
    a restore (another process's) takes the one before, and a save of a later step commits it first."""
    ckpt = CheckpointManager(tmp_path, keep=2)
    ckpt.save(1, reader=Counter(1))
    url = ckpt.save(2, reader=Counter(2), commit=False)
    assert ckpt.pending == 2
    assert [i.step for i in ckpt.list()] == [1]
    counter = Counter()
    with pytest.warns(CheckpointWarning, match="step-000000002"):
        restored = CheckpointManager(tmp_path).restore(reader=counter)
    assert restored is not None
    assert (restored.step, counter.value) == (1, 1)
    assert ckpt.commit_pending() == url
    assert (ckpt.pending, ckpt.commit_pending()) == (None, None)
    assert [i.step for i in ckpt.list()] == [1, 2]
    ckpt.save(3, reader=Counter(3), commit=False)
    ckpt.save(4, reader=Counter(4))
    assert [i.step for i in ckpt.list()] == [3, 4]  # keep=2
    ckpt.save(5, reader=Counter(5), commit=False)
    ckpt.discard_pending()  # a process failing before its step was over: the folder stays uncommitted
    assert [i.step for i in ckpt.list()] == [3, 4]
    assert ckpt.newest_folder() == 5


def test_saving_a_step_again_replaces_it(ckpt_url: str) -> None:
    ckpt = CheckpointManager(ckpt_url)
    ckpt.save(1, model=linear(1.0))
    ckpt.save(2, model=linear(2.0))
    ckpt.save(2, model=linear(3.0))  # a restarted run reaching step 2 again
    assert [i.step for i in ckpt.list()] == [1, 2]
    model = linear(0.0)
    assert ckpt.restore(model=model) is not None
    assert weight_of(model) == 3.0


def test_not_json_extra_fails_before_writing(tmp_path: Path) -> None:
    ckpt = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"extra is not JSON.*never pickle"):
        ckpt.save(1, model=linear(1.0), extra={"when": object()})
    assert not (tmp_path / "step-000000001").exists()


def test_extra_keys_must_be_strings(tmp_path: Path) -> None:
    ckpt = CheckpointManager(tmp_path)
    cases = [({"best_by_epoch": {3: 0.91}}, r"extra\['best_by_epoch'\] has the key 3 \(int\), which JSON "
              r"turns into the string '3'; use str keys"),
             ({"runs": [{"a": 1}, {True: "flag"}]},
              r"extra\['runs'\]\[1\] has the key True \(bool\), .*'true'"),
             ({None: 1}, r"extra has the key None \(NoneType\), which JSON turns into the string 'null'"),
             ({(1, 2): 1}, r"extra has the key \(1, 2\) \(tuple\), which JSON cannot hold")]
    for extra, message in cases:
        with pytest.raises(CheckpointError, match=message):
            ckpt.save(1, extra=extra)
    assert not (tmp_path / "step-000000001").exists()
    ckpt.save(1, extra={"shape": (2, 3), "nested": {"k": [(1, {"x": 2})]}})  # tuples: saved as lists
    restored = ckpt.restore()
    assert restored is not None
    assert restored.extra == {"shape": [2, 3], "nested": {"k": [[1, {"x": 2}]]}}


def test_numpy_scalars_in_torch_state_come_back_as_python_numbers(tmp_path: Path) -> None:
    model = linear(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    lr = 0.1 * 0.5 * (1 + np.cos(np.pi * 3 / 30))  # a cosine schedule computed with numpy: np.float64
    opt.param_groups[0]["lr"] = lr
    opt.param_groups[0]["dampening"] = np.int64(0)
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(3, model=model, optimizer=opt)
    fresh = linear(0.0)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # restored, not skipped as corrupt
        restored = ckpt.restore(model=fresh, optimizer=fresh_opt)
    assert restored is not None
    assert restored.step == 3
    group = fresh_opt.param_groups[0]
    assert (type(group["lr"]), group["lr"], type(group["dampening"])) == (float, float(lr), int)
    assert same_tensors(fresh_opt.state_dict()["state"], opt.state_dict()["state"])
    assert type(opt.param_groups[0]["lr"]) is np.float64  # the optimizer saved is not changed


class _Vocab(nn.Module):
    """A module with extra state (``get_extra_state``), which holds ``ids``."""

    def __init__(self, ids: Any) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 2)
        self.ids = ids

    def get_extra_state(self) -> Any:
        return {"ids": self.ids}

    def set_extra_state(self, state: Any) -> None:
        if len(state["ids"]) != len(self.ids):
            raise ValueError(f"a vocabulary of {len(state['ids'])} ids, this model has {len(self.ids)}")
        self.ids = state["ids"]


class _Tag:
    """A class of the script's own, which torch's weights_only load refuses unless it is registered."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_state_that_weights_only_refuses_fails_before_writing(tmp_path: Path) -> None:
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(1, model=_Vocab([0, 1, 2, 3, 4]))
    with pytest.raises(CheckpointError, match=(
            r"step-000000002/model.pt: model.state_dict\(\)\['_extra_state'\]\['ids'\] is a numpy.ndarray "
            r".*torch.load\(weights_only=True\) refuses.*Convert it to a torch tensor, a list or a Python "
            r"number, or register its class with torch.serialization.add_safe_globals")):
        ckpt.save(2, model=_Vocab(np.arange(5)))  # an array is not silently turned into a tensor
    model = linear(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["tag"] = [_Tag("warmup")]
    with pytest.raises(CheckpointError, match=r"optimizer.state_dict\(\)\['param_groups'\]\[0\]\['tag'\]"
                                              r"\[0\] is a tests.trainer.test_checkpoint._Tag"):
        ckpt.save(2, optimizer=opt)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000001"]  # nothing written
    restored = ckpt.restore(model=_Vocab([9] * 5))
    assert restored is not None
    assert restored.step == 1
    with torch.serialization.safe_globals([_Tag]):  # registered: saved and restored
        ckpt.save(2, optimizer=opt)
        fresh = torch.optim.SGD(linear(0.0).parameters(), lr=0.1)
        assert ckpt.restore(optimizer=fresh) is not None
    assert fresh.param_groups[0]["tag"][0].name == "warmup"


def test_refused_file_warning_says_what_to_do(tmp_path: Path) -> None:
    ckpt, fs, newest = _two_checkpoints(str(tmp_path))
    state = linear(2.0).state_dict()
    state["_extra_state"] = np.arange(3)  # as shardkit saved it before it checked
    _rewrite_commit(fs, newest, "model.pt", _torch_bytes(state))
    with pytest.warns(CheckpointWarning) as record:
        restored = ckpt.restore(model=linear(0.0))
    assert restored is not None
    assert restored.step == 1
    message = str(record[0].message)
    assert "model.pt is not a torch state dict that loads with weights_only=True" in message
    assert "a numpy array: older shardkit versions saved such states" in message
    assert "If you did not write it" not in message


def test_restore_into_another_architecture_raises_instead_of_falling_back(tmp_path: Path) -> None:
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(1, model=linear(1.0))
    with pytest.raises(CheckpointError, match=r"model.pt of checkpoint .*step-000000001 does not fit"):
        ckpt.restore(model=nn.Linear(5, 2))
    with pytest.raises(CheckpointError, match=r"has no optimizer.pt: it was saved without optimizer="):
        ckpt.restore(model=linear(0.0), optimizer=torch.optim.SGD(linear(0.0).parameters(), lr=0.1))


class _Two(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(2, n)


def _filled(module: nn.Module, value: float) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)
    return module


def test_restore_that_does_not_fit_changes_no_object(tmp_path: Path, dataset: str) -> None:
    other = str(tmp_path / "other")
    shardkit.write_dataset({"id": np.arange(80)}, other, row_group_size=10, progress=False)
    saved = _filled(linear(7.0), 7.0)
    reader = shardkit.make_reader(dataset, batch_size=4, seed=0)
    next(iter(reader))
    ckpt = CheckpointManager(tmp_path / "ckpt")
    ckpt.save(5, model=saved, optimizer=torch.optim.SGD(saved.parameters(), lr=0.1), reader=reader)
    reader.close()

    def unchanged(model: nn.Module) -> bool:
        return all(bool(torch.all(p == 1.0)) for p in model.parameters())

    # a reader of another dataset: its own load refuses it, before the model is touched
    model = _filled(linear(1.0), 1.0)
    with shardkit.make_reader(other, batch_size=4, seed=0) as wrong_reader:
        with pytest.raises(CheckpointError, match=r"reader state of checkpoint .*-000000005 does not fit"):
            CheckpointManager(tmp_path / "ckpt").restore(model=model, reader=wrong_reader)
        assert unchanged(model)

    # an optimizer with another layout of param groups: the model and the reader keep their state
    model = _filled(linear(1.0), 1.0)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.5)
    with shardkit.make_reader(dataset, batch_size=4, seed=0) as fresh_reader:
        before = fresh_reader.state_dict()
        with pytest.raises(CheckpointError, match=(r"the optimizer.pt of checkpoint .*step-000000005 does "
                                                   r"not fit this SGD \(its param groups hold \[2\] "
                                                   r"parameters, this optimizer's \[1, 1\]\)")):
            CheckpointManager(tmp_path / "ckpt").restore(model=model, optimizer=opt, reader=fresh_reader)
        assert fresh_reader.state_dict() == before
    assert unchanged(model)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]

    # a layer of another shape: torch would copy the layers that fit before raising
    ckpt = CheckpointManager(tmp_path / "two")
    ckpt.save(6, model=_filled(_Two(2), 7.0))
    two = _filled(_Two(5), 1.0)
    with pytest.raises(CheckpointError, match=r"model.pt of checkpoint .*step-000000006 does not fit this "
                                              r"_Two \('b.bias' has the shape \[2\] in the checkpoint, "
                                              r"\[5\] here and 1 more\)"):
        ckpt.restore(model=two)
    assert unchanged(two)
    with pytest.raises(CheckpointError, match=r"keys missing from the checkpoint: 'c.bias', 'c.weight'; keys "
                                              r"this model lacks: 'b.bias', 'b.weight'"):
        ckpt.restore(model=nn.ModuleDict({"a": nn.Linear(3, 2), "c": nn.Linear(2, 2)}))


def test_reader_is_put_back_when_the_model_then_fails(tmp_path: Path) -> None:
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(4, model=_Vocab([0, 1, 2, 3, 4]), reader=Counter(40))
    reader = Counter(7)
    model = _Vocab([0, 1, 2])  # same keys and shapes, but its set_extra_state refuses the saved state
    with pytest.raises(CheckpointError, match=r"model.pt of checkpoint .*does not fit this _Vocab \(a "
                                              r"vocabulary of 5 ids, this model has 3\)"):
        ckpt.restore(model=model, reader=reader)
    assert reader.value == 7
    ok = Counter(7)
    assert ckpt.restore(model=_Vocab([5, 6, 7, 8, 9]), reader=ok) is not None
    assert ok.value == 40


def test_bad_arguments_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.keep=0"):
        CheckpointManager("memory://x", keep=0)
    with pytest.raises(ConfigError, match=r"checkpoint.every_steps=0"):
        CheckpointManager("memory://x", every_steps=0)
    with pytest.raises(ConfigError, match=r"checkpoint.every_seconds=-1"):
        CheckpointManager("memory://x", every_seconds=-1)
    with pytest.raises(CheckpointError, match=r"model= takes a torch.nn.Module, not dict; for a Keras"):
        CheckpointManager("memory://x").save(1, model={"w": 1})  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"checkpoint step -1 under memory://x"):
        CheckpointManager("memory://x").save(-1)


# ------------------------------------------------------------------------------------------------- keep


def test_keep_k_newest_and_clear_leftovers(ckpt_url: str) -> None:
    ckpt = CheckpointManager(ckpt_url, keep=3)
    fs, root = fsspec.core.url_to_fs(ckpt_url)
    for step in range(1, 5):
        ckpt.save(step, model=linear(step))
    for step, data in ((2, b"x"), (9, b"partial")):  # a leftover, uncommitted; a save in progress
        fs.makedirs(f"{root}/step-00000000{step}", exist_ok=True)
        fs.pipe_file(f"{root}/step-00000000{step}/model.pt", data)
    ckpt.save(5, model=linear(5))
    assert [i.step for i in ckpt.list()] == [3, 4, 5]
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert names == ["step-000000003", "step-000000004", "step-000000005", "step-000000009"]
    latest = ckpt.latest()
    assert latest is not None
    assert latest.step == 5


def test_restore_at_most_a_step_takes_no_newer_checkpoint(tmp_path: Path) -> None:
    ckpt = CheckpointManager(tmp_path, keep=None)
    for step in (5, 10, 15):
        ckpt.save(step, model=linear(step))
    model = linear(0.0)

    restored = ckpt.restore(model=model, at_most=12)

    assert restored is not None
    assert restored.step == 10
    assert weight_of(model) == 10.0
    assert ckpt.restore(model=model, at_most=0) is None  # the attempt started with none
    newest = ckpt.restore(model=model)
    assert newest is not None
    assert newest.step == 15


def test_keep_none_keeps_all_but_deletes_broken_older_folders(tmp_path: Path) -> None:
    ckpt = CheckpointManager(tmp_path, keep=None)
    for step in range(1, 5):
        ckpt.save(step)
    (tmp_path / "step-000000002" / "COMMIT").unlink()  # uncommitted leftover of a killed save
    (tmp_path / "step-000000003" / "state.json").write_bytes(b"{}")  # damaged
    (tmp_path / "step-000000009").mkdir()  # a later save in progress
    ckpt.save(5)
    assert [i.step for i in ckpt.list()] == [1, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000000001", "step-000000004", "step-000000005", "step-000000009"]


def test_empty_folder() -> None:
    ckpt = CheckpointManager(f"memory://nothing-{uuid.uuid4().hex[:8]}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.restore(model=linear(0.0)) is None  # a fresh start warns about nothing
    assert ckpt.list() == []
    assert ckpt.latest() is None
    with pytest.raises(CheckpointError, match=r"no checkpoint under memory://nothing"):
        ckpt.restore(required=True)


# ------------------------------------------------------------------------------------------- corruption


def _rewrite_commit(fs: Any, folder: str, name: str, data: bytes) -> None:
    """Replace a file AND fix its COMMIT entry, as an attacker (or a buggy tool) would."""
    fs.pipe_file(f"{folder}/{name}", data)
    commit = json.loads(fs.cat_file(f"{folder}/COMMIT"))
    commit["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    fs.pipe_file(f"{folder}/COMMIT", json.dumps(commit).encode())


def _flip_byte(fs: Any, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def _state_doc(step: int, rng: Any = None) -> bytes:
    return json.dumps({"version": 1, "step": step, "reader": None, "rng": rng, "extra": {}}).encode()


CORRUPTIONS: dict[str, tuple[Callable[[Any, str], None], str]] = {
    "missing COMMIT": (lambda fs, d: fs.rm_file(f"{d}/COMMIT"), r"COMMIT is missing: the save of step 2"),
    "COMMIT not JSON": (lambda fs, d: fs.pipe_file(f"{d}/COMMIT", b'{"version": 1, "st'),
                        r"COMMIT is not JSON"),
    "COMMIT of another step": (
        lambda fs, d: fs.pipe_file(f"{d}/COMMIT", b'{"version": 1, "step": 3, "files": {}}'),
        r"not a version-1 commit of step 2"),
    "truncated file": (lambda fs, d: fs.pipe_file(f"{d}/model.pt", fs.cat_file(f"{d}/model.pt")[:100]),
                       r"model.pt has 100 bytes, .*COMMIT says \d+ \(truncated\?\)"),
    "checksum mismatch": (lambda fs, d: _flip_byte(fs, f"{d}/optimizer.pt"),
                          r"optimizer.pt does not match its COMMIT .*changed or damaged"),
    "missing file": (lambda fs, d: fs.rm_file(f"{d}/state.json"),
                     r"state.json is listed in .*COMMIT but missing"),
    "state not JSON": (lambda fs, d: _rewrite_commit(fs, d, "state.json", b"{nope"),
                       r"state.json is not a valid"),
    "state of another step": (
        lambda fs, d: _rewrite_commit(fs, d, "state.json", _state_doc(5)),
        r"holds step 5, its commit says step 2"),
    "bad rng state": (
        lambda fs, d: _rewrite_commit(fs, d, "state.json", _state_doc(2, {"numpy": {"kind": "MT19937"}})),
        r"rng.numpy is not a numpy MT19937 state"),
    "tensor file replaced by a non-dict": (
        lambda fs, d: _rewrite_commit(fs, d, "model.pt", _torch_bytes(torch.zeros(3))),
        r"holds a Tensor, not a state"),
    "torch file of garbage": (lambda fs, d: _rewrite_commit(fs, d, "model.pt", b"\x80\x04garbage" * 50),
                              r"model.pt is not a torch state dict that loads with weights_only=True"),
}


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _two_checkpoints(url: str) -> tuple[CheckpointManager, Any, str]:
    ckpt = CheckpointManager(url)
    for step, value in ((1, 1.0), (2, 2.0)):
        model = linear(value)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ckpt.save(step, model=model, optimizer=opt, extra={"value": value})
    fs, root = fsspec.core.url_to_fs(url)
    return ckpt, fs, f"{root}/step-000000002"


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_broken_newest_falls_back_to_the_previous(ckpt_url: str, case: str) -> None:
    ckpt, fs, newest = _two_checkpoints(ckpt_url)
    damage, why = CORRUPTIONS[case]
    damage(fs, newest)
    model = linear(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(CheckpointWarning, match=rf"skipping checkpoint {ckpt_url}/step-000000002: .*{why}"):
        restored = ckpt.restore(model=model, optimizer=opt)
    assert restored is not None
    assert restored.step == 1
    assert restored.extra == {"value": 1.0}
    assert weight_of(model) == 1.0


def test_none_usable_returns_none_with_a_warning_or_raises_when_required(tmp_path: Path) -> None:
    ckpt, fs, newest = _two_checkpoints(str(tmp_path))
    fs.rm_file(f"{newest}/COMMIT")
    _flip_byte(fs, str(tmp_path / "step-000000001" / "model.pt"))
    with pytest.warns(CheckpointWarning) as record:
        assert ckpt.restore(model=linear(0.0)) is None
    assert [str(w.message).split(":")[0] for w in record] == [
        f"skipping checkpoint {tmp_path}/step-000000002", f"skipping checkpoint {tmp_path}/step-000000001",
        f"none of the 2 checkpoints under {tmp_path} verifies; starting from scratch"]
    with pytest.warns(CheckpointWarning), pytest.raises(CorruptCheckpointError, match=r"none of the 2"):
        ckpt.restore(model=linear(0.0), required=True)


# ------------------------------------------------------------------------------------- hostile pickles


class _Evil:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(("name", "kind"), [("model.pt", "torch.save zip"), ("optimizer.pt", "raw pickle")])
def test_malicious_pickle_never_runs(tmp_path: Path, name: str, kind: str) -> None:
    def craft(marker: Path) -> bytes:
        evil = {"weight": _Evil(marker)}
        return _torch_bytes(evil) if kind == "torch.save zip" else pickle.dumps(evil)

    # The payload is live: loaded unrestricted, the same construction creates its marker.
    probe = tmp_path / "probe"
    if kind == "raw pickle":
        pickle.loads(craft(probe))
    else:
        torch.load(io.BytesIO(craft(probe)), weights_only=False)
    assert probe.exists()

    marker = tmp_path / "pwned"
    payload = craft(marker)

    ckpt_dir = tmp_path / "ckpt"
    ckpt, fs, newest = _two_checkpoints(str(ckpt_dir))
    _rewrite_commit(fs, newest, name, payload)  # a valid-looking commit: sizes and sha256 match
    model = linear(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(CheckpointWarning, match=rf"{name} is not a torch state dict .*weights_only=True"):
        restored = ckpt.restore(model=model, optimizer=opt)
    assert restored is not None
    assert restored.step == 1
    assert weight_of(model) == 1.0
    fs.rm(str(ckpt_dir / "step-000000001"), recursive=True)
    with pytest.warns(CheckpointWarning), pytest.raises(CorruptCheckpointError):
        ckpt.restore(model=model, optimizer=opt, required=True)
    assert not marker.exists()


# ------------------------------------------------------------------------------------- overlapping saves


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_overlapping_saves_into_one_local_folder_each_commit_a_verified_checkpoint(tmp_path: Path) -> None:
    """Two processes that both save (``writer=True`` on two ranks by mistake) the same steps at once:
    their saves take turns, so every URL a save returned holds a checkpoint that verifies, sha256 too."""
    import multiprocessing

    from tests.trainer.scripts import concurrent_saves

    url, steps = str(tmp_path / "ckpt"), 15
    spawn = multiprocessing.get_context("spawn")
    barrier, out = spawn.Barrier(2), spawn.Queue()
    procs = [spawn.Process(target=concurrent_saves.save, args=(url, rank, steps, barrier, out))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        results = dict(out.get(timeout=100) for _ in procs)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert all(error is None for rank in results for _, _, error in results[rank]), results
    urls = {u for rank in results for _, u, _ in results[rank]}
    assert urls == {f"{url}/step-{s:09d}" for s in range(1, steps + 1)}
    ckpt = CheckpointManager(url)
    assert [i.step for i in ckpt.list()] == list(range(1, steps + 1))
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [f"step-{s:09d}" for s in range(1, steps + 1)]  # no lock file left
    for step in range(1, steps + 1):  # every file against its COMMIT's size and sha256, then loaded
        loaded = _load.load(ckpt._store, step, str(tmp_path), model=True, optimizer=False, reader=False,
                            tf=False)
        assert loaded.model is not None
        rank = loaded.state["extra"]["rank"]
        assert bool(torch.all(loaded.model["weight"] == rank)), step  # one writer's files, not a mix
    restored = ckpt.restore(model=nn.Linear(128, 128))
    assert restored is not None
    assert restored.step == steps

def test_a_leftover_lock_file_is_no_checkpoint(tmp_path: Path) -> None:
    """A saver killed while it held the lock leaves its lock file: never listed, pruned or in the way."""
    (tmp_path / "_save.lock").write_bytes(b"")
    ckpt = CheckpointManager(tmp_path, keep=1)
    assert ckpt.list() == []
    for step in (1, 2):
        ckpt.save(step, model=linear(float(step)))
    assert [i.step for i in ckpt.list()] == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002"]  # each save removes it
    with ckpt._store.lock():
        assert (tmp_path / "_save.lock").is_file()
        assert ckpt._store.steps() == [2]


# ------------------------------------------------------------------------------------ SIGKILL mid-save

# A long-lived process that imports torch once and forks one child per save. A child stops itself
# (SIGSTOP) at the k-th line executed inside shardkit.trainer during the save; the zygote, another
# process, then SIGKILLs it. Lines of `_store.write`'s chunk loop are among those points, so kills land
# inside a large tensor's file as well as between files and on either side of COMMIT.
ZYGOTE = r"""
import json, os, signal, sys
import torch
from torch import nn
import shardkit.trainer as package
from shardkit.trainer.checkpoint import _store
from shardkit.trainer.checkpoint import CheckpointManager

_store.CHUNK = 1 << 18  # the 1 MiB weight goes out in 4 writes
OURS = os.path.dirname(package.__file__) + os.sep
url = sys.argv[1]
torch.set_num_threads(1)


def build(value):
    model = nn.Linear(256, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model, opt


MODEL, OPT = build(2.0)  # before any fork: the first optimizer step pays one-off set-up costs


def traced_save(on_line):
    def local(frame, event, arg):
        if event == "line":
            on_line(frame)
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename.startswith(OURS) else None)
    CheckpointManager(url, keep=1).save(2, model=MODEL, optimizer=OPT, extra={"value": 2.0})
    sys.settrace(None)


print("ready", flush=True)
for line in sys.stdin:
    cmd, arg = line.split()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if cmd == "count":
                names = []
                traced_save(lambda frame: names.append(frame.f_code.co_name))
                with open(arg, "w") as f:
                    json.dump(names, f)
            else:
                seen = [0]

                def stop_at_k(frame):
                    seen[0] += 1
                    if seen[0] == int(arg):
                        os.kill(os.getpid(), signal.SIGSTOP)

                traced_save(stop_at_k)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, os.WUNTRACED)
    if os.WIFSTOPPED(status):
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print("killed" if killed else status, flush=True)
    else:
        print("exit", os.waitstatus_to_exitcode(status), flush=True)
"""


def _big(value: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The zygote's `build`: a 1 MiB weight and its momentum buffer, every weight equal to ``value``."""
    model = nn.Linear(256, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model, opt


class Zygote:
    """The running ZYGOTE: ``ask("kill 17")`` -> ``"killed"``; it saves into ``live``."""

    def __init__(self, live: Path) -> None:
        self.live = live
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(live)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.ready = self._line()

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def stop(self) -> None:
        """Kill the zygote and any child it has (one process group), then close the pipes."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("sigkill") / "live")
    try:
        assert z.ready == "ready"
        yield z
    finally:
        z.stop()


@pytest.mark.timeout(120)
@pytest.mark.distributed
@pytest.mark.parametrize("start", ["new step", "same step again"])
def test_sigkill_anywhere_in_a_save_leaves_a_loadable_checkpoint(zygote: Zygote, tmp_path: Path,
                                                                 start: str) -> None:
    import shutil
    from collections import Counter

    pristine, live = tmp_path / "pristine", zygote.live
    values = {1: [1.0], 2: [2.0]}  # what each step may hold after a kill
    setup = CheckpointManager(pristine, keep=None)
    setup.save(1, model=_big(1.0)[0], optimizer=_big(1.0)[1], extra={"value": 1.0})
    if start == "same step again":  # the killed save re-writes a committed step 2
        setup.save(2, model=_big(3.0)[0], optimizer=_big(3.0)[1], extra={"value": 3.0})
        values[2].append(3.0)

    def reset() -> None:
        shutil.rmtree(live, ignore_errors=True)
        shutil.copytree(pristine, live)

    reset()
    assert zygote.ask(f"count {tmp_path / 'lines.json'}") == "exit 0"
    lines = json.loads((tmp_path / "lines.json").read_text())
    total = len(lines)
    rng = random.Random(f"sigkill-{start}")
    buckets = 16
    points = {rng.randrange(1 + i * total // buckets, 1 + (i + 1) * total // buckets) for i in range(buckets)}
    # every line of the commit and of the folder clean-ups, and the very last line
    points |= {i + 1 for i, name in enumerate(lines) if name in ("commit", "begin", "remove")} | {total}
    outcomes: Counter[tuple[int, float]] = Counter()
    model, opt = _big(0.0)
    for k in sorted(points):
        reset()
        assert zygote.ask(f"kill {k}") == "killed", f"the save finished before line {k} of {total}"
        with torch.no_grad():
            model.weight.fill_(0.0)
            model.bias.fill_(0.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = CheckpointManager(live).restore(model=model, optimizer=opt, rng=False)
        assert all(issubclass(w.category, CheckpointWarning) for w in caught), [str(w) for w in caught]
        assert restored is not None, f"no checkpoint after a kill at line {k} ({lines[k - 1]})"
        weight = weight_of(model)
        assert weight in values[restored.step], (k, lines[k - 1])
        assert restored.extra == {"value": weight}, (k, lines[k - 1])  # no files of two saves mixed
        assert bool(torch.all(model.weight == weight))
        assert bool(torch.all(model.bias == weight))
        outcomes[restored.step, weight] += 1
    # The sweep straddles the commit point: some kills left the old state, some the new one.
    assert outcomes[1, 1.0] + outcomes[2, 3.0] > 0, outcomes
    assert outcomes[2, 2.0] > 0, outcomes


# ------------------------------------------------------------------------------------------ TensorFlow


@pytest.mark.tf
def test_tensorflow_checkpoint_round_trip_and_non_writer(ckpt_url: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")

    def build(seed: int) -> tuple[Any, Any, Any]:
        tf.keras.utils.set_random_seed(seed)
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="relu"),
                                     tf.keras.layers.Dense(3)])
        opt = tf.keras.optimizers.Adam(0.01)
        return model, opt, tf.train.Checkpoint(model=model, optimizer=opt)

    def train_tf(model: Any, opt: Any, steps: int) -> None:
        for _ in range(steps):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables,
                                    strict=True))

    model, opt, tf_ckpt = build(0)
    train_tf(model, opt, 3)
    ckpt = CheckpointManager(ckpt_url)
    url = ckpt.save(3, tf_checkpoint=tf_ckpt, extra={"epoch": 0})
    info = ckpt.latest()
    assert info is not None
    assert info.url == url
    assert info.framework == "tensorflow"
    assert sorted(info.files) == ["state.json", "tf/ckpt.data-00000-of-00001", "tf/ckpt.index"]
    train_tf(model, opt, 2)  # the uninterrupted run

    model2, opt2, tf_ckpt2 = build(1)  # other initial weights, optimizer slots not created yet
    restored = CheckpointManager(ckpt_url).restore(tf_checkpoint=tf_ckpt2)
    assert restored is not None
    assert restored.step == 3
    assert restored.extra == {"epoch": 0}
    assert int(opt2.iterations.numpy()) == 3
    train_tf(model2, opt2, 2)
    for a, b in zip(model.get_weights(), model2.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise: Adam's slots were restored too

    # A MultiWorkerMirroredStrategy non-chief: writes (collectives need it), keeps nothing.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert ckpt.save(5, tf_checkpoint=tf_ckpt, writer=False) is None
    assert [i.step for i in ckpt.list()] == [3]
    assert list(scratch.iterdir()) == []

    with pytest.raises(CheckpointError, match=r"has no model.pt: it was saved without model="):
        ckpt.restore(model=linear(0.0))
    other_shape = tf.train.Checkpoint(
        model=tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(5), tf.keras.layers.Dense(3)]))
    with pytest.raises(CheckpointError, match=r"step-000000003/tf does not fit this tf.train.Checkpoint"):
        ckpt.restore(tf_checkpoint=other_shape)
    more_objects = tf.train.Checkpoint(model=build(2)[0], temperature=tf.Variable(1.0))
    with pytest.raises(CheckpointError, match=r"does not hold the objects of this tf.train.Checkpoint"):
        ckpt.restore(tf_checkpoint=more_objects)


# ------------------------------------------------------------------------------------------- schedule


@settings(max_examples=200, deadline=None)
@given(every_steps=st.none() | st.integers(1, 7), every_seconds=st.none() | st.floats(0.5, 5.0),
       start=st.integers(0, 30), gaps=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=60))
def test_due_saves_on_step_multiples_and_after_every_seconds(
        every_steps: int | None, every_seconds: float | None, start: int, gaps: list[float]) -> None:
    ckpt = CheckpointManager("memory://schedule", every_steps=every_steps, every_seconds=every_seconds)
    ckpt.schedule.record(start, 100.0)  # as after a restore of step `start` at time 100
    now, last_save = 100.0, 100.0
    for step, gap in enumerate(gaps, start=start + 1):
        now += gap
        due = ckpt.due(step, now=now)
        assert ckpt.due(step, now=now) is due  # asking changes nothing
        multiple = every_steps is not None and step % every_steps == 0
        late = every_seconds is not None and now - last_save >= every_seconds
        assert due is (multiple or late)
        assert not ckpt.due(ckpt.schedule.last_step, now=now + 1000)  # a saved step is never due again
        if due:
            ckpt.schedule.record(step, now)  # what save() does
            last_save = now
            assert not ckpt.due(step, now=now + 1000)


def test_save_and_restore_move_the_schedule() -> None:
    url = f"memory://sched-{uuid.uuid4().hex[:8]}"
    ckpt = CheckpointManager(url, every_steps=50)
    assert [s for s in range(1, 60) if ckpt.due(s)] == list(range(50, 60))  # due until saved
    ckpt.save(50)
    assert not ckpt.due(50)
    assert not ckpt.due(99)
    assert ckpt.due(100)
    again = CheckpointManager(url, every_steps=50, every_seconds=3600)
    assert again.restore() is not None
    assert not again.due(50)
    assert not again.due(99)
    assert again.due(100)
    assert again.due(51, now=again.schedule.last_time + 3601)
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


# ------------------------------------------------------------------------------------------ S3 protocol


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_s3_round_trip_keep_and_fallback(s3_server: S3Server, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/job/ckpt"
    ckpt = CheckpointManager(url, keep=2, storage_options=s3_server.storage_options)
    for step in (1, 2, 3):
        model = linear(float(step))
        ckpt.save(step, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert [i.url for i in ckpt.list()] == [f"{url}/step-000000002", f"{url}/step-000000003"]
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3_bucket}/job/ckpt")) == [
        "step-000000002", "step-000000003"]
    _flip_byte(fs, f"{s3_bucket}/job/ckpt/step-000000003/model.pt")
    model = linear(0.0)
    with pytest.warns(CheckpointWarning, match=r"step-000000003/model.pt does not match its COMMIT"):
        restored = CheckpointManager(url, storage_options=s3_server.storage_options).restore(model=model)
    assert restored is not None
    assert (restored.step, weight_of(model)) == (2, 2.0)


def test_s3_save_to_a_missing_bucket_creates_none(s3_server: S3Server, s3_bucket: str) -> None:
    """s3fs's makedirs creates a missing bucket: a typo in the URL must fail, not make a bucket."""
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    before = {b["Name"] for b in fs.call_s3("list_buckets")["Buckets"]}
    missing = f"typo-{s3_bucket}"
    ckpt = CheckpointManager(f"s3://{missing}/ckpt", storage_options=s3_server.storage_options)
    with pytest.raises(CheckpointError, match=rf"the bucket s3://{missing} does not exist.*does not create "
                                              "buckets"):
        ckpt.save(1, model=tiny_model())
    assert {b["Name"] for b in fs.call_s3("list_buckets")["Buckets"]} == before
    since = s3_server.mark()
    CheckpointManager(f"s3://{s3_bucket}/ckpt", storage_options=s3_server.storage_options).save(
        1, model=tiny_model())
    puts = [p.split("?")[0] for m, p, _ in s3_server.requests(since) if m == "PUT"]
    assert puts, s3_server.requests(since)
    assert all(p.startswith(f"/{s3_bucket}/ckpt/step-") for p in puts), puts
    assert not [p for p in puts if p.endswith("/")], puts
    assert {b["Name"] for b in fs.call_s3("list_buckets")["Buckets"]} == before
