"""torch and TensorFlow state to and from checkpoint files; torch unpickles only with ``weights_only``."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from typing import Any

from shardkit.errors import CheckpointError, CorruptCheckpointError, require

TF_PREFIX = "tf/ckpt"  # tf.train.Checkpoint.write(<step>/tf/ckpt) -> ckpt.index, ckpt.data-00000-of-00001


def unwrap(model: Any) -> Any:
    """The module inside DDP / DataParallel / torch.compile, so saved keys carry no ``module.`` prefix and a
    checkpoint of a wrapped model loads into a bare one (and back)."""
    torch: Any = require("torch", extra="torch", purpose="a torch checkpoint")
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"model= takes a torch.nn.Module, not {type(model).__name__}; for a Keras "
                              "model pass tf_checkpoint=tf.train.Checkpoint(model=..., optimizer=...)")
    while isinstance(inner := getattr(model, "module", None) or getattr(model, "_orig_mod", None),
                     torch.nn.Module):
        model = inner
    return model


def torch_bytes(state: Any) -> bytes:
    torch: Any = require("torch", extra="torch", purpose="a torch checkpoint")
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


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
            "not unpickled further. If you did not write it, delete it; shardkit never loads it unrestricted"
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
