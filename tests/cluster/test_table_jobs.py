"""``shardkit train`` on a Delta and an Iceberg table (``data.url`` the table's folder): every role reads
one snapshot, the one the job opened before its roles started, even when the table moves on while they
start; ``data.options.version`` time-travels. The role is ``tests/cluster/scripts/table_reader.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardkit.cluster import run_job
from shardkit.job.config import load_config
from tests.dataset.tables import History, make_history
from tests.trainer.scripts import proctree

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "tests" / "cluster" / "scripts" / "table_reader.py"
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


def _job(folder: Path, history: History, *, options: dict[str, Any] | None = None, move_on: bool = False,
         workers: int = 2) -> list[dict[str, Any]]:
    config = {
        "name": "table", "entrypoint": str(ROLE), "framework": "tensorflow", "strategy": "allreduce",
        "roles": {"worker": {"count": workers}}, "logdir": str(folder / "job"),
        "data": {"url": history.url, "batch_size": 16, "seed": 3, "options": {"remainder": "uneven",
                                                                              **(options or {})}},
        "fault_tolerance": {"max_restarts": 0, "startup_timeout": 120.0},
        "params": {"move_on": move_on},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_job(load_config(path), echo=False)
    assert result.ok, result.format()
    return [json.loads((folder / "job" / f"ids-{i}.json").read_text()) for i in range(workers)]


def _exactly(shards: list[dict[str, Any]], ids: set[int]) -> None:
    got = [i for shard in shards for i in shard["ids"]]
    assert len(got) == len(set(got)), "an id was read twice"
    assert set(got) == ids


def test_every_role_reads_the_snapshot_the_job_opened_though_the_table_moves_on(tmp_path: Path) -> None:
    history = make_history("delta", tmp_path / "t", [("append", 200), ("delete", 40), ("append", 60)])
    opened = history.current
    shards = _job(tmp_path, history, move_on=True)  # worker 0 commits 50 rows before opening its reader
    assert history.version() > opened, "the role did not move the table on"
    _exactly(shards, history.ids(opened))
    assert {s["version"] for s in shards} == {opened}  # pinned in data.options for every role


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_data_options_version_reads_an_older_snapshot(fmt: str, tmp_path: Path) -> None:
    history = make_history(fmt, tmp_path / "t", [("append", 150), ("overwrite", 70), ("append", 30)])
    first = next(iter(history.snapshots))
    shards = _job(tmp_path, history, options={"version": first})
    _exactly(shards, history.ids(first))
