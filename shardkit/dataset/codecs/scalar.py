"""Scalar codec: one number, bool, timestamp, string or bytes value per row, as a native Parquet column."""

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
    is_bytes_type,
    is_text_type,
    mask_of,
    null_error,
    plain_type,
)
from shardkit.errors import SchemaError, SchemaMismatchError

if TYPE_CHECKING:
    from shardkit.dataset._field import Field


def column_source(values: Any) -> pa.Array | np.ndarray:
    """Normalize an input column to either an Arrow array or a numpy array.

    pandas object/extension columns go through Arrow so that None/NA become nulls; float columns stay
    numpy so that NaN stays a value, not a null.
    """
    if isinstance(values, pa.ChunkedArray | pa.Array):
        return _decoded(combine(values))
    if isinstance(values, np.ndarray):
        return values
    to_numpy = getattr(values, "to_numpy", None)
    if to_numpy is not None and hasattr(values, "dtype"):  # pandas Series / Index
        dtype = values.dtype
        if isinstance(dtype, np.dtype) and dtype.kind != "O":
            return np.asarray(to_numpy())
        try:
            array = _decoded(pa.array(values, from_pandas=True))
        except (TypeError, ValueError):  # objects Arrow cannot convert itself, e.g. numpy datetime64[D]
            if dtype.kind != "O":
                raise
            return column_source([None if _missing(v) else v for v in values])
        if dtype.kind == "O" and pa.types.is_floating(array.type) and pc.any(pc.is_nan(array)).as_py():
            # pandas counts NaN as missing in an object column; Arrow nulls only a Python float's NaN,
            # so a NaN still here was a numpy float32/float16 one
            array = pc.if_else(pc.is_nan(array), pa.scalar(None, array.type), array)
        return array
    values = list(values)
    if not values:
        return pa.array([], pa.null())  # no values: any type fits (numpy would say float64)
    if any(isinstance(v, str | bytes) for v in values):
        # Arrow, not numpy, for text: numpy's fixed-width 'U'/'S' arrays drop trailing NUL characters.
        return pa.array(values)
    nulls = np.fromiter((v is None for v in values), dtype=bool, count=len(values))
    if not nulls.any():
        return np.asarray(values)
    # numbers with None: numpy finds the dtype of the others (Arrow's own conversion rejects, e.g.,
    # numpy datetime64[D] scalars), and the None rows become Arrow nulls
    present = np.asarray([v for v in values if v is not None])
    if nulls.all() or present.dtype == object or present.ndim != 1:
        return pa.array(values)
    filled = np.zeros(len(values), present.dtype)
    filled[~nulls] = present
    return pa.array(filled, mask=nulls)


def _missing(value: Any) -> bool:
    """pandas' missing values in an object column: None, NaN, pd.NA."""
    pandas_na = type(value).__name__ == "NAType"
    nan = isinstance(value, float | np.floating) and math.isnan(value)
    return value is None or nan or pandas_na


def _decoded(array: pa.Array) -> pa.Array:
    """Dictionary-encoded values (Arrow dictionaries, pandas categoricals) as plain values."""
    return array.dictionary_decode() if pa.types.is_dictionary(array.type) else array


def arrow_scalar_type(field: Field) -> pa.DataType:
    kind = field.dtype.kind
    if kind == "U":
        return pa.string()
    if kind == "S":
        return pa.binary()
    try:
        return pa.from_numpy_dtype(field.dtype)
    except (pa.ArrowNotImplementedError, TypeError) as e:
        if kind in "mM":
            raise SchemaError(_time_unit_problem(field)) from e
        raise SchemaError(
            f"field {field.name!r}: dtype {field.dtype} has no Arrow equivalent; use a number, bool, "
            "datetime64, str or bytes dtype"
        ) from e


#: The units of numpy times that Arrow (and so Parquet) stores: datetime64[D] as date32, the others as
#: timestamps and durations. Others (years, weeks, hours, picoseconds, ...) have no Arrow type.
TIME_UNITS = {"M": ("s", "ms", "us", "ns", "D"), "m": ("s", "ms", "us", "ns")}
#: The stored unit to convert each other unit to, and what the conversion costs.
_TIME_TARGETS = {
    "M": {"Y": ("D", "exact"), "M": ("D", "exact"), "W": ("D", "exact"), "h": ("s", "exact"),
          "m": ("s", "exact")},
    "m": {"W": ("s", "exact"), "D": ("s", "exact"), "h": ("s", "exact"), "m": ("s", "exact")},
}
_FINER_THAN_NS = ("ns", "it drops what is finer than a nanosecond")


def _time_unit_problem(field: Field) -> str:
    """Why a datetime64/timedelta64 field's unit cannot be stored, and the dtype to convert to."""
    kind = field.dtype.kind
    base = "datetime64" if kind == "M" else "timedelta64"
    unit = np.datetime_data(field.dtype)[0]
    accepted = (f"{base} is stored in the units s, ms, us, ns" + (", and D for dates" if kind == "M" else ""))
    if unit == "generic":
        return f"field {field.name!r}: dtype {field.dtype} has no unit; {accepted}: declare e.g. '{base}[us]'"
    problem = f"field {field.name!r}: dtype {field.dtype} has a unit that Arrow and Parquet cannot store"
    if kind == "m" and unit in ("Y", "M"):  # no fixed length: numpy cannot convert them to seconds
        return (f"{problem} (a month or a year has no fixed length in seconds); {accepted}. Store the count "
                f"instead: Field({field.name!r}, 'int64') and values.astype('int64')")
    target, cost = _TIME_TARGETS[kind].get(unit, _FINER_THAN_NS)
    dtype = f"{base}[{target}]"
    return (f"{problem}; {accepted}. Declare Field({field.name!r}, {dtype!r}) and convert the values with "
            f"values.astype({dtype!r}) ({cost})")


def zoned_times_fix(name: str, unit: str, *, objects: bool = False) -> str:
    """How to make times that carry a time zone storable: the same instants as UTC wall times.

    shardkit refuses such times rather than converting them itself: a batch is numpy, whose datetime64
    has no zone, so it could keep only one of the instant and the local wall time, silently. ``objects``:
    the times are Python objects (a pandas object column, e.g. of times in several zones).
    """
    pandas = (f"pandas.to_datetime(df[{name!r}], utc=True).dt.tz_localize(None)" if objects
              else f"df[{name!r}].dt.tz_convert('UTC').dt.tz_localize(None)")
    return (f"convert them to UTC and drop the zone before writing: with pandas {pandas}, with Arrow "
            f"pyarrow.compute.cast(column, pyarrow.timestamp({unit!r})) (both keep each instant, as UTC wall "
            "time, as shardkit does for Spark timestamps; .dt.tz_localize(None) alone keeps local wall time "
            "instead)")


def scalar_stored_problem(field: Field, stored: pa.DataType) -> str | None:
    """`ScalarCodec.stored_problem`, also used for the values of a tensor (``stored``: their type)."""
    kind, t = field.dtype.kind, plain_type(stored)
    if kind == "U":
        ok = is_text_type(t)
    elif kind == "S":
        ok = is_bytes_type(t)
    elif kind == "M":  # Parquet has no seconds timestamp: datetime64[s] is stored as milliseconds
        ok = pa.types.is_timestamp(t) or pa.types.is_date(t)
    elif kind == "m":
        ok = pa.types.is_duration(t)
    else:
        ok = t == arrow_scalar_type(field)
    return None if ok else f"{field.dtype_name} values cannot be read from a column of type {stored}"


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

    def stored_problem(self, field: Field, stored: pa.DataType) -> str | None:
        """Text needs a string column, bytes a binary one, times a timestamp/date (datetime64) or
        duration (timedelta64) of any unit, and numbers a column of exactly the field's dtype."""
        return scalar_stored_problem(field, stored)

    def encode(self, field: Field, values: Any) -> pa.Array:
        target = self.arrow_type(field)
        try:
            src = column_source(values)
        except (TypeError, ValueError) as e:  # includes pa.ArrowTypeError and pa.ArrowInvalid
            raise SchemaMismatchError(
                f"field {field.name!r} is declared {field.dtype_name} but its values are not all of one "
                f"type ({e}); convert them to {field.dtype_name} first"
            ) from e
        where = "writing"
        if isinstance(src, np.ndarray) and src.ndim != 1:
            raise SchemaMismatchError(
                f"field {field.name!r} holds one value per row (shape ()) but its data has the shape "
                f"{src.shape}, {src.shape[1:]} per row; declare Field({field.name!r}, {field.dtype_name!r}, "
                f"{src.shape[1:]}) for a tensor, or give one value per row"
            )
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
            raise null_error(field, first_null(out), where)
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
        if pa.types.is_timestamp(src.type) and src.type.tz is not None and field.dtype.kind == "M":
            raise SchemaMismatchError(
                f"field {field.name!r} (writing) is declared {field.dtype_name} but its times carry the time "
                f"zone {src.type.tz!r} ({src.type}), and a datetime64 has none; "
                f"{zoned_times_fix(field.name, src.type.unit)}"
            )
        try:
            src_dtype = np.dtype(src.type.to_pandas_dtype())
        except (NotImplementedError, TypeError):  # no numpy dtype (a pandas one, e.g. with a time zone)
            src_dtype = np.dtype(object)
        if src_dtype.kind == "O":  # strings, bytes, decimals, nested values: not numbers of any kind
            raise SchemaMismatchError(
                f"field {field.name!r} (writing) is declared {field.dtype_name} but the data has the Arrow "
                f"type {src.type}; convert the values to {field.dtype_name} first"
            )
        # one cast, `cast_array`'s, with or without nulls: it is checked for lost values either way
        mask = mask_of(src)
        present = src if mask is None else pc.drop_null(src)
        values = cast_array(field, np.asarray(present.to_numpy(zero_copy_only=False)), "writing")
        if mask is None:
            return pa.array(values, type=target)
        full = np.zeros(len(src), field.dtype)
        full[~mask] = values
        return pa.array(full, mask=mask, type=target)

    def decode(self, field: Field, column: ArrowColumn) -> np.ndarray:
        arr = combine(column)
        if field.dtype.kind in "US":
            text: np.ndarray = arr.to_numpy(zero_copy_only=False)
            return text
        mask = mask_of(arr)
        if mask is not None:
            arr = pc.fill_null(arr, pa.scalar(np.zeros((), field.dtype).item(), type=arr.type))
        values = arr.to_numpy(zero_copy_only=False)
        if values.dtype != field.dtype:
            # Parquet has no seconds timestamp: datetime64[s] comes back as milliseconds
            values = values.astype(field.dtype)
        return as_masked(values, mask)
