"""`Field`: one column's description, its dtype (``'str'``, ``'bytes'``, numbers, times without a zone:
a zone-aware dtype is refused, naming the conversion), shape, codec and nullability, and its JSON entry.

Apart from `shardkit.dataset.schema` (which re-exports `Field`): a field is what each codec checks and
encodes against, and checking one needs nothing of a schema; the ordered set of fields, its stored
versioned JSON and the inference of fields from data are there.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from shardkit.dataset.codecs import Codec, NdarrayCodec, ScalarCodec, TensorCodec, codec_from_json
from shardkit.dataset.codecs.scalar import zoned_times_fix
from shardkit.errors import SchemaError

DTypeLike = Any
Shape = tuple[int | None, ...]


#: A zone-aware datetime dtype as text: pandas' ``datetime64[ns, UTC]``, Arrow's ``timestamp[us, tz=UTC]``.
_ZONED_TEXT = re.compile(r"\s*(?:datetime64|timestamp)\[(\w+),\s*(?:tz=)?([^\]]+)\]\s*")


def _zoned(value: Any) -> tuple[str, str] | None:
    """(unit, zone) of a time-zone-aware datetime dtype (pandas dtype, Arrow type or text), else None."""
    if isinstance(value, str):
        match = _ZONED_TEXT.fullmatch(value)
        return (match[1], match[2].strip()) if match else None
    arrow = getattr(value, "pyarrow_dtype", value)  # a pandas.ArrowDtype holds an Arrow type
    if isinstance(arrow, pa.TimestampType):
        return (str(arrow.unit), str(arrow.tz)) if arrow.tz is not None else None
    tz, unit = getattr(value, "tz", None), getattr(value, "unit", None)
    if tz is not None and isinstance(unit, str):  # pandas.DatetimeTZDtype
        return unit, str(tz)
    return None


def _zoned_error(name: str, unit: str, tz: str, what: str, *, objects: bool = False) -> SchemaError:
    return SchemaError(
        f"field {name!r}: times in the time zone {tz!r} ({what}) cannot be stored: shardkit stores "
        f"datetime64 without a zone (a batch is numpy, whose datetimes have none); "
        f"{zoned_times_fix(name, unit, objects=objects)}, and declare Field({name!r}, 'datetime64[{unit}]') "
        "if you declare a schema"
    )


def _dtype(value: DTypeLike, name: str) -> np.dtype[Any]:
    if value in ("str", str, np.str_):
        return np.dtype(np.str_)
    if value in ("bytes", bytes, np.bytes_):
        return np.dtype(np.bytes_)
    zoned = _zoned(value)
    if zoned is not None:
        raise _zoned_error(name, *zoned, what=f"dtype {value}")
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise SchemaError(
            f"field {name!r}: {value!r} is not a numpy dtype; use e.g. 'float32', 'int64', 'str'"
        ) from e
    if dtype.kind == "U":
        return np.dtype(np.str_)
    if dtype.kind == "S":
        return np.dtype(np.bytes_)
    if dtype.kind in "cOV":
        raise SchemaError(
            f"field {name!r}: dtype {dtype} cannot be stored; use a number, bool, datetime64, 'str' or "
            "'bytes'"
        )
    return dtype


def _default_codec(shape: Shape) -> Codec:
    if not shape:
        return ScalarCodec()
    if any(d is None for d in shape):
        return NdarrayCodec()
    return TensorCodec()


@dataclasses.dataclass(frozen=True, init=False)
class Field:
    """One column: ``Field("image", "uint8", (32, 32, 3), codec=ImageCodec("png"))``.

    Args:
        name: column name.
        dtype: numpy dtype of the values (``'str'`` and ``'bytes'`` for text and blobs). Times are
            ``datetime64`` in the units Arrow stores (s, ms, us, ns, and D for dates) or ``timedelta64``
            (s, ms, us, ns), without a time zone: a zone-aware dtype (``datetime64[ns, Europe/Berlin]``)
            is a `SchemaError` naming the conversion to UTC, never converted silently, because a batch
            is numpy and could keep only one of the instant and the local wall time.
        shape: per-row shape; ``()`` for scalars, ``None`` marks a variable dimension.
        codec: a `Codec` or a codec name; by default ``scalar`` for (), ``tensor`` for a fixed shape
            and ``ndarray`` for a shape with ``None``.
        nullable: whether a row may hold no value.
    """

    name: str
    dtype: np.dtype[Any]
    shape: Shape
    codec: Codec
    nullable: bool

    def __init__(
        self,
        name: str,
        dtype: DTypeLike,
        shape: Sequence[int | None] = (),
        codec: Codec | str | Mapping[str, Any] | None = None,
        nullable: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise SchemaError(f"a field name must be a non-empty string, got {name!r}")
        try:
            dims = tuple(None if d is None else int(d) for d in shape)
        except (TypeError, ValueError) as e:
            raise SchemaError(f"field {name!r}: shape {shape!r} must be a tuple of ints or None") from e
        if any(d is not None and d < 0 for d in dims):
            raise SchemaError(f"field {name!r}: shape {dims} has a negative dimension")
        if codec is None:
            codec_obj = _default_codec(dims)
        elif isinstance(codec, Codec):
            codec_obj = codec
        else:
            codec_obj = codec_from_json(codec, where=f"field {name!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", _dtype(dtype, name))
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "codec", codec_obj)
        if not isinstance(nullable, bool | np.bool_):  # bool("no") is True: a typo would make it nullable
            raise SchemaError(f"field {name!r}: nullable={nullable!r} must be True or False")
        object.__setattr__(self, "nullable", bool(nullable))
        codec_obj.check(self)

    @property
    def dims(self) -> tuple[int, ...]:
        """The shape's fixed sizes (variable dimensions left out): a fixed shape itself."""
        return tuple(int(d) for d in self.shape if d is not None)

    @property
    def dtype_name(self) -> str:
        """``'str'``, ``'bytes'`` or the numpy dtype's name (``'float32'``, ``'datetime64[ns]'``)."""
        return {"U": "str", "S": "bytes"}.get(self.dtype.kind, self.dtype.name)

    @property
    def fixed_shape(self) -> bool:
        return all(d is not None for d in self.shape)

    def arrow_field(self) -> pa.Field:
        return pa.field(self.name, self.codec.arrow_type(self), nullable=self.nullable)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype_name,
            "shape": list(self.shape),
            "codec": self.codec.to_json(),
            "nullable": self.nullable,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Field:
        known = {"name", "dtype", "shape", "codec", "nullable"}
        if not isinstance(obj, Mapping) or set(obj) - known or "name" not in obj or "dtype" not in obj:
            raise SchemaError(f"schema field entry {obj!r} is malformed; expected keys {sorted(known)}")
        shape, codec, nullable = obj.get("shape", ()), obj.get("codec"), obj.get("nullable", False)
        return cls(obj["name"], obj["dtype"], shape, codec, nullable)
