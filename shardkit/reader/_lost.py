"""Rows in the place of lost ones (``on_error="skip"``): which readable sample takes a lost sample's
place, chosen from the epoch's order and the known bad rows only, so that every reader (resumed, or of
another number of shards) makes the same choice."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from shardkit.errors import CorruptDatasetError
from shardkit.reader._pipeline import batching
from shardkit.reader._pipeline.source import Columns, Part, RowGroupSource
from shardkit.reader._plan import EpochOrder, Task, first_readable

#: Places of ``pi`` tried for a lost sample (`probes`) before the first readable one after the last.
PROBES = 32
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's


def probe(x: np.ndarray, j: int, n: int) -> np.ndarray:
    """The ``j``-th place (``j >= 1``) tried for the lost samples ``x`` of an epoch of ``n``: a hash
    (splitmix64) of ``x`` and ``j``, so that lost neighbours try places far apart."""
    z = x.astype(np.uint64) * np.uint64(_GOLDEN) + np.uint64(j * _MIX1 % 2**64)  # arrays wrap silently
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return (z % np.uint64(n)).astype(np.int64)


def places(order: EpochOrder, lost: np.ndarray, bad_groups: frozenset[int],
           bad_rows: dict[int, frozenset[int]]) -> np.ndarray | None:
    """The place (a ``pi`` index) that takes each lost sample's: see `substitutes`. None when no row
    of the epoch is left that is not known to be unreadable."""
    n = order.num_samples
    lost = np.asarray(lost, dtype=np.int64)
    at = (lost + n // 2) % n
    out = at.copy()
    pending = np.arange(len(lost))
    for j in range(PROBES):
        if j:
            at[pending] = probe(lost[pending], j, n)
        first = first_readable(order, at[pending], bad_groups, bad_rows)
        if first is None:
            return None
        ok = first == at[pending]
        out[pending] = first  # readable at the place itself, or (after the last probe) the first after it
        pending = pending[~ok]
        if not len(pending):
            break
    return out


def substitutes(order: EpochOrder, lost: np.ndarray, source: RowGroupSource,
                submit: Callable[..., Future[Part | None]], where: str) -> Columns:
    """Readable rows in place of the samples ``lost`` (indices of ``pi``) that could not be read.

    The place of sample ``x`` is taken by the sample at ``x + N // 2`` in ``pi`` (cyclically, ``N``
    samples in the epoch) when it can be read: half an epoch away, so a run of lost rows takes as
    many distinct rows. When that one cannot be read either, by the first readable of `PROBES` - 1
    places hashed from ``x`` (`probe`), then by the first readable after the last: a long run of
    lost rows spreads over the readable ones (it took the first readable row after the unreadable
    ones it fell on, and with most of the data lost one row took a great many places). The choice depends
    only on the epoch's order and on which rows can be read: a resumed reader, or another number
    of shards, makes the same choice. Rows already known to be unreadable are passed over unread;
    the others are read (again), and when found unreadable, passed over too.

    ``submit`` runs a read in the reader's thread pool; ``where`` begins the error message (the shard,
    the epoch and the dataset: "... no sample of <url>").

    Raises `CorruptDatasetError` when no sample of the epoch can be read.
    """
    found: dict[int, tuple[Columns, int]] = {}  # pi index -> (decoded rows, row among them)
    while True:
        readable = places(order, lost, *source.known_bad())
        if readable is None:
            raise CorruptDatasetError(
                f"{where} can be read in the place of the {len(lost)} lost: every one is in a row group (or "
                f"is a row) skipped as corrupt (on_error='skip'); first: "
                f"{next(iter(source.skipped.values()), '?')}. Rewrite the dataset"
            )
        candidates = readable
        todo = np.unique(candidates[[int(c) not in found for c in candidates]])
        if not len(todo):
            break
        groups, rows = order.locate(todo)
        reads = []
        for g in np.unique(groups).tolist():
            mine = groups == g
            needed = rows[mine]
            sort = np.argsort(needed, kind="stable")  # a read takes its rows in ascending order
            lo = int(needed[sort[0]])
            task = Task(g, lo, int(needed[sort[-1]]) + 1)
            reads.append((todo[mine][sort], needed[sort] - lo,
                          submit(source.read, task, needed[sort] - lo)))
        for pis, rel, future in reads:
            part = future.result()
            if part is None:
                continue  # the row group is now a known bad one: the next round passes it over
            decoded = batching.concat(part.chunks) if part.chunks else {}
            kept = np.ones(len(rel), dtype=bool)  # rows that decoded (the others: known bad now)
            kept[part.lost] = False
            at = np.cumsum(kept) - 1
            for k, x in enumerate(pis.tolist()):
                if kept[k]:
                    found[x] = (decoded, int(at[k]))
    rows_of = [found[int(c)] for c in candidates]
    chunks = list({id(d): d for d, _ in rows_of}.values())
    index = {id(d): i for i, d in enumerate(chunks)}
    owner = np.array([index[id(d)] for d, _ in rows_of], dtype=np.int64)
    local = np.array([r for _, r in rows_of], dtype=np.int64)
    return batching.gather(chunks, owner, local)
