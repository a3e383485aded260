"""Tensor codecs: fixed shapes as Arrow's canonical ``fixed_shape_tensor``, variable shapes as lists.

Fixed-shape tensors are ``fixed_shape_tensor`` arrays in Arrow (what `Schema.encode` builds and what
Arrow input may give). In the Parquet files, by default (``storage="bytes"``), each row is one
``FIXED_LEN_BYTE_ARRAY`` value: the tensor's C-order bytes, little-endian. Parquet has no fixed-size
list, so the other layout (``storage="list"``, the canonical type's own storage) writes a repeated
column with a repetition and a definition level per element, and stores 1- and 2-byte integers as
INT32; decoding those levels is what bounds its read speed (a list column reads far slower than the
bytes one, for the same file size with snappy). The bytes layout is what Petastorm users know (its
ndarrays were bytes too); other engines (Spark, DuckDB, pandas) read it as binary, and the field's
dtype and shape are in the schema JSON. Choose ``TensorCodec(storage="list")`` for a dataset that
other engines should read as arrays. Both layouts decode zero-copy: numpy views the one contiguous
buffer as ``(rows, *shape)``.

Variable-shape tensors (``None`` in the shape) store a flat list of
values per row (1-D), or Arrow's ``variable_shape_tensor`` storage layout (``struct<data: list<T>,
shape: fixed_size_list<int32>[ndim]>``) for more dimensions; they decode to an object array of
per-row numpy views.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardkit.dataset.codecs.base import (
    ArrowColumn,
    Codec,
    as_masked,
    cast_array,
    combine,
    first_null,
    mask_of,
    null_error,
)
from shardkit.dataset.codecs.scalar import arrow_scalar_type, scalar_stored_problem
from shardkit.errors import SchemaError, SchemaMismatchError

if TYPE_CHECKING:
    from shardkit.dataset._field import Field


def _check_numeric(field: Field) -> None:
    if field.dtype.kind not in "biuf":
        raise SchemaError(
            f"field {field.name!r}: tensors hold numbers or bools, not {field.dtype}; "
            "store strings with codec='scalar' or encode them as bytes"
        )


def rows_of(values: Any) -> list[Any]:
    """The per-row values of a column given as Arrow, pandas, numpy or any sequence."""
    if isinstance(values, pa.ChunkedArray | pa.Array):
        return list(combine(values).to_numpy(zero_copy_only=False))
    if hasattr(values, "to_numpy") and hasattr(values, "dtype"):
        return list(values.to_numpy())
    return list(values)


def _is_null(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def row_array(v: Any) -> np.ndarray:
    """One row's value as an array of its full shape.

    ``np.asarray`` does that for nested Python lists, but a row of an Arrow nested list column
    (``list<list<int64>>``, as ``to_numpy`` gives it, and a pandas column made from one) is a 1-D object
    array of arrays, which it leaves 1-D: such a row is stacked level by level here, when its items
    have one shape (ragged ones stay a 1-D object array, for the caller's shape check to refuse with
    `shape_text`; numpy raises a bare ValueError on ragged Python lists)."""
    try:
        a = np.asarray(v)
    except ValueError:  # ragged nested lists
        a = np.empty(len(v), object)
        for i, x in enumerate(v):
            a[i] = x
    if a.dtype != object or a.ndim != 1 or not len(a) or not _all_sequences(a):
        return a
    items = [row_array(x) for x in a]
    if len({(x.shape, x.dtype == object) for x in items}) != 1 or items[0].dtype == object:
        return a
    return np.stack(items)


def _all_sequences(a: np.ndarray) -> bool:
    return all(isinstance(x, np.ndarray | list | tuple) for x in a)


def shape_text(a: np.ndarray) -> str:
    """``a``'s shape for a message; for a row of ragged nested lists (`row_array`), their lengths."""
    if a.dtype == object and a.ndim == 1 and len(a) and _all_sequences(a):
        lengths = ", ".join([*(str(len(x)) for x in a[:8]), *["..."] * (len(a) > 8)])
        return f"{a.shape}, of lists of unequal lengths ({lengths})"
    return str(a.shape)


def stack_rows(field: Field, rows: list[Any], where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Stack per-row values into ``(n, *shape)``, zero-filling nulls; returns (array, null mask)."""
    shape = field.dims
    mask = np.fromiter((_is_null(v) for v in rows), dtype=bool, count=len(rows))
    if mask.any() and not field.nullable:
        raise null_error(field, int(np.argmax(mask)), where)
    arrays = []
    for i, v in enumerate(rows):
        a = np.zeros(shape, field.dtype) if mask[i] else row_array(v)
        if a.shape != shape:
            raise SchemaMismatchError(
                f"field {field.name!r} ({where}) declares the fixed shape {shape} but row {i} has shape "
                f"{shape_text(a)}; reshape the data, or declare a variable dimension with None"
            )
        arrays.append(cast_array(field, a, where))
    out = np.stack(arrays) if arrays else np.zeros((0, *shape), field.dtype)
    return out, (mask if mask.any() else None)


def first_null_element(arr: pa.Array) -> int | None:
    """The first row of a list-like tensor column (fixed_shape_tensor, fixed_size_list, list, or the
    ndarray codec's ``(data, shape)`` struct) that is not null itself but holds a null element; None
    when there is none. Only the elements of valid rows count: Parquet gives the slots of a null row
    null elements."""
    storage = arr.storage if isinstance(arr, pa.ExtensionArray) else arr
    if pa.types.is_struct(storage.type):
        if storage.type.get_field_index("data") < 0:
            return None
        valid = np.asarray(storage.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        storage = storage.field("data")
    else:
        valid = None
    t = storage.type
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        child = storage.values.slice(storage.offset * size, len(storage) * size)
        if not child.null_count or not size:
            return None
        flags = np.asarray(child.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        bad = flags.reshape(len(storage), size).any(axis=1)
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        if not storage.values.null_count:
            return None
        offsets = np.asarray(storage.offsets.to_numpy())
        flags = np.asarray(storage.values.is_null().to_numpy(zero_copy_only=False), dtype=np.int64)
        seen = np.concatenate([[0], np.cumsum(flags)])
        bad = seen[offsets[1:]] > seen[offsets[:-1]]
    else:
        return None
    bad &= np.asarray(storage.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if valid is not None:
        bad &= valid
    return int(np.argmax(bad)) if bad.any() else None


def check_no_null_elements(field: Field, arr: pa.Array, where: str) -> None:
    """Raise `SchemaMismatchError` when a row of ``arr`` (not null itself) holds a null element: a
    tensor has no place for one (a fixed-shape tensor would read it as 0, a variable one as NaN)."""
    row = first_null_element(arr)
    if row is None:
        return
    fix = ("fill them before writing (e.g. pyarrow.compute.fill_null on the list values; NaN keeps them "
           "visible in a float tensor)" if where == "writing"
           else "rewrite the data with them filled, or read the other fields with columns=[...]")
    raise SchemaMismatchError(
        f"field {field.name!r} ({where}): row {row} holds a null element, and a tensor cannot hold one "
        f"(a whole row can be null, with nullable=True); {fix}"
    )


#: The layouts of a fixed-shape tensor in the Parquet files (see the module docstring).
STORAGES = ("bytes", "list")


def fixed_values(arr: pa.Array, shape: tuple[int, ...], dtype: np.dtype | None = None) -> np.ndarray:
    """Zero-copy ``(rows, *shape)`` view of a fixed_shape_tensor or fixed_size_list array, or of a
    fixed_size_binary array of ``dtype`` values (the bytes layout; null rows read as zeros)."""
    storage = arr.storage if isinstance(arr, pa.ExtensionArray) else arr
    size = math.prod(shape)
    if pa.types.is_fixed_size_binary(storage.type):
        if dtype is None:
            raise TypeError("fixed_values of a fixed_size_binary array needs the dtype of its values")
        item = np.dtype(dtype).newbyteorder("<")
        if storage.type.byte_width != size * item.itemsize:
            raise SchemaMismatchError(
                f"a column of {storage.type.byte_width}-byte values cannot hold {dtype} tensors of shape "
                f"{shape} ({size * item.itemsize} bytes); the schema does not describe this data"
            )
        data, start = storage.buffers()[1], storage.offset * size * item.itemsize
        flat = np.frombuffer(data, item, count=len(storage) * size, offset=start)
        out = flat.reshape((len(storage), *shape))
        if storage.null_count:  # a null row's bytes are whatever the writer left there
            out = out.copy()
            out[np.asarray(storage.is_null().to_numpy(zero_copy_only=False), dtype=bool)] = 0
        return out
    child = storage.values.slice(storage.offset * size, len(storage) * size)
    if child.null_count:
        # Parquet gives the slots of null rows null children; numpy would turn them into float NaN.
        child = child.fill_null(pa.scalar(0 if not pa.types.is_boolean(child.type) else False, child.type))
    # Arrow packs booleans as bits, so they are the one type numpy cannot view without a copy.
    zero_copy = not pa.types.is_boolean(child.type)
    values: np.ndarray = child.to_numpy(zero_copy_only=zero_copy)
    return values.reshape((len(storage), *shape))


def _numeric(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def nested_values(arr: pa.Array, shape: tuple[int, ...]) -> np.ndarray | None:
    """``(rows, *shape)`` values of an Arrow column of nested lists (``list<list<int64>>``, fixed-size or
    not, one level per dimension) whose every row has ``shape``, unnested level by level without a
    Python object per row; None for anything else (a null at any level, another length, another
    type), which the row-by-row path (`stack_rows`) takes and, where wrong, names the row of."""
    level, rows = arr, len(arr)
    for size in shape:
        t = level.type
        if level.null_count or not (pa.types.is_list(t) or pa.types.is_large_list(t)
                                    or pa.types.is_fixed_size_list(t)):
            return None
        lengths = pc.list_value_length(level)
        if len(level) and (pc.min(lengths).as_py() != size or pc.max(lengths).as_py() != size):
            return None
        level = level.flatten()
    if level.null_count or not _numeric(level.type):
        return None
    values: np.ndarray = level.to_numpy(zero_copy_only=False)
    return values.reshape((rows, *shape))


@dataclasses.dataclass(frozen=True)
class TensorCodec(Codec):
    """Fixed-shape tensor per row, as Arrow's canonical ``fixed_shape_tensor`` extension type.

    Args:
        storage: the layout in the Parquet files: ``"bytes"`` (default; one fixed-length binary value
            per row, fast to read) or ``"list"`` (a fixed-size list, which other engines read as
            arrays). See the module docstring for the difference.
    """

    name = "tensor"
    storage: str = "bytes"

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise SchemaError(
                f"codec 'tensor': storage={self.storage!r} is not a layout; use one of {list(STORAGES)}"
            )

    def check(self, field: Field) -> None:
        _check_numeric(field)
        if not field.shape or any(d is None for d in field.shape):
            raise SchemaError(
                f"field {field.name!r}: the tensor codec needs a fixed shape with at least one dimension, "
                f"got {field.shape}; use codec='scalar' for () or 'ndarray' for variable dimensions"
            )
        if 0 in field.shape:
            # rows of no values: Arrow's fixed-size list of size 0 cannot be built (pyarrow divides by the
            # list size and the process dies of SIGFPE), and a row that holds nothing needs no column
            raise SchemaError(
                f"field {field.name!r}: the tensor codec cannot store the shape {field.shape}, which has a "
                "dimension of size 0 (every row would hold no values); drop the field, or declare the "
                "dimension variable with None (codec 'ndarray' stores empty rows)"
            )

    def arrow_type(self, field: Field) -> pa.DataType:
        return pa.fixed_shape_tensor(arrow_scalar_type(field), list(field.dims))

    def stored_problem(self, field: Field, stored: pa.DataType) -> str | None:
        """Either layout (whatever the ``storage`` option says, as `decode` reads both) of the field's
        size: ``fixed_size_binary`` of its bytes, or a fixed-size list / ``fixed_shape_tensor`` of its
        number of values of its dtype. A tensor of another shape with as many values is not detected."""
        t = stored.storage_type if isinstance(stored, pa.BaseExtensionType) else stored
        size = math.prod(field.dims)
        if pa.types.is_fixed_size_binary(t):
            if t.byte_width == size * field.dtype.itemsize:
                return None
            return (f"{field.dtype_name} tensors of shape {field.shape} take {size * field.dtype.itemsize} "
                    f"bytes, not the column's {t.byte_width} ({stored})")
        if pa.types.is_fixed_size_list(t):
            if t.list_size != size:
                return f"tensors of shape {field.shape} hold {size} values, not the column's {t.list_size}"
            return scalar_stored_problem(field, t.value_type)
        return f"a fixed-shape tensor cannot be read from a column of type {stored}"

    def storage_type(self, field: Field) -> pa.DataType:
        if self.storage == "list":
            return self.arrow_type(field)
        return pa.binary(field.dtype.itemsize * math.prod(field.dims))

    def to_storage(self, field: Field, arr: pa.Array) -> pa.Array:
        """``arr`` (this field's ``fixed_shape_tensor``) as the stored layout; no copy of the values."""
        if self.storage == "list":
            return arr
        # a view of the values (a copy only for bools, packed as bits, and for null slots)
        values = np.ascontiguousarray(fixed_values(arr, field.dims), field.dtype.newbyteorder("<"))
        validity = arr.is_valid().buffers()[1] if arr.null_count else None  # a fresh array: offset 0
        return pa.Array.from_buffers(self.storage_type(field), len(arr), [validity, pa.py_buffer(values)],
                                     null_count=arr.null_count)

    def encode(self, field: Field, values: Any) -> pa.Array:
        target = self.arrow_type(field)
        shape = field.dims
        if isinstance(values, pa.ChunkedArray | pa.Array):
            arr = combine(values)
            check_no_null_elements(field, arr, "writing")
            if arr.type == target:
                if not field.nullable and arr.null_count:
                    raise null_error(field, first_null(arr), "writing")
                return arr
            same_tensor = isinstance(arr.type, pa.FixedShapeTensorType) and tuple(arr.type.shape) == shape
            # a flat fixed_size_list of the right size: what plain Parquet holds (pq.read_table output)
            flat_list = (pa.types.is_fixed_size_list(arr.type) and arr.type.list_size == math.prod(shape)
                         and _numeric(arr.type.value_type))  # else row by row: a cast names the row
            # the bytes layout as pq.read_table gives it
            stored = arr.type == self.storage_type(field) and pa.types.is_fixed_size_binary(arr.type)
            if same_tensor or flat_list or stored:
                if not field.nullable and arr.null_count:
                    raise null_error(field, first_null(arr), "writing")
                values = fixed_values(arr, shape, field.dtype)
                values, mask = cast_array(field, values, "writing"), mask_of(arr)
                return self._build(target, values, mask, field)
            nested = nested_values(arr, shape)  # list<list<...>> of the shape, no nulls
            if nested is not None:
                return self._build(target, cast_array(field, nested, "writing"), None, field)
        if isinstance(values, np.ndarray) and values.dtype != object:
            if values.shape[1:] != shape:
                raise SchemaMismatchError(
                    f"field {field.name!r} declares the fixed shape {shape} but the data has per-row shape "
                    f"{values.shape[1:]}; reshape the data, or declare a variable dimension with None"
                )
            return self._build(target, cast_array(field, values, "writing"), None, field)
        stacked, mask = stack_rows(field, rows_of(values), "writing")
        return self._build(target, stacked, mask, field)

    @staticmethod
    def _build(target: pa.DataType, values: np.ndarray, mask: np.ndarray | None, field: Field) -> pa.Array:
        n = values.shape[0]
        flat = pa.array(np.ascontiguousarray(values).reshape(-1), type=arrow_scalar_type(field))
        storage = pa.FixedSizeListArray.from_arrays(
            flat, type=target.storage_type, mask=None if mask is None else pa.array(mask)
        )
        assert len(storage) == n
        return pa.ExtensionArray.from_storage(target, storage)

    def decode(self, field: Field, column: ArrowColumn) -> np.ndarray:
        """Either layout (a dataset's files may predate its schema's storage) -> ``(rows, *shape)``."""
        arr = combine(column)
        shape = field.dims
        check_no_null_elements(field, arr, "reading")
        return as_masked(fixed_values(arr, shape, field.dtype), mask_of(arr))


@dataclasses.dataclass(frozen=True)
class NdarrayCodec(Codec):
    """Variable-shape tensor per row (``None`` in the shape); decodes to an object array of arrays."""

    name = "ndarray"

    def check(self, field: Field) -> None:
        _check_numeric(field)
        if not field.shape:
            raise SchemaError(f"field {field.name!r}: the ndarray codec needs at least one dimension")

    def stored_problem(self, field: Field, stored: pa.DataType) -> str | None:
        """A list of the field's dtype (1-D), or a struct of such a ``data`` list and a ``shape`` of as
        many dimensions as the field's (more)."""
        t, ndim = stored, len(field.shape)
        if ndim > 1:
            names = [t.field(i).name for i in range(t.num_fields)] if pa.types.is_struct(t) else []
            shape = t.field("shape").type if {"data", "shape"} <= set(names) else None
            if shape is None or not pa.types.is_fixed_size_list(shape) or shape.list_size != ndim:
                return f"{ndim}-dimensional tensors cannot be read from a column of type {stored}"
            t = t.field("data").type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            return f"variable-shape tensors cannot be read from a column of type {stored}"
        return scalar_stored_problem(field, t.value_type)

    def arrow_type(self, field: Field) -> pa.DataType:
        item = arrow_scalar_type(field)
        if len(field.shape) == 1:
            return pa.list_(item)
        return pa.struct([("data", pa.list_(item)), ("shape", pa.list_(pa.int32(), len(field.shape)))])

    def encode(self, field: Field, values: Any) -> pa.Array:
        if isinstance(values, pa.ChunkedArray | pa.Array):
            check_no_null_elements(field, combine(values), "writing")
        rows = rows_of(values)
        ndim = len(field.shape)
        mask = np.fromiter((_is_null(v) for v in rows), dtype=bool, count=len(rows))
        if mask.any() and not field.nullable:
            raise null_error(field, int(np.argmax(mask)), "writing")
        flats, shapes = [], np.zeros((len(rows), ndim), dtype=np.int32)
        for i, v in enumerate(rows):
            if mask[i]:
                continue
            a = row_array(v)
            ok = a.ndim == ndim and all(
                d is None or d == s for d, s in zip(field.shape, a.shape, strict=True)
            )
            if not ok:
                raise SchemaMismatchError(
                    f"field {field.name!r} declares the shape {field.shape} but row {i} has shape "
                    f"{shape_text(a)}; reshape the data or change the declared shape"
                )
            shapes[i] = a.shape
            flats.append(cast_array(field, a, "writing").reshape(-1))
        counts = np.where(mask, 0, shapes.prod(axis=1))
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        flat = np.concatenate(flats) if flats else np.zeros(0, field.dtype)
        pa_mask = pa.array(mask) if mask.any() else None
        data = pa.ListArray.from_arrays(
            pa.array(offsets), pa.array(flat, type=arrow_scalar_type(field)), mask=pa_mask
        )
        if ndim == 1:
            return data
        shape_arr = pa.FixedSizeListArray.from_arrays(pa.array(shapes.reshape(-1)), ndim)
        return pa.StructArray.from_arrays([data, shape_arr], names=["data", "shape"], mask=pa_mask)

    def decode(self, field: Field, column: ArrowColumn) -> np.ndarray:
        arr = combine(column)
        check_no_null_elements(field, arr, "reading")
        nulls = mask_of(arr)
        data = arr.field("data") if pa.types.is_struct(arr.type) else arr
        if pa.types.is_struct(arr.type):
            ndim = arr.type.field("shape").type.list_size
            shapes = fixed_values(arr.field("shape"), (ndim,))
        else:
            shapes = None
        offsets = np.asarray(data.offsets.to_numpy())
        values = data.values.to_numpy(zero_copy_only=False)
        out = np.empty(len(arr), dtype=object)
        for i in range(len(arr)):
            if nulls is not None and nulls[i]:
                out[i] = None
                continue
            row = values[offsets[i] : offsets[i + 1]]
            out[i] = row if shapes is None else row.reshape(tuple(shapes[i]))
        return out
