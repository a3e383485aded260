"""Columnar batch helpers: concatenate, gather and cut dicts of numpy arrays without per-row Python."""

from __future__ import annotations

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
