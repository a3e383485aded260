"""`shardkit.dataset.convert`: Petastorm datasets, shardkit and plain Parquet datasets, CSV, JSON and Parquet
files and folders into shardkit datasets, streamed, with encoded images copied byte for byte."""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from PIL import Image

import shardkit
from shardkit.dataset import convert as convert_module
from shardkit.dataset.codecs import ImageCodec
from shardkit.dataset.convert import _sources as convert_sources
from shardkit.dataset.convert import convert
from shardkit.errors import (
    DatasetExistsError,
    DatasetNotFoundError,
    NotADatasetError,
    SchemaError,
    SchemaMismatchError,
)
from tests.dataset.test_petastorm import EXTRA, FIXTURES

PETASTORM = [FIXTURES / name for name in ("tensors", "images", "varshape")] + [
    EXTRA / name for name in ("dtypes", "text_bytes", "png16", "partitioned")]


def read_rows(url: str | Path, columns: list[str] | None = None
              ) -> tuple[shardkit.Schema, dict[str, list[Any]]]:
    """Every row of the dataset at ``url`` read by `shardkit.make_reader`, in ``id`` order (nulls as None)."""
    from tests.dataset.conftest import column_rows

    with warnings.catch_warnings():  # Petastorm's: no summary; Hive partition keys that only convert reads
        warnings.simplefilter("ignore", shardkit.SummaryMissingWarning)
        warnings.simplefilter("ignore", shardkit.errors.PartitionColumnsWarning)
        reader = shardkit.make_reader(os.fspath(url), shuffle=False, batch_size=100_000, cache=None,
                                      columns=columns)
    with reader:
        schema = reader.dataset.schema if columns is None else reader.dataset.schema.select(columns)
        rows: dict[str, list[Any]] = {name: [] for name in schema.names}
        for batch in reader:
            for name, values in rows.items():
                values.extend(column_rows(batch[name]))
    order = np.argsort(rows["id"], kind="stable") if "id" in rows else np.arange(len(rows[schema.names[0]]))
    return schema, {name: [values[i] for i in order] for name, values in rows.items()}


# ---- Petastorm: the migration path ------------------------------------------------------------------


@pytest.mark.parametrize("source", PETASTORM, ids=lambda p: p.name)
def test_a_petastorm_dataset_converts_to_the_rows_petastorm_wrote(source: Path, tmp_path: Path,
                                                                  helpers: SimpleNamespace) -> None:
    """Every field, value, dtype and null of the source (as `make_reader` reads it) comes back from the
    shardkit dataset; images stay images of their format, what shardkit only reads gets shardkit codecs."""
    ds = convert(source, tmp_path / "out")
    assert ds.kind == "shardkit"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardkit.SummaryMissingWarning)
        warnings.simplefilter("ignore", shardkit.errors.PartitionColumnsWarning)
        src = shardkit.open_dataset(source)
    assert ds.num_rows == src.num_rows
    stored = [n for n in ds.schema.names if n in src.schema.names]
    for field in src.schema:
        out = ds.schema[field.name]
        assert (out.dtype, out.shape, out.nullable) == (field.dtype, field.shape, field.nullable), field.name
        expected_codec = field.codec.name if field.codec.writable else (
            "scalar" if not field.shape else "tensor" if field.fixed_shape else "ndarray")
        assert out.codec.name == expected_codec, field.name
        if field.codec.name == "image":
            assert out.codec == field.codec  # format and quality kept
    schema, want = read_rows(source, columns=stored)
    _, got = read_rows(ds.url, columns=stored)
    helpers.assert_rows_equal(schema, want, got)
    if source.name == "partitioned":  # Spark's partitionBy folder values are the Unischema's column again
        assert ds.schema["part"] == shardkit.Field("part", "int32")
        expected = np.load(EXTRA / "partitioned.expected.npz", allow_pickle=False)
        _, rows = read_rows(ds.url)
        assert rows["part"] == list(expected["part"])
        assert all(type(v) is np.int32 for v in rows["part"])


def raw_column(url: str | Path, name: str) -> list[bytes]:
    """The stored bytes of the column ``name`` of every data file under ``url``, in ``id`` order."""
    table = pads.dataset(os.fspath(url), format="parquet").to_table(columns=["id", name]).sort_by("id")
    return table.column(name).to_pylist()


def test_petastorm_png_and_jpeg_bytes_are_copied_byte_for_byte(tmp_path: Path) -> None:
    ds = convert(FIXTURES / "images", tmp_path / "out")
    for name in ("rgb_png", "gray_png", "rgb_jpeg"):
        copied = raw_column(ds.url, name)
        assert copied == raw_column(FIXTURES / "images", name), name
        assert len(copied) == 240
        assert all(copied)
    assert raw_column(ds.url, "rgb_jpeg")[0][:2] == b"\xff\xd8"  # JPEG, never decoded and encoded again


def test_appending_a_petastorm_dataset_twice_doubles_the_rows(tmp_path: Path) -> None:
    url = tmp_path / "out"
    convert(FIXTURES / "varshape", url)
    ds = convert(FIXTURES / "varshape", url, mode="append")
    assert ds.num_rows == 480
    assert len(ds.files) == 2
    _, rows = read_rows(url, columns=["id", "note"])
    assert rows["id"] == sorted(list(range(240)) * 2)


# ---- CSV, JSON, Parquet files and folders -------------------------------------------------------------


def frame(n: int = 50) -> pd.DataFrame:
    rng = np.random.default_rng(n)
    return pd.DataFrame({
        "id": np.arange(n, dtype=np.int64),
        "score": rng.normal(size=n),
        "name": [f"row, \"{i}\"" for i in range(n)],
        "flag": np.arange(n) % 3 == 0,
    })


def write_as(df: pd.DataFrame, path: Path, fmt: str) -> None:
    if fmt == "csv":
        df.to_csv(path, index=False)
    elif fmt == "json":  # not pandas' to_json: it writes 10 significant digits of a float
        path.write_text("".join(json.dumps(row) + "\n" for row in df.to_dict(orient="records")))
    else:
        df.to_parquet(path, index=False, row_group_size=7)


def assert_frame_rows(ds: shardkit.Dataset, df: pd.DataFrame) -> None:
    _, rows = read_rows(ds.url)
    assert list(rows) == list(df.columns)
    for name in df.columns:
        want = df[name].to_numpy()
        got = np.array(rows[name], dtype=want.dtype)
        assert ds.schema[name].dtype == (want.dtype if want.dtype != object else np.dtype(np.str_)), name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize(("fmt", "suffix"), [("csv", ".csv"), ("csv", ".csv.gz"), ("json", ".jsonl"),
                                             ("parquet", ".parquet")])
def test_a_file_converts(tmp_path: Path, fmt: str, suffix: str) -> None:
    df = frame()
    path = tmp_path / f"data{suffix}"
    write_as(df, path, fmt)
    ds = convert(path, tmp_path / "out")
    assert [f.nullable for f in ds.schema] == [False] * 4
    assert_frame_rows(ds, df)


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_a_folder_of_files_converts_with_its_hive_partitions(tmp_path: Path, fmt: str) -> None:
    df = frame(60)
    for k in range(3):
        folder = tmp_path / "src" / f"k={k}"
        folder.mkdir(parents=True)
        write_as(df.iloc[k * 20 : (k + 1) * 20], folder / f"part-{k}.{fmt}", fmt)
    (tmp_path / "src" / "_SUCCESS").write_text("")
    ds = convert(tmp_path / "src", tmp_path / "out")
    assert ds.schema["k"] == shardkit.Field("k", "int32")
    _, rows = read_rows(ds.url, columns=["id", "k"])
    assert rows["k"] == [i // 20 for i in range(60)]
    ds = convert(tmp_path / "src", tmp_path / "out2", columns=list(df.columns))
    assert_frame_rows(ds, df)


def test_a_plain_parquet_dataset_with_a_summary_converts(tmp_path: Path) -> None:
    df = frame(30).assign(maybe=[None if i % 4 else float(i) for i in range(30)])
    folder = tmp_path / "plain"
    folder.mkdir()
    df.to_parquet(folder / "a.parquet", row_group_size=8)
    shardkit.write_summary(folder)
    ds = convert(folder, tmp_path / "out")
    # pandas declares every column nullable; Parquet's statistics tell which hold a null
    assert {f.name: f.nullable for f in ds.schema} == {"id": False, "score": False, "name": False,
                                                       "flag": False, "maybe": True}
    _, rows = read_rows(ds.url)
    assert rows["maybe"] == [None if i % 4 else float(i) for i in range(30)]


def test_a_schema_declares_a_list_column_a_fixed_tensor(tmp_path: Path) -> None:
    path = tmp_path / "emb.jsonl"
    vecs = np.random.default_rng(0).normal(size=(40, 8)).astype(np.float32)
    path.write_text("".join(json.dumps({"id": i, "vec": v.tolist()}) + "\n" for i, v in enumerate(vecs)))
    assert convert(path, tmp_path / "inferred").schema["vec"] == shardkit.Field("vec", "float64", (None,))
    ds = convert(path, tmp_path / "out", schema=[shardkit.Field("vec", "float32", (8,))])
    assert ds.schema["vec"].codec.name == "tensor"
    batch = ds.decode(ds.read_row_group(0))
    assert batch["vec"].dtype == np.float32
    assert batch["vec"].shape == (40, 8)
    np.testing.assert_array_equal(batch["vec"], vecs)
    with pytest.raises(SchemaMismatchError, match=r"'vec'.* row 0 has shape \(8,\)") as info:
        convert(path, tmp_path / "bad", schema=[shardkit.Field("vec", "float32", (4,))])
    assert "emb.jsonl" in str(info.value)
    assert "source rows 0-39" in str(info.value)
    assert not (tmp_path / "bad").exists()


def test_a_schema_file_as_shardkit_inspect_json_prints_it(tmp_path: Path) -> None:
    """A CSV column of zip codes parses as text (not int, which drops the leading zero) when declared."""
    path = tmp_path / "zips.csv"
    path.write_text("id,zip\n1,01234\n2,98765\n")
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps({"url": "x", "fields": [shardkit.Field("zip", "str").to_json()]}))
    ds = convert(path, tmp_path / "out", schema=schema_file)
    assert ds.decode(ds.read_row_group(0))["zip"].tolist() == ["01234", "98765"]


def png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_a_bytes_column_declared_as_png_images_is_copied(tmp_path: Path) -> None:
    pixels = np.random.default_rng(1).integers(0, 256, (12, 6, 5, 3), dtype=np.uint8)
    blobs = [png(p) for p in pixels]
    table = pa.table({"id": np.arange(12), "img": pa.array(blobs, pa.binary())})
    pq.write_table(table, tmp_path / "i.parquet")
    field = shardkit.Field("img", "uint8", (6, 5, 3), codec=ImageCodec("png"))
    ds = convert(tmp_path / "i.parquet", tmp_path / "out", schema=[field])
    assert raw_column(ds.url, "img") == blobs
    np.testing.assert_array_equal(ds.decode(ds.read_row_group(0))["img"], pixels)
    wrong = shardkit.Field("img", "uint8", (5, 6, 3), codec=ImageCodec("png"))
    with pytest.raises(SchemaMismatchError, match=r"row 0 is a PNG image of 6x5 pixels, 8-bit RGB, but the "
                                                  r"field holds PNG images of shape \(5, 6, 3\)"):
        convert(tmp_path / "i.parquet", tmp_path / "bad", schema=[wrong])
    with pytest.raises(SchemaMismatchError, match=r"row 0 is a PNG image.* holds JPEG images"):
        convert(tmp_path / "i.parquet", tmp_path / "bad", schema=[
            shardkit.Field("img", "uint8", (6, 5, 3), codec=ImageCodec("jpeg"))])
    assert not (tmp_path / "bad").exists()


def test_a_source_larger_than_a_batch_is_streamed_into_several_row_groups(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 3 * convert_sources._BATCH_ROWS + 5
    path = tmp_path / "big.csv"
    pd.DataFrame({"id": np.arange(n), "x": np.arange(n) * 0.5}).to_csv(path, index=False)
    seen: list[int] = []
    real = convert_module.write_dataset

    def spy(data: Any, *args: Any, **kwargs: Any) -> shardkit.Dataset:
        def tables() -> Any:
            for table in data.tables:
                seen.append(table.num_rows)
                yield table
        return real(type(data)(tables(), data.num_rows), *args, **kwargs)

    monkeypatch.setattr(convert_module, "write_dataset", spy)
    ds = convert(path, tmp_path / "out", row_group_size=5000)
    assert len(seen) > 1
    assert max(seen) <= convert_sources._BATCH_ROWS
    assert sum(seen) == n
    assert [rg.num_rows for rg in ds.row_groups] == [5000, 5000, n - 10_000]
    _, rows = read_rows(ds.url)
    assert rows["id"] == list(range(n))


def test_a_null_after_the_first_batch_of_a_csv_names_the_field_and_the_fix(tmp_path: Path) -> None:
    """The row named is the source's (counted from 0), not the row of the batch that holds it."""
    n = convert_sources._BATCH_ROWS + 10
    path = tmp_path / "late.csv"
    path.write_text("id,x\n" + "".join(f"{i},{'' if i == n - 1 else i}\n" for i in range(n)))
    with pytest.raises(SchemaMismatchError, match=rf"'x'.* not nullable but source row {n - 1} is null"
                       ) as info:
        convert(path, tmp_path / "out")
    assert "nullable=True" in str(info.value)
    assert not (tmp_path / "out").exists()
    ds = convert(path, tmp_path / "out", schema=[shardkit.Field("x", "int64", nullable=True)])
    _, rows = read_rows(ds.url)
    assert rows["x"][-1] is None
    assert rows["x"][-2] == n - 2


# ---- errors: named, and nothing written ---------------------------------------------------------------


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.csv").write_bytes(b"")
    (tmp_path / "header.csv").write_text("a,b\n")
    (tmp_path / "lone-header.csv").write_text("a,b")  # no newline: pyarrow said "Empty CSV file"
    (tmp_path / "newline.jsonl").write_text("\n")  # pyarrow said "Empty JSON stream"
    (tmp_path / "keyless.jsonl").write_text("{}\n{}\n")  # was written as "0 rows", with no fields
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "ok.csv").write_text("a,b\n1,x\n2,y\n")
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{"a": "x"}\n')
    (tmp_path / "array.json").write_text('[{"a": 1}, {"a": 2}]\n')
    return tmp_path


@pytest.mark.parametrize(
    ("source", "kwargs", "error", "needles"),
    [
        ("missing", {}, DatasetNotFoundError, ["'{tmp}/missing'", "does not exist"]),
        ("empty", {}, NotADatasetError, ["'{tmp}/empty'", "holds no data files"]),
        ("empty.csv", {}, NotADatasetError, ["'{tmp}/empty.csv'", "holds no data (it is empty, or only "
                                             "whitespace); point at a file of rows"]),
        ("newline.jsonl", {}, NotADatasetError, ["'{tmp}/newline.jsonl'", "holds no data"]),
        ("keyless.jsonl", {}, NotADatasetError, ["'{tmp}/keyless.jsonl'", "has no columns (every JSON "
                                                 "object in it is {{}}), so there is nothing to write"]),
        ("header.csv", {}, SchemaError, ["holds no rows", "column 'a'", "--schema"]),
        ("lone-header.csv", {}, SchemaError, ["holds no rows", "column 'a'", "--schema"]),
        ("notes.txt", {}, NotADatasetError, ["'{tmp}/notes.txt'", "does not say a format", ".csv"]),
        ("*.xml", {}, DatasetNotFoundError, ["'{tmp}/*.xml'", "no file matches it as a glob pattern",
                                             "quote a pattern"]),
        ("*.txt", {}, NotADatasetError, ["'{tmp}/*.txt'", "matches no file of", "'notes.txt'"]),
        ("ok.csv", {"columns": ["a", "zz"]}, SchemaMismatchError,
         ["columns= ['zz']", "its columns: ['a', 'b']"]),
        ("ok.csv", {"schema": [shardkit.Field("zz", "int8")]}, SchemaMismatchError,
         ["the schema declares ['zz']", "rename or drop"]),
        ("ok.csv", {"schema": [shardkit.Field("b", "float32")]}, SchemaMismatchError,
         ["'{tmp}/ok.csv'", "cannot read it past source row 0", "to float", "declare the column's type"]),
        ("bad.jsonl", {}, NotADatasetError, ["'{tmp}/bad.jsonl'", "cannot be read as json",
                                            "changed from number to string"]),
        ("array.json", {}, NotADatasetError, ["cannot be read as json", "not a JSON array", "jq -c"]),
        ("ok.csv", {"schema": "{tmp}/nothing.json"}, SchemaError,
         ["cannot read the schema file", "nothing.json"]),
        ("ok.csv", {"mode": "replace"}, SchemaError, ["mode='replace'"]),
    ],
    ids=["missing", "empty-folder", "empty-file", "newline-json", "keyless-json", "header-only",
         "header-without-newline", "unknown-type", "pattern-unmatched",
         "pattern-of-no-data", "unknown-column", "undeclared-field", "declared-type-unfit", "unparsable",
         "json-array", "schema-file", "mode"],
)
def test_bad_sources_fail_naming_the_value_the_place_and_the_fix(
        sources: Path, source: str, kwargs: dict[str, Any], error: type[Exception], needles: list[str],
        helpers: SimpleNamespace) -> None:
    kwargs = {k: v.format(tmp=sources) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(error) as info:
        convert(os.fspath(sources / source), sources / "out", **kwargs)
    for needle in needles:
        assert needle.format(tmp=sources) in str(info.value), (needle, str(info.value))
    helpers.assert_nothing_written(os.fspath(sources / "out"))


def test_a_destination_that_is_or_holds_or_lies_in_the_source_is_refused(tmp_path: Path) -> None:
    src = convert(FIXTURES / "tensors", tmp_path / "a" / "ds")
    before = sorted(p.name for p in Path(src.url).iterdir())
    for dest, relation in [(src.url, "is"), (f"{src.url}/sub", "lies inside"), (tmp_path / "a", "holds")]:
        with pytest.raises(NotADatasetError, match=f"the destination {relation} the source"):
            convert(src.url, dest, mode="overwrite")
    assert sorted(p.name for p in Path(src.url).iterdir()) == before


def test_an_existing_destination_is_kept_unless_overwrite(tmp_path: Path) -> None:
    url = tmp_path / "out"
    first = convert(FIXTURES / "tensors", url)
    with pytest.raises(DatasetExistsError, match="already exists"):
        convert(FIXTURES / "varshape", url)
    assert shardkit.open_dataset(url).files == first.files
    assert convert(FIXTURES / "varshape", url, mode="overwrite").schema.names == [
        "id", "flag", "points", "counts", "note"]


# ---- properties ---------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_shardkit_dataset_converts_to_itself(tmp_path_factory: pytest.TempPathFactory,
                                              strategies: SimpleNamespace, helpers: SimpleNamespace,
                                              data: st.DataObject) -> None:
    """Any schema (every dtype, tensors in both layouts, variable shapes, nulls): same schema and rows."""
    schema = data.draw(strategies.schema())
    n = data.draw(st.integers(0, 12))
    columns = {f.name: data.draw(strategies.column(f, n)) for f in schema}
    tmp = tmp_path_factory.mktemp("same")
    src = shardkit.write_dataset(columns, tmp / "src", schema=schema, row_group_size=4)
    out = convert(src.url, tmp / "out", row_group_size=5)
    assert out.schema == src.schema
    assert out.num_rows == n
    helpers.assert_rows_equal(schema, helpers.read_all(src), helpers.read_all(out))


@st.composite
def arrow_tables(draw: st.DrawFn) -> pa.Table:
    n = draw(st.integers(0, 30))
    kinds = {"i": (pa.int64(), st.integers(-(2**63), 2**63 - 1)), "f": (pa.float64(), st.floats()),
             "s": (pa.string(), st.text(max_size=5)), "b": (pa.bool_(), st.booleans()),
             "l": (pa.list_(pa.int32()), st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3))}
    cols = {}
    for name in draw(st.lists(st.sampled_from(sorted(kinds)), min_size=1, max_size=5, unique=True)):
        arrow_type, values = kinds[name]
        cells = st.one_of(st.none(), values) if draw(st.booleans()) else values
        cols[name] = pa.array(draw(st.lists(cells, min_size=n, max_size=n)), arrow_type)
    return pa.table(cols)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=arrow_tables(), group=st.integers(1, 10))
def test_a_parquet_file_converts_with_its_rows_values_and_nulls(tmp_path_factory: pytest.TempPathFactory,
                                                                table: pa.Table, group: int) -> None:
    tmp = tmp_path_factory.mktemp("parquet")
    pq.write_table(table, tmp / "t.parquet", row_group_size=group)
    ds = convert(tmp / "t.parquet", tmp / "out")
    assert ds.num_rows == table.num_rows
    for name in table.column_names:  # a list's statistics count empty lists too: then it may say nullable
        nullable = ds.schema[name].nullable
        assert nullable == (table[name].null_count > 0) or (name == "l" and nullable)
    got = {name: [] for name in table.column_names}  # type: dict[str, list[Any]]
    for i in range(len(ds.row_groups)):
        for name, values in ds.decode(ds.read_row_group(i)).items():
            got[name].extend(shardkit_rows(values))
    for name in table.column_names:
        want = table[name].to_pylist()
        rows = [None if v is None else v.tolist() if isinstance(v, np.ndarray) else v.item()
                if isinstance(v, np.generic) else v for v in got[name]]
        same = [(a is None and b is None) or a == b or (a != a and b != b)  # NaN is NaN
                for a, b in zip(rows, want, strict=True)]
        assert all(same), name


def shardkit_rows(values: np.ndarray) -> list[Any]:
    from tests.dataset.conftest import column_rows

    return column_rows(values)


def test_images_of_a_shardkit_dataset_are_copied_or_encoded_in_a_declared_format(tmp_path: Path) -> None:
    pixels = np.random.default_rng(2).integers(0, 256, (9, 8, 8, 3), dtype=np.uint8)
    field = shardkit.Field("img", "uint8", (8, 8, 3), codec=ImageCodec("jpeg", quality=70))
    src = shardkit.write_dataset({"id": np.arange(9), "img": pixels}, tmp_path / "src",
                                 schema=[shardkit.Field("id", "int64"), field])
    same = convert(src.url, tmp_path / "same")
    assert same.schema == src.schema
    assert raw_column(same.url, "img") == raw_column(src.url, "img")
    as_png = shardkit.Field("img", "uint8", (8, 8, 3), codec=ImageCodec("png"))
    out = convert(src.url, tmp_path / "png", schema=[as_png])
    assert all(blob.startswith(b"\x89PNG") for blob in raw_column(out.url, "img"))
    np.testing.assert_array_equal(out.decode(out.read_row_group(0))["img"],
                                  src.decode(src.read_row_group(0))["img"])  # the JPEG's pixels, lossless


# ---- found by trying to break it: folders of files that differ, Hive nulls, late JSON keys, appends ----


def write_rows(rows: list[dict[str, Any]], path: Path, fmt: str) -> None:
    """``rows`` (their keys: the file's columns) as a CSV, JSON-lines or Parquet file."""
    if fmt == "json":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif fmt == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(["csv", "json", "parquet"]),
       files=st.lists(st.lists(st.sampled_from(["a", "b", "c"]), unique=True), min_size=1, max_size=4))
def test_a_folder_of_files_with_different_columns_keeps_every_column(
        tmp_path_factory: pytest.TempPathFactory, fmt: str, files: list[list[str]]) -> None:
    """Each file's own columns (any subset, in any order): every column of every file is written, null in
    the rows of a file that lacks it (and so nullable), never dropped for the first file's columns."""
    tmp = tmp_path_factory.mktemp("differ")
    (tmp / "src").mkdir()
    want: dict[str, list[Any]] = {"id": []}
    for i, names in enumerate(files):
        rows = [{"id": 10 * i + r, **{n: f"{n}{i}{r}" for n in names}} for r in range(2)]
        write_rows(rows, tmp / "src" / f"part-{i}.{fmt}", fmt)
        for n in names:
            want.setdefault(n, [])
    for i, names in enumerate(files):
        want["id"] += [10 * i, 10 * i + 1]
        for n in want:
            if n != "id":
                want[n] += [f"{n}{i}{r}" if n in names else None for r in range(2)]
    ds = convert(tmp / "src", tmp / "out")
    assert sorted(ds.schema.names) == sorted(want)
    for name, values in want.items():
        assert ds.schema[name].nullable == (None in values), name
    _, rows = read_rows(ds.url)
    assert rows == want


def test_files_whose_column_types_differ_widen_or_fail_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"x": pa.array([1, 2], pa.int32())}), tmp_path / "src" / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([2**40], pa.int64())}), tmp_path / "src" / "b.parquet")
    ds = convert(tmp_path / "src", tmp_path / "out")  # the first file's int32 would overflow
    assert ds.schema["x"] == shardkit.Field("x", "int64")
    assert read_rows(ds.url)[1]["x"] == [1, 2, 2**40]
    (tmp_path / "cat").mkdir()  # pandas' categoricals: dictionary-encoded strings beside plain ones
    pq.write_table(pa.table({"s": pa.array(["a", "b"]).dictionary_encode()}), tmp_path / "cat" / "a.parquet")
    pq.write_table(pa.table({"s": pa.array(["c"], pa.large_string())}), tmp_path / "cat" / "b.parquet")
    assert read_rows(convert(tmp_path / "cat", tmp_path / "cat-out").url)[1]["s"] == ["a", "b", "c"]
    pq.write_table(pa.table({"x": ["x"]}), tmp_path / "src" / "c.parquet")
    with pytest.raises(SchemaMismatchError, match=r"column 'x' of '.*c\.parquet' is string, but int64 in the "
                                                  r"files before it; declare its type"):
        convert(tmp_path / "src", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_a_hive_null_partition_converts_to_nulls(tmp_path: Path, fmt: str) -> None:
    """Spark and Hive write a null key's rows under ``k=__HIVE_DEFAULT_PARTITION__``: the key is nullable."""
    for key in ["1", "__HIVE_DEFAULT_PARTITION__", "2"]:
        (tmp_path / "src" / f"k={key}").mkdir(parents=True)
        write_rows([{"id": 1}, {"id": 2}], tmp_path / "src" / f"k={key}" / f"part.{fmt}", fmt)
    ds = convert(tmp_path / "src", tmp_path / "out")
    assert ds.schema["k"] == shardkit.Field("k", "int32", nullable=True)
    _, rows = read_rows(ds.url, columns=["k"])
    assert sorted(rows["k"], key=lambda k: -1 if k is None else k) == [None, None, 1, 1, 2, 2]


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_a_column_of_only_nulls_in_a_later_file_makes_it_nullable(tmp_path: Path, fmt: str) -> None:
    """A CSV's or JSON file's nullability was the first batch's: a later file whose column holds only
    nulls (pyarrow types it ``null``) failed the write, "declare it nullable", though that was known."""
    (tmp_path / "src").mkdir()
    write_rows([{"id": 1, "x": 1}, {"id": 2, "x": 2}], tmp_path / "src" / f"part-0.{fmt}", fmt)
    write_rows([{"id": 3, "x": None}], tmp_path / "src" / f"part-1.{fmt}", fmt)
    ds = convert(tmp_path / "src", tmp_path / "out")
    assert ds.schema["x"] == shardkit.Field("x", "int64", nullable=True)
    assert read_rows(ds.url)[1] == {"id": [1, 2, 3], "x": [1, 2, None]}


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_an_empty_csv_or_json_part_file_in_a_folder_is_left_out(tmp_path: Path, fmt: str) -> None:
    """Tools that write one part file per task leave empty ones (0 bytes: no header, no rows)."""
    (tmp_path / "src").mkdir()
    write_rows([{"id": 1}, {"id": 2}], tmp_path / "src" / f"part-0.{fmt}", fmt)
    (tmp_path / "src" / f"part-1.{fmt}").write_bytes(b"")
    write_rows([{"id": 3}], tmp_path / "src" / f"part-2.{fmt}", fmt)
    assert read_rows(convert(tmp_path / "src", tmp_path / "out").url)[1] == {"id": [1, 2, 3]}


def test_a_hive_key_that_is_also_a_column_fails_as_a_shardkit_error(tmp_path: Path) -> None:
    (tmp_path / "src" / "a=1").mkdir(parents=True)
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "src" / "a=1" / "part.parquet")
    with pytest.raises(NotADatasetError, match=r"Field a has incompatible types"):
        convert(tmp_path / "src", tmp_path / "out")


def test_a_json_key_first_seen_past_the_first_block_is_never_dropped(tmp_path: Path) -> None:
    """pyarrow takes a JSON file's columns from its first block: a key seen later only fails the write,
    naming the fix; declared, it is written; left out of named columns, it is left out."""
    path = tmp_path / "late.jsonl"
    pad = "x" * 2000
    n = convert_sources.BLOCK_BYTES // len(pad) + 100  # lines before the one with the new key
    path.write_text("".join(f'{{"id": {i}, "pad": "{pad}"}}\n' for i in range(n))
                    + json.dumps({"id": n, "pad": "y", "late": 7}) + "\n")
    assert path.stat().st_size > convert_sources.BLOCK_BYTES
    with pytest.raises(SchemaMismatchError, match=r"late\.jsonl'.*unexpected field.*declare the key's field"):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    ds = convert(path, tmp_path / "out", schema=[shardkit.Field("late", "int64", nullable=True)])
    _, rows = read_rows(ds.url, columns=["id", "late"])
    assert rows["late"][-1] == 7
    assert rows["late"][:-1] == [None] * n
    assert convert(path, tmp_path / "named", columns=["id", "pad"]).num_rows == n + 1


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_a_row_longer_than_pyarrows_default_block_converts(tmp_path: Path, fmt: str) -> None:
    """A JSON line or CSV row of a few MiB (a base64 image) is read, not refused as a "straddling object";
    one far longer than `BLOCK_BYTES` fails naming the limit (JSON here; CSV is read alike)."""
    path = tmp_path / f"long.{fmt}"
    rows = [{"id": i, "blob": "x" * (3 << 20 if i == 2 else 3)} for i in range(5)]
    write_rows(rows, path, fmt)
    _, got = read_rows(convert(path, tmp_path / "out").url)
    assert got["blob"] == [row["blob"] for row in rows]
    if fmt == "csv":
        return
    write_rows([*rows, {"id": 5, "blob": "x" * (2 * convert_sources.BLOCK_BYTES + 10)}, *rows], path, fmt)
    with pytest.raises((SchemaMismatchError, NotADatasetError), match=r"a row is longer than the 16 MiB"):
        convert(path, tmp_path / "too-long")


def test_quoted_csv_values_with_newlines_convert_across_blocks(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow cuts a CSV into blocks at newlines unless told that quoted values hold some: a block that
    ended inside one put its parser "out of sync with chunker"."""
    monkeypatch.setattr(convert_sources, "BLOCK_BYTES", 1 << 16, raising=False)  # many block ends
    n = 40_000  # 1.3 MiB: more than pyarrow's default block too
    df = pd.DataFrame({"id": np.arange(n), "text": [f'line 1\nline 2, "{i}"\n' for i in range(n)]})
    df.to_csv(tmp_path / "notes.csv", index=False)
    assert (tmp_path / "notes.csv").stat().st_size > 1 << 20
    _, rows = read_rows(convert(tmp_path / "notes.csv", tmp_path / "out").url)
    assert rows["text"] == df["text"].tolist()


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_declared_types_the_text_parsers_lack_are_converted_by_the_codec(tmp_path: Path, suffix: str) -> None:
    """pyarrow's CSV and JSON readers parse no float16 (nor JSON durations): such a declared field is read
    as inferred and converted by its codec, not a NotImplementedError."""
    path = tmp_path / f"a{suffix}"
    write_rows([{"x": 1.5, "d": 3}, {"x": 0.25, "d": 4}], path, "csv" if suffix == ".csv" else "json")
    ds = convert(path, tmp_path / "out", schema=[shardkit.Field("x", "float16"),
                                                 shardkit.Field("d", "timedelta64[s]")])
    batch = ds.decode(ds.read_row_group(0))
    assert batch["x"].dtype == np.float16
    assert batch["x"].tolist() == [1.5, 0.25]
    assert batch["d"].tolist() == [np.timedelta64(3, "s"), np.timedelta64(4, "s")]


def test_an_append_takes_the_columns_in_the_datasets_order(tmp_path: Path) -> None:
    """Appending a source whose columns come in another order writes them in the dataset's; a source with
    a column the dataset lacks, or columns= that leaves one of its fields out, fails naming them."""
    (tmp_path / "a.csv").write_text("id,x\n1,1.5\n")
    (tmp_path / "b.csv").write_text("x,id\n2.5,2\n")
    (tmp_path / "c.csv").write_text("x,id,extra\n2.5,2,9\n")
    url = tmp_path / "out"
    convert(tmp_path / "a.csv", url)
    ds = convert(tmp_path / "b.csv", url, mode="append")
    assert ds.schema.names == ["id", "x"]
    assert read_rows(url)[1] == {"id": [1, 2], "x": [1.5, 2.5]}
    with pytest.raises(SchemaMismatchError, match=r"has the column\(s\) \['extra'\], which the dataset"):
        convert(tmp_path / "c.csv", url, mode="append")
    with pytest.raises(SchemaMismatchError, match=r"columns= leaves out \['x'\]"):
        convert(tmp_path / "c.csv", url, mode="append", columns=["id"])
    assert convert(tmp_path / "c.csv", url, mode="append", columns=["x", "id"]).num_rows == 3


def test_an_append_with_the_first_writes_schema_takes_the_other_fields_from_the_dataset(tmp_path: Path
                                                                                       ) -> None:
    """The same ``schema=`` as the first write (it keeps zip codes text): the fields it does not declare
    are the dataset's, not inferred again from the appended rows (here: ``x`` without a null)."""
    (tmp_path / "a.csv").write_text("id,zip,x\n1,01234,\n2,00001,2.5\n")
    (tmp_path / "b.csv").write_text("id,zip,x\n3,09999,1.5\n")
    schema = [shardkit.Field("zip", "str")]
    first = convert(tmp_path / "a.csv", tmp_path / "out", schema=schema)
    assert first.schema["x"].nullable
    ds = convert(tmp_path / "b.csv", tmp_path / "out", schema=schema, mode="append")
    assert ds.schema == first.schema
    assert read_rows(ds.url)[1]["zip"] == ["01234", "00001", "09999"]


@pytest.mark.parametrize("columns", [[], ["id", "id"], "id,x"])
def test_columns_that_name_nothing_or_a_column_twice_are_refused(tmp_path: Path, columns: Any) -> None:
    (tmp_path / "a.csv").write_text("id,x\n1,2\n")
    with pytest.raises(SchemaError, match=r"columns=.* must be a list that names each column to write once"):
        convert(tmp_path / "a.csv", tmp_path / "out", columns=columns)
    assert not (tmp_path / "out").exists()


LAYOUTS = {"bytes": shardkit.Field("v", "uint8", (4, 4, 3)),
           "list": shardkit.Field("v", "uint8", (4, 4, 3), codec=shardkit.TensorCodec("list")),
           "png": shardkit.Field("v", "uint8", (4, 4, 3), codec=ImageCodec("png")),
           "ndarray": shardkit.Field("v", "uint8", (None, 4, 3))}


@pytest.mark.parametrize("dst", list(LAYOUTS))
@pytest.mark.parametrize("src", ["bytes", "list"])
def test_a_tensor_converts_to_any_layout_and_codec(tmp_path: Path, src: str, dst: str) -> None:
    """A tensor's stored bytes are decoded for any other codec or layout (a declared one, or the layout of
    a dataset appended to), not handed to it as rows of bytes."""
    pixels = np.random.default_rng(3).integers(0, 256, (5, 4, 4, 3), dtype=np.uint8)
    source = shardkit.write_dataset({"v": pixels}, tmp_path / "src", schema=[LAYOUTS[src]])
    ds = convert(source.url, tmp_path / "out", schema=[LAYOUTS[dst]])
    assert ds.schema["v"] == LAYOUTS[dst]
    np.testing.assert_array_equal(np.stack(list(ds.decode(ds.read_row_group(0))["v"])), pixels)
    if dst in ("bytes", "list"):
        appended = convert(source.url, ds.url, mode="append")
        assert appended.num_rows == 10


def test_a_list_of_non_numbers_declared_a_tensor_names_the_field(tmp_path: Path) -> None:
    pq.write_table(pa.table({"tags": [["a", "b"], ["c", "d"]]}), tmp_path / "t.parquet")
    with pytest.raises(SchemaMismatchError, match=r"field 'tags' .*declared float32 but the data has dtype "
                                                  r"object"):
        convert(tmp_path / "t.parquet", tmp_path / "out", schema=[shardkit.Field("tags", "float32", (2,))])


@pytest.mark.parametrize("nullable", ['"false"', '"no"'])
def test_a_schema_file_whose_nullable_is_no_boolean_is_refused(tmp_path: Path, nullable: str) -> None:
    """``"nullable": "false"`` is a string, which Field would take as true."""
    (tmp_path / "a.csv").write_text("x\n1\n")
    (tmp_path / "s.json").write_text(f'[{{"name": "x", "dtype": "int8", "nullable": {nullable}}}]')
    with pytest.raises(SchemaError, match=r"s\.json': field 'x': nullable is .*; write true or false"):
        convert(tmp_path / "a.csv", tmp_path / "out", schema=tmp_path / "s.json")


# ---- a CSV's NaN, times with a time zone, rows named in errors, stray files and glob patterns ---------


def test_a_csvs_nan_is_a_floats_nan_and_its_empty_value_a_null(tmp_path: Path) -> None:
    """pandas reads a CSV's nan/NaN as NaN: so does convert (pyarrow's defaults made them nulls, and a
    field declared not nullable failed); empty values and NA stay nulls, and text stays text."""
    path = tmp_path / "a.csv"
    path.write_text("id,x,s,i\n0,1.5,a,1\n1,nan,nan,nan\n2,NaN,NaN,2\n3,-nan,c,3\n4,,,4\n5,NA,NA,5\n")
    ds = convert(path, tmp_path / "out")
    _, rows = read_rows(ds.url)
    assert [("nan" if v != v else v) for v in rows["x"]] == [1.5, "nan", "nan", "nan", None, None]
    assert ds.schema["x"] == shardkit.Field("x", "float64", nullable=True)
    assert ds.schema["i"] == shardkit.Field("i", "float64")  # an int column with a NaN: float, as in pandas
    assert rows["s"] == ["a", "nan", "NaN", "c", "", "NA"]
    assert np.isnan(rows["i"][1])
    assert rows["i"][2:] == [2.0, 3.0, 4.0, 5.0]
    values = np.array([0.5, np.nan, -2.0, np.nan])  # numpy writes NaN as nan
    np.savetxt(tmp_path / "b.csv", values, header="x", comments="")
    ds = convert(tmp_path / "b.csv", tmp_path / "declared", schema=[shardkit.Field("x", "float32")])
    np.testing.assert_array_equal(ds.decode(ds.read_row_group(0))["x"], values.astype(np.float32))
    ds = convert(tmp_path / "b.csv", tmp_path / "inferred")
    assert ds.schema["x"] == shardkit.Field("x", "float64")
    np.testing.assert_array_equal(ds.decode(ds.read_row_group(0))["x"], values)


def test_a_csvs_nan_in_a_column_declared_without_nan_names_the_fix(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("x\n1\nnan\n")
    with pytest.raises(SchemaMismatchError, match=r"invalid value 'nan'.*a CSV's nan or NaN is a float's "
                                                  r"NaN, not a null.*declare the column a float"):
        convert(tmp_path / "a.csv", tmp_path / "out", schema=[shardkit.Field("x", "int64", nullable=True)])
    assert not (tmp_path / "out").exists()


def test_times_with_a_time_zone_are_written_as_utc_naming_the_column_and_the_zone(tmp_path: Path) -> None:
    """pandas writes zone-aware times to Parquet as ``timestamp[us, tz=...]``: they were refused (only
    --columns without them went through); now each instant is kept as UTC wall time, with a warning."""
    when = pd.to_datetime(["2020-01-01 00:30", "2020-07-01 12:00", None]).tz_localize("Europe/Berlin")
    pd.DataFrame({"id": [0, 1, 2], "when": when}).to_parquet(tmp_path / "t.parquet")
    with pytest.warns(shardkit.errors.TimeZoneWarning, match=r"column 'when' holds times with the time zone "
                      r"'Europe/Berlin': they are written as UTC wall times, datetime64\[us\].*tz_convert"):
        ds = convert(tmp_path / "t.parquet", tmp_path / "out")
    assert ds.schema["when"] == shardkit.Field("when", "datetime64[us]", nullable=True)
    got = ds.decode(ds.read_row_group(0))["when"]
    utc = when.tz_convert("UTC").tz_localize(None).to_numpy().astype("datetime64[us]")
    np.testing.assert_array_equal(np.ma.getdata(got)[:2], utc[:2])
    assert np.ma.getmaskarray(got).tolist() == [False, False, True]
    with warnings.catch_warnings():  # left out by columns=: nothing to warn of
        warnings.simplefilter("error")
        assert convert(tmp_path / "t.parquet", tmp_path / "ids", columns=["id"]).schema.names == ["id"]


def test_a_folders_files_in_several_time_zones_are_all_written_as_utc(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    for i, zone in enumerate(["Europe/Berlin", "UTC"]):
        pq.write_table(pa.table({"t": pa.array([3_600_000_000 * i], pa.timestamp("us", tz=zone))}),
                       tmp_path / "src" / f"p{i}.parquet")
    with pytest.warns(shardkit.errors.TimeZoneWarning, match=r"'t' .*time zones 'Europe/Berlin' and 'UTC'"):
        ds = convert(tmp_path / "src", tmp_path / "out")
    assert read_rows(ds.url)[1]["t"] == [np.datetime64(0, "us"), np.datetime64(3_600_000_000, "us")]


@pytest.mark.parametrize("declared", [None, shardkit.Field("ts", "datetime64[ms]")])
def test_csv_times_with_utc_offsets_are_written_as_utc(tmp_path: Path, declared: Any) -> None:
    """pyarrow reads ISO times with offsets as ``timestamp[s, tz=UTC]`` (declared without a zone, its parser
    refused them: "expected no zone offset")."""
    (tmp_path / "a.csv").write_text("ts\n2020-01-01T02:00:00+02:00\n2020-01-01T00:00:01Z\n")
    with pytest.warns(shardkit.errors.TimeZoneWarning, match=r"column 'ts' .*time zone 'UTC'"):
        ds = convert(tmp_path / "a.csv", tmp_path / "out", schema=None if declared is None else [declared])
    unit = "s" if declared is None else "ms"
    assert ds.schema["ts"] == shardkit.Field("ts", f"datetime64[{unit}]")
    assert ds.decode(ds.read_row_group(0))["ts"].tolist() == np.array(
        ["2020-01-01T00:00:00", "2020-01-01T00:00:01"], f"datetime64[{unit}]").tolist()


def test_errors_name_the_source_row_and_of_a_folder_the_file(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Codecs number the rows of the batch they encode: the message names the source's row instead (and
    the file's, in a folder), not "row 1" of "source rows 4-7"."""
    monkeypatch.setattr(convert_sources, "_BATCH_ROWS", 4)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.csv").write_text("id,x\n" + "".join(f"{i},{i}\n" for i in range(6)))
    (tmp_path / "src" / "b.csv").write_text("id,x\n" + "".join(f"{i},{'' if i == 5 else i}\n"
                                                                for i in range(8)))
    with pytest.raises(SchemaMismatchError) as info:
        convert(tmp_path / "src" / "b.csv", tmp_path / "out", schema=[shardkit.Field("x", "int64")])
    assert "(source rows 4-7): field 'x' (writing) is not nullable but source row 5 is null" in str(
        info.value)
    with pytest.raises(SchemaMismatchError) as info:
        convert(tmp_path / "src", tmp_path / "out", schema=[shardkit.Field("x", "int64")])
    assert ("('b.csv', its rows 4-7: source rows 10-13): field 'x' (writing) is not nullable but row 5 of "
            "'b.csv' (source row 11) is null") in str(info.value)
    pixels = np.zeros((6, 2, 2, 3), np.uint8)
    blobs = [png(p) for p in pixels[:5]] + [png(np.zeros((3, 2, 3), np.uint8))]
    pq.write_table(pa.table({"img": pa.array(blobs, pa.binary())}), tmp_path / "i.parquet")
    with pytest.raises(SchemaMismatchError, match=r"\(source rows 4-5\): field 'img': source row 5 is a PNG "
                                                  r"image of 3x2 pixels"):
        convert(tmp_path / "i.parquet", tmp_path / "out", schema=[
            shardkit.Field("img", "uint8", (2, 2, 3), codec=ImageCodec("png"))])
    (tmp_path / "src" / "c.csv").write_text("id,x\n1,1\n2,x\n")
    with pytest.raises(SchemaMismatchError, match=r"cannot read 'c\.csv' past its row 0 \(source row 14\)"):
        convert(tmp_path / "src", tmp_path / "out", schema=[shardkit.Field("x", "int64", nullable=True)])
    assert not (tmp_path / "out").exists()


def test_a_field_whose_name_says_row_keeps_its_name_in_errors(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert_sources, "_BATCH_ROWS", 2)
    pq.write_table(pa.table({"row 1": [1, 2, None]}), tmp_path / "a.parquet")
    with pytest.raises(SchemaMismatchError, match=r"field 'row 1' .*but source row 2 is null"):
        convert(tmp_path / "a.parquet", tmp_path / "out", schema=[shardkit.Field("row 1", "int64")])


def test_stray_files_beside_the_data_are_left_out_naming_them(tmp_path: Path) -> None:
    """A README or a notes.json beside Parquet files made the folder "mixed formats"; a Parquet file
    without a suffix (Hive's names) was left out silently. Now the data format is the one of most bytes,
    every other file is named in a warning, and Parquet is known by its magic bytes too."""
    src = tmp_path / "src"
    src.mkdir()
    write_as(frame(40).iloc[:20], src / "part-0.parquet", "parquet")
    write_as(frame(40).iloc[20:], src / "000001_0", "parquet")
    (src / "notes.json").write_text('{"source": "frame", "rows": 40}\n')
    (src / "README.txt").write_text("the frame, in two files\n")
    (src / "_SUCCESS").write_text("")  # Spark's: never data, no warning
    (src / ".part-0.parquet.crc").write_text("x")
    with pytest.warns(shardkit.errors.FilesLeftOutWarning) as caught:
        ds = convert(src, tmp_path / "out")
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(f"{os.fspath(src)!r}: left out 2 file(s) that are not parquet, the format of "
                              "its data (2 file(s), most of its bytes): 'README.txt', 'notes.json'; ")
    assert_frame_rows(ds, frame(40))


def test_a_glob_pattern_converts_the_files_it_matches(tmp_path: Path, helpers: SimpleNamespace) -> None:
    df = frame(30)
    for k in range(3):
        (tmp_path / "src" / f"k={k}").mkdir(parents=True)
        write_as(df.iloc[k * 10 : (k + 1) * 10], tmp_path / "src" / f"k={k}" / f"part-{k}.csv", "csv")
        (tmp_path / "src" / f"k={k}" / "schema.json").write_text("{}\n")
    (tmp_path / "src" / "README.txt").write_text("hi\n")
    with warnings.catch_warnings():  # what the pattern leaves out is not the data's
        warnings.simplefilter("error")
        ds = convert(tmp_path / "src" / "*" / "*.csv", tmp_path / "out")
    assert ds.schema["k"] == shardkit.Field("k", "int32")  # Hive folders below the first wildcard
    _, rows = read_rows(ds.url, columns=["id", "k"])
    assert rows == {"id": list(range(30)), "k": [i // 10 for i in range(30)]}
    one = convert(tmp_path / "src" / "k=1" / "*.csv", tmp_path / "one")
    assert one.schema.names == list(df.columns)
    assert one.num_rows == 10
    with pytest.warns(shardkit.errors.FilesLeftOutWarning, match=r"'k=0/schema\.json', 'k=1/schema\.json'"), \
            pytest.raises(NotADatasetError, match=r"the destination lies inside the source"):
        convert(tmp_path / "src" / "k=*", tmp_path / "src" / "k=1" / "out", mode="overwrite")
    helpers.assert_nothing_written(os.fspath(tmp_path / "src" / "k=1" / "out"))
