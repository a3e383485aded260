"""Codecs: every dtype and shape encodes to Arrow, survives Parquet, and decodes to the same values."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings

import shardkit
from shardkit import Field, ImageCodec, NdarrayCodec, ScalarCodec, Schema, TensorCodec
from shardkit.dataset.codecs import CODECS, codec_from_json
from shardkit.errors import CorruptDatasetError, SchemaError, SchemaMismatchError


def through_parquet(table: pa.Table) -> pa.Table:
    """``table`` written to Parquet in memory and read back (nulls, extension types and all)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return pq.read_table(pa.BufferReader(sink.getvalue()))


def round_trip(schema: Schema, columns: dict[str, Any], num_rows: int) -> dict[str, np.ndarray]:
    """Encode, store as the writer does (`Schema.to_storage`), write to Parquet, read, decode."""
    return schema.decode(through_parquet(schema.to_storage(schema.encode(columns, num_rows))))


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_every_dtype_and_shape_round_trips_through_parquet(
    strategies: SimpleNamespace, helpers: SimpleNamespace, data: st.DataObject
) -> None:
    schema = data.draw(strategies.schema())
    n = data.draw(st.integers(0, 6))
    columns = {f.name: data.draw(strategies.column(f, n)) for f in schema}

    table = schema.encode(columns, n)
    assert table.schema.equals(schema.arrow_schema(), check_metadata=True)
    decoded = schema.decode(through_parquet(table))

    helpers.assert_rows_equal(
        schema, columns, {name: helpers.column_rows(col) for name, col in decoded.items()}
    )
    for field in schema:
        col = decoded[field.name]
        if field.dtype.kind in "US":  # text decodes to an object array of str / bytes
            assert col.dtype == object
            assert col.shape == (n,)
        elif field.fixed_shape:  # scalars and fixed tensors stack to (rows, *shape) of the field's dtype
            assert col.dtype == field.dtype
            assert col.shape == (n, *field.shape)
        else:
            assert col.dtype == object
            assert col.shape == (n,)


@pytest.mark.parametrize("dtype", ["int8", "uint64", "float16", "bool", "datetime64[s]", "timedelta64[ms]"])
def test_nullable_scalars_decode_to_masked_arrays_of_the_field_dtype(dtype: str) -> None:
    field = Field("x", dtype, nullable=True)
    values = np.arange(3).astype(dtype)
    out = round_trip(Schema([field]), {"x": [values[0], None, values[2]]}, 3)["x"]
    assert isinstance(out, np.ma.MaskedArray)
    assert out.dtype == np.dtype(dtype)
    assert out.mask.tolist() == [False, True, False]
    assert out[0] == values[0]
    assert out[2] == values[2]


@pytest.mark.parametrize("dtype", ["int16", "uint8", "float32", "bool"])
def test_nullable_tensor_keeps_its_dtype_after_parquet(dtype: str) -> None:
    # Parquet hands back null child slots for null rows; they must not turn ints into float NaN
    field = Field("t", dtype, (2, 3), nullable=True)
    a = (np.arange(6) % 2).astype(dtype).reshape(2, 3)
    out = round_trip(Schema([field]), {"t": [a, None, a]}, 3)["t"]
    assert isinstance(out, np.ma.MaskedArray)
    assert out.dtype == np.dtype(dtype)
    assert out.shape == (3, 2, 3)
    assert np.ma.getmaskarray(out)[:, 0, 0].tolist() == [False, True, False]
    np.testing.assert_array_equal(out.data[2], a)


def test_nullable_variable_tensor_with_nulls_after_parquet() -> None:
    field = Field("v", "int32", (None, 2), nullable=True)
    rows = [np.arange(6, dtype=np.int32).reshape(3, 2), None, np.zeros((0, 2), np.int32)]
    out = round_trip(Schema([field]), {"v": rows}, 3)["v"]
    assert out[1] is None
    np.testing.assert_array_equal(out[0], rows[0])
    assert out[2].shape == (0, 2)


_NULL_ELEMENT_INPUTS = {
    "fixed_size_list": (pa.array([[1.5, 2.0], [3.0, None], None], pa.list_(pa.float32(), 2)), (2,)),
    "int fixed_size_list": (pa.array([[7, 8], [None, 4], None], pa.list_(pa.int32(), 2)), (2,)),
    "fixed_shape_tensor": (pa.ExtensionArray.from_storage(
        pa.fixed_shape_tensor(pa.float32(), [2]),
        pa.array([[1.5, 2.0], [3.0, None], None], pa.list_(pa.float32(), 2))), (2,)),
    "list": (pa.array([[1.5], [3.0, None], None], pa.list_(pa.float32())), (None,)),
    "int list": (pa.array([[7], [None, 4], None], pa.list_(pa.int32())), (None,)),
}


@pytest.mark.parametrize("storage", ["bytes", "list"])
@pytest.mark.parametrize("case", sorted(_NULL_ELEMENT_INPUTS))
def test_a_null_element_inside_a_tensor_row_is_refused_naming_the_row(case: str, storage: str) -> None:
    """A regression: a null element of a valid row was written as 0 (fixed shapes) or NaN (variable)."""
    arr, shape = _NULL_ELEMENT_INPUTS[case]
    dtype = "int32" if case.startswith("int") else "float32"
    codec = TensorCodec(storage=storage) if None not in shape else None
    field = Field("x", dtype, shape, nullable=True, codec=codec)
    with pytest.raises(SchemaMismatchError, match=r"field 'x' \(writing\): row 1 holds a null element"):
        Schema([field]).encode({"x": arr}, 3)
    # the same values without the null element (and with the null row) are written and read back
    good = pa.array([[1, 2], [3, 4], None], arr.type.storage_type if isinstance(arr, pa.ExtensionArray)
                    else arr.type)
    out = round_trip(Schema([field]), {"x": good}, 3)["x"]
    assert np.asarray(out[1]).tolist() == [3, 4]


@pytest.mark.parametrize("value_type", [pa.list_(pa.float32(), 2), pa.list_(pa.float32())])
def test_plain_parquet_with_a_null_element_is_refused_on_read(value_type: pa.DataType) -> None:
    """Data written by another tool: the null element is not read as 0 (or NaN)."""
    table = through_parquet(pa.table({"x": pa.array([[1.0, 2.0], None, [None, 4.0]], value_type)}))
    shape: tuple[int | None, ...] = (2,) if pa.types.is_fixed_size_list(value_type) else (None,)
    field = Field("x", "float32", shape, nullable=True,
                  codec=TensorCodec(storage="list") if shape == (2,) else None)
    with pytest.raises(SchemaMismatchError, match=r"field 'x' \(reading\): row 2 holds a null element"):
        Schema([field]).decode(table)


def test_fixed_tensors_decode_without_copying() -> None:
    field = Field("t", "float32", (4, 4))
    values = np.random.default_rng(0).random((5, 4, 4), dtype=np.float32)
    table = through_parquet(Schema([field]).encode({"t": values}, 5))
    out = Schema([field]).decode(table)["t"]
    np.testing.assert_array_equal(out, values)
    assert not out.flags.owndata  # a view of the Arrow buffer


def test_strings_and_bytes_keep_trailing_nul_characters() -> None:
    schema = Schema([Field("s", "str"), Field("b", "bytes")])
    rows = {"s": ["a\x00", "\x00", ""], "b": [b"ab\x00\x00", b"\x00", b""]}
    out = round_trip(schema, rows, 3)
    assert out["s"].tolist() == rows["s"]
    assert out["b"].tolist() == rows["b"]


def test_nan_is_a_value_and_none_is_a_null() -> None:
    field = Field("x", "float64", nullable=True)
    out = round_trip(Schema([field]), {"x": [np.nan, None, 1.5]}, 3)["x"]
    assert np.ma.getmaskarray(out).tolist() == [False, True, False]
    assert np.isnan(out.data[0])


@pytest.mark.parametrize("nan", [float("nan"), np.float64("nan"), np.float32("nan"), np.float16("nan")])
def test_nan_in_a_pandas_object_column_is_missing_whatever_its_type(nan: Any) -> None:
    # pandas' convention; numpy float32/float16 NaNs used to stay values (only Python floats' became nulls)
    import pandas as pd

    field = Field("x", "float32", nullable=True)
    out = round_trip(Schema([field]), {"x": pd.Series([None, nan, 1.5], dtype=object)}, 3)["x"]
    assert np.ma.getmaskarray(out).tolist() == [True, True, False]


def test_nan_in_an_int_field_suggests_nullable_and_that_fix_works() -> None:
    """pandas makes an integer column with a missing value float64 (NaN): the error says how to keep the
    integers (nullable=True with nulls), not only float64, and doing what it says writes them."""
    frame = pd.DataFrame({"n": [1.0, np.nan, 3.0]})
    with pytest.raises(SchemaMismatchError, match=r"declare Field\('n', 'int64', nullable=True\) and pass "
                                                  r"the column with nulls .*df\['n'\].astype\('Int64'\)"):
        Schema([Field("n", "int64")]).encode({"n": frame["n"].to_numpy()}, 3)
    fixed = {"n": frame["n"].astype("Int64")}
    out = round_trip(Schema([Field("n", "int64", nullable=True)]), fixed, 3)["n"]
    assert np.ma.getmaskarray(out).tolist() == [False, True, False]
    assert out.dtype == np.int64
    assert out.data[[0, 2]].tolist() == [1, 3]


# --- the cast policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("declared", "data"),
    [
        ("int64", np.arange(3, dtype=np.int8)),
        ("int8", np.arange(3, dtype=np.int64)),  # narrower but in range
        ("float32", np.arange(3, dtype=np.int32)),
        ("float32", np.linspace(0, 1, 3)),
        ("uint8", np.arange(3, dtype=np.int64)),
    ],
)
def test_same_kind_casts_are_accepted(declared: str, data: np.ndarray) -> None:
    out = round_trip(Schema([Field("x", declared)]), {"x": data}, 3)["x"]
    assert out.dtype == np.dtype(declared)
    np.testing.assert_array_equal(out, data.astype(declared))


@pytest.mark.parametrize(
    ("declared", "data", "needles"),
    [
        ("int64", np.array([1.0, 2.5]), ["'x'", "int64", "float64"]),
        ("float32", np.array(["a", "b"]), ["'x'", "float32", "'str'"]),
        ("float32", ["a", "b"], ["'x'", "float32"]),
        ("int8", np.array([1, 300]), ["'x'", "int8", "300", "[-128, 127]"]),
        ("uint8", np.array([-1, 3]), ["'x'", "uint8", "-1"]),
        ("bool", np.array([0, 1]), ["'x'", "bool", "int64"]),
        ("datetime64[ns]", np.array([1, 2]), ["'x'", "datetime64[ns]", "int64"]),
        ("str", np.array([1, 2]), ["'x'", "str", "int64"]),
        ("bytes", ["a", "b"], ["'x'", "bytes", "string"]),
    ],
)
def test_casts_across_kinds_raise_naming_field_and_dtypes(
    declared: str, data: Any, needles: list[str]
) -> None:
    with pytest.raises(SchemaMismatchError) as info:
        Schema([Field("x", declared)]).encode({"x": data}, 2)
    for needle in needles:
        assert needle in str(info.value)


CASTS = [
    ("float64", "float32"), ("float64", "float16"), ("float32", "float16"), ("int64", "float64"),
    ("int32", "float32"), ("uint16", "float16"), ("int64", "int32"), ("uint64", "int64"),
    ("datetime64[ns]", "datetime64[s]"), ("datetime64[us]", "datetime64[ms]"),
    ("datetime64[s]", "datetime64[ns]"), ("timedelta64[ns]", "timedelta64[ms]"),
]


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_a_cast_keeps_every_value_or_raises_with_or_without_nulls(data: st.DataObject) -> None:
    # Arrow input with a null used to take Arrow's safe cast, without one numpy's unchecked one:
    # nanoseconds into datetime64[s] were refused or truncated, 1e300 into float32 became inf either way
    source, declared = data.draw(st.sampled_from(CASTS))
    ints = st.integers(-(2**63) + 1, 2**63 - 1)  # -2**63 is NaT
    if np.dtype(source).kind in "mM":
        values = data.draw(hnp.arrays(np.int64, st.integers(1, 4), elements=ints)).view(source)
    else:
        values = data.draw(hnp.arrays(source, st.integers(1, 4)))
    field = Field("v", declared, nullable=True)
    outcomes = []
    for nulls in (0, 1):
        null_row = np.arange(len(values) + nulls) >= len(values)
        column = pa.array(np.concatenate([values, values[:nulls]]), mask=null_row)
        try:
            out = ScalarCodec().encode(field, column)
        except SchemaMismatchError as e:
            outcomes.append(str(e))
            continue
        got = out.to_numpy(zero_copy_only=False)[: len(values)].astype(declared)
        with np.errstate(all="ignore"):
            if np.dtype(source).kind == "f":  # rounded to the narrower float, never to inf
                assert np.array_equal(got, values.astype(declared), equal_nan=True)
                assert (np.isfinite(got) == np.isfinite(values)).all()
            else:  # exact
                assert (got.astype(source) == values).all()
        outcomes.append(got)
    assert isinstance(outcomes[0], str) == isinstance(outcomes[1], str)
    assert all("'v'" in o for o in outcomes if isinstance(o, str))


def test_lossy_casts_name_the_field_and_the_values() -> None:
    field = Field("t", "datetime64[s]", nullable=True)
    column = pa.array([1_500_000_000, 2_000_000_000, None], pa.timestamp("ns"))
    with pytest.raises(SchemaMismatchError, match=r"'t'.*datetime64\[s\].*01\.500000000.*datetime64\[ns\]"):
        ScalarCodec().encode(field, column)
    with pytest.raises(SchemaMismatchError, match=r"'x'.*float32.*1e\+300.*'float64'"):
        TensorCodec().encode(Field("x", "float32", (2,)), np.array([[0.5, 1e300]]))


def test_mixed_python_types_in_a_column_raise_schema_mismatch() -> None:
    with pytest.raises(SchemaMismatchError, match=r"'x'.*float32"):
        Schema([Field("x", "float32", nullable=True)]).encode({"x": ["a", None, 1]}, 3)


# --- tensors ---------------------------------------------------------------------------------------


def test_tensor_shape_mismatch_names_field_row_and_shapes() -> None:
    schema = Schema([Field("t", "float32", (2, 2))])
    with pytest.raises(SchemaMismatchError) as info:
        schema.encode({"t": [np.zeros((2, 2)), np.zeros((3, 2))]}, 2)
    for needle in ["'t'", "row 1", "(3, 2)", "(2, 2)", "None"]:
        assert needle in str(info.value)
    with pytest.raises(SchemaMismatchError, match=r"'t'.*\(2, 2\).*\(3,\)"):
        schema.encode({"t": np.zeros((2, 3))}, 2)


def test_variable_tensor_rank_mismatch_raises() -> None:
    schema = Schema([Field("v", "int64", (None, 3))])
    with pytest.raises(SchemaMismatchError, match=r"'v'.*row 1.*\(3,\)"):
        schema.encode({"v": [np.zeros((1, 3), np.int64), np.zeros(3, np.int64)]}, 2)
    with pytest.raises(SchemaMismatchError, match=r"'v'.*row 0.*\(2, 2\)"):
        schema.encode({"v": [np.zeros((2, 2), np.int64)]}, 1)


@pytest.mark.parametrize(
    ("field_args", "needles"),
    [
        (("t", "str", (2,)), ["'t'", "numbers"]),
        (("t", "datetime64[ns]", (2,)), ["'t'", "numbers"]),
        (("t", "float32", (None,), "tensor"), ["'t'", "fixed shape", "ndarray"]),
        (("t", "float32", (), "tensor"), ["'t'", "scalar"]),
        (("t", "float32", (2,), "scalar"), ["'t'", "(2,)", "tensor"]),
        (("t", "float32", (), "ndarray"), ["'t'", "dimension"]),
        (("t", "float32", (-1,)), ["'t'", "negative"]),
        (("t", "uint8", (0,)), ["'t'", "(0,)", "size 0", "None"]),
        (("t", "uint8", (3, 0), TensorCodec(storage="list")), ["'t'", "(3, 0)", "size 0"]),
        (("t", "uint8", (0, 2), TensorCodec(storage="bytes")), ["'t'", "(0, 2)", "size 0"]),
        (("t", "complex64"), ["'t'", "complex64"]),
        (("t", "object"), ["'t'", "object"]),
        (("t", "no-such-dtype"), ["'t'", "no-such-dtype"]),
        (("t", "datetime64[m]"), ["'t'", "datetime64[m]"]),
    ],
)
def test_invalid_fields_raise_schema_error(field_args: tuple[Any, ...], needles: list[str]) -> None:
    with pytest.raises(SchemaError) as info:
        Field(*field_args)
    assert not isinstance(info.value, SchemaMismatchError)
    for needle in needles:
        assert needle in str(info.value)


def test_a_zero_size_dimension_is_refused_before_anything_is_written(
    tmp_path: Any, helpers: SimpleNamespace
) -> None:
    # pyarrow cannot build a fixed-size list of size 0 (the process died of SIGFPE in write_dataset);
    # a schema inferred from such data, or one stored in a dataset, is refused as a declared one is
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaError, match=r"'t'.*\(0,\).*size 0"):
        shardkit.write_dataset({"t": np.zeros((3, 0), np.uint8)}, url)
    helpers.assert_nothing_written(url)
    stored = Schema([Field("t", "uint8", (2,))]).arrow_schema()
    text = stored.metadata[b"shardkit.schema"].replace(b'"shape": [2]', b'"shape": [0]')
    with pytest.raises(SchemaError, match=r"'t'.*size 0"):
        shardkit.dataset.schema.schema_from_arrow(stored.with_metadata({b"shardkit.schema": text}))


def test_a_zero_size_variable_tensor_dimension_round_trips() -> None:
    schema = Schema([Field("t", "uint8", (None, 0))])
    rows = [np.zeros((2, 0), np.uint8), np.zeros((0, 0), np.uint8)]
    out = round_trip(schema, {"t": rows}, 2)["t"]
    assert [r.shape for r in out] == [(2, 0), (0, 0)]


# --- images ----------------------------------------------------------------------------------------

IMAGE_SHAPES = [(5, 7), (5, 7, 1), (5, 7, 3), (5, 7, 4)]


@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_png_is_bit_exact(data: st.DataObject) -> None:
    import hypothesis.extra.numpy as hnp

    shape = data.draw(st.sampled_from(IMAGE_SHAPES))
    n = data.draw(st.integers(0, 4))
    images = data.draw(hnp.arrays(np.uint8, (n, *shape)))
    field = Field("im", "uint8", shape, codec=ImageCodec("png"))
    out = round_trip(Schema([field]), {"im": list(images)}, n)["im"]
    assert out.dtype == np.uint8
    assert out.shape == (n, *shape)
    np.testing.assert_array_equal(out, images)


def test_png_variable_size_images_with_nulls() -> None:
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(4, 9), (1, 1), (12, 3)]]
    field = Field("im", "uint8", (None, None, 3), codec="image", nullable=True)
    out = round_trip(Schema([field]), {"im": [rows[0], None, rows[1], rows[2]]}, 4)["im"]
    assert out[1] is None
    for got, want in zip([out[0], out[2], out[3]], rows, strict=True):
        np.testing.assert_array_equal(got, want)


def smooth_images(n: int, shape: tuple[int, ...]) -> np.ndarray:
    h, w = shape[:2]
    y, x = np.mgrid[0:h, 0:w]
    gray = np.stack([30 + x * 150 / w + y * 40 / h + 10 * k for k in range(n)])  # gradients in 30..240
    if len(shape) == 2:
        return gray.astype(np.uint8)
    channels = [gray, gray / 2 + 40, 255 - gray, gray / 3 + 100][: shape[2]]
    return np.stack(channels, axis=-1).astype(np.uint8)


@pytest.mark.parametrize("shape", [(32, 48), (32, 48, 1), (32, 48, 3)])
def test_jpeg_is_close_on_smooth_images(shape: tuple[int, ...]) -> None:
    images = smooth_images(3, shape)
    field = Field("im", "uint8", shape, codec=ImageCodec("jpeg", quality=90))
    table = Schema([field]).encode({"im": list(images)}, 3)
    assert table.column("im").to_pylist()[0][:2] == b"\xff\xd8"  # really JPEG
    out = Schema([field]).decode(through_parquet(table))["im"]
    assert out.shape == images.shape
    assert np.abs(out.astype(int) - images.astype(int)).mean() < 3.0


def test_png_bytes_are_png_and_readable_by_pillow() -> None:
    import io

    from PIL import Image

    images = smooth_images(2, (8, 8, 3))
    table = Schema([Field("im", "uint8", (8, 8, 3), codec="image")]).encode({"im": images}, 2)
    blob = table.column("im")[1].as_py()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(blob))), images[1])


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("im", "float32", (4, 4), "image"), ["'im'", "uint8", "float32"]),
        (("im", "uint8", (4,), "image"), ["'im'", "(4,)"]),
        (("im", "uint8", (4, 4, 2), "image"), ["'im'", "(4, 4, 2)"]),
        (("im", "uint8", (4, 4, 4), {"name": "image", "format": "jpeg"}), ["'im'", "jpeg", "1 or 3"]),
        (("im", "uint8", (0, 4), "image"), ["'im'", "(0, 4)", "size 0"]),
        (("im", "uint8", (4, 0, 3), "image"), ["'im'", "(4, 0, 3)", "size 0"]),
    ],
)
def test_image_fields_that_cannot_be_images(args: tuple[Any, ...], needles: list[str]) -> None:
    with pytest.raises(SchemaError) as info:
        Field(*args)
    for needle in needles:
        assert needle in str(info.value)


def test_image_codec_options_are_checked() -> None:
    with pytest.raises(SchemaError, match=r"'gif'.*png.*jpeg"):
        ImageCodec("gif")  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="quality 0"):
        ImageCodec("jpeg", quality=0)


def test_image_row_of_wrong_shape_or_dtype() -> None:
    fixed = Schema([Field("im", "uint8", (4, 4), codec="image")])
    with pytest.raises(SchemaMismatchError, match=r"'im'.*row 1.*\(5, 4\)"):
        fixed.encode({"im": [np.zeros((4, 4), np.uint8), np.zeros((5, 4), np.uint8)]}, 2)
    variable = Schema([Field("im", "uint8", (None, None), codec="image")])
    with pytest.raises(SchemaMismatchError, match=r"'im'.*row 0.*float64"):
        variable.encode({"im": [np.zeros((4, 4))]}, 1)
    with pytest.raises(SchemaMismatchError, match=r"'im'.*not nullable.*row 1"):
        variable.encode({"im": [np.zeros((4, 4), np.uint8), None]}, 2)


def test_corrupt_image_bytes_raise_corrupt_dataset_error_naming_the_field() -> None:
    field = Field("im", "uint8", (4, 4), codec="image")
    table = pa.table({"im": pa.array([b"not an image"], pa.binary())})
    with pytest.raises(CorruptDatasetError, match="'im'"):
        Schema([field]).decode(table)


# --- codecs as data --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codec", "spec"),
    [
        (ScalarCodec(), {"name": "scalar"}),
        (TensorCodec(), {"name": "tensor", "storage": "bytes"}),
        (TensorCodec("list"), {"name": "tensor", "storage": "list"}),
        (NdarrayCodec(), {"name": "ndarray"}),
        (ImageCodec("jpeg", quality=80), {"name": "image", "format": "jpeg", "quality": 80}),
    ],
)
def test_codec_json_round_trip(codec: shardkit.dataset.codecs.Codec, spec: dict[str, Any]) -> None:
    assert codec.to_json() == spec
    assert codec_from_json(spec) == codec
    assert codec_from_json(dict(spec)) == codec
    assert spec["name"] in CODECS


def test_codec_by_bare_name() -> None:
    assert codec_from_json("image") == ImageCodec()


@pytest.mark.parametrize(
    ("spec", "needles"),
    [
        ({"name": "zstd-tensor"}, ["field 'x'", "'zstd-tensor'", "known codecs", "pip install -U shardkit"]),
        ({"name": "image", "colour": "red"}, ["field 'x'", "'image'", "colour", "format", "quality"]),
        ({"name": "image", "format": "gif"}, ["field 'x'", "'gif'"]),
        ({"name": "image", "quality": "high"}, ["field 'x'", "'image'", "high"]),
        ({"name": "scalar", "level": 3}, ["field 'x'", "'scalar'", "level"]),
        ({"format": "png"}, ["field 'x'", "a codec must be"]),
        (42, ["field 'x'", "42"]),
    ],
)
def test_bad_codec_specs_raise_schema_error_naming_the_field(spec: Any, needles: list[str]) -> None:
    with pytest.raises(SchemaError) as info:
        codec_from_json(spec, where="field 'x'")
    for needle in needles:
        assert needle in str(info.value)


def test_tensor_field_accepts_a_flat_fixed_size_list_column(tmp_path) -> None:
    """Plain Parquet (pq.read_table) gives fixed_size_list<T>[prod(shape)]: it reshapes, no per-row path."""
    flat = np.arange(48, dtype=np.uint8).reshape(4, 12)
    column = pa.FixedSizeListArray.from_arrays(pa.array(flat.ravel()), 12)
    ds = shardkit.write_dataset(pa.table({"t": column}), tmp_path / "ds",
                                schema=[shardkit.Field("t", "uint8", (2, 2, 3))])
    got = ds.decode(ds.read_row_group(0))["t"]
    np.testing.assert_array_equal(got, flat.reshape(4, 2, 2, 3))


# --- the stored layouts of fixed-shape tensors ------------------------------------------------------


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_bytes_layout_of_any_slice_holds_the_same_tensors(data: st.DataObject) -> None:
    """`to_storage` of a sliced tensor array (offsets, nulls, bools) -> the bytes layout -> the same
    values, null rows as zeros, also after a trip through Parquet."""
    dtype = data.draw(st.sampled_from(["bool", "int8", "uint8", "int16", "float16", "int64", "float64"]))
    shape = tuple(data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    n = data.draw(st.integers(0, 12))
    field = Field("t", dtype, shape, nullable=True)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    values = (rng.integers(0, 100, (n, *shape)) % (2 if dtype == "bool" else 100)).astype(dtype)
    nulls = [data.draw(st.booleans()) for _ in range(n)]
    encoded = field.codec.encode(field, [None if z else v for v, z in zip(values, nulls, strict=True)])
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    stored = field.codec.to_storage(field, encoded.slice(start, stop - start))
    assert stored.type == pa.binary(np.dtype(dtype).itemsize * int(np.prod(shape)))
    expected = np.where(np.array(nulls, bool).reshape((-1,) + (1,) * len(shape)), 0, values)[start:stop]
    for arr in (stored, through_parquet(pa.table({"t": stored})).column("t").combine_chunks()):
        assert arr.null_count == sum(nulls[start:stop])
        got = field.codec.decode(field, arr)
        np.testing.assert_array_equal(np.ma.getdata(got), expected)
        mask = np.ma.getmaskarray(got)
        assert [bool(mask[i].any()) for i in range(len(got))] == nulls[start:stop]


def test_schemas_of_version_1_store_tensors_as_lists() -> None:
    text = ('{"version": 1, "fields": [{"name": "a", "dtype": "uint8", "shape": [2, 3]},'
            ' {"name": "b", "dtype": "float32", "shape": [4], "codec": "tensor"},'
            ' {"name": "c", "dtype": "float32", "shape": [4], "codec": {"name": "tensor"}},'
            ' {"name": "d", "dtype": "float32", "shape": [null]}]}')
    schema = Schema.from_json(text)
    assert [f.codec for f in schema][:3] == [TensorCodec("list")] * 3
    assert schema["d"].codec == NdarrayCodec()
    assert Field("a", "uint8", (2, 3)).codec == TensorCodec("bytes")  # what a new schema gets
    assert Schema.from_json(schema.to_json()) == schema


def test_tensor_storage_must_be_a_layout() -> None:
    with pytest.raises(SchemaError, match=r"storage='npy' is not a layout; use one of \['bytes', 'list'\]"):
        codec_from_json({"name": "tensor", "storage": "npy"}, where="field 'x'")


def test_bytes_of_the_wrong_width_name_the_mismatch() -> None:
    field = Field("t", "float32", (3,))
    column = pa.array([b"12345678"], type=pa.binary(8))
    with pytest.raises(SchemaMismatchError, match=r"8-byte values cannot hold float32 tensors of shape"):
        field.codec.decode(field, column)


def test_a_dataset_read_by_pyarrow_writes_again(tmp_path) -> None:
    """pq.read_table of the bytes layout gives fixed_size_binary; write_dataset takes it back."""
    values = np.arange(60, dtype=np.float32).reshape(5, 3, 4)
    ds = shardkit.write_dataset({"t": values}, tmp_path / "a")
    table = pq.read_table(tmp_path / "a")
    assert table.schema.field("t").type == pa.binary(48)
    again = shardkit.write_dataset(table, tmp_path / "b", schema=ds.schema)
    np.testing.assert_array_equal(again.decode(again.read_row_group(0))["t"], values)


# --- image decoding backends ---------------------------------------------------------------------


def _pillow_png(image: np.ndarray, **params: Any) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    pixels = image[:, :, 0] if image.ndim == 3 and image.shape[2] == 1 else image
    Image.fromarray(pixels).save(buf, format="PNG", **params)
    return buf.getvalue()


def decode_both(field: Field, blobs: list[bytes | None], monkeypatch: pytest.MonkeyPatch
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The column decoded with every fast path allowed (OpenCV when installed) and with Pillow only."""
    from shardkit.dataset.codecs import image as image_module

    column = pa.array(blobs, pa.binary())
    fast = field.codec.decode(field, column)
    with monkeypatch.context() as m:
        m.setattr(image_module, "USE_OPENCV", False)
        m.setattr(image_module, "USE_INFLATE", False)
        slow = field.codec.decode(field, column)
    return fast, slow


@given(data=st.data())
@settings(max_examples=30, deadline=None)
def test_png_decodes_to_the_same_pixels_with_opencv_and_pillow(data: st.DataObject) -> None:
    import hypothesis.extra.numpy as hnp

    shape = data.draw(st.sampled_from([(6, 5), (6, 5, 1), (6, 5, 3), (6, 5, 4), (33, 17, 3)]))
    n = data.draw(st.integers(1, 300))  # more than one IMAGE_SLICE: several pool tasks
    first = data.draw(hnp.arrays(np.uint8, shape))
    images = np.stack([np.roll(first, k) for k in range(n)])
    field = Field("im", "uint8", shape, codec=ImageCodec("png"))
    blobs: list[bytes | None] = [_pillow_png(im, optimize=bool(k % 2)) for k, im in enumerate(images)]
    with pytest.MonkeyPatch.context() as mp:
        fast, slow = decode_both(field, blobs, mp)
    np.testing.assert_array_equal(fast, images)
    np.testing.assert_array_equal(slow, images)


def test_images_opencv_does_not_take_go_through_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image

    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    palette = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    import io

    buf = io.BytesIO()
    palette.save(buf, format="PNG")
    field = Field("im", "uint8", (8, 8, 3), codec="image")  # its colours (see test_decode_images.py)
    fast, slow = decode_both(field, [buf.getvalue(), None], monkeypatch)
    np.testing.assert_array_equal(fast.data, slow.data)
    np.testing.assert_array_equal(np.ma.getmaskarray(fast), np.ma.getmaskarray(slow))
    np.testing.assert_array_equal(fast.data[0], np.asarray(palette.convert("RGB")))
    fast, slow = decode_both(Field("im", "uint8", (None, None, 3), codec="image"), [buf.getvalue()],
                              monkeypatch)
    np.testing.assert_array_equal(fast[0], slow[0])
    jpeg = Schema([Field("im", "uint8", (16, 16, 3), codec=ImageCodec("jpeg"))]).encode(
        {"im": list(smooth_images(2, (16, 16, 3)))}, 2)
    fast, slow = decode_both(Field("im", "uint8", (16, 16, 3), codec=ImageCodec("jpeg")),
                              jpeg.column("im").to_pylist(), monkeypatch)
    np.testing.assert_array_equal(fast, slow)  # JPEG is always Pillow's: no decoder differences


def test_corrupt_png_raises_with_either_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    good = _pillow_png(np.zeros((4, 4), np.uint8))
    bad = good[:20] + b"\x00" * (len(good) - 20)  # a PNG header, then garbage
    field = Field("im", "uint8", (4, 4), codec="image")
    from shardkit.dataset.codecs import image as image_module

    for use in (True, False):
        monkeypatch.setattr(image_module, "USE_OPENCV", use)
        with pytest.raises(CorruptDatasetError, match="'im'"):
            field.codec.decode(field, pa.array([good, bad], pa.binary()))


def test_png_with_a_wrong_size_names_the_row(monkeypatch: pytest.MonkeyPatch) -> None:
    field = Field("im", "uint8", (4, 4), codec="image")
    blobs = [_pillow_png(np.zeros((4, 4), np.uint8)), _pillow_png(np.zeros((4, 5), np.uint8))]
    with pytest.raises(SchemaMismatchError, match=r"'im'.*row 1.*\(4, 5\)"):
        field.codec.decode(field, pa.array(blobs, pa.binary()))


def test_png_fast_path_mixed_with_nulls_and_other_images(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed-shape column mixing 8-bit RGB PNGs (OpenCV's per-slice fast path), nulls and images the
    fast path leaves to the general one (JPEG, a PNG of the wrong size): the same result either way."""
    import io

    from PIL import Image

    rng = np.random.default_rng(11)
    smooth = smooth_images(4, (8, 8, 3))
    jpeg = io.BytesIO()
    Image.fromarray(smooth[0]).save(jpeg, format="JPEG")
    blobs: list[bytes | None] = []
    for k in range(300):  # more than one IMAGE_SLICE
        kind = k % 5
        if kind == 1:
            blobs.append(None)
        elif kind == 3:
            blobs.append(jpeg.getvalue())
        else:
            blobs.append(_pillow_png(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)))
    field = Field("im", "uint8", (8, 8, 3), codec="image", nullable=True)
    fast, slow = decode_both(field, blobs, monkeypatch)
    np.testing.assert_array_equal(np.ma.getmaskarray(fast), np.ma.getmaskarray(slow))
    np.testing.assert_array_equal(fast.filled(0), slow.filled(0))
    assert np.ma.getmaskarray(fast)[:, 0, 0, 0].tolist() == [k % 5 == 1 for k in range(300)]
    blobs[7] = _pillow_png(np.zeros((8, 9, 3), np.uint8))  # a fast-path candidate of the wrong size
    with pytest.raises(SchemaMismatchError, match=r"'im'.*row 7.*\(8, 9, 3\)"):
        field.codec.decode(field, pa.array(blobs, pa.binary()))


@pytest.mark.parametrize(
    ("dtype", "stored", "conversion"),
    [
        ("datetime64[h]", "s, ms, us, ns, and D for dates", "datetime64[s]"),
        ("datetime64[m]", "s, ms, us, ns, and D for dates", "datetime64[s]"),
        ("datetime64[W]", "s, ms, us, ns, and D for dates", "datetime64[D]"),
        ("datetime64[M]", "s, ms, us, ns, and D for dates", "datetime64[D]"),
        ("datetime64[Y]", "s, ms, us, ns, and D for dates", "datetime64[D]"),
        ("datetime64[ps]", "s, ms, us, ns, and D for dates", "datetime64[ns]"),
        ("timedelta64[D]", "timedelta64 is stored in the units s, ms, us, ns.", "timedelta64[s]"),
        ("timedelta64[h]", "timedelta64 is stored in the units s, ms, us, ns.", "timedelta64[s]"),
        ("timedelta64[fs]", "timedelta64 is stored in the units s, ms, us, ns.", "timedelta64[ns]"),
    ],
)
def test_a_time_unit_arrow_cannot_store_names_the_stored_units_and_the_conversion(
        dtype: str, stored: str, conversion: str) -> None:
    with pytest.raises(SchemaError) as info:
        Field("t", dtype)
    message = str(info.value)
    for needle in ["field 't'", dtype, stored, f"Field('t', {conversion!r})", f".astype({conversion!r})"]:
        assert needle in message, (needle, message)
    # the conversion named is storable and, for units coarser than its own, keeps every value
    values = np.array([0, 1, -7, 20_000], dtype=dtype)
    out = round_trip(Schema([Field("t", conversion)]), {"t": values.astype(conversion)}, 4)["t"]
    if np.datetime_data(np.dtype(dtype))[0] not in ("ps", "fs"):
        assert (out == values).all()


@pytest.mark.parametrize(
    ("dtype", "needles"),
    [
        ("timedelta64[M]", ["no fixed length", "Field('t', 'int64')", ".astype('int64')"]),
        ("datetime64", ["has no unit", "'datetime64[us]'"]),
        ("timedelta64", ["has no unit", "'timedelta64[us]'"]),
    ],
)
def test_time_units_without_a_conversion_name_the_alternative(dtype: str, needles: list[str]) -> None:
    with pytest.raises(SchemaError) as info:
        Field("t", dtype)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_inferring_a_time_unit_arrow_cannot_store_names_the_conversion() -> None:
    with pytest.raises(SchemaError, match=r"'t'.*datetime64\[h\].*astype\('datetime64\[s\]'\)"):
        shardkit.dataset.schema.infer_field("t", np.array(["2020-01-01T05"], "datetime64[h]"))


@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin"])
def test_zoned_times_for_a_datetime64_field_name_the_conversion_to_utc(zone: str) -> None:
    times = pd.Series(pd.date_range("2021-03-28", periods=3, freq="h", tz=zone))
    schema = Schema([Field("t", "datetime64[us]")])
    for data in (times, pa.array(times), list(times)):
        with pytest.raises(SchemaMismatchError) as info:
            schema.encode({"t": data}, 3)
        for needle in ["field 't'", "datetime64[us]", f"time zone {zone!r}", "tz_convert('UTC')",
                       "pyarrow.compute.cast(column, pyarrow.timestamp('us'))"]:
            assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.parametrize("values", [["1", "2", "3", "4"], ["a", "b", "c", "d"]])
def test_a_fixed_size_list_of_strings_for_a_tensor_is_a_schema_mismatch(values: list[str]) -> None:
    """It leaked pyarrow's ``ArrowInvalid: ... zero_copy_only was True`` (the fast path of numbers)."""
    field = Field("x", "float32", (2,))
    with pytest.raises(SchemaMismatchError, match=r"field 'x' \(writing\) is declared float32"):
        field.codec.encode(field, pa.FixedSizeListArray.from_arrays(pa.array(values), 2))


@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_nested_arrow_lists_unnest_to_the_rows_values_or_go_row_by_row(data: st.DataObject) -> None:
    """`nested_values` (Arrow nested lists of a tensor's shape, unnested without a Python object per row)
    gives exactly the rows' values, for any slice of the column, fixed-size levels or not; and None
    (the row-by-row path, which names the bad row) for a null row or a row of another shape."""
    from shardkit.dataset.codecs.tensor import nested_values

    shape = tuple(data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    n = data.draw(st.integers(0, 8))
    values = data.draw(hnp.arrays(np.int32, (n + 2, *shape)))
    fixed = [data.draw(st.booleans()) for _ in shape]  # each level a fixed-size list or not
    t: pa.DataType = pa.int32()
    for size, fixed_size in reversed(list(zip(shape, fixed, strict=True))):
        t = pa.list_(t, size) if fixed_size else pa.list_(t)
    arr = pa.array(values.tolist(), t).slice(1, n)
    got = nested_values(arr, shape)
    assert got is not None
    np.testing.assert_array_equal(got, values[1 : n + 1])
    field = Field("v", "int32", shape)
    encoded = field.codec.encode(field, arr)
    np.testing.assert_array_equal(field.codec.decode(field, encoded), values[1 : n + 1])
    assert nested_values(pa.array([*values.tolist(), None], t), shape) is None
    if not fixed[-1]:
        other = values.tolist()
        last: Any = other[0]
        for _ in shape[:-1]:
            last = last[0]
        last.pop()  # one innermost list one value short
        assert nested_values(pa.array(other, t), shape) is None
