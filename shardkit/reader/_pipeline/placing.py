"""Rows placed straight where a stream made of several readers' rows needs them (a mixture's batches).

One reader's worker threads put a shuffle window's rows in emission order as they decode them
(`batching.Scatter`). A mixture's batches take their rows from several readers, in the order of its
schedule: were each reader to assemble its own windows first, every row would be copied twice, the
second time in the thread that hands out the batches. Instead each reader's workers place its rows at
their positions in the mixed stream (`Blocks`), one copy per row, in parallel; the mixed batches are
then views of those arrays, as one reader's are views of its windows.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from shardkit.errors import ReaderError
from shardkit.reader._pipeline.batching import Columns, Recycler, num_rows


class Blocks:
    """The memory of a run of stream positions ``0, 1, 2, ...``: blocks of ``rows`` positions, each one
    array per column, from ``recycler`` (so reused once no batch refers to it any more).

    A block is made when a row is first placed in it (by any thread), with the columns of that row;
    `batch` gives views of positions within one block, and `release` lets go of the blocks before a
    position (their batches keep their arrays alive as long as they need them).
    """

    def __init__(self, rows: int, recycler: Recycler) -> None:
        self.rows = rows
        self.recycler = recycler
        self._blocks: dict[int, Columns] = {}
        self._masks: dict[tuple[int, str], np.ndarray] = {}
        self._lock = threading.Lock()

    def place_all(self, chunks: Sequence[Columns], dest: np.ndarray) -> None:
        """Copy the rows of ``chunks`` (in order) to the positions ``dest``, as `place` does: a task's
        chunks whose rows lie in one block, the usual case, are placed with one look-up of the block."""
        if not len(dest):
            return
        block = dest // self.rows
        b = int(block.min())
        if b < 0 or b != int(block.max()):
            offset = 0
            for chunk in chunks:
                n = num_rows(chunk)
                self.place(chunk, dest[offset : offset + n])
                offset += n
            return
        local, offset, columns = dest - b * self.rows, 0, self._block(b, chunks[0])
        for chunk in chunks:
            n = num_rows(chunk)
            self._put(b, columns, chunk, local[offset : offset + n], None)
            offset += n

    def place(self, chunk: Columns, dest: np.ndarray) -> None:
        """Copy the rows of ``chunk`` to the positions ``dest`` (int64; -1: a row no position needs)."""
        if not len(dest):
            return
        block = dest // self.rows  # -1 stays -1
        lo, hi = int(block.min()), int(block.max())
        if lo == hi:  # the usual case: a task's rows lie in one block
            if lo >= 0:
                self._put(lo, self._block(lo, chunk), chunk, dest - lo * self.rows, None)
            return
        order = np.argsort(block, kind="stable")
        cuts = np.searchsorted(block[order], np.arange(max(lo, 0), hi + 2))
        for k, b in enumerate(range(max(lo, 0), hi + 1)):
            rows = order[cuts[k] : cuts[k + 1]]
            if len(rows):
                self._put(b, self._block(b, chunk), chunk, dest[rows] - b * self.rows, rows)

    def _put(self, b: int, block: Columns, chunk: Columns, local: np.ndarray, rows: np.ndarray | None
             ) -> None:
        for name, values in chunk.items():
            target = block.get(name)
            data, mask = values, None
            if type(values) is not np.ndarray and isinstance(values, np.ma.MaskedArray):
                data, mask = values.data, np.ma.getmaskarray(values)  # nulls: their mask beside the values
            if target is None or type(data) is not np.ndarray or data.dtype != target.dtype \
                    or data.shape[1:] != target.shape[1:]:
                got = f"{type(data).__name__} {getattr(data, 'dtype', '?')}{list(np.shape(data)[1:])}"
                want = "no such column" if target is None else f"{target.dtype}{list(target.shape[1:])}"
                raise ReaderError(f"column {name!r} decoded as {got} where the mixed batches hold {want}; "
                                  "the sources of a mixture must decode to the same types; report this as "
                                  "a shardkit bug, with the sources' schemas")
            if rows is None:
                target[local] = data
            elif data.dtype.hasobject:
                target[local] = data[rows]
            else:  # through memory this thread reuses (a fresh array costs its pages' faults every time)
                target[local] = np.take(data, rows, axis=0, out=_scratch(len(rows), data), mode="clip")
            if mask is not None:
                self._mask(b, name, target.shape)[local] = mask if rows is None else mask[rows]

    def _block(self, b: int, chunk: Columns) -> Columns:
        with self._lock:
            block = self._blocks.get(b)
            if block is None:
                block = {name: self.recycler.empty((self.rows, *np.shape(a)[1:]), a.dtype)
                         for name, a in chunk.items()}
                self._blocks[b] = block
            return block

    def _mask(self, b: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Which values of column ``name`` of block ``b`` are null (made when its first null is placed:
        no row placed before or after holds one unless placed with it)."""
        with self._lock:
            mask = self._masks.get((b, name))
            if mask is None:
                mask = self._masks[b, name] = np.zeros(shape, dtype=bool)
            return mask

    def batch(self, start: int, stop: int, names: Sequence[str]) -> Columns:
        """Views of the positions ``[start, stop)``, which lie in one block and are all placed (masked
        arrays for the columns where the block holds a null)."""
        b, offset = divmod(start, self.rows)
        if stop - b * self.rows > self.rows:
            raise ValueError(f"positions [{start}, {stop}) cross a block of {self.rows} rows")
        block, cut = self._blocks[b], slice(offset, offset + stop - start)
        if not self._masks:  # no nulls placed (the usual case)
            return {name: block[name][cut] for name in names}
        out: Columns = {}
        for name in names:
            mask = self._masks.get((b, name))
            values = block[name][cut]
            out[name] = values if mask is None else np.ma.MaskedArray(values, mask=mask[cut])
        return out

    def release(self, before: int) -> None:
        """Let go of the blocks wholly before position ``before``."""
        with self._lock:
            for b in [b for b in self._blocks if (b + 1) * self.rows <= before]:
                del self._blocks[b]
            for key in [key for key in self._masks if (key[0] + 1) * self.rows <= before]:
                del self._masks[key]


_local = threading.local()


def _scratch(n: int, like: np.ndarray) -> np.ndarray:
    """An array of ``n`` rows like ``like``'s, in memory this thread keeps for it."""
    nbytes = n * like[:1].nbytes
    buffer: np.ndarray | None = getattr(_local, "buffer", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _local.buffer = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buffer[:nbytes].view(like.dtype).reshape((n, *like.shape[1:]))


class WindowPlacement:
    """One window of a reader placed in `Blocks`: its ``positions`` (the stream position of each row, in
    the window's emission order; -1 for rows no position needs). A `batching.Placement`."""

    def __init__(self, blocks: Blocks, positions: np.ndarray) -> None:
        self.blocks = blocks
        self.positions = positions
        self.ok = True

    def place(self, part: Sequence[Columns], dest: np.ndarray) -> None:
        self.blocks.place_all(part, dest)

    def placed(self, parts: Sequence[Sequence[Columns] | None]) -> WindowPlacement | None:
        return self if self.ok and all(p is not None for p in parts) else None

    def gathered(self, chunk: Columns, emitted: np.ndarray) -> None:
        self.blocks.place(chunk, self.positions[emitted])


def destinations(emit: np.ndarray | None, sizes: Sequence[int], positions: np.ndarray
                 ) -> list[np.ndarray] | None:
    """Per task, the stream position of each row it decodes (``positions``: per row in emission order;
    ``emit``: emission order as indices into the tasks' decoded rows, None: in order), or None when
    ``emit`` is not a permutation of them (a row emitted twice)."""
    bounds = np.cumsum([0, *sizes])
    if emit is None:
        return [positions[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]
    total_rows = int(bounds[-1])
    if len(emit) != total_rows:
        return None
    where = np.full(total_rows, -2, dtype=np.int64)
    where[emit] = positions
    if (where == -2).any():
        return None
    return [where[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]


__all__ = ["Blocks", "WindowPlacement", "destinations"]
