"""What a batch and this process hold, for `shardkit.bench.throughput`: a batch's rows and decoded bytes
(numpy, torch or TensorFlow values), and the process's peak resident memory."""

from __future__ import annotations

import functools
import itertools
import operator
import re
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["nbytes", "peak_rss", "size_of_batch"]

_NBYTES, _PRESENT = operator.attrgetter("nbytes"), functools.partial(operator.is_not, None)
_UTF8 = functools.partial(str.encode, encoding="utf-8", errors="surrogatepass")


def size_of_batch(batch: Mapping[str, Any], fields: Collection[str] | None = None) -> tuple[int, int]:
    """Rows (the first value's first dimension) and decoded bytes of a batch (a dict of arrays or tensors):
    `nbytes` of the values of ``fields`` (default: every key). The adapters add keys of their own to a
    batch (``<field>__valid`` of a nullable field, ``<field>__mask`` of a padded one), which are not
    the data read: `measure` passes the fields read, so that every adapter counts the same bytes."""
    first = next(iter(batch.values()), None)
    shape = getattr(first, "shape", None)
    if shape is not None and len(shape) and shape[0] is not None:
        rows = int(shape[0])
    else:
        rows = 0 if first is None else len(first)
    keys = batch.keys() if fields is None else [k for k in fields if k in batch]
    return rows, sum(nbytes(batch[k]) for k in keys)


def nbytes(value: Any) -> int:
    """Bytes a decoded value holds: ``nbytes`` of numbers (numpy, torch, tf; a masked array's values,
    not its mask), the UTF-8 bytes of each str, the length of each bytes, summed over object arrays,
    lists and ragged values (a tf.RaggedTensor's values, not its row splits); None counts 0.

    Example:
        >>> nbytes(np.array(["ab", "é", None], dtype=object))   # 2 + 2 + 0
        4
    """
    if isinstance(value, np.ndarray | np.generic):
        if value.dtype.kind == "U":  # fixed-width text: 4 bytes a character in memory, counted as UTF-8
            return _total(np.asarray(value).ravel().tolist())
        return int(value.nbytes) if value.dtype != object else _total(np.asarray(value).ravel())
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value) if value.isascii() else len(_UTF8(value))
    if isinstance(value, bytes | bytearray):
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
    is on the clock, and a Python call per value took much of the measured time of text and ragged batches."""
    first = next((v for v in values if v is not None), None)
    if isinstance(first, str):
        try:
            return _utf8_total(list(filter(_PRESENT, values)))
        except TypeError:  # values of another kind among them
            return sum(nbytes(v) for v in values)
    if isinstance(first, bytes):
        size: Callable[[Any], int] = len
    elif hasattr(first, "nbytes") and not (isinstance(first, np.ndarray) and first.dtype.hasobject):
        size = _NBYTES  # numpy arrays, torch tensors
    else:
        return sum(nbytes(v) for v in values)
    try:
        return sum(map(size, filter(_PRESENT, values)))
    except (TypeError, AttributeError):  # values of another kind among them
        return sum(nbytes(v) for v in values)


def _utf8_total(texts: list[str]) -> int:
    """UTF-8 bytes of ``texts``: an ASCII str's length is its UTF-8 size (``isascii`` reads a flag), the
    others are encoded."""
    ascii_bytes = sum(map(len, filter(str.isascii, texts)))
    return ascii_bytes + sum(map(len, map(_UTF8, itertools.filterfalse(str.isascii, texts))))


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
