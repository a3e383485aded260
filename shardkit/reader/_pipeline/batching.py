"""Columnar batch helpers: concatenate, gather and cut dicts of numpy arrays without per-row Python."""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

Columns = dict[str, np.ndarray]
ALIGN = 64  # bytes: where `Recycler` arrays start (TensorFlow's alignment for sharing a numpy array)


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


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _aligned(owner: np.ndarray, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of ``owner`` (uint8, ``ALIGN`` bytes longer) that start at a multiple of ALIGN."""
    start = -_address(owner) % ALIGN
    return owner[start : start + nbytes]


def _follows(before: Columns, after: Columns) -> bool:
    """Whether every column of ``after`` starts in memory where ``before``'s ends, in the same array."""
    if before.keys() != after.keys():
        return False
    for name, a in after.items():
        b = before[name]
        if type(a) is not np.ndarray or type(b) is not np.ndarray:  # masked, or lists of rows
            return False
        if a.base is None or a.base is not b.base or a.dtype != b.dtype or a.shape[1:] != b.shape[1:]:
            return False
        if not (a.flags.c_contiguous and b.flags.c_contiguous) or _address(b) + b.nbytes != _address(a):
            return False
    return True


def _joined(run: Sequence[Columns]) -> Columns:
    """Batches that follow one another in memory (`_follows`) as one view of all their rows."""
    if len(run) == 1:
        return run[0]
    rows = sum(num_rows(b) for b in run)
    return {name: np.lib.stride_tricks.as_strided(a, (rows, *a.shape[1:]), a.strides, writeable=False)
            for name, a in run[0].items()}


def runs(batches: Iterable[Columns], batch_size: int, max_bytes: int, max_batches: int = 64
         ) -> Iterator[Columns]:
    """Consecutive batches joined, without a copy, where they lie one after another in one array.

    Example:
        >>> x = np.arange(10)
        >>> [r["x"].tolist() for r in runs([{"x": x[:4]}, {"x": x[4:8]}, {"x": x[8:]}], 4, 1 << 20)]
        [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]

    The reader's batches of a shuffle window (and of an in-order row-group slice) are views of one
    array each column. Cutting a run back into pieces of ``batch_size`` rows gives the batches again:
    a run holds full batches, then at most one shorter one (which ends it). A run ends where a batch
    starts elsewhere in memory (or is not plain arrays: masked, lists), at ``max_bytes``, or at
    ``max_batches``. Read-only views: the batches were someone else's arrays.
    """
    run: list[Columns] = []
    size = 0
    for batch in batches:
        nbytes = sum(a.nbytes for a in batch.values() if isinstance(a, np.ndarray))
        if run and (len(run) >= max_batches or size + nbytes > max_bytes or num_rows(run[-1]) != batch_size
                    or not _follows(run[-1], batch)):
            yield _joined(run)
            run, size = [], 0
        run.append(batch)
        size += nbytes
    if run:
        yield _joined(run)


def _host_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


class Recycler:
    """Window-sized arrays used again once nothing refers to them any more.

    A fresh array of many MiB costs the kernel a zeroed page per 4 KiB on first touch (a large share
    of a shuffled read's CPU). An array handed out before is reused when its reference count
    shows that only this recycler holds it: every numpy view (and whatever holds a view: a torch tensor
    from ``torch.from_numpy``, a memoryview) refers to the array that owns the memory, so a batch still
    in use keeps its window's arrays out of reuse. A request takes the smallest free array that fits it
    (a window's small columns do not take its large ones' arrays). ``keep_bytes`` bounds what is kept
    while free: past it, free arrays go, the oldest first; an array in use is never let go, since its
    memory is held anyway and it is free again soon (dropping it made the next window fault in fresh
    pages: a DataLoader worker, whose queued batches keep one window more alive, allocated far more
    bytes than it reused). Object arrays are never kept (they hold references). Arrays start at a
    multiple of `ALIGN` bytes: TensorFlow takes such an array as a tensor without copying it (an
    unaligned run of batches costs tf.data a copy, and much more CPU).

    ``allocate(nbytes)`` makes a new array (a flat uint8 array of that many bytes; default: ordinary
    memory): `shardkit.torch` gives page-locked memory for a CUDA device (`Reader.set_batch_memory`).
    """

    def __init__(self, keep_bytes: int, allocate: Callable[[int], np.ndarray] | None = None) -> None:
        self.keep_bytes = keep_bytes
        self.allocate = allocate or _host_bytes
        self._arrays: list[np.ndarray] = []  # oldest first
        self._lock = threading.Lock()
        self.reused = 0  # arrays handed out again
        self.allocated = 0  # arrays made
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
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            free = [i for i in range(len(self._arrays)) if sys.getrefcount(self._arrays[i]) <= self._free]
            fits = [i for i in free if self._arrays[i].nbytes - ALIGN >= nbytes]
            if fits:
                a = self._arrays.pop(min(fits, key=lambda i: self._arrays[i].nbytes))
                self.reused += 1
            else:
                # room for a somewhat larger window next time (windows differ by some rows)
                a = self.allocate(-(-nbytes * 9 // 8 // ALIGN) * ALIGN + ALIGN)
                self.allocated += 1
                kept = sum(x.nbytes for x in self._arrays) + a.nbytes
                dropped = set()
                for i in free:  # too small for this request: the oldest go while over budget
                    if kept <= self.keep_bytes:
                        break
                    kept -= self._arrays[i].nbytes
                    dropped.add(i)
                self._arrays = [x for i, x in enumerate(self._arrays) if i not in dropped]
            self._arrays.append(a)
            return _aligned(a, nbytes).view(dtype).reshape(shape)  # owned by ``a``


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


class Placement(Protocol):
    """Where one window's rows go, when not in a window of their own (`Placer`): the worker threads
    ``place`` each task's rows (``dest``: per decoded row, from `Placer.plan`); ``placed`` tells whether
    they all are (``parts``: what the tasks returned, None where rows were lost), and ``gathered`` puts
    the rows the workers did not (``emitted``: their indices in the window's emission order)."""

    ok: bool

    def place(self, part: Sequence[Columns], dest: np.ndarray) -> None: ...

    def placed(self, parts: Sequence[Sequence[Columns] | None]) -> Any: ...

    def gathered(self, chunk: Columns, emitted: np.ndarray) -> None: ...


class Placer(Protocol):
    """Takes a reader's rows in its order, as `shardkit.reader.Reader._placing` reads them: ``remaining``
    samples from the reader's position on, each window's rows placed as ``plan`` says (``emit`` and
    ``sizes`` as `assemble.needed_rows` gives them; the second item, per task, where each decoded row
    goes, or None when the workers cannot place them and the window is gathered instead)."""

    def remaining(self) -> int: ...

    def plan(self, emit: np.ndarray | None, sizes: list[int]
             ) -> tuple[Placement, list[np.ndarray] | None]: ...


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
