"""Exactly-once under repetition: 1,000 epochs, several shard counts and thread settings, none short.

Petastorm's thread pool ended 9 of 20 epochs early without an error (ANCHORS.md). Here every epoch of
every configuration must yield each sample exactly once over its shards (``remainder="uneven"``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import shardkit
from tests.reader.datasets import assert_exactly_once, write_ids

pytestmark = pytest.mark.slow

N_ROWS = 120
# (num_shards, workers, prefetch, batch_size, epochs): 1,000 epochs in total
CONFIGS = [
    (1, 1, 0, 16, 125),
    (1, 4, 8, 7, 125),
    (2, 2, 1, 10, 125),
    (2, 3, 4, 32, 125),
    (3, 1, 8, 5, 125),
    (3, 4, 2, 11, 125),
    (4, 2, 0, 8, 125),
    (4, 4, 6, 3, 125),
]


@pytest.fixture(scope="module")
def ids_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", N_ROWS, row_group_size=9)


def test_configurations_add_up_to_1000_epochs() -> None:
    assert sum(c[-1] for c in CONFIGS) == 1000


@pytest.mark.parametrize(("num_shards", "workers", "prefetch", "batch_size", "epochs"), CONFIGS)
def test_every_epoch_is_complete_and_has_no_duplicates(ids_ds: str, num_shards: int, workers: int,
                                                       prefetch: int, batch_size: int, epochs: int) -> None:
    seen = [Counter[int]() for _ in range(epochs)]
    batches = [[0] * num_shards for _ in range(epochs)]
    for shard in range(num_shards):
        with shardkit.make_reader(ids_ds, shard=shard, num_shards=num_shards, batch_size=batch_size,
                                  remainder="uneven", workers=workers, prefetch=prefetch, shuffle_buffer=25,
                                  seed=13, num_epochs=epochs) as reader:
            for batch in reader:
                seen[reader.epoch].update(batch["id"].tolist())
                batches[reader.epoch][shard] += 1
            assert reader.epoch == epochs
            per_epoch = len(reader)
        assert all(b[shard] == per_epoch for b in batches), f"shard {shard}: an epoch of another length"
    for epoch, counts in enumerate(seen):
        try:
            assert_exactly_once(counts.elements(), N_ROWS)
        except AssertionError as e:
            raise AssertionError(f"epoch {epoch}: {e}") from e


def test_epochs_differ_but_repeat_with_the_seed(tmp_path: Path) -> None:
    url = write_ids(tmp_path / "ds", N_ROWS, row_group_size=9)

    def orders(seed: int) -> list[list[int]]:
        with shardkit.make_reader(url, batch_size=N_ROWS, seed=seed, num_epochs=5,
                                  shuffle_buffer=25) as reader:
            return [b["id"].tolist() for b in reader]

    first = orders(1)
    assert len({tuple(o) for o in first}) == 5
    assert orders(1) == first
    assert orders(2) != first
