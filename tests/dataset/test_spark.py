"""`write_spark` against a real local Spark session, compared with `write_dataset` on the same data."""

from __future__ import annotations

import datetime
import io
import os
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import shardkit
from shardkit import Field, ImageCodec, Schema
from shardkit.errors import (
    DatasetError,
    DatasetExistsError,
    DatasetNotFoundError,
    SchemaError,
    SchemaMismatchError,
)

pytest.importorskip("pyspark")
from pyspark.sql import types as T

from shardkit.dataset.codecs.tensor import TensorCodec
from shardkit.dataset.spark import schema_from_spark, write_spark
from shardkit.dataset.spark._columns import column_for_field

pytestmark = [
    pytest.mark.spark,
    # with pandas >= 3 installed, pyspark 4.3 warns from createDataFrame and mapInArrow (via its
    # pandas_udf version check), although mapInArrow converts nothing through pandas
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
]

N = 40
SPARK_DDL = "id long, x array<array<float>>, text string, weight long, image array<int>, tokens array<int>"
SCHEMA = Schema([
    Field("id", "int64"),
    Field("x", "float32", (2, 3), nullable=True),
    Field("text", "str"),
    Field("weight", "int64", nullable=True),
    Field("image", "uint8", (8, 8, 3), codec=ImageCodec("png")),
    Field("tokens", "int32", (None,)),
])


def _source() -> dict[str, list]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, 2, 3)).astype(np.float32)
    return {
        "id": list(range(N)),
        "x": [None if i == 5 else x[i] for i in range(N)],
        "text": [f"sample-{i}-é" for i in range(N)],
        "weight": [None if i % 7 == 0 else 10 * i for i in range(N)],
        "image": list(rng.integers(0, 256, (N, 8, 8, 3), dtype=np.uint8)),
        "tokens": [np.arange(i % 5, dtype=np.int32) for i in range(N)],
    }


def _spark_df(spark, src, *, image=None):
    # the tensor goes in nested (2 x 3), the image flat (192 ints per row): both layouts are accepted
    flat = image or (lambda a: a.reshape(-1).tolist())
    rows = [
        (i, None if x is None else x.tolist(), t, w, flat(img), tok.tolist())
        for i, x, t, w, img, tok in zip(*src.values(), strict=True)
    ]
    return spark.createDataFrame(rows, SPARK_DDL)


def _pandas_df(src) -> pd.DataFrame:
    cols = dict(src)
    cols["weight"] = pd.array(src["weight"], dtype="Int64")
    return pd.DataFrame({k: pd.Series(v, dtype=object) if k in ("x", "image", "tokens") else v
                         for k, v in cols.items()})


def _rows(ds: shardkit.Dataset) -> dict[str, list]:
    """Every decoded value of ``ds`` per column, in order, with None for a null row."""
    out: dict[str, list] = {name: [] for name in ds.schema.names}
    for i in range(len(ds.row_groups)):
        for name, arr in ds.decode(ds.read_row_group(i)).items():
            mask = np.ma.getmaskarray(arr) if isinstance(arr, np.ma.MaskedArray) else None
            data = np.ma.getdata(arr)
            out[name] += [None if mask is not None and mask[j].any() else data[j] for j in range(len(data))]
    return out


def _assert_same(got: list, want: list, name: str) -> None:
    assert len(got) == len(want), name
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, (name, j)
        else:
            assert np.array_equal(np.asarray(g), np.asarray(w)), (name, j, g, w)
            if isinstance(w, np.ndarray):
                assert np.asarray(g).dtype == w.dtype, (name, j)


@pytest.mark.timeout(120)
def test_spark_and_pandas_write_the_same_dataset(spark, tmp_path):
    src = _source()
    by_pandas = shardkit.write_dataset(_pandas_df(src), tmp_path / "pandas", schema=SCHEMA, row_group_size=16)
    by_spark = write_spark(_spark_df(spark, src), str(tmp_path / "spark"), schema=SCHEMA, row_group_size=16)

    assert by_spark.schema == by_pandas.schema == SCHEMA
    assert by_spark.num_rows == by_pandas.num_rows == N
    assert len(by_spark.files) == 2  # one part file per Spark partition (local[2])
    assert not (tmp_path / "spark" / "_staging").exists()
    got, want = _rows(by_spark), _rows(by_pandas)
    for name in SCHEMA.names:
        _assert_same(got[name], want[name], name)
        _assert_same(want[name], [np.int64(v) if name == "id" else v for v in src[name]], name)
    from shardkit.dataset.verify import verify_dataset

    for url in (tmp_path / "spark", tmp_path / "pandas"):  # every page written carries a checksum
        report = verify_dataset(str(url))
        assert report.ok
        assert report.pages > 0
        assert report.unchecked_pages == 0


@pytest.mark.timeout(120)
def test_append_and_overwrite_through_spark(spark, tmp_path):
    src = _source()
    url = str(tmp_path / "ds")
    shardkit.write_dataset(_pandas_df(src), url, schema=SCHEMA)
    df = _spark_df(spark, src)

    appended = write_spark(df, url, mode="append")  # the existing schema is taken
    assert appended.num_rows == 2 * N
    assert appended.schema == SCHEMA
    assert _rows(appended)["id"] == list(range(N)) * 2

    replaced = write_spark(df.limit(3), url, schema=SCHEMA, mode="overwrite")
    assert replaced.num_rows == 3
    assert sorted(os.listdir(url)) == sorted(["_common_metadata", "_metadata", *replaced.files])

    empty = write_spark(df.limit(0), str(tmp_path / "empty"), schema=SCHEMA)  # one empty file, the schema
    assert empty.num_rows == 0
    assert empty.schema == SCHEMA


@pytest.mark.timeout(120)
def test_schema_inferred_from_spark_types(spark, tmp_path):
    ddl = ("b boolean, i8 tinyint, i16 smallint, i32 int, i64 bigint not null, f32 float, f64 double, "
           "ts timestamp, d date, s string, bin binary, v array<double>, vv array<array<int>> not null")
    when = datetime.datetime(2024, 3, 1, 12, 30, tzinfo=datetime.UTC)
    rows = [
        (True, 1, 2, 3, 4, 0.5, 0.25, when, datetime.date(2024, 3, 1), "a", b"\x00\x01", [1.5, 2.5],
         [[1, 2], [3, 4]]),
        (None, None, None, None, 5, None, None, None, None, None, None, None, [[5, 6, 7]]),
    ]
    ds = write_spark(spark.createDataFrame(rows, ddl).coalesce(1), str(tmp_path / "ds"))

    expected = {
        "b": ("bool", ()), "i8": ("int8", ()), "i16": ("int16", ()), "i32": ("int32", ()),
        "i64": ("int64", ()), "f32": ("float32", ()), "f64": ("float64", ()), "ts": ("datetime64[us]", ()),
        "d": ("datetime64[D]", ()), "s": ("str", ()), "bin": ("bytes", ()), "v": ("float64", (None,)),
        "vv": ("int32", (None, None)),
    }
    assert {f.name: (f.dtype_name, f.shape) for f in ds.schema} == expected
    assert [f.name for f in ds.schema if not f.nullable] == ["i64", "vv"]
    assert ds.schema["vv"].codec.name == "ndarray"
    assert ds.schema["s"].codec.name == "scalar"
    got = _rows(ds)
    assert got["ts"] == [np.datetime64("2024-03-01T12:30:00", "us"), None]
    assert got["d"][0] == np.datetime64("2024-03-01", "D")
    assert got["bin"] == [b"\x00\x01", None]
    assert got["s"] == ["a", None]
    _assert_same(got["v"], [np.array([1.5, 2.5]), None], "v")
    _assert_same(got["vv"], [np.array([[1, 2], [3, 4]], np.int32), np.array([[5, 6, 7]], np.int32)], "vv")


@pytest.mark.timeout(30)
def test_unsupported_spark_types_are_named():
    unsupported = [
        (T.DecimalType(10, 2), "price"),
        (T.MapType(T.StringType(), T.IntegerType()), "tags"),
        (T.ArrayType(T.StringType()), "words"),
    ]
    for ddl_type, column in unsupported:
        struct = T.StructType([T.StructField("id", T.LongType()), T.StructField(column, ddl_type)])
        with pytest.raises(SchemaError, match=rf"{column}.*{re.escape(ddl_type.simpleString())}"):
            schema_from_spark(struct)


@pytest.mark.timeout(30)
def test_spark_arrays_become_tensors_or_name_the_bad_row():
    fixed = Field("x", "float32", (2, 2), nullable=True)
    flat = pa.array([[1, 2, 3, 4], None, [5, 6, 7, 8]], pa.list_(pa.float32()))
    rows = column_for_field(fixed, flat)
    assert rows[1] is None
    assert np.array_equal(rows[2], [[5, 6], [7, 8]])
    nested = pa.array([[[1, 2], [3, 4]]], pa.list_(pa.list_(pa.float32())))
    assert column_for_field(fixed, nested).shape == (1, 2, 2)  # no nulls: one stacked array
    ragged = Field("v", "int32", (None, None))
    got = column_for_field(ragged, pa.array([[[1, 2]], [], [[3], [4]]], pa.list_(pa.list_(pa.int64()))))
    assert [a.shape for a in got] == [(1, 2), (0, 0), (2, 1)]

    bad = [
        (fixed, pa.array([[1.0, 2, 3, 4], [1, 2, 3]]), r"row 1 holds an array of length 3"),
        (fixed, pa.array([[1.0, 2, 3, 4], None, [1, None, 3, 4]]), r"row 2 holds a null inside its array"),
        (fixed, pa.array([[[[1.0]]]]), r"nested 3 deep"),
        (ragged, pa.array([[[1]], [[1, 2], [3]]]), r"row 1 is ragged"),
        (Field("s", "int8", (None,)), pa.array([[1, 300]]), r"outside its range"),
        (Field("s", "int64"), pa.array([[1]]), r"declared with shape \(\) but the Spark column holds list"),
    ]
    for field, values, message in bad:
        with pytest.raises(SchemaMismatchError, match=message):
            column_for_field(field, values)


@pytest.mark.timeout(120)
def test_write_dataset_output_reads_as_plain_parquet(spark, tmp_path):
    """Spark reads shardkit's files: a fixed-shape tensor as its bytes (the default layout) or, stored
    as a list, as an array."""
    src = _source()
    listed = Schema([Field("x", "float32", (2, 3), nullable=True, codec=TensorCodec("list")) if f.name == "x"
                     else f for f in SCHEMA])
    for schema, url in ((SCHEMA, tmp_path / "ds"), (listed, tmp_path / "listed")):
        shardkit.write_dataset(_pandas_df(src), url, schema=schema, row_group_size=16)

        rows = sorted(spark.read.parquet(str(url)).collect(), key=lambda r: r.id)
        assert [r.id for r in rows] == list(range(N))
        assert [r.text for r in rows] == src["text"]
        assert rows[5].x is None
        assert [rows[6].weight, rows[7].weight] == [60, None]
        if schema is SCHEMA:
            assert np.array_equal(np.frombuffer(rows[3].x, "<f4").reshape(2, 3), src["x"][3])
        else:
            assert np.array_equal(np.array(rows[3].x, np.float32), src["x"][3].reshape(-1))
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(rows[2].image))), src["image"][2])

        table = pq.read_table(url)
        assert table.num_rows == N
        expected = pa.binary(24) if schema is SCHEMA else pa.fixed_shape_tensor(pa.float32(), [2, 3])
        assert table.schema.field("x").type == expected
        frame = pd.read_parquet(url)
        assert len(frame) == N
        assert sorted(frame["text"]) == sorted(src["text"])


@pytest.mark.timeout(120)
def test_mismatch_in_executors_raises_on_driver_and_commits_nothing(spark, tmp_path):
    src = _source()
    bad_shape = Schema([*(f for f in SCHEMA if f.name != "x"), Field("x", "float32", (3, 2), nullable=True)])
    fresh = tmp_path / "fresh"
    with pytest.raises(SchemaMismatchError, match=r"field 'x' declares the fixed shape \(3, 2\)") as info:
        write_spark(_spark_df(spark, src), str(fresh), schema=bad_shape)
    assert info.value.__cause__ is not None
    assert "in Spark partition" in str(info.value)
    assert not fresh.exists()
    with pytest.raises(DatasetNotFoundError):
        shardkit.open_dataset(fresh)

    # overwrite with bad data: the old dataset stays as it was
    old = tmp_path / "old"
    before = shardkit.write_dataset(_pandas_df(src), old, schema=SCHEMA)
    files = sorted(os.listdir(old))
    too_bright = _spark_df(spark, src, image=lambda a: [300] * a.size)
    with pytest.raises(SchemaMismatchError, match=r"field 'image'.*outside its range"):
        write_spark(too_bright, str(old), schema=SCHEMA, mode="overwrite")
    assert sorted(os.listdir(old)) == files  # no _staging, no new parts
    assert shardkit.open_dataset(old).num_rows == before.num_rows == N


@pytest.mark.timeout(120)
def test_existing_dataset_is_refused_before_any_spark_job(spark, tmp_path):
    url = tmp_path / "ds"
    shardkit.write_dataset({"id": np.arange(3)}, url)
    df = spark.createDataFrame([(1,)], "id long")
    tracker = spark.sparkContext.statusTracker()
    jobs = set(tracker.getJobIdsForGroup(None))

    with pytest.raises(DatasetExistsError, match="already exists"):
        write_spark(df, str(url))
    with pytest.raises(DatasetError, match="in-memory filesystem"):
        write_spark(df, "memory://somewhere")
    with pytest.raises(SchemaMismatchError, match=r"no column\(s\) \['x'\]"):
        write_spark(df, str(tmp_path / "other"), schema=Schema([Field("id", "int64"), Field("x", "float32")]))
    assert set(tracker.getJobIdsForGroup(None)) == jobs
    assert not (tmp_path / "other").exists()

    df.count()  # the tracker does see jobs, so the check above is not vacuous
    assert set(tracker.getJobIdsForGroup(None)) != jobs
