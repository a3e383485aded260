"""The sources `shardkit.dataset.convert` reads: CSV, JSON-lines or Parquet files (a file, a folder or a glob
pattern's, Hive partitions included) through ``pyarrow.dataset``, or any dataset `open_dataset` opens, as
a stream of Arrow batches of the stored columns with the fields the source knows for them.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Iterator
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.dataset as pads
import pyarrow.json as pj
import pyarrow.parquet as pq

from shardkit._storage.access import root_exists
from shardkit._storage.location import COMMON, SUMMARY, Location
from shardkit.dataset._dataset import Dataset
from shardkit.dataset._field import Field
from shardkit.dataset._footers import read_footer
from shardkit.dataset.codecs.scalar import arrow_scalar_type
from shardkit.dataset.convert._files import (
    COMPRESSED,
    FORMATS,
    Files,
    holding_rows,
    is_pattern,
    listed,
    related,
    suffix,
)
from shardkit.dataset.convert._integers import UINT64_MAX, integer_columns_each, rounds, to_floats
from shardkit.dataset.convert._json import json_batches
from shardkit.dataset.open import PETASTORM_KEY, SummaryMissingWarning, open_location
from shardkit.dataset.schema import SCHEMA_KEY, field_from_arrow, schema_from_arrow
from shardkit.errors import (
    ColumnsLeftOutWarning,
    DatasetNotFoundError,
    NotADatasetError,
    PartitionColumnsWarning,
    SchemaError,
    SchemaMismatchError,
)

__all__ = ["BLOCK_BYTES", "CSV_NULLS", "FORMATS", "READ_ERRORS", "TOO_LONG", "Batches", "Source",
           "open_source", "read_error"]

_BATCH_ROWS = 4096  # rows per batch read from files (datasets: a slice of `Dataset.iter_row_group`)
#: CSV and JSON bytes parsed at a time (pyarrow's default, 1 MiB, refuses a longer row: a JSON line with
#: a base64 image); the first block of a file also tells its columns and their types.
BLOCK_BYTES = 16 << 20
TOO_LONG = (f"a row is longer than the {BLOCK_BYTES >> 20} MiB blocks shardkit parses (by far): split it, or "
            "write the data as Parquet")
#: A CSV's null values: pyarrow's ("", NA, N/A, NULL, null, #N/A, ...) but its spellings of NaN (nan, NaN,
#: -nan, -NaN), which are a float's NaN, as pandas reads them (and Spark NaN), not nulls. (They are nulls
#: in no column: they make an integer column float, as in pandas, and a date or bool column text.)
CSV_NULLS = [v for v in pcsv.ConvertOptions().null_values if v.lstrip("-").lower() != "nan"]
READ_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError)  # pyarrow's, reading data
#: A batch of stored columns, the file it was read from (its name quoted, as in messages; "" for the one
#: file the source names), and the row of that file it starts at.
Batches = Iterator[tuple[pa.RecordBatch, str, int]]
_NAN_VALUE = re.compile(r"invalid value '[-+]?nan'", re.IGNORECASE)  # a CSV's NaN in a column of no floats
#: An integer that pyarrow's CSV or JSON parser cannot put in a column's integer type: its type and value.
_INT_VALUE = re.compile(r"(?:conversion error to |convert JSON to )(u?int\d+)\W+(?:invalid value '|couldn't "
                        r"parse:)(-?[0-9]+)(?:'|$)")
_TO_INTEGER = re.compile(r"conversion error to u?int|convert JSON to u?int")  # (pyarrow's: CSV, JSON)
_EMPTY = re.compile(r"Empty CSV file|Empty JSON stream")  # pyarrow's, on a file of no rows (`holding_rows`)


@dataclasses.dataclass(frozen=True)
class Source:
    """What is converted: its columns, the field of each where the source has one (else its Arrow field,
    to infer one from), and a stream of its batches of the given columns (None: all; a JSON key that the
    first block of its file lacks then fails, where it is left out of named columns)."""

    url: str
    names: list[str]
    known: dict[str, Field]  # a shardkit or Petastorm schema's fields, a partition key's
    arrow: dict[str, pa.Field]
    batches: Callable[[list[str] | None], Batches]
    num_rows: int | None
    infer_nulls: frozenset[str] = frozenset()  # columns whose nullability is inferred (see `convert`)
    null_counts: dict[str, int] | None = None  # Parquet statistics' (a column they miss: its Arrow flag)
    nulls: frozenset[str] = frozenset()  # columns that hold a null for sure (see `_columns`)
    #: the time zones of each column of times that carry one (a CSV's times with offsets: "UTC"; a JSON
    #: file's: the offsets, "+02:00", added as its batches are read); the batches hold them as UTC wall
    #: times, as ``arrow`` types them (datetime64 has no zone)
    zones: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    roots: tuple[str, ...] = ()  # what it reads: the file or folder, or what its glob pattern matched

    def field(self, name: str) -> Field | None:
        """The field of the stored column ``name``; None for an Arrow type no field maps (but declared)."""
        try:
            return self.known.get(name) or field_from_arrow(self.arrow[name])
        except SchemaError:
            return None


def open_source(loc: Location, declared: dict[str, Field]) -> Source:
    """The source at ``loc``: a dataset `open_dataset` opens, a file of the `FORMATS`, or the data files of
    a folder or of what a glob pattern matches (`listed`)."""
    pattern = False
    if not root_exists(loc):
        if not is_pattern(loc.root):
            raise DatasetNotFoundError(f"cannot convert {loc.url!r}: the path does not exist; check the path "
                                       "or URL")
        pattern = True
    elif loc.fs.isfile(loc.root):
        fmt = FORMATS.get(suffix(loc.root))
        if fmt is None:
            raise NotADatasetError(f"cannot convert {loc.url!r}: its name does not say a format shardkit "
                                   f"reads ({sorted(set(FORMATS))}, CSV and JSON also {list(COMPRESSED)}); "
                                   "rename it, or point at its folder if it is part of a dataset")
        return _files_source(loc, Files([loc.root], fmt, None, [loc.root]), declared)
    from shardkit.dataset.tables import detect

    # a Delta or Iceberg table converts at its current snapshot: its folder holds older snapshots' files
    summary = not pattern and (loc.exists(SUMMARY) or loc.exists(COMMON) or detect(loc) is not None)
    files = None if summary else listed(loc, pattern=pattern)
    if files is None:  # a dataset: its files are the ones its summary lists (else: no data, it says so)
        with warnings.catch_warnings():  # read once, all columns: no summary needed, nothing left out
            for warning in (SummaryMissingWarning, PartitionColumnsWarning, ColumnsLeftOutWarning):
                warnings.simplefilter("ignore", warning)
            try:
                ds = open_location(loc)
            except NotADatasetError as e:
                raise NotADatasetError(f"cannot convert {loc.url!r}: the folder holds no data files; point "
                                       f"at a dataset, or a file or folder of {sorted(set(FORMATS))} files"
                                       ) from e
        if ds.kind != "parquet":
            return _dataset_source(ds)
        files = Files([loc.join(name) for name in ds.files], "parquet", loc.root, [loc.root])
    return _files_source(loc, files, declared)


def read_error(url: str, row: int, e: Exception, *, where: str = "", file_row: int = 0
               ) -> SchemaMismatchError:
    """pyarrow's error ``e`` reading the source at ``url`` past its ``row`` (``where``: in that file, past
    its ``file_row``), with the fix."""
    fix = "fix the data, or declare the column's type in schema= (shardkit write --schema)"
    if "straddl" in str(e):  # pyarrow's "straddling object straddles two block boundaries"
        fix = TOO_LONG
    elif "unexpected field" in str(e):  # a JSON key that the first lines of its file lack
        fix = ("a line has a key that the file's first lines (its first block) lack: declare the key's field "
               "in schema= (shardkit write --schema) to keep it, or name the columns to write in columns= "
               "(--columns): the others are left out")
    elif m := _INT_VALUE.search(str(e)):  # (a later block's integer that the first block's type cannot hold)
        kinds = "uint64 or str" if m[1] == "int64" and 0 <= int(m[2]) <= UINT64_MAX else (
            "str (every digit kept as text; in JSON, written as strings) or float64 (rounded)")
        fix = (f"the column is {m[1]} (as its file's first rows, or the schema, say), which cannot hold "
               f"{m[2]}: declare it {kinds} in schema= (shardkit write --schema)")
    elif "changed from string to number" in str(e):  # a column declared str, in JSON
        fix = ("pyarrow reads no JSON number as text: declare the column a number type, or write its values "
               "as JSON strings")
    elif _NAN_VALUE.search(str(e)):
        fix = ("a CSV's nan or NaN is a float's NaN, not a null (as pandas reads it): declare the column a "
               "float in schema= (shardkit write --schema), or write its nulls as empty values (or NA, NULL)")
    place = f"{where} past its row {file_row} (source row {row})" if where else f"it past source row {row}"
    return SchemaMismatchError(f"{url!r}: cannot read {place} ({e}); {fix}")


def _dataset_source(ds: Dataset) -> Source:
    """A shardkit or Petastorm dataset, read as the reader reads it; Spark's partition folders of a
    Petastorm dataset become the Unischema's fields again (their values are in the folders' names)."""
    parts: dict[str, Field] = {}
    if ds.partition_keys and ds.kind == "petastorm":
        from shardkit.dataset.petastorm import petastorm_schema

        blob = (read_footer(ds.location, COMMON).metadata or {})[PETASTORM_KEY]
        unischema = {f.name: f for f in petastorm_schema(blob, where=ds.location.join(COMMON))}
        parts = {key: unischema[key] for key in ds.partition_keys if key in unischema}
    known = {**{f.name: f for f in ds.schema}, **parts}
    starts, rows = {}, dict.fromkeys(ds.files, 0)  # the row of its file each row group starts at
    for rg in sorted(ds.row_groups, key=lambda rg: (rg.file, rg.index)):
        starts[rg.file, rg.index], rows[rg.file] = rows[rg.file], rows[rg.file] + rg.num_rows

    def batches(names: list[str] | None) -> Batches:
        names = list(known) if names is None else names
        for i, rg in enumerate(ds.row_groups):
            row = starts[rg.file, rg.index]
            for stored in ds.iter_row_group(i, [n for n in names if n not in parts]):
                keys = {k: pa.array([_partition_value(rg.file, k)] * stored.num_rows, pa.string()).cast(
                    arrow_scalar_type(parts[k])) for k in names if k in parts}
                batch = pa.RecordBatch.from_arrays([*stored.columns, *keys.values()],
                                                   names=[*stored.schema.names, *keys])
                yield batch.select(names), repr(rg.file), row
                row += batch.num_rows

    return Source(ds.url, list(known), known, {}, batches, ds.num_rows, roots=(ds.location.root,))


def _partition_value(file: str, key: str) -> str | None:
    """The value of the partition ``key`` in the folders of ``file``; None in Hive's null folder."""
    value = next((p.split("=", 1)[1] for p in file.split("/")[:-1] if p.split("=", 1)[0] == key), None)
    return None if value in (None, "__HIVE_DEFAULT_PARTITION__") else unquote(value)


def _files_source(loc: Location, files: Files, declared: dict[str, Field]) -> Source:
    """Files read by pyarrow.dataset, with the columns of all of them (`_columns`); CSV and JSON parse the
    declared scalar fields as their type, CSV with `CSV_NULLS`. JSON is read by ``pyarrow.json.open_json``,
    which fails on a key its file's first block lacks (pyarrow.dataset would drop it)."""
    paths, fmt, folder = files.paths, files.fmt, files.base is not None
    root = (files.base or "").rstrip("/") + "/"
    hive = {"partitioning": "hive", "partition_base_dir": files.base} if folder else {}
    # newlines_in_values: a quoted value's newline is no row's end (else a block that ends in one fails)
    form = {"csv": pads.CsvFileFormat(pcsv.ParseOptions(newlines_in_values=True),
                                      convert_options=pcsv.ConvertOptions(null_values=CSV_NULLS),
                                      read_options=pcsv.ReadOptions(block_size=BLOCK_BYTES)),
            "json": pads.JsonFileFormat(read_options=pj.ReadOptions(block_size=BLOCK_BYTES))}.get(fmt, fmt)
    types = {n: t for n, f in declared.items()
             if f.codec.name == "scalar" and _parses(fmt, t := arrow_scalar_type(f))}
    header: bytes | None = None  # the one file is a CSV's header without a newline: read with one added

    def build(schema: pa.Schema | None = None) -> tuple[pads.Dataset, list[pads.Fragment]]:
        if header is not None:
            fragment = form.make_fragment(pa.py_buffer(header))
            data = pads.FileSystemDataset([fragment], schema or fragment.physical_schema, form)
        else:
            data = pads.dataset(paths, format=form, filesystem=loc.arrow_fs, schema=schema, **hive)
        return data, list(data.get_fragments())

    def place(i: int, row: int) -> str:  # the ``row`` of the ``i``-th file, as errors name it
        if not folder:
            return f"source row {row}"
        before = sum(f.count_rows() for f in fragments[:i])
        return f"row {row} of {fragments[i].path.removeprefix(root)!r} (source row {before + row})"

    try:
        try:
            data, fragments = build()
            for fragment in fragments:  # (each file's first block read here: pyarrow refuses some as empty)
                fragment.physical_schema  # noqa: B018
        except pa.ArrowInvalid as e:
            if not _EMPTY.search(str(e)):
                raise
            paths, header = holding_rows(loc, files, e)
            data, fragments = build()
        if not data.schema.names:
            raise NotADatasetError(f"cannot convert {loc.url!r}: it has no columns" + (
                " (every JSON object in it is {})" if fmt == "json" else "") + ", so there is nothing to "
                "write; point at data with columns (JSON lines: objects with keys, {\"id\": 1})")
        if folder:
            related(loc.url, {f.path.removeprefix(root): f.physical_schema.names for f in fragments})
        schema, nulls, zones, integers = _columns(loc, data, fragments, types, fmt, named=set(declared),
                                                    place=place)
        if schema != data.schema:
            data, fragments = build(schema)
    except (pa.ArrowException, OSError) as e:
        lines = " (JSON lines: an object per line, not a JSON array, which `jq -c '.[]'` rewrites)"
        none = (", or if it holds none (a schema, metadata), move it out of the folder or start its name "
                "with '_'")
        fix = TOO_LONG if "straddl" in str(e) else "check that it holds data, in the format its name says" + (
            lines if fmt == "json" else "") + (none if folder else "")
        raise NotADatasetError(f"cannot convert {loc.url!r}: it cannot be read as {fmt} ({e}); {fix}") from e

    # pre_buffer (pyarrow's default) keeps what it read of a file until the file is done: scanning a
    # large file from copied reads then holds far more memory with it than without. (Local files are
    # memory-mapped: their pages count in RSS as they are read, but are the page cache's, not the
    # process's.)
    scan = {"fragment_scan_options": pads.ParquetFragmentScanOptions(pre_buffer=False)} if fmt == "parquet" \
        else {}

    def read(fragment: pads.Fragment, names: list[str], strict: bool, schema: pa.Schema, skip: int = 0
             ) -> Iterator[pa.RecordBatch]:  # the file's batches past its first ``skip`` rows
        if fmt == "json":
            stream = json_batches(loc, schema, fragment, names, strict=strict, zones=zones,
                                  block_bytes=BLOCK_BYTES)
        else:
            stream = fragment.to_batches(schema=schema, columns=names, batch_size=_BATCH_ROWS,
                                         batch_readahead=1, fragment_readahead=1, **scan)
        for batch in stream:
            if batch.num_rows > skip:
                yield batch.slice(skip)
            skip = max(skip - batch.num_rows, 0)

    def batches(names: list[str] | None) -> Batches:
        strict, names, row = names is None, data.schema.names if names is None else names, 0
        for fragment in fragments:
            where, first = repr(fragment.path.removeprefix(root)) if folder else "", 0
            ints = integers.get(fragment.path, {})  # read as the file's integers, cast by `to_floats`
            schema = pa.schema([f.with_type(ints.get(f.name, f.type)) for f in data.schema],
                               metadata=data.schema.metadata) if ints else data.schema
            try:
                try:
                    for stored in read(fragment, names, strict, schema):
                        said = functools.partial(_said, where, first, row + first)
                        batch = to_floats(stored, data.schema, url=loc.url, fmt=fmt, place=said,
                                          declared=declared) if ints else stored
                        yield _zone_free(batch), where, first
                        first += batch.num_rows
                except READ_ERRORS as e:  # a CSV's or JSON file's fraction past the integers its type says:
                    if not ints or not _TO_INTEGER.search(str(e)):  # a float column, read as the others'
                        raise
                    for batch in read(fragment, names, strict, data.schema, skip=first):
                        yield _zone_free(batch), where, first
                        first += batch.num_rows
            except READ_ERRORS as e:
                raise read_error(loc.url, row + first, e, where=where, file_row=first) from e
            row += first

    own = SCHEMA_KEY in (data.schema.metadata or {})  # a part file of a shardkit dataset: its fields
    known = {f.name: f for f in schema_from_arrow(data.schema)} if own else {}
    arrow = {f.name: pa.field(f.name, pa.timestamp(f.type.unit), f.nullable) if f.name in zones else f
             for f in data.schema if f.name not in known}
    parquet = fmt == "parquet"
    counts = _null_counts([f.metadata for f in fragments], list(arrow)) if parquet else None
    return Source(loc.url, data.schema.names, known, arrow, batches, data.count_rows() if parquet else None,
                  frozenset(arrow), counts, frozenset(nulls), zones, tuple(files.roots))


def _said(where: str, first: int, row: int, i: int) -> str:
    """How errors name row ``i`` of a batch at row ``first`` of a folder's file ``where``, source ``row``."""
    return f"row {first + i} of {where} (source row {row + i})"


def _zone_free(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with its times that carry a time zone as UTC wall times (`Source.zones`)."""
    if not any(pa.types.is_timestamp(t) and t.tz is not None for t in batch.schema.types):
        return batch
    columns = [c.cast(pa.timestamp(c.type.unit)) if pa.types.is_timestamp(c.type) and c.type.tz is not None
               else c for c in batch.columns]
    return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)


def _parses(fmt: str, t: pa.DataType) -> bool:
    """Whether pyarrow's CSV or JSON reader parses values as ``t`` (else they are parsed as it infers, and
    the field's codec converts them): neither parses float16, nor JSON durations."""
    return fmt == "parquet" or not (pa.types.is_float16(t) or (fmt == "json" and pa.types.is_duration(t)))


def _columns(loc: Location, data: pads.Dataset, fragments: list[pads.Fragment], types: dict[str, pa.DataType],
             fmt: str, *, named: set[str], place: Callable[[int, int], str]
             ) -> tuple[pa.Schema, set[str], dict[str, list[str]], dict[str, dict[str, pa.DataType]]]:
    """The columns of all the files in order of appearance, then the partition keys; those that hold
    a null for sure: a column some file lacks, or that a file types ``null`` (a CSV's or JSON file's
    column of only nulls in its first block: so nullable where the other files' is not, though a file
    of no rows, a header, says so too), a key with a null folder or a file outside its folders; the
    time zones of each column of times that carry one (read as UTC, whatever the zone: the instants are
    kept); and of each file, its integer columns that the others widen to floats (read as integers and
    cast by `to_floats`, which refuses one that would lose digits, but declared: a CSV would parse them as
    float64 at once, and Parquet's cast fail in Arrow's words).

    A column's type is the one its files share or widen to (`_widened`), else the declared one (CSV,
    JSON: always; declared times without a zone read times with one in UTC); JSON also gets the declared
    scalar fields none of its files' first lines has. A CSV's or JSON file's column of integers past
    int64, which pyarrow types float64, is uint64 where they fit, else refused (`integer_columns`; the
    columns ``named`` in the schema are as declared), and int64 in other files widens to it."""
    keys = [pads.get_partition_keys(f.partition_expression) for f in fragments]
    parts = [f for f in data.schema if any(f.name in part for part in keys)]
    fields: dict[str, pa.DataType] = {}
    zones: dict[str, list[str]] = {}
    common: set[str] | None = None
    typed_null: set[str] = set()
    types = dict(types)
    read: list[dict[str, pa.DataType]] = []  # each file's type of each column
    floats = [(f.path, [c.name for c in f.physical_schema if pa.types.is_float64(c.type)
                        and c.name not in named] if fmt != "parquet" else []) for f in fragments]
    found = integer_columns_each(loc, floats, fmt, block_bytes=BLOCK_BYTES, csv_nulls=CSV_NULLS, place=place)
    for fragment, ints in zip(fragments, found, strict=True):
        physical = fragment.physical_schema
        common = set(physical.names) if common is None else common & set(physical.names)
        typed_null |= {f.name for f in physical if pa.types.is_null(f.type)}
        read.append({})
        for f in physical:
            t = read[-1][f.name] = ints.get(f.name, f.type)
            if pa.types.is_timestamp(t) and t.tz is not None:
                seen = zones.setdefault(f.name, [])
                seen += [t.tz] if t.tz not in seen else []
                t = pa.timestamp(t.unit, "UTC")
                declared = types.get(f.name)
                if declared is not None and pa.types.is_timestamp(declared) and declared.tz is None:
                    types[f.name] = pa.timestamp(declared.unit, "UTC")  # (a CSV's parser refuses offsets)
            before = fields.get(f.name, t)
            if f.name in types and (fmt != "parquet" or before != t):
                fields[f.name] = types[f.name]
            elif fmt != "parquet" and pa.uint64() in (before, t) and pa.int64() in (before, t):
                fields[f.name] = pa.uint64()  # (int64 would refuse the values past it: see `integer_columns`)
            else:
                try:
                    fields[f.name] = _widened(before, t)
                except pa.ArrowException as e:
                    raise SchemaMismatchError(
                        f"cannot convert {loc.url!r}: column {f.name!r} of {fragment.path!r} is {f.type}, "
                        f"but {before} in the files before it; declare its type in schema= (shardkit "
                        "write --schema), or convert these files apart") from e
    if fmt == "json":
        fields.update({n: t for n, t in types.items() if n not in fields and n not in data.schema.names})
    nulls = (set(fields) - (common or set())) | typed_null | {
        k for part in keys for k, v in part.items() if v is None} | {
        f.name for f in parts if any(f.name not in part for part in keys)}  # a file outside the key's folders
    schema = pa.schema([*(pa.field(n, t) for n, t in fields.items()),
                        *(pa.field(f.name, types.get(f.name, f.type)) for f in parts)])
    zones = {n: z for n, z in zones.items() if pa.types.is_timestamp(schema.field(n).type)}  # (else text)
    integers = {f.path: ints for f, own in zip(fragments, read, strict=True) if (ints := {
        n: t for n, t in own.items() if rounds(t, fields[n])})}
    return schema.with_metadata(data.schema.metadata), nulls, zones, integers


def _widened(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """The type both ``a`` and ``b`` cast to: pyarrow's permissive promotion (int32 and int64: int64, string
    and large_string: large_string), a dictionary as its values' type."""
    if a == b:
        return a
    a, b = (t.value_type if pa.types.is_dictionary(t) else t for t in (a, b))
    return a if a == b else pa.unify_schemas([pa.schema([("x", a)]), pa.schema([("x", b)])],
                                             promote_options="permissive").field(0).type


def _null_counts(footers: list[pq.FileMetaData], names: list[str]) -> dict[str, int]:
    """Nulls of each column in every row group's statistics; left out where they do not tell: a chunk
    without them, or a list's leaf that counts some (null rows, but also empty lists and null items)."""
    counts = dict.fromkeys(names, 0)
    unknown: set[str] = set()
    for md in footers:
        for chunk in (md.row_group(i).column(j) for i in range(md.num_row_groups)
                      if md.row_group(i).num_rows for j in range(md.num_columns)):
            stats, path = chunk.statistics, chunk.path_in_schema
            top = path.split(".")[0]
            if stats is None or not stats.has_null_count or (stats.null_count and "." in path):
                unknown.add(top)
            else:
                counts[top] = counts.get(top, 0) + stats.null_count
    return {name: n for name, n in counts.items() if name not in unknown}
