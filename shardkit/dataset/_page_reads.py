"""Reading the pages of a row group that hold given rows, not its column chunks whole (`Dataset.read_rows`).

shardkit's writer writes Parquet's page index (`_pages.ChecksumSink`): each column chunk's offset index
says where each of its data pages lies and the first row it holds. For rows of one row group, only the
pages that hold them are read (a column's dictionary page too), their checksums checked, and handed to
pyarrow as a small Parquet file of their own (`mini_file`): the file's footer with that row group alone,
its column chunks moved onto those pages and its row count set to the rows they hold. pyarrow decodes
those pages only, whatever their codec and encoding.

Each field is read from a file of its own pages, so that its pages need not start at the rows of another
field's. The leaves of one field (a list's values, a struct's members) must hold as many rows each: the
rows read are their pages' rows, grown until every leaf's pages hold the same rows (`covered_rows`). A
lookup of one row reads a page of each leaf (and the dictionary page where there is one). A field whose
pages holding asked rows are `DENSE` of its bytes or more is read as a row group is
(`Dataset.read_row_group`, or the caller's ``whole=``, which may keep it): reading its other pages too
costs less than copying most of them into a file of their own.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.dataset import _pages
from shardkit.dataset._dataset import SLICE_ROWS
from shardkit.dataset._pages import (
    _OFFSET_INDEX,
    PageError,
    _at,
    _field,
    _Thrift,
    _varint,
    crc32,
)
from shardkit.errors import ShardkitError, one_line

if TYPE_CHECKING:
    from shardkit.dataset._dataset import Dataset
    from shardkit.dataset.take import KeptRows

#: What of a footer a page read moves: the file's row count (3), its row groups (4) with their row count
#: (3), file offset (5) and compressed size (6), and each column chunk's file offset (2), its column
#: metadata's value count (5), sizes (6, 7) and page offsets (9, 11), and its offset index (4, 5).
_COLUMN_META = {5: None, 6: None, 7: None, 9: None, 10: None, 11: None}
_COLUMN_CHUNK = {2: None, 3: _COLUMN_META, 4: None, 5: None}
_ROW_GROUP = {1: _COLUMN_CHUNK, 3: None, 5: None, 6: None}
_FOOTER = {3: None, 4: _ROW_GROUP}

#: A page header's type (1), sizes (2: uncompressed, 3: compressed), checksum (4) and value count (of a
#: data page: 5.1, of a version 2 data page: 8.1)
_PAGE_HEADER = {1: None, 2: None, 3: None, 4: None, 5: {1: None}, 8: {1: None}}

#: Bytes of a remote file's gaps between pages read in one request, at most, per byte of its pages read:
#: fewer requests (the smallest gaps joined first), within the bytes the pages themselves take.
SPARE = 0.5

#: A field is read whole, not page by page, when the pages that hold the asked rows are this share of its
#: bytes or more (at most twice the bytes of its pages, in one read with no copy, kept by the caller
#: whole: no page of it is read or decoded again).
DENSE = 0.5

#: Pages of a remote file whose ranges lie this close are read in one request (the bytes between are read
#: and dropped): a request costs a round trip, 64 KiB a fraction of one.
GAP = 64 << 10


@dataclasses.dataclass(frozen=True)
class Footer:
    """A file's (or a summary's) footer, as bytes and as the fields a page read moves."""

    data: bytes
    fields: dict[int, Any]

    @classmethod
    def parse(cls, data: bytes) -> Footer:
        try:
            return cls(data, _Thrift(data, 0).struct(_FOOTER))  # type: ignore[arg-type]
        except (IndexError, ValueError) as e:
            raise PageError(f"a footer that cannot be read ({e})") from e

    def group(self, g: int) -> dict[int, Any]:
        return _field(self.fields, 4)[1][g]  # type: ignore[no-any-return]

    def offset_indexes(self, g: int, columns: Sequence[int]) -> dict[int, tuple[int, int]] | None:
        """Where the offset index of row group ``g``'s column chunk ``j`` lies, for each of ``columns``:
        j -> (offset, length); None when one of them has none (a file written without a page index)."""
        chunks = _field(self.group(g), 1)[1]
        found = {}
        for j in columns:
            chunk = chunks[j]
            offset, length = _field(chunk, 4, default=None), _field(chunk, 5, default=None)
            if offset is None or not length:
                return None
            found[j] = (offset, length)
        return found


@dataclasses.dataclass(frozen=True)
class ChunkPages:
    """A column chunk's pages, from its offset index and its metadata."""

    dictionary: tuple[int, int] | None  # (start, end) of its dictionary page, where it has one
    starts: np.ndarray  # each data page's start in the file (its header)
    sizes: np.ndarray  # each data page's bytes, header and body
    first_rows: np.ndarray  # the first row each data page holds (of the row group)

    def touched(self, rows: np.ndarray) -> np.ndarray:
        """Which data pages hold any of ``rows`` (a bool mask of the row group's rows): a page holds rows
        from its first to the next page's first (none, for a page of no values that pyarrow may write)."""
        counts = np.concatenate([[0], np.cumsum(rows)])
        ends = np.append(self.first_rows[1:], len(rows))
        touched: np.ndarray = counts[ends] > counts[self.first_rows]
        return touched


def chunk_pages(footer: Footer, g: int, j: int, index: bytes | memoryview) -> ChunkPages:
    """Row group ``g``'s column chunk ``j``: its offset index (the bytes ``index``) read, checked against
    the chunk's metadata."""
    chunk = _field(footer.group(g), 1)[1][j]
    column = _field(chunk, 3)
    data_at = _field(column, 9)
    dictionary_at = _field(column, 11, default=0)
    start = dictionary_at if 0 < dictionary_at < data_at else data_at
    end = start + _field(column, 7)
    try:
        locations = _field(_Thrift(index, 0).struct(_OFFSET_INDEX), 1)[1]  # type: ignore[arg-type]
    except (IndexError, ValueError) as e:
        raise PageError(f"an offset index that cannot be read ({e})") from e
    starts = np.array([_field(p, 1) for p in locations], dtype=np.int64)
    sizes = np.array([_field(p, 2) for p in locations], dtype=np.int64)
    first_rows = np.array([_field(p, 3) for p in locations], dtype=np.int64)
    if not len(starts) or starts[0] != data_at or starts[-1] + sizes[-1] != end or np.any(sizes <= 0) \
            or np.any(starts[1:] != starts[:-1] + sizes[:-1]) or first_rows[0] != 0 \
            or np.any(np.diff(first_rows) < 0):
        raise PageError(f"an offset index whose pages do not tile their column chunk ({start}-{end})")
    return ChunkPages((start, data_at) if start < data_at else None, starts, sizes, first_rows)


def covered_rows(chunks: Sequence[ChunkPages], num_rows: int, wanted: np.ndarray) -> np.ndarray:
    """The rows (a bool mask of the row group's ``num_rows``) that the pages holding ``wanted`` hold, grown
    until each chunk's pages hold exactly them: every chunk then reads the same rows."""
    rows = np.zeros(num_rows, dtype=bool)
    rows[wanted] = True
    while True:
        grown = rows.copy()
        for chunk in chunks:
            touched = chunk.touched(rows)
            ends = np.append(chunk.first_rows[1:], num_rows)
            for first, end in zip(chunk.first_rows[touched].tolist(), ends[touched].tolist(), strict=True):
                grown[first:end] = True
        if np.array_equal(grown, rows):
            return rows
        rows = grown


def selected_ranges(chunks: dict[int, ChunkPages], rows: np.ndarray) -> dict[int, list[tuple[int, int]]]:
    """Per column chunk, the (start, end) byte ranges to read for ``rows`` (`covered_rows`' mask): its
    dictionary page, where it has one, then each data page holding any of them."""
    out = {}
    for j, chunk in chunks.items():
        touched = np.flatnonzero(chunk.touched(rows))
        ranges = [chunk.dictionary] if chunk.dictionary is not None else []
        ranges += [(int(chunk.starts[k]), int(chunk.starts[k] + chunk.sizes[k])) for k in touched]
        out[j] = ranges
    return out


def coalesced(ranges: Sequence[tuple[int, int]], gap: int = GAP, spare: float = 0.0) -> list[tuple[int, int]]:
    """``ranges`` merged where they overlap or lie within ``gap`` bytes, sorted: the requests to make;
    then, smallest first, more of the gaps between them, while the bytes read in gaps stay within
    ``spare`` times the bytes of ``ranges`` (fewer requests, each a round trip, for a few more bytes)."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start - merged[-1][1] <= gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    budget = spare * sum(e - s for s, e in merged)
    gaps = sorted((merged[k + 1][0] - merged[k][1], k) for k in range(len(merged) - 1))
    joined = set()
    for size, k in gaps:
        if size > budget:
            break
        budget -= size
        joined.add(k)
    out: list[tuple[int, int]] = []
    for k, (start, end) in enumerate(merged):
        if k - 1 in joined:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


@dataclasses.dataclass
class Read:
    """A page's bytes checked: its header's values and whether its checksum matched (None: it has none)."""

    values: int
    uncompressed: int
    ok: bool | None


def check_page(page: bytes | memoryview) -> Read:
    """Read the header of ``page`` (a page's bytes, header and body) and check its body's checksum."""
    view = memoryview(page)
    reader = _Thrift(view, 0)
    try:
        header = reader.struct(_PAGE_HEADER)
    except (IndexError, ValueError) as e:
        raise PageError(f"a page header that cannot be read ({e})") from e
    kind, size = _field(header, 1), _field(header, 3)
    if reader.at + size != len(view):
        raise PageError(f"a page of {size} bytes where its offset index says {len(view) - reader.at}")
    crc = _field(header, 4, default=None)
    ok = None if crc is None else crc32(view[reader.at:]) == crc & 0xFFFFFFFF
    sub = _field(header, 5, default=None) or _field(header, 8, default=None)
    values = _field(sub, 1) if sub is not None and kind in (0, 3) else 0
    return Read(values, _field(header, 2) + reader.at, ok)


def mini_file(footer: Footer, g: int, pieces: dict[int, tuple[Any, list[Any], int, int]],
              num_rows: int) -> bytes:
    """A Parquet file of row group ``g``'s pages ``pieces`` (column chunk j -> its dictionary page's bytes
    (b"" without one), its data pages' bytes, their values, their uncompressed bytes with headers), which
    hold ``num_rows`` rows: ``footer`` with row group ``g`` alone, whose chunks ``pieces`` lie where they
    are put here (the other chunks keep their offsets: they are not read)."""
    body: list[Any] = [b"PAR1"]  # (joined once at the end: pages are MBs)
    at = 4
    placed: dict[int, tuple[int, int]] = {}
    for j, (dictionary, pages, _, _) in sorted(pieces.items()):
        start = at
        body.append(dictionary)
        at += len(dictionary)
        placed[j] = (start, at)
        body += pages
        at += sum(len(p) for p in pages)
    ints: list[tuple[tuple[int, int], int]] = []
    group = footer.group(g)
    fields = footer.fields
    if 3 in fields:
        ints.append((_at(fields, 3), num_rows))
    ints.append((_at(group, 3), num_rows))
    if 5 in group:
        ints.append((_at(group, 5), 4))
    if 6 in group:
        ints.append((_at(group, 6), at - 4))
    chunks = _field(group, 1)[1]
    for j, (start, data_at) in placed.items():
        chunk = chunks[j]
        column = _field(chunk, 3)
        dictionary, pages, values, uncompressed = pieces[j]
        end = data_at + sum(len(p) for p in pages)
        if 2 in chunk:
            ints.append((_at(chunk, 2), start))
        ints += [(_at(column, 5), values), (_at(column, 6), uncompressed), (_at(column, 7), end - start),
                 (_at(column, 9), data_at)]
        if 11 in column:
            ints.append((_at(column, 11), start if dictionary else 0))
        if 10 in column:
            ints.append((_at(column, 10), 0))
    edits = [(start, end, _zigzag(value)) for (start, end), value in ints]
    # the row groups' list: row group g alone
    list_start, list_end = fields[4][1]
    group_start, group_end = group[0][1]
    edits += [(list_start, group_start, bytes([0x1C])), (group_end, list_end, b"")]  # (one struct)
    data = footer.data
    out = bytearray()
    done = 0
    for start, end, replacement in sorted(edits):
        out += data[done:start]
        out += replacement
        done = end
    out += data[done:]
    return b"".join([*body, out, len(out).to_bytes(4, "little"), b"PAR1"])


def _zigzag(value: int) -> bytes:
    out = bytearray()
    _varint(out, (value << 1) ^ (value >> 63))
    return bytes(out)



def read_rows(ds: Dataset, i: int, columns: Sequence[str], wanted: np.ndarray, *,
              whole: Callable[[list[str]], pa.Table] | None = None,
              kept: KeptRows | None = None) -> tuple[pa.Table, int] | None:
    """Rows ``wanted`` (sorted, distinct positions in row group ``i`` of ``ds``) of ``columns``, in that
    order, and the pages read for them: only the pages that hold them, checked, each field's pages
    decoded by pyarrow from a `mini_file`; a field whose pages holding them are `DENSE` of its bytes or
    more, read whole by ``whole(fields)`` (all the row group's rows of those fields; None:
    `Dataset.read_row_group`). From a store, the ranges ``kept`` holds are not fetched, and those
    fetched are kept there (None: none). None where that cannot be done (the row group is then read
    whole): a table (its deletions and column mapping), columns read through ``schema=`` hints, a file
    without a page index.

    Raises:
        CorruptDatasetError: a page that fails its checksum, an offset index or a page that cannot be
            read (naming the row group and the column).
        DatasetChangedError: a remote file replaced since its footer was read.
    """
    if ds.snapshot is not None or ds.casts or not len(wanted):
        return None
    rg = ds.row_groups[i]
    path = ds.location.join(rg.file)
    where = f"row group {rg.index} of {path!r}"
    g = ds.row_group_index(i)
    try:
        footer, leaves = ds.page_footer(rg.file)
        by_field = {name: [j for j, leaf in enumerate(leaves) if leaf == name] for name in columns}
        if any(not js for js in by_field.values()):
            return None  # (a column the file does not hold: a partition key)
        found = footer.offset_indexes(g, [j for js in by_field.values() for j in js])
        if found is None:
            return None
        # the offset indexes of a row group lie together, after its file's last page: one request
        ranges = {j: [(offset, offset + length)] for j, (offset, length) in found.items()}
        indexes = {j: blobs[0] for j, blobs in _read(ds, rg.file, ranges, kept).items()}
        chunks = {j: chunk_pages(footer, g, j, index) for j, index in indexes.items()}
        if any(chunk.first_rows[-1] > rg.num_rows for chunk in chunks.values()):
            raise PageError(f"an offset index names rows past the row group's {rg.num_rows}")
        selected: dict[str, tuple[np.ndarray, dict[int, list[tuple[int, int]]]]] = {}
        dense = []  # fields whose pages holding asked rows are most of their bytes: read as a row group is
        for name, js in by_field.items():
            rows = covered_rows([chunks[j] for j in js], rg.num_rows, wanted)
            ranges = selected_ranges({j: chunks[j] for j in js}, rows)
            needed = sum(end - start for rs in ranges.values() for start, end in rs)
            total = sum(int(chunks[j].sizes.sum()) + _dictionary_bytes(chunks[j]) for j in js)
            if rows.all() or needed >= DENSE * total:
                dense.append(name)
            else:
                selected[name] = (rows, ranges)
        # every field's pages in one go (coalesced requests, concurrent on an object store)
        got = _read(ds, rg.file, {j: r for _, ranges in selected.values() for j, r in ranges.items()}, kept) \
            if selected else {}
        arrays: dict[str, pa.Array] = {}
        pages_read = 0
        if dense:
            table = ds.read_row_group(i, dense) if whole is None else whole(dense)
            taken = table.take(pa.array(wanted))
            arrays.update((name, taken.column(name).combine_chunks()) for name in dense)
            pages_read += sum(len(chunks[j].starts) + (chunks[j].dictionary is not None)
                              for name in dense for j in by_field[name])
        for name, (rows, ranges) in selected.items():
            pieces = {}
            for j, blobs in ((j, got[j]) for j in ranges):
                checked = [check_page(blob) for blob in blobs]
                for (start, _), read in zip(ranges[j], checked, strict=True):
                    if read.ok is False:
                        raise _pages.checksum_error(
                            where, f"column {name!r}: the page at byte {start} {_pages.MISMATCH}")
                pages_read += len(blobs)
                dictionary: Any = blobs[0] if chunks[j].dictionary is not None else b""
                data = blobs[1:] if chunks[j].dictionary is not None else blobs
                pieces[j] = (dictionary, data, sum(r.values for r in checked),
                             sum(r.uncompressed for r in checked))
            mini = mini_file(footer, g, pieces, int(rows.sum()))
            # (in slices, as a row group is read: the scratch buffers of a slice stay in the CPU caches)
            slices = pq.ParquetFile(pa.BufferReader(mini)).iter_batches(batch_size=SLICE_ROWS, columns=[name],
                                                                         use_threads=False)
            column = pa.chunked_array([b.column(0) for b in slices], ds.arrow_schema.field(name).type)
            arrays[name] = column.take(pa.array(np.cumsum(rows)[wanted] - 1)).combine_chunks()
    except PageError as e:
        if (changed := ds.changed(rg.file)) is not None:
            raise changed from e
        raise _pages.unreadable_error(where, str(e)) from e
    except (pa.ArrowInvalid, OSError) as e:
        if isinstance(e, ShardkitError):  # (ours, named already: a checksum, a permission, a request)
            raise
        if (changed := ds.changed(rg.file)) is not None:
            raise changed from e
        raise _pages.unreadable_error(where, one_line(e)) from e
    schema = pa.schema([ds.arrow_schema.field(n) for n in columns], metadata=ds.arrow_schema.metadata)
    return pa.Table.from_arrays([arrays[n] for n in columns], schema=schema), pages_read


def _dictionary_bytes(chunk: ChunkPages) -> int:
    return 0 if chunk.dictionary is None else chunk.dictionary[1] - chunk.dictionary[0]


def _read(ds: Dataset, file: str, ranges: dict[int, list[tuple[int, int]]],
          keep: KeptRows | None = None) -> dict[int, list[memoryview]]:
    """The bytes of each of ``ranges`` (per key, a list of (start, end)) of ``file``, read in `coalesced`
    requests (`Dataset.read_ranges`): views of what the requests read, not copies. From a store, the
    ranges ``keep`` holds are not fetched again, and those fetched are kept there."""
    wanted = [r for rs in ranges.values() for r in rs]
    local = ds.location.is_local
    # (a memory map is read in place: nothing to keep; a budget of 0 keeps nothing: no copy to make)
    store = keep if keep is not None and keep.budget > 0 and not local else None
    kept = {} if store is None else store.get_ranges(file, wanted)
    missing = [r for r in wanted if r not in kept]
    # (a memory map: no request to save; a store: fewer requests for at most half as many bytes more)
    requests = coalesced(missing, 0, 0.0) if local else coalesced(missing, GAP, SPARE)
    blobs = ds.read_ranges(file, requests) if requests else []
    starts = [s for s, _ in requests]
    views = [memoryview(blob).cast("B") for blob in blobs]  # (a pa.Buffer's items are signed chars)
    out: dict[int, list[memoryview]] = {}
    fetched: dict[tuple[int, int], bytes] = {}
    for key, rs in ranges.items():
        pieces = []
        for start, end in rs:
            if (start, end) in kept:
                pieces.append(memoryview(kept[(start, end)]))
                continue
            k = bisect.bisect_right(starts, start) - 1
            at = start - starts[k]
            piece = views[k][at:at + end - start]
            if len(piece) != end - start:
                raise PageError(f"bytes {start}-{end} of {file!r} are past its end")
            pieces.append(piece)
            if store is not None:
                fetched[(start, end)] = bytes(piece)  # (a copy: the request's gaps are not kept)
        out[key] = pieces
    if store is not None and fetched:
        store.put_ranges(file, fetched)
    return out
