"""Spark types -> shardkit fields, and the Arrow batches Spark hands to executors -> shardkit columns.

Mapping (`schema_from_spark`), each field nullable as its Spark field is:

==============================================  ======================================
Spark                                           shardkit field
==============================================  ======================================
boolean, tinyint, smallint, int, bigint         ``bool``, ``int8`` ... ``int64``, shape ()
float, double                                   ``float32``, ``float64``, shape ()
timestamp, timestamp_ntz                        ``datetime64[us]`` (UTC wall time), shape ()
date                                            ``datetime64[D]``, shape ()
string (char, varchar)                          ``str``
binary                                          ``bytes``
array<number>, array<array<number>>, ...        the number's dtype, shape (None,), (None, None), ...
==============================================  ======================================

Anything else (decimal, map, struct, interval, variant, arrays of strings) is a `SchemaError` naming
the column: cast it to one of the above or drop it. Fixed shapes and images are never guessed; declare
them in a `Schema`, and give their values as Spark arrays, either flat (``H*W*C`` numbers per row) or
nested as deep as the shape. Arrays must not hold null elements; a whole row may be null when the
field is nullable. An image field's column may be binary instead: encoded PNG or JPEG images, stored as
they are (`shardkit.dataset.codecs.image.ImageCodec.encode`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardkit.dataset._field import Field
from shardkit.dataset.codecs.base import cast_array, is_bytes_type
from shardkit.dataset.schema import Schema
from shardkit.errors import SchemaError, SchemaMismatchError, require

_SCALARS = {
    "BooleanType": "bool", "ByteType": "int8", "ShortType": "int16", "IntegerType": "int32",
    "LongType": "int64", "FloatType": "float32", "DoubleType": "float64",
    "TimestampType": "datetime64[us]", "TimestampNTZType": "datetime64[us]", "DateType": "datetime64[D]",
    "StringType": "str", "CharType": "str", "VarcharType": "str", "BinaryType": "bytes",
}
_NUMBERS = {"bool", "int8", "int16", "int32", "int64", "float32", "float64"}


def spark_leaf(data_type: Any) -> tuple[int, str | None]:
    """``(array depth, shardkit dtype of the innermost type or None if unsupported)`` of a Spark type."""
    types: Any = require("pyspark.sql.types", extra="spark", purpose="reading Spark types")
    depth = 0
    while isinstance(data_type, types.ArrayType):
        data_type, depth = data_type.elementType, depth + 1
    dtype = _SCALARS.get(type(data_type).__name__)
    if depth and dtype not in _NUMBERS:
        return depth, None
    return depth, dtype


def schema_from_spark(spark_schema: Any) -> Schema:
    """The shardkit schema of a Spark ``StructType`` (see the module docstring for the mapping).

    Example:
        >>> schema_from_spark(df.schema)
        Schema(id: int64, x: float32[None])

    Raises:
        SchemaError: a column's Spark type has no shardkit equivalent.
    """
    fields = []
    for sf in spark_schema.fields:
        depth, dtype = spark_leaf(sf.dataType)
        if dtype is None:
            raise SchemaError(
                f"Spark column {sf.name!r} has the type {sf.dataType.simpleString()}, which shardkit does "
                "not store; cast it to a number, string, binary or array of numbers "
                f"(e.g. df.withColumn({sf.name!r}, F.col({sf.name!r}).cast('double'))) or drop it"
            )
        fields.append(Field(sf.name, dtype, (None,) * depth, nullable=sf.nullable))
    return Schema(fields)


def check_spark_columns(schema: Schema, spark_schema: Any) -> None:
    """Raise `SchemaMismatchError` (before any Spark job) if the DataFrame cannot fit ``schema``."""
    types = {sf.name: sf.dataType for sf in spark_schema.fields}
    missing = [n for n in schema.names if n not in types]
    if missing:
        raise SchemaMismatchError(
            f"the Spark DataFrame has no column(s) {missing} declared in the schema (its columns: "
            f"{sorted(types)}); add or rename them, or leave them out of the schema"
        )
    extra = sorted(set(types) - set(schema.names))
    if extra:
        raise SchemaMismatchError(
            f"the Spark DataFrame has column(s) {extra} that the schema does not declare; add a Field for "
            f"each, or drop them first: df.drop(*{extra})"
        )
    for f in schema:
        depth, dtype = spark_leaf(types[f.name])
        where = f"field {f.name!r} (Spark type {types[f.name].simpleString()})"
        if dtype is None:
            raise SchemaMismatchError(f"{where}: shardkit cannot store this Spark type; cast or drop it")
        if not f.shape and depth:
            raise SchemaMismatchError(
                f"{where} is declared with shape () but holds arrays; declare its shape, "
                f"e.g. Field({f.name!r}, {f.dtype_name!r}, (None,))"
            )
        if f.shape and not depth and not (f.codec.name == "image" and dtype == "bytes"):
            raise SchemaMismatchError(
                f"{where} is declared with shape {f.shape} but holds single values; give each row an array "
                f"of numbers (flat, or nested {len(f.shape)} deep)"
                + (", or the image encoded as PNG or JPEG (a binary column)" if f.codec.name == "image"
                   else "")
            )


def columns_from_batch(batch: pa.RecordBatch, schema: Schema) -> dict[str, Any]:
    """The schema's columns from one Arrow batch of a Spark task, ready for ``schema.encode``."""
    return {f.name: column_for_field(f, batch.column(f.name)) for f in schema}


def _list_depth(t: pa.DataType) -> int:
    depth = 0
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t, depth = t.value_type, depth + 1
    return depth


def column_for_field(field: Field, arr: pa.Array) -> Any:
    """One Spark column as the field's codec takes it: Arrow for scalars, numpy/rows for arrays."""
    if pa.types.is_timestamp(arr.type) and arr.type.tz is not None:
        # Spark sends session-zone timestamps; the instant is kept, as UTC wall time without a zone.
        arr = arr.cast(pa.timestamp(arr.type.unit))
    depth = _list_depth(arr.type)
    if not field.shape:
        if depth:
            raise SchemaMismatchError(
                f"field {field.name!r} is declared with shape () but the Spark column holds {arr.type}; "
                f"declare its shape, e.g. Field({field.name!r}, {field.dtype_name!r}, (None,))"
            )
        return arr
    if field.codec.name == "image" and is_bytes_type(arr.type):
        return arr  # encoded PNG/JPEG, stored as they are once their headers are checked (ImageCodec.encode)
    if not depth:
        raise SchemaMismatchError(
            f"field {field.name!r} is declared with shape {field.shape} but the Spark column holds "
            f"{arr.type}, not arrays; give each row an array of numbers"
            + (", or the image encoded as PNG or JPEG (a binary column)" if field.codec.name == "image"
               else "")
        )
    return _array_rows(field, arr, depth)


def _array_rows(field: Field, arr: pa.Array, depth: int) -> Any:
    """Spark (nested) arrays -> ``(n, *shape)`` numpy for fixed shapes, else a list of per-row arrays."""
    mask = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool) if arr.null_count else None
    valid = arr if mask is None else arr.filter(pa.array(~mask))
    rows = np.arange(len(arr)) if mask is None else np.flatnonzero(~mask)
    lengths: list[np.ndarray] = []
    level = valid
    for _ in range(depth + 1):
        if level.null_count:
            row = int(rows[_row_of(_first_null(level), lengths)])
            raise SchemaMismatchError(
                f"field {field.name!r}: row {row} holds a null inside its array; replace the nulls first "
                f"(e.g. F.transform({field.name!r}, lambda v: F.coalesce(v, F.lit(0)))) or drop those rows"
            )
        if len(lengths) == depth:
            break
        lengths.append(np.asarray(pc.list_value_length(level).to_numpy(zero_copy_only=False), dtype=np.int64))
        level = level.flatten()
    leaves = cast_array(field, level.to_numpy(zero_copy_only=False), "from Spark")
    if field.fixed_shape:
        values: Any = _fixed(field, leaves, lengths, rows)
    else:
        values = _variable(field, leaves, lengths, rows)
    if mask is None:
        return values
    out: list[Any] = [None] * len(arr)
    for j, i in enumerate(rows):
        out[i] = values[j]
    return out


def _first_null(arr: pa.Array) -> int:
    return int(np.argmax(np.asarray(arr.is_null().to_numpy(zero_copy_only=False))))


def _row_of(entry: int, lengths: list[np.ndarray]) -> int:
    """The row that ``entry`` of the level under ``lengths`` (list lengths per level) belongs to."""
    for n in reversed(lengths):
        entry = int(np.searchsorted(np.cumsum(n), entry, side="right"))
    return entry


def _fixed(field: Field, leaves: np.ndarray, lengths: list[np.ndarray], rows: np.ndarray) -> np.ndarray:
    shape = field.dims
    size = math.prod(shape)
    if len(lengths) == 1:
        expected: tuple[int, ...] = (size,)
    elif len(lengths) == len(shape):
        expected = shape
    else:
        raise SchemaMismatchError(
            f"field {field.name!r} declares the fixed shape {shape} but the Spark arrays are nested "
            f"{len(lengths)} deep; give flat arrays of {size} numbers, or arrays nested {len(shape)} deep"
        )
    per_row = 1
    for level, (n, want) in enumerate(zip(lengths, expected, strict=True)):
        bad = np.flatnonzero(n != want)
        if bad.size:
            row = int(rows[bad[0] // per_row])
            raise SchemaMismatchError(
                f"field {field.name!r} declares the fixed shape {shape} but row {row} holds an array of "
                f"length {int(n[bad[0]])} at nesting level {level} (expected {want}); fix the data, or "
                "declare a variable dimension with None"
            )
        per_row *= want
    return leaves.reshape((len(rows), *shape))


def _variable(
    field: Field, leaves: np.ndarray, lengths: list[np.ndarray], rows: np.ndarray
) -> list[np.ndarray]:
    if len(lengths) != len(field.shape):
        raise SchemaMismatchError(
            f"field {field.name!r} declares the shape {field.shape} but the Spark arrays are nested "
            f"{len(lengths)} deep; nest them {len(field.shape)} deep or change the declared shape"
        )
    starts = [np.concatenate([[0], np.cumsum(n)]) for n in lengths]
    out = []
    for j in range(len(rows)):
        lo, hi, dims = j, j + 1, []
        for level, n in enumerate(lengths):
            sizes = n[lo:hi]
            if sizes.size and (sizes != sizes[0]).any():
                raise SchemaMismatchError(
                    f"field {field.name!r}: row {int(rows[j])} is ragged (arrays of lengths "
                    f"{sorted(set(sizes.tolist()))} at nesting level {level}); an n-d array needs equal "
                    "lengths"
                )
            dims.append(int(sizes[0]) if sizes.size else 0)
            lo, hi = int(starts[level][lo]), int(starts[level][hi])
        out.append(leaves[lo:hi].reshape(dims))
    return out


__all__ = ["check_spark_columns", "column_for_field", "columns_from_batch", "schema_from_spark", "spark_leaf"]
