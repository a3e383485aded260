"""Running a job again, from the user's side: a completed run is refused with the choices (``shardkit
train`` in a subprocess, ``run_job``), ``--resume`` trains more, ``--fresh`` moves the old run aside,
a failed run resumes by default, a script started by hand follows the same rule, and the README's
demo job runs twice in a row. The role is ``tests/cluster/scripts/count.py`` (a step counter: more
``params.steps`` trains more steps from where it was)."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardkit.cluster import run_job
from shardkit.errors import CompletedRunError, ConfigError, JobError
from shardkit.job.config import load_config
from shardkit.trainer.checkpoint import CheckpointManager
from shardkit.trainer.rerun import changes
from tests.trainer.scripts import proctree

REPO = Path(__file__).resolve().parents[2]
COUNT = REPO / "tests" / "cluster" / "scripts" / "count.py"
pytestmark = [pytest.mark.distributed]


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


def write_config(folder: Path, *, steps: int = 10, workers: int = 2, fault: dict[str, Any] | None = None,
                 max_restarts: int = 1, late: dict[str, Any] | None = None, **extra: Any) -> Path:
    config = {
        "name": "count", "entrypoint": str(COUNT), "framework": "tensorflow", "strategy": "allreduce",
        "roles": {"worker": {"count": workers}}, "checkpoint": {"every_steps": 5, "keep": 3},
        "fault_tolerance": {"max_restarts": max_restarts, "heartbeat_interval": 0.2,
                            "heartbeat_timeout": 10.0, "startup_timeout": 60.0},
        "logdir": str(folder / "job"),
        "params": {"steps": steps, "sleep": 0.01, "fault": fault, "late": late}, **extra,
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``shardkit train`` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(path), "--quiet", *args],
                          capture_output=True, text=True, timeout=120, check=False, start_new_session=True,
                          env={**os.environ, **(env or {})})


def summary(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "job" / "summary.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.timeout(120)
def test_a_completed_run_is_refused_naming_it_the_overrides_and_the_choices(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    first = train(path)
    assert first.returncode == 0, first.stdout + first.stderr
    before = (tmp_path / "job" / "summary.json").read_text()

    again = train(path, "--set", "params.steps=15", "--set", "roles.worker.count=3")

    assert again.returncode == 2, again.stdout + again.stderr
    message = again.stderr
    assert message.startswith("shardkit train: error: ")
    assert f"logdir {tmp_path / 'job'}" in message
    assert "completed at step 10 on 20" in message  # and when
    assert "would resume that checkpoint and train nothing" in message
    assert "params.steps 10 -> 15" in message
    assert "roles.worker.count 2 -> 3" in message
    for choice in ("--resume", "--fresh", "--set logdir=PATH", f"{tmp_path / 'job'}/previous/<time>/"):
        assert choice in message
    assert "attempt 0" not in again.stdout, "nothing started"
    assert (tmp_path / "job" / "summary.json").read_text() == before, "the completed run's files stay"


@pytest.mark.timeout(120)
def test_resume_continues_a_completed_run_and_trains_the_steps_added(tmp_path: Path) -> None:
    run_job(load_config(write_config(tmp_path)), console=io.StringIO())
    with pytest.raises(CompletedRunError, match="completed at step 10"):
        run_job(load_config(write_config(tmp_path, steps=15)), console=io.StringIO())

    console = io.StringIO()
    result = run_job(load_config(write_config(tmp_path, steps=15)), console=console, rerun="resume")

    assert result.ok
    assert result.attempts[0].resumed_from == 10
    assert (result.steps, result.samples) == (15, 5 * (4 + 5)), "steps 11-15 of both workers, no more"
    assert "--resume: continuing the run that completed at step 10" in console.getvalue()
    assert "params.steps 10 -> 15" in console.getvalue()
    with pytest.raises(CompletedRunError, match="completed at step 15"):  # completed again, at its new end
        run_job(load_config(write_config(tmp_path, steps=15)), console=io.StringIO())


@pytest.mark.timeout(120)
def test_resume_with_nothing_left_to_train_says_so_and_exits_0(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    assert train(path).returncode == 0

    resumed = train(path, "--resume")  # the same steps: the run is at its end

    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    out = resumed.stdout + resumed.stderr
    assert "--resume: continuing the run that completed at step 10" in out
    assert "job count: nothing left to train" in out
    assert "it resumed from checkpoint step 10, and its scripts ended there without a training step" in out
    assert "--fresh starts over from step 0" in out
    assert "succeeded" not in out
    assert "samples" not in out
    assert "first step" not in out
    done = summary(tmp_path)
    assert (done["status"], done["nothing_left"]) == ("succeeded", True)
    assert (done["steps"], done["samples"]) == (10, 0)
    assert done["first_step_s"] is None
    assert train(path).returncode == 2, "the run is still completed"
    more = train(path, "--resume", "--set", "params.steps=12")
    assert "job count succeeded" in more.stdout, more.stdout + more.stderr
    assert summary(tmp_path)["nothing_left"] is False


@pytest.mark.timeout(300)
def test_resume_of_a_torch_data_job_at_its_end_trains_nothing_and_says_so(tmp_path: Path) -> None:
    """The same with torch DDP reading a dataset (the README's kind of job): its reader restores at the end
    of its last epoch, so the loop ends at once."""
    import numpy as np

    import shardkit

    rows = 32
    x = np.random.default_rng(0).normal(size=(rows, 4)).astype(np.float32)
    schema = shardkit.Schema([shardkit.Field("id", "int64"), shardkit.Field("x", "float32", (4,)),
                              shardkit.Field("y", "float32")])
    shardkit.write_dataset({"id": np.arange(rows), "x": list(x), "y": x.sum(axis=1)}, str(tmp_path / "ids"),
                           schema=schema, row_group_size=8)
    config = {
        "name": "ids", "entrypoint": str(REPO / "tests" / "trainer" / "scripts" / "ddp_ids.py"),
        "framework": "torch", "roles": {"worker": {"count": 2}},
        "data": {"url": str(tmp_path / "ids"), "batch_size": 4, "num_epochs": 1, "options": {"workers": 1}},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "fault_tolerance": {"max_restarts": 0, "heartbeat_interval": 0.2, "startup_timeout": 120},
        "logdir": str(tmp_path / "job"), "env": {"OMP_NUM_THREADS": "1"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    first = train(path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert summary(tmp_path)["steps"] == rows // 2 // 4

    resumed = train(path, "--resume")

    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert "job ids: nothing left to train (" in out
    assert f"it resumed from checkpoint step {rows // 2 // 4}, and its scripts ended there" in out
    assert "succeeded" not in out
    assert "first step" not in out
    assert (summary(tmp_path)["samples"], summary(tmp_path)["nothing_left"]) == (0, True)


@pytest.mark.timeout(120)
def test_a_process_that_starts_late_restores_the_attempts_checkpoint_not_one_a_peer_saved_meanwhile(
        tmp_path: Path) -> None:
    run_job(load_config(write_config(tmp_path)), console=io.StringIO())
    # worker 1 restores only after worker 0 has trained steps 11-15 and saved step 15
    late = write_config(tmp_path, steps=15, late={"index": 1, "seconds": 3.0})

    result = run_job(load_config(late), console=io.StringIO(), rerun="resume")

    assert result.ok
    assert result.attempts[0].resumed_from == 10
    assert (result.steps, result.samples) == (15, 5 * (4 + 5)), "worker 1 trains steps 11-15 too"
    log = (tmp_path / "job" / "logs" / "attempt-0" / "worker-1.log").read_text()
    assert "worker-1 attempt 0 starts at step 10" in log


@pytest.mark.timeout(120)
def test_fresh_moves_the_old_run_aside_and_trains_from_step_0(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    assert train(path).returncode == 0
    old_summary = (tmp_path / "job" / "summary.json").read_text()

    fresh = train(path, "--fresh")

    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    (aside,) = (tmp_path / "job" / "previous").iterdir()
    said = f"--fresh: a new run from step 0; the earlier run's checkpoints and logs are in {aside}"
    assert said in fresh.stdout
    assert (aside / "summary.json").read_text() == old_summary
    assert (aside / "logs" / "attempt-0" / "worker-0.log").exists()
    assert CheckpointManager(aside / "checkpoints", keep=None).completed() is not None
    assert [c.step for c in CheckpointManager(aside / "checkpoints", keep=None).list()] == [5, 10]
    new = summary(tmp_path)
    assert new["attempts"][0]["resumed_from"] is None
    assert (new["status"], new["steps"], new["samples"]) == ("succeeded", 10, 10 * (4 + 5))
    assert train(path).returncode == 2, "the new run completed too"


@pytest.mark.timeout(120)
def test_a_failed_run_resumes_by_default_and_the_changes_are_named(tmp_path: Path) -> None:
    fault = {"index": 0, "step": 8, "how": "raise", "attempts": [0]}
    with pytest.raises(JobError):
        run_job(load_config(write_config(tmp_path, fault=fault, max_restarts=0)), console=io.StringIO())

    console = io.StringIO()
    result = run_job(load_config(write_config(tmp_path, steps=12)), console=console)

    assert result.ok
    assert result.attempts[0].resumed_from == 5
    assert result.steps == 12
    text = console.getvalue()
    assert "resuming the unfinished run from checkpoint step 5; changed since: params.fault" in text
    assert "params.steps 10 -> 12" in text


@pytest.mark.timeout(120)
def test_a_run_completed_before_the_marker_existed_is_refused_by_its_summary(tmp_path: Path) -> None:
    """A logdir from an earlier shardkit: checkpoints and a succeeded summary.json, no COMPLETED."""
    path = write_config(tmp_path)
    assert train(path).returncode == 0
    (tmp_path / "job" / "checkpoints" / "COMPLETED").unlink()

    refused = train(path)

    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "completed at step 10" in refused.stderr
    resumed = train(path, "--resume", "--set", "params.steps=12")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert summary(tmp_path)["steps"] == 12


def test_changes_name_params_data_and_role_counts_only() -> None:
    before = {"params": {"lr": 0.05, "seed": 0}, "roles": {"worker": {"count": 2, "resources": {"cpus": 1}}},
              "data": {"url": "/d", "num_epochs": 20}, "logdir": "/a"}
    after = {"params": {"lr": 0.1, "seed": 0}, "roles": {"worker": {"count": 4, "resources": {"cpus": 2}}},
             "data": {"url": "/d", "num_epochs": 40}, "logdir": "/b"}
    assert changes(before, after) == ["data.num_epochs 20 -> 40", "params.lr 0.05 -> 0.1",
                                      "roles.worker.count 2 -> 4"]
    assert changes(None, after) == []


@pytest.mark.timeout(120)
def test_a_script_started_by_hand_follows_the_same_rule(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    assert train(path).returncode == 0

    def by_hand(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(COUNT)], capture_output=True, text=True, timeout=60,
                              check=False, env={**os.environ, "SHARDKIT_CONFIG": str(path), **env})

    refused = by_hand()
    assert refused.returncode != 0
    assert "CompletedRunError" in refused.stderr
    assert "completed at step 10" in refused.stderr
    assert "SHARDKIT_RERUN=resume" in refused.stderr
    assert "SHARDKIT_RERUN=fresh" in refused.stderr
    assert "--resume" in refused.stderr

    bad = by_hand(SHARDKIT_RERUN="yes")
    assert "SHARDKIT_RERUN='yes' (from the environment): not a choice" in bad.stderr

    resumed = by_hand(SHARDKIT_RERUN="resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "starts at step 10" in resumed.stdout
    assert re.search(r"resumed checkpoint step 10 \(.*step-000000010\) of the run that completed there",
                     resumed.stderr)

    fresh = by_hand(SHARDKIT_RERUN="fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert "starts at step 0" in fresh.stdout
    (aside,) = (tmp_path / "job" / "previous").iterdir()
    assert f"the earlier run's checkpoints are in {aside / 'checkpoints'}" in fresh.stderr
    assert [c.step for c in CheckpointManager(aside / "checkpoints", keep=None).list()] == [5, 10]
    assert CheckpointManager(tmp_path / "job" / "checkpoints", keep=None).completed() is not None


@pytest.mark.timeout(120)
def test_an_unfinished_run_by_hand_resumes_and_says_so(tmp_path: Path) -> None:
    path = write_config(tmp_path, fault={"index": 0, "step": 8, "how": "raise", "attempts": [0]})
    env = {**os.environ, "SHARDKIT_CONFIG": str(path)}
    failed = subprocess.run([sys.executable, str(COUNT)], capture_output=True, text=True, timeout=60,
                            check=False, env=env)
    assert failed.returncode != 0
    fixed = write_config(tmp_path)
    again = subprocess.run([sys.executable, str(COUNT)], capture_output=True, text=True, timeout=60,
                           check=False, env={**env, "SHARDKIT_CONFIG": str(fixed)})
    assert again.returncode == 0, again.stderr
    assert "starts at step 5" in again.stdout
    assert "resumed checkpoint step 5" in again.stderr
    assert "of an unfinished run" in again.stderr


def test_a_bad_rerun_choice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rerun='again': use one of 'refuse', 'resume', 'fresh'"):
        run_job(load_config(write_config(tmp_path)), rerun="again")  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_torchrun_node_0_refuses_a_completed_run_and_resumes_with_resume(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from shardkit.job.layout import free_ports

    (port,) = free_ports(1)
    engine = {"name": "torchrun", "rdzv_endpoint": f"127.0.0.1:{port}"}
    path = write_config(tmp_path, workers=1, engine=engine, framework="torch")
    first = train(path)
    assert first.returncode == 0, first.stdout + first.stderr

    refused = train(path, "--set", "params.steps=15")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "completed at step 10" in refused.stderr
    assert "params.steps 10 -> 15" in refused.stderr
    assert "joining rendezvous" not in refused.stdout, "refused before the agent started"

    resumed = train(path, "--set", "params.steps=15", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "[shardkit node 0] --resume: continuing the run that completed at step 10" in resumed.stdout
    assert summary(tmp_path)["steps"] == 15
    log = tmp_path / "job" / "logs" / "node-0" / "attempt-0" / "worker-0.log"
    assert "starts at step 10" in log.read_text()

    again = train(path, "--set", "params.steps=15", "--resume")  # at its end: nothing left
    assert again.returncode == 0, again.stdout + again.stderr
    assert "job count: nothing left to train" in again.stdout
    assert "succeeded" not in again.stdout
    assert "first step" not in again.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demos_train_command_runs_twice_in_a_row(tmp_path: Path, digits: str) -> None:
    """``./scripts/demo``'s `shardkit train` line (its install and dataset steps aside), twice: each run
    trains the whole job, the first one's files are kept under previous/ (2 epochs, for time)."""
    line = next(x for x in (REPO / "scripts" / "demo").read_text().splitlines()
                if x.startswith(".venv/bin/shardkit train "))
    argv = shlex.split(line.split("#")[0])[2:]  # after `.venv/bin/shardkit train`
    command = [sys.executable, "-m", "shardkit.cli", "train", *[str(REPO / a) if a.endswith(".yaml") else a
                                                             for a in argv],
               "--set", f"data.url={digits}", "--set", f"logdir={tmp_path / 'job'}",
               "--set", "data.num_epochs=2"]
    for run in range(2):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=140, check=False,
                              start_new_session=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "job digits succeeded" in proc.stdout, run
        assert "(no checkpoint yet)" in proc.stdout, "a new run each time"
        assert summary(tmp_path)["samples"] == 2 * 1500, "both epochs of both shards"
    assert len(list((tmp_path / "job" / "previous").iterdir())) == 1
