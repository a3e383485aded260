"""Encoded values set aside on local disk while a shuffle window waits for its batches (the select stage).

A reader that decodes an image field late (`shardkit.reader.reader.Reader`, ``decode`` and the image
path) does not keep a window's encoded images in memory: each task's values are appended to a spill
file, and the window holds a *handle* per row, ``(offset, length)`` as two int64s, which its batches
carry until the decode stage reads the bytes back (``pread``) and decodes them. So a window costs 16
bytes per image in memory whatever the images weigh, and the shuffle can reach across the whole
dataset; the bytes stay in the page cache (the kernel's, not the process's: it writes them to disk
under memory pressure) and on disk, at most about a window of them per reader.

Offsets are global over the spill's segments: segment ``k`` holds offsets ``[k << SEGMENT_BITS, ...)``.
A reader starts a new segment with each window (`Spill.next_segment`) and lets go of the segments of
the windows before the oldest one a batch still refers to (`Spill.release_before`), so the disk holds
about the windows in flight, not the epoch. A window may have more segments than its own: a local file
read in place is a segment of its own (`Spill.external`), numbered when a reading thread first gets
to it, which may be after later windows took their numbers; so segments are let go of by their
window's number, never by their own. Files live in a private folder under the temporary directory
(``TMPDIR``), removed on `Spill.close`, at interpreter exit, and, for a process that was killed, by the
next spill that finds its folder (named with the pid of a process that no longer runs).

A null value has length -1. Everything here is thread-safe: worker threads append, the decode stage
reads. `SpillReader` reads the same files by path, in another process (a transform worker).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from shardkit.dataset import PageChecks
from shardkit.errors import ReaderError

if TYPE_CHECKING:
    from shardkit.reader._cache import MappedEntry

__all__ = ["Spill", "SpillReader", "handles_to_bytes"]

SEGMENT_BITS = 40
_IOV = 1024  # pieces per pwritev (the usual IOV_MAX)  # a segment holds up to 1 TiB; 2**23 segments per spill
_PREFIX = "shardkit-spill-"
#: `SpillReader.read_each`: from this mean size a value is read by a ``pread`` of its own, into its bytes
EACH_BYTES = 4096


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(root: str) -> None:
    """Remove the spill folders of processes that no longer run (killed before they cleaned up)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if not name.startswith(_PREFIX):
                continue
            pid = name[len(_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _piece(view: memoryview, length: int, at: int) -> memoryview:
    return view[at : at + length]


class SpillReader:
    """Reads values of a spill by handle, from its files by path (in any process of the machine)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._fds: dict[int, int] = {}
        self._pages: dict[int, PageChecks] = {}  # an external segment's pages, checked as they are read
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, str]:
        return {"folder": self.folder}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["folder"])  # type: ignore[misc]

    def _fd(self, segment: int) -> int:
        with self._lock:
            fd = self._fds.get(segment)
            if fd is None:
                fd = self._fds[segment] = os.open(os.path.join(self.folder, f"{segment}.bin"), os.O_RDONLY)
                pages = os.path.join(self.folder, f"{segment}.pages")
                if segment not in self._pages and os.path.exists(pages):  # (another process's spill)
                    self._pages[segment] = PageChecks.load(pages)
            return fd

    def adopt(self, segment: int, pages: PageChecks) -> None:
        """Check the values of external ``segment`` against ``pages`` (the spill's own reader: its
        checks are shared with every window of the file, each page checked once)."""
        with self._lock:
            self._pages[segment] = pages

    def forget(self, segments: list[int] | None = None) -> None:
        """Close the files of ``segments`` (they are gone, or soon will be); None: every one."""
        with self._lock:
            for k in list(self._fds) if segments is None else segments:
                fd = self._fds.pop(k, None)
                self._pages.pop(k, None)
                if fd is not None:
                    os.close(fd)

    def _check(self, handles: np.ndarray) -> None:
        """Check the pages that hold the values of ``handles`` in files read in place (`Spill.external`),
        those not checked yet, before anything reads the values (`PageChecks.check`)."""
        if not self._pages or not len(handles):
            return
        segments = handles[:, 0] >> SEGMENT_BITS
        for k in np.unique(segments).tolist():
            fd = self._fd(k)
            pages = self._pages.get(k)
            if pages is None:
                continue
            mine = handles[(segments == k) & (handles[:, 1] >= 0)]
            # over a memory map of the file (no copy of a page), unmapped at once: pages a mapping keeps
            # count in the process's memory (PSS) while they are mapped
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
                pages.check(functools.partial(_piece, view), mine[:, 0] & ((1 << SEGMENT_BITS) - 1))

    def close(self) -> None:
        self.forget()

    def read(self, handles: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The values of ``handles`` ((n, 2) int64): ``(data, starts, ends)``, value ``i`` being
        ``data[starts[i]:ends[i]]`` (one buffer for all; a null's range is empty, ``ends[i] == -1`` marks
        it). Values that lie one after another in a segment are read with one ``pread``; those of a file
        read in place, after the checksums of their pages (`_check`)."""
        self._check(handles)
        n = len(handles)
        lengths = np.maximum(handles[:, 1], 0) if n else np.zeros(0, np.int64)
        starts = np.zeros(n, np.int64)
        if n:
            np.cumsum(lengths[:-1], out=starts[1:])
        data = np.empty(int(lengths.sum()), np.uint8)
        view = memoryview(data.data)
        firsts = starts.tolist()
        for first, last in _runs(handles).tolist():
            size = firsts[last] - firsts[first] + int(lengths[last])
            if size:
                segment, at = divmod(int(handles[first, 0]), 1 << SEGMENT_BITS)
                got = os.preadv(self._fd(segment), [view[firsts[first] : firsts[first] + size]], at)
                if got != size:
                    raise OSError(f"spill segment {segment}: read {got} of {size} bytes at {at}")
        ends = starts + lengths
        ends[handles[:, 1] < 0] = -1
        return data, starts, ends

    def read_each(self, handles: np.ndarray) -> list[bytes | None]:
        """The values of ``handles`` as `bytes` each (None for a null): `read`'s, in one copy. Values of
        `EACH_BYTES` or more on average are read one ``pread`` each straight into their own `bytes` (a
        shuffled batch's values lie apart anyway); smaller ones as `read` reads them, then sliced."""
        n = len(handles)
        if not n or int(np.maximum(handles[:, 1], 0).sum()) < EACH_BYTES * n:
            data, starts, ends = self.read(handles)
            view = memoryview(data.data)
            return [None if b < 0 else bytes(view[a:b]) for a, b in zip(starts.tolist(), ends.tolist(),
                                                                          strict=True)]
        self._check(handles)
        out: list[bytes | None] = []
        for offset, length in handles.tolist():
            if length < 0:
                out.append(None)
                continue
            segment, at = divmod(offset, 1 << SEGMENT_BITS)
            value = os.pread(self._fd(segment), length, at)
            if len(value) != length:
                raise OSError(f"spill segment {segment}: read {len(value)} of {length} bytes at {at}")
            out.append(value)
        return out


class Spill:
    """An append-only store of encoded values in local files, addressed by handles (module docstring)."""

    def __init__(self, folder: str | None = None, *, shared: bool = False) -> None:
        """``folder``: where the spill's own folder is made (default: the temporary directory);
        ``shared``: other processes read it too (transform workers): the checks of the pages of files
        read in place are saved beside their segments for them (`external`)."""
        root = folder or tempfile.gettempdir()
        self.shared = shared
        _sweep(root)
        try:
            self.folder = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=root)
        except OSError as e:
            raise ReaderError(
                f"cannot make the folder where a shuffle window's encoded images wait, under {root!r} "
                f"({e.strerror or e}); point TMPDIR at a writable local folder") from e
        self._lock = threading.Lock()
        self._segment = 0
        self._fds: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        # (window, file, page checks or an entry's inode) -> the segment that is that file, not copied
        self._external: dict[tuple[int, str, tuple[str, str] | int | None], int] = {}
        self._links = True  # until a hard link fails: the cache on another filesystem
        self._window: dict[int, int] = {}  # segment -> the window (its first segment) it belongs to
        self.bytes_written = 0
        self.reader = SpillReader(self.folder)
        self._open(0)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def _open(self, segment: int) -> None:
        path = os.path.join(self.folder, f"{segment}.bin")
        self._fds[segment] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._sizes[segment] = 0
        self._window[segment] = segment

    @property
    def segment(self) -> int:
        return self._segment

    def next_segment(self) -> int:
        """Append to a new segment from now on (a new window); returns its number."""
        with self._lock:
            self._segment += 1
            self._open(self._segment)
            return self._segment

    def external(self, path: str, window: int, pages: PageChecks | None = None) -> int:
        """A segment that is the file ``path`` itself (a local Parquet file whose values are stored as they
        are: handles point into it, nothing is copied), for the window of segment ``window``; one per
        window and file (and column chunk, given ``pages``), let go of with the window's segments.
        ``pages``: the checks of the column chunk's pages, made as its values are read (by this spill's
        reader, or, from a copy saved beside the segment when the spill is ``shared``, by a transform
        worker's); None: none to make."""
        key = (window, path, None if pages is None else (pages.where, pages.column))
        with self._lock:
            k = self._external.get(key)
            if k is None:
                self._segment += 1
                k = self._external[key] = self._segment
                if pages is not None:
                    if self.shared:
                        pages.save(os.path.join(self.folder, f"{k}.pages"))
                    self.reader.adopt(k, pages)
                os.symlink(path, os.path.join(self.folder, f"{k}.bin"))
                self._fds[k] = -1  # not written to
                self._sizes[k] = 0
                self._window[k] = window
            return k

    def put(self, column: pa.Array | pa.ChunkedArray, segment: int | None = None,
            rows: np.ndarray | None = None, *, mapped: MappedEntry | None = None) -> np.ndarray:
        """Append the values of a binary ``column`` (only those at ``rows``, ascending, when given); their
        handles, ``(n, 2)`` int64. The bytes go from Arrow's buffers to the file (``pwritev``), uncopied:
        a selection is not gathered first (Arrow's ``take`` of large values cost several times the read).

        ``mapped``: the cache entry the column was read from (`RowGroupCache.entry_of`). Its values are
        then not copied: the entry's file is linked into the spill's folder (a hard link, so the bytes
        stay whatever another process evicts or replaces) and the handles point into it. Where it cannot
        be linked (another filesystem), they are copied as any others."""
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        if rows is None:
            out = [self._put_array(c, segment, None, mapped) for c in chunks]
        else:
            out, start = [], 0
            cuts = np.searchsorted(rows, np.cumsum([len(c) for c in chunks]))
            lo = 0
            for c, hi in zip(chunks, cuts.tolist(), strict=True):
                out.append(self._put_array(c, segment, rows[lo:hi] - start, mapped))
                start += len(c)
                lo = hi
        if not out:
            return np.empty((0, 2), np.int64)
        return np.concatenate(out) if len(out) != 1 else out[0]

    def _put_array(self, arr: pa.Array, segment: int | None, rows: np.ndarray | None,
                   mapped: MappedEntry | None = None) -> np.ndarray:
        if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
            arr = arr.cast(pa.large_binary() if pa.types.is_large_string(arr.type) else pa.binary())
            mapped = None  # (a cast's buffers are its own)
        n = len(arr)
        _validity, offsets_buf, data_buf = arr.buffers()
        offset_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
        offsets = np.frombuffer(offsets_buf, offset_type)[arr.offset : arr.offset + n + 1].astype(np.int64) \
            if n else np.zeros(1, np.int64)
        starts, ends = offsets[:-1], offsets[1:]
        if rows is not None:
            starts, ends = starts[rows], ends[rows]
        lengths = ends - starts
        handles = np.empty((len(starts), 2), np.int64)
        if not len(starts):
            return handles
        base = None if mapped is None or data_buf is None else mapped.offset_of(data_buf)
        linked = None if mapped is None or base is None else self._linked(mapped, segment)
        if linked is not None and base is not None:
            handles[:, 0] = (linked << SEGMENT_BITS) + base + starts
            handles[:, 1] = lengths
            return _with_nulls(handles, arr, rows)
        total = int(lengths.sum())
        with self._lock:
            k = self._segment if segment is None else segment
            if k not in self._fds:
                raise ValueError(f"spill segment {k} was released")
            at = self._sizes[k]
            self._sizes[k] = at + total
            fd = self._fds[k]
        if total:
            try:
                self._write(fd, memoryview(data_buf), starts, ends, at)  # type: ignore[arg-type]
            except OSError as e:
                raise ReaderError(
                    f"cannot set aside a shuffle window's encoded images in {self.folder!r} "
                    f"({e.strerror or e}); point TMPDIR at a local folder with room for about the reader's "
                    "share of a window of them, or pass a smaller shuffle_buffer") from e
        with self._lock:
            self.bytes_written += total
        handles[:, 0] = (k << SEGMENT_BITS) + at + np.concatenate([[0], np.cumsum(lengths[:-1])])
        handles[:, 1] = lengths
        return _with_nulls(handles, arr, rows)

    def _linked(self, mapped: MappedEntry, segment: int | None) -> int | None:
        """The segment that is ``mapped``'s file, hard-linked into the folder, for the window of
        ``segment`` (one per window and entry, let go of with the window's segments); None where it
        cannot be linked, or the file at its path is no longer the one mapped."""
        with self._lock:
            window = self._window.get(self._segment if segment is None else segment, self._segment)
            key = (window, mapped.path, mapped.inode)
            k = self._external.get(key)
            if k is not None or not self._links:
                return k
            k = self._segment + 1
            link = os.path.join(self.folder, f"{k}.bin")
            try:
                os.link(mapped.path, link)
                same = os.stat(link).st_ino == mapped.inode  # not replaced since it was mapped
            except OSError as e:
                if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    self._links = False  # (another filesystem: copy from now on)
                return None
            if not same:
                os.unlink(link)
                return None
            self._segment = self._external[key] = k
            self._fds[k] = -1  # not written to
            self._sizes[k] = 0
            self._window[k] = window
            return k

    @staticmethod
    def _write(fd: int, data: memoryview, starts: np.ndarray, ends: np.ndarray, at: int) -> None:
        """``data[starts[i]:ends[i]]`` for every ``i``, one after another in the file from ``at``; runs of
        adjacent values are one piece, and the pieces go `_IOV` at a time."""
        if len(starts) > 1:  # join values that lie one after another in the buffer
            breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
            starts = starts[np.concatenate([[0], breaks])]
            ends = ends[np.concatenate([breaks - 1, [len(ends) - 1]])]
        pieces = [data[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True) if b > a]
        for i in range(0, len(pieces), _IOV):
            group = pieces[i : i + _IOV]
            size = sum(len(p) for p in group)
            written = os.pwritev(fd, group, at)
            while written < size:  # a short write: the rest, from where it stopped
                rest = bytes(b"".join(group))[written:]
                written += os.pwrite(fd, rest, at + written)
            at += size

    def oldest_window(self, handles: np.ndarray) -> int:
        """The oldest window whose segments ``handles`` refer to; a large value when none."""
        if not len(handles):
            return 1 << 62
        segments = np.unique(handles[:, 0] >> SEGMENT_BITS).tolist()
        with self._lock:
            return min(self._window.get(int(k), int(k)) for k in segments)

    def release_before(self, window: int) -> None:
        """Delete the segments of the windows before ``window``: no batch refers to them any more."""
        with self._lock:
            gone = [k for k in self._fds if self._window[k] < window]
            fds = [self._fds.pop(k) for k in gone]
            for k in gone:
                self._sizes.pop(k)
                self._window.pop(k)
            for key in [key for key in self._external if key[0] < window]:
                del self._external[key]
        self.reader.forget(gone)
        for k, fd in zip(gone, fds, strict=True):
            if fd >= 0:
                os.close(fd)
            for suffix in (".bin", ".pages"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.folder, f"{k}{suffix}"))

    def close(self) -> None:
        """Delete every file (idempotent)."""
        self.release_before(1 << 62)
        self.reader.close()
        self._finalizer()


def _with_nulls(handles: np.ndarray, arr: pa.Array, rows: np.ndarray | None) -> np.ndarray:
    """``handles`` with the null values of ``arr`` (at ``rows``) marked: length -1."""
    if arr.null_count:
        nulls = np.asarray(arr.is_null())
        handles[nulls if rows is None else nulls[rows], 1] = -1
    return handles


def handles_to_bytes(reader: SpillReader, handles: np.ndarray) -> np.ndarray:
    """The values of ``handles`` as a 1-D object array of `bytes` (None for a null)."""
    out = np.empty(len(handles), dtype=object)
    out[:] = reader.read_each(handles)
    return out


def _runs(handles: np.ndarray) -> np.ndarray:
    """(first, last) row of each run of ``handles`` whose values lie one after another in one segment
    (a null ends a run and is a run of its own): one read each."""
    if not len(handles):
        return np.zeros((0, 2), np.int64)
    offsets, lengths = handles[:, 0], handles[:, 1]
    joined = (offsets[1:] == offsets[:-1] + lengths[:-1]) & (lengths[1:] >= 0) & (lengths[:-1] >= 0)
    firsts = np.flatnonzero(np.concatenate([[True], ~joined]))
    return np.stack([firsts, np.append(firsts[1:], len(handles)) - 1], axis=1)
