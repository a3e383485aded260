"""``schema=`` hints: fields declared for columns of data shardkit did not write (a plain Parquet folder,
a Delta or Iceberg table), where the Arrow types alone do not say the field.

Spark and most table writers store a tensor as a flat ``array<float>`` and an image as ``binary``: read
as they are, those are variable-length lists and bytes. A hint such as ``Field("emb", "float32", (16,))``
or ``Field("image", "uint8", (64, 64, 3), codec=ImageCodec("png"))`` declares the fixed shape or the image
codec; the columns it does not name keep the fields their Arrow types map to.

A list column hinted a fixed shape is read as a fixed-size list of that many values (row by row: a
row of another length is a `SchemaMismatchError` naming the column, the file and the fix, never a
silently reshaped tensor). A hint naming a column the data lacks, or of a type no cast reads, is refused
when the dataset opens. A shardkit dataset stores its schema: hints there are refused (rewrite it to
change a field).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pyarrow as pa

from shardkit.dataset._dataset import Dataset
from shardkit.dataset._field import Field
from shardkit.dataset.schema import Schema
from shardkit.errors import SchemaError

Hints = Schema | Sequence[Field]


def apply_hints(ds: Dataset, hints: Hints) -> Dataset:
    """``ds`` with the hinted fields in place of those its Arrow types gave (see the module docstring).

    Raises:
        SchemaError: a hint names a column ``ds`` lacks, for a type it cannot be read from, or ``ds`` is
            a shardkit dataset (its schema is stored).
    """
    fields = list(hints)
    if not fields:
        return ds
    if ds.kind == "shardkit":
        raise SchemaError(
            f"schema= hints {[f.name for f in fields]} were given for {ds.url!r}, a shardkit dataset, whose "
            "fields are stored with it; leave schema= out, or rewrite the dataset with the fields you want "
            "(shardkit.write_dataset(..., schema=...))")
    types = {f.name: f.type for f in ds.arrow_schema}
    by_name: dict[str, Field] = {}
    casts: dict[str, pa.DataType] = {}
    for field in fields:
        if not isinstance(field, Field):
            raise SchemaError(f"schema= takes shardkit Fields (or a Schema), not {field!r}")
        if field.name not in types:
            raise SchemaError(
                f"the schema= hint {field.name!r} names no column of {ds.url!r} (its columns: "
                f"{list(types)}); fix the name, or leave the hint out")
        stored = types[field.name]
        target = _readable_as(field, stored)
        if target is None:
            problem = field.codec.stored_problem(field, stored)
            raise SchemaError(
                f"the schema= hint {field.name!r} ({field.dtype_name}, shape {field.shape}, codec "
                f"{field.codec.name!r}) does not fit its column in {ds.url!r}, of type {stored}: {problem}. "
                "Declare a field this column can hold (a list of N values: shape (N,), or a product of N), "
                "or leave the hint out")
        if target != stored:
            casts[field.name] = target
        by_name[field.name] = field
    known = {f.name: f for f in ds.schema}
    schema = Schema([by_name.get(n) or known[n] for n in types if n in by_name or n in known])
    arrow = pa.schema([pa.field(f.name, casts.get(f.name, f.type), nullable=f.nullable)
                       for f in ds.arrow_schema], metadata=ds.arrow_schema.metadata)
    left_out = {k: v for k, v in ds.left_out.items() if k not in by_name}
    return dataclasses.replace(ds, schema=schema, arrow_schema=arrow, left_out=left_out,
                               casts={**ds.casts, **casts}, hints=(*ds.hints, *fields))


def _readable_as(field: Field, stored: pa.DataType) -> pa.DataType | None:
    """The type ``field`` reads its column of type ``stored`` as: ``stored`` itself, or the fixed-size
    list a variable list becomes for a fixed shape; None when neither fits."""
    if field.codec.stored_problem(field, stored) is None:
        return stored
    if field.fixed_shape and (pa.types.is_list(stored) or pa.types.is_large_list(stored)):
        target = pa.list_(stored.value_type, math.prod(d or 1 for d in field.shape))
        if field.codec.stored_problem(field, target) is None:
            return target
    return None
