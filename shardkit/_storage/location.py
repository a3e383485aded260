"""Where a dataset lives: an fsspec filesystem plus a root path, and atomic single-file replacement.

Local folders are read through pyarrow's native filesystem (memory-mapped, no Python in the loop);
everything else goes through fsspec (s3, gcs, hdfs, http, memory, ...).

A file's version (`Location.versions`, `Location.version`) is what tells a rewritten file from the
one read before under the same name: the ETag on object stores (else the version id or generation),
``size:mtime_ns`` for local files. Object stores have no folders (`Location.makedirs` creates none
there: s3fs's ``makedirs`` would create a missing bucket, and shardkit never creates buckets).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
import weakref
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import fsspec
import fsspec.asyn
import pyarrow as pa
import pyarrow.fs as pafs

from shardkit._storage.access import _options_taken, filesystem_error, request_error, storage_option_error
from shardkit.errors import NotADatasetError

SUMMARY = "_metadata"
COMMON = "_common_metadata"
STAGING = "_staging"
#: Protocols of object stores: keys under buckets, no folders (fsspec's names for S3, GCS, Azure, ...).
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss", "oci", "r2"})
#: Fields of an fsspec listing entry that name the bytes' version, in order of preference: a content
#: tag (S3, Azure, GCS), else an id the store gives each upload.
_VERSION_FIELDS = ("ETag", "etag", "md5Hash", "generation", "VersionId", "version_id")
#: Fields with a modification time, for filesystems that give no version (memory, HDFS, ...).
_TIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


@dataclasses.dataclass(frozen=True)
class Location:
    """A dataset root: ``Location.of("s3://bucket/ds")`` or ``Location.of("/data/ds")``."""

    url: str
    fs: fsspec.AbstractFileSystem
    root: str

    @classmethod
    def of(cls, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Location:
        """The location of ``url``: its fsspec filesystem (made with ``storage_options``) and root.

        Raises:
            UnsupportedURLError: no filesystem serves the URL's protocol (``foo://``).
            MissingDependencyError: the protocol's filesystem is not installed (s3fs, gcsfs, ...), or
                HDFS's native client cannot be loaded.
            StorageOptionsError: a key of ``storage_options`` that the filesystem does not take (see
                `storage_option_error`): refused here, not by the first request.
            DatasetError: the filesystem cannot be set up for another reason (its message says why).
            NotADatasetError: ``url`` is empty (fsspec would read the current folder).
        """
        text = os.fspath(url)
        if not text.strip():  # fsspec reads "" as the current folder: no one means that
            raise NotADatasetError(f"the dataset URL {text!r} is empty; give the dataset's folder or URL "
                                   "(use '.' for the current folder)")
        refused = storage_option_error(text, storage_options or {})
        if refused is not None:
            raise refused
        try:
            fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
        except (ImportError, ValueError, OSError) as e:
            error = filesystem_error(text, e)
            if error is None:
                raise
            raise error from e
        location = cls(text, fs, root.rstrip("/") or "/")
        if isinstance(fs, fsspec.asyn.AsyncFileSystem):
            _ASYNC[id(location)] = location
        return location

    def _forked(self) -> None:
        """In a forked child: an async filesystem (s3fs, gcsfs, ...) refuses to run there ("not
        fork-safe": its event loop is the parent's), so the location gets a fresh instance made with the
        same options. Where the filesystem takes a ``session`` (s3fs), the parent's goes with it: a
        session has no connection, and the service descriptions it parsed already need not be parsed
        again in every child. A dataset opened before a fork (a DataLoader's workers)
        then reads in the child as it did in the parent."""
        fs = self.fs
        options = dict(fs.storage_options)
        session = getattr(fs, "session", None)
        kind: type = type(fs)
        if session is not None and "session" in (_options_taken(kind) or ()):
            options["session"] = session
        try:
            fresh = kind(*getattr(fs, "storage_args", ()), **options)
        except Exception:  # a filesystem that cannot be made again keeps the parent's, which says why
            return         # not at its first use here
        object.__setattr__(self, "fs", fresh)
        self.__dict__.pop("arrow_fs", None)  # a remote one wraps the filesystem: made again when used

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    @cached_property
    def arrow_fs(self) -> pafs.FileSystem:
        if self.is_local:
            # memory-mapped: a column chunk is read as a view of the page cache, with no copy into
            # freshly allocated (and so kernel-zeroed) buffers, which makes shuffled reads faster. Files
            # are replaced, never rewritten in place, so no mapping outlives the bytes under it.
            return pafs.LocalFileSystem(use_mmap=True)
        return pafs.PyFileSystem(pafs.FSSpecHandler(self.fs))

    def open_ranges(self, path: str) -> pa.NativeFile:
        """``path`` opened for reads at given offsets: each read asks the store for exactly its bytes.

        Local files are memory-mapped (`arrow_fs`). A remote file is opened without fsspec's read-ahead
        (``cache_type="none"``): the Parquet reader coalesces a row group's column chunks into one range
        itself (``pre_buffer``), and read-ahead would fetch a block beyond it on every open (s3fs: 50 MB
        more per row group). A filesystem whose ``open`` takes no ``cache_type`` opens as it defaults.

        A request that is never answered (a server down, a connection cut) raises `DatasetError`, at the
        opening or at any read (`access.request_error`), never an ``OSError`` read as corruption.
        """
        if self.is_local:
            return self.arrow_fs.open_input_file(path)
        try:
            try:
                f = self.fs.open(path, "rb", cache_type="none")
            except TypeError:
                f = self.fs.open(path, "rb")
        except Exception as e:
            error = request_error(self.url, path, e)
            if error is None:
                raise
            raise error from e
        return pa.PythonFile(_Requests(f, self.url, path), mode="r")

    @property
    def is_object_store(self) -> bool:
        """Whether the root is on an object store (`OBJECT_STORES`): keys in a bucket, no folders."""
        return not OBJECT_STORES.isdisjoint(_protocols(self.fs))

    def makedirs(self, path: str) -> None:
        """Create the folder ``path`` (and its parents) where folders exist.

        On object stores this does nothing: a key needs no folder above it, and s3fs's ``makedirs``
        creates a missing bucket (a typo in the URL would make a bucket in the user's account).
        """
        if not self.is_object_store:
            self.fs.makedirs(path, exist_ok=True)

    def missing_bucket(self) -> str | None:
        """The root's bucket as a URL (``s3://name``) when the store says it does not exist, else None.

        None without a request where there are no buckets (local, memory, HDFS). On an object store
        this asks the store once (s3fs: ``HEAD`` of the bucket); a bucket these credentials may not
        see counts as missing, as the store cannot tell the two apart for them.
        """
        if not self.is_object_store:
            return None
        bucket = self.root.lstrip("/").split("/", 1)[0]
        if self.fs.exists(bucket):
            return None
        return f"{_protocols(self.fs)[0]}://{bucket}"

    def versions(self) -> dict[str, str]:
        """The version (see the module docstring) of every file under the root, by path relative to it.

        One listing: on an object store one request per 1,000 files (s3fs: ``ListObjectsV2``), not one
        per file. Locally, and where the listing is refused (credentials that may read objects but not
        list them) or gives no versions, this is empty, and `version` asks file by file.
        """
        if self.is_local:
            return {}  # a stat per file costs no round trip, and is taken just before the file's reads
        self.fs.invalidate_cache(self.root)  # fsspec instances are shared: an older listing may be cached
        try:
            found = self.fs.find(self.root, detail=True)
        except (OSError, NotImplementedError, ValueError):
            return {}
        root = self.root.rstrip("/") + "/"
        out = {}
        for path, info in found.items():
            rel = str(path)[len(root):] if str(path).startswith(root) else str(path)
            version = _version_of(info)
            if version is not None:
                out[rel] = version
        return out

    def version(self, name: str) -> str | None:
        """The version of the file ``name`` (relative to the root): one ``stat``, or one request; None when
        the filesystem gives none (no version, no modification time) or the file cannot be looked at."""
        path = self.join(name)
        if self.is_local:
            try:
                st = os.stat(path)
            except OSError:
                return None
            return f"{st.st_size}:{st.st_mtime_ns}"
        try:
            info = self.fs.info(path)
        except (OSError, NotImplementedError, ValueError):
            return None
        return _version_of(info)

    def join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def exists(self, *parts: str) -> bool:
        return bool(self.fs.exists(self.join(*parts)))

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace the file ``name`` under the root with ``data`` in one step.

        Local: write a temporary file, fsync, then ``os.replace`` (atomic on POSIX). Object stores:
        a single PUT is atomic already, so the bytes go straight to the final key.
        """
        path = self.join(name)
        if self.is_local:
            tmp = self.join(f".{name}.tmp-{uuid.uuid4().hex[:8]}")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return
        self.fs.pipe_file(path, data)

    def move(self, src: str, dst: str) -> None:
        if self.is_local:
            os.replace(src, dst)
        else:
            self.fs.mv(src, dst)


class _Requests:
    """An fsspec file whose reads that go unanswered raise `access.request_error`'s `DatasetError`
    (Arrow passes a Python exception raised in a read through as it is); the rest is the file's own."""

    def __init__(self, f: Any, url: str, path: str) -> None:
        self._f, self._url, self._path = f, url, path

    def read(self, nbytes: int = -1) -> bytes:
        try:
            return bytes(self._f.read(nbytes))
        except Exception as e:
            error = request_error(self._url, self._path, e)
            if error is None:
                raise
            raise error from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


#: locations on async filesystems, given a fresh filesystem in a forked child (`Location._forked`)
_ASYNC: weakref.WeakValueDictionary[int, Location] = weakref.WeakValueDictionary()


def _after_fork() -> None:
    for location in list(_ASYNC.values()):
        location._forked()


os.register_at_fork(after_in_child=_after_fork)


def _version_of(info: Mapping[str, Any]) -> str | None:
    """A file's version from its fsspec listing entry (see `_VERSION_FIELDS`), else its size and
    modification time; None when the entry has neither."""
    for field in _VERSION_FIELDS:
        value = info.get(field)
        if value not in (None, ""):
            return f"{field}={value}"
    for field in _TIME_FIELDS:
        value = info.get(field)
        if value not in (None, ""):
            return f"size={info.get('size')},{field}={value}"
    return None


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
