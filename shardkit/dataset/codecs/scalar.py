"""Scalar codec: one number, bool, timestamp, string or bytes value per row, as a native Parquet column."""

from __future__ import annotations

import dataclasses
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
    mask_of,
    null_error,
)
from shardkit.errors import SchemaError, SchemaMismatchError

if TYPE_CHECKING:
    from shardkit.dataset.schema import Field


def column_source(values: Any) -> pa.Array | np.ndarray:
    """Normalize an input column to either an Arrow array or a numpy array.

    pandas object/extension columns go through Arrow so that None/NA become nulls; float columns stay
    numpy so that NaN stays a value, not a null.
    """
    if isinstance(values, pa.ChunkedArray | pa.Array):
        return combine(values)
    if isinstance(values, np.ndarray):
        return values
    to_numpy = getattr(values, "to_numpy", None)
    if to_numpy is not None and hasattr(values, "dtype"):  # pandas Series / Index
        dtype = values.dtype
        if isinstance(dtype, np.dtype) and dtype != object:
            return np.asarray(to_numpy())
        return pa.array(values, from_pandas=True)
    values = list(values)
    if any(v is None for v in values):
        return pa.array(values)
    return np.asarray(values)


def arrow_scalar_type(field: Field) -> pa.DataType:
    kind = field.dtype.kind
    if kind == "U":
        return pa.string()
    if kind == "S":
        return pa.binary()
    try:
        return pa.from_numpy_dtype(field.dtype)
    except (pa.ArrowNotImplementedError, TypeError) as e:
        raise SchemaError(
            f"field {field.name!r}: dtype {field.dtype} has no Arrow equivalent; use a number, bool, "
            "datetime64, str or bytes dtype"
        ) from e


@dataclasses.dataclass(frozen=True)
class ScalarCodec(Codec):
    """Stores one value per row as a plain Parquet column (int/float/bool/timestamp/string/binary)."""

    name = "scalar"

    def check(self, field: Field) -> None:
        if field.shape != ():
            raise SchemaError(
                f"field {field.name!r}: the scalar codec stores shape (), not {field.shape}; "
                "use codec='tensor' for fixed shapes or 'ndarray' for variable ones"
            )
        if field.dtype.kind in "cOV":
            raise SchemaError(
                f"field {field.name!r}: dtype {field.dtype} cannot be stored; use a number, bool, "
                "datetime64, str or bytes dtype"
            )
        arrow_scalar_type(field)

    def arrow_type(self, field: Field) -> pa.DataType:
        return arrow_scalar_type(field)

    def encode(self, field: Field, values: Any) -> pa.Array:
        target = self.arrow_type(field)
        src = column_source(values)
        where = "writing"
        if field.dtype.kind in "US":
            out = self._encode_text(field, src, target)
        elif isinstance(src, np.ndarray):
            if src.dtype == object:
                src = pa.array(src.tolist())
                out = self._encode_arrow_number(field, src, target)
            else:
                out = pa.array(cast_array(field, src, where), type=target)
        else:
            out = self._encode_arrow_number(field, src, target)
        if not field.nullable and out.null_count:
            raise null_error(field, int(np.argmax(mask_of(out))), where)
        return out

    def _encode_text(self, field: Field, src: pa.Array | np.ndarray, target: pa.DataType) -> pa.Array:
        try:
            if isinstance(src, np.ndarray):
                if src.dtype.kind not in "USO":
                    raise SchemaMismatchError(
                        f"field {field.name!r} is declared {field.dtype_name} but the data has dtype "
                        f"{src.dtype}; convert the values to {field.dtype_name} first"
                    )
                return pa.array(src.tolist() if src.dtype == object else src, type=target)
            if src.type == pa.null():
                return pa.nulls(len(src), target)
            text_types = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
            is_text = any(t(src.type) for t in text_types)
            if (target == pa.string()) != is_text:
                raise SchemaMismatchError(
                    f"field {field.name!r} is declared {field.dtype_name} but the data has Arrow type "
                    f"{src.type}; convert the values to {field.dtype_name} first"
                )
            return src.cast(target)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise SchemaMismatchError(
                f"field {field.name!r} is declared {field.dtype_name} but holds other values ({e}); "
                f"convert the values to {field.dtype_name} first"
            ) from e

    def _encode_arrow_number(self, field: Field, src: pa.Array, target: pa.DataType) -> pa.Array:
        if src.type == target:
            return src
        if src.type == pa.null():
            return pa.nulls(len(src), target)
        try:
            src_dtype = np.dtype(src.type.to_pandas_dtype())
        except NotImplementedError:
            src_dtype = np.dtype(object)
        if src.null_count == 0 and src_dtype != object:
            data = src.to_numpy(zero_copy_only=False)
            return pa.array(cast_array(field, data, "writing"), type=target)
        # nulls present: check the kind on the non-null values, then let Arrow cast (keeps the nulls)
        cast_array(field, np.asarray(pc.drop_null(src).to_numpy(zero_copy_only=False)), "writing")
        try:
            return pc.cast(src, target, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise SchemaMismatchError(
                f"field {field.name!r} is declared {field.dtype_name}; its data ({src.type}) does not "
                f"convert: {e}"
            ) from e

    def decode(self, field: Field, column: ArrowColumn) -> np.ndarray:
        arr = combine(column)
        if field.dtype.kind in "US" or arr.null_count == 0:
            return arr.to_numpy(zero_copy_only=False)
        mask = mask_of(arr)
        filled = pc.fill_null(arr, pa.scalar(np.zeros((), field.dtype).item(), type=arr.type))
        return as_masked(filled.to_numpy(zero_copy_only=False), mask)
