"""Petastorm compatibility: its pickled Unischema read without running it, and its read-only codecs.

Petastorm (up to 0.13.1) pickles its ``Unischema`` into ``_common_metadata``. `petastorm_schema`
reads that pickle with `shardkit.dataset.petastorm._safe_pickle`, which allows only the classes below and
never imports or calls them, and maps the result to a shardkit `Schema`:

- ``ScalarCodec(<spark type>)`` -> `ScalarCodec` (a plain Parquet column), or
  ``petastorm.scalar`` for the two kinds of columns Petastorm converted while reading (below);
- ``NdarrayCodec()`` -> ``petastorm.ndarray``: ``np.save`` bytes per row;
- ``CompressedNdarrayCodec()`` -> ``petastorm.compressed_ndarray``: ``np.savez_compressed(arr=...)``
  bytes per row (a zip archive whose member ``arr.npy`` is deflated ``np.save`` bytes);
- ``CompressedImageCodec(fmt, quality)`` -> `ImageCodec` (fmt png or jpeg). Petastorm swapped RGB to
  OpenCV's BGR before encoding and OpenCV swapped it back while writing, so the files hold RGB.
  16-bit PNGs (a ``uint16`` field, e.g. depth maps), which `ImageCodec` does not hold, get the
  read-only ``petastorm.png16``, decoded by OpenCV as Petastorm did (``pip install 'shardkit[image]'``);
- no codec -> `ScalarCodec` for shape ``()``, shardkit's list-based `NdarrayCodec` otherwise.

A field's dtype is the numpy type the Unischema names, however it was pickled: a numpy scalar type
(``np.float32``, also ``np.intc``/``np.longlong``, which pickle under their own names), a
``np.dtype`` object, or Python's ``int``, ``float``, ``bool``, ``str``, ``bytes`` (as int64, float64,
bool, str, bytes: Petastorm returned Python objects for those, shardkit numpy arrays). Three need the
field's Spark type, which its ``ScalarCodec`` holds:

- ``np.datetime64`` has no unit: ``DateType`` fields are ``datetime64[D]`` and ``TimestampType``
  ones ``datetime64[us]``, Spark's own precision (the units Petastorm's values had);
- ``decimal.Decimal`` (``DecimalType``): Petastorm returned ``Decimal`` objects, which no numpy
  dtype holds; shardkit reads them as their exact decimal text, a ``str`` field (``'-100.25'``);
- ``np.bytes_`` over a Spark ``StringType`` column (the column Petastorm's Unischema makes for a
  ``np.bytes_`` field without a codec): the text's UTF-8 bytes. Petastorm's ``np.bytes_(text)``
  encoded ASCII and failed on any other character.

Nulls: a nullable field's nulls are masked (`shardkit.dataset.codecs.base`). Petastorm returned
None for them, except in float columns, where its pandas conversion turned them into NaN values.

The read-only ``petastorm.*`` codecs are in `shardkit.dataset.petastorm.codecs`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import numpy as np

from shardkit.dataset._field import Field
from shardkit.dataset.codecs import Codec, ImageCodec, NdarrayCodec, ScalarCodec
from shardkit.dataset.petastorm import _safe_pickle as safe_pickle
from shardkit.dataset.petastorm.codecs import (
    PetastormCompressedNdarrayCodec,
    PetastormNdarrayCodec,
    PetastormPng16Codec,
    PetastormScalarCodec,
)
from shardkit.dataset.schema import Schema
from shardkit.errors import SchemaError

__all__ = [
    "ALLOWED", "PetastormCompressedNdarrayCodec", "PetastormNdarrayCodec", "PetastormPng16Codec",
    "PetastormScalarCodec", "petastorm_schema",
]

_NUMPY_DTYPES = {
    **{n: n for n in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
    **{n: n for n in ("float16", "float32", "float64")},
    # numpy pickles a scalar type by its class's name, and these C types are classes of their own
    "intc": "int32", "uintc": "uint32", "longlong": "int64", "ulonglong": "uint64",
    "bool_": "bool", "bool": "bool", "str_": "str", "unicode_": "str", "bytes_": "bytes", "string_": "bytes",
}
_BUILTIN_DTYPES = {"int": "int64", "float": "float64", "bool": "bool", "str": "str", "bytes": "bytes"}
#: numpy types a Unischema may name that have no shardkit dtype: data types like the others (never
#: called), so refused as unreadable fields (`SchemaError`), not as unsafe pickles
_NUMPY_OTHER = ("object_", "void", "timedelta64", "complex64", "complex128", "clongdouble", "longdouble",
                "float128", "complex256")
#: The code a pickled ``np.dtype`` is rebuilt from (``np.dtype('f4')`` pickles as ``dtype('f4', ...)``).
_DTYPE_CODE = re.compile(r"[<>|=]?(?:\?|b1|[iu][1248]|f[248]|[US]\d{0,9})")
#: The unit of ``np.datetime64`` (which has none) by the Spark type of the field's ScalarCodec.
_TIME_UNITS = {"DateType": "D", "TimestampType": "us", "TimestampNTZType": "us"}
_SPARK_TYPES = (
    "NullType", "StringType", "CharType", "VarcharType", "BinaryType", "BooleanType", "DateType",
    "TimestampType", "TimestampNTZType", "DecimalType", "DoubleType", "FloatType", "ByteType", "IntegerType",
    "LongType", "ShortType", "ArrayType", "MapType", "StructField", "StructType", "DayTimeIntervalType",
    "YearMonthIntervalType",
)
_IMAGE_FORMATS: dict[str, Literal["png", "jpeg"]] = {"png": "png", "jpeg": "jpeg", "jpg": "jpeg"}
_CODECS = ("ScalarCodec", "NdarrayCodec", "CompressedNdarrayCodec", "CompressedImageCodec")
_UNISCHEMA, _FIELD = "petastorm.unischema.Unischema", "petastorm.unischema.UnischemaField"

#: Everything a Petastorm schema pickle may name; anything else is refused unread.
ALLOWED = frozenset({
    _UNISCHEMA, _FIELD, "collections.OrderedDict",
    *(f"petastorm.codecs.{c}" for c in _CODECS),
    *(f"numpy.{n}" for n in (*_NUMPY_DTYPES, *_NUMPY_OTHER, "datetime64", "dtype")),
    *(f"builtins.{n}" for n in _BUILTIN_DTYPES), "decimal.Decimal",
    *(f"pyspark.sql.types.{t}" for t in _SPARK_TYPES),
})
_ADVICE = ("Open it only if you trust its writer: read it with Petastorm itself and rewrite it with "
           "shardkit.write_dataset, whose schema is plain JSON.")


def petastorm_schema(blob: bytes, *, where: str) -> Schema:
    """The shardkit schema of a Petastorm dataset, from its pickled Unischema, without running it.

    Example:
        >>> md = pyarrow.parquet.read_metadata("/data/ds/_common_metadata")
        >>> petastorm_schema(md.metadata[b"dataset-toolkit.unischema.v1"], where="/data/ds/_common_metadata")
        Schema(id: int64, image: uint8[16, 16, 3])

    Raises:
        UnsafePickleError: the pickle names anything outside `ALLOWED`, or is malformed.
        SchemaError: the Unischema holds a field shardkit cannot represent.
    """
    tree = safe_pickle.load(blob, allowed=ALLOWED, where=where, advice=_ADVICE)
    state = tree.state if isinstance(tree, safe_pickle.Call) and tree.func.qualname == _UNISCHEMA else None
    fields = state.get("_fields") if isinstance(state, dict) else None
    entries: list[Any] = []
    if isinstance(fields, safe_pickle.Call) and fields.func.qualname == "collections.OrderedDict":
        # Python 3 adds the entries with SETITEMS; Python 2 passed them as the constructor's argument
        given = fields.args[0] if fields.args and isinstance(fields.args[0], list) else []
        entries = [*given, *fields.items]
    if not entries or not all(isinstance(e, tuple | list) and len(e) == 2 for e in entries):
        raise SchemaError(f"{where}: the Petastorm schema pickle does not hold a Unischema with a '_fields' "
                          "OrderedDict of fields; the file is not a Petastorm schema. Rewrite the dataset")
    return Schema([_field(value, where) for _key, value in entries])


def _r(value: Any) -> str:
    """A value from the pickle in a message: bounded (`safe_pickle.short_repr`), however large or nested."""
    return safe_pickle.short_repr(value)


def _field(uf: Any, where: str) -> Field:
    args = uf.args if isinstance(uf, safe_pickle.Call) and uf.func.qualname == _FIELD else ()
    if len(args) not in (4, 5):
        raise SchemaError(f"{where}: a Petastorm schema entry is not a UnischemaField ({_r(uf)}); "
                          "rewrite the dataset")
    name, dtype_ref, shape, codec = args[:4]
    nullable = args[4] if len(args) == 5 else False
    dims = tuple(shape) if isinstance(shape, tuple | list) else None
    if (not isinstance(name, str) or not isinstance(nullable, bool) or dims is None
            or not all(d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in dims)):
        raise SchemaError(f"{where}: the Petastorm field {_r(name)} has a malformed name, shape {_r(shape)} "
                          f"or nullable flag {_r(nullable)}; rewrite the dataset")
    spark = _spark_type(codec)
    try:
        dtype = _dtype(dtype_ref, spark)
        return Field(name, dtype, dims, _codec(codec, dims, dtype, spark), nullable)
    except SchemaError as e:
        raise SchemaError(f"{where}: the Petastorm field {_r(name)} cannot be read: {e}") from e


def _spark_type(codec: Any) -> str | None:
    """The name of the Spark type in a ``ScalarCodec`` (``'DateType'``), else None."""
    if not (isinstance(codec, safe_pickle.Call) and codec.func.qualname == "petastorm.codecs.ScalarCodec"):
        return None
    spark = codec.state.get("_spark_type") if isinstance(codec.state, dict) else None
    if isinstance(spark, safe_pickle.Call) and spark.func.module == "pyspark.sql.types":
        return spark.func.name
    return None


def _dtype(ref: Any, spark: str | None) -> str:
    """The shardkit dtype of a Unischema field's numpy type (see the module docstring)."""
    if isinstance(ref, safe_pickle.Global):
        if ref.module == "numpy" and ref.name in _NUMPY_DTYPES:
            return _NUMPY_DTYPES[ref.name]
        if ref.module == "builtins" and ref.name in _BUILTIN_DTYPES:
            return _BUILTIN_DTYPES[ref.name]
        if ref.qualname == "numpy.datetime64":
            if spark in _TIME_UNITS:
                return f"datetime64[{_TIME_UNITS[spark]}]"
            raise SchemaError(f"its dtype numpy.datetime64 has no unit, which shardkit takes from a "
                              f"ScalarCodec of the Spark types {sorted(_TIME_UNITS)}, and its codec has "
                              f"{spark or 'none'}. Rewrite the field with a datetime64 dtype of a unit, e.g. "
                              "'datetime64[us]'")
        if ref.qualname == "decimal.Decimal":
            if spark == "DecimalType":
                return "str"
            raise SchemaError(f"its dtype decimal.Decimal is read (as text) from a "
                              f"ScalarCodec(DecimalType()) only, and its codec has {spark or 'none'}. "
                              "Rewrite the field as 'str' or 'float64'")
    elif isinstance(ref, safe_pickle.Call) and ref.func.qualname == "numpy.dtype" and ref.args:
        code = ref.args[0]
        if isinstance(code, str) and _DTYPE_CODE.fullmatch(code):
            dtype = np.dtype(code)
            return {"U": "str", "S": "bytes"}.get(dtype.kind, dtype.name)
    raise SchemaError(f"its dtype {_r(ref)} has no shardkit dtype: shardkit reads the numpy types "
                      f"{sorted(set(_NUMPY_DTYPES.values()))} (as types, np.dtype objects or Python's "
                      f"{sorted(_BUILTIN_DTYPES)}), and numpy.datetime64 and decimal.Decimal of Spark dates, "
                      "timestamps and decimals. Rewrite the field with one of them")


def _codec(codec: Any, shape: tuple[int | None, ...], dtype: str, spark: str | None) -> Codec:
    if codec is None and shape != ():
        return NdarrayCodec()
    kind = "petastorm.codecs.ScalarCodec" if codec is None else (
        codec.func.qualname if isinstance(codec, safe_pickle.Call) else _r(codec))
    if kind == "petastorm.codecs.ScalarCodec":
        return PetastormScalarCodec() if dtype == "bytes" or spark == "DecimalType" else ScalarCodec()
    if kind == "petastorm.codecs.NdarrayCodec":
        return PetastormNdarrayCodec()
    if kind == "petastorm.codecs.CompressedNdarrayCodec":
        return PetastormCompressedNdarrayCodec()
    if kind == "petastorm.codecs.CompressedImageCodec":
        state = codec.state if isinstance(codec.state, dict) else {}
        written, quality = state.get("_image_codec", ".png"), state.get("_quality", 80)
        text = written if isinstance(written, str) else _r(written)  # str() of a nested list recurses
        fmt = _IMAGE_FORMATS.get(text.lstrip(".").lower())
        if fmt is None or not isinstance(quality, int):
            raise SchemaError(f"its CompressedImageCodec({_r(written)}, quality={_r(quality)}) is not PNG or "
                              "JPEG; shardkit decodes only those. Rewrite the images as PNG or JPEG")
        if dtype == "uint16" and fmt == "png":
            return PetastormPng16Codec()
        # the quality only matters when re-encoding; OpenCV accepted 0..100, shardkit 1..100
        return ImageCodec(fmt, min(max(quality, 1), 100))
    raise SchemaError(f"its codec {kind} is not one of Petastorm's {list(_CODECS)}; rewrite the dataset "
                      "with shardkit codecs")
