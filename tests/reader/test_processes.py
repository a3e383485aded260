"""Real reader processes (spawned, as a launcher starts them) each read their shard of one dataset."""

from __future__ import annotations

import multiprocessing
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.reader.datasets import assert_exactly_once, read_shard_ids, write_ids

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

N_ROWS = 1000


@pytest.fixture(scope="module")
def ids_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", N_ROWS, row_group_size=37)


def run_shards(url: str, world: int, *, remainder: str, from_env: bool) -> list[tuple[list[int], int]]:
    """Each rank in its own spawned process: ``make_reader(url, shard=rank, num_shards=world)``, or with
    ``from_env`` ``make_reader(url, shard=rank)`` under ``WORLD_SIZE``/``RANK`` set in that process."""
    with ProcessPoolExecutor(max_workers=world, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = []
        for rank in range(world):
            if from_env:
                env = {"WORLD_SIZE": str(world), "RANK": str(rank)}
                futures.append(pool.submit(read_shard_ids, url, rank, None, 32, remainder, env))
            else:
                futures.append(pool.submit(read_shard_ids, url, rank, world, 32, remainder, None))
        return [f.result(timeout=100) for f in futures]


@pytest.mark.parametrize(("world", "remainder", "from_env"),
                         [(2, "drop", False), (3, "drop", False), (3, "uneven", False), (3, "pad", True)])
def test_reader_processes_split_the_dataset(ids_ds: str, world: int, remainder: str, from_env: bool) -> None:
    results = run_shards(ids_ds, world, remainder=remainder, from_env=from_env)
    per_rank = [ids for ids, _ in results]
    batches = [count for _, count in results]
    every = Counter(i for ids in per_rank for i in ids)
    if remainder == "uneven":
        assert_exactly_once(every.elements(), N_ROWS)
        assert max(batches) - min(batches) <= 1
        return
    assert len(set(batches)) == 1, f"ranks yield different numbers of batches: {batches}"
    assert len({len(ids) for ids in per_rank}) == 1
    if remainder == "drop":
        assert max(every.values()) == 1, "a sample went to two ranks"
        assert N_ROWS - len(every) == N_ROWS % world
    else:  # pad: every sample, fewer than `world` of them twice
        assert len(every) == N_ROWS
        assert sum(every.values()) - N_ROWS == -N_ROWS % world
