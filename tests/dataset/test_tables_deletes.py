"""Rows deleted without rewriting their files: Delta's deletion vectors applied exactly (every shard, every
version, the cache, resume); Iceberg's delete files refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deltalake  # noqa: F401  (installed by [dev]: a missing one is a broken install, not a skip)
import pytest

import shardkit
from tests.dataset.tables import DeltaHistory, add_deletion_vector, read_ids


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> tuple[DeltaHistory, set[int]]:
    history = DeltaHistory(tmp_path_factory.mktemp("dv") / "t", deletion_vectors=True)
    history.apply(("append", 100))
    history.apply(("append", 40))
    deleted = add_deletion_vector(history)
    history.apply(("append", 10))  # the table moves on; the vector stays
    return history, deleted


def test_deleted_rows_are_never_read(table: tuple[DeltaHistory, set[int]]) -> None:
    history, deleted = table
    ids = read_ids(history.url, shuffle=True, seed=4)
    assert sorted(ids) == sorted(history.ids())
    assert not deleted & set(ids)
    assert shardkit.open_dataset(history.url).num_rows == 150 - 6


def test_the_version_before_the_vector_has_the_rows(table: tuple[DeltaHistory, set[int]]) -> None:
    history, deleted = table
    before = list(history.snapshots)[1]
    ids = read_ids(history.url, version=before)
    assert deleted <= set(ids)
    assert len(ids) == 140


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_shards_without_the_deleted_rows_are_orthogonal_and_complete(
        table: tuple[DeltaHistory, set[int]], num_shards: int) -> None:
    history, _ = table
    seen: list[int] = []
    for shard in range(num_shards):
        seen += read_ids(history.url, shard=shard, num_shards=num_shards, shuffle=True, seed=9, batch_size=5)
    assert sorted(seen) == sorted(history.ids())


def test_a_filter_counts_the_kept_rows_only(table: tuple[DeltaHistory, set[int]]) -> None:
    history, deleted = table
    lo, hi = min(deleted) - 2, max(deleted) - 5  # some deleted rows inside, the last one outside
    ids = read_ids(history.url, filter=[("id", ">=", lo), ("id", "<", hi)])
    assert sorted(ids) == sorted(i for i in history.ids() if lo <= i < hi)
    assert deleted & set(range(lo, hi))


def test_the_row_group_cache_keeps_versions_apart(table: tuple[DeltaHistory, set[int]],
                                                  tmp_path: Path) -> None:
    history, deleted = table
    before = list(history.snapshots)[1]
    cache = str(tmp_path / "cache")
    assert deleted <= set(read_ids(history.url, version=before, cache=cache))
    assert not deleted & set(read_ids(history.url, cache=cache))
    assert deleted <= set(read_ids(history.url, version=before, cache=cache))


def test_resume_on_the_version_with_the_vector_after_the_table_moved_on(tmp_path: Path) -> None:
    history = DeltaHistory(tmp_path / "t", deletion_vectors=True)
    history.apply(("append", 100))
    add_deletion_vector(history)
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
