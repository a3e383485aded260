"""One checkpoint folder in and out: every needed file is verified and deserialized before anything is set."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardkit.errors import CheckpointError, CorruptCheckpointError
from shardkit.trainer.checkpoint import _frameworks as fw
from shardkit.trainer.checkpoint._state import decode_state
from shardkit.trainer.checkpoint._store import CheckpointInfo, Store, digest

MODEL, OPTIMIZER, STATE = "model.pt", "optimizer.pt", "state.json"
TF_DIR = os.path.dirname(fw.TF_PREFIX)


@dataclasses.dataclass
class Loaded:
    """A verified checkpoint, deserialized but not yet applied to any object."""

    info: CheckpointInfo
    state: dict[str, Any]
    model: Mapping[str, Any] | None = None
    optimizer: Mapping[str, Any] | None = None
    tf_prefix: str | None = None


def write_tf(store: Store, step: int, checkpoint: Any) -> dict[str, dict[str, Any]]:
    """``checkpoint.write`` into the step's ``tf/`` folder; returns the files' ``{"size", "sha256"}``.

    Local folders: TensorFlow writes in place, then each file is fsynced (TensorFlow does not, and
    ``COMMIT`` must not reach the disk before them). Elsewhere: written to a temporary local folder,
    then uploaded file by file.
    """
    if store.loc.is_local:
        files = {}
        for path in fw.tf_write(checkpoint, store.path(step, fw.TF_PREFIX)):
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
                f.seek(0)
                files[f"{TF_DIR}/{os.path.basename(path)}"] = digest(iter(lambda: f.read(1 << 22), b""))
        return files
    with tempfile.TemporaryDirectory(prefix="shardkit-ckpt-") as tmp:
        paths = fw.tf_write(checkpoint, f"{tmp}/{fw.TF_PREFIX}")
        names = {f"{TF_DIR}/{os.path.basename(p)}": p for p in paths}
        return {name: store.write(step, name, Path(p).read_bytes()) for name, p in names.items()}


def load(store: Store, step: int, tmp: str, *, model: bool, optimizer: bool, reader: bool,
         tf: bool) -> Loaded:
    """Read and verify what the caller asked for (flags) from step ``step``; remote TF files go to ``tmp``.

    Raises `CorruptCheckpointError` for what an older checkpoint can cure (uncommitted, damaged, not a
    plain state dict) and `CheckpointError` for what it cannot (an object asked for that was not saved).
    """
    info = store.info(step)
    files = info.files
    if STATE not in files:
        raise CorruptCheckpointError(f"{store.url(step, 'COMMIT')} lists no {STATE}")
    tf_files = sorted(n for n in files if n.startswith(TF_DIR + "/"))
    for want, present, name, arg in ((model, MODEL in files, MODEL, "model"),
                                      (optimizer, OPTIMIZER in files, OPTIMIZER, "optimizer"),
                                      (tf, bool(tf_files), fw.TF_PREFIX, "tf_checkpoint")):
        if want and not present:
            raise CheckpointError(f"checkpoint {info.url} (framework {info.framework!r}) has no {name}: it "
                                  f"was saved without {arg}=; restore with the objects that were saved")
    try:
        state = decode_state(store.read(step, STATE, files[STATE]), step)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{store.url(step, STATE)} is not a valid state ({e})") from e
    if reader and state.get("reader") is None:
        raise CheckpointError(f"checkpoint {info.url} has no reader state: it was saved without reader=; "
                              "restore without reader=, or save with it")
    out = Loaded(info, state)
    if model:
        out.model = _torch_state(store, step, MODEL, files[MODEL])
    if optimizer:
        out.optimizer = _torch_state(store, step, OPTIMIZER, files[OPTIMIZER])
    if tf:
        local = store.loc.is_local
        for name in tf_files:
            path = store.path(step, name) if local else os.path.join(tmp, name)
            if not local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                Path(path).write_bytes(store.read(step, name, files[name]))
            store.verify_file(step, name, files[name], path)
        out.tf_prefix = store.path(step, fw.TF_PREFIX) if local else os.path.join(tmp, fw.TF_PREFIX)
    return out


def apply(loaded: Loaded, *, model: Any, optimizer: Any, reader: Any) -> None:
    """Load the states into the objects (those given); a state that does not fit raises `CheckpointError`.

    Checked before anything changes: the model state against ``model.state_dict()`` (the same keys and
    tensor shapes: torch's own load copies the layers that fit before it raises) and the optimizer state
    against the optimizer (as many param groups, as many parameters in each). Then the reader is loaded,
    its state kept first (JSON, cheap) and put back when the optimizer or the model then fails; then
    the optimizer; then the model. So a misfit leaves every object as it was, but for a model whose own
    loading fails past these checks (its ``set_extra_state`` refuses, say): the optimizer stays loaded.
    """
    model = fw.unwrap(model) if model is not None else None
    if model is not None:
        _check_model(loaded, model)
    if optimizer is not None:
        _check_optimizer(loaded, optimizer)
    before = None
    if reader is not None:
        before = reader.state_dict()
        _load_into(loaded, reader, "reader state", loaded.state.get("reader"))
    try:
        if optimizer is not None:
            _load_into(loaded, optimizer, OPTIMIZER, loaded.optimizer)
        if model is not None:
            _load_into(loaded, model, MODEL, loaded.model)
    except BaseException:
        if reader is not None:
            reader.load_state_dict(before)
        raise


_FIX = "restore into the same architecture, optimizer and dataset that were saved"


def _load_into(loaded: Loaded, obj: Any, name: str, state: Any) -> None:
    try:
        obj.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise _misfit(loaded, obj, name, str(e)) from e


def _misfit(loaded: Loaded, obj: Any, name: str, why: str) -> CheckpointError:
    return CheckpointError(f"the {name} of checkpoint {loaded.info.url} does not fit this "
                           f"{type(obj).__name__} ({why}); {_FIX}")


def _check_model(loaded: Loaded, model: Any) -> None:
    """The saved state has the model's keys (``_extra_state`` aside: the module's own
    ``set_extra_state`` judges it) with the same tensor shapes."""
    saved = loaded.model if loaded.model is not None else {}
    mine = model.state_dict()
    keys = {k for k in saved if not k.endswith("_extra_state")}
    want = {k for k in mine if not k.endswith("_extra_state")}
    problems = []
    if want - keys:
        problems.append(f"keys missing from the checkpoint: {_few(want - keys)}")
    if keys - want:
        problems.append(f"keys this model lacks: {_few(keys - want)}")
    shapes = [(k, tuple(saved[k].shape), tuple(mine[k].shape)) for k in sorted(keys & want)
              if _tensor_shape(saved[k]) and _tensor_shape(mine[k]) and saved[k].shape != mine[k].shape]
    if shapes:
        k, theirs, ours = shapes[0]
        more = f" and {len(shapes) - 1} more" if len(shapes) > 1 else ""
        problems.append(f"{k!r} has the shape {list(theirs)} in the checkpoint, {list(ours)} here{more}")
    if problems:
        raise _misfit(loaded, model, MODEL, "; ".join(problems))


def _check_optimizer(loaded: Loaded, optimizer: Any) -> None:
    """What torch's ``Optimizer.load_state_dict`` checks, first: as many param groups, as many parameters
    in each (other optimizers, such as a parameter-server handle, check their own state when loading)."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return
    saved = loaded.optimizer if loaded.optimizer is not None else {}
    theirs = saved.get("param_groups")
    if not (isinstance(theirs, list) and "state" in saved
            and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in theirs)):
        raise _misfit(loaded, optimizer, OPTIMIZER, "it is not a torch optimizer state dict: no "
                      "state and param_groups with params")
    ours_n = [len(g["params"]) for g in groups]
    theirs_n = [len(g["params"]) for g in theirs]
    if ours_n != theirs_n:
        raise _misfit(loaded, optimizer, OPTIMIZER, f"its param groups hold {theirs_n} parameters, this "
                      f"optimizer's {ours_n}")


def _tensor_shape(value: Any) -> bool:
    """A tensor whose shape is known (an uninitialized lazy parameter takes any saved shape)."""
    import torch

    return isinstance(value, torch.Tensor) and not torch.nn.parameter.is_lazy(value)


def _few(keys: set[str]) -> str:
    names = sorted(keys)
    return ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _torch_state(store: Store, step: int, name: str, meta: Mapping[str, Any]) -> Mapping[str, Any]:
    state = fw.torch_load(store.read(step, name, meta), store.url(step, name))
    if not isinstance(state, Mapping):
        raise CorruptCheckpointError(f"{store.url(step, name)} holds a {type(state).__name__}, "
                                     "not a state dict")
    return state
