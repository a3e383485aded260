"""The pages of a Parquet column chunk, walked from their headers, and their page checksums checked.

Parquet gives every page an optional CRC-32 of its bytes as stored (compressed; a v2 page's levels
included) in its Thrift header. shardkit writes one on every page (`shardkit.dataset.write`), and the
reader has pyarrow verify them (`shardkit.dataset._dataset.VERIFY_PAGE_CHECKSUMS`). This module reads the
headers itself (Thrift's compact protocol, the few fields needed) so that a scrub can say more than
pyarrow does: which column and page of which row group is damaged, and which pages carry no checksum
to check (files written by other tools, or by shardkit before it wrote them). Writing, `ChecksumSink` puts
the checksums into the pages pyarrow writes without them (ISA-L's CRC-32, several times faster than
pyarrow's), and moves the footer's offsets by the bytes that adds: pyarrow's own bytes, sooner.

Example:
    >>> report = check_chunk(chunk_bytes, offset=4)      # the bytes of one column chunk
    >>> report.pages, report.unchecked, report.problems
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from shardkit.errors import CorruptDatasetError

__all__ = ["MISMATCH", "ChunkReport", "Page", "PageChecks", "PageError", "PlainLayout", "check_chunk",
           "check_row_group", "checksum_error", "chunk_range", "crc32", "first_page", "page_header",
           "plain_layout", "ranges_of", "read_page", "walk_pages"]

def _fastest_crc32() -> Callable[..., int]:
    """ISA-L's CRC-32 (``isal``, a dependency: much faster, with PCLMUL), else zlib's (as fast as
    pyarrow's own): the same checksum, Parquet's (IEEE 802.3); ``crc32(data, start)`` goes on from the
    checksum of the bytes before ``data``."""
    try:
        from isal import isal_zlib
    except ImportError:  # a platform without isal's wheels
        return zlib.crc32
    return isal_zlib.crc32


crc32 = _fastest_crc32()

#: The checks of pages as a dataset reads them are timed (`Dataset.checksum_seconds`, shown by
#: `Reader.profile`). Off only to measure what the reader's clocks cost (``benchmarks.read``'s
#: ``shardkit-notelemetry``, with `shardkit.reader._profile.TIMING`).
CHECK_CLOCK = True

_U32 = struct.Struct("<I")  # a PLAIN BYTE_ARRAY value's length

#: how a problem of `check_chunk` says that a page's bytes are not those its checksum was made of
MISMATCH = "does not match its checksum"

#: Parquet's page types (``PageType``)
PAGE_KINDS = {0: "data page", 1: "index page", 2: "dictionary page", 3: "data page (v2)"}


class PageError(ValueError):
    """A page header that cannot be read: the bytes are not what a column chunk holds."""


@dataclasses.dataclass(frozen=True)
class Page:
    """One page: where its header starts in the file, its kind, its stored size and its checksum
    (None: the page carries none), and whether its bytes match it (None: nothing to check)."""

    offset: int
    kind: str
    size: int
    crc: int | None
    ok: bool | None


@dataclasses.dataclass
class ChunkReport:
    """What `check_chunk` found in one column chunk."""

    pages: int = 0
    unchecked: int = 0  # pages without a checksum
    problems: list[str] = dataclasses.field(default_factory=list)


def chunk_range(column: pq.ColumnChunkMetaData) -> tuple[int, int]:
    """The (start, length) in the file of a column chunk (pyarrow's ``ColumnChunkMetaData``): from its
    dictionary page, where it has one, to the end of its last data page."""
    start = int(column.data_page_offset)
    dictionary = getattr(column, "dictionary_page_offset", None)
    if getattr(column, "has_dictionary_page", False) and dictionary and 0 < int(dictionary) < start:
        start = int(dictionary)
    return start, int(column.total_compressed_size)


def walk_pages(data: bytes | memoryview, offset: int = 0) -> Iterator[Page]:
    """The pages of a column chunk's bytes ``data`` (which start at ``offset`` in the file), in order.

    Raises:
        PageError: a header that cannot be read, or a page that runs past the chunk's end.
    """
    view = memoryview(data)
    at, stop = offset, offset + len(view)
    while at < stop:
        page, at = read_page(lambda start, length: view[start - offset:start - offset + length], at, stop)
        yield page


#: bytes `read_page` reads for a page header at first (a longer header: read again, longer)
HEADER_BYTES = 256


def read_page(read: Callable[[int, int], bytes | memoryview], at: int, stop: int) -> tuple[Page, int]:
    """The page whose header starts at byte ``at`` of a column chunk that ends at ``stop``, its checksum
    checked (``Page.ok``), and where the next page begins; ``read(start, length)`` gives the file's bytes.

    Raises:
        PageError: a header that cannot be read, or a page that runs past the chunk's end.
    """
    length = min(HEADER_BYTES, stop - at)
    while True:
        try:
            kind, size, crc, header = page_header(read(at, length))
            break
        except PageError as e:
            if length >= stop - at:
                raise PageError(f"the page header at byte {at} cannot be read ({e})") from e
            length = min(stop - at, length * 64)
    body = at + header
    if size < 0 or body + size > stop:
        raise PageError(f"the page at byte {at} claims {size} bytes, past the end of its column chunk "
                        f"({stop - body} bytes left)")
    ok = None if crc is None else (crc32(read(body, size)) == crc & 0xFFFFFFFF)
    return Page(at, PAGE_KINDS.get(kind, f"page of type {kind}"), size, crc, ok), body + size


def page_header(data: bytes | memoryview) -> tuple[int, int, int | None, int]:
    """The page header at the start of ``data``: its page type, stored size, CRC-32 (None: none) and
    its own length in bytes.

    Raises:
        PageError: not a page header, or one longer than ``data``.
    """
    reader = _Compact(memoryview(data), 0)
    try:
        kind, size, crc = reader.page_header()
    except (IndexError, ValueError) as e:
        raise PageError(str(e)) from e
    return kind, size, crc, reader.at


@dataclasses.dataclass(frozen=True)
class PlainLayout:
    """Where the values of a column chunk stored as they are lie in its file (`plain_layout`): value ``k``
    is ``lengths[k]`` bytes at ``starts[k]``; page ``p``'s stored bytes are ``[bodies[p, 0], bodies[p, 1])``
    with checksum ``crcs[p]`` (-1: the page carries none)."""

    starts: np.ndarray
    lengths: np.ndarray
    bodies: np.ndarray
    crcs: np.ndarray


def checksum_error(where: str, detail: str) -> CorruptDatasetError:
    """A row group whose pages fail their checksums: ``where`` names it, ``detail`` its column and page."""
    return CorruptDatasetError(
        f"{where} fails its page checksums: {detail}. Its bytes changed after they were written (storage "
        "or a copy went wrong); no row of a damaged page is read. Restore the file from its source, or "
        "rewrite the dataset from its source; `shardkit verify URL` finds every damaged file, and "
        "on_error='skip' reads the others")


def unreadable_error(where: str, reason: str) -> CorruptDatasetError:
    """A row group that cannot be read (``reason``: pyarrow's or the page walk's words): ``where`` names
    it and its file."""
    return CorruptDatasetError(f"{where} cannot be read ({reason}); the file is truncated or corrupt: "
                               "rewrite the dataset, or read with on_error='skip'")


@dataclasses.dataclass
class PageChecks:
    """The pages of a column chunk whose values are read in place, checked as the values are read: each
    page once, before any of its values is used (`check`). ``where`` names the row group and its file,
    ``column`` the column; ``bodies`` and ``crcs`` are a `PlainLayout`'s. Saved beside a reader's spill
    (`save`, `load`: plain arrays, nothing pickled) for its transform worker processes, which read the
    values."""

    where: str
    column: str
    bodies: np.ndarray
    crcs: np.ndarray
    checked: np.ndarray = dataclasses.field(init=False, repr=False)  # which pages passed

    def __post_init__(self) -> None:
        self.checked = np.zeros(len(self.crcs), dtype=bool)

    def check(self, read: Callable[[int, int], Any], offsets: np.ndarray) -> int:
        """Check the pages that hold the values at file ``offsets`` and are not checked yet; ``read(length,
        start)`` gives the file's bytes. Returns how many were checked; a mismatch raises
        `CorruptDatasetError` naming the row group, the column and the page. (Two threads may both check
        a page: it is marked only once it passed.)"""
        pages = np.searchsorted(self.bodies[:, 0], offsets, side="right") - 1
        pages = np.unique(pages[pages >= 0])
        todo = pages[~self.checked[pages]].tolist()
        for p in todo:
            crc = int(self.crcs[p])
            start, end = int(self.bodies[p, 0]), int(self.bodies[p, 1])
            if crc >= 0 and crc32(read(end - start, start)) != crc:
                raise checksum_error(self.where,
                                     f"column {self.column!r}: the page at byte {start} {MISMATCH}")
            self.checked[p] = True
        return len(todo)

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            np.savez(f, where=np.array(self.where), column=np.array(self.column), bodies=self.bodies,
                     crcs=self.crcs)

    @classmethod
    def load(cls, path: str) -> PageChecks:
        with np.load(path, allow_pickle=False) as saved:
            return cls(str(saved["where"]), str(saved["column"]), saved["bodies"], saved["crcs"])


def plain_layout(data: bytes | memoryview, offset: int) -> PlainLayout | None:
    """Where each value of a column chunk's bytes ``data`` (which start at ``offset`` in the file) lies:
    a flat BYTE_ARRAY column stored as it is (required, PLAIN, uncompressed, no dictionary), whose data
    pages hold nothing but ``u32 length | bytes`` per value. The pages' checksums are read, not checked
    (`PageChecks` checks the pages a lookup reads). None when the pages are not laid out so (a
    dictionary page, levels, another encoding): the values must then be read through Parquet.
    """
    view = memoryview(data)
    starts: list[int] = []
    lengths: list[int] = []
    bodies: list[tuple[int, int]] = []
    crcs: list[int] = []
    length_at = _U32.unpack_from
    at = 0
    while at < len(view):
        reader = _Compact(view, at)
        try:
            kind, size, crc = reader.page_header()
        except (IndexError, ValueError):
            return None
        body, end = reader.at, reader.at + size
        if kind not in (0, 3) or end > len(view):  # data pages (v1, v2) only
            return None
        bodies.append((offset + body, offset + end))
        crcs.append(-1 if crc is None else crc & 0xFFFFFFFF)
        p = body
        try:
            while p < end:
                (n,) = length_at(view, p)
                starts.append(p + 4)
                lengths.append(n)
                p += 4 + n
        except struct.error:  # a length cut by the chunk's end
            return None
        if p != end:  # a value runs past its page: not plain values
            return None
        at = end
    return PlainLayout(np.asarray(starts, np.int64) + offset, np.asarray(lengths, np.int64),
                       np.asarray(bodies, np.int64).reshape(-1, 2), np.asarray(crcs, np.int64))


def first_page(read: Callable[[int, int], bytes], column: pq.ColumnChunkMetaData) -> Page:
    """The first page of a column chunk, from its header alone (its bytes are not read or checked):
    what tells whether a file carries page checksums. ``read(length, offset)`` reads bytes of the file.

    Raises:
        PageError: the header cannot be read.
    """
    start, length = chunk_range(column)
    for size in (min(length, 4096), min(length, 1 << 20)):  # a header with long statistics: read more
        reader = _Compact(memoryview(read(size, start)), 0)
        try:
            kind, page_size, crc = reader.page_header()
        except IndexError:
            continue
        except ValueError as e:
            raise PageError(f"the page header at byte {start} cannot be read ({e})") from e
        return Page(start, PAGE_KINDS.get(kind, f"page of type {kind}"), page_size, crc, None)
    raise PageError(f"the page header at byte {start} runs past its column chunk")


def check_chunk(data: bytes | memoryview, offset: int = 0) -> ChunkReport:
    """Walk a column chunk's pages and check each checksum; problems are named by page and byte.

    A page header of the shapes pyarrow writes most (a crc, no statistics) is read by one match of
    `_PLAIN_HEADER`; any other goes through `read_page`. The same pages, checks and problems either way,
    a few times faster on a chunk of many pages (every read of a local file walks its row group's chunks
    before decoding: `Dataset._verify_local`)."""
    report = ChunkReport()
    view = memoryview(data)
    at, stop = 0, len(view)
    match = _PLAIN_HEADER.match

    def read(start: int, length: int) -> memoryview:
        return view[start - offset:start - offset + length]

    try:
        while at < stop:
            found = match(view[at:at + _PLAIN_HEADER_MAX])
            if found is not None:
                size = _zigzag(_uvarint(found.group(2)))
                body = at + found.end()
                if 0 <= size <= stop - body:  # (else read_page raises, naming it)
                    report.pages += 1
                    if crc32(view[body:body + size]) != _zigzag(_uvarint(found.group(3))) & 0xFFFFFFFF:
                        report.problems.append(f"the {_PLAIN_KINDS[found.group(1)]} at byte {offset + at} "
                                               f"{MISMATCH}")
                    at = body + size
                    continue
            page, end = read_page(read, offset + at, offset + stop)
            report.pages += 1
            if page.ok is None:
                report.unchecked += 1
            elif not page.ok:
                report.problems.append(f"the {page.kind} at byte {page.offset} {MISMATCH}")
            at = end - offset
    except PageError as e:
        report.problems.append(str(e))
    return report


_VARINT = rb"[\x80-\xff]{0,4}[\x00-\x7f]"  # an i32 (zigzag): 1 to 5 bytes
_VARINT64 = rb"[\x80-\xff]{0,9}[\x00-\x7f]"  # an i64: 1 to 10 bytes
#: A ``PageHeader`` as pyarrow writes most: the type (0, 2 or 3: a data page, a dictionary page, a v2
#: data page), the uncompressed and compressed sizes and the crc (fields 1-4, i32), then its own header
#: without statistics (or with an empty struct of them): a ``DataPageHeader`` (field 5: four i32), a
#: ``DictionaryPageHeader`` (field 7: two i32, is_sorted) or a ``DataPageHeaderV2`` (field 8: six i32,
#: is_compressed); then the stop. Groups: the type, the compressed size, the crc (their varints as stored).
_PLAIN_HEADER = re.compile(
    rb"\x15([\x00\x04\x06])\x15" + _VARINT + rb"\x15(" + _VARINT + rb")\x15(" + _VARINT + rb")(?:"
    rb"\x1c(?:\x15" + _VARINT + rb"){4}(?:\x1c\x00)?\x00"
    rb"|\x3c(?:\x15" + _VARINT + rb"){2}[\x11\x12]?\x00"
    rb"|\x4c(?:\x15" + _VARINT + rb"){6}[\x11\x12]?(?:\x1c\x00)?\x00)\x00", re.S)
_PLAIN_HEADER_MAX = 2 + 3 * 6 + 1 + 6 * 6 + 5  # the longest header it matches (a v2 page's), in bytes
_PLAIN_KINDS = {b"\x00": PAGE_KINDS[0], b"\x04": PAGE_KINDS[2], b"\x06": PAGE_KINDS[3]}


def _uvarint(raw: bytes) -> int:
    value = shift = 0
    for b in raw:
        value |= (b & 0x7F) << shift
        shift += 7
    return value


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def ranges_of(f: Any) -> Callable[[int, int], memoryview]:
    """``read(length, offset)`` over a pyarrow ``NativeFile``: a memory-mapped file's bytes as a view of
    its mapping, no copy (its position moves: a file the caller reads alone, or at offsets only)."""

    def read(length: int, start: int) -> memoryview:
        f.seek(start)
        return memoryview(f.read_buffer(length))

    return read


def check_row_group(read: Callable[[int, int], Any], group: pq.RowGroupMetaData, *,
                    columns: set[str] | None = None, size: int | None = None
                    ) -> Iterator[tuple[str, ChunkReport]]:
    """`check_chunk` of each column chunk of a row group (pyarrow's ``RowGroupMetaData``), as its column
    path and report; ``read(length, offset)`` reads bytes of the file. ``columns``: only the chunks of
    these top-level fields. ``size`` (the file's): a chunk that lies outside the file's data is reported
    as a problem, not read."""
    for j in range(group.num_columns):
        column = group.column(j)
        if columns is not None and column.path_in_schema.split(".", 1)[0] not in columns:
            continue
        start, length = chunk_range(column)
        if size is not None and (start < 4 or start + length > size - 8):
            outside = ChunkReport(problems=[f"its column chunk (bytes {start}..{start + length}) lies "
                                            f"outside the file's {size} bytes of data"])
            yield column.path_in_schema, outside
            continue
        yield column.path_in_schema, check_chunk(read(length, start), start)


class _Compact:
    """Just enough of Thrift's compact protocol to read a ``PageHeader`` and skip what it does not need."""

    def __init__(self, view: memoryview, at: int) -> None:
        self.view, self.at = view, at

    def byte(self) -> int:
        value = self.view[self.at]
        self.at += 1
        return int(value)

    def varint(self) -> int:
        view, at = self.view, self.at
        shift = value = 0
        while True:
            b = view[at]
            at += 1
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                self.at = at
                return value
            shift += 7
            if shift > 63:
                raise ValueError("a varint longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def page_header(self) -> tuple[int, int, int | None]:
        """``PageHeader``'s type (field 1), compressed_page_size (3) and crc (4, or None); the rest
        skipped."""
        fields: dict[int, int] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == 0:
                break
            delta = head >> 4
            last = last + delta if delta else self.zigzag()
            if last in (1, 2, 3, 4) and kind == 5:
                fields[last] = self.zigzag()
            else:
                self.skip(kind)
        if 1 not in fields or 3 not in fields:
            raise ValueError("no page type or size")
        crc = fields.get(4)
        return fields[1], fields[3], crc

    def skip(self, kind: int, depth: int = 0) -> None:
        if depth > 32:
            raise ValueError("structures nested too deep")
        if kind in (1, 2):  # a boolean field: its value is the type
            return
        if kind in (5, 6):  # (the most frequent)
            self.varint()
        elif kind == 3:
            self.at += 1
        elif kind == 4:
            self.varint()
        elif kind == 7:
            self.at += 8
        elif kind == 8:
            size = self.varint()  # (not ``self.at += self.varint()``: that adds to the offset before it)
            self.at += size
        elif kind in (9, 10):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            element = head & 0x0F
            for _ in range(size):
                if element in (1, 2):  # a boolean in a list takes a byte
                    self.at += 1
                else:
                    self.skip(element, depth + 1)
        elif kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip(types >> 4, depth + 1)
                    self.skip(types & 0x0F, depth + 1)
        elif kind == 12:
            last = 0
            while True:
                head = self.byte()
                if head & 0x0F == 0:
                    return
                last = last + (head >> 4) if head >> 4 else self.zigzag()
                self.skip(head & 0x0F, depth + 1)
        else:
            raise ValueError(f"unknown Thrift type {kind}")
        if self.at > len(self.view):
            raise ValueError("past the end")


# ---- writing: page checksums added to what pyarrow writes -------------------------------------------

#: Thrift compact types
_I32, _I64, _STRUCT = 5, 6, 12


class ChecksumSink:
    """A writable binary file for ``pq.ParquetWriter(write_page_checksum=False)`` that gives every page
    the CRC-32 pyarrow would have written (`crc32`, much faster than pyarrow's own), into ``raw``.

    pyarrow writes a page as two writes, its Thrift header and its bytes; the sink holds the header until
    the page's bytes have come, and writes the header with its ``crc`` field (5 bytes or fewer) then the
    bytes, untouched. The footer, which pyarrow wrote with the offsets and sizes it counted, gets them
    moved by the bytes added before each (`_moved_footer`): the file is byte for byte the one pyarrow
    writes with ``write_page_checksum=True``. `metadata` is its footer, once closed.

    A page index (``write_page_index=True``: each column chunk's column index and offset index, which
    pyarrow writes between the last page and the footer) is moved too: its offset index gets each page's
    offset and size with the checksum in (`_moved_index`), and the footer the index's new place.

    Anything written that is not laid out so (a file not starting with its magic, a page running into the
    next write; at `close`, a file ending inside a page, or bytes after the last page that are neither the
    page index nor the footer: a bloom filter) raises `PageError`, naming it: a file is never finished
    with sizes that do not add up. The caller (`shardkit.dataset.write.PartWriter`) asks for no bloom
    filter.
    """

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.logical = 0  # the bytes pyarrow has written (where it thinks it is)
        self.added: list[int] = [0]  # bytes added before each header in ``starts`` (cumulative)
        self.starts: list[int] = []  # logical offset of each page header
        self._header: bytes | None = None
        self._end = 0
        self._pieces: list[Any] = []
        self._left = 0
        self._crc = 0
        self._footer: list[bytes] | None = None
        self._footer_at = 0  # where the footer starts (logical)
        self.metadata: pq.FileMetaData | None = None
        self.closed = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if not isinstance(data, bytes):  # (pyarrow's PythonFile gives bytes: a buffer it reused would change)
            data = bytes(data)
        n = len(data)
        if not n:  # (the body of an empty page: a dictionary page of a column of nulls)
            return 0
        at, self.logical = self.logical, self.logical + n
        if self._footer is not None:
            self._footer.append(bytes(data))
        elif self._left:
            if n > self._left:
                raise PageError(f"a write of {n} bytes at byte {at} runs past its page ({self._left} bytes "
                                "left): not the layout of pyarrow's page writes")
            self._pieces.append(data)
            self._crc = crc32(data, self._crc)
            self._left -= n
            if not self._left:
                self._flush_page()
        elif at == 0:
            if bytes(data) != b"PAR1":
                raise PageError("a Parquet file starts with its magic bytes PAR1")
            self.raw.write(data)
        else:
            header = bytes(data)
            found = _header_fields(header)
            if found is None:  # not a page header: the footer (FileMetaData, its length, PAR1)
                self._footer, self._footer_at = [header], at
                return n
            size, self._end = found
            self.starts.append(at)
            self._header, self._pieces, self._left, self._crc = header, [], size, 0
            if not size:
                self._flush_page()
        return n

    def _flush_page(self) -> None:
        plain = self._header or b""
        header = _with_crc(plain, self._end, self._crc)
        self.added.append(self.added[-1] + len(header) - len(plain))
        self.raw.write(header)
        for piece in self._pieces:
            self.raw.write(piece)
        self._header, self._pieces = None, []

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._left or self._header is not None:
                raise PageError(f"the file ends inside a page ({self._left} of its bytes not written)")
            if self._footer is not None:
                tail = b"".join(self._footer)
                size = int.from_bytes(tail[-8:-4], "little")
                if tail[-4:] != b"PAR1" or size > len(tail) - 8:
                    raise PageError(f"the {len(tail) - 8} bytes after the last page do not end in a Parquet "
                                    "footer: their offsets cannot be moved")
                index, footer = self._moved_footer(tail[:-8 - size], tail[-8 - size:-8])
                ending = index + footer + len(footer).to_bytes(4, "little") + b"PAR1"
                self.raw.write(ending)
                import pyarrow as pa

                self.metadata = pq.read_metadata(pa.BufferReader(b"PAR1" + ending))
        finally:
            self.raw.close()

    def _moved(self, offset: int) -> int:
        """Where a logical offset (a page's start, or the end of the last page) is in the file written."""
        return offset + self.added[bisect.bisect_left(self.starts, offset)]

    def _moved_footer(self, index: bytes, footer: bytes) -> tuple[bytes, bytes]:
        """The page index (``index``, written after the last page; empty without one) and FileMetaData
        with every offset moved (`_moved`) and every column chunk's and row group's size grown by the
        bytes added to its page headers: the integers rewritten in place, every other byte kept."""
        meta = _Thrift(footer, 0).struct(_FILE_META)  # type: ignore[arg-type]  # (bytes: indexed faster)
        new: list[tuple[tuple[int, int], int]] = []  # (where, value) of each integer changed
        indexes: list[tuple[int, int, bool, dict[int, Any]]] = []  # (offset, length, offset index?, chunk)
        pages = 0
        for group in _field(meta, 4, default=(0, []))[1]:
            grown = 0
            for chunk in _field(group, 1)[1]:
                column = _field(chunk, 3)
                start = _field(column, 9)
                if 0 < _field(column, 11, default=0) < start:
                    start = _field(column, 11)
                end = start + _field(column, 7)
                first, last = bisect.bisect_left(self.starts, start), bisect.bisect_left(self.starts, end)
                ends_at_page = last < len(self.starts) and self.starts[last] == end
                if first == len(self.starts) or self.starts[first] != start or not (
                        ends_at_page or end == self._footer_at):
                    raise PageError(f"the column chunk at byte {start} ({end - start} bytes) of the footer "
                                    "is not the pages written: their checksums cannot be put in")
                pages += last - first
                more = self._moved(end) - end - (self._moved(start) - start)
                grown += more
                for k in (9, 10, 11):
                    if _field(column, k, default=0) > 0:
                        new.append((_at(column, k), self._moved(_field(column, k))))
                new += [(_at(column, k), _field(column, k) + more) for k in (6, 7)]
                if _field(chunk, 2, default=0) > 0:
                    new.append((_at(chunk, 2), self._moved(_field(chunk, 2))))
                if _field(column, 14, default=None) is not None:
                    raise PageError("a column chunk with a bloom filter: its offset cannot be moved")
                for k, is_offsets in ((4, True), (6, False)):
                    if _field(chunk, k, default=None) is not None:
                        indexes.append((_field(chunk, k), _field(chunk, k + 1), is_offsets, chunk))
            new.append((_at(group, 2), _field(group, 2) + grown))
            if _field(group, 5, default=None) is not None:
                new.append((_at(group, 5), self._moved(_field(group, 5))))
            if _field(group, 6, default=None) is not None:
                new.append((_at(group, 6), _field(group, 6) + grown))
        if pages != len(self.starts):
            raise PageError(f"{len(self.starts) - pages} pages written are in no column chunk of the footer")
        # the page index: column indexes (no offsets in them) and offset indexes, which must tile the bytes
        # between the last page and the footer
        moved_index = bytearray()
        at, moved_at = self._footer_at, self._moved(self._footer_at)
        for offset, length, is_offsets, chunk in sorted(indexes, key=lambda i: i[0]):
            if offset != at or length < 0:
                raise PageError(f"a page index at byte {offset} ({length} bytes) where the bytes after the "
                                f"last page hold {'more' if offset > at else 'less'} (at byte {at}): "
                                "its offsets cannot be moved")
            piece = index[at - self._footer_at:at - self._footer_at + length]
            if is_offsets:
                piece = self._moved_index(piece)
            k = 4 if is_offsets else 6
            new += [(_at(chunk, k), moved_at + len(moved_index)), (_at(chunk, k + 1), len(piece))]
            moved_index += piece
            at += length
        if at != self._footer_at + len(index):
            raise PageError(f"{self._footer_at + len(index) - at} bytes after the last page are neither the "
                            "page index nor the footer (a bloom filter?): their offsets cannot be moved")
        return bytes(moved_index), _spliced(footer, new)

    def _moved_index(self, piece: bytes) -> bytes:
        """An offset index (``OffsetIndex``) with each page's offset moved and its size (header and
        body) grown by the checksum put in its header. Its page locations as pyarrow writes them (the
        three fields, nothing else) are each read by one match of `_LOCATION`; an index laid out
        otherwise is read field by field."""
        quick = self._moved_locations(piece)
        if quick is not None:
            return quick
        try:
            where = _Thrift(piece, 0).struct(_OFFSET_INDEX)  # type: ignore[arg-type]
        except (IndexError, ValueError) as e:
            raise PageError(f"an offset index that is not one ({e})") from e
        new: list[tuple[tuple[int, int], int]] = []
        for location in _field(where, 1)[1]:
            start, size = self._moved_location(_field(location, 1), _field(location, 2))
            new += [(_at(location, 1), start), (_at(location, 2), size)]
        return _spliced(piece, new)

    def _moved_location(self, offset: int, size: int) -> tuple[int, int]:
        """A page location (its offset, its size with the header) as it is in the file written.

        Raises:
            PageError: no page was written at ``offset``.
        """
        k = bisect.bisect_left(self.starts, offset)
        if k == len(self.starts) or self.starts[k] != offset:
            raise PageError(f"an offset index names a page at byte {offset}, where none was written")
        start = self._moved(offset)
        return start, self._moved(offset + size) - start

    def _moved_locations(self, piece: bytes) -> bytes | None:
        """`_moved_index` of an offset index whose field 1 comes first and holds nothing but page
        locations of three fields; None for any other."""
        if len(piece) < 2 or piece[0] != 0x19 or piece[1] & 0x0F != _STRUCT:
            return None
        count, at = piece[1] >> 4, 2
        if count == 15:  # the count in full
            found = _COUNT.match(piece, 2)
            if found is None:
                return None
            count, at = _uvarint(found.group()), found.end()
        out = bytearray(piece[:at])
        for _ in range(count):
            location = _LOCATION.match(piece, at)
            if location is None:
                return None
            start, size = self._moved_location(*(_zigzag(_uvarint(location.group(k))) for k in (1, 2)))
            out.append(0x16)
            _varint(out, start << 1)
            out.append(0x15)
            _varint(out, size << 1)
            out += piece[location.end(2):location.end()]
            at = location.end()
        out += piece[at:]
        return bytes(out)


_COUNT = re.compile(_VARINT)  # a list's size in full
#: A ``PageLocation`` as pyarrow writes it: offset (i64), compressed_page_size (i32), first_row_index
#: (i64), the stop. Groups: the offset, the size (their varints as stored).
_LOCATION = re.compile(rb"\x16(" + _VARINT64 + rb")\x15(" + _VARINT + rb")\x16" + _VARINT64 + rb"\x00", re.S)


def _spliced(buf: bytes, new: list[tuple[tuple[int, int], int]]) -> bytes:
    """``buf`` with the (zigzag varint) integers at ``(start, end)`` replaced by their new values."""
    out = bytearray()
    done = 0
    for (start, end), value in sorted(new):
        out += buf[done:start]
        _varint(out, (value << 1) ^ (value >> 63))  # (i32 and i64 alike: zigzag, never negative here)
        done = end
    out += buf[done:]
    return bytes(out)


def _header_fields(header: bytes) -> tuple[int, int] | None:
    """A page header's compressed page size, and where its field 3 ends (where the crc goes); None when
    ``header`` does not start as a page header without a crc does: the page type (field 1), its
    uncompressed (2) and compressed size (3) as i32, then no crc (4). A footer's field 2 is a list: the
    bytes pyarrow writes after its last page are never taken for a page. (That the pages found tile the
    column chunks the footer names is checked at the end: `ChecksumSink._moved_footer`.)"""
    at, size = 0, -1
    try:
        for head in (0x15, 0x15, 0x15):  # fields 1, 2, 3 in turn, each an i32 (delta 1, type 5)
            if header[at] != head:
                return None
            at += 1
            shift = size = 0
            while True:
                b = header[at]
                at += 1
                size |= (b & 0x7F) << shift
                if not b & 0x80:
                    break
                shift += 7
                if shift > 35:
                    return None
        nxt = header[at]
    except IndexError:
        return None
    size = (size >> 1) ^ -(size & 1)
    if size < 0 or (nxt >> 4 == 1 and nxt & 0x0F):  # field 4 there already: a crc
        return None
    return size, at


def _with_crc(header: bytes, end: int, crc: int) -> bytes:
    """``header`` with field 4 (crc, i32) at ``end`` (after field 3), the next field's head re-encoded
    (its id is now counted from 4)."""
    signed = crc - (1 << 32) if crc >= 1 << 31 else crc
    out = bytearray(header[:end])
    out.append(0x10 | _I32)
    _varint(out, ((signed << 1) ^ (signed >> 31)) & 0xFFFFFFFF)
    head = header[end]
    if head >> 4 and head & 0x0F:  # the next field, its id as a delta from 3 (it is 5 or more)
        out.append(head - 0x10)
        out += header[end + 1:]
    elif head & 0x0F:  # its id in full
        reader = _Compact(memoryview(header), end + 1)
        _field_head(out, reader.zigzag(), 4, head & 0x0F)
        out += header[reader.at:]
    else:  # the stop
        out += header[end:]
    return bytes(out)


def _varint(out: bytearray, n: int) -> None:
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _field_head(out: bytearray, fid: int, last: int, kind: int) -> None:
    if 0 < fid - last <= 15:
        out.append((fid - last) << 4 | kind)
    else:
        out.append(kind)
        _varint(out, ((fid << 1) ^ (fid >> 15)) & 0xFFFF)


def _field(struct: dict[int, Any], fid: int, **default: Any) -> Any:
    """The value of field ``fid`` of a struct `_Thrift.struct` read."""
    if fid in struct:
        return struct[fid][0]
    if default:
        return default["default"]
    raise PageError(f"a Parquet footer without its field {fid}")


def _at(struct: dict[int, Any], fid: int) -> tuple[int, int]:
    """Where the value of integer field ``fid`` of a struct `_Thrift.struct` read lies in the footer."""
    start, end = struct[fid][1]
    return int(start), int(end)


#: The fields of a footer (``FileMetaData``) that `ChecksumSink` moves, by struct: field id -> the spec of
#: the struct it holds (of a list's elements), or None for an integer. Every other field is skipped.
_COLUMN_META: dict[int, Any] = {6: None, 7: None, 9: None, 10: None, 11: None, 14: None}
_COLUMN_CHUNK: dict[int, Any] = {2: None, 3: _COLUMN_META, 4: None, 5: None, 6: None, 7: None}
_ROW_GROUP: dict[int, Any] = {1: _COLUMN_CHUNK, 2: None, 5: None, 6: None}
_FILE_META: dict[int, Any] = {4: _ROW_GROUP}
#: an ``OffsetIndex``'s page locations: offset, compressed_page_size (with the header), first_row_index
_PAGE_LOCATION: dict[int, Any] = {1: None, 2: None, 3: None}
_OFFSET_INDEX: dict[int, Any] = {1: _PAGE_LOCATION}


class _Thrift(_Compact):
    """The fields of a Thrift struct (compact protocol) named in a spec: field id -> (value, where its
    bytes lie), an integer as an int, a struct as such a dict, a list of structs as ``(type, [dicts])``
    (where: its list header and elements); every other field skipped (`_skip`). Key 0 (no field has that
    id) holds ``(None, where)`` of the struct itself."""

    def struct(self, spec: dict[int, Any], depth: int = 0) -> dict[int, Any]:
        if depth > 16:
            raise PageError("a Parquet footer nested too deep")
        fields: dict[int, Any] = {}
        last = 0
        view = self.view
        start = self.at
        while True:
            head = view[self.at]
            self.at += 1
            kind = head & 0x0F
            if kind == 0:
                fields[0] = (None, (start, self.at))
                return fields
            last = last + (head >> 4) if head >> 4 else self.zigzag()
            if last not in spec or kind in (1, 2):
                self.at = _skip(view, self.at, kind)
            elif kind in (4, 5, 6):
                at = self.at
                fields[last] = (self.zigzag(), (at, self.at))
            elif kind == _STRUCT:
                fields[last] = (self.struct(spec[last], depth + 1), None)
            elif kind == 9 and spec[last] is not None:
                at = self.at
                head = self.byte()
                size = head >> 4 if head >> 4 != 15 else self.varint()
                if head & 0x0F != _STRUCT:
                    raise PageError(f"a Parquet footer whose field {last} is not a list of structs")
                elements = [self.struct(spec[last], depth + 1) for _ in range(size)]
                fields[last] = ((_STRUCT, elements), (at, self.at))
            else:
                raise PageError(f"a Parquet footer whose field {last} is of Thrift type {kind}")


def _skip(view: memoryview | bytes, at: int, kind: int) -> int:
    """Where the Thrift value of type ``kind`` at ``at`` ends: `_Compact.skip` in one loop over the bytes,
    with a stack of the structures open (a footer's statistics and encoding stats are most of its
    fields, and are skipped: this is most of the footer's rewrite)."""
    stack: list[int] = []  # per open structure: -1 (a struct) or the values left in its list
    size = len(view)
    while True:
        if kind in (5, 6, 4):
            while view[at] & 0x80:
                at += 1
            at += 1
        elif kind == 8:
            n = shift = 0
            while True:
                b = view[at]
                at += 1
                n |= (b & 0x7F) << shift
                if not b & 0x80:
                    break
                shift += 7
            at += n
        elif kind == 12:
            stack.append(-1)
        elif kind in (9, 10):
            head = view[at]
            at += 1
            n = head >> 4
            if n == 15:
                n = shift = 0
                while True:
                    b = view[at]
                    at += 1
                    n |= (b & 0x7F) << shift
                    if not b & 0x80:
                        break
                    shift += 7
            element = head & 0x0F
            if element in (1, 2, 3):  # booleans and bytes in a list: a byte each
                at += n
            elif n:
                stack.append(n << 4 | element)
        elif kind == 3:
            at += 1
        elif kind == 7:
            at += 8
        elif kind == 11:
            reader = _Compact(memoryview(view), at)
            reader.skip(11)
            at = reader.at
        elif kind not in (1, 2):
            raise PageError(f"a Parquet footer with an unknown Thrift type {kind}")
        if at > size or len(stack) > 64:
            raise PageError("a Parquet footer cut short, or nested too deep")
        # the next value: a struct's next field, a list's next element, or the end of what is open
        while stack:
            top = stack[-1]
            if top == -1:
                head = view[at]
                at += 1
                if not head & 0x0F:  # the struct's stop
                    stack.pop()
                    continue
                if not head >> 4:  # a field id in full (zigzag i16)
                    while view[at] & 0x80:
                        at += 1
                    at += 1
                kind = head & 0x0F
                break
            if top >> 4:
                stack[-1] = top - 16
                kind = top & 0x0F
                break
            stack.pop()
        else:
            return at
