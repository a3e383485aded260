"""Rows deleted without rewriting their files: Delta's deletion vectors and Iceberg's position delete files
applied exactly (every shard, every version, filters, the cache, resume); Iceberg's equality deletes
refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deltalake  # noqa: F401  (installed by [dev]: a missing one is a broken install, not a skip)
import pytest

import shardkit
from shardkit.errors import CorruptDatasetError, UnsupportedTableError
from tests.dataset.tables import (
    DeltaHistory,
    History,
    IcebergHistory,
    add_deletion_vector,
    add_iceberg_deletes,
    read_ids,
)


def _with_deletes(fmt: str, path: Path) -> tuple[History, set[int]]:
    """150 rows in three commits, the second followed by a commit that deletes rows of a file without
    rewriting it (Delta: a deletion vector, 6 rows; Iceberg: a position delete file, 5 rows)."""
    history: History = DeltaHistory(path, deletion_vectors=True) if fmt == "delta" else IcebergHistory(path)
    history.apply(("append", 100))
    history.apply(("append", 40))
    if isinstance(history, DeltaHistory):
        deleted = add_deletion_vector(history)
    else:
        assert isinstance(history, IcebergHistory)
        deleted = add_iceberg_deletes(history)
    history.apply(("append", 10))  # the table moves on; the deletes stay
    return history, deleted


@pytest.fixture(scope="module", params=["delta", "iceberg"])
def table(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[History, set[int]]:
    return _with_deletes(request.param, tmp_path_factory.mktemp(request.param) / "t")


def test_deleted_rows_are_never_read(table: tuple[History, set[int]]) -> None:
    history, deleted = table
    ids = read_ids(history.url, shuffle=True, seed=4)
    assert sorted(ids) == sorted(history.ids())
    assert not deleted & set(ids)
    assert shardkit.open_dataset(history.url).num_rows == 150 - len(deleted)


def test_the_version_before_the_vector_has_the_rows(table: tuple[History, set[int]]) -> None:
    history, deleted = table
    before = list(history.snapshots)[1]
    ids = read_ids(history.url, version=before)
    assert deleted <= set(ids)
    assert len(ids) == 140


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_shards_without_the_deleted_rows_are_orthogonal_and_complete(
        table: tuple[History, set[int]], num_shards: int) -> None:
    history, _ = table
    seen: list[int] = []
    for shard in range(num_shards):
        seen += read_ids(history.url, shard=shard, num_shards=num_shards, shuffle=True, seed=9, batch_size=5)
    assert sorted(seen) == sorted(history.ids())


def test_a_filter_counts_the_kept_rows_only(table: tuple[History, set[int]]) -> None:
    history, deleted = table
    lo, hi = min(deleted) - 2, max(deleted) - 5  # some deleted rows inside, the last one outside
    ids = read_ids(history.url, filter=[("id", ">=", lo), ("id", "<", hi)])
    assert sorted(ids) == sorted(i for i in history.ids() if lo <= i < hi)
    assert deleted & set(range(lo, hi))


def test_the_row_group_cache_keeps_versions_apart(table: tuple[History, set[int]],
                                                  tmp_path: Path) -> None:
    history, deleted = table
    before = list(history.snapshots)[1]
    cache = str(tmp_path / "cache")
    assert deleted <= set(read_ids(history.url, version=before, cache=cache))
    assert not deleted & set(read_ids(history.url, cache=cache))
    assert deleted <= set(read_ids(history.url, version=before, cache=cache))


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_resume_on_the_version_with_the_deletes_after_the_table_moved_on(fmt: str, tmp_path: Path) -> None:
    history, _ = _with_deletes(fmt, tmp_path / "t")
    pinned, expected = history.current, history.ids()
    kw: dict[str, Any] = {"batch_size": 8, "seed": 3, "remainder": "uneven"}
    with shardkit.make_reader(history.url, shard=0, num_shards=2, **kw) as a, \
            shardkit.make_reader(history.url, shard=1, num_shards=2, **kw) as b:
        ia, ib = iter(a), iter(b)
        seen = [int(i) for _ in range(2) for it in (ia, ib) for i in next(it)["id"]]
        state = a.state_dict()
    history.apply(("overwrite", 30))
    for shard in range(3):
        with shardkit.make_reader(history.url, shard=shard, num_shards=3, **kw) as r:
            r.load_state_dict(state)
            assert r.dataset.snapshot is not None
            assert r.dataset.snapshot.version == pinned
            seen += [int(i) for batch in r for i in batch["id"]]
    assert sorted(seen) == sorted(expected)


def test_iceberg_reads_what_pyiceberg_itself_reads(tmp_path: Path) -> None:
    """The delete file written by the fixture is one pyiceberg's own scan applies: the same ids."""
    history, deleted = _with_deletes("iceberg", tmp_path / "t")
    assert isinstance(history, IcebergHistory)
    theirs = history.catalog.load_table("ns.t").scan().to_arrow().column("id").to_pylist()
    assert sorted(theirs) == sorted(read_ids(history.url)) == sorted(history.ids())
    assert not deleted & set(theirs)


def test_iceberg_equality_deletes_are_refused_with_the_snapshot_and_the_fix(tmp_path: Path) -> None:
    history = IcebergHistory(tmp_path / "t")
    history.apply(("append", 60))
    before = history.current
    add_iceberg_deletes(history, equality=True)
    with pytest.raises(UnsupportedTableError) as e:
        shardkit.open_dataset(history.url)
    text = str(e.value)
    assert f"at snapshot {history.current}" in text
    assert "equality delete files" in text
    assert "rewrite_data_files" in text
    assert len(read_ids(history.url, version=before)) == 60  # the snapshot before it still reads


def test_an_iceberg_delete_past_the_end_of_its_file_is_corrupt(tmp_path: Path) -> None:
    history = IcebergHistory(tmp_path / "t")
    history.apply(("append", 40))
    add_iceberg_deletes(history, rows=(3, 40))  # the file has rows 0..39
    with pytest.raises(CorruptDatasetError, match=r"deletes row 40 of .* which has 40 rows"):
        shardkit.open_dataset(history.url)


def test_a_missing_iceberg_delete_file_is_named(tmp_path: Path) -> None:
    history = IcebergHistory(tmp_path / "t")
    history.apply(("append", 40))
    add_iceberg_deletes(history)
    for f in (Path(history.url) / "data").glob("deletes-*.parquet"):
        f.unlink()
    with pytest.raises(CorruptDatasetError, match=r"position delete file .*deletes-.* cannot be read"):
        shardkit.open_dataset(history.url)
