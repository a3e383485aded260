"""torch and TensorFlow state to and from checkpoint files; torch unpickles only with ``weights_only``."""

from __future__ import annotations

import copy
import io
import os
import pickle
import sys
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from shardkit.errors import CheckpointError, CorruptCheckpointError, require

TF_PREFIX = "tf/ckpt"  # tf.train.Checkpoint.write(<step>/tf/ckpt) -> ckpt.index, ckpt.data-00000-of-00001


def unwrap(model: Any) -> Any:
    """The module inside DDP / DataParallel / torch.compile, so saved keys carry no ``module.`` prefix and a
    checkpoint of a wrapped model loads into a bare one (and back).

    Only those wrappers are opened (a compiled DDP model too), by their classes: a model that merely has
    an attribute ``module`` (a submodule of that name, ``torch.optim.swa_utils.AveragedModel``) is saved
    whole. torch.compile's class is looked up only when the script imported dynamo, which is slow to import.
    """
    torch: Any = require("torch", extra="torch", purpose="a torch checkpoint")
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"model= takes a torch.nn.Module, not {type(model).__name__}; for a Keras "
                              "model pass tf_checkpoint=tf.train.Checkpoint(model=..., optimizer=...)")
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    while True:
        if isinstance(model, parallel):
            model = model.module
        elif compiled is not None and isinstance(model, compiled):
            model = model._orig_mod
        else:
            return model


def torch_bytes(state: Any, *, what: str, where: str) -> bytes:
    """``torch.save(state)`` bytes that load again with ``weights_only=True``, checked before any write.

    numpy scalars (a learning rate computed with numpy) are saved as the Python numbers they hold, at
    any depth of the state, so they come back as Python numbers. Anything else that torch's restricted
    unpickler would refuse (a numpy array, an object of the script's own class) raises `CheckpointError`
    naming ``what`` (``model``, ``optimizer``) and the key path of the first such value: saved as it is,
    the checkpoint could never be restored.
    """
    torch: Any = require("torch", extra="torch", purpose="a torch checkpoint")
    state = _plain(state)
    data = _save(torch, state)
    refused = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    if refused:
        path, value, names = next(_refused(torch, state, f"{what}.state_dict()"),
                                  (f"{what}.state_dict()", state, refused))
        raise CheckpointError(
            f"checkpoint {where}: {path} is a {type(value).__module__}.{type(value).__qualname__} "
            f"(pickled as {', '.join(sorted(names))}), which torch.load(weights_only=True) "
            "refuses, so this checkpoint could never be restored. Convert it to a torch tensor, a list or "
            "a Python number, or register its class with torch.serialization.add_safe_globals. Nothing "
            "was written; the previous checkpoints are intact")
    return data


def _save(torch: Any, state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars (values and keys) replaced by Python scalars; containers holding none
    are returned as they are, and a copied one keeps its class and attributes (a state dict's
    ``_metadata``)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        items = [(_plain(k), _plain(v)) for k, v in value.items()]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(items, value.items(), strict=True)):
            return value
        out = copy.copy(value)
        out.clear()
        out.update(items)
        return out
    if isinstance(value, list | tuple):
        parts = [_plain(v) for v in value]
        if all(a is b for a, b in zip(parts, value, strict=True)):
            return value
        if isinstance(value, list):
            return parts
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
    return value


def _refused(torch: Any, value: Any, path: str) -> Iterator[tuple[str, Any, list[str]]]:
    """``(key path, value, refused globals)`` of the values in ``value`` that a ``weights_only`` load
    refuses, deepest first. Plain tensors and Python scalars are never refused; any other value is
    pickled alone to ask torch (this runs only after the whole state was refused)."""
    if type(value) in (str, int, float, bool, complex, bytes, type(None), torch.Tensor, torch.nn.Parameter):
        return
    if type(value) not in (dict, OrderedDict, list, tuple):
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(_save(torch, value)))
        if not names:
            return
    else:
        names = []
    found = False
    items = value.items() if isinstance(value, Mapping) else (
        enumerate(value) if isinstance(value, list | tuple) else ())
    for key, item in items:
        for hit in _refused(torch, item, f"{path}[{key!r}]"):
            found = True
            yield hit
    if names and not found:
        yield path, value, names


def torch_load(data: bytes, where: str) -> Any:
    """Load tensors and containers only (``weights_only=True``): a pickle that names any other callable
    is refused by torch's restricted unpickler before it can run."""
    torch: Any = require("torch", extra="torch", purpose="a torch checkpoint")
    try:
        with warnings.catch_warnings():
            # torch warns about pickle protocols it did not write itself: such a file is refused or loads.
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
            KeyError, IndexError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptCheckpointError(
            f"{where} is not a torch state dict that loads with weights_only=True ({first[:200]}); it was "
            "not unpickled further (shardkit never loads a checkpoint unrestricted). Either it was altered "
            "after its save, or it holds objects other than tensors, numbers, strings and containers (a "
            "numpy array: older shardkit versions saved such states without complaint). If you trust "
            "the file, load it with torch.load(weights_only=False) and save its state again with plain "
            "values; otherwise delete it"
        ) from e


def tf_write(checkpoint: Any, prefix: str) -> list[str]:
    """``checkpoint.write(prefix)``; returns the files it made (paths), so each can be hashed and fsynced."""
    folder = os.path.dirname(prefix)
    os.makedirs(folder, exist_ok=True)
    checkpoint.write(prefix)
    base = os.path.basename(prefix)
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(base + "."))


def tf_read(checkpoint: Any, prefix: str, where: str) -> None:
    """``checkpoint.read(prefix)``, then insist that every object the caller built was found in it.

    A file TensorFlow cannot read is corrupt (the caller falls back to an older checkpoint); objects
    missing from a readable file, or of other shapes, mean the script changed, which no older checkpoint
    fixes: CheckpointError.

    ``expect_partial()`` silences only the reverse case (values in the file with no object yet, such as
    optimizer slots that Keras creates at the first step, which TensorFlow restores when they appear).
    """
    tf: Any = require("tensorflow", extra="tf", purpose="a TensorFlow checkpoint")
    fix = "restore into the same model and optimizer structure that was saved"
    try:
        status = checkpoint.read(prefix)
    except tf.errors.OpError as e:
        raise CorruptCheckpointError(f"{where} could not be read by tf.train.Checkpoint ({e})") from e
    except ValueError as e:  # a variable of another shape or dtype
        raise CheckpointError(f"{where} does not fit this tf.train.Checkpoint ({e}); {fix}") from e
    status.expect_partial()
    try:
        status.assert_existing_objects_matched()
    except AssertionError as e:
        raise CheckpointError(
            f"{where} does not hold the objects of this tf.train.Checkpoint ({str(e)[:300]}); {fix}") from e
