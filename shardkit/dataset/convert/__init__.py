"""`convert` (``shardkit write``): CSV, JSON-lines or Parquet files, or any dataset `open_dataset` opens
(Petastorm's included), streamed into a shardkit dataset by `write_dataset`; encoded images are copied.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardkit._storage.location import SUMMARY, Location
from shardkit.dataset._dataset import Dataset
from shardkit.dataset._field import Field
from shardkit.dataset.codecs.base import combine, first_null, is_bytes_type, null_error
from shardkit.dataset.codecs.image import copy_encoded
from shardkit.dataset.codecs.tensor import check_no_null_elements
from shardkit.dataset.convert._sources import FORMATS, READ_ERRORS, Batches, Source, open_source, read_error
from shardkit.dataset.open import open_location
from shardkit.dataset.schema import Schema, field_from_arrow
from shardkit.dataset.write import EncodedTables, Mode, write_dataset
from shardkit.errors import (
    NotADatasetError,
    SchemaError,
    SchemaMismatchError,
    TimeZoneWarning,
)

__all__ = ["FORMATS", "column", "convert", "load_schema"]

_ROW = re.compile(r"\brow (\d+)\b")  # a row that an error of a codec names: of the batch it was given


def convert(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    schema: Schema | Sequence[Field] | str | os.PathLike[str] | None = None,
    columns: Sequence[str] | None = None,
    mode: Mode = "error",
    row_group_size: int | str = "16MiB",
    file_size: int | str = "128MiB",
    compression: str = "auto",
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Dataset:
    """Write the data at ``source`` as a shardkit dataset at ``dest`` (atomically) and return it opened.

    Example:
        >>> convert("hdfs:///petastorm/train", "s3://bucket/train")       # a Petastorm dataset
        >>> convert("logs.csv.gz", "/data/logs", columns=["id", "text"], mode="overwrite")
        >>> convert("emb.parquet", "/data/emb", schema=[Field("vec", "float32", (128,))])
        >>> convert("exports/*/part-*.csv", "/data/exports")                # a glob pattern

    The source is read one row group or CSV/JSON block at a time, never whole: a ``.csv``, ``.json``,
    ``.jsonl``, ``.ndjson`` (JSON lines; both also ``.gz``, ``.bz2``, ``.zst``) or Parquet file, a folder
    of such files or those a glob pattern matches (Hive ``key=value`` folders, below its first wildcard,
    become columns, ``__HIVE_DEFAULT_PARTITION__`` nulls; the columns of all its files, null in a file
    that lacks one; files not in its data format, the one of most bytes, such as a README.txt, are left
    out and named in a `FilesLeftOutWarning`: `convert_files.listed`; files whose columns share none with
    the others', such as a ``schema.json`` among JSON data, are refused: `convert_files.related`; files
    that hold no rows, 0 bytes, only whitespace or a CSV's header without a newline, are left out quietly:
    `convert_files.holding_rows`), or a shardkit or Petastorm dataset. A
    Petastorm dataset's fields keep their names, dtypes, shapes and nullability;
    ``CompressedImageCodec`` PNG/JPEG bytes are copied as they are into an `ImageCodec` of their format
    (decoding and encoding a JPEG again would lose quality), scalar and list columns are copied, and
    what shardkit reads but does not write (``NdarrayCodec`` and ``CompressedNdarrayCodec`` bytes, 16-bit
    PNGs, text-as-bytes and decimals) is decoded and written with the tensor (fixed shape), ndarray
    (variable) or scalar codec; Spark's partition folders become the Unischema's column again.

    Undeclared columns are inferred as `write_dataset` infers Arrow data (images never), nullable where
    the source holds a null: as its shardkit or Petastorm schema says, else as Parquet statistics count,
    else as the first batch shows (a null further down a CSV fails the write, naming the field and the
    fix: declare it). A JSON file's keys are those of its first block (`BLOCK_BYTES`, as pyarrow reads
    it): one seen only further down fails the write unless declared, or left out of ``columns``.

    Integers keep every digit (`convert_integers`). A CSV or JSON column of integers with one past int64
    (18446744073709551615), which pyarrow types float64 (so that 9007199254740993 would become
    9007199254740992), is uint64 where every value fits, as pandas reads it; where no 64-bit integer
    type holds them all (a value past uint64, or negatives beside values past int64) the write is
    refused, naming the column, the first value that does not fit, its row and the fix: declare the
    field ``str`` (every digit kept as text; a JSON file's values written as strings, as pyarrow reads
    no JSON number as text) or ``float64`` (rounded). A column with a fraction or an exponent is a float
    column, as in pandas. A column's type is that of its file's first block: a value further down that
    it cannot hold fails, naming the type to declare (uint64, str). A file's integers in a column that
    other files make float are refused where the float would round one.

    The one file named that holds no data (0 bytes, only whitespace) is refused, as is a source with no
    columns (JSON lines of ``{}``, which would be written as a dataset of no fields); a CSV's header
    without a newline is read as one (``a,b`` as ``a,b\\n``).

    A CSV's ``nan``, ``NaN``, ``-nan``, ``-NaN`` are a float's NaN, as pandas reads them, not a null: a NaN
    written to a CSV is NaN again, its field need not be nullable (an integer column that holds one
    becomes float64, as in pandas; a declared type without NaN fails, naming the fix). Its other null
    spellings (`convert_sources.CSV_NULLS`: empty, NA, N/A, NULL, null, #N/A, ...) are nulls, but in text
    columns. Times with a time zone (``timestamp[us, tz=Europe/Berlin]`` in Parquet, ISO times with
    offsets in a CSV or JSON file) are written as UTC wall times without a zone, as shardkit stores
    Spark's: each instant is kept, and a `TimeZoneWarning` names the column and the zone (a CSV's: UTC,
    as pyarrow reads them; a JSON file's: the offsets, such as ``+02:00``, warned of again where one is
    first seen further down). A JSON column of times with and without offsets keeps the latter as they
    are. Errors name the source's rows, counted from 0 (a folder's or pattern's files in name order),
    and a folder's file and its row.

    Args:
        source, dest: a file, folder or glob pattern (``*``, ``?``, ``[...]``, ``**``: matched by
            fsspec, where no such path exists), and a folder (any fsspec URL; one ``storage_options``
            for both).
        schema: fields that declare what inference cannot know, each replacing the inferred field of its
            name: a list column that is a fixed tensor (``Field("vec", "float32", (128,))``), a bytes
            column of encoded images (``Field("img", "uint8", (64, 64, 3), codec=ImageCodec("png"))``:
            their headers are checked, the bytes copied), a CSV column that must stay text. A `Schema`,
            a list of fields or a JSON file of them (`load_schema`); on ``mode="append"`` the dataset's
            fields are the default of every field.
        columns: the source's columns to write, in this order (default: all; on ``mode="append"``, the
            dataset's fields in its order).
        mode, row_group_size, file_size, compression, progress: as for `write_dataset`.

    Raises:
        DatasetNotFoundError: nothing exists at ``source`` (a pattern: nothing matches it).
        NotADatasetError: ``source`` holds no data (no rows or no columns) or is not in a format above;
            ``dest`` is, holds or lies inside ``source`` (or what the pattern matched).
        SchemaMismatchError: a declared field or a column does not fit the data (the message says where),
            or integers that no 64-bit integer type holds would be rounded.
        SchemaError, DatasetExistsError, ...: as `write_dataset`; a failed write leaves ``dest`` as it was.
    """
    declared = {f.name: f for f in load_schema(schema)} if schema is not None else {}
    src_loc, dst_loc = Location.of(source, storage_options), Location.of(dest, storage_options)
    _check_apart(src_loc, [src_loc.root], dst_loc)
    appended = open_location(dst_loc).schema if mode == "append" and dst_loc.exists(SUMMARY) else None
    checks = [("the schema declares", list(declared), "rename or drop those fields")]
    if appended is not None:  # its fields, but those declared (which must then be the same)
        declared = {**{f.name: f for f in appended}, **declared}
        checks.append((f"the dataset appended to, {dst_loc.url!r}, has", appended.names,
                       "append data of its fields"))
    if columns is not None and (isinstance(columns, str) or not columns or len(set(columns)) < len(columns)):
        raise SchemaError(f"columns={columns!r} must be a list that names each column to write once (or be "
                          "left out: all of them)")
    src = open_source(src_loc, declared)
    _check_apart(src_loc, src.roots, dst_loc)  # (a glob pattern's: what it matched)
    names = list(columns) if columns is not None else src.names
    for what, asked, fix in [("columns=", names, "name columns it has"), *checks]:
        if absent := [n for n in asked if n not in src.names]:
            raise SchemaMismatchError(f"{what} {absent}, but {src.url!r} has no such column(s) (its columns: "
                                      f"{src.names}); {fix}")
    if appended is not None:  # written in the dataset's order, whatever the source's
        if extra := [n for n in names if n not in appended.names]:
            raise SchemaMismatchError(f"{src.url!r} has the column(s) {extra}, which the dataset appended "
                                      f"to, {dst_loc.url!r}, has not (its fields: {appended.names}); pick "
                                      "its fields with columns= (shardkit write --columns), or write a new "
                                      "dataset")
        if left := [n for n in appended.names if n not in names]:
            raise SchemaMismatchError(f"columns= leaves out {left}, fields of the dataset appended to, "
                                      f"{dst_loc.url!r}; an append writes all of its fields {appended.names}")
        names = appended.names
    batches = _guarded(src, src.batches(None if columns is None else names))
    first = next(batches, None)
    target = Schema([declared.get(n) or _inferred(src, n, first) for n in names])
    warned = {n: src.zones[n] for n in names if n in src.zones}
    for name, zones in warned.items():
        warnings.warn(_zone_warning(src.url, target[name], zones), stacklevel=2)
    rest = _zones_warned(src, target, batches, warned)  # (a JSON file's: seen as they are parsed)
    tables = _encoded(src, target, itertools.chain([first] if first else [], rest))
    return write_dataset(EncodedTables(tables, src.num_rows), dest, schema=target, mode=mode,
                         row_group_size=row_group_size, file_size=file_size, compression=compression,
                         progress=progress, storage_options=storage_options)


def load_schema(schema: Schema | Sequence[Field] | str | os.PathLike[str]) -> Schema:
    """``schema`` as a `Schema`: a list of fields, or a JSON file (path or fsspec URL) of a list of field
    entries or an object with ``"fields"``: what ``shardkit inspect --json`` prints, or a stored schema."""
    if isinstance(schema, Schema) or not isinstance(schema, str | os.PathLike):
        return Schema(list(schema))
    path = os.fspath(schema)
    try:
        with fsspec.open(path, "rt") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise SchemaError(f"cannot read the schema file {path!r} ({type(e).__name__}: {e}); give a JSON file "
                          "of fields, e.g. what `shardkit inspect --json` prints") from e
    entries = obj.get("fields") if isinstance(obj, dict) else obj
    try:
        if not isinstance(entries, list):
            raise SchemaError('it holds no list of fields, nor an object with "fields" (as `shardkit inspect '
                              '--json` prints)')
        for entry in entries:  # (Field takes any truthy value: "false" would be True)
            if isinstance(entry, dict) and not isinstance(entry.get("nullable", False), bool):
                raise SchemaError(f"field {entry.get('name')!r}: nullable is {entry['nullable']!r}; write "
                                  "true or false (JSON booleans)")
        return Schema([Field.from_json(entry) for entry in entries])
    except SchemaError as e:
        raise SchemaError(f"the schema file {path!r}: {e}") from e


def _zone_warning(url: str, field: Field, zones: list[str]) -> TimeZoneWarning:
    """What converting the times of ``field``, in the time ``zones``, to UTC wall times loses."""
    other = [z for z in zones if z != "UTC"]
    again = f"; to see them in their zone again: pandas.Series(values).dt.tz_localize('UTC').dt.tz_convert(" \
        f"{other[0]!r})" if other else ""
    said = ("time zone " if len(zones) == 1 else "time zones ") + " and ".join(repr(z) for z in zones)
    return TimeZoneWarning(f"{url!r}: column {field.name!r} holds times with the {said}: they are "
                           f"written as UTC wall times, {field.dtype_name} without a zone (shardkit stores "
                           f"none), each instant kept{again}")


def _zones_warned(src: Source, target: Schema, batches: Batches, warned: dict[str, list[str]]) -> Batches:
    """``batches``, warning of the time zones that `Source.zones` gains as they are read (a JSON file's
    offsets, first seen past its first batch) where ``warned`` has not named them yet."""
    for item in batches:
        for name in target.names:
            if src.zones.get(name, []) != warned.get(name, []):
                warned[name] = list(src.zones[name])
                warnings.warn(_zone_warning(src.url, target[name], warned[name]), stacklevel=2)
        yield item


def _check_apart(src: Location, roots: Sequence[str], dst: Location) -> None:
    """Refuse a ``dest`` that is, holds or lies in one of the source's ``roots`` (its file or folder, or
    what its glob pattern matched): an overwrite would delete what is read, or the new files would become
    part of the source."""
    if type(src.fs) is not type(dst.fs):
        return
    b, *paths = (os.path.realpath(p) if src.is_local else p.rstrip("/") for p in (dst.root, *roots))
    for a in paths:
        relation = "is" if a == b else "lies inside" if b.startswith(a.rstrip("/") + "/") else \
            "holds" if a.startswith(b.rstrip("/") + "/") else None
        if relation is not None:
            raise NotADatasetError(f"cannot convert {src.url!r} into {dst.url!r}: the destination {relation} "
                                   "the source; write to a folder outside it (and move it afterwards if need "
                                   "be)")


def _inferred(src: Source, name: str, first: tuple[pa.RecordBatch, str, int] | None) -> Field:
    """The field written for the undeclared column ``name`` (see `convert` on nulls)."""
    try:
        field = src.known.get(name) or field_from_arrow(src.arrow[name])
    except SchemaError as e:
        empty = "" if first else " (it holds no rows to tell the type by)"
        raise SchemaError(f"{src.url!r}{empty}: {e}; with shardkit write: --schema FILE, or --columns "
                          "without it") from e
    if name in src.infer_nulls:
        if name in src.nulls:  # a file lacks the column, or a partition folder is the null one
            nullable = True
        elif src.null_counts is None:
            nullable = bool(first and first[0].column(name).null_count)
        else:
            nullable = src.null_counts[name] > 0 if name in src.null_counts else field.nullable
        field = Field(name, field.dtype, field.shape, field.codec, nullable)
    return field if field.codec.writable else Field(name, field.dtype, field.shape, None, field.nullable)


def _guarded(src: Source, batches: Batches) -> Batches:
    """``batches``, with pyarrow's parse and conversion errors as `SchemaMismatchError` naming the rows (a
    source of files names the file itself: `read_error`)."""
    row = 0
    while True:
        try:
            item = next(batches, None)
        except READ_ERRORS as e:
            raise read_error(src.url, row, e) from e
        if item is None:
            return
        if item[0].num_rows:  # (an empty first batch would say nothing of nulls)
            yield item
        row += item[0].num_rows


def _encoded(src: Source, target: Schema, batches: Batches) -> Iterator[pa.Table]:
    """The source's batches encoded for ``target``; errors name the source, the file, and the rows."""
    arrow_schema, row, fields = target.arrow_schema(), 0, {f.name: src.field(f.name) for f in target}
    for batch, where, first in batches:
        try:
            arrays = [column(fields[f.name], f, batch.column(f.name)) for f in target]
        except SchemaError as e:
            raise type(e)(_located(src.url, str(e), target.names, (row, batch.num_rows, where, first))) from e
        yield pa.Table.from_arrays(arrays, schema=arrow_schema)
        row += batch.num_rows


def _located(url: str, message: str, names: list[str], rows: tuple[int, int, str, int]) -> str:
    """The ``message`` of an error encoding a batch (codecs count rows from 0 in what they are given) with
    the source's rows: ``rows`` is the batch's first row in the source, its rows, the file it came from
    and its first row in that file. Quoted field names are left as they are."""
    row, n, where, first = rows
    place = f"{where}, its rows {first}-{first + n - 1}: " if where else ""

    def said(i: int) -> str:
        return f"row {first + i} of {where} (source row {row + i})" if where else f"source row {row + i}"

    masked = {f"\0{i}\0": repr(name) for i, name in enumerate(sorted(names, key=len, reverse=True))}
    for key, name in masked.items():
        message = message.replace(name, key)
    message = _ROW.sub(lambda m: said(int(m.group(1))), message)
    for key, name in masked.items():
        message = message.replace(key, name)
    return f"{url!r} ({place}source rows {row}-{row + n - 1}): {message}"


def column(src: Field | None, dst: Field, values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column stored as the field ``src`` (None: an Arrow type no field maps) encoded for ``dst``.

    Encoded images (or bytes) in ``dst``'s image format are checked and copied; columns of shardkit's
    plain codecs go to ``dst``'s codec as Arrow, as `write_dataset` gives them; anything else (Petastorm's
    codecs, images into tensors or another format) is decoded by ``src``'s codec, encoded by ``dst``'s.
    """
    arr = combine(values)
    kind = "arrow" if src is None else src.codec.name
    same_format = src is not None and getattr(src.codec, "format", None) == getattr(dst.codec, "format", 0)
    if dst.codec.name == "image" and (kind in ("arrow", "scalar") or (kind == "image" and same_format)):
        return copy_encoded(dst, arr)
    same = src is not None and (src.dtype, src.shape) == (dst.dtype, dst.shape)
    # a tensor's stored bytes fit its own codec only, its list layout a tensor's of either layout
    listed = kind == "tensor" and dst.codec.name == "tensor" and (
        (src is not None and src.codec == dst.codec) or not is_bytes_type(arr.type))
    if src is not None and not (kind == "scalar" or (kind == "ndarray" and len(src.shape) == 1)
                                or (same and (kind == "ndarray" or listed))):
        return dst.codec.encode(dst, _rows(src.codec.decode(src, arr)))
    if dst.codec.name == "tensor" and (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) and (
            _is_number(arr.type.value_type)):  # (else the codec names what the lists hold)
        size = math.prod(dst.dims)
        if not arr.null_count and pc.all(pc.equal(pc.list_value_length(arr), size)).as_py() is not False:
            arr = pa.FixedSizeListArray.from_arrays(arr.flatten(), size)  # else the codec names the row
    elif dst.codec.name == "ndarray" and (len(dst.shape) == 1 or same) and arr.type == (
            target := dst.codec.arrow_type(dst)):
        if arr.null_count and not dst.nullable:
            raise null_error(dst, first_null(arr), "writing")
        check_no_null_elements(dst, arr, "writing")
        return arr.cast(target)  # copied: the codec would rebuild it row by row
    return dst.codec.encode(dst, arr)


def _is_number(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _rows(values: np.ndarray) -> Any:
    """Decoded values as ``encode`` takes them: a masked array's null rows as None (it drops masks)."""
    if not isinstance(values, np.ma.MaskedArray):
        return values
    nulls = np.asarray(np.ma.getmaskarray(values).reshape(len(values), -1).all(axis=1))
    return [None if null else row for null, row in zip(nulls, np.ma.getdata(values), strict=True)]
