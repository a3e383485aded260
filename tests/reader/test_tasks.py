"""Tasks cut smaller than a row group (`split_tasks`): the same rows, in the same order, sooner.

The reader cuts the first window of each pass into tasks of about `TASK_BYTES` of decoded rows and
reads a row group slice by slice, as far as its tasks so far need, so the first batch does not wait
for a whole row group (Petastorm's 10,000-row PNG row groups took 0.4 s to the first batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.reader._plan import EpochOrder, shard_ranges, shard_windows, split_tasks
from tests.reader.datasets import ids_of, substitutes, with_substitutes, write_ids, write_layout
from tests.reader.test_plan import as_layout, emitted_ids, layouts
from tests.reader.test_reader_errors import corrupt_column_chunk

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])


@SETTINGS
@given(layouts, st.booleans(), st.integers(1, 60), st.integers(1, 5), st.data())
def test_cut_tasks_emit_the_same_rows(rows: list[int], shuffle: bool, task_rows: int, num_shards: int,
                                      data: st.DataObject) -> None:
    window = data.draw(st.integers(1, 90))
    order = EpochOrder(as_layout(rows), seed=3, epoch=1, shuffle=shuffle, window=window)
    shard = data.draw(st.integers(0, num_shards - 1))
    windows = shard_windows(order, shard_ranges(order.num_samples, shard=shard, num_shards=num_shards))
    first_rows = data.draw(st.none() | st.integers(1, 30))
    cut = split_tasks(windows, task_rows, first_rows)
    assert np.array_equal(emitted_ids(order, cut), emitted_ids(order, windows))
    for w in cut:
        for t in w.tasks:
            assert 0 < t.stop - t.start <= task_rows
            assert t.start // task_rows == (t.stop - 1) // task_rows  # cut at multiples of task_rows
        if not shuffle:
            assert len(w.tasks) == 1  # an unshuffled window is one task: its rows go out as it is read
    if first_rows and windows:
        head, whole = cut[0].tasks[0], windows[0].tasks[0]
        assert head.stop - head.start <= first_rows or head.stop - head.start == 0
        assert head.start == whole.start
    assert split_tasks(windows, None) == windows


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.booleans(), st.integers(1, 30),
       st.integers(1, 3), st.integers(0, 2**16))
def test_reader_with_cut_tasks_yields_what_it_yields_without(tmp_path_factory: pytest.TempPathFactory,
                                                             rows: list[int], shuffle: bool, task_rows: int,
                                                             workers: int, seed: int) -> None:
    url = write_layout(tmp_path_factory.mktemp("cut") / "ds", rows)

    def read(cut: int | None) -> np.ndarray:
        with shardkit.make_reader(url, batch_size=7, shuffle=shuffle, seed=seed, shuffle_buffer=25,
                                  workers=workers, remainder="uneven", num_epochs=2) as reader:
            reader.task_rows = cut
            return ids_of(reader)

    assert np.array_equal(read(task_rows), read(None))


def test_first_window_is_cut_and_later_ones_are_not(tmp_path: Path) -> None:
    url = write_ids(tmp_path / "ds", 400, row_group_size=100)
    with shardkit.make_reader(url, batch_size=10, shuffle=False) as reader:
        assert reader.task_rows is not None
        assert reader.task_rows % 256 == 0  # whole Parquet slices
        reader.task_rows = 30
        seen: list[tuple[int, int, int]] = []
        read = reader._source.read

        def spy(task, rows=None, **kw):  # type: ignore[no-untyped-def]
            seen.append((task.row_group, task.start, task.stop))
            return read(task, rows, **kw)

        reader._source.read = spy  # type: ignore[method-assign]
        assert np.array_equal(ids_of(reader), np.arange(400))
    first = [t for t in seen if t[0] == seen[0][0]]
    assert [t[2] - t[1] for t in first] == [30, 30, 30, 10]  # the first row group, in four tasks
    assert len(seen) == 4 + (len({t[0] for t in seen}) - 1)  # every later row group in one task


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_corrupt_row_group_fails_every_task_that_shares_it(tmp_path: Path, seed: int) -> None:
    """Tasks of one row group share its read; when it fails, each of them fails (or is skipped) alike,
    none gets the rows read before the failure as if they were all (the first, shuffled window spans
    every row group here, so all of them are cut into 7-row tasks)."""
    url = write_ids(tmp_path / "ds", 200, row_group_size=50, file_size=10**9)
    ds = shardkit.open_dataset(url)
    kw: dict[str, Any] = {"batch_size": 10, "seed": seed, "shuffle_buffer": 200, "remainder": "uneven"}
    with shardkit.make_reader(url, **kw) as reader:
        intact = ids_of(reader)
    corrupt_column_chunk(url, ds.files[0], 1)
    with shardkit.make_reader(url, on_error="skip", **kw) as reader:
        reader.task_rows = 7
        with pytest.warns(UserWarning, match="skipped 1 corrupt row group"):
            ids = ids_of(reader)
    # the rows 50..99 are lost, each in its place, which a readable row half an epoch on takes
    assert ids.tolist() == with_substitutes(intact, substitutes(intact, range(50, 100)))
    assert not set(ids.tolist()) & set(range(50, 100))


@pytest.mark.parametrize(("shuffle", "num_shards"), [(False, 1), (False, 2), (True, 1), (True, 3)])
def test_cut_tasks_still_cache_whole_row_groups(tmp_path: Path, shuffle: bool, num_shards: int) -> None:
    """With a cache, the first window's cut tasks read only as far as they need, but the last task of
    each row group reads it to its end: after one epoch every row group is cached whole, and the next
    epoch reads nothing from the source (shard edges inside the first window included)."""
    from shardkit.reader._cache import CacheConfig

    url = write_ids(tmp_path / "ds", 600, row_group_size=150, file_size=10**9)
    groups = len(shardkit.open_dataset(url).row_groups)
    config = CacheConfig(str(tmp_path / "cache"), 1 << 30)
    readers = [shardkit.make_reader(url, shard=shard, num_shards=num_shards, batch_size=10, shuffle=shuffle,
                                    shuffle_buffer=200, cache=config, num_epochs=2, remainder="uneven")
               for shard in range(num_shards)]
    for r in readers:
        r.task_rows = 40
    ids = [ids_of(r.iter_epoch()) for r in readers]  # every shard, one epoch: each row group read once
    reads = [r._source.remote_reads for r in readers]
    for r in readers:  # the next epoch (another order, other row groups per shard): all from the cache
        ids_of(r.iter_epoch())
        r.close()
    assert [r._source.remote_reads for r in readers] == reads
    assert sorted(np.concatenate(ids).tolist()) == list(range(600))
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == groups
