"""The ``spark`` engine on the shared local[2] session: the digits job in barrier mode, from a dataset the
same session materialized with `write_spark`; and a task's Python worker SIGKILLed mid-run.

The session is the session-scoped ``spark`` fixture of ``tests/conftest.py`` (local[2] on 127.0.0.1, the
executors on this interpreter): the engine uses an active session as it is, which is the point of the
first test (materialize, then train, in one session); it also saves a JVM start per test. Because that
JVM outlives each test, `proctree.reaped` (which kills every new descendant) cannot be used here; the
tests check and kill the job's own processes instead.
"""

from __future__ import annotations

import io
import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit import Field, Schema
from shardkit.cluster.engines import get_engine
from shardkit.cluster.engines.spark import check_master
from shardkit.cluster.monitor.report import JobResult
from shardkit.cluster.supervisor import Supervisor
from shardkit.errors import ConfigError, EngineUnreachableError, MissingDependencyError
from tests.cluster.test_ray import digits_config, kill_after_first_checkpoint
from tests.trainer.scripts import proctree

pytestmark = [
    # with pandas >= 3 installed, pyspark 4.3 warns from createDataFrame and mapInArrow
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
]

SCHEMA = Schema([Field("id", "int64"), Field("pixels", "float32", (8, 8)), Field("label", "int64"),
                 Field("split", "str")])


@pytest.fixture
def spark_digits(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """scikit-learn's digits written by the shared session (`write_spark`), laid out as make_digits does."""
    from sklearn.datasets import load_digits

    from shardkit.dataset.spark import write_spark

    digits = load_digits()
    n = len(digits.images)
    rows = [(i, (digits.images[i] / 16.0).reshape(-1).tolist(), int(digits.target[i]),
             "train" if i < n - 297 else "test") for i in range(n)]
    df = spark.createDataFrame(rows, "id long, pixels array<float>, label long, split string").repartition(2)
    url = str(tmp_path_factory.mktemp("data") / "digits")
    write_spark(df.orderBy("id"), url, schema=SCHEMA, row_group_size=128)
    return url


@pytest.fixture
def _job_processes(tmp_path: Path) -> Iterator[None]:
    """Kill whatever of this test's job is still running at its end, and fail if anything was."""
    yield
    left = {pid for pid in proctree.descendants(os.getpid())
            if f"SHARDKIT_JOB_DIR={tmp_path / 'job'}".encode() in _environ(pid)}
    proctree.kill(left)
    assert proctree.wait_gone(left, 5) == set()
    assert not left, f"job processes left behind (killed now): {sorted(left)}"


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def run(config: Any) -> tuple[JobResult, str]:
    engine = get_engine(config.engine.name, config.engine.options)
    console = io.StringIO()
    try:
        result = Supervisor(config, engine=engine, console=console).run()
    finally:
        engine.close()  # type: ignore[attr-defined]  # leaves the shared session running
    return result, console.getvalue()


def test_options_and_missing_pyspark(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"engine\.mastr = .*did you mean 'master'"):
        get_engine("spark", {"mastr": "local[2]"})
    with pytest.raises(ConfigError, match=r"engine\.conf = "):
        get_engine("spark", {"conf": "spark.executor.memory=4g"})
    monkeypatch.setitem(sys.modules, "pyspark", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'shardkit\[spark\]'"):
        get_engine("spark")


def test_a_standalone_master_must_answer_within_the_connect_timeout() -> None:
    """The check `SparkEngine.session` makes before it starts a session on a ``spark://`` master (across
    hosts: tests/multihost/test_spark.py)."""
    with pytest.raises(ConfigError, match=r"engine\.connect_timeout = -1"):
        get_engine("spark", {"master": "spark://127.0.0.1:7077", "connect_timeout": -1})
    with pytest.raises(ConfigError, match=r"engine\.slots_timeout = 0"):
        get_engine("spark", {"master": "spark://127.0.0.1:7077", "slots_timeout": 0})
    with pytest.raises(ConfigError, match=r"engine\.master='spark://nohost': 'nohost' is not HOST:PORT"):
        check_master("spark://nohost", timeout=1.0)
    with socket.create_server(("127.0.0.1", 0)) as master:
        port = master.getsockname()[1]
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
            gone = closed.getsockname()[1]
            with pytest.raises(EngineUnreachableError, match=(
                    rf"engine\.master='spark://127\.0\.0\.1:{gone}': no Spark master answers there "
                    rf"\(127\.0\.0\.1:{gone}: Connection refused; each given 1 s, "
                    r"engine\.connect_timeout\)\. Fix: start the master")):
                check_master(f"spark://127.0.0.1:{gone}", timeout=1.0)
            # high availability: the masters are tried in turn; the driver's address is the one that answered
            assert check_master(f"spark://127.0.0.1:{gone},127.0.0.1:{port}", timeout=1.0) == "127.0.0.1"


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_job_processes")
def test_digits_in_barrier_mode_from_a_dataset_the_same_session_wrote(spark: Any, spark_digits: str,
                                                                      tmp_path: Path) -> None:
    result, out = run(digits_config(tmp_path, spark_digits, "spark", epochs=3, every_steps=30))
    assert result.ok, out
    assert (result.steps, result.restarts) == (72, 0)
    assert result.metrics["loss"] < 2.0
    assert result.metrics["test_accuracy"] > 0.5
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []  # the barrier stage is over
    logs = tmp_path / "job" / "logs" / "attempt-0"
    assert "rank 1/2 attempt 0: starting, 72 steps" in (logs / "worker-1.log").read_text()
    assert "[worker-0] test accuracy:" in out
    assert np.isfinite(result.samples_per_s)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_job_processes")
def test_a_killed_task_restarts_the_stage_from_the_checkpoint(spark: Any, spark_digits: str,
                                                             tmp_path: Path) -> None:
    config = digits_config(tmp_path, spark_digits, {"name": "spark", "grace": 2}, epochs=6, every_steps=10)
    killed: dict[str, Any] = {}
    watcher = threading.Thread(target=kill_after_first_checkpoint, args=(tmp_path / "job", 1, killed),
                               daemon=True)
    watcher.start()
    try:
        result, out = run(config)
    finally:
        watcher.join(10)
    assert killed, f"the task was never killed:\n{out}"
    assert "pyspark.daemon" in killed["cmdline"], killed  # a Python worker the Spark daemon forked
    assert proctree.wait_gone([killed["role_pid"]], 10) == set()  # its process died with it
    assert result.ok, out
    assert result.restarts == 1, out
    failure = result.failures[0]
    assert failure.name == "worker-1", out
    # its exit never reached the trainer: what the engine saw is said instead (not "killed by SIGKILL")
    assert failure.reason == ("lost: its Spark task ended without reporting the exit (its Python worker "
                              "died or Spark killed the task)"), failure.reason
    lines = failure.last_lines
    assert any("Spark task ended without reporting" in line for line in lines), lines
    resumed = result.attempts[1].resumed_from
    assert resumed is not None
    assert resumed >= 10
    assert result.steps == 144
    worker0 = (tmp_path / "job" / "logs" / "attempt-1" / "worker-0.log").read_text()
    assert f"rank 0/2 attempt 1: resuming at step {resumed}" in worker0
