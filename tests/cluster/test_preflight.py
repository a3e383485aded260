"""Before a job starts: the logdir lock (one run per logdir, torchrun nodes sharing one), an uncreatable
logdir, and a local data.url that holds no dataset."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.cluster.config import JobConfig
from shardkit.cluster.preflight import LogdirLock, check_local_data, prepare_logdir
from shardkit.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, **changes: Any) -> JobConfig:
    data = {"name": "pre", "entrypoint": str(REPO / "tests" / "trainer" / "scripts" / "behave.py"),
            "framework": "tensorflow", "roles": {"worker": {"count": 1}}, "logdir": str(tmp_path / "job"),
            **changes}
    return JobConfig.from_dict(data)


def test_one_run_per_logdir_and_the_message_names_the_holder(tmp_path: Path) -> None:
    job = config(tmp_path)
    first = prepare_logdir(job, clear=[])
    try:
        (tmp_path / "job" / "logs").mkdir()
        with pytest.raises(ConfigError) as info:
            prepare_logdir(job, clear=[tmp_path / "job" / "logs"])
        message = str(info.value)
        for word in ("logdir", str(tmp_path / "job"), f"pid {os.getpid()}", "wait until that run ends",
                     f"--set logdir={tmp_path / 'job'}-2"):
            assert word in message, (word, message)
        assert (tmp_path / "job" / "logs").is_dir()  # refused before clearing anything
    finally:
        first.release()
    prepare_logdir(job, clear=[tmp_path / "job" / "logs"]).release()  # free again once released
    assert not (tmp_path / "job" / "logs").exists()


def test_torchrun_nodes_share_a_logdir_but_not_a_node_rank_nor_with_a_local_run(tmp_path: Path) -> None:
    job = config(tmp_path)
    (tmp_path / "job").mkdir()
    nodes = [LogdirLock(job, node=0), LogdirLock(job, node=1)]
    try:
        with pytest.raises(ConfigError, match="another `shardkit train`"):
            LogdirLock(job, node=1)
        with pytest.raises(ConfigError, match="another `shardkit train`"):
            LogdirLock(job)  # a local run wants the logdir to itself
    finally:
        for lock in nodes:
            lock.release()
    local = LogdirLock(job)
    try:
        with pytest.raises(ConfigError, match="another `shardkit train`"):
            LogdirLock(job, node=0)
    finally:
        local.release()


@pytest.mark.parametrize("where", ["under_a_file", "job_json_unwritable"])
def test_a_logdir_that_cannot_be_created_or_written_is_a_config_error(tmp_path: Path, where: str) -> None:
    """A logdir under a file cannot be created; one where job.json cannot be written (a folder of that
    name: what a read-only folder does, also as root, which writes into read-only folders) fails after
    the lock was taken, and must let it go."""
    if where == "under_a_file":
        (tmp_path / "afile").write_text("x")
        logdir = tmp_path / "afile" / "job"
    else:
        logdir = tmp_path / "job"
        (logdir / "job.json").mkdir(parents=True)
    with pytest.raises(ConfigError) as info:
        prepare_logdir(config(tmp_path, logdir=str(logdir)), clear=[])
    message = str(info.value)
    for word in ("logdir", str(logdir), "cannot create it or write in it", "Fix:", "--set logdir="):
        assert word in message, (word, message)
    assert isinstance(info.value.__cause__, OSError)
    if where == "job_json_unwritable":  # the lock was released: the next run gets it
        (logdir / "job.json").rmdir()
        prepare_logdir(config(tmp_path, logdir=str(logdir)), clear=[]).release()


def test_a_local_data_url_must_hold_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    for url, why in [(tmp_path / "missing", "does not exist"), (tmp_path / "empty", "no Parquet data"),
                     (tmp_path / "afile", "is a file")]:
        with pytest.raises(ConfigError) as info:
            check_local_data(config(tmp_path, data={"url": str(url)}))
        message = str(info.value)
        for word in ("data.url", str(url), why, "Fix: point data.url at the dataset's folder"):
            assert word in message, (word, message)
    ds = shardkit.write_dataset({"x": np.arange(4)}, str(tmp_path / "ds"))
    check_local_data(config(tmp_path, data={"url": ds.url}))
    check_local_data(config(tmp_path, data={"url": f"file://{ds.url}"}))
    check_local_data(config(tmp_path, data={"url": "s3://bucket/nowhere"}))  # remote: the roles' business
    check_local_data(config(tmp_path))  # no data section
