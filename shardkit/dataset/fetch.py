"""Row groups of a remote dataset fetched ahead of their reads, in the order the reader will read them.

An object store answers each request after a round trip, and then sends at its own speed. A reader
that asks for one row group at a time, as it decodes, waits a round trip per row group and leaves the
link idle meanwhile. `Fetcher` keeps requests in flight ahead of the reads instead:

- **Coalesced ranges.** A row group's column chunks of the columns read are one or a few byte ranges
  (chunks less than `GAP` apart are fetched as one range, the bytes between them too), cut into parts
  of at most `PART` bytes that are requested in parallel.
- **In the plan's order, within a budget.** The reader gives the order of its row groups (`plan`);
  parts are requested in that order while the bytes in flight or fetched and not yet read stay within
  a target: enough to cover the time a request takes times the rate the reads consume bytes (measured:
  it grows with the store's latency), at least `MIN_AHEAD`, at most ``max_bytes`` (the reader's
  ``max_inflight_bytes``).
- **Released when read.** A row group's bytes are let go of once its read has ended (`release`); a row
  group asked for before its turn is fetched at once, ahead of the rest.

Requests go through the dataset's fsspec filesystem (``cat_file`` with a byte range): its retries and
timeouts hold; a request that fails in the end fails the read of that row group, as a direct read would.
Where the whole dataset is local nothing is fetched: the files are memory-mapped.
"""

from __future__ import annotations

import bisect
import heapq
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from shardkit.dataset import _pages
from shardkit.dataset._pages import MISMATCH, PageError, read_page

__all__ = ["GAP", "MIN_AHEAD", "PART", "Again", "Fetched", "FetchedFile", "Fetcher", "PageCheck", "coalesce",
           "fetch_getter"]

GAP = 1 << 20  # chunks closer than this are fetched as one range (a request costs more than the gap)
PART = 32 << 20  # the most bytes of one request: a larger row group comes in parallel parts
MIN_AHEAD = 64 << 20  # bytes kept in flight or fetched ahead, at the least
MIN_REQUESTS = 4  # requests in flight, at the least (while there is something to fetch) ...
MAX_REQUESTS = 32  # ... and at the most


def coalesce(ranges: Iterable[tuple[int, int]], gap: int = GAP) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges (end exclusive) merged where they overlap or lie less than ``gap``
    apart, sorted.

    Example:
        >>> coalesce([(0, 10), (12, 20), (5_000_000, 5_000_100)])
        [(0, 20), (5000000, 5000100)]
    """
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start - merged[-1][1] < gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _parts(ranges: Sequence[tuple[int, int]], part: int) -> list[tuple[int, int]]:
    return [(a, min(a + part, end)) for start, end in ranges for a in range(start, end, part)]


class Fetched:
    """One row group's bytes as they come: `read` waits for the parts it needs, not for all of them, so
    the Parquet reader decodes the first pages while later parts are still on their way."""

    def __init__(self, entry: _Entry) -> None:
        self.path = entry.path
        self._entry = entry

    def covers(self, start: int, end: int) -> bool:
        """Whether bytes ``start..end`` of the file lie within one of the ranges fetched."""
        return any(a <= start and end <= b for a, b in self._entry.ranges)

    def read(self, start: int, length: int, again: Again | None = None) -> memoryview | bytes | None:
        """``length`` bytes at ``start`` of the file, once fetched; None where they were not asked for
        (outside the ranges). Raises what the request of a part raised, or, given ``again``, takes the
        part's bytes from ``again(i, a, b, error)`` (part ``i``, bytes ``a..b``) instead."""
        entry = self._entry
        end = start + length
        if not self.covers(start, end):
            return None
        i = bisect.bisect_right(entry.starts, start) - 1
        pieces = []
        while start < end:
            a, b = entry.parts[i]
            try:
                data = entry.futures[i].result()
            except Exception as e:
                if again is None:
                    raise
                data = again(i, a, b, e)
            pieces.append(memoryview(data)[start - a:min(end, b) - a])
            start = min(end, b)
            i += 1
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


#: ``again(part, start, end, error)``: the bytes of a part whose request failed, asked for once more
Again = Callable[[int, int, int, BaseException], bytes]


@dataclass
class _Entry:
    path: str
    ranges: list[tuple[int, int]]
    parts: list[tuple[int, int]]  # in file order
    nbytes: int
    futures: list[Future[bytes]] = field(default_factory=list)

    @property
    def starts(self) -> list[int]:
        return [a for a, _ in self.parts]


class Fetcher:
    """Fetches the ranges of planned keys (row groups) ahead of `take`, within a byte budget.

    ``get(path, start, end)`` fetches one range (``fs.cat_file``); ``max_bytes`` bounds the bytes in
    flight plus those fetched and not released. Parts are requested strictly in plan order (a key
    taken before its turn first) by a few threads of its own; how many grows with the latency measured
    (`concurrency`).
    """

    def __init__(self, get: Callable[[str, int, int], bytes], max_bytes: int, *,
                 part: int = PART, min_ahead: int = MIN_AHEAD) -> None:
        self._get, self.max_bytes, self._part = get, max_bytes, part
        self._min_ahead = min(min_ahead, max_bytes)
        self._reset()

    def _reset(self) -> None:
        """A fetcher with nothing started: at the start, and in a process forked from one that had
        fetched (a DataLoader worker): the parent's threads and their requests are not in the child."""
        self._pid = os.getpid()
        self._lock = threading.Condition()
        self._queue: deque[Hashable] = deque()  # planned, not started, in plan order
        self._planned: dict[Hashable, tuple[str, list[tuple[int, int]]]] = {}
        self._entries: dict[Hashable, _Entry] = {}  # started: in flight or fetched, not released
        self._held = 0  # bytes of the started entries
        self._parts: list[tuple[tuple[int, int, int], _Entry, int]] = []  # heap: parts not yet asked for
        self._seq = 0
        self._threads: list[threading.Thread] = []
        self._active = 0  # requests in flight
        self.concurrency = 1  # the first request alone, at the store's whole speed: the first batch needs it
        self._closed = False
        # what the targets are measured from: request seconds (EWMA and the least of recent ones), and
        # the bytes the reads consumed, with when
        self._request_s = 0.0
        self._recent_s: deque[float] = deque(maxlen=16)
        self._consumed: deque[tuple[float, int]] = deque(maxlen=64)
        self.stats = {"requests": 0, "bytes": 0, "max_held": 0, "max_concurrency": MIN_REQUESTS}

    def _forked(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    # -- the plan -----------------------------------------------------------------------------------
    def plan(self, items: Iterable[tuple[Hashable, str, Sequence[tuple[int, int]]]]) -> None:
        """The keys to fetch, in order, with their file and byte ranges (``(start, end)``); replaces the
        keys planned and not started (a new pass). Entries started stay until released."""
        self._forked()
        with self._lock:
            self._queue.clear()
            self._planned.clear()
            for key, path, ranges in items:
                if key in self._entries or key in self._planned:
                    continue
                self._planned[key] = (path, coalesce(ranges))
                self._queue.append(key)
            self._fill()

    def take(self, key: Hashable) -> Fetched | None:
        """``key``'s bytes as they come (requested now, first, when not started yet); None when ``key``
        was never planned."""
        self._forked()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if key not in self._planned:
                    return None
                self._queue.remove(key)
                entry = self._start(key, *self._planned.pop(key), urgent=True)
        return Fetched(entry)

    def release(self, key: Hashable) -> None:
        """``key``'s read has ended: its bytes are let go of, and more is fetched in their place."""
        self._forked()
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return
            for f in entry.futures:
                f.cancel()
            self._held -= entry.nbytes
            self._consumed.append((time.monotonic(), entry.nbytes))
            self._fill()

    def close(self) -> None:
        self._forked()
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._planned.clear()
            entries, self._entries = list(self._entries.values()), {}
            self._parts.clear()
            self._held = 0
            self._lock.notify_all()
        for entry in entries:
            for f in entry.futures:
                f.cancel()

    # -- scheduling (under the lock) ----------------------------------------------------------------
    def target(self) -> int:
        """Bytes to keep in flight or fetched ahead: 4 x (seconds a request takes) x (bytes read per
        second), at least `MIN_AHEAD`, at most ``max_bytes``."""
        rate = 0.0
        if len(self._consumed) >= 2:
            span = self._consumed[-1][0] - self._consumed[0][0]
            if span > 0:
                rate = sum(n for _, n in list(self._consumed)[1:]) / span
        return int(min(self.max_bytes, max(self._min_ahead, 4 * self._request_s * rate)))

    def _fill(self) -> None:
        target = self.target()
        while self._queue and not self._closed:
            key = self._queue[0]
            path, ranges = self._planned[key]
            nbytes = sum(b - a for a, b in ranges)
            if self._entries and self._held + nbytes > target:
                return
            self._queue.popleft()
            self._start(key, path, ranges)

    def _start(self, key: Hashable, path: str, ranges: list[tuple[int, int]], *, urgent: bool = False
               ) -> _Entry:
        entry = _Entry(path, ranges, _parts(ranges, self._part), sum(b - a for a, b in ranges))
        entry.futures = [Future() for _ in entry.parts]
        self._entries[key] = entry
        self._held += entry.nbytes
        self.stats["max_held"] = max(self.stats["max_held"], self._held)
        self._seq += 1
        for i in range(len(entry.parts)):  # in plan order; a key taken before its turn goes first
            heapq.heappush(self._parts, ((0 if urgent else 1, self._seq, i), entry, i))
        while len(self._threads) < min(self.concurrency, len(self._parts) + self._active):
            thread = threading.Thread(target=self._work, name="shardkit-fetch", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._lock.notify_all()
        return entry

    def _adapt(self, took: float) -> None:
        """More requests in flight while they take about the least time seen (the store's latency, not
        its bandwidth, sets their pace); fewer once they queue behind each other."""
        self._request_s = took if not self.stats["requests"] else 0.8 * self._request_s + 0.2 * took
        self._recent_s.append(took)
        if self.concurrency < MIN_REQUESTS:
            self.concurrency = MIN_REQUESTS
        elif len(self._recent_s) >= 4 and self._request_s > 0:
            latency = min(self._recent_s)
            wanted = round(self.concurrency * latency / self._request_s) + 2
            self.concurrency = max(MIN_REQUESTS, min(MAX_REQUESTS, wanted))
            self.stats["max_concurrency"] = max(self.stats["max_concurrency"], self.concurrency)

    # -- the requesting threads ---------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (not self._parts or self._active >= self.concurrency):
                    self._lock.wait()
                if self._closed:
                    return
                _, entry, i = heapq.heappop(self._parts)
                future = entry.futures[i]
                if not future.set_running_or_notify_cancel():  # released meanwhile
                    continue
                self._active += 1
            start, end = entry.parts[i]
            began = time.monotonic()
            try:
                data = self._get(entry.path, start, end)
                if len(data) != end - start:
                    raise OSError(f"asked for bytes {start}..{end} of {entry.path!r}, got {len(data)}")
            except BaseException as e:
                future.set_exception(e)
                data = b""
            else:
                future.set_result(data)
            with self._lock:
                self._active -= 1
                if data:
                    self._adapt(time.monotonic() - began)
                    self.stats["requests"] += 1
                    self.stats["bytes"] += len(data)
                while len(self._threads) < self.concurrency and self._parts:
                    thread = threading.Thread(target=self._work, name="shardkit-fetch", daemon=True)
                    thread.start()
                    self._threads.append(thread)
                self._lock.notify_all()


def fetch_getter(fs: Any) -> Callable[[str, int, int], bytes]:
    """``get(path, start, end)`` over an fsspec filesystem: one ranged request."""

    def get(path: str, start: int, end: int) -> bytes:
        data: bytes = fs.cat_file(path, start=start, end=end)
        return data

    return get


class FetchedFile:
    """A file object over `Fetched` bytes, for ``pyarrow.PythonFile``: reads within the fetched ranges
    come from memory (a view, no copy); any other read is one request (``fallback(start, end)``). A part
    whose request failed raises what ``named`` makes of the failure (a `DatasetError` saying the server
    stopped answering), else is asked for once more by ``fallback``, whole, and kept: every later read of
    its bytes gets the same ones.

    ``chunks``: the column chunks (``(column, start, end)``) whose page checksums this file checks as the
    Parquet reader reads them (`PageCheck`: ISA-L's CRC-32, many times cheaper than pyarrow's own check,
    which the reader then leaves off). Every page a read touches, and those before it in its chunk, are
    checked before the read returns, so no byte of a damaged page reaches the decoder. They must lie in
    the fetched ranges (`Fetched.covers`).

    Its size is not known without a request, and the Parquet reader, given the footer, reads only the
    column chunks the footer names: the size claimed is larger than any file.
    """

    SIZE = 1 << 62

    def __init__(self, fetched: Fetched, fallback: Callable[[int, int], bytes],
                 named: Callable[[BaseException], BaseException | None],
                 chunks: Sequence[tuple[str, int, int]] = ()) -> None:
        # fallback: one request, its failure named; named: a failed request's error, when it is one
        self._fetched, self._fallback, self._named = fetched, fallback, named
        self._again: dict[int, bytes] = {}  # parts whose request failed, asked for once more
        self._checks = PageCheck(chunks, self._bytes) if chunks else None
        self._pos = 0
        self.closed = False
        self.mode = "rb"

    @property
    def checked_seconds(self) -> float:
        """CPU seconds spent checking page checksums as the reader read (0: nothing to check)."""
        return 0.0 if self._checks is None else self._checks.seconds

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else self.SIZE + offset)
        return self._pos

    def read(self, n: int = -1) -> memoryview | bytes:
        if n is None or n < 0:
            raise OSError("a fetched file is read by ranges only")
        start, self._pos = self._pos, self._pos + n
        if self._checks is not None:
            self._checks.through(start, start + n)
        return self._bytes(start, n)

    def _bytes(self, start: int, n: int) -> memoryview | bytes:
        view = self._fetched.read(start, n, self._part_again)
        return view if view is not None else self._fallback(start, start + n)

    def _part_again(self, i: int, start: int, end: int, error: BaseException) -> bytes:
        if i not in self._again:
            named = self._named(error)  # the filesystem retried already: a request never answered is
            if named is not None:  # named as a direct read's; anything else is asked for once more
                raise named from error
            self._again[i] = self._fallback(start, end)
        return self._again[i]

    def close(self) -> None:
        self.closed = True


class PageCheck:
    """The page checksums of column chunks (``(column, start, end)`` in the file), checked in order as
    far as a reader reads (`through`), each page once; ``read(start, length)`` gives the file's bytes.

    A page whose bytes do not match its CRC-32 raises an `OSError` that says so ("checksum"); a page
    header that cannot be read, or a page that runs past its chunk, raises one that names it. Pages
    without a checksum pass unchecked, as with pyarrow's own check.
    """

    def __init__(self, chunks: Sequence[tuple[str, int, int]],
                 read: Callable[[int, int], memoryview | bytes]) -> None:
        self._chunks = sorted(chunks, key=lambda c: c[1])
        self._starts = [start for _, start, _ in self._chunks]
        self._next = [start for _, start, _ in self._chunks]  # per chunk: the next page not checked
        self._read = read
        self._lock = threading.Lock()
        self.seconds = 0.0  # CPU time spent checking, so far (this thread's: not the waits for bytes)

    def through(self, start: int, end: int) -> None:
        """Check every page of the chunks that lies before ``end`` and is not checked yet, where the
        bytes ``start..end`` fall in a chunk."""
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        with self._lock:
            started = time.thread_time() if _pages.CHECK_CLOCK else 0.0
            try:
                while i < len(self._chunks) and self._chunks[i][1] < end:
                    column, _, stop = self._chunks[i]
                    if start < stop:
                        while self._next[i] < min(end, stop):
                            self._next[i] = self._check(column, self._next[i], stop)
                    i += 1
            finally:
                if _pages.CHECK_CLOCK:
                    self.seconds += time.thread_time() - started

    def _check(self, column: str, at: int, stop: int) -> int:
        """Check the page whose header starts at ``at`` (its chunk ends at ``stop``); where the next
        begins."""
        try:
            page, after = read_page(self._read, at, stop)
        except PageError as e:
            raise OSError(f"column {column!r}: {e}") from None
        if page.ok is False:
            raise OSError(f"column {column!r}: the {page.kind} at byte {at} {MISMATCH} (page checksum)")
        return after
