"""`Schema` and `Field`: what each column holds (dtype, shape, codec, nullability), stored as JSON; the
fields inferred from data (`infer_field`) and from Arrow types (`field_from_arrow`). `Field` itself is
`shardkit.dataset._field`'s.

The schema travels inside the Parquet files and summary files as versioned JSON under the key-value
metadata key ``shardkit.schema``; it is data only, so opening a dataset never runs code.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from shardkit.dataset._field import Field, _zoned, _zoned_error
from shardkit.dataset.codecs.base import first_null, is_bytes_type, is_text_type
from shardkit.errors import CorruptDatasetError, SchemaError, SchemaMismatchError

SCHEMA_KEY = b"shardkit.schema"
SCHEMA_VERSION = 2
#: Versions this shardkit reads. Version 1 predates the tensor codec's ``storage`` option: its
#: fixed-shape tensors are stored as fixed-size lists.
READABLE_VERSIONS = (1, 2)


class Schema(Sequence[Field]):
    """An ordered set of fields: ``Schema([Field("id", "int64"), Field("x", "float32", (128,))])``."""

    def __init__(self, fields: Sequence[Field]) -> None:
        self._fields = tuple(fields)
        self._by_name = {f.name: f for f in self._fields}
        if len(self._by_name) != len(self._fields):
            seen: set[str] = set()
            dup = next(f.name for f in self._fields if f.name in seen or seen.add(f.name))  # type: ignore[func-returns-value]
            raise SchemaError(f"schema has the field {dup!r} twice; field names must be unique")

    def __len__(self) -> int:
        return len(self._fields)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            try:
                return self._by_name[key]
            except KeyError:
                raise KeyError(f"no field {key!r} in the schema; fields are {self.names}") from None
        return self._fields[key]

    def __iter__(self) -> Iterator[Field]:
        return iter(self._fields)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and self._fields == other._fields

    def __hash__(self) -> int:
        return hash(self._fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}: {f.dtype_name}{list(f.shape) if f.shape else ''}" for f in self._fields)
        return f"Schema({inner})"

    @property
    def names(self) -> list[str]:
        return [f.name for f in self._fields]

    def select(self, names: Sequence[str]) -> Schema:
        return Schema([self[n] for n in names])

    def to_json(self) -> str:
        return json.dumps({"version": SCHEMA_VERSION, "fields": [f.to_json() for f in self._fields]})

    @classmethod
    def from_json(cls, text: str | bytes) -> Schema:
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise SchemaError(f"the stored shardkit schema is not valid JSON: {e}") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("fields"), list):
            raise SchemaError("the stored shardkit schema has no 'fields' list")
        version = obj.get("version")
        if version not in READABLE_VERSIONS:
            raise SchemaError(
                f"the stored shardkit schema has version {version!r}; this shardkit reads versions "
                f"{list(READABLE_VERSIONS)}. Upgrade shardkit: pip install -U shardkit"
            )
        fields = obj["fields"]
        if version == 1:
            fields = [_v1_tensor_storage(f) for f in fields]
        return cls([Field.from_json(f) for f in fields])

    def arrow_schema(self) -> pa.Schema:
        """The Arrow schema of encoded columns (`encode`), with this schema's JSON in its metadata."""
        return pa.schema([f.arrow_field() for f in self._fields], metadata={SCHEMA_KEY: self.to_json()})

    def storage_schema(self) -> pa.Schema:
        """The Arrow schema of the Parquet files: `arrow_schema` with each codec's stored layout."""
        fields = [pa.field(f.name, f.codec.storage_type(f), nullable=f.nullable) for f in self._fields]
        return pa.schema(fields, metadata={SCHEMA_KEY: self.to_json()})

    def to_storage(self, table: pa.Table) -> pa.Table:
        """An encoded table (of `arrow_schema`) as the Parquet files store it (`storage_schema`)."""
        schema = self.storage_schema()
        columns = [
            pa.chunked_array([f.codec.to_storage(f, chunk) for chunk in table.column(f.name).chunks],
                             type=schema.field(f.name).type)
            for f in self._fields
        ]
        return pa.Table.from_arrays(columns, schema=schema)

    def encode(self, columns: Mapping[str, Any], num_rows: int) -> pa.Table:
        """Encode a batch of columns into an Arrow table of this schema; raise on any mismatch."""
        missing = [n for n in self.names if n not in columns]
        if missing:
            problem = (f"the data has no column(s) {missing} declared in the schema (data columns: "
                       f"{sorted(columns)})")
            raise SchemaMismatchError(f"{problem}; add them, or leave them out of the schema",
                                      problem=problem)
        extra = sorted(set(columns) - set(self.names))
        if extra:
            problem = f"the data has column(s) {extra} that the schema does not declare"
            raise SchemaMismatchError(f"{problem}; add a Field for each or drop them before writing",
                                      problem=problem)
        arrays = []
        for f in self._fields:
            arr = f.codec.encode(f, columns[f.name])
            if len(arr) != num_rows:
                raise SchemaMismatchError(f"column {f.name!r} has {len(arr)} rows, the others {num_rows}")
            arrays.append(arr)
        return pa.Table.from_arrays(arrays, schema=self.arrow_schema())

    def decode(self, table: pa.Table | pa.RecordBatch) -> dict[str, np.ndarray]:
        """Decode an Arrow table (any subset of the columns) to a dict of numpy arrays.

        Raises:
            CorruptDatasetError: a null in a field that is not nullable (a file written outside shardkit,
                or for another schema): its row read as a masked value, or 0 under TensorFlow, unsaid.
                With ``on_error="skip"`` the reader loses that row only.
        """
        out = {}
        for name in table.column_names:
            field, column = self[name], table.column(name)
            if column.null_count and not field.nullable:
                raise stored_null_error(field, first_null(column))
            out[name] = field.codec.decode(field, column)
        return out


def stored_null_error(field: Field, row: int) -> CorruptDatasetError:
    """What reading a null in a field that is not nullable raises (``row``: its row in what was read)."""
    return CorruptDatasetError(
        f"field {field.name!r} is not nullable but row {row} is null: the file was written "
        "outside shardkit or for another schema; rewrite it with the field declared "
        f"Field({field.name!r}, ..., nullable=True), or read with on_error='skip'")


def _v1_tensor_storage(entry: Any) -> Any:
    """A version-1 field entry whose codec is the tensor codec, with that version's storage: lists."""
    if not isinstance(entry, Mapping):
        return entry
    codec = entry.get("codec")
    if codec == "tensor" or (isinstance(codec, Mapping) and codec.get("name") == "tensor"):
        spec = {"name": "tensor"} if isinstance(codec, str) else dict(codec)
        return {**entry, "codec": {"storage": "list", **spec}}
    if codec is None and entry.get("shape") and None not in entry["shape"]:
        return {**entry, "codec": {"name": "tensor", "storage": "list"}}
    return entry


def infer_field(name: str, values: Any) -> Field:
    """Infer a field from a column of data (numpy, pandas or Arrow); images are never guessed."""
    zoned = _zoned(getattr(values, "dtype", None))
    if zoned is not None:  # say the pandas dtype the user has, not the Arrow type it would become
        raise _zoned_error(name, *zoned, what=f"dtype {values.dtype}")
    if hasattr(values, "to_numpy") and not isinstance(getattr(values, "dtype", None), np.dtype | None):
        # pandas extension dtypes (Int64, boolean, string, ...): numpy would turn <NA> into float NaN
        # and infer float64 for an integer column; Arrow keeps the type and makes <NA> a null.
        values = pa.array(values, from_pandas=True)
    if isinstance(values, pa.ChunkedArray | pa.Array):
        return field_from_arrow(pa.field(name, values.type, nullable=values.null_count > 0))
    arr = values.to_numpy() if hasattr(values, "to_numpy") else _as_array(values)
    if arr.dtype != object:
        # NaT is stored as a null (NaN stays a value, as in the float codecs)
        nat = arr.dtype.kind in "mM" and bool(np.isnat(arr).any())
        return Field(name, arr.dtype, arr.shape[1:], nullable=nat)
    present = [v for v in arr if v is not None and not (isinstance(v, float) and np.isnan(v))]
    nullable = len(present) < len(arr)
    if not present:
        raise SchemaError(f"column {name!r} holds only nulls; declare its Field in a schema")
    _one_kind(name, arr)
    first = present[0]
    if isinstance(first, datetime.datetime) and first.tzinfo is not None:
        # an object column of zone-aware times: pandas makes one of times in more than one zone
        kind = type(first).__name__
        raise _zoned_error(name, "us", str(first.tzinfo), what=f"{kind} objects", objects=True)
    if isinstance(first, str):
        return Field(name, "str", (), nullable=nullable)
    if isinstance(first, bytes):
        return Field(name, "bytes", (), nullable=nullable)
    if isinstance(first, datetime.date):  # dates (as SQL and pandas give them) or naive datetimes
        return _infer_times(name, present, nullable)
    if not isinstance(first, np.ndarray | list | tuple):
        dtype = np.asarray(present).dtype
        if dtype.kind == "O":
            raise SchemaError(
                f"column {name!r} holds {type(first).__name__} values, which have no numpy dtype; convert "
                "them to numbers, str or bytes, or declare the column's Field"
            )
        return Field(name, dtype, (), nullable=nullable)
    shapes = {np.shape(v) for v in present}
    # empty rows say nothing about the dtype (numpy calls them float64)
    dtypes = [a.dtype for a in map(np.asarray, present[:64]) if a.size] or [np.dtype(np.float64)]
    dtype = np.result_type(*dtypes)
    ndims = {len(s) for s in shapes}
    if len(ndims) != 1:
        raise SchemaError(f"column {name!r} mixes arrays of {sorted(ndims)} dimensions; declare its Field")
    if len(shapes) == 1:
        return Field(name, dtype, next(iter(shapes)), nullable=nullable)
    shape = tuple(s0 if all(s[i] == s0 for s in shapes) else None for i, s0 in enumerate(next(iter(shapes))))
    return Field(name, dtype, shape, nullable=nullable)


def _kind(value: Any) -> str:
    """What a value of an object column makes: values of one kind infer one field (`_one_kind`)."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes):
        return "bytes"
    if isinstance(value, datetime.date):
        return "date or datetime"  # `_infer_times` tells them apart
    if isinstance(value, np.ndarray | list | tuple):
        return "array"
    if isinstance(value, bool | int | float | complex | np.number | np.bool_):
        return "number"
    return type(value).__name__


def _one_kind(name: str, values: np.ndarray) -> None:
    """`SchemaError` for an object column whose values (nulls aside) make no one type (str beside
    numbers): the first would otherwise decide the field, and the others fail to encode as if it had
    been declared."""
    kinds: dict[str, tuple[int, Any]] = {}
    for i, value in enumerate(values):
        if value is not None and not (isinstance(value, float) and np.isnan(value)):
            kinds.setdefault(_kind(value), (i, value))
    if len(kinds) > 1 and next(iter(kinds)) != "date or datetime":  # `_infer_times` names what they mix
        seen = ", ".join(f"{kind} ({value!r} in row {i})" for kind, (i, value) in kinds.items())
        raise SchemaError(f"column {name!r} mixes values of {len(kinds)} kinds: {seen}; they make no one "
                          f"type. Convert them to one (pandas: df[{name!r}].astype(str)), or declare the "
                          "column's Field")


def _infer_times(name: str, present: list[Any], nullable: bool) -> Field:
    """A column of ``datetime.date`` objects -> ``datetime64[D]``; of naive ``datetime.datetime`` ->
    ``datetime64[us]`` (Python's resolution), as pyarrow reads them (date32, timestamp[us]).

    Refused: dates mixed with datetimes (pyarrow would make them all dates, dropping the times of
    day), other values among them, and zone-aware datetimes (see `_zoned_error`)."""
    times = [v for v in present if isinstance(v, datetime.datetime)]
    aware = next((v for v in times if v.tzinfo is not None), None)
    if aware is not None:
        raise _zoned_error(name, "us", str(aware.tzinfo), what="datetime objects", objects=True)
    dates = sum(isinstance(v, datetime.date) and not isinstance(v, datetime.datetime) for v in present)
    if len(times) + dates != len(present) or (times and dates):
        kinds = ", ".join(sorted({type(v).__name__ for v in present}))
        lost = " (as dates, the times of day would be lost)" if times and dates else ""
        raise SchemaError(f"column {name!r} mixes {kinds} values: they make no one type{lost}; make them "
                          "all dates or all datetimes, or declare the column's Field")
    arrow = pa.array(present)
    return field_from_arrow(pa.field(name, arrow.type, nullable=nullable))


def _as_array(values: Any) -> np.ndarray:
    """``values`` as numpy; rows of different shapes (which numpy refuses to stack), and numbers among
    strings (which numpy would turn into strings: ``[1, "x"]`` is ``['1', 'x']``), as an object array."""
    if isinstance(values, np.ndarray):
        return values
    items = list(values)
    try:
        arr = np.asarray(items)
        if arr.ndim != 1 or arr.dtype.kind not in "US" or all(isinstance(v, str | bytes) for v in items):
            return arr
    except ValueError:
        pass
    arr = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        arr[i] = v
    return arr


def field_from_arrow(af: pa.Field) -> Field:
    """Map an Arrow field (of a plain Parquet file, or of data to write) to a shardkit field.

    Every layout of text (string, large_string, string_view) is ``str``, of blobs (binary,
    large_binary, binary_view, fixed_size_binary) ``bytes``; date32 and date64 are dates,
    ``datetime64[D]``; timestamps and durations keep their unit. A timestamp with a time zone is a
    `SchemaError` naming the conversion to UTC (see `Field`); so is any type the codecs cannot write
    and read back unchanged (decimals, times of day, structs, maps, lists of non-numbers).
    """
    t = af.type
    if isinstance(t, pa.FixedShapeTensorType):
        return Field(af.name, t.value_type.to_pandas_dtype(), tuple(t.shape), nullable=af.nullable)
    if is_text_type(t):  # any layout, dictionary-encoded too
        return Field(af.name, "str", (), nullable=af.nullable)
    if is_bytes_type(t):
        return Field(af.name, "bytes", (), nullable=af.nullable)
    if pa.types.is_date(t):  # both count days (date64 in milliseconds): numpy's dates
        return Field(af.name, "datetime64[D]", (), nullable=af.nullable)
    if pa.types.is_timestamp(t) and t.tz is not None:
        raise _zoned_error(af.name, t.unit, t.tz, what=f"Arrow type {t}")
    if pa.types.is_fixed_size_list(t) and _is_number(t.value_type):
        return Field(af.name, t.value_type.to_pandas_dtype(), (t.list_size,), nullable=af.nullable)
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_number(t.value_type):
        return Field(af.name, t.value_type.to_pandas_dtype(), (None,), nullable=af.nullable)
    if pa.types.is_dictionary(t):
        return field_from_arrow(pa.field(af.name, t.value_type, af.nullable))
    if _is_number(t) or pa.types.is_timestamp(t) or pa.types.is_duration(t):
        return Field(af.name, t.to_pandas_dtype(), (), nullable=af.nullable)
    if pa.types.is_null(t):
        raise SchemaError(
            f"column {af.name!r} holds only nulls (Arrow type null), which says nothing of its dtype; "
            f"declare its Field in a schema, e.g. Field({af.name!r}, 'float32', nullable=True)"
        )
    fix = _cast_hint(t) or "rewrite the column as numbers, strings, bytes or lists of numbers"
    raise SchemaError(
        f"column {af.name!r} has the Arrow type {t}, which shardkit does not map to a field; {fix}, or "
        "select other columns"
    )


def _cast_hint(t: pa.DataType) -> str | None:
    """The cast that makes a column of the Arrow type ``t`` storable, where there is an obvious one."""
    if pa.types.is_decimal(t):
        return "cast it with pyarrow.compute.cast(column, pyarrow.float64()) (rounds) or to pyarrow.string()"
    if pa.types.is_time(t):
        return f"cast it to {t.unit} since midnight with pyarrow.compute.cast(column, pyarrow.int64())"
    return None


def _is_number(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def schema_from_arrow(arrow_schema: pa.Schema) -> Schema:
    """The shardkit schema stored in ``arrow_schema``'s metadata, else one inferred from its types."""
    meta = arrow_schema.metadata or {}
    if SCHEMA_KEY in meta:
        return Schema.from_json(meta[SCHEMA_KEY])
    return Schema([field_from_arrow(f) for f in arrow_schema])


__all__ = ["Schema", "field_from_arrow", "infer_field", "schema_from_arrow"]
