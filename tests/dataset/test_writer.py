"""`write_dataset`: every input form round-trips through the files; bad input raises and writes nothing."""

from __future__ import annotations

import datetime
import json
import math
import os
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import hypothesis.strategies as st
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings

import shardkit
from shardkit import Field, ImageCodec, Schema
from shardkit.dataset.codecs.tensor import TensorCodec
from shardkit.dataset.schema import SCHEMA_KEY
from shardkit.dataset.write._sources import BATCH_ROWS
from shardkit.errors import DatasetExistsError, DatasetPermissionError, SchemaError, SchemaMismatchError
from tests.dataset import test_storage_s3
from tests.reader import conftest as s3_fixtures
from tests.reader.s3_tools import IAMServer

# a moto S3 server that checks credentials against its IAM users (tests/dataset/test_storage_s3.py)
iam, s3_server, no_internet = test_storage_s3.iam, s3_fixtures.s3_server, s3_fixtures.no_internet

FORMS = ["dict", "rows", "dataframe", "table", "batches"]


# --- building each input form from per-column row lists (None = null) ------------------------------


def _no_nulls(rows: list[Any]) -> bool:
    return all(r is not None for r in rows)


def as_dict(schema: Schema, columns: dict[str, list[Any]]) -> dict[str, Any]:
    """Columns as numpy arrays where they can be (no nulls, fixed shape), else lists."""
    out: dict[str, Any] = {}
    for f in schema:
        rows = columns[f.name]
        if _no_nulls(rows) and f.fixed_shape and f.dtype.kind not in "US":
            out[f.name] = np.stack(rows) if rows else np.zeros((0, *f.shape), f.dtype)
        else:
            out[f.name] = rows
    return out


def as_rows(schema: Schema, columns: dict[str, list[Any]], n: int) -> list[dict[str, Any]]:
    return [{f.name: columns[f.name][i] for f in schema} for i in range(n)]


def as_dataframe(schema: Schema, columns: dict[str, list[Any]], n: int) -> pd.DataFrame:
    """What a pandas user has: numpy columns for plain numbers, pandas' own dtypes for text, objects else."""
    data: dict[str, Any] = {}
    for f in schema:
        rows = columns[f.name]
        if f.shape == () and f.dtype.kind not in "US" and _no_nulls(rows):
            data[f.name] = np.asarray(rows, dtype=f.dtype)
        elif f.dtype.kind == "U":
            data[f.name] = pd.Series(rows, dtype="str" if _no_nulls(rows) else object)
        else:
            data[f.name] = pd.Series(rows, dtype=object)
    return pd.DataFrame(data, index=range(n))


def arrow_column(f: Field, rows: list[Any]) -> pa.Array:
    """An Arrow array of the rows as an Arrow user builds it: native types, tensors as the canonical type."""
    mask = np.array([r is None for r in rows], dtype=bool)
    if f.dtype.kind == "U":
        return pa.array(rows, pa.string())
    if f.dtype.kind == "S":
        return pa.array(rows, pa.binary())
    if f.shape == ():
        values = np.array([np.zeros((), f.dtype) if r is None else r for r in rows], dtype=f.dtype)
        return pa.array(values, mask=mask if mask.any() else None)
    if f.fixed_shape:
        values = (
            np.stack([np.zeros(f.shape, f.dtype) if r is None else r for r in rows])
            if rows
            else (np.zeros((0, *f.shape), f.dtype))
        )
        tensor_type = pa.fixed_shape_tensor(pa.from_numpy_dtype(f.dtype), list(f.shape))
        storage = pa.FixedSizeListArray.from_arrays(
            pa.array(values.reshape(-1)), math.prod(f.shape), mask=pa.array(mask) if mask.any() else None
        )
        return pa.ExtensionArray.from_storage(tensor_type, storage)
    assert len(f.shape) == 1, "Arrow input of multi-dimensional variable tensors is not a thing users have"
    return pa.array([None if r is None else r for r in rows], pa.list_(pa.from_numpy_dtype(f.dtype)))


def as_table(schema: Schema, columns: dict[str, list[Any]]) -> pa.Table:
    return pa.table({f.name: arrow_column(f, columns[f.name]) for f in schema})


def make_input(form: str, schema: Schema, columns: dict[str, list[Any]], n: int, chunk: int) -> Any:
    if form == "dict":
        return as_dict(schema, columns)
    if form == "rows":
        return iter(as_rows(schema, columns, n))  # a one-shot iterator, as a generator would be
    if form == "dataframe":
        return as_dataframe(schema, columns, n)
    if form == "table":
        return as_table(schema, columns)
    return iter(as_table(schema, columns).to_batches(max_chunksize=chunk))


def expected_for(form: str, schema: Schema, columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """What reading back must give: the rows written, except that pandas reads NaN as missing in object
    columns (pandas' own convention), so a NaN in a nullable float column with nulls comes back null."""
    if form != "dataframe":
        return columns
    out = dict(columns)
    for f in schema:
        rows = columns[f.name]
        if f.shape == () and f.dtype.kind == "f" and not _no_nulls(rows):
            out[f.name] = [None if r is None or np.isnan(r) else r for r in rows]
    return out


# --- reading back -----------------------------------------------------------------------------------


def pyarrow_table(url: str) -> pa.Table:
    fs, root = fsspec.core.url_to_fs(url)
    return pq.read_table(root, filesystem=fs)


@st.composite
def write_case(draw: st.DrawFn, strategies: SimpleNamespace) -> SimpleNamespace:
    form = draw(st.sampled_from(FORMS))
    schema = draw(strategies.schema(multi_dim_variable=form not in ("table", "batches")))
    n = draw(st.integers(0, 9))
    columns = {f.name: draw(strategies.column(f, n)) for f in schema}
    row_group_size = draw(st.one_of(st.integers(1, 4), st.sampled_from(["1B", "100B", "2KiB", "32MiB"])))
    return SimpleNamespace(
        form=form,
        schema=schema,
        n=n,
        columns=columns,
        row_group_size=row_group_size,
        chunk=draw(st.integers(1, 4)),
        where=draw(st.sampled_from(["local", "memory"])),
    )


@given(data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_round_trip_every_form_dtype_shape_and_store(
    tmp_path: Path, strategies: SimpleNamespace, helpers: SimpleNamespace, data: st.DataObject
) -> None:
    case = data.draw(write_case(strategies))
    name = f"ds-{uuid.uuid4().hex[:8]}"
    url = str(tmp_path / name) if case.where == "local" else f"memory://shardkit-writer-test/{name}"
    try:
        written = shardkit.write_dataset(
            make_input(case.form, case.schema, case.columns, case.n, case.chunk),
            url,
            schema=case.schema,
            row_group_size=case.row_group_size,
            progress=False,
        )
        expected = expected_for(case.form, case.schema, case.columns)

        ds = shardkit.open_dataset(url)
        assert ds.kind == "shardkit"
        assert ds.schema == case.schema == written.schema
        assert ds.num_rows == case.n
        if isinstance(case.row_group_size, int) and case.n:
            sizes = [rg.num_rows for rg in ds.row_groups]
            assert sizes[:-1] == [case.row_group_size] * (len(sizes) - 1)
            assert 0 < sizes[-1] <= case.row_group_size
        helpers.assert_rows_equal(case.schema, expected, helpers.read_all(ds))

        # the same files through plain pyarrow: same rows, the schema travels in the metadata
        table = pyarrow_table(url)
        assert table.num_rows == case.n
        assert table.schema.names == case.schema.names
        assert shardkit.dataset.schema.schema_from_arrow(table.schema) == case.schema
        decoded = case.schema.decode(table)
        helpers.assert_rows_equal(
            case.schema, expected, {k: helpers.column_rows(v) for k, v in decoded.items()}
        )
        for f in case.schema:
            if f.codec.name == "tensor":  # the stored layout: the canonical tensor type, or its bytes
                stored = table.schema.field(f.name).type
                if f.codec.storage == "list":
                    assert stored == pa.fixed_shape_tensor(pa.from_numpy_dtype(f.dtype), list(f.shape))
                else:
                    assert stored == pa.binary(f.dtype.itemsize * int(np.prod(f.shape)))
        parts = helpers.files_under(url) - {"_metadata", "_common_metadata"}
        if case.n:
            assert parts == set(ds.files)
        else:  # no row groups, so no file listed: one empty part carries the schema for plain readers
            assert len(parts) == 1
    finally:
        fs, root = fsspec.core.url_to_fs(url)
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_plain_readers_see_plain_parquet(tmp_path: Path) -> None:
    """pyarrow.dataset and pandas read the folder as Parquet, scalar columns as their native types;
    a fixed-shape tensor as its bytes (dtype and shape in the schema JSON) or, stored as a list, as
    arrays and Arrow's canonical tensor type."""
    import pyarrow.dataset as pads

    url = str(tmp_path / "ds")
    n = 50
    df = pd.DataFrame(
        {
            "id": np.arange(n, dtype=np.int64),
            "score": np.linspace(0, 1, n, dtype=np.float32),
            "name": [f"row {i}" for i in range(n)],
            "when": np.arange(n).astype("datetime64[ms]"),
            "vec": list(np.arange(n * 3, dtype=np.float32).reshape(n, 3)),
        }
    )
    ds = shardkit.write_dataset(df, url, row_group_size=7)

    got = pd.read_parquet(url)
    assert list(got.columns) == ["id", "score", "name", "when", "vec"]
    pd.testing.assert_series_equal(got["id"], df["id"])
    pd.testing.assert_series_equal(got["score"], df["score"])
    assert got["name"].tolist() == df["name"].tolist()
    assert (got["when"].to_numpy() == df["when"].to_numpy()).all()
    stored = json.loads(pq.read_schema(f"{url}/_common_metadata").metadata[SCHEMA_KEY])["fields"][4]
    assert (stored["dtype"], stored["shape"], stored["codec"]) == (
        "float32", [3], {"name": "tensor", "storage": "bytes"}
    )
    as_bytes = np.frombuffer(b"".join(got["vec"]), "<f4").reshape(n, *stored["shape"])
    np.testing.assert_array_equal(as_bytes, np.stack(df["vec"]))
    assert ds.schema["vec"].codec == TensorCodec("bytes")

    dataset = pads.dataset(url, format="parquet")
    assert dataset.count_rows() == n
    assert sorted(dataset.to_table(columns=["id"]).column("id").to_pylist()) == list(range(n))

    listed = str(tmp_path / "listed")
    schema = shardkit.Schema([shardkit.Field("vec", "float32", (3,), codec=TensorCodec("list"))])
    shardkit.write_dataset(df[["vec"]], listed, schema=schema, row_group_size=7)
    got = pd.read_parquet(listed)
    np.testing.assert_array_equal(np.stack(got["vec"].map(np.asarray)).reshape(n, 3), np.stack(df["vec"]))
    tensor = pq.read_table(listed, columns=["vec"]).column("vec").combine_chunks()
    np.testing.assert_array_equal(tensor.to_numpy_ndarray(), np.stack(df["vec"]))


def test_append_keeps_the_tensor_layout_of_the_dataset(tmp_path: Path) -> None:
    """A dataset of list-stored tensors (e.g. written before the bytes layout) stays one layout."""
    url = tmp_path / "ds"
    listed = Schema([Field("t", "uint8", (2, 2), codec=TensorCodec("list"))])
    first = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    shardkit.write_dataset({"t": first}, url, schema=listed)
    ds = shardkit.write_dataset({"t": first + 1}, url, mode="append", schema=[Field("t", "uint8", (2, 2))])
    assert ds.schema == listed
    assert len(ds.files) == 2
    for name in ds.files:
        assert pq.read_schema(url / name).field("t").type == pa.fixed_shape_tensor(pa.uint8(), [2, 2])
    got = np.concatenate([ds.decode(ds.read_row_group(i))["t"] for i in range(len(ds.row_groups))])
    assert sorted(map(bytes, got)) == sorted(map(bytes, np.concatenate([first, first + 1])))
    with pytest.raises(SchemaMismatchError, match="cannot append"):
        shardkit.write_dataset({"t": first}, url, mode="append", schema=[Field("t", "int16", (2, 2))])


def test_row_group_size_in_bytes_cuts_by_encoded_size(tmp_path: Path) -> None:
    data = {"x": np.arange(1000, dtype=np.int64)}  # 8 encoded bytes per row
    ds = shardkit.write_dataset(data, tmp_path / "a", row_group_size="800B")
    assert [rg.num_rows for rg in ds.row_groups] == [100] * 10
    ds = shardkit.write_dataset(data, tmp_path / "b", row_group_size="1KiB")
    assert [rg.num_rows for rg in ds.row_groups] == [128] * 7 + [104]


def test_row_group_size_in_rows_across_input_batches(tmp_path: Path) -> None:
    n = 2 * BATCH_ROWS + 5
    ds = shardkit.write_dataset({"x": np.arange(n)}, tmp_path / "ds", row_group_size=3000)
    assert [rg.num_rows for rg in ds.row_groups] == [3000, 3000, n - 6000]
    assert np.concatenate([ds.decode(ds.read_row_group(i))["x"] for i in range(3)]).tolist() == list(range(n))


def test_file_size_rolls_part_files(tmp_path: Path) -> None:
    ds = shardkit.write_dataset(
        {"x": np.arange(1000.0)}, tmp_path / "ds", row_group_size=100, file_size="1.5KiB"
    )
    assert len(ds.files) == 5  # two 800-byte row groups per file
    assert all(rg.num_rows == 100 for rg in ds.row_groups)
    assert [rg.index for rg in ds.row_groups] == [0, 1] * 5


@pytest.mark.parametrize("size", ["0B", "-1", "lots", "12 parsecs", 0, -5, True])
def test_bad_sizes_raise_before_writing(tmp_path: Path, helpers: SimpleNamespace, size: Any) -> None:
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaError, match="row_group_size") as info:
        shardkit.write_dataset({"x": [1]}, url, row_group_size=size)
    assert repr(size) in str(info.value)
    with pytest.raises(SchemaError, match="file_size"):
        shardkit.write_dataset({"x": [1]}, url, file_size=size if size is not True else "x")
    helpers.assert_nothing_written(url)


@pytest.mark.parametrize("compression", ["snappy", "zstd", "none", "gzip"])
def test_compression(tmp_path: Path, compression: str) -> None:
    ds = shardkit.write_dataset({"x": np.zeros(100)}, tmp_path / "ds", compression=compression)
    codec = pq.ParquetFile(tmp_path / "ds" / ds.files[0]).metadata.row_group(0).column(0).compression
    assert codec == ("UNCOMPRESSED" if compression == "none" else compression.upper())


def _codecs(ds: shardkit.Dataset, root: Path) -> list[dict[str, str]]:
    """Per part file: column path -> codec, the same in every row group of the file (asserted)."""
    out = []
    for name in ds.files:
        md = pq.ParquetFile(root / name).metadata
        groups = [{md.row_group(g).column(c).path_in_schema: md.row_group(g).column(c).compression
                   for c in range(md.num_columns)} for g in range(md.num_row_groups)]
        assert all(g == groups[0] for g in groups), groups
        out.append(groups[0])
    return out


def test_auto_compression_leaves_binary_columns_snappy_cannot_shrink_uncompressed(tmp_path: Path) -> None:
    """The default: snappy, except for tensor/image/bytes columns it shrinks by less than 10% (decided on
    the first row group, kept in every file); scalars, text and list-layout tensors stay snappy. (PNGs of
    16x16 noise do shrink by more: their repeated headers are ~10% of them.)"""
    rng = np.random.default_rng(0)
    n = 3000
    noise = rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)
    smooth = np.repeat(np.arange(n, dtype=np.uint16)[:, None] % 7, 64, axis=1).astype(np.uint8)
    data = {"id": np.arange(n), "noise": noise, "smooth": smooth, "text": [f"row {i}" for i in range(n)],
            "blob": [rng.bytes(40) for _ in range(n)],
            "png": rng.integers(0, 256, (n, 64, 64), dtype=np.uint8), "listed": noise[:, 0, :, 0]}
    schema = Schema([Field("id", "int64"), Field("noise", "uint8", (16, 16, 3)),
                     Field("smooth", "uint8", (64,)),
                     Field("text", "str"), Field("blob", "bytes"),
                     Field("png", "uint8", (64, 64), codec=shardkit.ImageCodec("png")),
                     Field("listed", "uint8", (16,), codec=TensorCodec(storage="list"))])
    ds = shardkit.write_dataset(data, tmp_path / "ds", schema=schema, row_group_size=500, file_size="300KiB")
    files = _codecs(ds, tmp_path / "ds")
    assert len(files) > 1
    assert all(f == files[0] for f in files), files
    plain = {path for path, codec in files[0].items() if codec == "UNCOMPRESSED"}
    assert plain == {"noise", "blob", "png"}, files[0]
    assert set(files[0].values()) == {"UNCOMPRESSED", "SNAPPY"}
    assert files[0]["smooth"] == files[0]["text"] == files[0]["id"] == "SNAPPY"
    with shardkit.make_reader(tmp_path / "ds", shuffle=False, batch_size=n, num_shards=1, shard=0) as reader:
        got = next(iter(reader))
    np.testing.assert_array_equal(got["noise"], noise)
    np.testing.assert_array_equal(got["png"], data["png"])
    assert list(got["blob"]) == data["blob"]


def test_an_explicit_codec_compresses_every_column(tmp_path: Path) -> None:
    noise = np.random.default_rng(1).integers(0, 256, (500, 64), dtype=np.uint8)
    ds = shardkit.write_dataset({"id": np.arange(500), "noise": noise}, tmp_path / "ds", compression="snappy")
    assert _codecs(ds, tmp_path / "ds") == [{"id": "SNAPPY", "noise": "SNAPPY"}]


def test_auto_is_taken_in_any_case_like_codec_names(tmp_path: Path) -> None:
    noise = np.random.default_rng(2).integers(0, 256, (500, 64), dtype=np.uint8)
    ds = shardkit.write_dataset({"id": np.arange(500), "noise": noise}, tmp_path / "ds", compression="AUTO")
    assert _codecs(ds, tmp_path / "ds") == [{"id": "SNAPPY", "noise": "UNCOMPRESSED"}]


@pytest.mark.parametrize("compression", ["bogus", "", None])
def test_bad_compression(tmp_path: Path, helpers: SimpleNamespace, compression: Any) -> None:
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaError, match=rf"compression={compression!r}.*'auto'.*'zstd'"):
        shardkit.write_dataset({"x": [1]}, url, compression=compression)
    helpers.assert_nothing_written(url)


# --- schema inference -------------------------------------------------------------------------------


def test_schema_inferred_from_pandas(tmp_path: Path) -> None:
    n = BATCH_ROWS + 10  # nulls and shapes that first appear after the first batch count too
    late = [None] * n
    late[-1] = "x"
    df = pd.DataFrame(
        {
            "i": np.arange(n, dtype=np.int16),
            "f": np.ones(n, dtype=np.float32),
            "b": np.ones(n, dtype=bool),
            "t": np.arange(n).astype("datetime64[us]"),
            "s": [str(i) for i in range(n)],
            "late_null": ["a"] * (n - 1) + [None],
            "mostly_null": late,
            "blob": [b"\x00\x01"] * n,
            "nullable_int": pd.array([1] * (n - 1) + [None], dtype="Int64"),
            "nullable_bool": pd.array([True] * (n - 1) + [None], dtype="boolean"),
            "tensor": list(np.zeros((n, 2, 3), np.float64)),
            "var": [np.zeros(i % 3 if i < BATCH_ROWS else 7, np.int32) for i in range(n)],
        }
    )
    ds = shardkit.write_dataset(df, tmp_path / "ds")
    want = {
        "i": ("int16", (), False),
        "f": ("float32", (), False),
        "b": ("bool", (), False),
        "t": ("datetime64[us]", (), False),
        "s": ("str", (), False),
        "late_null": ("str", (), True),
        "mostly_null": ("str", (), True),
        "blob": ("bytes", (), False),
        "nullable_int": ("int64", (), True),
        "nullable_bool": ("bool", (), True),
        "tensor": ("float64", (2, 3), False),
        "var": ("int32", (None,), False),
    }
    assert {f.name: (f.dtype_name, f.shape, f.nullable) for f in ds.schema} == want
    assert ds.schema["tensor"].codec.name == "tensor"
    assert ds.schema["var"].codec.name == "ndarray"
    assert ds.num_rows == n


def test_date_objects_are_inferred_and_read_back_as_datetime64(tmp_path: Path) -> None:
    days = [datetime.date(1999, 12, 31), None, datetime.date(2024, 2, 29)]
    times = [datetime.datetime(2024, 2, 29, 23, 59, 58, 999999), datetime.datetime(1970, 1, 1), None]
    ds = shardkit.write_dataset(pd.DataFrame({"day": days, "at": times}), tmp_path / "ds")
    assert {f.name: (f.dtype_name, f.nullable) for f in ds.schema} == {
        "day": ("datetime64[D]", True), "at": ("datetime64[us]", True)}
    batch = next(iter(shardkit.make_reader(ds.url, batch_size=3, shuffle=False)))
    for name, values in (("day", days), ("at", times)):
        assert batch[name].mask.tolist() == [v is None for v in values]
        got = zip(batch[name].data.tolist(), batch[name].mask, strict=True)
        assert [None if masked else v for v, masked in got] == values


def test_schema_inferred_from_arrow(tmp_path: Path) -> None:
    table = pa.table(
        {
            "i": pa.array([1, 2, None], pa.int32()),
            "f": pa.array([1.0, 2.0, 3.0], pa.float16()),
            "s": pa.array(["a", "b", "c"], pa.large_string()),
            "d": pa.array(["x", "y", "x"]).dictionary_encode(),
            "l": pa.array([[1.0], [], [2.0, 3.0]], pa.list_(pa.float32())),
            "fl": pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.int64(), 2)),
            "ts": pa.array([0, 1, 2], pa.timestamp("ms")),
            "tensor": pa.FixedShapeTensorArray.from_numpy_ndarray(np.zeros((3, 2, 2), np.uint8)),
        }
    )
    ds = shardkit.write_dataset(table, tmp_path / "ds")
    got = {f.name: (f.dtype_name, f.shape, f.nullable) for f in ds.schema}
    assert got == {
        "i": ("int32", (), True),
        "f": ("float16", (), False),
        "s": ("str", (), False),
        "d": ("str", (), False),
        "l": ("float32", (None,), False),
        "fl": ("int64", (2,), False),
        "ts": ("datetime64[ms]", (), False),
        "tensor": ("uint8", (2, 2), False),
    }
    out = ds.decode(ds.read_row_group(0))
    assert out["d"].tolist() == ["x", "y", "x"]
    np.testing.assert_array_equal(out["fl"], [[1, 2], [3, 4], [5, 6]])


def test_schema_inferred_from_row_dicts_and_dict_of_columns(tmp_path: Path) -> None:
    rows = [{"id": i, "x": np.full((2,), i, np.float32), "tag": "t" if i else None} for i in range(5)]
    ds = shardkit.write_dataset(rows, tmp_path / "rows")
    assert [(f.name, f.dtype_name, f.shape, f.nullable) for f in ds.schema] == [
        ("id", "int64", (), False),
        ("x", "float32", (2,), False),
        ("tag", "str", (), True),
    ]
    ds = shardkit.write_dataset(
        {"id": np.arange(3, dtype=np.uint8), "v": [[1, 2], [3], []]}, tmp_path / "cols"
    )
    assert [(f.name, f.dtype_name, f.shape) for f in ds.schema] == [
        ("id", "uint8", ()),
        ("v", "int64", (None,)),
    ]


def test_inference_refuses_columns_it_cannot_guess(tmp_path: Path, helpers: SimpleNamespace) -> None:
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaError, match=r"'n'.*only nulls.*Field"):
        shardkit.write_dataset({"n": [None, None]}, url)
    with pytest.raises(SchemaError, match=r"'m'.*dimensions.*Field"):
        shardkit.write_dataset({"m": [np.zeros(2), np.zeros((2, 2))]}, url)
    with pytest.raises(SchemaError, match="no rows and no schema"):
        shardkit.write_dataset(iter([]), url)
    helpers.assert_nothing_written(url)


# --- bad input: the error class, a message naming value / place / fix, and nothing written ---------

GOOD_SCHEMA = Schema(
    [Field("id", "int64"), Field("score", "float32"), Field("x", "float32", (3,)), Field("name", "str")]
)


def good_columns(n: int = 4) -> dict[str, Any]:
    return {
        "id": np.arange(n),
        "score": np.linspace(0, 1, n),
        "x": np.zeros((n, 3), np.float32),
        "name": [f"n{i}" for i in range(n)],
    }


def with_changes(**changes: Any) -> dict[str, Any]:
    columns = good_columns()
    for key, value in changes.items():
        if value is KeyError:
            del columns[key]
        else:
            columns[key] = value
    return columns


BAD_DATA = {
    "missing column": (with_changes(name=KeyError), ["['name']", "add them", "schema"]),
    "extra column": (with_changes(extra=[1, 2, 3, 4]), ["['extra']", "Field", "drop"]),
    "float in int field": (with_changes(id=np.array([1.0, 2.5, 3.0, 4.0])), ["'id'", "int64", "float64"]),
    "str in float field": (with_changes(score=["a", "b", "c", "d"]), ["'score'", "float32", "string"]),
    "str in float tensor": (
        with_changes(x=[np.array(["a", "b", "c"])] * 4),
        ["'x'", "float32", "str", "convert"],
    ),
    "wrong shape": (with_changes(x=np.zeros((4, 4), np.float32)), ["'x'", "(3,)", "(4,)", "reshape"]),
    "mixed shapes": (
        with_changes(
            x=[np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(2, np.float32), np.zeros(3)]
        ),
        ["'x'", "row 2", "(2,)", "(3,)"],
    ),
    "null in non-nullable": (with_changes(name=["a", None, "c", "d"]), ["'name'", "row 1", "nullable=True"]),
    "null tensor in non-nullable": (
        with_changes(x=[np.zeros(3, np.float32), None, None, None]),
        ["'x'", "row 1", "nullable=True"],
    ),
    "columns of different lengths": (with_changes(id=np.arange(5)), ["'id': 5", "'name': 4"]),
}


@pytest.mark.parametrize("case", BAD_DATA, ids=list(BAD_DATA))
@pytest.mark.parametrize("first_write", [True, False], ids=["first-write", "overwrite"])
def test_bad_data_raises_schema_mismatch_and_writes_nothing(
    any_url: str, helpers: SimpleNamespace, case: str, first_write: bool
) -> None:
    data, needles = BAD_DATA[case]
    if not first_write:
        shardkit.write_dataset(good_columns(3), any_url, schema=GOOD_SCHEMA)
        before = helpers.files_under(any_url)
    with pytest.raises(SchemaMismatchError) as info:
        shardkit.write_dataset(
            data, any_url, schema=GOOD_SCHEMA, mode="error" if first_write else "overwrite"
        )
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    if first_write:
        helpers.assert_nothing_written(any_url)
    else:
        assert helpers.files_under(any_url) == before  # the old dataset, untouched, no staging
        assert shardkit.open_dataset(any_url).num_rows == 3


def test_bad_row_far_into_a_stream_names_its_input_row(tmp_path: Path, helpers: SimpleNamespace) -> None:
    url = str(tmp_path / "ds")
    rows = ({"id": i, "name": "x" if i != BATCH_ROWS + 7 else None} for i in range(BATCH_ROWS + 10))
    schema = Schema([Field("id", "int64"), Field("name", "str")])
    with pytest.raises(SchemaMismatchError) as info:
        shardkit.write_dataset(rows, url, schema=schema, row_group_size=100)
    message = str(info.value)
    assert f"input row {BATCH_ROWS}" in message
    assert "row 7" in message
    assert "'name'" in message
    helpers.assert_nothing_written(url)


def test_row_dicts_with_different_keys(tmp_path: Path, helpers: SimpleNamespace) -> None:
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaMismatchError, match=r"row 2.*missing \['b'\].*extra \['c'\]"):
        shardkit.write_dataset([{"a": 1, "b": 2}, {"a": 1, "b": 2}, {"a": 1, "c": 2}], url)
    helpers.assert_nothing_written(url)


LABELS = st.one_of(st.integers(0, 3), st.sampled_from(["0", "1", "a"]))


@given(labels=st.lists(LABELS, min_size=1, max_size=4))
@settings(max_examples=40, deadline=None)
def test_dataframe_labels_that_name_one_field_are_refused(labels: list[Any]) -> None:
    # 1 and "1" both became the field "1" and one column was lost; ["a", "a"] gave a shape error
    df = pd.DataFrame([list(range(len(labels)))], columns=labels)
    root = f"/shardkit-labels-{uuid.uuid4().hex[:8]}"
    url = f"memory://{root}/ds"
    names = [str(label) for label in labels]
    declared = Schema([Field(n, "int64") for n in set(names)])
    try:
        for data, schema in [(df, None), (iter([df]), None), (df, declared)]:
            if len(set(names)) == len(names):
                ds = shardkit.write_dataset(data, url, schema=schema, mode="overwrite")
                assert sorted(ds.schema.names) == sorted(names)
                continue
            clash = next(n for n in names if names.count(n) > 1)
            with pytest.raises(SchemaMismatchError) as info:
                shardkit.write_dataset(data, url, schema=schema, mode="overwrite")
            message = str(info.value)
            assert f"become {clash!r}" in message
            assert repr([label for label in labels if str(label) == clash]) in message
            assert not fsspec.filesystem("memory").exists(f"{root}/ds")
    finally:
        if fsspec.filesystem("memory").exists(root):
            fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.mark.parametrize(
    ("data", "shape"),
    [
        ({"id": np.zeros((3, 2), np.int64)}, r"\(3, 2\), \(2,\) per row"),
        # inside an iterable, a dict of 2-D numpy columns is a batch of 1-D rows by the schema's scalar
        # field (a dict of 1-D columns is a batch of scalars: tests/dataset/test_tables_write.py)
        (lambda: iter([{"id": np.zeros((3, 2), np.int64)}]), r"\(3, 2\), \(2,\) per row"),
    ],
    ids=["2-D column", "iterable of dicts of numpy columns"],
)
def test_arrays_given_to_a_scalar_field_name_the_field_and_shape(
    tmp_path: Path, helpers: SimpleNamespace, data: Any, shape: str
) -> None:
    # raised a bare pyarrow ArrowInvalid
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaMismatchError, match=rf"field 'id'.*shape \(\).*{shape}"):
        shardkit.write_dataset(data() if callable(data) else data, url, schema=Schema([Field("id", "int64")]))
    helpers.assert_nothing_written(url)
    columns = iter([{"id": pa.array(np.arange(3))}, {"id": pa.array(np.arange(3, 6))}])  # Arrow: columns
    assert shardkit.write_dataset(columns, url, schema=Schema([Field("id", "int64")])).num_rows == 6


def test_arrow_tables_with_a_column_name_twice_are_refused(tmp_path: Path, helpers: SimpleNamespace) -> None:
    url = str(tmp_path / "ds")
    table = pa.table([pa.array([1]), pa.array([2])], names=["a", "a"])
    with pytest.raises(SchemaMismatchError, match=r"Arrow table.*\['a', 'a'\] become 'a'"):
        shardkit.write_dataset(table, url)
    helpers.assert_nothing_written(url)


@pytest.mark.parametrize("data", [42, "a string", b"bytes", 3.5])
def test_unsupported_input_types(tmp_path: Path, helpers: SimpleNamespace, data: Any) -> None:
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaError, match=rf"{type(data).__name__}.*DataFrame"):
        shardkit.write_dataset(data, url, schema=GOOD_SCHEMA)
    helpers.assert_nothing_written(url)


def test_an_exception_from_the_input_itself_leaves_nothing(tmp_path: Path, helpers: SimpleNamespace) -> None:
    def rows() -> Any:
        for i in range(BATCH_ROWS * 3):
            if i == BATCH_ROWS * 2 + 1:
                raise RuntimeError("the source broke")
            yield {"id": i, "name": "n"}

    url = str(tmp_path / "ds")
    with pytest.raises(RuntimeError, match="the source broke"):
        shardkit.write_dataset(
            rows(), url, schema=[Field("id", "int64"), Field("name", "str")], row_group_size=10
        )
    helpers.assert_nothing_written(url)


@pytest.mark.parametrize(
    "data",
    [
        [pa.record_batch({"a": [1]}), None, pa.record_batch({"a": [2]})],
        [{"a": 1}, None, {"a": 2}],
    ],
    ids=["batches", "rows"],
)
def test_none_inside_an_input_stream_is_an_error_not_its_end(
    tmp_path: Path, helpers: SimpleNamespace, data: list[Any]
) -> None:
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaError, match="NoneType"):
        shardkit.write_dataset(iter(data), url, schema=[Field("a", "int64")])
    helpers.assert_nothing_written(url)


def test_url_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "data.parquet"
    pq.write_table(pa.table({"a": [1]}), target)
    for mode in ("error", "overwrite", "append"):
        with pytest.raises(shardkit.errors.NotADatasetError, match=r"data\.parquet.*is a file.*folder"):
            shardkit.write_dataset(good_columns(), target, mode=mode)  # type: ignore[arg-type]
    assert pq.read_table(target).column("a").to_pylist() == [1]


def test_file_urls_and_paths_name_the_same_dataset(tmp_path: Path) -> None:
    shardkit.write_dataset(good_columns(), f"file://{tmp_path}/ds")
    assert shardkit.open_dataset(tmp_path / "ds").num_rows == 4
    assert shardkit.write_dataset(good_columns(2), tmp_path / "ds", mode="append").num_rows == 6
    assert shardkit.open_dataset(f"file://{tmp_path}/ds/").num_rows == 6


def test_images_through_write_dataset(any_url: str, helpers: SimpleNamespace) -> None:
    rng = np.random.default_rng(3)
    png = rng.integers(0, 256, (7, 6, 5, 3), dtype=np.uint8)
    y, x = np.mgrid[0:16, 0:16]
    smooth = np.stack([(40 + 8 * x + 4 * y + k).astype(np.uint8) for k in range(7)])
    schema = Schema(
        [
            Field("png", "uint8", (6, 5, 3), codec=shardkit.ImageCodec("png")),
            Field("jpeg", "uint8", (16, 16), codec=shardkit.ImageCodec("jpeg", quality=92)),
            Field("any", "uint8", (None, None), codec="image", nullable=True),
        ]
    )
    sizes = [None if i == 3 else png[i, : i + 1, : 7 - i, 0] for i in range(7)]
    ds = shardkit.write_dataset(
        {"png": png, "jpeg": list(smooth), "any": sizes}, any_url, schema=schema, row_group_size=3
    )
    got = helpers.read_all(shardkit.open_dataset(any_url))
    np.testing.assert_array_equal(np.stack(got["png"]), png)
    assert np.abs(np.stack(got["jpeg"]).astype(int) - smooth).mean() < 2.0
    assert got["any"][3] is None
    for i in (0, 1, 2, 4, 5, 6):
        np.testing.assert_array_equal(got["any"][i], sizes[i])
    table = pyarrow_table(any_url)
    assert table.schema.field("png").type == pa.binary()
    np.testing.assert_array_equal(ds.schema.decode(table)["png"], png)


def test_bad_mode(tmp_path: Path, helpers: SimpleNamespace) -> None:
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaError, match=r"'replace'.*'overwrite'"):
        shardkit.write_dataset(good_columns(), url, mode="replace")  # type: ignore[arg-type]
    helpers.assert_nothing_written(url)


# --- modes ------------------------------------------------------------------------------------------


def test_mode_error_over_an_existing_dataset(any_url: str, helpers: SimpleNamespace) -> None:
    shardkit.write_dataset(good_columns(), any_url)
    before = helpers.files_under(any_url)
    with pytest.raises(DatasetExistsError) as info:
        shardkit.write_dataset(good_columns(), any_url)
    assert isinstance(info.value, FileExistsError)
    for needle in [any_url, "mode='overwrite'", "mode='append'"]:
        assert needle in str(info.value)
    assert helpers.files_under(any_url) == before


def test_mode_error_over_a_plain_parquet_folder(tmp_path: Path, plain_parquet_folder: Any) -> None:
    url = plain_parquet_folder([pd.DataFrame({"a": [1, 2]})])
    with pytest.raises(DatasetExistsError, match="already exists"):
        shardkit.write_dataset(good_columns(), url)


def test_mode_error_into_an_empty_folder_or_one_without_parquet(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert shardkit.write_dataset(good_columns(), tmp_path / "empty").num_rows == 4
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("hello")
    ds = shardkit.write_dataset(good_columns(), tmp_path / "notes")
    assert ds.num_rows == 4
    assert (tmp_path / "notes" / "README.md").read_text() == "hello"


@pytest.mark.parametrize("mode", ["error", "append", "overwrite"])
def test_only_overwrite_replaces_parts_without_a_summary(
    tmp_path: Path, helpers: SimpleNamespace, mode: str
) -> None:
    """Parts with no _metadata and no _staging beside them: a dataset whose summary was deleted or not
    copied (or a write killed after its last move). They used to be garbage for every mode: mode='error'
    or 'append' deleted a dataset that had only lost its summary. Now only 'overwrite' replaces them;
    the others name both fixes. (With _staging beside them: test_atomic's killed writes.)"""
    url = str(tmp_path / "ds")
    killed = shardkit.write_dataset(good_columns(8), url, row_group_size=2, file_size=1)
    for name in ("_metadata", "_common_metadata"):  # what a writer killed before its commit leaves
        os.remove(os.path.join(url, name))
    with pytest.raises(shardkit.errors.NotADatasetError, match=r"did not finish.*mode='overwrite'"):
        shardkit.open_dataset(url)
    before = helpers.files_under(url)
    if mode != "overwrite":
        with pytest.raises(DatasetExistsError, match=rf"holds {len(killed.files)} part file\(s\) written by "
                           rf"shardkit but no _metadata.*mode='{mode}' does not delete them: pass "
                           r"mode='overwrite'.*shardkit.write_summary\(url\)"):
            shardkit.write_dataset(good_columns(3), url, mode=mode)  # type: ignore[arg-type]
        assert helpers.files_under(url) == before  # nothing deleted
        assert shardkit.write_summary(url).num_rows == 8  # the parts were whole: adopted
        return
    ds = shardkit.write_dataset(good_columns(3), url, mode=mode)  # type: ignore[arg-type]
    assert ds.num_rows == 3
    assert not set(killed.files) & helpers.files_under(url)
    assert helpers.files_under(url) == {"_metadata", "_common_metadata", *ds.files}


def test_overwrite_replaces_data_files_and_keeps_others(tmp_path: Path, helpers: SimpleNamespace) -> None:
    url = str(tmp_path / "ds")
    old = shardkit.write_dataset(good_columns(8), url, row_group_size=2)
    (tmp_path / "ds" / "README.md").write_text("about this dataset")
    new = shardkit.write_dataset({"other": np.arange(3)}, url, mode="overwrite")
    assert new.schema.names == ["other"]
    assert new.num_rows == 3
    assert not set(old.files) & set(new.files)
    assert helpers.files_under(url) == {"_metadata", "_common_metadata", "README.md", *new.files}
    assert shardkit.open_dataset(url).decode(new.read_row_group(0))["other"].tolist() == [0, 1, 2]


def test_overwrite_a_plain_parquet_folder(
    tmp_path: Path, plain_parquet_folder: Any, helpers: SimpleNamespace
) -> None:
    url = plain_parquet_folder([pd.DataFrame({"a": [1, 2]}), pd.DataFrame({"a": [3]})])
    ds = shardkit.write_dataset({"b": ["x"]}, url, mode="overwrite")
    assert helpers.files_under(url) == {"_metadata", "_common_metadata", *ds.files}
    assert shardkit.open_dataset(url).kind == "shardkit"


def test_append_adds_row_groups(any_url: str, helpers: SimpleNamespace) -> None:
    first = shardkit.write_dataset(good_columns(4), any_url, schema=GOOD_SCHEMA, row_group_size=2)
    more = good_columns(3)
    more["id"] = np.arange(100, 103)
    ds = shardkit.write_dataset(more, any_url, mode="append", row_group_size=2)
    assert ds.schema == GOOD_SCHEMA
    assert ds.num_rows == 7
    assert ds.row_groups[:2] == first.row_groups
    assert [rg.num_rows for rg in ds.row_groups] == [2, 2, 2, 1]
    assert helpers.read_all(shardkit.open_dataset(any_url))["id"] == [0, 1, 2, 3, 100, 101, 102]
    assert helpers.files_under(any_url) == {"_metadata", "_common_metadata", *ds.files}


def test_append_creates_a_missing_dataset(any_url: str) -> None:
    assert shardkit.write_dataset(good_columns(), any_url, mode="append").num_rows == 4


def test_append_with_a_different_schema(any_url: str, helpers: SimpleNamespace) -> None:
    shardkit.write_dataset(good_columns(), any_url, schema=GOOD_SCHEMA)
    before = helpers.files_under(any_url)
    other = Schema([Field("id", "int32"), *GOOD_SCHEMA[1:]])
    with pytest.raises(SchemaMismatchError) as info:
        shardkit.write_dataset(good_columns(), any_url, schema=other, mode="append")
    for needle in [any_url, "field 'id': dtype 'int64' in the dataset, 'int32' given", "mode='overwrite'"]:
        assert needle in str(info.value)
    with pytest.raises(SchemaMismatchError, match=r"\['extra'\]"):
        shardkit.write_dataset(with_changes(extra=np.arange(4)), any_url, mode="append")
    assert helpers.files_under(any_url) == before
    assert shardkit.open_dataset(any_url).num_rows == 4


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        (Field("v", "float32", (3,)), Field("v", "float32", (3,), nullable=True),
         "field 'v': nullable False in the dataset, True given"),
        (Field("v", "uint8", (4, 4), codec=ImageCodec("png")),
         Field("v", "uint8", (4, 4), codec=ImageCodec("jpeg")),
         "field 'v': codec ImageCodec(format='png', quality=95) in the dataset, ImageCodec(format='jpeg'"),
        (Field("v", "float32", (3,)), Field("v", "float32", (None,)),
         "field 'v': shape (3,) in the dataset, (None,)"),
        (Field("v", "float32", (3,)), Field("w", "float32", (3,)),
         "the dataset has the fields ['v'], the given"),
    ],
    ids=["nullable", "codec option", "shape", "name"],
)
def test_append_with_a_different_schema_names_what_differs(
    tmp_path: Path, old: Field, new: Field, needle: str
) -> None:
    # schemas that differ only in nullability or a codec option printed the same twice
    url = str(tmp_path / "ds")
    shardkit.write_dataset({"v": np.zeros((2, 3), np.float32) if old.codec.name != "image" else
                            np.zeros((2, 4, 4), np.uint8)}, url, schema=Schema([old]))
    with pytest.raises(SchemaMismatchError) as info:
        shardkit.write_dataset({new.name: []}, url, schema=Schema([new]), mode="append")
    assert needle in str(info.value)


def test_append_to_a_plain_parquet_folder_is_refused(tmp_path: Path, plain_parquet_folder: Any) -> None:
    url = plain_parquet_folder([pd.DataFrame({"a": [1, 2]})])
    with pytest.raises(DatasetExistsError, match=r"no _metadata.*write_summary"):
        shardkit.write_dataset({"a": [3]}, url, mode="append")


def test_empty_dataset_with_a_schema(any_url: str, helpers: SimpleNamespace) -> None:
    ds = shardkit.write_dataset([], any_url, schema=GOOD_SCHEMA)
    assert ds.num_rows == 0
    assert ds.row_groups == ()
    assert shardkit.open_dataset(any_url).schema == GOOD_SCHEMA
    assert pyarrow_table(any_url).num_rows == 0
    ds = shardkit.write_dataset(good_columns(2), any_url, mode="append")
    assert ds.num_rows == 2


def test_storage_options_reach_every_open(tmp_path: Path) -> None:
    """A filesystem that only works with its storage options (here fsspec's DirFileSystem)."""
    options = {"path": os.fspath(tmp_path), "target_protocol": "file"}
    shardkit.write_dataset(good_columns(2), "dir://ds", storage_options=options)
    ds = shardkit.write_dataset(good_columns(3), "dir://ds", mode="append", storage_options=options)
    assert ds.num_rows == 5
    assert shardkit.open_dataset("dir://ds", storage_options=options).num_rows == 5
    assert shardkit.open_dataset(tmp_path / "ds").num_rows == 5


# --- progress ---------------------------------------------------------------------------------------


def test_progress_bar_counts_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n = 3 * BATCH_ROWS + 11
    shardkit.write_dataset({"x": np.arange(n)}, tmp_path / "a", progress=True)
    err = capsys.readouterr().err
    assert "write_dataset" in err
    assert "rows" in err
    assert "12.3k/12.3k" in err  # done / total, unit-scaled by tqdm
    assert "rows/s" in err

    shardkit.write_dataset([{"x": i} for i in range(25)], tmp_path / "b", progress=True)
    assert "25.0/25.0" in capsys.readouterr().err

    batches = [pa.record_batch({"x": np.arange(10)})] * 4  # a list of 4 batches is 40 rows, not 4
    shardkit.write_dataset(iter(batches), tmp_path / "c", progress=True)
    err = capsys.readouterr().err
    assert "40.0 rows" in err
    assert "/" not in err.split("rows")[-2]  # no total for a stream

    shardkit.write_dataset({"x": np.arange(n)}, tmp_path / "d", progress=False)
    assert capsys.readouterr().err == ""


def _arrow_of(column: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """A column read by `make_reader` (masked where null, or an object array with None) as Arrow."""
    if column.dtype == object:
        return pa.array(column.tolist(), arrow_type)
    return pa.array(np.ma.getdata(column), mask=np.ma.getmaskarray(column), type=arrow_type)


def test_arrow_types_the_codecs_round_trip_are_inferred_and_read_back_unchanged(tmp_path: Path) -> None:
    """Each column, with nulls, is inferred, written and read back by `make_reader` as the same values
    (compared in the canonical Arrow type of its field), and plain pyarrow reads the same values."""
    days = [0, None, 18_000, -1, -719_162, 2_932_896]
    table = pa.table({
        "string_view": pa.array(["a", None, "", "日本", "z\x00", "x" * 40], pa.string_view()),
        "large_string": pa.array(["a", None, "", "日本", "z", "y"], pa.large_string()),
        "binary_view": pa.array([b"a", None, b"", b"\x00\xff", b"z", b"x" * 40], pa.binary_view()),
        "large_binary": pa.array([b"a", None, b"", b"\x00\xff", b"z", b"y"], pa.large_binary()),
        "fixed_binary": pa.array([b"ab", None, b"\x00\x00", b"\x00\xff", b"zz", b"yy"], pa.binary(2)),
        "date32": pa.array(days, pa.date32()),
        "date64": pa.array([None if d is None else d * 86_400_000 for d in days], pa.date64()),
        "duration_s": pa.array([0, None, -5, 2**40, 1, 2], pa.duration("s")),
        "duration_ns": pa.array([0, None, -5, 2**62, 1, 2], pa.duration("ns")),
    })
    canonical = {"str": pa.string(), "bytes": pa.binary(), "datetime64[D]": pa.date32()}
    url = str(tmp_path / "ds")
    ds = shardkit.write_dataset(table, url, row_group_size=4)
    with shardkit.make_reader(url, shuffle=False, batch_size=100) as reader:
        (batch,) = list(reader)
    stored = pq.read_table(url)
    for name in table.column_names:
        field = ds.schema[name]
        assert field.nullable, name
        want = canonical.get(field.dtype_name, table.schema.field(name).type)
        expected = table.column(name).cast(want).combine_chunks()
        assert _arrow_of(batch[name], want).equals(expected), (name, batch[name], expected)
        assert stored.column(name).cast(want).combine_chunks().equals(expected), name


# --- tensors of 2 or more dimensions as nested lists -----------------------------------------------------


def _read_all(url: str) -> dict[str, Any]:
    with shardkit.make_reader(url, batch_size=1000, shuffle=False) as reader:
        return next(iter(reader))


@pytest.mark.parametrize("form", ["python lists", "arrow lists", "arrow fixed-size lists", "arrow sliced",
                                  "arrow with a null row", "pandas from arrow"])
def test_nested_lists_of_the_declared_shape_write_as_tensors(tmp_path: Path, form: str) -> None:
    """An Arrow ``list<list<int64>>`` column (a Parquet or JSON source's nested lists; a DataFrame made from
    one holds object arrays of arrays) failed a fixed shape (2, 3) with "row 0 has shape (2,)": numpy
    made each row a 1-D array of arrays. Every form now writes and reads back as the nested values."""
    values = np.arange(60, dtype=np.int64).reshape(10, 2, 3)
    rows: list[Any] = values.tolist()
    nested = pa.list_(pa.list_(pa.int64()))
    data: Any = {
        "python lists": {"v": rows},
        "arrow lists": pa.table({"v": pa.array(rows, nested)}),
        "arrow fixed-size lists": pa.table({"v": pa.array(rows, pa.list_(pa.list_(pa.int64(), 3), 2))}),
        "arrow sliced": pa.table({"v": pa.array([rows[0], *rows, rows[0]], nested)}).slice(1, 10),
        "arrow with a null row": pa.table({"v": pa.array([*rows[:9], None], nested)}),
        "pandas from arrow": pa.table({"v": pa.array(rows, nested)}).to_pandas(),
    }[form]
    nullable = form == "arrow with a null row"
    for shape, codec in (((2, 3), "tensor"), ((None, 3), "ndarray"), ((2, None), "ndarray")):
        url = str(tmp_path / f"{codec}-{shape[0]}-{shape[1]}")
        schema = Schema([Field("v", "int64", shape, codec=codec, nullable=nullable)])
        shardkit.write_dataset(data, url, schema=schema)
        got = _read_all(url)["v"]
        if nullable:
            assert got[9] is None or bool(np.ma.getmaskarray(got[9]).all())
            got, values9 = got[:9], values[:9]
        else:
            values9 = values
        assert [np.asarray(r).tolist() for r in got] == values9.tolist(), (form, shape)


def test_ragged_nested_lists_name_their_lengths_not_a_numpy_error(tmp_path: Path) -> None:
    """Ragged Python lists raised numpy's bare ``ValueError`` ("inhomogeneous shape") from inside the codec,
    and ragged Arrow lists said "row 0 has shape (2,)"; both are a `SchemaMismatchError` naming the row
    and the inner lengths now."""
    for codec, shape in (("tensor", (2, 3)), ("ndarray", (None, 3))):
        schema = Schema([Field("v", "int64", shape, codec=codec)])
        for data in ({"v": [[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5]]]},
                     pa.table({"v": pa.array([[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5]]])})):
            with pytest.raises(SchemaMismatchError, match=r"field 'v'.*row 1 has shape \(2,\), of lists of "
                                                          r"unequal lengths \(3, 2\)"):
                shardkit.write_dataset(data, str(tmp_path / codec), schema=schema)


# --- credentials an S3 store refuses -------------------------------------------------------------------


@pytest.mark.parametrize("user", ["unknown key", "nobody", "no-list"])
def test_refused_credentials_are_a_permission_error_naming_the_url(iam: IAMServer, no_internet: None,
                                                                   user: str) -> None:
    """A key the store does not know, credentials that may do nothing, or only read objects: the write's
    first request (does the dataset exist?) raised s3fs's bare ``PermissionError: Forbidden`` (no URL, no
    fix); now a `DatasetPermissionError` naming the URL and what the credentials need, nothing written.
    What a write needs, not a read's "list the bucket and read objects" (credentials fixed to that would
    be refused again at the first write)."""
    url = f"s3://{iam.bucket}/new-{uuid.uuid4().hex[:8]}"
    consumed: list[int] = []

    def rows() -> Any:
        consumed.append(0)
        yield {"x": 1}

    with pytest.raises(DatasetPermissionError, match=rf"permission denied: cannot write to '{iam.bucket}/"
                                                     rf"new-[0-9a-f]+' \(.*\)\. Check that these "
                                                     rf"credentials may list the bucket and read, write and "
                                                     rf"delete objects under '{url}'$"):
        shardkit.write_dataset(rows(), url, storage_options=iam.options(user))
    assert not consumed  # refused before any input was read
    import s3fs

    assert not s3fs.S3FileSystem(**iam.options("admin")).exists(url)


@pytest.mark.parametrize("data", [pd.DataFrame(), pd.DataFrame(index=range(3)), pa.table({}), {},
                                  iter([pd.DataFrame(index=range(2))])],
                         ids=["empty-frame", "rows-no-columns", "arrow", "dict", "stream"])
def test_data_without_columns_is_refused_as_the_cli_refuses_it(tmp_path: Path, data: Any) -> None:
    url = str(tmp_path / "none")
    with pytest.raises(SchemaError, match="has no columns") as caught:
        shardkit.write_dataset(data, url)
    assert "at least one column" in str(caught.value)
    assert not os.path.exists(url)


@pytest.mark.parametrize(("frame", "problem"), [
    (pd.DataFrame({"id": np.arange(3, dtype=np.int32), "new": [1, 2, 3]}), r"column\(s\) \['new'\]"),
    (pd.DataFrame({"id": np.array([2**40], dtype=np.int64)}), "outside its range"),
    (pd.DataFrame({"id": [0.5]}), "the data has dtype float64"),
], ids=["new-column", "wider-integers", "floats"])
def test_an_append_that_does_not_fit_offers_the_fixes_an_append_can_take(
        tmp_path: Path, frame: pd.DataFrame, problem: str) -> None:
    url = str(tmp_path / "ds")
    shardkit.write_dataset(pd.DataFrame({"id": np.arange(3, dtype=np.int32)}), url)
    with pytest.raises(SchemaMismatchError, match=problem) as caught:
        shardkit.write_dataset(frame, url, mode="append")
    message = str(caught.value)
    assert "add a Field" not in message
    fixes = message.split("; ", 1)[1]
    assert "declare" not in fixes  # no fix an append cannot take
    assert "an append keeps the dataset's schema (id: int32)" in message
    assert "mode='overwrite'" in message
    assert len(shardkit.open_dataset(url).files) == 1  # nothing appended
