"""Reading one task: a row range of a row group -> decoded numpy columns (through the cache if any).

Runs in the reader's worker threads: Parquet decoding, Arrow->numpy and image decoding all release
the GIL, so row groups are fetched and decoded in parallel. A task decodes to a list of chunks (the
row group's `SLICE_ROWS`-row record batches, cut to the task's rows): read in order, fixed-shape
tensors stay zero-copy views of the Arrow buffers up to the batches; a shuffled reader's task is
concatenated once, in the worker, into the chunk its window gathers batches from.

Tasks of one row group share its read. Without a cache the row group is read slice by slice, only as
far as the tasks so far need: the reader cuts the first window of a pass into small tasks, so the
first rows are decoded while the rest of their row group is still being read. A read that fails fails
every task that shares it (none gets the rows read before the failure as a whole task).

Remote row groups are fetched ahead (`shardkit.dataset.fetch`): the reader gives the order it will
read them in (`RowGroupSource.plan`), and their column chunks are requested in that order, within a
budget of bytes, so that a store's round trips overlap instead of adding up. A row group read before
its turn is fetched at once; one whose fetch failed is read directly, which retries and names the
failure as a direct read does. Row groups the cache holds are not fetched.

With a cache, the processes of a machine that share its folder fetch each row group once between them
(the cache's claims, `shardkit.reader._cache`): the fetch-ahead claims the row groups of the plan in
order, as far ahead as the fetcher's budget (`Fetcher.target`) of row groups claimed and not read yet,
and skips those the cache holds or another process has claimed. A thread of the source's own (the
filler) fetches the claimed row groups whole, writes them to the cache and lets go of their claims,
whatever the reads are doing: a process that waits for another's entry never waits on that process's
reads, so two processes waiting for each other's row groups always get them. A read takes a row group
from the cache (memory-mapped); one it reaches before the filler does it fills itself; one claimed
elsewhere it waits for (`RowGroupCache.wait`), and fetches itself when the claim goes away without an
entry or turns stale (a killed process). A remote row group read through the cache is read whole, not
slice by slice: its claim must not wait on later tasks. Where the cache folder takes no claims, each
process fetches ahead on its own, as without claims.

With a cache, a row group's key names its file's version (`Location.versions`: the ETag on object
stores, ``size:mtime_ns`` locally), so a file rewritten in place under the same name, with the same
rows and bytes, is fetched again instead of served from the old entry. The versions come from one
listing of the dataset, made at the reader's first read through the cache (one request per 1,000
files, not one per file); locally, and where the store refuses the listing, each file is looked at
once (a ``stat``, or one request) before its first read. A file whose filesystem gives no version
at all is read without the cache: an entry could not be told from a stale one. No cache, no listing.

Corrupt data (``on_error="skip"``). What is lost must not depend on how the reader happened to cut its
tasks (a resumed reader cuts them elsewhere), so with ``on_error="skip"`` a row group is read to its end
before any of its rows is used: a row group that cannot be read is lost whole, in every task and every
pass. A row that cannot be decoded (a corrupt image) is lost alone: the task's other rows are decoded
one by one. Either way the facts are kept (`RowGroupSource.bad_groups`, `RowGroupSource.bad_rows`) for
the reader to find readable rows in the place of lost ones without reading them again.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa

from shardkit.dataset import SLICE_ROWS, Dataset
from shardkit.dataset.fetch import Fetched, Fetcher, fetch_getter
from shardkit.errors import CorruptDatasetError, ImageShapeError
from shardkit.reader._pipeline import batching
from shardkit.reader._pipeline.spill import SEGMENT_BITS
from shardkit.reader._plan import Task

if TYPE_CHECKING:
    from shardkit.reader._cache import Claim, RowGroupCache
    from shardkit.reader._pipeline.spill import Spill

Columns = dict[str, np.ndarray]
#: fields a task leaves encoded: the spill their values go to, its segment, and their names
Late = tuple["Spill", int, tuple[str, ...]]


def row_group_key(dataset: Dataset, row_group: int, columns: Sequence[str], version: str) -> str:
    """The row-group cache's key of row group ``row_group``'s ``columns`` of ``dataset``, whose file is at
    ``version`` (an ETag, a local ``size:mtime_ns``): what a reader and a `shardkit.torch.MapDataset`
    share the entries of."""
    rg = dataset.row_groups[row_group]
    key = "|".join([dataset.url, rg.file, version, str(rg.index), str(rg.num_rows), str(rg.num_bytes),
                    ",".join(columns)])
    if tag := dataset.deletions_tag(row_group):  # a table's deleted rows: per version, not per file
        key += "|" + tag
    return key


@dataclasses.dataclass(frozen=True)
class Part:
    """One task's decoded rows: ``chunks`` of its readable rows in order, and ``lost``, the indices (among
    the rows the task decodes) of rows that could not be decoded and were skipped (``on_error="skip"``)."""

    chunks: list[Columns]
    lost: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def whole(self) -> bool:
        """Whether every row of the task is here."""
        return not len(self.lost)


@dataclasses.dataclass(eq=False)
class _Ahead:
    """A row group this source claimed ahead: fetched whole and written to the cache by whoever gets to
    it first, the filler or a read (``state``: claimed -> filling -> done)."""

    key: str
    claim: Claim
    where: tuple[str, list[tuple[int, int]]]  # its file and byte ranges (`Dataset.chunk_ranges`)
    state: str = "claimed"
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    table: pa.Table | None = None  # when it could not be cached: handed to its read
    fetched: bool = False  # fetched here (a cache miss of this process, counted when it is read)

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.where[1])


IN_PLACE_KEPT = 64  # row groups whose value pages (`Dataset.value_pages`) are kept for their next tasks
RECENT_READS = 2  # row-group tables kept for the next task (bounded memory: two row groups)
DEFAULT_INFLIGHT = 512 << 20  # bytes fetched ahead of a remote dataset's reads, at most (make_reader's)


class RowGroupSource:
    """Fetches and decodes tasks of one dataset for a fixed column selection."""

    def __init__(
        self,
        dataset: Dataset,
        columns: Sequence[str],
        *,
        selection: dict[int, np.ndarray] | None = None,
        cache: RowGroupCache | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        max_inflight_bytes: int = DEFAULT_INFLIGHT,
    ) -> None:
        self.dataset = dataset
        self.columns = list(columns)  # read through Parquet
        self.fields = list(columns)  # every field of a task's rows, in order
        self.direct: frozenset[str] = frozenset()  # late fields read in place, not through Parquet
        # late fields read in place: (path, `PlainLayout`, `PageChecks` or None) per (row group, name)
        self._ranges: OrderedDict[tuple[int, str], tuple[str, Any, Any] | None] = OrderedDict()
        self.selection = selection or {}
        self.cache = cache
        self.on_error = on_error
        self.skipped: dict[int, str] = {}  # corrupt row groups skipped (index -> error), until cleared
        # facts, kept for good (on_error="skip"): row groups that cannot be read, and per row group the
        # rows (of the plan: a filter's selected rows) that cannot be decoded
        self.bad_groups: set[int] = set()
        self.bad_rows: dict[int, set[int]] = {}
        self.remote_reads = 0
        self._lock = threading.Lock()
        self._recent: OrderedDict[int, _Shared] = OrderedDict()
        self._versions: dict[str, str | None] | None = None  # file -> version, when a cache is in use
        self._versions_lock = threading.Lock()
        self._fetcher: Fetcher | None = None
        if not dataset.location.is_local:
            self._fetcher = Fetcher(fetch_getter(dataset.location.fs), max_inflight_bytes)
        self._reset_ahead()

    def _reset_ahead(self) -> None:
        """No row group claimed ahead: at the start, and in a process forked from one that had claimed
        (its claims and its filler thread stay the parent's)."""
        self._pid = os.getpid()
        self._claims = self._fetcher is not None and self.cache is not None  # until the folder says no
        self._order: deque[int] = deque()  # the plan's row groups not yet looked at for claiming
        self._ahead: OrderedDict[int, _Ahead] = OrderedDict()  # claimed here, not read yet
        self._ahead_lock = threading.Condition()
        self._filler: threading.Thread | None = None
        self._closed = False

    def close(self) -> None:
        """Let go of the row groups being read (their open files), as `Reader.close` does: a reader kept
        alive after it is closed (tf.data keeps every generator it ran) no longer holds files open.
        Claims not filled yet are let go of (other processes then fetch those row groups)."""
        with self._lock:
            reads = list(self._recent.values())
            self._recent.clear()
        for read in reads:
            read.close()
        if self._pid == os.getpid():
            with self._ahead_lock:
                self._closed = True
                unfilled = [a for a in self._ahead.values() if a.state == "claimed"]
                self._ahead.clear()
                self._order.clear()
                self._ahead_lock.notify_all()
            for a in unfilled:
                self.cache.release(a.claim)  # type: ignore[union-attr]
        if self._fetcher is not None:
            self._fetcher.close()

    def read_in_place(self, names: Sequence[str]) -> None:
        """Read the late fields ``names`` of a local dataset that stores them as they are in place (no
        Parquet read of their pages but the checksum's: `Dataset.value_pages`), the others through
        Parquet; ``()``: every field through Parquet (a mixture's source decodes as it reads)."""
        self.direct = frozenset(n for n in names if self.dataset.stored_as_is(n))
        self.columns = [c for c in self.fields if c not in self.direct]
        with self._lock:
            self._recent.clear()

    def known_bad(self) -> tuple[frozenset[int], dict[int, frozenset[int]]]:
        """A snapshot of `bad_groups` and `bad_rows` (worker threads add to them meanwhile)."""
        with self._lock:
            return frozenset(self.bad_groups), {g: frozenset(r) for g, r in self.bad_rows.items()}

    def plan(self, row_groups: Sequence[int], *, new_pass: bool = True) -> None:
        """The row groups about to be read, in order (repeats ignored): a remote dataset's are fetched
        ahead (see the module docstring), but for those the cache holds. A new pass: the reads kept for
        the last pass's next tasks go (each pass reads its row groups anew, as `shardkit bench` counts);
        ``new_pass=False``: the same pass, planned further (after a quick start's lead)."""
        if new_pass:
            with self._lock:
                self._recent.clear()
        if self._fetcher is None:
            return
        if self._pid != os.getpid():
            self._reset_ahead()
        if self._claims:
            with self._ahead_lock:
                self._order = deque(dict.fromkeys(row_groups))
                planned = set(self._order)
                for g, a in list(self._ahead.items()):  # filled and cached (a read finds them there),
                    if a.state == "done" and (a.table is None or g not in planned):  # or not read now
                        del self._ahead[g]
            self._claim_more()
            return
        self._plan_unclaimed(row_groups)

    def _plan_unclaimed(self, row_groups: Sequence[int],
                        first: Sequence[tuple[int, str, list[tuple[int, int]]]] = ()) -> None:
        """Fetch ahead ``first``, then the row groups the cache does not hold, claiming none."""
        assert self._fetcher is not None
        items = list(first)
        for g in dict.fromkeys(row_groups):
            if self.cache is not None and self._cached(g):
                continue
            where = self.dataset.chunk_ranges(g, self.columns)
            if where is not None:
                items.append((g, *where))
        self._fetcher.plan(items)

    def _claim_more(self) -> None:
        """Claim the plan's next row groups (skipping those the cache holds or another process claimed)
        while the row groups claimed here and not read yet stay within the fetcher's budget; fetch
        them ahead, in order, and wake the filler."""
        assert self._fetcher is not None
        assert self.cache is not None
        with self._ahead_lock:
            if self._closed or not self._claims:
                return
            budget = self._fetcher.target()
            pending = sum(a.nbytes for a in self._ahead.values())  # filled or not: not read yet
            while self._order and (pending < budget or not self._ahead):
                g = self._order.popleft()
                if g in self._ahead:
                    continue
                key = self._key(g)
                where = None if key is None else self.dataset.chunk_ranges(g, self.columns)
                if key is None or where is None or self.cache.has(key):
                    continue  # never cached, or not fetched ahead (its read goes on its own), or held
                claim = self.cache.claim(key)
                if claim is None:  # another process is fetching it: read from the cache when needed
                    continue
                if claim.path is None:  # the folder takes no claims: each process fetches ahead alone
                    self._claims = False
                    first = [(h, *a.where) for h, a in self._ahead.items() if a.state == "claimed"]
                    self._plan_unclaimed([g, *self._order], first)
                    self._order.clear()
                    break
                self._ahead[g] = _Ahead(key, claim, where)
                pending += self._ahead[g].nbytes
            else:
                self._fetcher.plan([(g, *a.where) for g, a in self._ahead.items() if a.state == "claimed"])
            if self._filler is None and any(a.state == "claimed" for a in self._ahead.values()):
                # one at a time, in claim order; it ends when nothing claimed is left (a reader never
                # closed keeps no idle thread), and starts again with the next claim
                self._filler = threading.Thread(target=self._fill_claimed, name="shardkit-cache-fill",
                                                daemon=True)
                self._filler.start()
            self._ahead_lock.notify_all()

    def _fill_claimed(self) -> None:
        """The filler thread: the row groups claimed here, in order, fetched and cached."""
        while True:
            with self._ahead_lock:
                found = None if self._closed else next(
                    ((g, a) for g, a in self._ahead.items() if a.state == "claimed"), None)
                if found is None:
                    self._filler = None
                    return
                g, a = found
                a.state = "filling"
            self._fill(g, a)

    def _fill(self, row_group: int, ahead: _Ahead, *, reraise: bool = False) -> None:
        """Fetch a row group claimed here whole, write it to the cache and let go of its claim. A fetch
        that fails lets go, and raises with ``reraise`` (a read's), else not (the filler's: the read of
        the row group then reads it directly, which retries and names the failure)."""
        cache = self.cache
        assert cache is not None
        table = None
        try:
            if not self._closed:
                # decoded as one record batch, which the cache writes as it is (slices: a copy)
                stream = self._stream(row_group, whole=True)
                try:
                    table = stream.upto(None)
                finally:
                    stream.close()
                    if self._fetcher is not None:
                        self._fetcher.release(row_group)
                cache.put(ahead.key, table)
                ahead.fetched = True
        except Exception:
            table = None
            if reraise:
                raise
        finally:
            cache.release(ahead.claim)
            with self._ahead_lock:
                ahead.table = table if table is not None and not cache.has(ahead.key) else None
                ahead.state = "done"
                ahead.done.set()
                self._ahead_lock.notify_all()

    def _cached(self, row_group: int) -> bool:
        key = self._key(row_group)
        return key is None or (self.cache is not None and self.cache.has(key))

    def _stream(self, row_group: int, on_done: Callable[[pa.Table], None] | None = None, *,
                whole: bool = False) -> _Stream:
        with self._lock:
            self.remote_reads += 1
        fetched = None
        if self._fetcher is not None:
            try:
                fetched = self._fetcher.take(row_group)
            except Exception:  # read directly: its retries, and today's words for what went wrong
                fetched = None
        stream = _Stream(self.dataset, row_group, self.columns, on_done, fetched, whole=whole)
        if fetched is not None:  # its bytes are let go of when the stream is
            weakref.finalize(stream, self._fetcher.release, row_group)  # type: ignore[union-attr]
        return stream

    def _version(self, file: str) -> str | None:
        """``file``'s version as of this source's first read of it (see the module docstring)."""
        loc = self.dataset.location
        with self._versions_lock:  # one listing, even when several worker threads start at once
            if self._versions is None:
                self._versions = dict(loc.versions())
            if file not in self._versions:
                self._versions[file] = loc.version(file)
            version = self._versions[file]
        self.dataset.saw_version(file, version)
        return version

    def _key(self, row_group: int) -> str | None:
        """The cache key of the row group's rows; None when its file gives no version (never cached)."""
        version = self._version(self.dataset.row_groups[row_group].file)
        if version is None:  # nothing tells a rewritten file from this one: never cache it
            return None
        return row_group_key(self.dataset, row_group, self.columns, version)

    def _open(self, row_group: int) -> _Stream | pa.Table:
        """A new read of the row group: the cached table, or a stream (which fills the cache at its end)."""
        if self.cache is None:
            return self._stream(row_group)
        key = self._key(row_group)
        if key is None:
            return self._stream(row_group)
        cache = self.cache
        if self._fetcher is not None and self._claims and self._pid == os.getpid():
            return self._open_claimed(row_group, key)
        table = cache.get(key)
        return table if table is not None else self._stream(row_group, lambda t: cache.put(key, t))

    def _open_claimed(self, row_group: int, key: str) -> _Stream | pa.Table:
        """A remote row group through the cache's claims (see the module docstring): the whole table."""
        cache = self.cache
        assert cache is not None
        assert self._fetcher is not None
        with self._ahead_lock:
            ahead = self._ahead.pop(row_group, None)  # read now: room for more ahead
            fill = ahead is not None and ahead.state == "claimed"
            if fill:
                ahead.state = "filling"  # type: ignore[union-attr]
        if ahead is not None:
            self._claim_more()
            if fill:
                self._fill(row_group, ahead, reraise=True)
            ahead.done.wait()
            if ahead.fetched:  # fetched here: this process's miss, read back from the cache uncounted
                cache.count("misses")
                table = ahead.table if ahead.table is not None else cache.get(key, count=False)
                if table is not None:
                    return table
            elif ahead.table is not None:
                return ahead.table
        while True:
            table = cache.get(key)
            if table is not None:
                return table
            claim = cache.claim(key)
            if claim is None:  # another process is fetching it
                table = cache.wait(key, count=False)
                if table is not None:
                    return table
                if cache.claimed(key):  # waited CLAIM_WAIT_S for it: read it unclaimed
                    return self._stream(row_group, lambda t: cache.put(key, t))
                continue
            if claim.path is None:  # the folder takes no claims: as without them
                return self._stream(row_group, lambda t: cache.put(key, t))
            where = self.dataset.chunk_ranges(row_group, self.columns)
            mine = _Ahead(key, claim, where if where is not None else ("", []), state="filling")
            if where is not None:  # fetched at once, ahead of the rest
                with self._ahead_lock:
                    self._fetcher.plan([(row_group, *where)] + [
                        (g, *a.where) for g, a in self._ahead.items() if a.state == "claimed"])
            self._fill(row_group, mine, reraise=True)
            if mine.table is not None:
                return mine.table
            table = cache.get(key, count=False)  # (its miss counted above)
            if table is not None:
                return table
            return self._stream(row_group)  # its fetch failed: read directly, which names the failure

    def _arrow(self, row_group: int, stop: int | None) -> pa.Table:
        """The row group's Arrow table, at least its first ``stop`` rows (None: all). Tasks of one row group
        share one read (a small table of recent reads), which goes slice by slice, as far as the tasks
        so far need, so the first task's rows are decoded while later slices are read."""
        with self._lock:
            read = self._recent.get(row_group)
            if read is None:
                read = self._recent[row_group] = _Shared(self._open, row_group)
                while len(self._recent) > RECENT_READS:
                    self._recent.popitem(last=False)
            else:
                self._recent.move_to_end(row_group)
        try:
            return read.upto(stop)
        except BaseException:
            with self._lock:
                if self._recent.get(row_group) is read:
                    del self._recent[row_group]
            raise

    def _head(self, row_group: int, stop: int) -> pa.Table:
        """The row group's first ``stop`` rows (at least), read from their pages only (`read`'s ``head``):
        decoded in a batch of ``stop`` rows (not `SLICE_ROWS`), so that no page past them is requested
        (a column of images holds a few dozen rows a page)."""
        batches: list[pa.RecordBatch] = []
        it = self.dataset.iter_row_group(row_group, self.columns, head=True,
                                         batch_size=min(max(stop, 1), SLICE_ROWS))
        try:
            for batch in it:
                batches.append(batch)
                stop -= batch.num_rows
                if stop <= 0:
                    break
        finally:
            close = getattr(it, "close", None)  # (a generator: its file let go of now)
            if close is not None:
                close()
        return self.dataset.table_of(batches, self.columns)

    def read(self, task: Task, rows: np.ndarray | None = None, *, whole: bool = False,
             to_end: bool = True, late: Late | None = None, times: Any = None, head: bool = False
             ) -> Part | None:
        """Decoded chunks of ``task``'s rows (only ``rows`` of them, relative to ``task.start``, when
        given), in order; None when the row group is corrupt and skipped.

        ``whole=True`` concatenates the chunks into one (here, in the worker thread): what a shuffle
        window gathers from, at a fraction of the cost of gathering from many small chunks.
        ``to_end=False`` (with a cache): read the row group only as far as this task needs; a later
        task of the row group reads it to its end, and the whole row group is then cached. With
        ``on_error="skip"`` every task reads its row group to its end (see the module docstring).
        ``late``: fields left encoded, their values appended to a spill segment, and handles to them in
        their columns (`shardkit.reader._pipeline.spill`): the decode stage decodes them per batch.
        ``times``: the reader's `StageTimes`, which gets the seconds of the Arrow read and of the decoding.
        ``head=True``: a look at the row group's first rows, not a read of it: from a remote dataset, only
        the pages that hold them are requested, and nothing is cached or kept for the next tasks (a
        reader's first sample, read in the process that makes it: see `Reader.schema`).
        """
        try:
            selected = self.selection.get(task.row_group)
            # the task's rows in the row group; a filter's task ranges over the selected rows
            index = None if selected is None else selected[task.start : task.stop]
            if rows is not None:
                index = (rows + task.start) if index is None else index[rows]
            # read as far as the last row needed (none needed: no further than read already)
            end = task.stop if index is None else int(index.max(initial=-1)) + 1
            partial = self.on_error == "raise" and (self.cache is None or not to_end)
            handles: Columns | None = None
            if late is not None:
                spill, segment, names = late
                picked = np.arange(task.start, task.stop) if index is None else index
                handles = {n: self._in_place((spill, segment), task.row_group, n, picked)
                           for n in names if n in self.direct}
                if not self.columns:  # nothing else to read: the handles are the rows
                    return Part([handles])
            started = time.perf_counter()
            table = (self._head(task.row_group, end) if head and not self.dataset.location.is_local
                     else self._arrow(task.row_group, end if partial else None))
            if times is not None:  # the reader's StageTimes: fetch + Parquet, then to numpy
                times.add("read_arrow", time.perf_counter() - started)
            if late is not None and handles is not None:  # spilled from Arrow's buffers, not taken first
                spilled = [n for n in late[2] if n not in self.direct]
                mapped = None if self.cache is None else self.cache.entry_of(table)  # (not copied: linked)
                handles.update({n: late[0].put(table.column(n), late[1], rows=picked, mapped=mapped)
                                for n in spilled})
                table = table.drop_columns(spilled)
                if not table.num_columns:
                    return Part([{n: handles[n] for n in self.fields}])
            if index is None:
                batches = table.slice(task.start, task.stop - task.start).to_batches()
            else:
                batches = _take(table, index)
            started = time.perf_counter()
            chunks, lost = self._decode([b for b in batches if b.num_rows], task, rows, handles)
            if times is not None:
                times.add("read_numpy", time.perf_counter() - started)
            return Part([batching.concat(chunks)] if whole and len(chunks) > 1 else chunks, lost)
        except CorruptDatasetError as e:
            error = self._located(task, e)
            if self.on_error == "raise":
                if error is e:
                    raise
                raise error from e
            with self._lock:
                self.skipped.setdefault(task.row_group, str(error))
                self.bad_groups.add(task.row_group)
            return None

    def _in_place(self, late: tuple[Spill, int], row_group: int, name: str, rows: np.ndarray) -> np.ndarray:
        """Handles of the values at ``rows`` of a late field read in place: into the data file itself
        (`Dataset.value_pages`; nothing copied), or, for a row group not stored as it is after all, into
        the spill, read through Parquet.

        The checksums of the pages are checked as the values are read for their batch (`PageChecks`,
        by the spill's reader), each page once: a reader's first batch checks the pages of its
        samples, not every page of every row group its window draws from. With ``on_error="skip"`` a
        row group's pages are all checked here, at its first task: a row group is then readable or not
        as a whole, whichever task meets it first (what the choice of rows in place of lost ones rests
        on, `_lost`)."""
        spill, segment = late
        key = (row_group, name)
        with self._lock:
            found = self._ranges.get(key, False)
        if found is False:
            pages = self.dataset.value_pages(row_group, name)
            found = None if pages is None else (*pages, self.dataset.page_checks(row_group, name, pages[1]))
            if found is not None and self.on_error != "raise":  # every page now (see above)
                self.dataset.check_value_pages(row_group, found[0], found[2], found[1].bodies[:, 0])
                found = (found[0], found[1], None)
            with self._lock:
                self._ranges[key] = found
                while len(self._ranges) > IN_PLACE_KEPT:
                    self._ranges.popitem(last=False)
        if found is None:  # read through Parquet, alone
            column = self.dataset.table_of(list(self.dataset.iter_row_group(row_group, [name])), [name])
            return spill.put(column.column(name), segment, rows=rows)
        path, layout, checks = found  # type: ignore[misc]  # (False replaced above)
        k = spill.external(path, segment, checks)
        handles = np.empty((len(rows), 2), np.int64)
        handles[:, 0] = (k << SEGMENT_BITS) + layout.starts[rows]
        handles[:, 1] = layout.lengths[rows]
        return handles

    def _located(self, task: Task, e: CorruptDatasetError) -> CorruptDatasetError:
        """``e``, or a copy of it that names the row group and its file, of its class (an
        `ImageShapeError` stays one, and so a `SchemaMismatchError`)."""
        rg = self.dataset.row_groups[task.row_group]
        where = f"row group {rg.index} of {self.dataset.location.join(rg.file)!r}"
        if where in str(e):
            return e
        return (ImageShapeError if isinstance(e, ImageShapeError) else CorruptDatasetError)(f"{where}: {e}")

    def _decode(self, batches: Sequence[pa.RecordBatch], task: Task, rows: np.ndarray | None,
                late: Columns | None = None) -> tuple[list[Columns], np.ndarray]:
        """The batches decoded, and the indices (among their rows) of rows that cannot be decoded.
        ``late``: the spill handles of the fields left encoded, for all the batches' rows in order.

        A batch that fails to decode raises, or with ``on_error="skip"`` is decoded again row by row,
        leaving out (and remembering) the rows that fail."""
        chunks: list[Columns] = []
        lost: list[int] = []
        offset = 0
        names = [] if late is None else self.fields
        for batch in batches:
            order = names or batch.schema.names
            rows_here = slice(offset, offset + batch.num_rows)
            handles = {} if late is None else {n: h[rows_here] for n, h in late.items()}
            try:
                chunks.append(self.dataset.decode(batch) if late is None else
                              _in_order(order, self.dataset.decode(batch), handles))
            except CorruptDatasetError as e:
                if self.on_error == "raise":
                    raise
                bad = []
                for i in range(batch.num_rows):
                    try:
                        one = self.dataset.decode(batch.slice(i, 1))
                        chunks.append(one if late is None else _in_order(
                            order, one, {n: h[i : i + 1] for n, h in handles.items()}))
                    except CorruptDatasetError:
                        bad.append(i)
                if not bad:  # fails only as a whole: nothing tells its rows apart, so it is lost whole
                    raise
                plan_rows = task.start + (np.asarray(bad) if rows is None else rows[np.asarray(bad)])
                with self._lock:
                    self.skipped.setdefault(task.row_group, str(self._located(task, e)))
                    self.bad_rows.setdefault(task.row_group, set()).update(plan_rows.tolist())
                lost.extend(offset + i for i in bad)
            offset += batch.num_rows
        return chunks, np.asarray(lost, dtype=np.int64)


def _in_order(names: Sequence[str], decoded: Columns, handles: Columns) -> Columns:
    """The decoded columns and the late fields' handles, in the batch's column order."""
    return {n: decoded[n] if n in decoded else handles[n] for n in names}


def _take(table: pa.Table, index: np.ndarray) -> list[pa.RecordBatch]:
    """The rows ``index`` of ``table``, batch by batch (ascending: a filter's selection,
    `assemble.needed_rows`).

    ``Table.take`` first concatenates each column's chunks, all the rows read so far of the row group,
    into fresh memory (a noticeable share of a shuffled DataLoader worker's CPU); here each record
    batch gives the indices that fall in it, and a batch needed whole is kept as it is.
    """
    if len(index) == 0:
        return []
    lo = int(index[0])
    local = index - lo
    out: list[pa.RecordBatch] = []
    start = 0
    for batch in table.slice(lo, int(index[-1]) + 1 - lo).to_batches():
        stop = start + batch.num_rows
        a, b = np.searchsorted(local, (start, stop))
        if b - a == batch.num_rows:
            out.append(batch)
        elif b > a:
            out.append(batch.take(pa.array(local[a:b] - start)))
        start = stop
    return out


class _Stream:
    """One row group read slice by slice (`Dataset.iter_row_group`), as far as asked so far; ``whole``:
    in one slice (a read for the cache, which writes one record batch)."""

    def __init__(self, dataset: Dataset, row_group: int, columns: Sequence[str],
                 on_done: Callable[[pa.Table], None] | None = None, fetched: Fetched | None = None, *,
                 whole: bool = False) -> None:
        self._on_done = on_done  # called once with the whole table, when the last slice is read
        self._batches: list[pa.RecordBatch] = []
        self._rows = 0
        size = max(1, dataset.row_groups[row_group].num_rows) if whole else SLICE_ROWS
        self._it: Iterator[pa.RecordBatch] | None = dataset.iter_row_group(row_group, columns,
                                                                            batch_size=size, fetched=fetched)
        self._dataset = dataset
        self._columns = list(columns)

    def close(self) -> None:
        """Stop reading: the row group's file is let go of now, not when the stream is collected."""
        it, self._it = self._it, None
        close = getattr(it, "close", None)
        if close is not None:
            close()

    def upto(self, stop: int | None) -> pa.Table:
        """The rows read so far, after reading on until there are ``stop`` of them (None: all)."""
        while self._it is not None and (stop is None or self._rows < stop):
            batch = next(self._it, None)
            if batch is None:
                self._it = None
                table = self._dataset.table_of(self._batches, self._columns)
                if self._on_done is not None:
                    self._on_done(table)
                return table
            self._batches.append(batch)
            self._rows += batch.num_rows
        return self._dataset.table_of(self._batches, self._columns)


class _Shared:
    """A row group read shared by the tasks that need it: one task at a time moves it forward.

    ``open`` makes the read: a `_Stream`, or a whole table (from the cache).
    """

    def __init__(self, open: Callable[[int], _Stream | pa.Table], row_group: int) -> None:
        self._open, self._row_group = open, row_group
        self._read: _Stream | pa.Table | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:  # after the task reading it, if any
            read, self._read = self._read, None
        if isinstance(read, _Stream):
            read.close()

    def upto(self, stop: int | None) -> pa.Table:
        with self._lock:  # Parquet decoding releases the GIL: other row groups go on meanwhile
            if self._error is not None:  # every task of a corrupt row group fails alike
                raise self._error
            try:
                if self._read is None:
                    self._read = self._open(self._row_group)
                read = self._read
                return read.upto(stop) if isinstance(read, _Stream) else read
            except BaseException as e:
                self._error = e
                raise
