"""A reader's batches written back (dicts of numpy columns): batches of rows, or refused when ambiguous."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.dataset import Field, Schema
from shardkit.errors import SchemaError
from tests.dataset.tables import make_history, read_ids


def test_a_readers_batches_round_trip_through_write_dataset(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    shardkit.write_dataset({"id": np.arange(1000), "v": np.arange(3000, dtype=np.float32).reshape(1000, 3)},
                           src)
    with shardkit.make_reader(src, batch_size=64, seed=2) as reader:
        out = shardkit.write_dataset(iter(reader), tmp_path / "dst", schema=reader.schema)
    assert out.num_rows == 1000
    assert out.schema["id"].shape == ()
    assert out.schema["v"].shape == (3,)
    ids = read_ids(str(tmp_path / "dst"), columns=["id"])
    assert sorted(ids) == list(range(1000))
    with shardkit.make_reader(str(tmp_path / "dst"), shuffle=False, batch_size=1000) as reader:
        batch = next(iter(reader))
    assert (batch["v"][:, 0] == batch["id"] * 3).all()


def test_a_tables_batches_round_trip(tmp_path: Path) -> None:
    import deltalake  # noqa: F401
    history = make_history("delta", tmp_path / "t", [("append", 300), ("overwrite", 120)])
    with shardkit.make_reader(history.url, batch_size=50) as reader:
        shardkit.write_dataset(iter(reader), tmp_path / "copy", schema=reader.schema)
    assert sorted(read_ids(str(tmp_path / "copy"))) == sorted(history.ids())


def test_numpy_columns_without_a_schema_are_refused_naming_both_readings(tmp_path: Path) -> None:
    batches = iter([{"id": np.arange(50)}, {"id": np.arange(50, 100)}])
    with pytest.raises(SchemaError) as e:
        shardkit.write_dataset(batches, tmp_path / "ds")
    text = str(e.value)
    assert "one row whose field 'id' is a int64[50] tensor" in text
    assert "a batch of 50 rows" in text
    assert "schema=reader.schema" in text
    assert not (tmp_path / "ds").exists() or not list((tmp_path / "ds").glob("*.parquet"))


def test_the_schema_decides_row_of_tensors_or_batch(tmp_path: Path) -> None:
    items = [{"v": np.full(4, i, np.float32)} for i in range(5)]
    tensors = Schema([Field("v", "float32", (4,))])
    rows = shardkit.write_dataset(iter(items), tmp_path / "rows", schema=tensors)
    assert rows.num_rows == 5
    batch = shardkit.write_dataset(iter(items), tmp_path / "batch", schema=Schema([Field("v", "float32")]))
    assert batch.num_rows == 20


def test_rows_with_scalars_and_arrays_of_other_lengths_stay_rows(tmp_path: Path) -> None:
    rows = [{"id": i, "v": np.zeros(3)} for i in range(4)] + [{"id": 9, "v": np.zeros(3)}]
    assert shardkit.write_dataset(iter(rows), tmp_path / "a").num_rows == 5
    mixed = [{"a": np.zeros(3), "b": np.zeros(2)} for _ in range(4)]
    assert shardkit.write_dataset(iter(mixed), tmp_path / "b").num_rows == 4


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_shardkit_write_converts_a_table_at_its_current_snapshot(tmp_path: Path, fmt: str) -> None:
    importlib.import_module("deltalake" if fmt == "delta" else "pyiceberg")  # installed by [dev]
    from shardkit.dataset.convert import convert

    history = make_history(fmt, tmp_path / "t", [("append", 300), ("overwrite", 120), ("append", 7)])
    convert(history.url, tmp_path / "copy")
    assert sorted(read_ids(str(tmp_path / "copy"))) == sorted(history.ids())
