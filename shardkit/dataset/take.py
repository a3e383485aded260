"""Random access: an opened dataset's rows by their global index (`take`, `RowAccess`).

A row's global index is its place in the dataset's order: row groups in the order of
``Dataset.row_groups`` (the summary's, or the files' in order), rows in order within each, counting only
the rows the dataset holds (a table's rows deleted by its log, Delta's deletion vectors or Iceberg's
position deletes, are not counted, exactly as ``Dataset.iter_row_group`` leaves them out). Index ``i``
of a dataset is row ``i`` of an unshuffled read of it on one shard (``make_reader(url, shuffle=False)``).
Indices follow Python's rules: ``-1`` is the last row, ``-len`` the first, anything else out of range
raises `RowIndexError`; a boolean mask of one value per row and a slice select rows too.

What a lookup reads. The indices are grouped by row group. A column stored as it is (uncompressed PLAIN
values, no levels: images and other binary that compression would not shrink, as shardkit writes them)
is read in place: only the asked rows' bytes are copied from the file's memory map, after the checksums
of the pages that hold them are checked (each page once per `RowAccess`; where its values lie is found
from the page headers and kept, a few int64 per row). The other columns are read a page at a time: only
the pages that hold the asked rows (Parquet's offset index, which shardkit's writer writes), from a
local file or in range requests to an object store, checked and decoded (`Dataset.read_rows`); only the
asked rows are decoded (an image is decoded for its own row, not its row group's).

What is kept for the next lookups (`KeptRows`, up to ``cache_bytes``, the least recently used dropped
first). A column whose pages holding the asked rows are half its bytes or more (`_page_reads.DENSE`)
is read whole (``Dataset.read_row_group``: its page checksums checked) and kept, as Arrow, not decoded;
so is a row group of a local dataset asked again after a lookup read its pages, while it fits beside
what is kept. From an object store, where bytes cost requests and egress, the pages and offset indexes
fetched are kept instead, and a lookup fetches only what is not kept. Lookups answered from what is
kept read nothing: a map-style loader that asks for the rows of one row group one by one reads it once,
and random 256-row batches over a dataset that fits read it once. An opened dataset's ``take`` and
``ds[i]`` share one `KeptRows` (``Dataset.lookups``, `ROWS_KEPT` bytes; ``ds.lookups.budget = 0``
keeps nothing). A table (its deletions and casts) and a file without a page index are read a row group
at a time (noted once on the ``shardkit.dataset`` logger).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from shardkit.dataset._field import Field
from shardkit.dataset.schema import Schema
from shardkit.errors import ReaderError, RowIndexError, RowIndexTypeError

if TYPE_CHECKING:
    from shardkit.dataset._dataset import Dataset

__all__ = ["CACHE_BYTES", "KeptRows", "RowAccess", "check_columns", "encoded_schema", "raw_fields",
           "row_positions", "sample_of", "take"]

#: Arrow bytes of row groups a `RowAccess` keeps (least recently used dropped first): enough for a few
#: row groups of images, so that consecutive lookups in one row group read it once.
CACHE_BYTES = 256 << 20

#: row groups of a remote dataset one lookup reads at once (each waits on its requests' round trips)
CONCURRENT_GROUPS = 8

#: row groups a `KeptRows` remembers as read in pages (forgotten all at once past this)
PAGED_KEPT = 1 << 16

#: row groups' layouts of the values read in place (`Dataset.value_pages`) a `RowAccess` keeps: a few
#: arrays of one int64 per row each
LAYOUTS_KEPT = 4096

Columns = dict[str, Any]


def take(dataset: Dataset, indices: Any, columns: Sequence[str] | None = None, *,
         decode: bool | Mapping[str, bool] = True) -> Columns:
    """The rows ``indices`` of ``dataset``, decoded as a reader's batch holds them.

    Example:
        >>> ds = shardkit.open_dataset(url)
        >>> batch = take(ds, [5, 0, -1, 5], columns=["image", "label"])
        >>> batch["label"].shape
        (4,)

    Args:
        dataset: an opened dataset (`shardkit.open_dataset`).
        indices: global row indices (a sequence, a numpy or torch array of integers, an integer; in any
            order, repeats allowed; negative ones count from the end), a boolean mask with one value per
            row, or a slice.
        columns: the fields to read (None: all of them).
        decode: as a reader's ``decode=``: False leaves every image field encoded (its JPEG/PNG bytes,
            for a decoder elsewhere), ``{"image": False}`` the fields named.

    Returns:
        field name -> the rows' values in the order of ``indices``: what a reader's batch of those rows
        holds (numpy arrays, masked arrays for nullable numbers, object arrays for text, bytes and
        variable shapes). An integer gives a batch of one row (`RowAccess.row` gives the row itself).

    Raises:
        RowIndexError: an index out of range, a mask of another length than the dataset's rows.
        RowIndexTypeError: an index that is no integer (a float, a bool, a string).
        ReaderError: a column that is not a field of the dataset.
        CorruptDatasetError: a row group that cannot be read (its checksums fail, its file is truncated).
    """
    return RowAccess(dataset, columns, decode=decode, kept=dataset.lookups).take(indices)


class KeptRows:
    """What lookups of one dataset keep for the next ones: row groups' columns read whole (Arrow arrays,
    not decoded) and the pages and offset indexes fetched from a store (their bytes, checked again at
    each use), the least recently used dropped past ``budget`` bytes; the row groups whose pages a lookup
    read (a second lookup there reads the row group whole, where it fits beside what is kept); the
    layouts of the values read in place with their pages checked (each page checked once). Thread-safe.

    Args:
        budget: bytes kept at most, of arrays and fetched ranges together (0: none kept; the layouts
            are kept still).
    """

    def __init__(self, budget: int) -> None:
        self.budget = int(budget)
        self.nbytes = 0
        # (g, column) -> its array; (file, start, end) -> bytes fetched
        self._arrays: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._paged: set[int] = set()  # row groups a lookup read in pages
        self.layouts: OrderedDict[tuple[int, str], Any] = OrderedDict()  # (g, column) -> layout or None
        self.lock = threading.Lock()

    def get(self, g: int, columns: Sequence[str]) -> dict[str, pa.Array]:
        """Those of row group ``g``'s ``columns`` that are kept (all its rows)."""
        found = {}
        with self.lock:
            for name in columns:
                array = self._arrays.get((g, name))
                if array is not None:
                    self._arrays.move_to_end((g, name))
                    found[name] = array
        return found

    def put(self, g: int, table: pa.Table) -> None:
        """Keep row group ``g``'s columns ``table`` (all its rows; a column larger than the budget is not
        kept), dropping the least recently used past the budget."""
        if self.budget <= 0:
            return
        with self.lock:
            for name, column in zip(table.column_names, table.columns, strict=True):
                # (a table `_row_group` combined already: its one chunk, not a second copy of it)
                self._keep((g, name), column.chunk(0) if column.num_chunks == 1 else column.combine_chunks())

    def get_ranges(self, file: str, ranges: Sequence[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
        """Those of ``ranges`` (start, end) of remote data file ``file`` that are kept."""
        found = {}
        with self.lock:
            for start, end in ranges:
                blob = self._arrays.get((file, start, end))
                if blob is not None:
                    self._arrays.move_to_end((file, start, end))
                    found[(start, end)] = blob
        return found

    def put_ranges(self, file: str, blobs: Mapping[tuple[int, int], bytes]) -> None:
        """Keep the bytes fetched of ranges (start, end) of remote data file ``file``."""
        if self.budget <= 0:
            return
        with self.lock:
            for (start, end), blob in blobs.items():
                self._keep((file, start, end), blob)

    def _keep(self, key: tuple[Any, ...], value: Any) -> None:
        size = _size(value)
        if size > self.budget or key in self._arrays:
            return
        self._arrays[key] = value
        self.nbytes += size
        while self.nbytes > self.budget:
            _, dropped = self._arrays.popitem(last=False)
            self.nbytes -= _size(dropped)

    def again(self, g: int, nbytes: int) -> bool:
        """Whether a lookup read row group ``g``'s pages before and ``nbytes`` more fit beside what is
        kept (then it is read whole now); else it is marked as read in pages."""
        with self.lock:
            if g in self._paged and self.nbytes + nbytes <= self.budget:
                return True
            if len(self._paged) >= PAGED_KEPT:
                self._paged.clear()
            self._paged.add(g)
            return False


class RowAccess:
    """Lookups of rows by global index in one dataset, keeping the row groups read (Arrow) for the next.

    Example:
        >>> rows = RowAccess(shardkit.open_dataset(url), columns=["image", "label"])
        >>> batch = rows.take([10, 11, 12])   # one read of the row group that holds them
        >>> sample = rows.row(13)             # from the row group kept: no read
        >>> len(rows)                         # the dataset's rows

    Thread-safe: lookups from several threads share the kept row groups (two threads that miss the same
    row group at once may both read it). Not picklable (the dataset holds a lock and open files): a
    process makes its own, as ``shardkit.torch.MapDataset`` does in each DataLoader worker.

    Args:
        dataset: an opened dataset.
        columns: the fields every lookup reads (None: all of them).
        cache_bytes: Arrow bytes of row groups kept for the next lookups (0: none kept), where ``kept`` is
            not given.
        read: ``read(g, columns) -> pa.Table``, how row group ``g``'s columns are read (None: only the
            pages that hold the rows, `Dataset.read_rows`, or ``Dataset.read_row_group``);
            `shardkit.torch.MapDataset` reads through the reader's disk cache, whole row groups.
        decode: as `take`'s: image fields left encoded.
        kept: what is kept, shared with other lookups of the dataset (None: a `KeptRows` of its own).
    """

    def __init__(self, dataset: Dataset, columns: Sequence[str] | None = None, *,
                 cache_bytes: int = CACHE_BYTES,
                 read: Callable[[int, Sequence[str]], pa.Table] | None = None,
                 decode: bool | Mapping[str, bool] = True, kept: KeptRows | None = None) -> None:
        self.dataset = dataset
        self.read = read
        self.columns = check_columns(dataset, columns)
        #: image fields left encoded (``decode=``): their values are the stored JPEG/PNG bytes
        self.raw = raw_fields(decode, dataset.schema, self.columns)
        self.kept = KeptRows(cache_bytes) if kept is None else kept
        self._ends = np.cumsum(dataset.rows_per_group)  # row group g holds [ends[g-1], ends[g])
        self._lock = threading.Lock()
        #: the columns whose values are read in place, only the rows asked (images stored as they are)
        self.in_place = [c for c in self.columns if dataset.stored_as_is(c)]
        #: row groups read whole (of the columns not read in place), lookups of a row group answered from
        #: the kept ones, values read in place and the pages whose checksums those reads checked, reads of
        #: only the pages holding the rows (`Dataset.read_rows`) and the pages they read and checked
        self.stats = {"row_groups_read": 0, "row_groups_kept_hits": 0, "values_read_in_place": 0,
                      "pages_checked": 0, "page_reads": 0, "pages_read": 0}

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def take(self, indices: Any) -> Columns:
        """The rows ``indices`` (see `take`), decoded, in the order given."""
        positions = row_positions(indices, len(self), self.dataset.url)
        table = self._arrow_rows(positions)
        if not self.raw:
            return self.dataset.decode(table)
        decoded = self.dataset.decode(table.drop_columns(self.raw))
        return {name: _as_bytes(table.column(name)) if name in self.raw else decoded[name]
                for name in self.columns}

    def row(self, index: Any) -> dict[str, Any]:
        """Row ``index`` (an integer; negative: from the end) as one sample: field -> its value (a numpy
        scalar or array, a str or bytes, None for a null), as a reader's transform gets a sample."""
        if isinstance(index, bool | np.bool_) or not isinstance(index, int | np.integer):
            raise RowIndexTypeError(
                f"row index {index!r} ({type(index).__name__}) of dataset {self.dataset.url!r} is not an "
                "integer; pass an int (negative: from the end), or take(indices) for several rows")
        return sample_of(self.take(index), 0)

    def _arrow_rows(self, positions: np.ndarray) -> pa.Table:
        """The Arrow rows at ``positions`` (non-negative, in range), in that order."""
        if not len(positions):
            return self.dataset.table_of([], self.columns)
        groups = np.searchsorted(self._ends, positions, side="right")
        order = np.argsort(groups, kind="stable")
        bounds = np.flatnonzero(np.diff(groups[order])) + 1
        asks: list[tuple[int, np.ndarray]] = []
        where = np.empty(len(positions), dtype=np.int64)  # each asked row's place among the pieces' rows
        placed = 0
        for chosen in np.split(order, bounds):
            g = int(groups[chosen[0]])
            start = int(self._ends[g - 1]) if g else 0
            wanted, back = np.unique(positions[chosen] - start, return_inverse=True)
            asks.append((g, wanted))
            where[chosen] = placed + back
            placed += len(wanted)
        if len(asks) > 1 and not self.dataset.location.is_local:
            # a store's row groups at once: each waits on its round trips (offset indexes, then pages)
            with ThreadPoolExecutor(min(len(asks), CONCURRENT_GROUPS), "shardkit-take") as pool:
                pieces = list(pool.map(lambda ask: self._rows_of(*ask), asks))
        else:
            pieces = [self._rows_of(g, wanted) for g, wanted in asks]
        rows = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
        if len(where) == rows.num_rows and np.array_equal(where, np.arange(len(where))):
            return rows  # asked in the dataset's order, each once: no second take
        return rows.take(pa.array(where))

    def _rows_of(self, g: int, wanted: np.ndarray) -> pa.Table:
        """Rows ``wanted`` (sorted, distinct) of row group ``g``, Arrow, in ``self.columns``' order: the
        columns stored as they are read in place (only those rows' bytes, and the checksums of their
        pages), the others from the row group read whole (and kept)."""
        layouts = {name: self._layout(g, name) for name in self.in_place}
        in_place = {name: found for name, found in layouts.items() if found is not None}
        if not in_place:
            return self._others(g, self.columns, wanted)
        rest = [c for c in self.columns if c not in in_place]
        others = self._others(g, rest, wanted) if rest else None
        arrays, fields = [], []
        for name in self.columns:
            field = self.dataset.arrow_schema.field(name)
            if name in in_place:
                arrays.append(self._values(g, name, in_place[name], wanted, field.type))
            else:
                arrays.append(others.column(name))  # type: ignore[union-attr]
            fields.append(field)
        schema = pa.schema(fields, metadata=self.dataset.arrow_schema.metadata)
        return pa.Table.from_arrays(arrays, schema=schema)

    def _others(self, g: int, columns: list[str], wanted: np.ndarray) -> pa.Table:
        """Rows ``wanted`` of row group ``g``'s ``columns`` (not read in place): those kept from the
        kept; the others from the pages that hold them (`Dataset.read_rows`), or from the row group read
        whole (and kept): where ``read=`` is given, where the file has no page index, where a lookup read
        this row group's pages before, it is local and it fits beside what is kept (`KeptRows.again`)."""
        kept = self.kept.get(g, columns)
        index = pa.array(wanted)
        arrays = {name: array.take(index) for name, array in kept.items()}
        missing = [c for c in columns if c not in kept]
        if not missing:
            with self._lock:
                self.stats["row_groups_kept_hits"] += 1
        elif self.read is not None or (self.dataset.location.is_local
                                       and self.kept.again(g, self.dataset.row_groups[g].num_bytes)):
            table = self._row_group(g, missing).take(index)
            arrays.update(zip(missing, table.columns, strict=True))
        else:
            found = self.dataset.read_rows(g, missing, wanted, whole=lambda names: self._row_group(g, names),
                                           kept=self.kept)
            if found is None:
                self.dataset.note_once(
                    "whole chunks", f"random access to {self.dataset.url} reads whole column chunks: its "
                    "files have no page index (Parquet's offset index, which shardkit's writer writes), or "
                    "it is a table or read through schema= hints")
                table = self._row_group(g, missing).take(index)
            else:
                table, pages = found
                with self._lock:
                    self.stats["page_reads"] += 1
                    self.stats["pages_read"] += pages
            arrays.update(zip(missing, table.columns, strict=True))
        schema = pa.schema([self.dataset.arrow_schema.field(n) for n in columns],
                           metadata=self.dataset.arrow_schema.metadata)
        return pa.Table.from_arrays([arrays[n] for n in columns], schema=schema)

    def _layout(self, g: int, name: str) -> Any:
        """`Dataset.value_pages` of row group ``g``'s column ``name`` (kept for the next lookups)."""
        key, layouts = (g, name), self.kept.layouts
        with self.kept.lock:
            if key in layouts:
                layouts.move_to_end(key)
                return layouts[key]
        pages = self.dataset.value_pages(g, name)
        found = None if pages is None else (*pages, self.dataset.page_checks(g, name, pages[1]))
        with self.kept.lock:
            layouts[key] = found
            while len(layouts) > LAYOUTS_KEPT:
                layouts.popitem(last=False)
        return found

    def _values(self, g: int, name: str, found: tuple[str, Any, Any], wanted: np.ndarray,
                kind: pa.DataType) -> pa.Array:
        """Values ``wanted`` of a column stored as it is (``found``: `_layout`'s), copied from its file's
        memory map into one Arrow binary array, after the checksums of their pages not checked before are
        checked (a page is checked once per `RowAccess`, as a reader checks a row group's once)."""
        path, layout, checks = found
        starts, lengths = layout.starts[wanted], layout.lengths[wanted]
        self.stats["pages_checked"] += self.dataset.check_value_pages(g, path, checks, starts)
        offsets = np.zeros(len(wanted) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        data = np.empty(int(offsets[-1]), dtype=np.uint8)
        with self.dataset.mapped(g, path) as f:
            for k, (at, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
                data[offsets[k]:offsets[k] + n] = np.frombuffer(f.read_at(n, at), dtype=np.uint8)
        self.stats["values_read_in_place"] += len(wanted)
        large = pa.types.is_large_binary(kind) or pa.types.is_large_string(kind)
        if not large and offsets[-1] >= 1 << 31:
            kind = pa.large_binary()
            large = True
        offset_buffer = pa.py_buffer(offsets if large else offsets.astype(np.int32))
        return pa.Array.from_buffers(kind, len(wanted), [None, offset_buffer, pa.py_buffer(data)])

    def _row_group(self, g: int, columns: Sequence[str]) -> pa.Table:
        """Row group ``g``'s ``columns`` read whole (all its rows), kept (`KeptRows.put`)."""
        # one chunk per column: a take from a table of `SLICE_ROWS`-row chunks concatenates every chunk of
        # every column first, on each lookup; once here, a lookup gathers only its rows
        table = (self.dataset.read_row_group(g, columns) if self.read is None else self.read(g, columns)
                 ).combine_chunks()
        with self._lock:
            self.stats["row_groups_read"] += 1
        self.kept.put(g, table)
        return table


def _size(value: Any) -> int:
    return len(value) if isinstance(value, bytes) else int(value.nbytes)


def raw_fields(decode: Any, schema: Schema, columns: Sequence[str]) -> list[str]:
    """The fields a ``decode=`` argument leaves encoded (image fields among ``columns``), checked:
    True (none), False (every image field) or a dict of field -> bool."""
    if isinstance(decode, bool | np.bool_):
        return [] if decode else [c for c in columns if schema[c].codec.name == "image"]
    if not isinstance(decode, Mapping):
        raise ReaderError(f"decode={decode!r} must be True, False or a dict of field -> bool")
    out = []
    for name, flag in decode.items():
        if name not in columns:
            raise ReaderError(f"decode= names {name!r}, which is not a column read ({list(columns)})")
        if not isinstance(flag, bool | np.bool_):
            raise ReaderError(f"decode[{name!r}]={flag!r} must be True or False")
        if not flag:
            codec = schema[name].codec.name
            if codec != "image":
                raise ReaderError(
                    f"decode={{{name!r}: False}}: {name!r} is a {codec} field, and only image fields "
                    "(JPEG/PNG bytes) can be delivered encoded; leave it out of decode=")
            out.append(name)
    return out


def encoded_schema(schema: Schema, raw: Sequence[str]) -> Schema:
    """``schema`` with the fields ``raw`` (left encoded) as the bytes fields they are delivered as."""
    return Schema([Field(f.name, "bytes", nullable=f.nullable) if f.name in raw else f for f in schema])


def _as_bytes(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A binary column's values as a 1-D object array of `bytes` (None for a null), as a reader's
    ``decode=False`` gives an image field."""
    values = column.to_pylist()
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def check_columns(dataset: Dataset, columns: Sequence[str] | None) -> list[str]:
    """``columns`` (None: every field) checked against the dataset's fields, as a reader checks them."""
    names = list(dataset.schema.names)
    if columns is None:
        return names
    if isinstance(columns, str):
        raise ReaderError(f"columns={columns!r} is one string; pass a list of field names: "
                          f"columns=[{columns!r}] (the fields of {dataset.url!r} are {names})")
    asked = list(columns)
    unknown = [c for c in asked if c not in names]
    if unknown:
        why = {c: dataset.left_out[c] for c in unknown if c in dataset.left_out}
        extra = f" ({'; '.join(f'{c!r}: {w}' for c, w in why.items())})" if why else ""
        raise ReaderError(f"unknown column(s) {unknown!r} for {dataset.url!r}{extra}; its fields are {names}")
    twice = sorted({c for c in asked if asked.count(c) > 1})
    if twice:
        raise ReaderError(f"columns={asked!r} names {twice} more than once; name each field once")
    if not asked:
        raise ReaderError(f"columns=[] reads nothing of {dataset.url!r}; name at least one of its fields "
                          f"{names}, or pass None for all of them")
    return asked


def row_positions(indices: Any, num_rows: int, url: str) -> np.ndarray:
    """``indices`` (integers, negative from the end; a boolean mask of ``num_rows`` values; a slice) as
    non-negative int64 positions, in order; `RowIndexError` / `RowIndexTypeError` naming the bad one."""
    if isinstance(indices, slice):
        try:
            return np.arange(*indices.indices(num_rows), dtype=np.int64)
        except TypeError as e:
            raise RowIndexTypeError(f"slice {indices!r} of dataset {url!r} has a bound or step that is not "
                                    "an integer; use integers (or None) in a slice of rows") from e
    if isinstance(indices, bool | np.bool_):
        raise RowIndexTypeError(
            f"row index {indices!r} of dataset {url!r} is a bool, not a row number; pass an int, or a "
            f"boolean mask with one value per row (a sequence of {num_rows} bools)")
    if isinstance(indices, str | bytes | float | np.floating | dict | set) or indices is None:
        raise RowIndexTypeError(
            f"row index {indices!r} ({type(indices).__name__}) of dataset {url!r} is not an integer; pass "
            "an int, a sequence or array of ints (negative: from the end), a boolean mask or a slice")
    if hasattr(indices, "detach"):  # a torch tensor (on any device), without importing torch
        indices = indices.detach().cpu().numpy()
    try:
        arr = np.asarray(indices)
    except (ValueError, TypeError) as e:
        raise RowIndexTypeError(f"indices {_short(indices)} of dataset {url!r} are not a flat sequence of "
                                "integers (ragged or nested); pass a list or 1-d array of ints") from e
    scalar = arr.ndim == 0
    if scalar:
        if arr.dtype.kind not in "iu":
            raise RowIndexTypeError(f"row index {indices!r} ({type(indices).__name__}) of dataset {url!r} is "
                                    "not an integer; pass an int (negative: from the end)")
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise RowIndexTypeError(f"indices of shape {arr.shape} for dataset {url!r}: row indices are one "
                                "flat sequence; flatten them (np.ravel) and reshape the result")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "b":
        if len(arr) != num_rows:
            raise RowIndexError(
                f"a boolean mask of {len(arr)} values for dataset {url!r}, which has {num_rows} rows: a mask "
                f"holds one value per row; make it {num_rows} long, or pass the row numbers it selects "
                "(np.flatnonzero(mask))")
        return np.flatnonzero(arr).astype(np.int64)
    if arr.dtype.kind == "O" or (arr.dtype.kind in "iu" and isinstance(indices, list | tuple)
                                 and any(isinstance(v, bool | np.bool_) for v in indices)):
        for k, value in enumerate(indices if arr.dtype.kind != "O" else arr):
            if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
                raise RowIndexTypeError(
                    f"indices[{k}] = {value!r} ({type(value).__name__}) for dataset {url!r} is not an "
                    "integer; row indices are ints (negative: from the end)")
        arr = np.array([int(v) for v in arr], dtype=object)
    elif arr.dtype.kind not in "iu":
        k = int(np.flatnonzero(arr != np.trunc(arr))[0]) if arr.dtype.kind == "f" and \
            (arr != np.trunc(arr)).any() else 0
        raise RowIndexTypeError(
            f"indices[{k}] = {arr[k].item()!r} for dataset {url!r}: indices of dtype {arr.dtype} are not row "
            "numbers; pass ints (np.asarray(indices).astype(np.int64) if they hold whole numbers)")
    bad = (arr < -num_rows) | (arr >= num_rows)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        which = f"row index {int(arr[k])}" + ("" if scalar else f" (indices[{k}])")
        raise RowIndexError(
            f"{which} is out of range for dataset {url!r} of {num_rows} rows; indices run from 0 to "
            f"{num_rows - 1} (or -{num_rows} to -1 from the end)"
            if num_rows else f"{which}: dataset {url!r} has no rows")
    out = arr.astype(np.int64)
    return np.where(out < 0, out + num_rows, out)


def sample_of(batch: Columns, j: int) -> dict[str, Any]:
    """Row ``j`` of a decoded batch as one sample: field -> value (None for a null)."""
    out: dict[str, Any] = {}
    for name, column in batch.items():
        if isinstance(column, np.ma.MaskedArray):
            mask = np.ma.getmaskarray(column)[j]
            out[name] = None if np.all(mask) else column.data[j]
        else:
            out[name] = column[j]
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
