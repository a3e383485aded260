"""Bad input to the reader: each raises a `ReaderError` (or a dataset error) that names what is wrong."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.errors import CorruptDatasetError, DatasetNotFoundError, ReaderError
from tests.reader.datasets import ids_of, write_ids


@pytest.fixture(scope="module")
def ids_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", 200, row_group_size=23)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"shard": 2, "num_shards": 2}, ["shard=2", "num_shards=2", "rank"]),
        ({"shard": 5, "num_shards": 3}, ["shard=5", "[0, num_shards=3)"]),
        ({"shard": -1, "num_shards": 3}, ["shard=-1"]),
        ({"shard": 0, "num_shards": 0}, ["num_shards=0", "positive"]),
        ({"shard": 0, "num_shards": -2}, ["num_shards=-2"]),
        ({"shard": 1.0, "num_shards": 2}, ["shard=1.0", "int"]),
        ({"batch_size": -4}, ["batch_size=-4", ">= 1"]),
        ({"batch_size": 0}, ["batch_size=0"]),
        ({"seed": -1}, ["seed=-1", ">= 0"]),
        ({"workers": -1}, ["workers=-1"]),
        ({"workers": 0}, ["workers=0"]),
        ({"prefetch": -1}, ["prefetch=-1", ">= 0"]),
        ({"num_epochs": 0}, ["num_epochs=0"]),
        ({"shuffle_buffer": 0}, ["shuffle_buffer=0"]),
        ({"remainder": "even"}, ["remainder='even'", "'drop'", "'uneven'"]),
        ({"on_error": "ignore"}, ["on_error='ignore'", "'skip'"]),
        ({"shard": 0, "num_shards": 201}, ["num_shards=201", "200 samples", "fewer shards"]),
        ({"shard": 1, "num_shards": 4, "batch_size": 51, "drop_last": True},
         ["shard 1 of 4", "50 samples", "batch_size=51", "drop_last=True"]),
        ({"shard": 0, "num_shards": 3, "filter": pc.field("id") < 0}, ["no samples", "filter", "(id < 0)"]),
        ({"shard": 0, "num_shards": 21, "filter": pc.field("id") < 20},
         ["num_shards=21", "20 samples", "matching the filter"]),
        ({"columns": ["id", "nope"]}, ["unknown column", "'nope'", "'label'"]),
        ({"columns": "id"}, ["columns='id'", "list"]),
        ({"columns": []}, ["columns=[]"]),
        ({"filter": pc.field("nope") > 1}, ["nope", "does not apply", "'label'"]),
        ({"filter": [("nope", "=", 1)]}, ["nope"]),
        ({"filter": pc.field("label") == "three"}, ["label", "does not apply", "type"]),
        ({"filter": [("group", ">", 3)]}, ["group", "does not apply"]),
        ({"filter": 5}, ["filter=5", "tuples"]),
        ({"filter": [("label", "<")]}, ["tuples"]),
    ],
)
def test_bad_arguments(ids_ds: str, kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ReaderError) as info:
        shardkit.make_reader(ids_ds, **kwargs)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_arguments_are_checked_before_the_dataset_is_opened(tmp_path: Path) -> None:
    with pytest.raises(ReaderError, match="batch_size=0"):
        shardkit.make_reader(tmp_path / "nothing-here", batch_size=0)


def test_nonexistent_url(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="no dataset at") as info:
        shardkit.make_reader(tmp_path / "nothing-here")
    assert "nothing-here" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize(
    "state",
    [
        None,
        "epoch 3",
        [],
        {},
        {"version": 99},
        {"version": 1},
        {"version": 1, "history": "abc"},
    ],
)
def test_load_state_dict_of_garbage(ids_ds: str, state: Any) -> None:
    reader = shardkit.make_reader(ids_ds, batch_size=10)
    with pytest.raises(ReaderError, match="state"):
        reader.load_state_dict(state)


@pytest.mark.parametrize(
    "change",
    [
        {"history": "abc"},
        {"history": [[2]]},
        {"history": [["2", "x"]]},
        {"history": [[2, -1]]},
        {"history": [[0, 3]]},
        {"history": [[2, 1.5]]},
        {"epoch": -1},
        {"epoch": "1"},
        {"epoch": None},
    ],
)
def test_load_state_dict_of_a_damaged_state(ids_ds: str, change: dict[str, Any]) -> None:
    reader = shardkit.make_reader(ids_ds, batch_size=10)
    state = {**reader.state_dict(), **change}
    with pytest.raises(ReaderError):
        reader.load_state_dict(state)
    # the failed load left the reader as it was
    assert reader.epoch == 0
    assert len(ids_of(reader)) == 200


# ---- corrupt data found mid-epoch -------------------------------------------------------------------
def corrupt_column_chunk(url: str, file: str, row_group: int) -> None:
    """Overwrite the first page header of ``row_group``'s first column chunk with garbage (mid-file)."""
    path = os.path.join(url, file)
    chunk = pq.read_metadata(path).row_group(row_group).column(0)
    offset = chunk.dictionary_page_offset or chunk.data_page_offset
    assert 4 < offset < os.path.getsize(path) - 100  # in the middle of the file
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 32)


@pytest.fixture
def corrupt_ds(tmp_path: Path) -> tuple[str, str, int, int]:
    """A 4-file dataset whose second file has a corrupt row group 1: (url, file, its rows, the ids in it)."""
    url = write_ids(tmp_path / "ds", 500, row_group_size=23)
    ds = shardkit.open_dataset(url)
    assert len(ds.files) >= 3
    file = ds.files[1]
    corrupt_column_chunk(url, file, 1)
    i = next(k for k, rg in enumerate(ds.row_groups) if rg.file == file and rg.index == 1)
    return url, file, ds.row_groups[i].num_rows, i


def test_corrupt_row_group_raises_naming_file_and_row_group(corrupt_ds: tuple[str, str, int, int]) -> None:
    url, file, _, _ = corrupt_ds
    delivered: list[int] = []

    def read_all(reader: shardkit.Reader) -> None:
        for batch in reader:
            delivered.append(len(batch["id"]))

    reader = shardkit.make_reader(url, batch_size=10, shuffle=False)  # opens: the index is fine
    with reader, pytest.raises(CorruptDatasetError) as info:
        read_all(reader)
    assert sum(delivered) > 0, "the error should come mid-epoch, after rows were delivered"
    message = str(info.value)
    assert file in message
    assert "row group 1" in message
    assert "on_error='skip'" in message
    assert isinstance(info.value, OSError)


def test_corrupt_row_group_skipped(corrupt_ds: tuple[str, str, int, int]) -> None:
    url, file, rows, index = corrupt_ds
    first = int(sum(shardkit.open_dataset(url).rows_per_group[:index]))
    lost = set(range(first, first + rows))
    readers = [shardkit.make_reader(url, shard=s, num_shards=2, batch_size=10, on_error="skip",
                                    remainder="uneven", shuffle_buffer=40) for s in range(2)]
    with pytest.warns(UserWarning, match=r"skipped 1 corrupt row group.*row group 1 of") as record:
        ids = np.concatenate([ids_of(r) for r in readers])
    assert file in str(record[0].message)
    assert sorted(ids.tolist()) == sorted(set(range(500)) - lost)
    assert sum(r.stats["skipped_row_groups"] for r in readers) >= 1
    assert all(r.epoch == 1 for r in readers)  # the epochs completed

    with shardkit.make_reader(url, batch_size=10, on_error="skip", num_epochs=2, shuffle_buffer=40) as reader:
        for epoch in range(2):
            with pytest.warns(UserWarning, match=f"epoch {epoch}: skipped 1 corrupt"):
                ids = ids_of(reader.iter_epoch())
            assert sorted(ids.tolist()) == sorted(set(range(500)) - lost)
            assert reader.stats["skipped_row_groups"] == epoch + 1  # once per epoch it was met


def test_skipped_rows_are_not_read_again_on_resume(corrupt_ds: tuple[str, str, int, int]) -> None:
    url, _, rows, _ = corrupt_ds
    reader = shardkit.make_reader(url, batch_size=10, shuffle=False, on_error="skip")
    it = iter(reader)
    got = [next(it)["id"] for _ in range(20)]  # past the corrupt row group (rows 184..206)
    state = reader.state_dict()
    resumed = shardkit.make_reader(url, batch_size=10, shuffle=False, on_error="skip")
    resumed.load_state_dict(state)
    reader.close()
    assert list(it) == []  # the closed reader's iteration ends (before the end of the epoch: no warning)
    rest = ids_of(resumed)  # starts past the corrupt row group: nothing skipped, nothing repeated
    ids = np.concatenate([*got, rest])
    assert len(ids) == len(set(ids.tolist())) == 500 - rows


def test_truncated_file_raises_naming_file_and_row_group(tmp_path: Path) -> None:
    """A data file cut in half: the row groups still whole in it are read (the ``_metadata`` summary
    says where they are), the first one that is not raises naming the file and row group; skipping
    loses exactly the row groups the cut reached."""
    url = write_ids(tmp_path / "ds", 500, row_group_size=23)
    ds = shardkit.open_dataset(url)
    path = os.path.join(url, ds.files[2])
    size = os.path.getsize(path) // 2
    with open(path, "r+b") as f:
        f.truncate(size)
    assert ds.metadata is not None
    cut = []  # (global index, index in the file) of the row groups that reach past the cut
    for k, rg in enumerate(ds.row_groups):
        meta = ds.metadata.row_group(k)
        chunks = [meta.column(j) for j in range(meta.num_columns)]
        end = max((c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size for c in chunks)
        if rg.file == ds.files[2] and end > size:
            cut.append((k, rg.index))
    assert cut
    reader = shardkit.make_reader(url, batch_size=10, shuffle=False)
    with reader, pytest.raises(CorruptDatasetError) as info:
        list(reader)
    assert ds.files[2] in str(info.value)
    assert f"row group {cut[0][1]} of" in str(info.value)
    with shardkit.make_reader(url, batch_size=10, shuffle=False, on_error="skip") as reader:
        with pytest.warns(UserWarning, match="skipped"):
            ids = ids_of(reader)
        lost = sum(ds.row_groups[k].num_rows for k, _ in cut)
        assert len(ids) == len(set(ids.tolist())) == 500 - lost
        assert reader.stats["skipped_row_groups"] == len(cut)
