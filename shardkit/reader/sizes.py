"""What a batch and this process hold, for `shardkit.reader.throughput`: a batch's rows and decoded bytes
(numpy, torch or TensorFlow values), and the process's peak resident memory."""

from __future__ import annotations

import functools
import operator
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["nbytes", "peak_rss", "size_of_batch"]

_NBYTES, _PRESENT = operator.attrgetter("nbytes"), functools.partial(operator.is_not, None)


def size_of_batch(batch: Mapping[str, Any]) -> tuple[int, int]:
    """Rows (the first value's first dimension) and decoded bytes of a batch (a dict of arrays or tensors)."""
    first = next(iter(batch.values()), None)
    shape = getattr(first, "shape", None)
    if shape is not None and len(shape) and shape[0] is not None:
        rows = int(shape[0])
    else:
        rows = 0 if first is None else len(first)
    return rows, sum(nbytes(v) for v in batch.values())


def nbytes(value: Any) -> int:
    """Bytes a decoded value holds: ``nbytes`` of numbers (numpy, torch, tf), ``len`` of each str or
    bytes (characters, not UTF-8 bytes), summed over object arrays, lists and ragged values."""
    if isinstance(value, np.ndarray | np.generic):
        return int(value.nbytes) if value.dtype != object else _total(np.asarray(value).ravel())
    if value is None:
        return 0
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    if isinstance(value, Mapping):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return _total(value)
    if hasattr(value, "element_size") and hasattr(value, "numel"):  # a torch tensor
        return int(value.numel()) * int(value.element_size())
    values = getattr(value, "flat_values", None)  # a tf.RaggedTensor: its values, not its row splits
    if values is not None:
        return nbytes(values)
    if hasattr(value, "numpy"):  # a tf tensor: a view of CPU numbers, the bytes objects of strings
        return nbytes(value.numpy())
    return len(value) if hasattr(value, "__len__") else 0


def _total(values: Any) -> int:
    """`nbytes` summed over one field's values (None for a null), in C where they are text or arrays: this
    is on the clock, and a Python call per value took half the measured time of text and ragged batches."""
    first = next((v for v in values if v is not None), None)
    if isinstance(first, str | bytes):
        size: Callable[[Any], int] = len
    elif hasattr(first, "nbytes") and not (isinstance(first, np.ndarray) and first.dtype.hasobject):
        size = _NBYTES  # numpy arrays, torch tensors
    else:
        return sum(nbytes(v) for v in values)
    try:
        return sum(map(size, filter(_PRESENT, values)))
    except (TypeError, AttributeError):  # values of another kind among them
        return sum(nbytes(v) for v in values)


def peak_rss() -> int | None:
    """This process's peak resident memory in bytes: ``VmHWM`` on Linux, else ``getrusage``'s
    ``ru_maxrss`` (which a forked child inherits from its parent, hence not first); None if neither."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        found = None
    if found:
        return int(found.group(1)) * 1024
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
