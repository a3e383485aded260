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


class Batcher:
    """Cuts a stream of column chunks into batches of ``batch_size`` rows (views when possible)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.pending: list[Columns] = []
        self.pending_rows = 0

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
