"""The codec protocol: how one field's values become an Arrow column and come back as numpy.

A codec is data, not code: a frozen dataclass whose name and options serialize to JSON in the
dataset's schema. Decoding is columnar: a whole Arrow column becomes one numpy array (stacked when
every value has the same shape, an object array of per-row arrays otherwise). Nullable columns that
hold nulls decode to a ``numpy.ma.MaskedArray`` (numeric) or an object array with ``None`` entries.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import numpy as np
import pyarrow as pa

from shardkit.errors import SchemaError, SchemaMismatchError

if TYPE_CHECKING:
    from shardkit.dataset._field import Field

ArrowColumn: TypeAlias = pa.Array | pa.ChunkedArray


@dataclasses.dataclass(frozen=True)
class Codec:
    """Base class of every codec; subclasses set ``name`` and implement the four methods."""

    name: ClassVar[str] = ""
    #: Codecs that only read (e.g. Petastorm's) refuse to encode.
    writable: ClassVar[bool] = True

    def check(self, field: Field) -> None:
        """Raise `SchemaError` if this codec cannot store ``field`` (dtype, shape)."""

    def arrow_type(self, field: Field) -> pa.DataType:
        raise NotImplementedError

    def storage_type(self, field: Field) -> pa.DataType:
        """The type of the column in the Parquet files (by default the Arrow type itself)."""
        return self.arrow_type(field)

    def to_storage(self, field: Field, arr: pa.Array) -> pa.Array:
        """An encoded array (of `arrow_type`) as the Parquet files store it (of `storage_type`)."""
        return arr

    def encode(self, field: Field, values: Any) -> pa.Array:
        """Turn a column of values (numpy, pandas, list, or Arrow) into an Arrow array."""
        raise NotImplementedError

    def decode(self, field: Field, column: ArrowColumn) -> np.ndarray:
        """Turn an Arrow column into numpy (first axis = rows)."""
        raise NotImplementedError

    def stored_problem(self, field: Field, stored: pa.DataType) -> str | None:
        """Why a Parquet column of the Arrow type ``stored`` cannot hold ``field``, or None when it can.

        Checked when a dataset opens, from its metadata alone: a schema that no longer describes the
        files (a field renamed or retyped in the stored JSON) must fail there, not decode wrong values.
        Only what the type shows is checked (the kind of values, a tensor's size in values or bytes);
        codecs that do not override this accept any type.
        """
        return None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self)}


def plain_type(t: pa.DataType) -> pa.DataType:
    """``t`` without a dictionary encoding (a dictionary column decodes as its values)."""
    return t.value_type if pa.types.is_dictionary(t) else t


def is_text_type(t: pa.DataType) -> bool:
    t = plain_type(t)
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def is_bytes_type(t: pa.DataType) -> bool:
    t = plain_type(t)
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)
                or pa.types.is_fixed_size_binary(t))


def combine(column: ArrowColumn) -> pa.Array:
    """One contiguous Arrow array (zero-copy when the column already has a single chunk)."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            return column.chunk(0)
        if column.num_chunks == 0:
            return pa.array([], type=column.type)
        return column.combine_chunks()
    return column


def mask_of(array: pa.Array) -> np.ndarray | None:
    """Boolean null mask of an Arrow array, or None when it has no nulls."""
    if array.null_count == 0:
        return None
    return np.asarray(array.is_null().to_numpy(zero_copy_only=False), dtype=bool)


def first_null(array: pa.Array | pa.ChunkedArray) -> int:
    """Index of the first null of an Arrow array (or chunked array) that has one."""
    return int(np.argmax(array.is_null().to_numpy(zero_copy_only=False)))


def as_masked(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Wrap ``values`` in a MaskedArray whose row mask is ``mask`` (broadcast over tensor dims)."""
    if mask is None:
        return values
    full = np.broadcast_to(mask.reshape((-1,) + (1,) * (values.ndim - 1)), values.shape)
    return np.ma.MaskedArray(values, mask=full.copy())


def cast_array(field: Field, arr: np.ndarray, where: str) -> np.ndarray:
    """Cast ``arr`` to the field's dtype when it is the same kind of number, else raise.

    Policy (documented for users): any cast numpy calls "same_kind" is accepted (int -> wider
    int, int -> float, float64 -> float32), integers must also fit the target range; a cast across
    kinds (float -> int, str -> number) is a `SchemaMismatchError`. A cast must not lose a value
    either (`SchemaMismatchError` naming the first ones): a finite value that overflows to inf
    (1e300 as float32), an integer a float cannot hold exactly (2**53 + 1 as float64), a time finer
    than the declared unit or out of its range (nanoseconds as datetime64[s]). Rounding a float to a
    narrower float (0.1 as float32) is the one loss accepted: it is what declaring float32 asks for.
    """
    target = field.dtype
    if arr.dtype == target:
        return arr
    if arr.size == 0:  # no values, nothing to check: an empty list comes as float64 from numpy
        return arr.astype(target)
    cross_kind = arr.dtype == object or not np.can_cast(arr.dtype, target, casting="same_kind")
    if cross_kind and not (arr.dtype.kind in "iu" and target.kind in "iu"):
        if arr.dtype == object:  # e.g. strings, or a mix of types: no dtype of its own to suggest
            fix = f"convert the values to {field.dtype_name}"
        else:
            found = {"U": "str", "S": "bytes"}.get(arr.dtype.kind, arr.dtype.name)
            fix = f"convert the data, or declare Field({field.name!r}, {found!r}, ...)"
            if arr.dtype.kind == "f" and target.kind in "iu" and bool(np.isnan(arr).any()):
                # pandas makes an integer column with a missing value float64, the missing value NaN
                fix = (f"its NaN values look like missing values: to keep the integers, declare "
                       f"Field({field.name!r}, {field.dtype_name!r}, nullable=True) and pass the column "
                       f"with nulls for them (pandas: df[{field.name!r}].astype('Int64'); Arrow: an "
                       f"integer array with nulls), or {fix}")
        problem = (f"field {field.name!r} ({where}) is declared {field.dtype_name} but the data has dtype "
                   f"{arr.dtype}")
        raise SchemaMismatchError(f"{problem}; {fix}", problem=problem)
    if arr.dtype.kind in "iub" and target.kind in "iu" and arr.size:
        info = np.iinfo(target)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            problem = (f"field {field.name!r} ({where}) is declared {field.dtype_name} but holds values in "
                       f"[{lo}, {hi}], outside its range [{info.min}, {info.max}]")
            raise SchemaMismatchError(f"{problem}; declare a wider dtype", problem=problem)
    with np.errstate(all="ignore"):  # overflows are found below, and named
        out = arr.astype(target, copy=False)
        lossy = _lost(arr, out)
    if lossy is not None and lossy.any():
        bad = ", ".join(str(v) for v in arr[lossy][:3]) + (", ..." if lossy.sum() > 3 else "")
        problem = (f"field {field.name!r} ({where}) is declared {field.dtype_name} but its data "
                   f"({arr.dtype}) holds values that {field.dtype_name} cannot hold, which the cast would "
                   f"change: [{bad}]")
        raise SchemaMismatchError(f"{problem}; declare Field({field.name!r}, {arr.dtype.name!r}, ...) or "
                                  "convert the values first", problem=problem)
    return out


def _lost(arr: np.ndarray, out: np.ndarray) -> np.ndarray | None:
    """Where casting ``arr`` to ``out`` changed a value beyond rounding a float (see `cast_array`)."""
    src, dst = arr.dtype.kind, out.dtype.kind
    if dst == "f" and src == "f":
        lost = np.isinf(out) & np.isfinite(arr)
    elif dst == "f" and src in "iu":
        lost = np.isinf(out) | (out.astype(arr.dtype) != arr) | ((out < 0) != (arr < 0))
    elif dst in "mM" and src == dst:
        lost = (out.astype(arr.dtype) != arr) & ~np.isnat(arr) | (np.isnat(out) & ~np.isnat(arr))
    else:
        return None
    return np.asarray(lost, dtype=bool)


def null_error(field: Field, row: int, where: str) -> SchemaMismatchError:
    return SchemaMismatchError(
        f"field {field.name!r} ({where}) is not nullable but row {row} is null; fill the value, "
        f"or declare Field({field.name!r}, ..., nullable=True)"
    )


def check_options(codec_name: str, options: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise SchemaError(
            f"codec {codec_name!r} has no option(s) {unknown}; its options are {sorted(allowed) or 'none'}"
        )
