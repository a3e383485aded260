"""`Schema` and `Field`: construction, JSON (the on-disk form), inference from pandas / Arrow / numpy."""

from __future__ import annotations

import datetime
import json
import re
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings

from shardkit import Field, ImageCodec, NdarrayCodec, ScalarCodec, Schema, TensorCodec
from shardkit.dataset.schema import (
    SCHEMA_KEY,
    SCHEMA_VERSION,
    field_from_arrow,
    infer_field,
    schema_from_arrow,
)
from shardkit.errors import SchemaError, SchemaMismatchError


@given(data=st.data())
@settings(max_examples=100, deadline=None)
def test_json_round_trip(strategies: SimpleNamespace, data: st.DataObject) -> None:
    schema = data.draw(strategies.schema(max_fields=4))
    text = schema.to_json()
    assert Schema.from_json(text) == schema
    assert Schema.from_json(text.encode()) == schema
    obj = json.loads(text)
    assert obj["version"] == SCHEMA_VERSION
    assert [f["name"] for f in obj["fields"]] == schema.names
    assert schema_from_arrow(schema.arrow_schema()) == schema
    assert hash(Schema.from_json(text)) == hash(schema)


def test_field_defaults_and_codecs() -> None:
    assert Field("a", "int64").codec == ScalarCodec()
    assert Field("a", "float32", (3, 4)).codec == TensorCodec()
    assert Field("a", "float32", (None, 4)).codec == NdarrayCodec()
    assert Field("a", "uint8", (8, 8), codec="image").codec == ImageCodec("png")
    assert Field("a", "uint8", (8, 8), codec={"name": "image", "format": "jpeg"}).codec == ImageCodec("jpeg")
    f = Field("a", np.float16, [2, 3])
    assert f.shape == (2, 3)
    assert f.dtype == np.float16
    assert f.nullable is False
    assert f.fixed_shape


@pytest.mark.parametrize(
    ("given_dtype", "name"),
    [
        ("str", "str"),
        (str, "str"),
        (np.str_, "str"),
        ("<U10", "str"),
        ("bytes", "bytes"),
        (bytes, "bytes"),
        ("S4", "bytes"),
        ("float16", "float16"),
        (np.uint64, "uint64"),
        (bool, "bool"),
        ("datetime64[us]", "datetime64[us]"),
        ("timedelta64[ns]", "timedelta64[ns]"),
    ],
)
def test_dtype_names(given_dtype: Any, name: str) -> None:
    assert Field("a", given_dtype).dtype_name == name
    assert Field.from_json(Field("a", given_dtype).to_json()).dtype_name == name


def test_fields_are_frozen_values() -> None:
    f = Field("a", "int64")
    with pytest.raises(AttributeError):
        f.name = "b"  # type: ignore[misc]
    assert f == Field("a", "int64")
    assert f != Field("a", "int64", nullable=True)
    assert len({f, Field("a", "int64")}) == 1


@pytest.mark.parametrize("name", ["", None, 3])
def test_field_name_must_be_a_string(name: Any) -> None:
    with pytest.raises(SchemaError, match="non-empty string"):
        Field(name, "int64")


@pytest.mark.parametrize("shape", [("a",), 3, (1.5j,)])
def test_field_shape_must_be_ints(shape: Any) -> None:
    with pytest.raises(SchemaError, match=r"'a': shape .* tuple of ints or None"):
        Field("a", "int64", shape)


def test_schema_sequence_behaviour() -> None:
    schema = Schema([Field("a", "int64"), Field("b", "str"), Field("c", "float32", (2,))])
    assert len(schema) == 3
    assert schema.names == ["a", "b", "c"]
    assert schema["b"] == schema[1]
    assert "c" in schema
    assert "z" not in schema
    assert [f.name for f in schema] == ["a", "b", "c"]
    assert schema.select(["c", "a"]).names == ["c", "a"]
    assert repr(schema) == "Schema(a: int64, b: str, c: float32[2])"
    with pytest.raises(KeyError, match=r"'z'.*\['a', 'b', 'c'\]"):
        schema["z"]
    assert schema != Schema([Field("a", "int64")])
    assert schema != "not a schema"


def test_duplicate_field_names() -> None:
    with pytest.raises(SchemaError, match="'b' twice"):
        Schema([Field("a", "int64"), Field("b", "int64"), Field("b", "str")])


def test_arrow_schema_types_and_metadata() -> None:
    schema = Schema(
        [
            Field("i", "int32"),
            Field("s", "str", nullable=True),
            Field("b", "bytes"),
            Field("t", "float16", (2, 3)),
            Field("v", "int8", (None,)),
            Field("m", "uint16", (None, 2)),
            Field("im", "uint8", (4, 4), codec="image"),
            Field("ts", "datetime64[ms]"),
        ]
    )
    arrow = schema.arrow_schema()
    assert arrow.field("i").type == pa.int32()
    assert not arrow.field("i").nullable
    assert arrow.field("s").nullable
    assert arrow.field("s").type == pa.string()
    assert arrow.field("b").type == pa.binary()
    assert arrow.field("t").type == pa.fixed_shape_tensor(pa.float16(), [2, 3])
    assert arrow.field("v").type == pa.list_(pa.int8())
    assert arrow.field("m").type == pa.struct(
        [("data", pa.list_(pa.uint16())), ("shape", pa.list_(pa.int32(), 2))]
    )
    assert arrow.field("im").type == pa.binary()
    assert arrow.field("ts").type == pa.timestamp("ms")
    assert Schema.from_json(arrow.metadata[SCHEMA_KEY]) == schema


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("{not json", ["not valid JSON"]),
        ("[]", ["no 'fields' list"]),
        ('{"version": 1, "fields": {}}', ["no 'fields' list"]),
        ('{"version": 3, "fields": []}', ["version 3", "versions [1, 2]", "pip install -U shardkit"]),
        ('{"fields": []}', ["version None", "Upgrade"]),
        ('{"version": 1, "fields": [{"name": "a"}]}', ["malformed", "dtype"]),
        ('{"version": 1, "fields": [{"name": "a", "dtype": "int64", "unit": "m"}]}', ["malformed", "unit"]),
        ('{"version": 1, "fields": [{"name": "a", "dtype": "int64", "codec": "lz"}]}', ["field 'a'", "'lz'"]),
        ('{"version": 1, "fields": [{"name": "a", "dtype": "complex128"}]}', ["field 'a'", "complex128"]),
    ],
)
def test_bad_schema_json(text: str, needles: list[str]) -> None:
    with pytest.raises(SchemaError) as info:
        Schema.from_json(text)
    for needle in needles:
        assert needle in str(info.value)


# --- encode / decode at the schema level ------------------------------------------------------------


def test_encode_names_missing_and_extra_columns() -> None:
    schema = Schema([Field("a", "int64"), Field("b", "int64")])
    with pytest.raises(SchemaMismatchError, match=r"no column\(s\) \['b'\].*data columns: \['a'\]"):
        schema.encode({"a": [1]}, 1)
    with pytest.raises(SchemaMismatchError, match=r"\['c'\].*does not declare"):
        schema.encode({"a": [1], "b": [1], "c": [1]}, 1)
    with pytest.raises(SchemaMismatchError, match="'b' has 2 rows, the others 1"):
        schema.encode({"a": [1], "b": [1, 2]}, 1)


def test_decode_any_subset_of_columns() -> None:
    schema = Schema([Field("a", "int64"), Field("b", "str"), Field("c", "float32", (2,))])
    table = schema.encode({"a": [1, 2], "b": ["x", "y"], "c": np.ones((2, 2), np.float32)}, 2)
    out = schema.decode(table.select(["c", "a"]))
    assert list(out) == ["c", "a"]
    assert out["a"].tolist() == [1, 2]
    assert out["c"].shape == (2, 2)


# --- inference --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (np.arange(3, dtype=np.int16), ("int16", (), False)),
        (np.zeros((3, 2, 5), np.float32), ("float32", (2, 5), False)),
        ([1, 2, 3], ("int64", (), False)),
        ([1.5, None], ("float64", (), True)),
        (["a", None, "b"], ("str", (), True)),
        ([b"a", b"b"], ("bytes", (), False)),
        ([np.zeros(2), np.zeros(3)], ("float64", (None,), False)),
        ([np.zeros((2, 3), np.uint8), np.zeros((4, 3), np.uint8), None], ("uint8", (None, 3), True)),
        ([[1, 2], [3]], ("int64", (None,), False)),
        ([[1, 2], []], ("int64", (None,), False)),  # an empty row says nothing about the dtype
        ([[1, 2], [3, 4]], ("int64", (2,), False)),
        (pd.Series([1, 2], dtype="int8"), ("int8", (), False)),
        (pd.Series([1, None], dtype="Int32"), ("int32", (), True)),
        (pd.Series([True, None], dtype="boolean"), ("bool", (), True)),
        (pd.Series(["a", None], dtype="string"), ("str", (), True)),
        (pd.Series(["a", "b"]), ("str", (), False)),
        (pd.Series(["a", "b", "a"], dtype="category"), ("str", (), False)),
        (pd.Series(pd.to_datetime(["2020-01-01", "2021-01-01"])), (None, (), False)),
        (np.array(["2020-01-01", "NaT"], "datetime64[s]"), ("datetime64[s]", (), True)),  # NaT is a null
        (np.array([1.0, np.nan]), ("float64", (), False)),  # NaN is a value
        ([datetime.date(2024, 1, 31), None], ("datetime64[D]", (), True)),  # as SQL and pandas give dates
        (pd.Series([datetime.date(2024, 1, 31)] * 2), ("datetime64[D]", (), False)),
        ([datetime.datetime(2024, 1, 31, 5, 6, 7, 8), None], ("datetime64[us]", (), True)),
        (pa.array([1, None], pa.uint32()), ("uint32", (), True)),
        (pa.chunked_array([pa.array([[1.0]], pa.list_(pa.float64()))]), ("float64", (None,), False)),
    ],
)
def test_infer_field(values: Any, expected: tuple[str | None, tuple[Any, ...], bool]) -> None:
    f = infer_field("c", values)
    dtype_name, shape, nullable = expected
    if dtype_name is not None:
        assert f.dtype_name == dtype_name
    else:
        assert f.dtype.kind == "M"
    assert (f.shape, f.nullable) == (shape, nullable)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([None, None], "only nulls"),
        ([np.zeros(2), np.zeros((2, 2))], r"mixes arrays of \[1, 2\] dimensions"),
        (np.zeros(2, np.complex64), "complex64"),
        ([{"a": 1}], "dict"),
        ([datetime.date(2024, 1, 1), datetime.datetime(2024, 1, 1, 3)], "mixes date, datetime.*times of day"),
        ([datetime.date(2024, 1, 1), 5], "mixes date, int values: they make no one type;"),
        ([1, "x", 2.5], r"mixes values of 2 kinds: number \(1 in row 0\), str \('x' in row 1\); they make "
                        r"no one type. Convert them to one \(pandas: df\['c'\].astype\(str\)\)"),
        (["x", None, b"y", 3],
         r"3 kinds: str \('x' in row 0\), bytes \(b'y' in row 2\), number \(3 in row 3\)"),
        ([datetime.datetime(2024, 1, 1), datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)], "zone 'UTC'"),
    ],
)
def test_infer_field_refuses(values: Any, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        infer_field("c", values)


@pytest.mark.parametrize(
    ("arrow_type", "expected"),
    [
        (pa.int8(), ("int8", ())),
        (pa.float16(), ("float16", ())),
        (pa.bool_(), ("bool", ())),
        (pa.string(), ("str", ())),
        (pa.large_string(), ("str", ())),
        (pa.binary(), ("bytes", ())),
        (pa.large_binary(), ("bytes", ())),
        (pa.timestamp("us"), ("datetime64[us]", ())),
        (pa.list_(pa.float32()), ("float32", (None,))),
        (pa.large_list(pa.int16()), ("int16", (None,))),
        (pa.list_(pa.uint8(), 4), ("uint8", (4,))),
        (pa.fixed_shape_tensor(pa.float64(), [2, 3]), ("float64", (2, 3))),
        (pa.dictionary(pa.int32(), pa.string()), ("str", ())),
    ],
)
def test_field_from_arrow(arrow_type: pa.DataType, expected: tuple[str, tuple[Any, ...]]) -> None:
    f = field_from_arrow(pa.field("c", arrow_type))
    assert (f.dtype_name, f.shape, f.nullable) == (*expected, True)


@pytest.mark.parametrize(
    "arrow_type",
    [
        pa.struct([("a", pa.int8())]),
        pa.map_(pa.string(), pa.int8()),
        pa.list_(pa.string()),
        pa.decimal128(10, 2),
    ],
)
def test_field_from_arrow_refuses_what_it_cannot_map(arrow_type: pa.DataType) -> None:
    with pytest.raises(SchemaError, match=r"'c' has the Arrow type .*select other columns"):
        field_from_arrow(pa.field("c", arrow_type))


# --- times with a time zone, Arrow types inference maps ---------------------------------------------

BERLIN = pd.Series(pd.date_range("2021-03-28 00:30", periods=4, freq="h", tz="Europe/Berlin"))


@pytest.mark.parametrize(
    ("make", "zone", "unit", "pandas_fix"),
    [
        (lambda: infer_field("x", BERLIN), "Europe/Berlin", "us",
         "df['x'].dt.tz_convert('UTC').dt.tz_localize(None)"),
        (lambda: infer_field("x", pa.array(BERLIN)), "Europe/Berlin", "us", ".dt.tz_convert('UTC')"),
        (lambda: field_from_arrow(pa.field("x", pa.timestamp("ms", tz="Asia/Tokyo"))), "Asia/Tokyo", "ms",
         ".dt.tz_convert('UTC')"),
        (lambda: Field("x", BERLIN.dtype), "Europe/Berlin", "us", ".dt.tz_convert('UTC')"),
        (lambda: Field("x", "datetime64[ns, UTC]"), "UTC", "ns", ".dt.tz_convert('UTC')"),
        (lambda: Field("x", pd.ArrowDtype(pa.timestamp("s", tz="+01:00"))), "+01:00", "s", ".dt.tz_convert"),
        # pandas keeps times in several zones as an object column of Timestamps
        (lambda: infer_field("x", pd.Series([pd.Timestamp("2020-01-01", tz="UTC"),
                                             pd.Timestamp("2020-01-01", tz="Europe/Berlin")])),
         "UTC", "us", "pandas.to_datetime(df['x'], utc=True).dt.tz_localize(None)"),
    ],
    ids=["pandas", "arrow", "arrow-field", "pandas-dtype", "dtype-text", "arrow-dtype", "object-column"],
)
def test_times_with_a_time_zone_are_refused_naming_the_conversion_to_utc(
        make: Any, zone: str, unit: str, pandas_fix: str) -> None:
    """Refused, not converted: a batch is numpy, whose datetime64 has no zone (see `Field`)."""
    with pytest.raises(SchemaError) as info:
        make()
    message = str(info.value)
    for needle in ["field 'x'", f"time zone {zone!r}", "without a zone", pandas_fix,
                   f"pyarrow.compute.cast(column, pyarrow.timestamp({unit!r}))", f"'datetime64[{unit}]'"]:
        assert needle in message, (needle, message)


def test_the_named_conversion_of_zoned_times_keeps_every_instant() -> None:
    df = pd.DataFrame({"x": BERLIN})  # across the switch to summer time
    df["x"] = df["x"].dt.tz_convert("UTC").dt.tz_localize(None)
    via_arrow = pc.cast(pa.array(BERLIN), pa.timestamp("us"))
    for data in (df["x"], via_arrow):
        field = infer_field("x", data)
        assert field.dtype_name == "datetime64[us]"
        got = Schema([field]).decode(pa.table({"x": Schema([field]).encode({"x": data}, 4).column(0)}))["x"]
        assert (pd.Series(got).dt.tz_localize("UTC") == BERLIN).all()


@pytest.mark.parametrize(
    ("arrow_type", "dtype_name"),
    [
        (pa.string_view(), "str"),
        (pa.large_string(), "str"),
        (pa.binary_view(), "bytes"),
        (pa.large_binary(), "bytes"),
        (pa.binary(3), "bytes"),
        (pa.dictionary(pa.int8(), pa.string_view()), "str"),
        (pa.date32(), "datetime64[D]"),
        (pa.date64(), "datetime64[D]"),
        (pa.duration("s"), "timedelta64[s]"),
        (pa.duration("ns"), "timedelta64[ns]"),
    ],
)
def test_field_from_arrow_maps_every_type_the_codecs_round_trip(arrow_type: pa.DataType,
                                                                dtype_name: str) -> None:
    f = field_from_arrow(pa.field("c", arrow_type))
    assert (f.dtype_name, f.shape, f.nullable, f.codec) == (dtype_name, (), True, ScalarCodec())


@pytest.mark.parametrize(
    ("arrow_type", "needles"),
    [
        (pa.null(), ["'c'", "only nulls", "Field('c', 'float32', nullable=True)"]),
        (pa.decimal128(10, 2), ["'c'", "decimal128(10, 2)", "cast(column, pyarrow.float64())", "string()"]),
        (pa.time64("us"), ["'c'", "time64[us]", "us since midnight", "pyarrow.int64()"]),
        (pa.timestamp("us", tz="UTC"), ["'c'", "time zone 'UTC'", "pyarrow.timestamp('us')"]),
    ],
)
def test_field_from_arrow_names_the_fix_for_types_it_cannot_map(arrow_type: pa.DataType,
                                                                needles: list[str]) -> None:
    with pytest.raises(SchemaError) as info:
        field_from_arrow(pa.field("c", arrow_type))
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.parametrize("nullable", ["no", "false", 1, 0, None, [True]])
def test_nullable_must_be_a_boolean(nullable: Any) -> None:
    """``bool("false")`` is True: a schema file's ``"nullable": "false"`` made the field nullable."""
    message = f"field 'a': nullable={nullable!r} must be True or False"
    with pytest.raises(SchemaError, match=re.escape(message)):
        Field("a", "int8", nullable=nullable)
    with pytest.raises(SchemaError, match="must be True or False"):
        Field.from_json({"name": "a", "dtype": "int8", "nullable": nullable})
    assert Field("a", "int8", nullable=np.bool_(True)).nullable is True
