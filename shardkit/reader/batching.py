"""Columnar batch helpers: concatenate, gather and cut dicts of numpy arrays without per-row Python."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence

import numpy as np

Columns = dict[str, np.ndarray]


def concat(parts: Sequence[Columns]) -> Columns:
    """Concatenate column dicts row-wise (no copy when there is a single part)."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for name in parts[0]:
        arrays = [p[name] for p in parts]
        if any(isinstance(a, np.ma.MaskedArray) for a in arrays):
            out[name] = np.ma.concatenate(arrays)  # type: ignore[no-untyped-call]
        else:
            out[name] = np.concatenate(arrays)
    return out


def take(columns: Columns, index: np.ndarray | slice) -> Columns:
    return {name: a[index] for name, a in columns.items()}


def num_rows(columns: Columns) -> int:
    return len(next(iter(columns.values()))) if columns else 0


def gather(chunks: Sequence[Columns], owner: np.ndarray, local: np.ndarray) -> Columns:
    """Rows ``local[i]`` of chunk ``owner[i]``, for every ``i``, as new arrays (one copy, no concatenation).

    Example:
        >>> gather([{"x": np.array([0, 1])}, {"x": np.array([2, 3])}], np.array([1, 0]), np.array([1, 0]))
        {'x': array([3, 0])}

    Rows are grouped by chunk (a stable sort of ``owner``), so each chunk costs one fancy index per
    column, however its rows interleave with the others'.
    """
    if len(chunks) == 1:
        return take(chunks[0], local)
    order = np.argsort(owner, kind="stable")
    cuts = np.searchsorted(owner[order], np.arange(len(chunks) + 1))
    present = np.flatnonzero(cuts[1:] > cuts[:-1]).tolist()
    if len(present) == 1:
        return take(chunks[present[0]], local)
    rows = local[order]
    out: Columns = {}
    for name in chunks[0]:
        arrays = [c[name] for c in chunks]
        first = arrays[0]
        alike = all(type(a) is np.ndarray and a.dtype == first.dtype and a.shape[1:] == first.shape[1:]
                    for a in arrays)
        if not alike:  # masked (nulls) in some chunks, or object rows: the general, slower way
            starts = np.cumsum([0, *(len(a) for a in arrays[:-1])])
            out[name] = concat([{name: a} for a in arrays])[name][starts[owner] + local]
            continue
        result = np.empty((len(owner), *first.shape[1:]), first.dtype)
        for p in present:
            a, b = cuts[p], cuts[p + 1]
            result[order[a:b]] = arrays[p][rows[a:b]]
        out[name] = result
    return out


class Recycler:
    """Window-sized arrays used again once nothing refers to them any more.

    A fresh array of many MiB costs the kernel a zeroed page per 4 KiB on first touch (measured: a
    fifth of a shuffled read's CPU). An array handed out before is reused when its reference count
    shows that only this recycler holds it: every numpy view (and whatever holds a view: a torch tensor
    from ``torch.from_numpy``, a memoryview) refers to the array that owns the memory, so a batch still
    in use keeps its window's arrays out of reuse. At most ``keep_bytes`` of arrays are kept (the
    oldest go first); object arrays are never kept (they hold references).
    """

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0  # arrays handed out again
        # the reference count of an array that only this list holds, read the way `empty` reads it
        probe = [np.empty(1)]
        self._free = sys.getrefcount(probe[0])

    def clear(self) -> None:
        """Let go of every kept array (those still in use live on with their batches)."""
        with self._lock:
            self._arrays.clear()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized array, reused when one is free."""
        if dtype.hasobject:
            return np.empty(shape, dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        with self._lock:
            for i in range(len(self._arrays)):
                if self._arrays[i].nbytes >= nbytes and sys.getrefcount(self._arrays[i]) <= self._free:
                    a = self._arrays.pop(i)
                    self._arrays.append(a)
                    self.reused += 1
                    return a[:nbytes].view(dtype).reshape(shape)  # owned by ``a``
            # room for a somewhat larger window next time (windows differ by some rows)
            a = np.empty(-(-nbytes * 9 // 8 // 64) * 64, np.uint8)
            self._arrays.append(a)
            while sum(x.nbytes for x in self._arrays) > self.keep_bytes and len(self._arrays) > 1:
                del self._arrays[0]
            return a[:nbytes].view(dtype).reshape(shape)


class Scatter:
    """A shuffle window assembled in emission order by the threads that decode it.

    Each decoded part is copied once, straight to its rows of the window's columns (``place``, called
    in the worker threads, in parallel: numpy copies without the GIL); the batches are then views of
    those columns. Gathering instead copies every row twice (the parts joined, then each batch
    picked out of them in the consuming thread). Columns whose chunks are not plain arrays of one
    dtype and row shape (masked, because they hold nulls) cannot be placed: ``ok`` turns False and
    the window is gathered from its parts as before.
    """

    def __init__(self, num_rows: int, recycler: Recycler | None = None) -> None:
        self.num_rows = num_rows
        self.recycler = recycler
        self.columns: Columns | None = None
        self.ok = True
        self._lock = threading.Lock()

    def placed(self, parts: Sequence[Sequence[Columns] | None]) -> Columns | None:
        """The window's columns, if they hold all its rows (``parts``: what its tasks returned)."""
        if self.ok and self.columns and all(p is not None for p in parts):
            return self.columns
        return None

    def place(self, part: Sequence[Columns], dest: np.ndarray) -> None:
        """Copy ``part``'s rows (its chunks in order) to the window rows ``dest``."""
        offset = 0
        for chunk in part:
            n = num_rows(chunk)
            columns = self._columns_for(chunk)
            if columns is None:
                self.ok = False
                return
            rows = dest[offset : offset + n]
            for name, values in chunk.items():
                columns[name][rows] = values
            offset += n

    def _columns_for(self, chunk: Columns) -> Columns | None:
        if not self.ok or any(type(a) is not np.ndarray for a in chunk.values()):
            return None
        with self._lock:
            if self.columns is None:
                empty = np.empty if self.recycler is None else self.recycler.empty
                self.columns = {name: empty((self.num_rows, *a.shape[1:]), a.dtype)
                                for name, a in chunk.items()}
            columns = self.columns
        alike = columns.keys() == chunk.keys() and all(
            a.dtype == columns[name].dtype and a.shape[1:] == columns[name].shape[1:]
            for name, a in chunk.items()
        )
        return columns if alike else None


class Batcher:
    """Cuts a stream of column chunks into batches of ``batch_size`` rows (views when possible)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.pending: list[Columns] = []
        self.pending_rows = 0

    def need(self) -> int:
        """Rows that complete the next batch: a chunk of this size is cut without any copy."""
        return self.batch_size - self.pending_rows

    def add(self, chunk: Columns) -> Iterator[Columns]:
        """Add a chunk; yield every full batch now available."""
        n = num_rows(chunk)
        pos = 0
        if self.pending:
            need = self.batch_size - self.pending_rows
            if n < need:
                self.pending.append(chunk)
                self.pending_rows += n
                return
            yield concat([*self.pending, take(chunk, slice(0, need))])
            self.pending, self.pending_rows, pos = [], 0, need
        while n - pos >= self.batch_size:
            yield take(chunk, slice(pos, pos + self.batch_size))
            pos += self.batch_size
        if pos < n:
            self.pending = [take(chunk, slice(pos, n))]
            self.pending_rows = n - pos

    def flush(self) -> Iterator[Columns]:
        """Yield the last, partial batch, if any."""
        if self.pending:
            yield concat(self.pending)
        self.pending, self.pending_rows = [], 0
