"""`open_dataset` and `write_summary`: what opens, its row-group index, and what refuses to open."""

from __future__ import annotations

import datetime
import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.dataset.schema import SCHEMA_KEY
from shardkit.errors import (
    CorruptDatasetError,
    DatasetError,
    DatasetNotFoundError,
    NotADatasetError,
    SchemaError,
    SchemaMismatchError,
)
from tests.reader import conftest as s3_fixtures
from tests.reader.conftest import S3Server

# the moto S3 server on loopback and a fresh bucket per test (tests/reader/conftest.py)
s3_server, s3_bucket, no_internet = s3_fixtures.s3_server, s3_fixtures.s3_bucket, s3_fixtures.no_internet


def frames() -> list[pd.DataFrame]:
    n = 11
    df = pd.DataFrame(
        {
            "id": np.arange(n, dtype=np.int64),
            "score": np.linspace(0, 1, n),
            "name": [f"n{i}" for i in range(n)],
            "vec": [np.arange(i % 4, dtype=np.float32) for i in range(n)],
        }
    )
    return [df.iloc[:6].reset_index(drop=True), df.iloc[6:].reset_index(drop=True)]


def expected_index(url: str, files: list[str]) -> list[tuple[str, int, int, int]]:
    out = []
    for name in files:
        md = pq.ParquetFile(os.path.join(url, name)).metadata
        out += [
            (name, i, md.row_group(i).num_rows, md.row_group(i).total_byte_size)
            for i in range(md.num_row_groups)
        ]
    return out


def index_of(ds: shardkit.Dataset) -> list[tuple[str, int, int, int]]:
    return [(rg.file, rg.index, rg.num_rows, rg.num_bytes) for rg in ds.row_groups]


# --- plain Parquet folders --------------------------------------------------------------------------


def test_plain_folder_opens_with_a_warning_and_correct_index(plain_parquet_folder: Any) -> None:
    url = plain_parquet_folder(frames(), row_group_size=4)
    with pytest.warns(
        shardkit.SummaryMissingWarning, match=r"no _metadata.*2 files.*write_summary"
    ) as record:
        ds = shardkit.open_dataset(url)
    assert record[0].filename == __file__  # points at the caller's line
    assert ds.kind == "parquet"
    assert ds.metadata is None
    assert index_of(ds) == expected_index(url, ["part-0.parquet", "part-1.parquet"])
    assert [rg.num_rows for rg in ds.row_groups] == [4, 2, 4, 1]
    assert ds.num_rows == 11
    assert ds.files == ["part-0.parquet", "part-1.parquet"]
    assert ds.rows_per_group.tolist() == [4, 2, 4, 1]
    assert ds.num_bytes == sum(rg.num_bytes for rg in ds.row_groups) > 0

    # schema inferred from the Arrow types pandas wrote (Parquet columns are nullable)
    assert [(f.name, f.dtype_name, f.shape, f.codec.name) for f in ds.schema] == [
        ("id", "int64", (), "scalar"),
        ("score", "float64", (), "scalar"),
        ("name", "str", (), "scalar"),
        ("vec", "float32", (None,), "ndarray"),
    ]
    out = ds.decode(ds.read_row_group(2))
    assert out["id"].tolist() == [6, 7, 8, 9]
    assert out["name"].tolist() == ["n6", "n7", "n8", "n9"]
    assert [v.tolist() for v in out["vec"]] == [[0.0, 1.0], [0.0, 1.0, 2.0], [], [0.0]]


def test_write_summary_removes_the_warning(plain_parquet_folder: Any, helpers: SimpleNamespace) -> None:
    url = plain_parquet_folder(frames(), row_group_size=4)
    with pytest.warns(shardkit.SummaryMissingWarning):
        before = shardkit.open_dataset(url)
    indexed = shardkit.write_summary(url)
    assert helpers.files_under(url) == {"_metadata", "_common_metadata", "part-0.parquet", "part-1.parquet"}
    ds = shardkit.open_dataset(url)  # filterwarnings=error: any warning here fails the test
    for opened in (indexed, ds):
        assert opened.kind == "parquet"
        assert opened.metadata is not None
        assert index_of(opened) == index_of(before)
        assert opened.schema == before.schema
    assert ds.decode(ds.read_row_group(3))["id"].tolist() == [10]


def test_pyarrow_written_folder(tmp_path: Path) -> None:
    import pyarrow.dataset as pads

    table = pa.table({"a": np.arange(20), "b": pa.array([[1, 2]] * 20, pa.list_(pa.int8(), 2))})
    pads.write_dataset(table, tmp_path / "ds", format="parquet", max_rows_per_group=8, max_rows_per_file=12)
    pq.write_to_dataset(table.slice(0, 5), tmp_path / "ds")  # pandas-style <uuid>-0.parquet beside them
    with pytest.warns(shardkit.SummaryMissingWarning):
        ds = shardkit.open_dataset(tmp_path / "ds")
    assert len(ds.files) == 3
    assert ds.num_rows == 25
    assert index_of(ds) == expected_index(str(tmp_path / "ds"), ds.files)
    assert ds.schema["b"].shape == (2,)
    rows = np.concatenate([ds.decode(ds.read_row_group(i))["a"] for i in range(len(ds.row_groups))])
    assert sorted(rows.tolist()) == sorted([*range(20), *range(5)])


def test_spark_style_and_hive_style_names(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    pq.write_table(pa.table({"a": [1, 2]}), folder / "part-00000-1b2c-c000.snappy.parquet")
    pq.write_table(pa.table({"a": [3]}), folder / "000001_0")  # Hive names files without a suffix
    (folder / "_SUCCESS").write_text("")
    (folder / ".part-00000-1b2c-c000.snappy.parquet.crc").write_bytes(b"crc")
    (folder / "README.md").write_text("not data")
    (folder / "notes.txt").write_text("not data either")
    with pytest.warns(shardkit.SummaryMissingWarning):
        ds = shardkit.open_dataset(folder)
    assert ds.files == ["000001_0", "part-00000-1b2c-c000.snappy.parquet"]
    assert ds.num_rows == 3
    ds = shardkit.write_summary(folder)
    assert ds.files == ["000001_0", "part-00000-1b2c-c000.snappy.parquet"]


def test_files_with_different_schemas_are_refused(tmp_path: Path, helpers: SimpleNamespace) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    pq.write_table(pa.table({"a": [1, 2]}), folder / "a.parquet")
    pq.write_table(pa.table({"a": ["x"]}), folder / "b.parquet")
    for call in (shardkit.open_dataset, shardkit.write_summary):
        with pytest.raises(SchemaMismatchError) as info:
            call(folder)
        for needle in ["'b.parquet'", "'a.parquet'", "a: string", "a: int64", "same columns"]:
            assert needle in str(info.value)
    assert helpers.files_under(str(folder)) == {"a.parquet", "b.parquet"}


def test_memory_filesystem_plain_folder(memory_url: str) -> None:
    fs = fsspec.filesystem("memory")
    root = memory_url.removeprefix("memory://")
    with fs.open(f"{root}/x.parquet", "wb") as f:
        pq.write_table(pa.table({"a": np.arange(5)}), f, row_group_size=2)
    with pytest.warns(shardkit.SummaryMissingWarning):
        ds = shardkit.open_dataset(memory_url)
    assert [rg.num_rows for rg in ds.row_groups] == [2, 2, 1]
    shardkit.write_summary(memory_url)
    ds = shardkit.open_dataset(memory_url)
    assert ds.decode(ds.read_row_group(2))["a"].tolist() == [4]


# --- shardkit datasets ------------------------------------------------------------------------------


def test_shardkit_index_matches_the_footers(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    ds = shardkit.write_dataset({"x": np.arange(1000.0)}, url, row_group_size=150, file_size="2KiB")
    assert len(ds.files) > 1
    assert ds.kind == "shardkit"
    assert index_of(ds) == expected_index(url, ds.files)
    assert sum(rg.num_rows for rg in ds.row_groups) == 1000
    # opening reads _metadata only: the same index with the data files out of the way
    away = tmp_path / "away"
    away.mkdir()
    for name in ds.files:
        os.replace(os.path.join(url, name), away / name)
    assert index_of(shardkit.open_dataset(url)) == index_of(ds)


def test_schema_travels_as_json_in_the_summary(tmp_path: Path) -> None:
    schema = shardkit.Schema(
        [
            shardkit.Field("im", "uint8", (4, 4, 3), codec=shardkit.ImageCodec("jpeg", quality=70)),
            shardkit.Field("v", "float16", (None, 2), nullable=True),
        ]
    )
    shardkit.write_dataset([], tmp_path / "ds", schema=schema)
    for name in ("_metadata", "_common_metadata"):
        meta = pq.read_schema(tmp_path / "ds" / name).metadata
        stored = json.loads(meta[SCHEMA_KEY])
        assert stored["version"] == 2
        assert stored["fields"][0] == {
            "name": "im",
            "dtype": "uint8",
            "shape": [4, 4, 3],
            "codec": {"name": "image", "format": "jpeg", "quality": 70},
            "nullable": False,
        }
    assert shardkit.open_dataset(tmp_path / "ds").schema == schema


# --- what does not open -----------------------------------------------------------------------------


def test_nonexistent_url(any_url: str, helpers: SimpleNamespace) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        shardkit.open_dataset(any_url)
    assert isinstance(info.value, FileNotFoundError)
    assert any_url.removeprefix("memory://") in str(info.value)
    assert "write_dataset" in str(info.value)
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        shardkit.write_summary(any_url)
    helpers.assert_nothing_written(any_url)


def test_a_file_is_not_a_dataset(tmp_path: Path) -> None:
    pq.write_table(pa.table({"a": [1]}), tmp_path / "one.parquet")
    with pytest.raises(NotADatasetError, match=r"one\.parquet.*is a file.*folder"):
        shardkit.open_dataset(tmp_path / "one.parquet")


@pytest.mark.parametrize("content", ["empty", "text files", "only staging"])
def test_folders_that_are_not_datasets(tmp_path: Path, helpers: SimpleNamespace, content: str) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    if content == "text files":
        (folder / "a.csv").write_text("a,b\n1,2\n")
        (folder / "README").write_text("hello")
        (folder / "sub").mkdir()
        (folder / "sub" / "notes.md").write_text("# notes")
    elif content == "only staging":
        (folder / "_staging" / "abc").mkdir(parents=True)
    before = helpers.files_under(str(folder))
    with pytest.raises(NotADatasetError) as info:
        shardkit.open_dataset(folder)
    assert isinstance(info.value, ValueError)
    for needle in [str(folder), "no Parquet data", "write_dataset"]:
        assert needle in str(info.value)
    with pytest.raises(NotADatasetError, match="no Parquet data files to index"):
        shardkit.write_summary(folder)
    assert helpers.files_under(str(folder)) == before  # opening and failing wrote nothing


def test_unfinished_shardkit_write_does_not_open(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    ds = shardkit.write_dataset({"x": np.arange(10)}, url, row_group_size=3)
    os.remove(os.path.join(url, "_metadata"))
    os.remove(os.path.join(url, "_common_metadata"))
    with pytest.raises(NotADatasetError, match=r"written by shardkit but no _metadata.*write_summary"):
        shardkit.open_dataset(url)
    adopted = shardkit.write_summary(url)
    assert adopted.kind == "shardkit"
    assert index_of(adopted) == index_of(ds)


# --- corrupt files ----------------------------------------------------------------------------------


def corrupt_row_group(path: str, row_group: int) -> None:
    """Overwrite the first bytes of one row group's first column chunk (its page header) with garbage."""
    md = pq.read_metadata(path)
    offset = md.row_group(row_group).column(0).data_page_offset
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(np.random.default_rng(row_group).integers(0, 256, 48, dtype=np.uint8)))


def truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def test_corrupt_and_truncated_files_in_a_plain_folder_fail_at_open(plain_parquet_folder: Any) -> None:
    url = plain_parquet_folder(frames(), row_group_size=4)
    path = os.path.join(url, "part-1.parquet")
    with open(path, "r+b") as f:  # garble the footer
        f.seek(-40, os.SEEK_END)
        f.write(b"\x13" * 32)
    with pytest.raises(CorruptDatasetError) as info:
        shardkit.open_dataset(url)
    assert isinstance(info.value, OSError)
    for needle in ["part-1.parquet", "truncated or corrupt"]:
        assert needle in str(info.value)

    url = plain_parquet_folder(frames(), row_group_size=4, name="truncated")
    truncate(os.path.join(url, "part-0.parquet"))
    with pytest.raises(CorruptDatasetError, match=r"part-0\.parquet.*truncated or corrupt"):
        shardkit.open_dataset(url)
    with pytest.raises(CorruptDatasetError, match=r"part-0\.parquet"):
        shardkit.write_summary(url)


def test_corrupt_pages_in_a_plain_folder_fail_at_read(plain_parquet_folder: Any) -> None:
    url = plain_parquet_folder(frames(), row_group_size=4)
    corrupt_row_group(os.path.join(url, "part-0.parquet"), 1)
    with pytest.warns(shardkit.SummaryMissingWarning):
        ds = shardkit.open_dataset(url)
    with pytest.raises(CorruptDatasetError, match=r"(?s)row group 1 of '.*part-0\.parquet'.*corrupt"):
        ds.read_row_group(1)
    assert ds.decode(ds.read_row_group(0))["id"].tolist() == [0, 1, 2, 3]


@pytest.fixture
def three_files(tmp_path: Path) -> tuple[str, shardkit.Dataset]:
    url = str(tmp_path / "ds")
    data = {"x": np.arange(900, dtype=np.int64), "s": [f"s{i}" for i in range(900)]}
    ds = shardkit.write_dataset(data, url, row_group_size=100, file_size="4KiB")
    assert len(ds.files) == 3
    return url, ds


def test_corrupt_row_group_in_a_shardkit_dataset(three_files: tuple[str, shardkit.Dataset]) -> None:
    url, ds = three_files
    target = next(i for i, rg in enumerate(ds.row_groups) if rg.file == ds.files[1] and rg.index == 1)
    corrupt_row_group(os.path.join(url, ds.files[1]), 1)
    ds = shardkit.open_dataset(url)  # the summary is intact: opening does not read data files
    with pytest.raises(CorruptDatasetError) as info:
        ds.read_row_group(target)
    for needle in ["row group 1", ds.files[1], "corrupt"]:
        assert needle in str(info.value)
    for i in range(len(ds.row_groups)):
        if i != target:
            assert ds.decode(ds.read_row_group(i))["x"].tolist() == list(range(100 * i, 100 * i + 100))


def test_truncated_file_in_a_shardkit_dataset(three_files: tuple[str, shardkit.Dataset]) -> None:
    url, ds = three_files
    truncate(os.path.join(url, ds.files[2]))
    ds = shardkit.open_dataset(url)
    last = len(ds.row_groups) - 1
    with pytest.raises(CorruptDatasetError) as info:
        ds.read_row_group(last)
    for needle in [f"row group {ds.row_groups[last].index}", ds.files[2], "truncated or corrupt"]:
        assert needle in str(info.value)
    assert ds.decode(ds.read_row_group(0))["x"][0] == 0


def test_missing_file_in_a_shardkit_dataset(three_files: tuple[str, shardkit.Dataset]) -> None:
    url, ds = three_files
    os.remove(os.path.join(url, ds.files[0]))
    with pytest.raises(CorruptDatasetError, match=rf"row group 0 of .*{ds.files[0]}.*missing.*write_summary"):
        shardkit.open_dataset(url).read_row_group(0)


def test_write_summary_indexes_the_files_that_remain(
    three_files: tuple[str, shardkit.Dataset], helpers: SimpleNamespace
) -> None:
    # what the missing-file error above tells users to do
    url, ds = three_files
    os.remove(os.path.join(url, ds.files[1]))
    indexed = shardkit.write_summary(url)  # filterwarnings=error: no UncommittedFilesWarning
    assert indexed.kind == "shardkit"
    assert indexed.files == [ds.files[0], ds.files[2]]
    assert helpers.read_all(indexed)["x"] == [*range(300), *range(600, 900)]


def test_write_summary_leaves_out_the_parts_of_an_uncommitted_write(
    three_files: tuple[str, shardkit.Dataset], tmp_path: Path, helpers: SimpleNamespace
) -> None:
    # a killed overwrite (or append) moved its parts into the root and died before its _metadata:
    # indexing must not mix them into the committed dataset
    url, ds = three_files
    other = shardkit.write_dataset({"x": np.full(50, -1), "s": ["new"] * 50}, tmp_path / "other")
    stray = other.files[0]
    os.replace(os.path.join(other.url, stray), os.path.join(url, stray))
    warning = shardkit.dataset.UncommittedFilesWarning
    with pytest.warns(warning, match=rf"1 data file.*{stray}.*did not commit"):
        indexed = shardkit.write_summary(url)
    assert indexed.files == ds.files
    assert helpers.read_all(shardkit.open_dataset(url))["x"] == list(range(900))
    assert stray in helpers.files_under(url)  # left for the next write to remove, not deleted here


def test_write_summary_of_an_empty_shardkit_dataset(tmp_path: Path, helpers: SimpleNamespace) -> None:
    schema = shardkit.Schema([shardkit.Field("x", "int64")])
    url = os.fspath(tmp_path / "ds")
    shardkit.write_dataset({"x": []}, url, schema=schema)
    indexed = shardkit.write_summary(url)  # its one empty part is never listed, and is no stray
    assert (indexed.kind, indexed.num_rows, indexed.schema) == ("shardkit", 0, schema)


def test_write_summary_of_a_plain_folder_adopts_new_files(plain_parquet_folder: Any) -> None:
    # no shardkit summary: every data file is the dataset's, as before
    url = plain_parquet_folder(frames()[:1])
    shardkit.write_summary(url)
    frames()[1].to_parquet(os.path.join(url, "part-9.parquet"), row_group_size=3, index=False)
    assert shardkit.write_summary(url).num_rows == 11


def test_corrupt_summary(three_files: tuple[str, shardkit.Dataset]) -> None:
    url, _ = three_files
    with open(os.path.join(url, "_metadata"), "wb") as f:
        f.write(b"PAR1 this is not a footer PAR1")
    with pytest.raises(CorruptDatasetError, match=r"_metadata.*truncated or corrupt"):
        shardkit.open_dataset(url)


# --- schemas this shardkit cannot read --------------------------------------------------------------


def dataset_with_stored_schema(
    folder: Path, schema_json: dict[str, Any], table: pa.Table | None = None
) -> str:
    """A dataset of ``table`` (default: an int64 column ``x``) whose files and summary carry
    ``schema_json`` as the shardkit schema."""
    folder.mkdir()
    table = pa.table({"x": np.arange(3, dtype=np.int64)}) if table is None else table
    table = table.replace_schema_metadata({SCHEMA_KEY: json.dumps(schema_json)})
    collector: list[pq.FileMetaData] = []
    pq.write_table(table, folder / "part-0.parquet", metadata_collector=collector)
    collector[0].set_file_path("part-0.parquet")
    pq.write_metadata(table.schema, folder / "_metadata", metadata_collector=collector)
    return os.fspath(folder)


def field_json(**codec: Any) -> dict[str, Any]:
    return {"name": "x", "dtype": "int64", "shape": [], "codec": codec, "nullable": False}


def test_the_stored_schema_helper_makes_a_dataset_that_opens(tmp_path: Path) -> None:
    url = dataset_with_stored_schema(tmp_path / "ok", {"version": 1, "fields": [field_json(name="scalar")]})
    ds = shardkit.open_dataset(url)
    assert ds.kind == "shardkit"
    assert ds.decode(ds.read_row_group(0))["x"].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("stored", "needles"),
    [
        (
            {"version": 3, "fields": [field_json(name="scalar")]},
            ["version 3", "versions [1, 2]", "pip install -U shardkit"],
        ),
        (
            {"version": 1, "fields": [field_json(name="zfp")]},
            ["field 'x'", "unknown codec 'zfp'", "pip install -U"],
        ),
        ({"version": 1, "fields": [field_json(name="scalar", level=9)]}, ["field 'x'", "'scalar'", "level"]),
        ({"version": 1, "fields": [field_json(name="image", format="webp")]}, ["field 'x'", "'webp'"]),
        ({"version": 1, "fields": [{"name": "x", "dtype": "int64", "colour": 1}]}, ["colour", "malformed"]),
        ({"version": 1}, ["no 'fields' list"]),
    ],
    ids=["future version", "unknown codec", "bad codec option", "bad codec value", "bad field", "no fields"],
)
def test_stored_schemas_that_cannot_be_read(
    tmp_path: Path, stored: dict[str, Any], needles: list[str]
) -> None:
    url = dataset_with_stored_schema(tmp_path / "ds", stored)
    with pytest.raises(SchemaError) as info:
        shardkit.open_dataset(url)
    message = str(info.value)
    assert url in message
    for needle in needles:
        assert needle in message


def test_stored_schema_that_is_not_json(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    table = pa.table({"x": [1]}).replace_schema_metadata({SCHEMA_KEY: b"{not json"})
    collector: list[pq.FileMetaData] = []
    pq.write_table(table, folder / "p.parquet", metadata_collector=collector)
    collector[0].set_file_path("p.parquet")
    pq.write_metadata(table.schema, folder / "_metadata", metadata_collector=collector)
    with pytest.raises(SchemaError, match="not valid JSON"):
        shardkit.open_dataset(folder)


def with_edited_schema(url: str, edit: Any) -> None:
    """Replace the schema JSON in ``url``'s ``_metadata`` by ``edit(fields)``'s, as a hand edit would."""
    md = pq.read_metadata(os.path.join(url, "_metadata"))
    arrow_schema = md.schema.to_arrow_schema()
    stored = json.loads(arrow_schema.metadata[SCHEMA_KEY])
    edit(stored["fields"])
    sink = pa.BufferOutputStream()
    pq.ParquetWriter(sink, arrow_schema.with_metadata({SCHEMA_KEY: json.dumps(stored)})).close()
    edited = pq.read_metadata(pa.BufferReader(sink.getvalue()))
    edited.append_row_groups(md)
    edited.write_metadata_file(os.path.join(url, "_metadata"))


def _set(index: int, **changes: Any) -> Any:
    return lambda fields: fields[index].update(changes)


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (_set(1, name="renamed"), ["'renamed'", "no Parquet column", "'x'"]),
        (_set(0, dtype="str"), ["'id'", "str values", "int64"]),
        (_set(2, dtype="int64"), ["'s'", "int64 values", "string"]),
        (_set(0, dtype="int32"), ["'id'", "int32 values", "int64"]),
        (_set(1, shape=[5]), ["'x'", "(5,)", "20 bytes", "16"]),
        (_set(3, dtype="int32"), ["'l'", "int32 values", "float"]),
        (_set(3, shape=[3, 3]), ["'l'", "(3, 3)", "9 values", "not the column's 4"]),
        (_set(4, dtype="float64"), ["'v'", "float64 values", "int16"]),
        (_set(4, shape=[None, 2]), ["'v'", "2-dimensional", "list<"]),
        (_set(0, shape=[4], codec={"name": "tensor"}), ["'id'", "fixed-shape tensor", "int64"]),
        (_set(0, dtype="uint8", shape=[2, 2], codec={"name": "image"}), ["'id'", "images", "int64"]),
        (lambda fields: fields.pop(2), ["['s']", "not in its schema"]),
    ],
    ids=["renamed", "int as str", "str as int", "int64 as int32", "tensor size", "tensor values",
         "list size", "ndarray values", "ndarray rank", "scalar as tensor", "int as image", "field dropped"],
)
def test_a_stored_schema_that_does_not_describe_the_files_fails_at_open(
    tmp_path: Path, edit: Any, needles: list[str]
) -> None:
    # the schema JSON is edited, the files stay: reading on would drop a field or decode wrong values
    url = os.fspath(tmp_path / "ds")
    schema = shardkit.Schema([
        shardkit.Field("id", "int64"),
        shardkit.Field("x", "float32", (4,)),
        shardkit.Field("s", "str"),
        shardkit.Field("l", "float32", (2, 2), codec=shardkit.TensorCodec(storage="list")),
        shardkit.Field("v", "int16", (None,)),
    ])
    data = {"id": np.arange(3), "x": np.ones((3, 4), np.float32), "s": list("abc"),
            "l": np.ones((3, 2, 2), np.float32), "v": [np.arange(i, dtype=np.int16) for i in range(3)]}
    shardkit.write_dataset(data, url, schema=schema)
    with_edited_schema(url, edit)
    with pytest.raises(CorruptDatasetError) as info:
        shardkit.open_dataset(url)
    message = str(info.value)
    for needle in [url, "_metadata", "rewrite the dataset", *needles]:
        assert needle in message


def test_every_layout_a_field_decodes_from_opens(tmp_path: Path) -> None:
    # the check takes what the codecs read, not only what this shardkit writes: a tensor in either
    # layout whatever its storage option says, datetime64[s] (stored as milliseconds), dictionary text
    url = os.fspath(tmp_path / "ds")
    table = pa.table({
        "t": pa.array([b"\x00" * 8], pa.binary(8)),
        "when": pa.array([1000], pa.timestamp("ms")),
        "s": pa.array(["a"]).dictionary_encode(),
        "im": pa.array([b"png"], pa.large_binary()),
    })
    stored = shardkit.Schema([
        shardkit.Field("t", "float32", (2,), codec=shardkit.TensorCodec(storage="list")),
        shardkit.Field("when", "datetime64[s]"),
        shardkit.Field("s", "str"),
        shardkit.Field("im", "uint8", (None, None), codec="image"),
    ])
    dataset_with_stored_schema(tmp_path / "ds", json.loads(stored.to_json()), table)
    ds = shardkit.open_dataset(url)
    assert ds.decode(ds.read_row_group(0, ["t", "when", "s"]))["when"].tolist() == [np.datetime64(1, "s")]


def test_open_never_warns_for_a_shardkit_dataset(tmp_path: Path) -> None:
    shardkit.write_dataset({"x": [1, 2]}, tmp_path / "ds")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shardkit.open_dataset(tmp_path / "ds")


# --- reading row groups ---------------------------------------------------------------------------


def test_row_groups_are_read_in_slices_equal_to_pyarrow(tmp_path: Path) -> None:
    from shardkit.dataset import SLICE_ROWS

    n = 3 * SLICE_ROWS + 17
    data = {"x": np.arange(n, dtype=np.int64), "t": np.arange(2 * n, dtype=np.float32).reshape(n, 2)}
    ds = shardkit.write_dataset(data, tmp_path / "ds", row_group_size=n)
    batches = list(ds.iter_row_group(0))
    assert [b.num_rows for b in batches] == [SLICE_ROWS] * 3 + [17]
    assert [b.num_rows for b in ds.iter_row_group(0, ["t"], batch_size=500)] == [500] * (n // 500) + [n % 500]
    table = ds.read_row_group(0)
    path = tmp_path / "ds" / ds.row_groups[0].file
    assert table.equals(pq.ParquetFile(path).read_row_group(0))
    np.testing.assert_array_equal(ds.decode(table)["t"], data["t"])


def test_an_empty_selection_reads_an_empty_table_with_the_columns(tmp_path: Path) -> None:
    ds = shardkit.write_dataset({"x": np.arange(3), "y": np.ones(3)}, tmp_path / "ds")
    table = ds.read_row_group(0, ["y"])
    assert table.column_names == ["y"]
    assert table.num_rows == 3


def test_a_file_footer_is_read_at_most_once_per_dataset(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ds = shardkit.write_dataset({"x": np.arange(400)}, tmp_path / "ds", row_group_size=100)
    assert len(ds.files) == 1
    assert len(ds.row_groups) == 4
    ds = shardkit.open_dataset(tmp_path / "ds")
    reads: list[object] = []
    real = pq.ParquetFile.__init__

    def counting(self: pq.ParquetFile, source: Any, *args: Any, metadata: Any = None, **kw: Any) -> None:
        reads.append(metadata)
        real(self, source, *args, metadata=metadata, **kw)

    monkeypatch.setattr(pq.ParquetFile, "__init__", counting)
    values = [ds.decode(ds.read_row_group(i))["x"] for i in range(4)]
    assert np.concatenate(values).tolist() == list(range(400))
    assert len(reads) == 4
    assert all(md is ds.metadata for md in reads)  # the _metadata summary: no data file footer is read
    ds = shardkit.open_dataset(tmp_path / "ds")
    object.__setattr__(ds, "metadata", None)  # as a folder without a summary beyond FOOTERS_KEPT files
    reads.clear()
    values = [ds.decode(ds.read_row_group(i))["x"] for i in range(4)]
    assert np.concatenate(values).tolist() == list(range(400))
    assert reads[0] is None  # the first opening reads the footer ...
    assert all(md is not None for md in reads[1:])  # ... the others reuse it


def test_decoded_row_bytes_counts_shapes_not_encoded_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    schema = shardkit.Schema([
        shardkit.Field("id", "int64"),
        shardkit.Field("im", "uint8", (8, 8, 3), codec=shardkit.ImageCodec("png")),
        shardkit.Field("v", "float32", (None,)),
        shardkit.Field("s", "str"),
    ])
    n = 50
    data = {"id": np.arange(n), "im": list(np.zeros((n, 8, 8, 3), np.uint8)),
            "v": [rng.standard_normal(10).astype(np.float32) for _ in range(n)], "s": ["abcd"] * n}
    ds = shardkit.write_dataset(data, tmp_path / "ds", schema=schema)
    assert ds.decoded_row_bytes(["id", "im"]) == 8 + 8 * 8 * 3  # the PNG bytes are far fewer
    assert ds.decoded_row_bytes(["v"]) >= 40  # ten float32 a row, from Parquet's plain size
    assert ds.decoded_row_bytes(["s"]) >= 8
    assert ds.decoded_row_bytes() == sum(ds.decoded_row_bytes([f]) for f in schema.names)


# --- Hive-partitioned folders: files read, partition columns named as not read -------------------------


def _hive(root: Path) -> Path:
    table = pa.table({"id": list(range(6)), "year": [2020, 2020, 2021, 2021, 2022, 2022],
                      "month": [1, 2, 1, 2, 1, 2]})
    pq.write_to_dataset(table, str(root), partition_cols=["year", "month"])
    return root


def test_a_hive_partitioned_folder_warns_once_naming_the_keys_not_read(tmp_path: Path) -> None:
    from shardkit.errors import PartitionColumnsWarning

    root = _hive(tmp_path / "hive")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = shardkit.open_dataset(str(root))
    assert ds.schema.names == ["id"]
    assert ds.num_rows == 6  # every file is read
    partition = [w for w in caught if issubclass(w.category, PartitionColumnsWarning)]
    assert len(partition) == 1, [str(w.message) for w in caught]
    assert partition[0].filename == __file__  # points at the caller's open_dataset
    message = str(partition[0].message)
    for words in ("['year', 'month']", "as columns of the batches", "filter may name them",
                  f"`shardkit write {root} NEW_URL`", f"convert({str(root)!r}, new_url)"):
        assert words in message, (words, message)


def test_the_fix_the_warning_gives_keeps_the_partition_columns(tmp_path: Path) -> None:
    from shardkit.dataset.convert import convert

    root = _hive(tmp_path / "hive")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converted without a warning, and the new dataset opens without one
        convert(str(root), str(tmp_path / "flat"))
        ds = shardkit.open_dataset(str(tmp_path / "flat"))
    assert sorted(ds.schema.names) == ["id", "month", "year"]
    with shardkit.make_reader(ds, shuffle=False, batch_size=6) as reader:
        (batch,) = list(reader)
    rows = zip(batch["id"].tolist(), batch["year"].tolist(), batch["month"].tolist(), strict=True)
    assert sorted(rows) == [(i, 2020 + i // 2, 1 + i % 2) for i in range(6)]


def test_a_plain_folder_with_equals_signs_in_file_names_only_does_not_warn(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1, 2]}), tmp_path / "a=1.parquet")
    with pytest.warns(shardkit.SummaryMissingWarning) as caught:
        shardkit.open_dataset(str(tmp_path))
    assert [w.category for w in caught] == [shardkit.SummaryMissingWarning]


@pytest.mark.filterwarnings("ignore::shardkit.SummaryMissingWarning")
def test_partition_keys_lists_the_unread_keys(tmp_path: Path) -> None:
    with pytest.warns(shardkit.errors.PartitionColumnsWarning):
        ds = shardkit.open_dataset(str(_hive(tmp_path / "hive")))
    assert ds.partition_keys == ["year", "month"]
    assert shardkit.write_dataset(pd.DataFrame({"id": [1]}), str(tmp_path / "flat")).partition_keys == []


def test_plain_folder_with_dates_and_durations_opens(plain_parquet_folder: Any) -> None:
    """pandas writes Python dates as date32 and timedeltas as durations: both map to fields (as Spark's
    dates do) and read back as the values written."""
    dates = [datetime.date(2020, 2, 29), None, datetime.date(1969, 12, 31), datetime.date(1, 1, 1)]
    waits = pd.to_timedelta([1.5, None, -2, 0], unit="s")
    url = plain_parquet_folder([pd.DataFrame({"day": dates, "wait": waits})], row_group_size=2)
    with pytest.warns(shardkit.SummaryMissingWarning):
        ds = shardkit.open_dataset(url)
    assert [(f.name, f.dtype_name, f.nullable) for f in ds.schema] == [
        ("day", "datetime64[D]", True), ("wait", str(waits.dtype), True)]
    with pytest.warns(shardkit.SummaryMissingWarning), shardkit.make_reader(url, shuffle=False) as reader:
        (batch,) = list(reader)
    assert batch["day"].tolist() == dates  # a masked array lists its nulls as None
    present = ~np.asarray(waits.isna())
    assert (batch["wait"].mask == ~present).all()
    assert (batch["wait"].data[present] == waits.to_numpy()[present]).all()


def test_plain_parquet_columns_of_no_field_type_are_left_out_not_the_whole_dataset(tmp_path: Path) -> None:
    """A data-lake table with a decimal, a struct, a time of day or a zone-aware timestamp opened not at
    all: `columns=` could not leave them out, since it applies after opening."""
    import decimal

    from shardkit.errors import ColumnsLeftOutWarning, ReaderError

    table = pa.table({
        "id": pa.array([3, 1, 2], pa.int64()),
        "amount": pa.array([decimal.Decimal("1.25"), None, decimal.Decimal("-7.00")], pa.decimal128(10, 2)),
        "meta": pa.array([{"a": 1}, {"a": 2}, None]),
        "at": pa.array([datetime.time(1, 2), None, datetime.time(3, 4)], pa.time64("us")),
        "when": pa.array([datetime.datetime(2024, 1, 1)] * 3, pa.timestamp("us", tz="UTC")),
        "label": pa.array(["x", "y", None]),
    })
    (tmp_path / "t").mkdir()
    pq.write_table(table, tmp_path / "t" / "part-0.parquet")
    for summary in (False, True):
        if summary:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                shardkit.write_summary(str(tmp_path / "t"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = shardkit.open_dataset(str(tmp_path / "t"))
        (message,) = [str(w.message) for w in caught if w.category is ColumnsLeftOutWarning]
        for word in ("['amount', 'meta', 'at', 'when']", "decimal128(10, 2)", "pyarrow.float64()",
                     "struct<a: int64>", "time64[us]", "pyarrow.int64()", "time zone 'UTC'"):
            assert word in message, (word, message)
        assert ds.schema.names == ["id", "label"]
        assert ds.left_out.keys() == {"amount", "meta", "at", "when"}
        batch = next(iter(shardkit.make_reader(ds, batch_size=3, shuffle=False)))
        assert batch["id"].tolist() == [3, 1, 2]
        assert batch["label"].tolist() == ["x", "y", None]
        with pytest.raises(ReaderError, match=r"\['amount'\] of .* have no field type.*pyarrow.float64"):
            shardkit.make_reader(ds, columns=["id", "amount"])
    (tmp_path / "none").mkdir()
    pq.write_table(table.select(["amount", "meta"]), tmp_path / "none" / "part-0.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardkit.SummaryMissingWarning)
        with pytest.raises(SchemaError, match=r"no column maps to a field: column 'amount'.*column 'meta'"):
            shardkit.open_dataset(str(tmp_path / "none"))


def test_an_empty_url_is_refused_not_read_as_the_current_folder(tmp_path: Path) -> None:
    """fsspec reads "" as the current folder: `shardkit inspect ""` listed whatever was there."""
    for call in (lambda: shardkit.open_dataset(""), lambda: shardkit.open_dataset("  "),
                 lambda: shardkit.write_dataset({"x": np.arange(2)}, ""), lambda: shardkit.write_summary(""),
                 lambda: shardkit.make_reader("")):
        with pytest.raises(NotADatasetError, match=r"the dataset URL .* is empty"):
            call()


def test_write_summary_of_a_file_says_it_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("name: x\n")
    with pytest.raises(NotADatasetError, match="it is a file; a dataset is a folder"):
        shardkit.write_summary(str(tmp_path / "job.yaml"))


def test_a_server_that_cannot_be_reached_is_not_called_a_missing_path(tmp_path: Path) -> None:
    """fsspec's HTTP `exists` answers False for a refused connection: "the path does not exist" sent
    users looking for a typo while the server was down. A real server's 404 is still "does not exist"."""
    import functools
    import http.server
    import socket
    import threading

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/train"
    for call in (lambda: shardkit.open_dataset(url), lambda: shardkit.make_reader(url),
                 lambda: shardkit.write_summary(url)):
        with pytest.raises(DatasetError, match=rf"cannot reach '{url}' \(ClientConnectorError: .*check the "
                                               "host and port") as info:
            call()
        assert not isinstance(info.value, DatasetNotFoundError)

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            with pytest.raises(DatasetNotFoundError, match="the path does not exist"):
                shardkit.open_dataset(f"http://127.0.0.1:{server.server_address[1]}/missing")
        finally:
            server.shutdown()


# --- a bucket that does not exist ----------------------------------------------------------------------


def test_a_missing_bucket_is_named_where_a_missing_path_is_not(s3_server: S3Server, s3_bucket: str) -> None:
    """Reading from a bucket that does not exist said "the path does not exist", sending users to look
    for a typo in the folder; it names the bucket now, as a write does. A missing folder in a bucket
    that exists still says the path."""
    options = s3_server.storage_options
    url = f"s3://missing-{s3_bucket}/train/ds"
    for call in (lambda: shardkit.open_dataset(url, storage_options=options),
                 lambda: shardkit.make_reader(url, storage_options=options)):
        with pytest.raises(DatasetNotFoundError, match=rf"no dataset at '{url}': the bucket 's3://missing-"
                                                       rf"{s3_bucket}' does not exist, or these credentials "
                                                       r"cannot see it\. Check the bucket's name"):
            call()
    with pytest.raises(DatasetNotFoundError, match=rf"no dataset at 's3://{s3_bucket}/no': the path does "
                                                   r"not exist\. Check the URL"):
        shardkit.open_dataset(f"s3://{s3_bucket}/no", storage_options=options)
    with pytest.raises(shardkit.errors.DatasetNotFoundError, match=rf"the bucket 's3://missing-{s3_bucket}' "
                                                                    r"does not exist"):
        shardkit.write_dataset({"x": [1]}, url, storage_options=options)  # as writes said it already
