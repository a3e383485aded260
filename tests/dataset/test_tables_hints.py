"""``schema=`` hints for columns of data shardkit did not write: Spark-style list tensors and binary
images in plain Parquet folders and tables, and hints that do not fit (named, with the fix)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import shardkit
from shardkit.dataset import Field
from shardkit.dataset.codecs import ImageCodec
from shardkit.errors import SchemaError, SchemaMismatchError


def png(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), value, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def spark_like(n: int, length: int = 6) -> pa.Table:
    return pa.table({
        "id": pa.array(range(n), pa.int64()),
        "emb": pa.array([[float(i)] * length for i in range(n)], pa.list_(pa.float32())),
        "img": pa.array([png(i % 250) for i in range(n)], pa.binary()),
    })


HINTS = [Field("emb", "float32", (2, 3)), Field("img", "uint8", (4, 4, 3), codec=ImageCodec("png"))]


def check_batch(url: str) -> None:
    with shardkit.make_reader(url, schema=HINTS, shuffle=False, batch_size=50, remainder="uneven") as reader:
        assert reader.schema["emb"].shape == (2, 3)
        batch = next(iter(reader))
    ids = batch["id"]
    assert batch["emb"].shape == (len(ids), 2, 3)
    assert (batch["emb"][:, 1, 2] == ids).all()
    assert batch["img"].shape == (len(ids), 4, 4, 3)
    assert (batch["img"][:, 0, 0, 0] == ids % 250).all()


def test_hints_read_a_plain_folders_lists_as_tensors_and_bytes_as_images(tmp_path: Path) -> None:
    (tmp_path / "spark").mkdir()
    pq.write_table(spark_like(120), tmp_path / "spark" / "part-0.parquet")
    with pytest.warns(shardkit.SummaryMissingWarning):
        check_batch(str(tmp_path / "spark"))


def test_hints_read_a_delta_table(tmp_path: Path) -> None:
    import deltalake  # noqa: F401
    from deltalake import write_deltalake

    url = str(tmp_path / "t")
    write_deltalake(url, spark_like(120))
    check_batch(url)


def test_a_row_of_another_length_names_the_column_the_file_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "spark").mkdir()
    bad = pa.concat_tables([spark_like(10), spark_like(1, length=5)])
    pq.write_table(bad, tmp_path / "spark" / "part-0.parquet")
    with pytest.warns(shardkit.SummaryMissingWarning), shardkit.make_reader(
            str(tmp_path / "spark"), schema=HINTS[:1], batch_size=4) as reader, \
            pytest.raises(SchemaMismatchError) as e:
        list(reader)
    text = str(e.value)
    assert "'emb'" in text
    assert "part-0.parquet" in text
    assert "fix the hint's shape" in text


def test_a_hint_for_a_missing_column_or_a_wrong_type_is_refused(tmp_path: Path) -> None:
    (tmp_path / "spark").mkdir()
    pq.write_table(spark_like(10), tmp_path / "spark" / "part-0.parquet")
    url = str(tmp_path / "spark")
    with pytest.warns(shardkit.SummaryMissingWarning), \
            pytest.raises(SchemaError, match=r"'embedding' names no column.*\['id', 'emb', 'img'\]"):
        shardkit.open_dataset(url, schema=[Field("embedding", "float32", (6,))])
    with pytest.warns(shardkit.SummaryMissingWarning), \
            pytest.raises(SchemaError, match=r"'id' \(float32, shape \(3,\)"):
        shardkit.open_dataset(url, schema=[Field("id", "float32", (3,))])


def test_hints_are_refused_for_a_shardkit_dataset(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    shardkit.write_dataset({"id": np.arange(5)}, url)
    with pytest.raises(SchemaError, match="fields are stored"):
        shardkit.open_dataset(url, schema=[Field("id", "int64")])
