"""What `write_dataset` accepts, turned into a stream of ``(columns, num_rows)`` batches.

Accepted: a pandas DataFrame, an Arrow Table or RecordBatch, a mapping of column name -> values (one
columnar batch), or an iterable of DataFrames, Arrow tables or batches, mappings of column name -> Arrow
array, mappings of column name -> numpy array (batches: what a shardkit reader, Ray Data and Hugging Face
datasets yield), or row dicts.

Inside an iterable a mapping is a batch when all its values are Arrow arrays, and a row when any value
is no array (a number, a string) or the arrays differ in their first dimension. A mapping whose values
are all numpy arrays of one first dimension ``n`` reads two ways: one row whose fields are tensors of
shape ``(n, ...)``, or a batch of ``n`` rows (`item_kind`). The schema decides, by each field's number of
dimensions (an image field's column of encoded images, a 1-D object array of ``bytes`` as a reader gives
it with ``decode=False``, is a batch's); without one the input is refused, naming both readings and the
fix.
Large inputs are cut into batches of at most ``BATCH_ROWS`` rows so that memory stays bounded by a row
group, not by the input; a stream of row dicts also at about ``BATCH_BYTES`` of arrays and blobs (4,096
rows of 24 KB JPEGs would be 100 MB a batch, of 1 MB photos 4 GB).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from shardkit.dataset._field import Field
from shardkit.dataset.schema import Schema
from shardkit.errors import SchemaError, SchemaMismatchError

BATCH_ROWS = 4096
BATCH_BYTES = 8 << 20  # row dicts: a batch ends past this many bytes of numpy arrays and bytes values
Batch = tuple[Mapping[str, Any], int]


def _is_dataframe(obj: Any) -> bool:
    return type(obj).__name__ == "DataFrame" and hasattr(obj, "iloc") and hasattr(obj, "columns")


def _column_len(name: str, values: Any) -> int:
    try:
        return len(values)
    except TypeError as e:
        raise SchemaError(f"column {name!r} is a {type(values).__name__}, not a sequence of values") from e


def column_names(labels: Iterable[Any], what: str) -> list[str]:
    """The field names of a frame's or table's column ``labels`` (``str`` of each); raise
    `SchemaMismatchError` when two labels give one name, as one column would silently replace the other.

    pandas labels that are not strings (``0``, ``1.5``) become their ``str``; ``1`` and ``"1"`` (or a
    label given twice) collide.
    """
    labels = list(labels)
    names = [str(label) for label in labels]
    if len(set(names)) == len(names):
        return names
    seen: dict[str, list[Any]] = {}
    for label, name in zip(labels, names, strict=True):
        seen.setdefault(name, []).append(label)
    clashes = {name: found for name, found in seen.items() if len(found) > 1}
    raise SchemaMismatchError(
        f"the {what} has column labels that name one field: "
        + "; ".join(f"{found} become {name!r}" for name, found in clashes.items())
        + ". Every column needs its own name: rename or drop the duplicates before writing"
    )


def _from_table(table: pa.Table | pa.RecordBatch) -> Iterator[Batch]:
    names = column_names(table.schema.names, "Arrow table")
    batches = table.to_batches(max_chunksize=BATCH_ROWS) if isinstance(table, pa.Table) else [table]
    for batch in batches:
        yield {name: batch.column(i) for i, name in enumerate(names)}, batch.num_rows


def _from_dataframe(df: Any) -> Iterator[Batch]:
    names = column_names(df.columns, "DataFrame")
    for start in range(0, len(df), BATCH_ROWS):
        chunk = df.iloc[start : start + BATCH_ROWS]
        yield {name: chunk.iloc[:, i] for i, name in enumerate(names)}, len(chunk)


def _from_mapping(columns: Mapping[str, Any]) -> Iterator[Batch]:
    lengths = {name: _column_len(name, v) for name, v in columns.items()}
    if len(set(lengths.values())) > 1:
        raise SchemaMismatchError(
            f"columns have different lengths: {lengths}; every column needs one value per row"
        )
    n = next(iter(lengths.values()), 0)
    for start in range(0, n, BATCH_ROWS):
        yield {k: v[start : start + BATCH_ROWS] for k, v in columns.items()}, min(BATCH_ROWS, n - start)


_END = object()  # the end of an input iterable (None is an item, and an error)


def _from_rows(first: Mapping[str, Any], rest: Iterator[Any], offset: int,
               schema: Schema | None = None) -> tuple[Batch, Any]:
    """Gather up to BATCH_ROWS row dicts into columns; returns the batch and the next item (or _END)."""
    names = list(first)
    cols: dict[str, list[Any]] = {n: [] for n in names}
    row: Any = first
    count = size = 0
    while True:
        if set(row) != set(names):
            missing, extra = sorted(set(names) - set(row)), sorted(set(row) - set(names))
            raise SchemaMismatchError(
                f"row {offset + count} has different keys from row 0 (missing {missing}, extra {extra}); "
                "every row dict needs the same keys"
            )
        for n in names:
            value = row[n]
            cols[n].append(value)
            if isinstance(value, np.ndarray | memoryview):
                size += value.nbytes
            elif isinstance(value, bytes | bytearray):
                size += len(value)
        count += 1
        row = next(rest, _END)
        if count >= BATCH_ROWS or size >= BATCH_BYTES or item_kind(row, schema, offset + count) != "row":
            return (cols, count), row


def item_kind(item: Any, schema: Schema | None, offset: int = 0) -> str:
    """``"row"`` or ``"batch"`` for a mapping inside an iterable input (``"other"`` for anything else);
    see the module docstring.

    Raises:
        SchemaError: a mapping of numpy arrays of one first dimension, and no schema to tell a row of
            tensors from a batch of rows (the message names both readings and the fix).
    """
    if not isinstance(item, Mapping) or not item:
        return "other"
    values = list(item.values())
    if _of_arrow(item):
        return "batch"
    if not all(isinstance(v, np.ndarray) and v.ndim >= 1 for v in values):
        return "row"
    if len({len(v) for v in values}) > 1:
        return "row"
    n = len(values[0])
    if schema is not None:
        dims = {name: len(schema[name].shape) for name in item if name in schema}
        if dims and all(item[name].ndim > k or _encoded_images(schema[name], item[name])
                        for name, k in dims.items()):
            return "batch"
        return "row"
    first, array = next(iter(item.items()))
    shape = tuple(array.shape)
    raise SchemaError(
        f"item {offset} of the input is a dict of numpy arrays with {n} values each (e.g. {first!r}: "
        f"{array.dtype}{list(shape)}), which reads two ways: one row whose field {first!r} is a "
        f"{array.dtype}{list(shape)} tensor, or a batch of {n} rows whose {first!r} is "
        f"{array.dtype}{list(shape[1:]) if len(shape) > 1 else ''}. Pass schema= to say which (for a "
        "shardkit reader's batches: write_dataset(iter(reader), url, schema=reader.schema)), or give "
        "batches as Arrow tables or record batches, or rows as dicts with one row's values"
    )


def iter_batches(data: Any, schema: Schema | None = None) -> Iterator[Batch]:
    """Yield ``(columns, num_rows)`` for every batch in ``data`` (see the module docstring); ``schema``
    (when known before the data is read) tells rows from batches of numpy arrays (`item_kind`)."""
    if isinstance(data, pa.Table | pa.RecordBatch):
        yield from _from_table(data)
    elif _is_dataframe(data):
        yield from _from_dataframe(data)
    elif isinstance(data, Mapping):
        yield from _from_mapping(data)
    elif isinstance(data, Iterable) and not isinstance(data, str | bytes):
        it = iter(data)
        item: Any = next(it, _END)
        count = 0  # items read: what a message names
        while item is not _END:
            kind = item_kind(item, schema, count)
            if kind == "row":
                (cols, n), item = _from_rows(item, it, count, schema)
                count += n
                yield cols, n
            elif kind == "batch" and not _of_arrow(item):  # numpy columns
                yield from _from_mapping(item)
                item, count = next(it, _END), count + 1
            else:
                yield from iter_batches(item)  # a None item raises here rather than end the input
                item, count = next(it, _END), count + 1
    else:
        raise SchemaError(
            f"write_dataset cannot read a {type(data).__name__}; pass a pandas DataFrame, an Arrow Table, "
            "a dict of columns, or an iterable of record batches or row dicts"
        )


def whole_columns(data: Any) -> Mapping[str, Any] | None:
    """Every column of an in-memory input (table, frame, dict of columns); None for a stream.

    The writer infers the schema from these, not from the first batch, so that a null or a shape
    that first appears past ``BATCH_ROWS`` rows is seen too.
    """
    if isinstance(data, pa.Table | pa.RecordBatch):
        return {name: data.column(i) for i, name in enumerate(column_names(data.schema.names, "Arrow table"))}
    if _is_dataframe(data):
        return {name: data.iloc[:, i] for i, name in enumerate(column_names(data.columns, "DataFrame"))}
    if isinstance(data, Mapping):
        return data
    return None


def _encoded_images(field: Field, values: np.ndarray) -> bool:
    """Whether ``values`` is a column of encoded images of image field ``field``: a 1-D object array of
    ``bytes`` (and None), as a reader gives an image field it does not decode. A row's image is never one
    (its pixels are a uint8 array of 2 or 3 dimensions, its encoded bytes no array)."""
    if field.codec.name != "image" or values.dtype != object or values.ndim != 1:
        return False
    return all(v is None or isinstance(v, bytes | bytearray | memoryview) for v in values)


def _of_arrow(item: Mapping[str, Any]) -> bool:
    return all(isinstance(v, pa.Array | pa.ChunkedArray) for v in item.values())


def is_row(item: Any) -> bool:
    """A dict inside an iterable is a row, unless all its values are Arrow arrays (a batch)."""
    return (
        isinstance(item, Mapping)
        and bool(item)
        and not all(isinstance(v, pa.Array | pa.ChunkedArray) for v in item.values())
    )


__all__ = ["BATCH_BYTES", "BATCH_ROWS", "column_names", "is_row", "item_kind", "iter_batches",
           "whole_columns"]
