"""Planning: which samples each shard reads, in which order — a pure function of the row-group index.

The epoch order. Row groups are put in a random order with ``(seed, epoch)`` (`spread_order`: a
window's row groups come from all parts of the dataset); their rows, concatenated in that order, form
the *stream* (positions ``0..N-1``). The stream is cut into windows of
``shuffle_buffer`` rows and each window is permuted with ``(seed, epoch, window)``. The result is the
epoch's global order ``pi``: rows mix across all row groups a window spans, memory holds one window,
and any position of ``pi`` can be computed without replaying anything (no RNG state to save).
Without shuffling, ``pi`` is the stream in file order.

The quick start (order 3). Where a shard's piece of the epoch's first stage begins (`piece_starts`), its
first batch of rows (the *lead*) is drawn from one row group of the window (`EpochOrder.leads`), so the
reader reads that row group alone and yields the batch before the rest of the window is read
(`lead_window`). ``pi`` then depends on the first stage's number of shards and batch size; a reader
state carries them (``lead``), so a resume on any number of shards goes on in the same ``pi``.

The split. In a stage, the samples of ``pi`` not yet consumed (``remaining``, a list of ranges of
``pi`` indices) are split into ``num_shards`` contiguous, equally sized pieces; shard ``k`` reads
piece ``k`` in order. Contiguous pieces mean each shard reads whole row groups except at its two ends,
where a row group is split by row range (so any number of shards works, even more than row groups).
The remainder policy makes the pieces equal: ``drop`` leaves out the last ``len(remaining) %
num_shards`` samples of the stage, ``pad`` repeats the first ones, ``uneven`` gives the first shards
one more sample (so the last batch may be missing on some shards: it can hang an allreduce).
``mask`` splits as ``uneven`` does, and every shard steps the batches of the longest piece
(`stage_steps`): the reader fills a shorter piece's last batch with masked rows (`mask_ranges`), so
every sample is read once and every shard runs the same number of steps, in every stage.
``drop_last`` also cuts every piece down to a multiple of the batch size (the stage's tail is left out).

Resume. A data-parallel job steps all shards together, so "each shard consumed ``c`` samples of
stage ``i``" (a shorter piece: all of it, if that is less) describes the global position. The state
is the list of stages ``[(num_shards, c), ...]``; replaying it removes exactly the consumed pieces
from ``remaining``, and the next stage splits the rest among any number of shards: nothing repeats,
nothing is skipped.

Lost rows. With ``on_error="skip"``, a row that cannot be read keeps its place in the order; the reader
puts a readable sample there, half an epoch further in ``pi`` or at places hashed from its own
(`shardkit.reader._lost.places`; `first_readable` tells what is known to be unreadable,
`EpochOrder.locate` says where a sample is), so which row takes its place depends on the data and
``pi`` only, and a resume (with any number of shards) agrees.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Mapping, Sequence
from functools import cached_property
from typing import Literal

import numpy as np

from shardkit.errors import ReaderError

Remainder = Literal["drop", "pad", "uneven", "mask"]
REMAINDERS: tuple[Remainder, ...] = ("drop", "pad", "uneven", "mask")
Ranges = list[tuple[int, int]]
#: a stage of an epoch: (num_shards, samples each shard consumed: one count for all, or one per shard)
Stage = tuple[int, int | list[int]]


#: the row groups a shuffle window must span (on average) for the quick start's leads: the first batch then
#: waits for one of them, not for all (a window of two or three: little to save, and the rest of the
#: window is read only once the lead's batch is out: less reading ahead)
LEAD_GROUPS = 4
#: the kinds of order (`EpochOrder.order`; in a reader's state as ``order``): 1, row groups in a plain
#: permutation; `SPREAD`, spread (`spread_order`); `LEADS`, spread, and each shard's first batch drawn from
#: one row group (`EpochOrder.leads`)
SPREAD = 2
LEADS = 3
#: the order a shuffled reader makes
ORDER = LEADS


def spread_order(rows_per_group: np.ndarray, window: int, rng: np.random.Generator) -> np.ndarray:
    """Row-group indices in a shuffled stream order whose every run of ``k`` consecutive row groups (a
    window of ``window`` rows spans about ``k``) draws one row group from each ``k``-th of the dataset.

    The row groups, in the dataset's order, are cut into ``k`` strata of about equal rows; each stratum
    is permuted; the stream takes one row group of each stratum per round, the strata in a random order
    each round. Every row group is as likely to come at any round as with a plain permutation, but a
    window never draws its row groups from one part of the dataset: the rows it mixes lie far apart in
    the dataset's order (a dataset written sorted, by label or by source, is mixed across its sorted
    runs in every window), nearly as far as a uniform shuffle's. With a window as large as the dataset
    (or under two row groups) it is a plain permutation.
    """
    n = len(rows_per_group)
    total = int(rows_per_group.sum())
    k = round(window * n / total) if total else 0
    if k < 2 or k >= n:
        return rng.permutation(n)
    starts = np.cumsum(rows_per_group) - rows_per_group
    stratum = np.minimum((starts + rows_per_group / 2) * k // total, k - 1).astype(np.int64)
    by_stratum = np.lexsort((rng.random(n), stratum))  # each stratum's row groups, in a random order
    first = np.searchsorted(stratum[by_stratum], np.arange(k))  # where each stratum starts in it
    rank = np.empty(n, dtype=np.int64)  # the round each row group comes in
    rank[by_stratum] = np.arange(n) - first[stratum[by_stratum]]
    return np.lexsort((rng.random(n), rank))


@dataclasses.dataclass(frozen=True)
class EpochOrder:
    """The global order ``pi`` of one epoch over ``rows_per_group`` (see the module docstring)."""

    rows_per_group: np.ndarray
    seed: int
    epoch: int
    shuffle: bool
    window: int
    #: 3: row groups in `spread_order`, and the lead of each piece of `starts` from one row group (see
    #: `window_permutation`); 2: spread, no leads (a mixture's sources; a state saved before leads); 1: a
    #: plain permutation (a state saved before the spread order). A resumed state's order goes on
    order: int = ORDER
    #: ``pi`` indices where the shards' pieces of the epoch's first stage begin (`piece_starts`)
    starts: tuple[int, ...] = ()
    #: rows of each lead: the first stage's batch size
    lead: int = 0
    #: the last windows' permutations (a reader asks for a window's many times: its reads, its batches'
    #: keys), read-only
    _perms: dict[int, np.ndarray] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def num_samples(self) -> int:
        return int(self.rows_per_group.sum())

    @cached_property
    def group_order(self) -> np.ndarray:
        """Row-group indices in stream order."""
        n = len(self.rows_per_group)
        if not self.shuffle:
            return np.arange(n)
        rng = np.random.default_rng([self.seed, self.epoch])
        if self.order == 1:
            return rng.permutation(n)
        return spread_order(self.rows_per_group, self.window, rng)

    @cached_property
    def stream_offsets(self) -> np.ndarray:
        """Stream position where each row group (in stream order) starts; one extra entry = N."""
        sizes = self.rows_per_group[self.group_order]
        out = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=out[1:])
        return out

    def window_size(self) -> int:
        return self.window if self.shuffle else max(1, self.num_samples)

    def window_permutation(self, w: int) -> np.ndarray:
        """Stream offsets (within window ``w``) in ``pi`` order: a uniform permutation, with (order 3) the
        leads of the window's `starts` drawn from one row group each (`leads`)."""
        size = min(self.window_size(), self.num_samples - w * self.window_size())
        if not self.shuffle:
            return np.arange(size)
        if w in self._perms:
            return self._perms[w]
        perm = np.random.default_rng([self.seed, self.epoch, w, 1]).permutation(size)
        if self.order >= 3 and self.lead > 0 and self.starts:
            self.leads(w, perm)
        perm.flags.writeable = False
        while len(self._perms) >= 2:
            self._perms.pop(next(iter(self._perms)))
        self._perms[w] = perm
        return perm

    def row_index(self, pi: np.ndarray) -> np.ndarray:
        """The row each of the ``pi`` indices ``pi`` holds, numbered in the dataset's order (a sample's own
        number, whatever the order, the shards and the leads: a transform's seed)."""
        groups, rows = self.locate(pi)
        out: np.ndarray = self._rows_before[groups] + rows
        return out

    @cached_property
    def _rows_before(self) -> np.ndarray:
        """Per row group, the rows of the row groups before it in the dataset's order."""
        before: np.ndarray = np.cumsum(self.rows_per_group) - self.rows_per_group
        return before

    def lead_zones(self, w: int) -> list[tuple[int, int]]:
        """The leads of window ``w`` (order 3), as ``(offset, rows)`` in its permutation (see `leads`):
        none where a window spans fewer than `LEAD_GROUPS` row groups (on average)."""
        groups = len(self.rows_per_group)
        if self.order < LEADS or self.lead <= 0 or not self.shuffle or not self.num_samples or \
                min(groups, self.window * groups / self.num_samples) < LEAD_GROUPS:
            return []
        base = w * self.window_size()
        end = min(self.num_samples, base + self.window_size())
        cut = [*self.starts, self.num_samples]
        return [(a - base, min(self.lead, end - a, b - a))
                for a, b in itertools.pairwise(cut) if base <= a < end]

    def leads(self, w: int, perm: np.ndarray) -> None:
        """Draw each lead of window ``w`` (`lead_zones`) from one row group, in place in its permutation
        ``perm``.

        A lead is the first `lead` rows (fewer where the piece or the window ends sooner) of a piece that
        begins in the window: a shard's first batch of the epoch. Its row group is the one of the sample
        the uniform permutation put first; it takes rows of that row group no other lead took, at random
        (the next row groups of the window if it has too few), in a random order, and the samples they
        displace take their places. Every other position of ``pi`` keeps its uniform draw but for those
        swaps, so a batch after the first mixes the whole window as before; the first batch of a shard
        needs one row group read, not all of the window's (a remote window is fetched row group by row
        group). The permutation stays a pure function of the seed, the epoch and the first stage.
        """
        size = len(perm)
        base = w * self.window_size()
        zones = self.lead_zones(w)
        segs = self.segments(base, base + size)
        if not zones or len(segs) < 2:  # a window of one row group: every batch is from it
            return
        bounds = np.cumsum([0, *(hi - lo for _, lo, hi in segs)])
        inverse = np.empty(size, dtype=np.int64)
        inverse[perm] = np.arange(size)
        taken = np.zeros(size, dtype=bool)
        rng = np.random.default_rng([self.seed, self.epoch, w, 2])
        for at, rows in zones:
            first = int(np.searchsorted(bounds, perm[at], side="right")) - 1
            picked: list[np.ndarray] = []
            need = rows
            for step in range(len(segs)):
                k = (first + step) % len(segs)
                free = np.arange(bounds[k], bounds[k + 1])
                free = free[~taken[free]]
                picked.append(rng.permutation(free)[:need])
                need -= len(picked[-1])
                if not need:
                    break
            chosen = rng.permutation(np.concatenate(picked))
            slots = np.arange(at, at + rows)
            current = perm[slots]
            incoming = chosen[~np.isin(chosen, current)]
            leaving = current[~np.isin(current, chosen)]
            away = inverse[incoming]  # slots outside the lead, where the displaced samples go
            perm[away], inverse[leaving] = leaving, away
            perm[slots], inverse[chosen] = chosen, slots
            taken[chosen] = True

    def stream_positions(self, pi: np.ndarray) -> np.ndarray:
        """The stream positions of the ``pi`` indices ``pi``."""
        pi = np.asarray(pi, dtype=np.int64)
        if not self.shuffle:
            return pi
        size = self.window_size()
        windows = pi // size
        out = np.empty_like(pi)
        for w in np.unique(windows).tolist():
            mine = windows == w
            out[mine] = w * size + self.window_permutation(w)[pi[mine] - w * size]
        return out

    def locate(self, pi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The row group (index) and the row in it of each of the ``pi`` indices ``pi``."""
        stream = self.stream_positions(pi)
        i = np.searchsorted(self.stream_offsets, stream, side="right") - 1
        return self.group_order[i], stream - self.stream_offsets[i]

    def segments(self, start: int, stop: int, order: np.ndarray | None = None,
                 offsets: np.ndarray | None = None) -> list[tuple[int, int, int]]:
        """Stream positions ``[start, stop)`` as ``(row_group, row_start, row_stop)`` pieces."""
        order = self.group_order if order is None else order
        offsets = self.stream_offsets if offsets is None else offsets
        out = []
        i = int(np.searchsorted(offsets, start, side="right")) - 1
        while start < stop:
            g_start, g_stop = int(offsets[i]), int(offsets[i + 1])
            hi = min(stop, g_stop)
            if hi > start:
                out.append((int(order[i]), start - g_start, hi - g_start))
            start = max(start, hi)
            i += 1
        return out


#: ``pi`` indices looked at together when an unshuffled order is searched for readable rows
PROBE_ROWS = 1 << 16


def first_readable(order: EpochOrder, start: np.ndarray, bad_groups: Collection[int],
                   bad_rows: Mapping[int, Collection[int]]) -> np.ndarray | None:
    """For each ``pi`` index of ``start``, the first one at or after it (cyclically) whose row is not
    known to be unreadable: not in a row group of ``bad_groups``, not one of ``bad_rows[row group]``.
    None when every row of the epoch is known to be unreadable.

    Example:
        >>> order = EpochOrder(np.array([3, 3, 3]), seed=0, epoch=0, shuffle=False, window=3)
        >>> first_readable(order, np.array([4, 7]), bad_groups={1}, bad_rows={2: {1}})
        array([6, 8])

    The search goes a block of ``pi`` at a time (a shuffle window, or `PROBE_ROWS` unshuffled): a long
    run of unreadable rows costs a few vectorized steps, not one per row.
    """
    start = np.asarray(start, dtype=np.int64)
    n = order.num_samples
    if (not bad_groups and not bad_rows) or not len(start):
        return start
    block = order.window_size() if order.shuffle else PROBE_ROWS
    blocks = -(-n // block)
    groups = np.fromiter(bad_groups, dtype=np.int64, count=len(bad_groups))
    nearest: dict[int, np.ndarray] = {}  # block -> for each of its offsets, the first readable one on

    def first_ok(b: int) -> np.ndarray:
        if b not in nearest:
            g, r = order.locate(np.arange(b * block, min(n, (b + 1) * block)))
            bad = np.isin(g, groups)
            for group, rows in bad_rows.items():
                mine = g == group
                if mine.any():
                    bad[mine] |= np.isin(r[mine], np.fromiter(rows, dtype=np.int64, count=len(rows)))
            index = np.where(bad, len(bad), np.arange(len(bad)))
            nearest[b] = np.minimum.accumulate(index[::-1])[::-1]
        return nearest[b]

    out = start.copy()
    at = start.copy()
    pending = np.arange(len(start))
    for _ in range(blocks + 1):  # a full turn: back in its first block, from that block's start
        b_of = at[pending] // block
        missed = []
        for b in np.unique(b_of).tolist():
            mine = pending[b_of == b]
            ok = first_ok(b)
            hit = ok[at[mine] - b * block]
            found = hit < len(ok)
            out[mine[found]] = b * block + hit[found]
            at[mine[~found]] = (b + 1) * block if (b + 1) * block < n else 0
            missed.append(mine[~found])
        pending = np.concatenate(missed)
        if not len(pending):
            return out
    return None


def total(ranges: Sequence[tuple[int, int]]) -> int:
    return sum(b - a for a, b in ranges)


def take(ranges: Sequence[tuple[int, int]], start: int, stop: int) -> Ranges:
    """The sub-ranges covering positions ``[start, stop)`` of the concatenation of ``ranges``."""
    out: Ranges = []
    pos = 0
    for a, b in ranges:
        n = b - a
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += n
        if pos >= stop:
            break
    return out


def _split(remaining: Ranges, num_shards: int, remainder: Remainder, batch: int, drop_last: bool, *,
           n: int) -> tuple[list[Ranges], Ranges]:
    """Cut ``remaining`` into ``num_shards`` contiguous pieces per the remainder policy; also returns the
    stage's samples: ``remaining`` and its padding, in order (the pieces are a prefix of them).

    ``pad`` repeats the first samples of ``remaining`` as *virtual* indices: sample ``v`` again is
    ``v + layer * n`` with a ``layer`` above every index in ``remaining`` (`_real` maps them back). So
    the padding a stage did not consume stays in the next stage's ``remaining`` as samples of its own,
    and a resume in the same number of shards splits exactly the rest of each piece (re-padding from
    the resumed stage's first samples instead gave its last shard other repeats than the job without
    the resume).
    """
    total_rows = total(remaining)
    if remainder in ("uneven", "mask"):
        sizes = [total_rows // num_shards + (1 if k < total_rows % num_shards else 0)
                 for k in range(num_shards)]
        if drop_last:  # each shard's last partial batch goes; the pieces stay contiguous
            sizes = [size // batch * batch for size in sizes]
    else:
        per = total_rows // num_shards if remainder == "drop" else -(-total_rows // num_shards)
        if drop_last:
            per = per // batch * batch
        sizes = [per] * num_shards
    extended = list(remaining)
    need = sum(sizes)
    while total(extended) < need:  # pad: repeat from the start of the stage
        layer = max(b - 1 for _, b in extended) // n + 1
        extended += [(a + layer * n, b + layer * n) for a, b in take(remaining, 0, need - total(extended))]
    pieces, pos = [], 0
    for size in sizes:
        pieces.append(take(extended, pos, pos + size))
        pos += size
    return pieces, extended


def _real(ranges: Ranges, n: int) -> Ranges:
    """``ranges`` with virtual (padding) indices mapped back to the samples they repeat (see `_split`)."""
    out: Ranges = []
    for a, b in ranges:
        lo = a
        while lo < b:
            layer = lo // n
            stop = min(b, (layer + 1) * n)
            out.append((lo - layer * n, stop - layer * n))
            lo = stop
    return out


def _subtract(remaining: Ranges, consumed: Ranges) -> Ranges:
    """``remaining`` minus the (sorted, disjoint) ranges in ``consumed``, order kept."""
    cuts = sorted(consumed)
    out: Ranges = []
    for a, b in remaining:
        pos = a
        for c, d in cuts:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
        if pos < b:
            out.append((pos, b))
    return out


def merge(ranges: Sequence[tuple[int, int]]) -> Ranges:
    """Ranges sorted, empty ones dropped, overlapping or touching ones joined."""
    out: Ranges = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def shard_ranges(
    num_samples: int,
    *,
    shard: int,
    num_shards: int,
    history: Sequence[Stage] = (),
    remainder: Remainder = "drop",
    batch_size: int = 1,
    drop_last: bool = False,
) -> Ranges:
    """The ``pi`` index ranges shard ``shard`` of ``num_shards`` reads in the current stage.

    Example:
        >>> shard_ranges(10, shard=1, num_shards=3)            # drop: 3 samples each, 1 dropped
        [(3, 6)]
        >>> shard_ranges(10, shard=0, num_shards=2, history=[(3, 2)])   # resume 3 -> 2 shards
        [(2, 3), (5, 6)]

    ``history`` lists earlier stages of this epoch as ``(num_shards, samples consumed per shard)``: one
    count for every shard, or a list of one count per shard (DataLoader workers a batch apart).
    """
    validate_shard(shard, num_shards)
    remaining: Ranges = [(0, num_samples)] if num_samples else []
    for past_shards, consumed in history:
        counts = stage_counts(past_shards, consumed)
        pieces, stage = _split(remaining, past_shards, remainder, batch_size, drop_last, n=num_samples)
        # A shorter piece (remainder="uneven") is read whole when the longest one reaches its count.
        gone = [r for piece, count in zip(pieces, counts, strict=True) for r in take(piece, 0, count)]
        if max(counts) > max(total(piece) for piece in pieces):
            raise ReaderError(
                f"resume state says a shard of {past_shards} consumed {max(counts)} samples, more than "
                f"the stage holds; the state belongs to another dataset or reader configuration"
            )
        remaining = _subtract(stage, merge(gone))  # padding not consumed stays (see `_split`)
    pieces, _ = _split(remaining, num_shards, remainder, batch_size, drop_last, n=num_samples)
    return _real(pieces[shard], num_samples)


def piece_starts(num_samples: int, num_shards: int, remainder: Remainder = "drop", batch_size: int = 1,
                 drop_last: bool = False) -> tuple[int, ...]:
    """The ``pi`` indices where the shards' pieces of an epoch's first stage begin (`EpochOrder.starts`).

    Example:
        >>> piece_starts(10, 3), piece_starts(10, 3, "uneven")
        ((0, 3, 6), (0, 4, 7))
    """
    pieces, _ = _split([(0, num_samples)] if num_samples else [], num_shards, remainder, batch_size,
                       drop_last, n=num_samples)
    return tuple(sorted({piece[0][0] for piece in pieces if piece and piece[0][0] < num_samples}))


def stage_steps(num_samples: int, *, num_shards: int, history: Sequence[Stage] = (),
                remainder: Remainder = "drop", batch_size: int = 1, drop_last: bool = False) -> int:
    """Batches every shard steps in the current stage: those of its longest piece (shard 0's).

    Example:
        >>> stage_steps(10, num_shards=3, remainder="mask", batch_size=2)   # pieces of 4, 3, 3 samples
        2
    """
    longest = shard_ranges(num_samples, shard=0, num_shards=num_shards, history=history,
                           remainder=remainder, batch_size=batch_size, drop_last=drop_last)
    return -(-total(longest) // batch_size)


def mask_ranges(ranges: Ranges, *, start: int, steps_left: int, batch_size: int, first: Ranges) -> Ranges:
    """``remainder="mask"``: a shard's piece ``ranges`` with the masked rows it reads to step
    ``steps_left`` more batches from piece position ``start``. Rows past ``total(ranges)`` are masked.

    Example:
        >>> mask_ranges([(0, 4)], start=0, steps_left=3, batch_size=2, first=[(0, 5)])  # 2 batches + 1
        [(0, 4), (3, 4)]
        >>> mask_ranges([], start=0, steps_left=1, batch_size=2, first=[(7, 9)])         # an empty piece
        [(7, 8)]

    Pieces differ by one sample at most, so a shorter piece is one batch short at most: one row of it,
    its last one again (in the window already read), makes that batch; the reader fills the batch up to
    ``batch_size`` rows with copies of it. An empty piece (a stage of fewer samples than shards) reads
    the first sample of ``first`` (the longest piece) instead. The reader pads the last partial batch
    of a piece the same way; what is masked is never a sample of the piece, so nothing is consumed.
    """
    batches = -(-max(0, total(ranges) - start) // batch_size)
    if steps_left <= batches:
        return ranges
    filler = take(ranges, total(ranges) - 1, total(ranges)) if ranges else take(first, 0, 1)
    return [*ranges, *filler]


def stage_counts(num_shards: int, consumed: int | Sequence[int]) -> list[int]:
    """The samples each of ``num_shards`` shards consumed in a stage: ``consumed`` is one count for all
    (ranks step together) or one per shard (DataLoader workers, some a batch ahead of others).

    Example:
        >>> stage_counts(3, 8), stage_counts(3, [8, 8, 4])
        ([8, 8, 8], [8, 8, 4])
    """
    counts = [consumed] * num_shards if isinstance(consumed, int) else list(consumed)
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards <= 0 \
            or len(counts) != num_shards \
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise ReaderError(f"resume history entry {(num_shards, consumed)!r:.200} is invalid: it needs a "
                          "number of shards and the samples consumed (one int, or one per shard)")
    return counts


def validate_shard(shard: int, num_shards: int) -> None:
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
        raise ReaderError(f"num_shards={num_shards!r} must be a positive int (the number of workers)")
    if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < num_shards:
        raise ReaderError(
            f"shard={shard!r} must be an int in [0, num_shards={num_shards}); pass the worker's rank"
        )


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of reading: rows ``[start, stop)`` of row group ``row_group``."""

    row_group: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Window:
    """Read ``tasks`` and concatenate their rows; then emit ``picks`` of the window's permutation.

    ``picks`` are ``(lo, hi)`` slices of ``EpochOrder.window_permutation(index)``, computed only
    when the window is read (so planning stays cheap); None means every row, in order (unshuffled).
    """

    index: int
    tasks: tuple[Task, ...]
    picks: tuple[tuple[int, int], ...] | None
    #: the stream offsets (within the window) each task's rows are, in the tasks' order, where the tasks
    #: cover part of the window or not in its order (`lead_window`); None: the whole window, in order
    spans: tuple[tuple[int, int], ...] | None = None

    @property
    def num_rows(self) -> int:
        if self.picks is None:
            return sum(t.stop - t.start for t in self.tasks)
        return sum(hi - lo for lo, hi in self.picks)

    def emit(self, order: EpochOrder) -> np.ndarray | None:
        """Row indices into the concatenated tasks, in emission order (None: all rows in order)."""
        if self.picks is None:
            return None
        perm = order.window_permutation(self.index)
        out = np.concatenate([perm[lo:hi] for lo, hi in self.picks])
        if self.spans is None:
            return out
        starts = np.array([a for a, _ in self.spans], dtype=np.int64)
        before = np.cumsum([0, *(b - a for a, b in self.spans)])[:-1]
        by_start = np.argsort(starts)
        k = by_start[np.searchsorted(starts[by_start], out, side="right") - 1]
        within: np.ndarray = out - starts[k] + before[k]
        return within


def split_tasks(windows: Sequence[Window], task_rows: int | None, first_rows: int | None = None
                ) -> list[Window]:
    """``windows`` with each task cut at multiples of ``task_rows`` rows of its row group (None: as is),
    and the very first task cut after ``first_rows`` rows too (the first batch needs no more).

    The cut tasks cover the same rows in the same order, so the windows emit the same rows; an
    unshuffled window becomes one window per cut task (its rows go out as soon as that task is read).
    Smaller tasks let the first rows of a row group be decoded and emitted while its later slices are
    still being read, and spread one row group over several worker threads.
    """
    if task_rows is None:
        return list(windows)
    out: list[Window] = []
    for w in windows:
        tasks: list[Task] = []
        for t in w.tasks:
            cuts = range((t.start // task_rows + 1) * task_rows, t.stop, task_rows)
            head = [t.start + first_rows] if first_rows and not out and not tasks else []
            edges = sorted({t.start, *(c for c in head if c < t.stop), *cuts, t.stop})
            tasks.extend(Task(t.row_group, a, b) for a, b in itertools.pairwise(edges))
        if w.picks is None:
            out.extend(Window(w.index, (t,), None) for t in tasks)
        else:
            out.append(dataclasses.replace(w, tasks=tuple(tasks)))
    return out


def lead_window(order: EpochOrder, windows: list[Window], first: int) -> list[Window]:
    """``windows`` (a shard's, from the start of its piece, ``pi`` index ``first``) with the first one cut
    in two where the piece begins with a lead (`EpochOrder.leads`): the lead alone, reading only the row
    groups its rows lie in, then the rest of the window, those row groups first (their read is still
    there: the source keeps its last reads). So a shard's first batch waits for one row group, not for
    the whole window."""
    w = windows[0] if windows else None
    if w is None or w.picks is None or w.spans is not None:
        return windows
    at = first - w.index * order.window_size()
    rows = dict(order.lead_zones(w.index)).get(at)
    if rows is None or w.picks[0][0] != at:
        return windows
    rows = min(rows, w.picks[0][1] - at)  # a piece shorter than a batch
    bounds = np.cumsum([0, *(t.stop - t.start for t in w.tasks)])
    offsets = order.window_permutation(w.index)[at:at + rows]
    used = np.unique(np.searchsorted(bounds, offsets, side="right") - 1).tolist()
    spans = [(int(bounds[k]), int(bounds[k + 1])) for k in range(len(w.tasks))]
    lead = Window(w.index, tuple(w.tasks[k] for k in used), ((at, at + rows),), tuple(spans[k] for k in used))
    picks = ((at + rows, w.picks[0][1]), *w.picks[1:]) if at + rows < w.picks[0][1] else w.picks[1:]
    if not picks:
        return [lead, *windows[1:]]
    tasks = used + [k for k in range(len(w.tasks)) if k not in used]
    rest = Window(w.index, tuple(w.tasks[k] for k in tasks), picks, tuple(spans[k] for k in tasks))
    return [lead, rest, *windows[1:]]


def shard_windows(order: EpochOrder, ranges: Ranges) -> list[Window]:
    """The windows a shard reads for ``ranges`` of ``pi``, in order.

    Shuffled: a window's tasks cover its whole stream span and its picks select the shard's rows in
    ``pi`` order; two ranges in one window (after a resume) share one read. Unshuffled: one window
    per task, covering exactly the shard's rows.
    """
    group_order, offsets = order.group_order, order.stream_offsets
    out: list[Window] = []
    if not order.shuffle:  # one window per task: rows stream out as soon as each task is read
        for a, b in ranges:
            for seg in order.segments(a, b, group_order, offsets):
                out.append(Window(len(out), (Task(*seg),), None))
        return out
    size = order.window_size()
    n = order.num_samples
    for a, b in ranges:
        for w in range(a // size, (b - 1) // size + 1):
            pick = (max(a, w * size) - w * size, min(b, (w + 1) * size) - w * size)
            if out and out[-1].index == w:
                out[-1] = Window(w, out[-1].tasks, (*(out[-1].picks or ()), pick))
                continue
            span = order.segments(w * size, min(n, (w + 1) * size), group_order, offsets)
            out.append(Window(w, tuple(Task(*seg) for seg in span), (pick,)))
    return out
