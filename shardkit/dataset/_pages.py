"""The pages of a Parquet column chunk, walked from their headers, and their page checksums checked.

Parquet gives every page an optional CRC-32 of its bytes as stored (compressed; a v2 page's levels
included) in its Thrift header. shardkit writes one on every page (`shardkit.dataset.write`), and the
reader has pyarrow verify them (`shardkit.dataset._dataset.VERIFY_PAGE_CHECKSUMS`). This module reads the
headers itself (Thrift's compact protocol, the few fields needed) so that a scrub can say more than
pyarrow does: which column and page of which row group is damaged, and which pages carry no checksum
to check (files written by other tools, or by shardkit before it wrote them).

Example:
    >>> report = check_chunk(chunk_bytes, offset=4)      # the bytes of one column chunk
    >>> report.pages, report.unchecked, report.problems
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow.parquet as pq

__all__ = ["MISMATCH", "ChunkReport", "Page", "PageError", "check_chunk", "check_row_group", "chunk_range",
           "crc32", "first_page", "plain_values", "ranges_of", "walk_pages"]

def _fastest_crc32() -> Callable[[Any], int]:
    """ISA-L's CRC-32 (``isal``, a dependency: much faster, with PCLMUL), else zlib's (as fast as
    pyarrow's own): the same checksum, Parquet's (IEEE 802.3)."""
    try:
        from isal import isal_zlib
    except ImportError:  # a platform without isal's wheels
        return zlib.crc32
    return isal_zlib.crc32


crc32 = _fastest_crc32()

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
    at = 0
    while at < len(view):
        reader = _Compact(view, at)
        try:
            kind, size, crc = reader.page_header()
        except (IndexError, ValueError) as e:
            raise PageError(f"the page header at byte {offset + at} cannot be read ({e})") from e
        body = reader.at
        if size < 0 or body + size > len(view):
            raise PageError(f"the page at byte {offset + at} claims {size} bytes, past the end of its "
                            f"column chunk ({len(view) - body} bytes left)")
        ok = None if crc is None else (crc32(view[body:body + size]) == crc & 0xFFFFFFFF)
        yield Page(offset + at, PAGE_KINDS.get(kind, f"page of type {kind}"), size, crc, ok)
        at = body + size


def plain_values(data: bytes | memoryview, offset: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Where each value of a column chunk's bytes ``data`` (which start at ``offset`` in the file) starts
    in the file, and its length: a flat BYTE_ARRAY column stored as it is (required, PLAIN,
    uncompressed, no dictionary), whose data pages hold nothing but ``u32 length | bytes`` per value.
    Every page's checksum is checked on the way (`crc32`); a mismatch raises `PageError` with
    `MISMATCH` in its message. None when the pages are not laid out so (a dictionary page, levels,
    another encoding): the values must then be read through Parquet.
    """
    view = memoryview(data)
    starts: list[int] = []
    lengths: list[int] = []
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
        if crc is not None and crc32(view[body:end]) != crc & 0xFFFFFFFF:
            raise PageError(f"the page at byte {offset + at} {MISMATCH}")
        p = body
        while p < end:
            if p + 4 > end:
                return None
            n = int.from_bytes(view[p : p + 4], "little")
            starts.append(offset + p + 4)
            lengths.append(n)
            p += 4 + n
        if p != end:  # a value runs past its page: not plain values
            return None
        at = end
    return np.asarray(starts, np.int64), np.asarray(lengths, np.int64)


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
    """Walk a column chunk's pages and check each checksum; problems are named by page and byte."""
    report = ChunkReport()
    try:
        for page in walk_pages(data, offset):
            report.pages += 1
            if page.ok is None:
                report.unchecked += 1
            elif not page.ok:
                report.problems.append(f"the {page.kind} at byte {page.offset} {MISMATCH}")
    except PageError as e:
        report.problems.append(str(e))
    return report


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
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
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
        if kind == 3:
            self.at += 1
        elif kind in (4, 5, 6):
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
