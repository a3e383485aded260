"""The sources `shardkit.dataset.convert` reads: CSV, JSON-lines or Parquet files (a file, a folder or a glob
pattern's, Hive partitions included) through ``pyarrow.dataset``, or any dataset `open_dataset` opens, as
a stream of Arrow batches of the stored columns with the fields the source knows for them.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterator
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.dataset as pads
import pyarrow.json as pj
import pyarrow.parquet as pq

from shardkit.dataset.access import root_exists
from shardkit.dataset.codecs.scalar import arrow_scalar_type
from shardkit.dataset.convert_files import COMPRESSED, FORMATS, Files, is_pattern, listed, related, suffix
from shardkit.dataset.footers import read_footer
from shardkit.dataset.index import PETASTORM_KEY, Dataset, SummaryMissingWarning, open_location
from shardkit.dataset.location import COMMON, SUMMARY, Location
from shardkit.dataset.schema import SCHEMA_KEY, Field, field_from_arrow, schema_from_arrow
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
#: The UTC offset that ends an ISO time (after its date and "T" or " "), as pyarrow's parser takes it.
_OFFSET = r"[T ][0-9:.,]*(?P<offset>Z|[+-]\d\d(?::?\d\d)?)$"


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
    summary = not pattern and (loc.exists(SUMMARY) or loc.exists(COMMON))
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
    try:
        data = pads.dataset(paths, format=form, filesystem=loc.arrow_fs, **hive)
        fragments = list(data.get_fragments())
        if folder:
            related(loc.url, {f.path.removeprefix(root): f.physical_schema.names for f in fragments})
        schema, nulls, zones = _columns(loc, data, fragments, types, fmt)
        if schema != data.schema:
            data = pads.dataset(paths, format=form, filesystem=loc.arrow_fs, schema=schema, **hive)
            fragments = list(data.get_fragments())
    except (pa.ArrowException, OSError) as e:
        lines = " (JSON lines: an object per line, not a JSON array, which `jq -c '.[]'` rewrites)"
        none = (", or if it holds none (a schema, metadata), move it out of the folder or start its name "
                "with '_'")
        fix = TOO_LONG if "straddl" in str(e) else "check that it holds data, in the format its name says" + (
            lines if fmt == "json" else "") + (none if folder else "")
        raise NotADatasetError(f"cannot convert {loc.url!r}: it cannot be read as {fmt} ({e}); {fix}") from e

    # pre_buffer (pyarrow's default) keeps what it read of a file until the file is done: scanning the
    # ADAPTERS data's one 719 MB file (44 row groups) from copied reads peaked at 1.3 GB with it, 0.55 GB
    # without. (Local files are memory-mapped: their pages count in RSS as they are read, but are the
    # page cache's, not the process's.)
    scan = {"fragment_scan_options": pads.ParquetFragmentScanOptions(pre_buffer=False)} if fmt == "parquet" \
        else {}

    def batches(names: list[str] | None) -> Batches:
        strict, names, row = names is None, data.schema.names if names is None else names, 0
        for fragment in fragments:
            where, first = repr(fragment.path.removeprefix(root)) if folder else "", 0
            if fmt == "json":
                read = _json_batches(loc, data.schema, fragment, names, strict=strict, zones=zones)
            else:
                read = fragment.to_batches(schema=data.schema, columns=names, batch_size=_BATCH_ROWS,
                                           batch_readahead=1, fragment_readahead=1, **scan)
            try:
                for batch in read:
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


def _columns(loc: Location, data: pads.FileSystemDataset, fragments: list[pads.Fragment],
             types: dict[str, pa.DataType], fmt: str) -> tuple[pa.Schema, set[str], dict[str, list[str]]]:
    """The columns of all the files in order of appearance, then the partition keys; those that hold
    a null for sure: a column some file lacks, or that a file types ``null`` (a CSV's or JSON file's
    column of only nulls in its first block: so nullable where the other files' is not, though a file
    of no rows, a header, says so too), a key with a null folder or a file outside its folders; and the
    time zones of each column of times that carry one (read as UTC, whatever the zone: the instants are
    kept). A column's type is the one its files share or widen to (`_widened`), else the declared one
    (CSV, JSON: always; declared times without a zone read times with one in UTC); JSON also gets the
    declared scalar fields none of its files' first lines has."""
    keys = [pads.get_partition_keys(f.partition_expression) for f in fragments]
    parts = [f for f in data.schema if any(f.name in part for part in keys)]
    fields: dict[str, pa.DataType] = {}
    zones: dict[str, list[str]] = {}
    common: set[str] | None = None
    typed_null: set[str] = set()
    types = dict(types)
    for fragment in fragments:
        physical = fragment.physical_schema
        common = set(physical.names) if common is None else common & set(physical.names)
        typed_null |= {f.name for f in physical if pa.types.is_null(f.type)}
        for f in physical:
            t = f.type
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
    return schema.with_metadata(data.schema.metadata), nulls, zones


def _widened(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """The type both ``a`` and ``b`` cast to: pyarrow's permissive promotion (int32 and int64: int64, string
    and large_string: large_string), a dictionary as its values' type."""
    if a == b:
        return a
    a, b = (t.value_type if pa.types.is_dictionary(t) else t for t in (a, b))
    return a if a == b else pa.unify_schemas([pa.schema([("x", a)]), pa.schema([("x", b)])],
                                             promote_options="permissive").field(0).type


def _json_batches(loc: Location, schema: pa.Schema, fragment: pads.Fragment, names: list[str], *,
                  strict: bool, zones: dict[str, list[str]]) -> Iterator[pa.RecordBatch]:
    """A JSON-lines file's batches of ``names``, its partition keys' values added. Its times are parsed
    as text, then by `_json_times`: pyarrow's JSON parser turns a time's UTC offset into UTC silently
    (where its CSV parser types the column ``tz=UTC``); the offsets seen are added to ``zones``."""
    keys = pads.get_partition_keys(fragment.partition_expression)
    times = {f.name: f.type for f in schema if f.name not in keys and pa.types.is_timestamp(f.type)}
    parsed = pa.schema([pa.field(f.name, pa.string()) if f.name in times else f
                        for f in schema if f.name not in keys])
    options = pj.ParseOptions(explicit_schema=parsed,
                              unexpected_field_behavior="error" if strict else "ignore")
    with loc.arrow_fs.open_input_stream(fragment.path, compression="detect") as stream:
        for batch in pj.open_json(stream, pj.ReadOptions(block_size=BLOCK_BYTES), options):
            n, cols = batch.num_rows, []
            for name in names:
                if name in keys:
                    cols.append(pa.repeat(pa.scalar(keys[name], schema.field(name).type), n))
                elif name in times:
                    values, offsets = _json_times(batch.column(name), times[name])
                    cols.append(values)
                    if new := [z for z in offsets if z not in zones.get(name, [])]:
                        zones[name] = [*zones.get(name, []), *new]
                else:
                    cols.append(batch.column(name))
            yield pa.RecordBatch.from_arrays(cols, schema=pa.schema([schema.field(name) for name in names]))


def _json_times(text: pa.Array, t: pa.DataType) -> tuple[pa.Array, list[str]]:
    """ISO times as the timestamps ``t`` (no zone), as pyarrow's JSON parser reads them (those with a UTC
    offset as their UTC wall time, the others as they are), and the offsets they carry (``Z`` and
    ``+00:00`` as ``UTC``). Arrow's cast refuses an offset where ``t`` has no zone, and a time without
    one where it has: the two kinds are cast apart."""
    found = pc.extract_regex(text, _OFFSET)
    zoned, offsets = pc.is_valid(found), found.flatten()[0]  # (flatten: null where nothing matched)
    if not pc.any(zoned).as_py():
        return text.cast(t), []
    utc = pc.if_else(zoned, text, None).cast(pa.timestamp(t.unit, "UTC")).cast(t)
    values = pc.if_else(zoned, utc, pc.if_else(zoned, None, text).cast(t))
    return values, list(dict.fromkeys(_zone_name(o) for o in pc.unique(offsets.drop_null()).to_pylist()))


def _zone_name(offset: str) -> str:
    """A UTC offset as ``+HH:MM`` (``+02`` and ``+0200`` are ``+02:00``), ``UTC`` for ``Z`` and zero."""
    if offset == "Z" or not offset.strip("+-0:"):
        return "UTC"
    digits = offset[1:].replace(":", "")
    return f"{offset[0]}{digits[:2]}:{digits[2:] or '00'}"


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
