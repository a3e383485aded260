"""The reader's local-disk row-group cache: Arrow IPC files, memory-mapped on read, shared by processes.

An entry is one file ``<sha256(key)>.arrow``: the uncompressed Arrow IPC file bytes of the row group,
then a 20-byte trailer ``b"SKC2" | xxh3-64 of the IPC bytes (u64 LE) | their length (u64 LE)``. One file
per entry (no sidecar) means an entry and its checksum are always replaced together. An entry of the
previous format (``SKC1``, crc32) is a miss: fetched again and replaced, without a warning.

- Reading maps the file (`pyarrow.memory_map`): the table's buffers point into the page cache and a
  cached epoch copies nothing. Verifying the checksum reads every byte once (xxh3: much faster than
  zlib's crc32, which made checking a restarted job's cache cost more than reading it); it is done once
  per process per entry version, remembered as (path, inode, size, mtime_ns, ctime_ns), and an entry
  this process wrote counts as verified. Entries are only ever replaced by rename, never changed in
  place by shardkit; a change in place by anything else (a bad disk, a tool that writes into the file
  and puts its mtime back) changes the ctime, which no one can set back, so the entry is verified
  again. Another process's hit (its atime update) changes the ctime too: this process then verifies
  that entry once more.
- A corrupt entry (bad trailer, checksum or IPC) is deleted, counted in ``stats["corrupt"]`` (and as
  a miss) and fetched again; it is never returned.
- A write puts the table, as one record batch (cached reads cut their batches as views of it), in a
  temporary file in the folder (checksummed from the page cache) and renames it over the entry
  (``os.replace``). It is not fsynced: the kernel writes it back when it will, and an entry cut short
  by a power loss or a crash of the machine fails its checksum in the next process to read it (a
  miss, fetched again), so waiting for the disk would buy nothing but a slower fill. So the
  processes of one machine share the folder safely: two filling one key both end with a valid table,
  and a mapped entry stays readable when another process replaces or evicts it.
- An entry is only as fresh as its key: the cache never looks at the data file behind it. The reader's
  keys (`shardkit.reader._pipeline.source`) hold the dataset URL, the file, the file's version (ETag on object
  stores, ``size:mtime_ns`` locally), the row group, its rows and bytes, and the columns; a file
  rewritten in place gets a new key, so its old entries are never hit again and age out by LRU.
- Recency is the file's atime, set explicitly on insert and on every hit; mtime is left alone so it
  stays part of the entry's identity. After each insert, under an ``fcntl.flock`` on ``.lock``, the
  least recently used entries are deleted until the folder's entries fit ``size_limit`` (one pass,
  never the entry just written). An entry larger than the whole limit is returned but not kept.
- One fetch per entry across the processes of a machine. A process about to fetch a key first claims
  it: ``<sha256(key)>.claim``, created with ``O_CREAT | O_EXCL`` and holding its pid, host and time
  (`RowGroupCache.claim`). The claimer fetches, writes the entry and removes the claim; a process that
  finds a claim waits for the entry (`RowGroupCache.wait`: polling, from 5 ms up to every 50 ms) and
  fetches only when the claim goes away without an entry (a failed fetch, an entry too large to keep,
  one evicted at once) or turns stale: its pid is gone on this host (a killed process, a zombie; a
  claim with this process's own pid that it does not hold: a pid reused by a new container), or it
  was not refreshed for `CLAIM_STALE_S` seconds (a thread of the claimer refreshes the mtime of its
  claims every `CLAIM_REFRESH_S`; this is what tells a dead claimer on another host sharing the
  folder, or a recycled pid). A stale claim is removed under the ``.lock`` flock, re-checked there, so
  two waiters never remove a fresh claim between them. A claimer alive but stuck never blocks the
  others for long: a process that has waited `CLAIM_WAIT_S` for one claim fetches itself, unclaimed.
  A folder where no claim can be created (read only, full, deleted) only logs a warning, once per
  `RowGroupCache`: the process fetches without claiming, as before. `RowGroupCache.claimed` tells a
  fetch-ahead which keys another process is fetching, to leave them to it and read them from the
  cache when it needs them. Claims left by killed processes are removed when found stale, or by the
  eviction pass after `_STALE_TMP_S`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator

import pyarrow as pa
import xxhash

from shardkit.dataset.write import parse_size
from shardkit.errors import ReaderError, SchemaError

__all__ = ["CLAIM_REFRESH_S", "CLAIM_STALE_S", "CLAIM_WAIT_S", "CacheConfig", "Claim", "MappedEntry",
           "RowGroupCache"]

DEFAULT_SIZE = "10GiB"
_TRAILER = struct.Struct("<4sQQ")
_MAGIC = b"SKC2"
_OLD_TRAILER = struct.Struct("<4sIQ")  # the earlier format: b"SKC1" | crc32 | length
_OLD_MAGIC = b"SKC1"  # a miss, refetched quietly
_SUFFIX = ".arrow"
_TMP = ".tmp-"
_STALE_TMP_S = 3600  # a temporary file (or a claim) this old belongs to a killed process
_CLAIM = ".claim"
CLAIM_STALE_S = 30.0  # a claim not refreshed for this long is stale: its claimer is gone
CLAIM_REFRESH_S = 5.0  # how often a claimer refreshes (the mtime of) the claims it holds
CLAIM_WAIT_S = 300.0  # the longest a process waits for one claim before it fetches itself
_WAIT_FIRST_S, _WAIT_MAX_S = 0.005, 0.05  # the polling of a process waiting for another's entry
_HOST = socket.gethostname()
_log = logging.getLogger(__name__)

# path -> (inode, size, mtime_ns, ctime_ns) of the entry version this process has checked (see the module
# docstring)
_verified: dict[str, tuple[int, int, int, int]] = {}


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Where the row-group cache lives and how many bytes its entries may take.

    Example:
        >>> CacheConfig("/mnt/nvme/shardkit-cache", parse_size("200GiB", what="size"))
        >>> CacheConfig.resolve("auto", remote=True)   # ~/.cache/shardkit, 10 GiB

    ``size_limit`` also accepts a string such as ``"10GiB"``, parsed on creation.
    """

    directory: str
    size_limit: int

    def __post_init__(self) -> None:
        directory = os.fspath(self.directory) if isinstance(self.directory, str | os.PathLike) else None
        if not isinstance(directory, str) or not directory.strip():
            raise ReaderError(f"CacheConfig.directory={self.directory!r} is not a folder path; pass a local "
                              "folder such as '~/.cache/shardkit'")
        object.__setattr__(self, "directory", directory)
        try:
            object.__setattr__(self, "size_limit", parse_size(self.size_limit, what="size_limit"))
        except SchemaError as e:
            raise ReaderError(f"CacheConfig.size_limit={self.size_limit!r} is not a size; pass a positive "
                              "number of bytes or a string such as '10GiB'") from e

    @classmethod
    def resolve(
        cls, cache: str | os.PathLike[str] | CacheConfig | None, *, remote: bool
    ) -> CacheConfig | None:
        """The cache for a reader's ``cache=`` argument, or None for no cache.

        Example:
            >>> CacheConfig.resolve("/tmp/rg-cache", remote=False).size_limit   # 10 GiB by default

        ``None`` -> no cache; ``"auto"`` -> for remote data a cache in ``$SHARDKIT_CACHE_DIR`` (default
        ``~/.cache/shardkit``) of ``$SHARDKIT_CACHE_SIZE`` bytes (default 10GiB), for local data none;
        a path -> that folder with the default size; a `CacheConfig` -> itself.

        Raises:
            ReaderError: ``cache`` is none of these, or ``$SHARDKIT_CACHE_SIZE`` is not a size.
        """
        if cache is None or isinstance(cache, CacheConfig):
            return cache
        if isinstance(cache, str) and cache == "auto":
            if not remote:
                return None
            directory = os.environ.get("SHARDKIT_CACHE_DIR") or os.path.join("~", ".cache", "shardkit")
            return cls(os.path.expanduser(directory), _default_size())
        path = os.fspath(cache) if isinstance(cache, str | os.PathLike) else None
        if not isinstance(path, str) or not path.strip():
            raise ReaderError(
                f"cache={cache!r} is not a cache setting; pass None (no cache), 'auto', a local folder, or "
                "shardkit.reader._cache.CacheConfig(directory, size_limit)"
            )
        return cls(os.path.expanduser(path), _default_size())


def _default_size() -> int:
    text = os.environ.get("SHARDKIT_CACHE_SIZE") or DEFAULT_SIZE
    try:
        return parse_size(text, what="SHARDKIT_CACHE_SIZE")
    except SchemaError as e:
        raise ReaderError(f"the environment variable SHARDKIT_CACHE_SIZE={text!r} is not a size; set it to a "
                          "number of bytes or e.g. '10GiB', or unset it for the default 10GiB") from e


@dataclasses.dataclass(frozen=True)
class Claim:
    """This process's claim on a key: it fetches the key and writes its entry, others wait for it.

    ``path`` is the claim file, None where the folder took no claim (the fetch goes on unclaimed);
    ``inode`` tells the file this process created from one another process made after it.
    """

    key: str
    path: str | None
    inode: int = -1


class _Claims:
    """The claims this process holds, refreshed by a daemon thread (started with the first claim, anew
    in a forked child, which holds none of its parent's claims)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, int] = {}  # claim file -> its inode
        self.thread: threading.Thread | None = None

    def add(self, path: str, inode: int) -> None:
        with self.lock:
            self.held[path] = inode
            if self.thread is None:
                self.thread = threading.Thread(target=self._refresh, name="shardkit-cache-claims",
                                               daemon=True)
                self.thread.start()

    def remove(self, path: str) -> None:
        with self.lock:
            self.held.pop(path, None)

    def holds(self, path: str) -> bool:
        with self.lock:
            return path in self.held

    def _refresh(self) -> None:
        while True:
            time.sleep(CLAIM_REFRESH_S)
            with self.lock:
                held = list(self.held.items())
            for path, inode in held:
                with contextlib.suppress(OSError):
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        if os.fstat(fd).st_ino == inode:  # still ours, not a claim made after ours
                            os.utime(fd)
                    finally:
                        os.close(fd)


_claims = _Claims()
os.register_at_fork(after_in_child=_claims.reset)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not: a killed child not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return True  # no /proc here: the signal said it exists
    return state not in ([b"Z"], [b"X"])


class _Corrupt(Exception):
    """An entry that fails its trailer, checksum or IPC decoding."""


class _OldFormat(Exception):
    """An entry in the earlier format: not corrupt, but replaced like a corrupt one."""


class RowGroupCache:
    """Row groups (Arrow tables) by key on local disk, shared by the processes of one machine.

    Example:
        >>> cache = RowGroupCache(CacheConfig("/tmp/rg-cache", 1 << 30))
        >>> table = cache.get_or_fetch('s3://b/ds|part-0.parquet|ETag="9b2c.."|3|id,x', lambda: read_remote())
        >>> cache.stats   # {'hits': 0, 'misses': 1, 'evictions': 0, 'corrupt': 0}

    A key must name the version of the data it stands for (an ETag, a local ``size:mtime_ns``): an entry
    is served for its key as long as it is kept, whatever happened to the file it was read from.

    Thread-safe. ``stats`` counts this instance's hits, misses (refetched corrupt entries included),
    the evictions it made and the corrupt entries it found. Format and guarantees: the module docstring.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._mapped: dict[int, MappedEntry] = {}  # id of a table `_load` gave (while it lives) -> its entry
        self.directory = os.path.abspath(os.path.expanduser(config.directory))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise ReaderError(
                f"the cache folder {self.directory!r} cannot be created ({e}); pass a writable folder with "
                "cache=CacheConfig(directory, size_limit) or set SHARDKIT_CACHE_DIR, or cache=None"
            ) from e
        self.stats: dict[str, int] = {"hits": 0, "misses": 0, "evictions": 0, "corrupt": 0}
        self._lock = threading.Lock()
        self._claims_warned = False

    def path_of(self, key: str) -> str:
        """The entry file of ``key``."""
        return os.path.join(self.directory, hashlib.sha256(key.encode()).hexdigest() + _SUFFIX)

    def get_or_fetch(self, key: str, fetch: Callable[[], pa.Table]) -> pa.Table:
        """The cached table of ``key`` (memory-mapped), or ``fetch()``'s result, which is then cached.

        Example:
            >>> cache.get_or_fetch(key, lambda: parquet_file.read_row_group(3))

        Where another process (or thread) is fetching ``key`` already, this waits for its entry instead
        of fetching too (see the module docstring). Exceptions from ``fetch`` propagate and cache
        nothing; a cache folder that cannot be written (full disk, permissions) only logs a warning.
        """
        path = self.path_of(key)
        while True:
            table = self._load(path)
            if table is not None:
                self._count("hits")
                return table
            claim = self.claim(key)
            if claim is None:  # another is fetching it: its entry, unless it gave up or died
                table = self.wait(key, count=False)
                if table is not None:
                    self._count("hits")
                    return table
                if not self.claimed(key):
                    continue
                claim = Claim(key, None)  # waited CLAIM_WAIT_S for a live claim: fetch unclaimed
            with self.claimed_by_me(claim):
                table = fetch()
                self.put(key, table)
            self._count("misses")
            return table

    def get(self, key: str, *, count: bool = True) -> pa.Table | None:
        """The cached table of ``key`` (memory-mapped, checksum verified), or None (counted as a miss;
        ``count=False``: not counted)."""
        table = self._load(self.path_of(key))
        if count:
            self._count("hits" if table is not None else "misses")
        return table

    def count(self, name: str) -> None:
        """Count one ``name`` (``"hits"``, ``"misses"``) in `stats`: for a row group fetched here outside
        `get_or_fetch` (the reader's fetch-ahead), a miss."""
        self._count(name)

    def has(self, key: str) -> bool:
        """Whether an entry of ``key`` is there (not verified, not counted: what to fetch ahead)."""
        return os.path.exists(self.path_of(key))

    def claim(self, key: str) -> Claim | None:
        """This process's claim to fetch ``key`` (release it with `release`, after `put`), or None
        while another process holds a live claim on it (`wait` for its entry then).

        Example:
            >>> claim = cache.claim(key)
            >>> if claim is not None:
            ...     with cache.claimed_by_me(claim):
            ...         cache.put(key, fetch())

        A stale claim (see the module docstring) is removed and claimed anew. In a folder where no
        claim can be made, a claim without a file (``path=None``): the caller fetches unclaimed.
        """
        path = self._claim_path(key)
        for _ in range(3):  # a stale claim removed, then ours; a claim gone meanwhile: ours
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                state = self._claim_state(path)
                if state == "live":
                    return None
                if state == "stale":
                    self._remove_stale(path)
                continue
            except OSError as e:
                return self._unclaimed(key, e)
            try:
                inode = os.fstat(fd).st_ino
                _claims.add(path, inode)  # before its pid is in it: held, not stale, for our threads
                os.write(fd, json.dumps({"pid": os.getpid(), "host": _HOST, "time": time.time(),
                                         "key": key[:200]}).encode())
            except OSError as e:
                _claims.remove(path)
                with contextlib.suppress(OSError):
                    os.remove(path)
                return self._unclaimed(key, e)
            finally:
                os.close(fd)
            return Claim(key, path, inode)
        return None  # claimed again and again by others: wait for theirs

    def claimed(self, key: str) -> bool:
        """Whether a live claim on ``key`` is held (another process is fetching it: leave it to it)."""
        return self._claim_state(self._claim_path(key)) == "live"

    def release(self, claim: Claim) -> None:
        """Let go of ``claim`` (after `put`, or after a failed fetch: others then fetch themselves)."""
        if claim.path is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(claim.path).st_ino == claim.inode:  # ours, not one made after ours was removed
                os.remove(claim.path)
        _claims.remove(claim.path)

    @contextlib.contextmanager
    def claimed_by_me(self, claim: Claim) -> Iterator[Claim]:
        """``claim``, released when the block ends (however it ends)."""
        try:
            yield claim
        finally:
            self.release(claim)

    def wait(self, key: str, *, count: bool = True) -> pa.Table | None:
        """The entry of ``key`` once the process holding its claim has written it; None (counted as a
        miss) when the claim goes away without an entry or turns stale, or after `CLAIM_WAIT_S` (then
        fetch it yourself: unclaimed where `claimed` still says so)."""
        path, claim_path = self.path_of(key), self._claim_path(key)
        pause, deadline = _WAIT_FIRST_S, time.monotonic() + CLAIM_WAIT_S
        while True:
            table = self._load(path)
            if table is not None:
                break
            state = self._claim_state(claim_path)
            if state != "live":
                if state == "stale":
                    self._remove_stale(claim_path)
                table = self._load(path)  # written just before its claim went
                break
            if time.monotonic() > deadline:
                _log.warning("waited %.0f s for the cache entry %s, claimed by another process; fetching it "
                             "too", CLAIM_WAIT_S, path)
                break
            time.sleep(pause)
            pause = min(_WAIT_MAX_S, pause * 1.5)
        if count:
            self._count("hits" if table is not None else "misses")
        return table

    def put(self, key: str, table: pa.Table) -> None:
        """Cache ``table`` as ``key`` (a folder that cannot be written only logs a warning)."""
        self._store(self.path_of(key), table)

    def _claim_path(self, key: str) -> str:
        return os.path.join(self.directory, hashlib.sha256(key.encode()).hexdigest() + _CLAIM)

    def _unclaimed(self, key: str, error: OSError) -> Claim:
        if not self._claims_warned:
            self._claims_warned = True
            _log.warning("cannot claim cache entries in %s (%s); fetching without telling other processes, "
                         "which may fetch the same row groups", self.directory, error)
        return Claim(key, None)

    def _claim_state(self, path: str) -> str:
        """``"none"``, ``"live"`` or ``"stale"`` (see the module docstring)."""
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                text = f.read(4096)
        except FileNotFoundError:
            return "none"
        except OSError:
            return "live"  # cannot be read: trust it until it is old
        if time.time() - st.st_mtime > CLAIM_STALE_S:
            return "stale"
        try:
            info = json.loads(text)
            pid, host = int(info["pid"]), info["host"]
        except (ValueError, KeyError, TypeError):
            return "live"  # being written now (or not ours to read): only its age tells
        if host == _HOST and (not _claims.holds(path) if pid == os.getpid() else not _alive(pid)):
            return "stale"
        return "live"

    def _remove_stale(self, path: str) -> None:
        """Remove the claim at ``path`` if it is still stale, checked under the folder's lock: another
        waiter may have removed it and claimed anew meanwhile."""
        try:
            with open(os.path.join(self.directory, ".lock"), "ab") as lock:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
                if self._claim_state(path) == "stale":
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
        except OSError as e:
            _log.warning("cannot remove the stale cache claim %s (%s)", path, e)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n

    def _load(self, path: str) -> pa.Table | None:
        try:
            mapped = pa.memory_map(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            _log.warning("cache entry %s cannot be opened (%s); fetching the row group", path, e)
            return None
        with mapped:  # closing the file keeps the mapping alive for the buffers that point into it
            st = os.fstat(mapped.fileno())
            data = mapped.read_buffer(st.st_size)
            try:
                table = _decode(data, verify=_verified.get(path) != _identity(st))
            except (_Corrupt, _OldFormat) as e:
                if isinstance(e, _Corrupt):
                    _log.warning("cache entry %s is corrupt (%s); deleted, fetching the row group again",
                                 path, e)
                    self._count("corrupt")
                with contextlib.suppress(OSError):
                    if os.stat(path).st_ino == st.st_ino:  # not a fresh entry another process just wrote
                        os.remove(path)
                return None
            with contextlib.suppress(OSError):  # another user's entry: recency is best effort
                os.utime(mapped.fileno(), ns=(time.time_ns(), st.st_mtime_ns))
            _verified[path] = _identity(os.fstat(mapped.fileno()))  # after the utime, which sets the ctime
        self._mapped[id(table)] = MappedEntry(path, st.st_ino, data.address, data.size)
        weakref.finalize(table, self._mapped.pop, id(table), None)
        return table

    def entry_of(self, table: pa.Table) -> MappedEntry | None:
        """The entry ``table`` is mapped from, when this cache gave it (`get`, `wait`) and it is still
        alive; else None. Its buffers then lie in the entry's file (`MappedEntry.offset_of`)."""
        return self._mapped.get(id(table))

    def _store(self, path: str, table: pa.Table) -> None:
        limit = self.config.size_limit
        if table.nbytes + _TRAILER.size > limit:  # the IPC file is at least this large: skip writing it
            return
        tmp = os.path.join(self.directory, f"{_TMP}{uuid.uuid4().hex}")
        try:
            # One record batch: a cached read slices views out of it, where the row group's read slices
            # would make every batch that straddles two of them a copy. Checksummed from the page cache.
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table.combine_chunks())
            length = os.path.getsize(tmp)
            if length + _TRAILER.size > limit:
                os.remove(tmp)
                return
            with pa.memory_map(tmp) as written:
                digest = _digest(written.read_buffer())
            with open(tmp, "ab") as f:
                f.write(_TRAILER.pack(_MAGIC, digest, length))
                f.flush()
                os.utime(f.fileno(), ns=(time.time_ns(), os.fstat(f.fileno()).st_mtime_ns))
                st = os.fstat(f.fileno())
            os.replace(tmp, path)
            moved = os.stat(path)  # the rename may set the ctime
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            _log.warning("cannot write the cache entry %s (%s); continuing without caching it", path, e)
            return
        if moved.st_ino == st.st_ino:  # not replaced by another process meanwhile
            _verified[path] = _identity(moved)
        self._evict(keep=path)

    def _evict(self, keep: str) -> None:
        """Delete least recently used entries (never ``keep``) until the entries fit the limit."""
        with open(os.path.join(self.directory, ".lock"), "ab") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
            entries, total, now = [], 0, time.time()
            with os.scandir(self.directory) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if entry.name.endswith(_SUFFIX) and len(entry.name) == 64 + len(_SUFFIX):
                        entries.append((st.st_atime_ns, entry.path, st.st_size))
                        total += st.st_size
                    elif (entry.name.startswith(_TMP) or entry.name.endswith(_CLAIM)) and \
                            now - st.st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.remove(entry.path)
            evicted = 0
            for _, victim, size in sorted(entries):
                if total <= self.config.size_limit:
                    break
                if victim == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.remove(victim)
                    evicted += 1
                total -= size
            if evicted:
                self._count("evictions", evicted)


@dataclasses.dataclass(frozen=True)
class MappedEntry:
    """A cache entry as this process mapped it: its file (``path``, ``inode``) and where the mapping lies
    in memory. A table read from it holds views of the mapping (uncompressed Arrow IPC), so its values
    lie in the file too: a reader can point into the entry (`offset_of`) instead of copying them."""

    path: str
    inode: int
    address: int
    size: int

    def offset_of(self, buffer: pa.Buffer) -> int | None:
        """Where ``buffer``'s bytes start in the entry's file, when they lie in its mapping; else None."""
        start = int(buffer.address) - self.address
        return start if start >= 0 and start + buffer.size <= self.size else None


def _decode(data: pa.Buffer, *, verify: bool) -> pa.Table:
    if data.size < _TRAILER.size:
        raise _Corrupt(f"{data.size} bytes, shorter than the {_TRAILER.size}-byte trailer")
    magic, digest, length = _TRAILER.unpack(data.slice(data.size - _TRAILER.size).to_pybytes())
    if magic != _MAGIC or length != data.size - _TRAILER.size:
        if data.slice(data.size - _OLD_TRAILER.size, 4).to_pybytes() == _OLD_MAGIC:
            raise _OldFormat()
        raise _Corrupt("its trailer is missing or does not match the file's size")
    payload = data.slice(0, length)
    if verify and _digest(payload) != digest:
        raise _Corrupt("checksum mismatch")
    try:
        return pa.ipc.open_file(payload).read_all()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise _Corrupt(f"not an Arrow IPC file ({e})") from e


def _digest(data: pa.Buffer) -> int:
    return int(xxhash.xxh3_64_intdigest(data))
