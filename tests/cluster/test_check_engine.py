"""`check_engine`: what `run_job` refuses about a job's engine before it starts anything, checked
without starting it (what ``shardkit validate`` runs besides loading the config)."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardkit.cluster import run_job
from shardkit.cluster.engines import check_engine
from shardkit.errors import ConfigError, MissingDependencyError
from shardkit.job.config import JobConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "trainer" / "scripts" / "behave.py"

# engine: section -> a word of the refusal
REFUSED: dict[str, tuple[dict[str, Any] | str, str]] = {
    "torchrun-tensorflow": ("torchrun", "runs torch allreduce jobs with workers only"),
    "torchrun-option": ({"name": "torchrun", "nnodez": "2"}, "did you mean 'nnodes'"),
    "torchrun-node-rank": ({"name": "torchrun", "nnodes": "1:2", "node_rank": 2}, "at most 2 node(s)"),
    "local-grace": ({"name": "local", "grace": -3}, "engine.grace = -3"),
    "local-option": ({"name": "local", "workers": 2}, "not an option of the local engine"),
    "ray-option": ({"name": "ray", "bogus": 1}, "no option 'bogus'"),
    "ray-value": ({"name": "ray", "num_cpus": -1}, "engine.num_cpus = -1"),
    "spark-option": ({"name": "spark", "mastr": "local[2]"}, "did you mean 'master'"),
    # a barrier stage of 4 processes (chief, 2 workers, ps) a local master cannot start together: it waited
    "spark-slots": ({"name": "spark", "master": "local[2]"}, "runs 2 task(s) at a time, but the job has 4"),
    "spark-task-cpus": ({"name": "spark", "master": "local[4]", "conf": {"spark.task.cpus": 2}},
                        "runs 2 task(s) of 2 cores each (spark.task.cpus)"),
    "spark-local-0": ({"name": "spark", "master": "local[0]"}, "runs 0 task(s) at a time"),
    # a local Ray instance too small for the actors, which start together: they waited for startup_timeout
    "ray-too-small": ({"name": "ray", "num_cpus": 2}, "would have 2 CPUS, but the job's processes"),
    "kubernetes": ("kubernetes", "shardkit render"),
    "yarn": ("yarn", "shardkit render"),
}


def _config(tmp_path: Path, engine: dict[str, Any] | str, **extra: Any) -> JobConfig:
    doc = {"name": "check", "entrypoint": str(SCRIPT), "framework": "tensorflow",
           "strategy": "parameter_server", "roles": {"worker": {"count": 2}, "ps": {"count": 1}},
           "logdir": str(tmp_path / "job"),
           "data": {"url": str(tmp_path / "no-dataset-here")}, "engine": engine, **extra}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_config(path)


@pytest.mark.parametrize(("engine", "word"), REFUSED.values(), ids=REFUSED.keys())
def test_check_engine_refuses_what_run_job_refuses(tmp_path: Path, engine: dict[str, Any] | str,
                                                   word: str) -> None:
    config = _config(tmp_path, engine)
    with pytest.raises(ConfigError) as checked:
        check_engine(config)
    with pytest.raises(ConfigError) as ran:
        run_job(config, console=io.StringIO())
    assert str(checked.value) == str(ran.value)
    assert word in str(checked.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


def test_a_node_rank_is_checked_as_train_checks_it(tmp_path: Path) -> None:
    config = _config(tmp_path, {"name": "torchrun", "nnodes": "1:2"}, framework="torch", strategy="allreduce",
                     roles={"worker": {"count": 2}})
    check_engine(config)
    check_engine(config, node_rank=1)
    with pytest.raises(ConfigError, match=r"engine\.node_rank = 2.*at most 2 node\(s\)"):
        check_engine(config, node_rank=2)


@pytest.mark.parametrize("engine", ["local", {"name": "local", "grace": 1}, {"name": "ray", "num_cpus": 4},
                                    {"name": "spark", "master": "local[4]"}],
                         ids=["local", "local-grace", "ray", "spark"])
def test_check_engine_starts_and_reads_nothing(tmp_path: Path, engine: dict[str, Any] | str) -> None:
    """The data does not exist and the logdir is not made: those are run_job's to check, where it runs; no
    Ray instance or SparkSession is started (building the engine imports its package, nothing more)."""
    before = _running()
    check_engine(_config(tmp_path, engine))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
    assert _running() == before


def _running() -> tuple[bool, Any]:
    ray = sys.modules.get("ray")
    spark = None
    if "pyspark" in sys.modules:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
    return ray is not None and ray.is_initialized(), spark


def test_a_missing_engine_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path, {"name": "ray", "address": "auto"})
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed: `import ray` fails
    with pytest.raises(MissingDependencyError, match=r"pip install 'shardkit\[ray\]'"):
        check_engine(config)
