"""A shuffle window's rows in emission order: which rows its tasks decode, how the worker threads place
them (`batching.Scatter`), and the chunks the batcher cuts into batches, each row with its position
in the shard's piece (`POSITION`), lost rows (``on_error="skip"``) kept in their places; with
``remainder="mask"``, each batch filled to ``batch_size`` rows and its mask (`VALID`, `masked`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from shardkit.reader._pipeline import batching
from shardkit.reader._pipeline.source import Columns, Part
from shardkit.reader._plan import EpochOrder, Window

POSITION = "\x00shardkit.position"  # rides along in chunks: the piece position of each row
#: ``remainder="mask"``: the column every batch carries, bool per row, True for a sample of the shard's piece,
#: False for a masked row that fills a shorter piece's last batch (see `masked`)
VALID = "__valid__"


def needed_rows(window: Window, order: EpochOrder
                 ) -> tuple[np.ndarray | None, list[np.ndarray | None], list[int]]:
    """Which rows of each task this shard emits, so only those are decoded.

    Returns the emission order as indices into the concatenated decoded rows (None: all, in order),
    per task the rows to decode (None: all of them), and per task how many rows it decodes. A shard
    that needs only part of a shuffle window (at its ends, or when the window spans the whole dataset)
    decodes only its part.
    """
    emit = window.emit(order)
    sizes = [t.stop - t.start for t in window.tasks]
    if emit is None or len(emit) == sum(sizes):
        return emit, [None] * len(window.tasks), sizes
    needed = np.unique(emit)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    cuts = np.searchsorted(needed, bounds)
    picked = [needed[cuts[i] : cuts[i + 1]] - bounds[i] for i in range(len(sizes))]
    rows: list[np.ndarray | None] = list(picked)
    return np.searchsorted(needed, emit), rows, [len(r) for r in picked]


def scatter_plan(emit: np.ndarray | None, sizes: list[int], recycler: batching.Recycler
                  ) -> tuple[batching.Scatter, list[np.ndarray]] | None:
    """How a window's tasks are placed in emission order (`batching.Scatter`), if they can be.

    ``emit`` indexes the concatenation of the tasks' decoded rows; when it is a permutation of them
    (no row emitted twice, as padding does), task ``i``'s rows go to the window rows ``dests[i]``.
    """
    total_rows = sum(sizes)
    if emit is None or len(emit) != total_rows or not total_rows:
        return None
    inverse = np.full(total_rows, -1, dtype=np.int64)
    inverse[emit] = np.arange(total_rows)
    if (inverse < 0).any():  # a row emitted twice, another not at all
        return None
    bounds = np.cumsum([0, *sizes])
    dests = [inverse[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]
    return batching.Scatter(total_rows, recycler), dests


def chunks(parts: Sequence[Part | None], emit: np.ndarray | None, sizes: list[int], position: int,
            need: Callable[[], int], *, lost_at: Callable[[np.ndarray], Columns] | None = None
            ) -> Iterator[Columns]:
    """A window's rows in emission order, as chunks for the batcher, each with its piece positions.

    ``parts`` are the decoded tasks (None: the row group is corrupt and skipped), ``sizes`` the rows each
    decodes, and ``emit`` indexes their concatenation (None: all rows, in order). In order, the decoded
    chunks go out as they are (views, no copy); otherwise each chunk is gathered from the parts,
    ``need()`` rows at a time so that it completes the batcher's next batch without a further copy.
    Lost rows (of skipped parts, or that a part could not decode) keep their places: ``lost_at(j)``
    gives the rows that take them, for their indices ``j`` in the emission order. The position column
    holds, per row, ``position`` plus its index in the window's emission order.
    """
    if all(p is not None and p.whole for p in parts):
        chunks = [c for p in parts if p is not None for c in p.chunks]
        if emit is None:
            offset = position
            for chunk in chunks:
                n = batching.num_rows(chunk)
                yield {**chunk, POSITION: np.arange(offset, offset + n)}
                offset += n
            return
        order = emit
    else:
        counts = np.asarray(sizes, dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        ok = np.ones(int(bounds[-1]), dtype=bool)
        for i, p in enumerate(parts):
            if p is None:
                ok[bounds[i] : bounds[i + 1]] = False
            else:
                ok[bounds[i] + p.lost] = False
        order = np.arange(len(ok)) if emit is None else emit
        lost = np.flatnonzero(~ok[order])  # none, when this shard emits none of the lost rows
        chunks = [c for p in parts if p is not None for c in p.chunks]
        readable = sum(batching.num_rows(c) for c in chunks)
        order = (np.cumsum(ok) - 1)[order]  # index among the readable rows; then the lost ones'
        if len(lost):
            if lost_at is None:
                raise ValueError("rows were lost and nothing gives rows in their place")
            chunks.append(lost_at(lost))
            order[lost] = readable + np.arange(len(lost))
    lengths = np.array([batching.num_rows(c) for c in chunks], dtype=np.int64)
    ends = np.cumsum(lengths)
    owner = np.searchsorted(ends, order, side="right")
    local = order - (ends - lengths)[owner]
    pos = 0
    while pos < len(order):
        cut = slice(pos, pos + need())
        yield {**batching.gather(chunks, owner[cut], local[cut]),
               POSITION: position + np.arange(cut.start, min(cut.stop, len(order)))}
        pos = cut.stop


def pi_at(ranges: Sequence[tuple[int, int]], positions: np.ndarray) -> np.ndarray:
    """The ``pi`` indices at ``positions`` of the concatenation of ``ranges`` (a shard's piece)."""
    lengths = np.array([b - a for a, b in ranges], dtype=np.int64)
    ends = np.cumsum(lengths)
    k = np.searchsorted(ends, positions, side="right")
    starts = np.array([a for a, _ in ranges], dtype=np.int64)
    pi: np.ndarray = starts[k] + positions - (ends - lengths)[k]
    return pi


def masked(batch: Columns, valid: int, batch_size: int) -> Columns:
    """``remainder="mask"``: ``batch`` filled up to ``batch_size`` rows with copies of its first row, and
    its `VALID` column: True on its first ``valid`` rows (samples), False on the rest (masked).

    Example:
        >>> masked({"x": np.array([5, 6])}, 2, 4)
        {'x': array([5, 6, 5, 5]), '__valid__': array([ True,  True, False, False])}

    Copies of a real row keep every value in its field's domain (an index in range, an image of its
    shape), so a model computes on masked rows without error; their loss is masked out. A batch of no
    rows (every sample left out by ``on_error="skip"``) stays empty: it has no row to copy.
    """
    n = batching.num_rows(batch)
    if 0 < n < batch_size:
        batch = batching.concat([batch, batching.take(batch, np.zeros(batch_size - n, dtype=np.int64))])
    mask = np.zeros(batching.num_rows(batch), dtype=bool)
    mask[:valid] = True
    batch[VALID] = mask
    return batch
