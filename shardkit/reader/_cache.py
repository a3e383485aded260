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
  temporary file in the folder (checksummed from the page cache), fsyncs it and renames it over the
  entry (``os.replace``). So the processes of one machine share the folder safely: two filling one
  key both end with a valid table, and a mapped entry stays readable when another process replaces or
  evicts it.
- An entry is only as fresh as its key: the cache never looks at the data file behind it. The reader's
  keys (`shardkit.reader._pipeline.source`) hold the dataset URL, the file, the file's version (ETag on object
  stores, ``size:mtime_ns`` locally), the row group, its rows and bytes, and the columns; a file
  rewritten in place gets a new key, so its old entries are never hit again and age out by LRU.
- Recency is the file's atime, set explicitly on insert and on every hit; mtime is left alone so it
  stays part of the entry's identity. After each insert, under an ``fcntl.flock`` on ``.lock``, the
  least recently used entries are deleted until the folder's entries fit ``size_limit`` (one pass,
  never the entry just written). An entry larger than the whole limit is returned but not kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable

import pyarrow as pa
import xxhash

from shardkit.dataset.write import parse_size
from shardkit.errors import ReaderError, SchemaError

__all__ = ["CacheConfig", "RowGroupCache"]

DEFAULT_SIZE = "10GiB"
_TRAILER = struct.Struct("<4sQQ")
_MAGIC = b"SKC2"
_OLD_TRAILER = struct.Struct("<4sIQ")  # the earlier format: b"SKC1" | crc32 | length
_OLD_MAGIC = b"SKC1"  # a miss, refetched quietly
_SUFFIX = ".arrow"
_TMP = ".tmp-"
_STALE_TMP_S = 3600  # a temporary file this old belongs to a killed process
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

    def path_of(self, key: str) -> str:
        """The entry file of ``key``."""
        return os.path.join(self.directory, hashlib.sha256(key.encode()).hexdigest() + _SUFFIX)

    def get_or_fetch(self, key: str, fetch: Callable[[], pa.Table]) -> pa.Table:
        """The cached table of ``key`` (memory-mapped), or ``fetch()``'s result, which is then cached.

        Example:
            >>> cache.get_or_fetch(key, lambda: parquet_file.read_row_group(3))

        Exceptions from ``fetch`` propagate and cache nothing; a cache folder that cannot be written
        (full disk, permissions) only logs a warning.
        """
        table = self.get(key)
        if table is None:
            table = fetch()
            self.put(key, table)
        return table

    def get(self, key: str) -> pa.Table | None:
        """The cached table of ``key`` (memory-mapped, checksum verified), or None (counted as a miss)."""
        table = self._load(self.path_of(key))
        self._count("hits" if table is not None else "misses")
        return table

    def has(self, key: str) -> bool:
        """Whether an entry of ``key`` is there (not verified, not counted: what to fetch ahead)."""
        return os.path.exists(self.path_of(key))

    def put(self, key: str, table: pa.Table) -> None:
        """Cache ``table`` as ``key`` (a folder that cannot be written only logs a warning)."""
        self._store(self.path_of(key), table)

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
            try:
                table = _decode(mapped.read_buffer(st.st_size), verify=_verified.get(path) != _identity(st))
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
        return table

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
                os.fsync(f.fileno())
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
                    elif entry.name.startswith(_TMP) and now - st.st_mtime > _STALE_TMP_S:
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
