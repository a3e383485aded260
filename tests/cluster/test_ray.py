"""The ``ray`` engine on a real local Ray instance: the digits job, and a Ray actor SIGKILLed mid-run.

Each job test runs the job as ``shardkit train`` does (the supervisor makes the engine), so the engine
starts its own local Ray instance and the supervisor shuts it down at the end: `ray_daemons_left` and
`proctree.reaped` check that nothing of the job or of Ray is left behind.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardkit.cluster.engines import get_engine
from shardkit.cluster.engines.ray import bundle, check_answers, shortfall
from shardkit.cluster.monitor.report import JobResult
from shardkit.cluster.supervisor import Supervisor
from shardkit.errors import ConfigError, EngineUnreachableError, MissingDependencyError
from shardkit.job.config import JobConfig, load_config
from shardkit.job.layout import free_ports
from tests.trainer.scripts import proctree

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def digits_config(folder: Path, data_url: str, engine: str | dict[str, Any], *, epochs: int,
                  every_steps: int) -> JobConfig:
    """``examples/digits.yaml`` (2 DDP workers) on ``data_url`` with ``engine``, for ``epochs``."""
    config = yaml.safe_load((EXAMPLES / "digits.yaml").read_text())
    config.update(entrypoint=str(EXAMPLES / config["entrypoint"]), logdir=str(folder / "job"), engine=engine)
    config["data"].update(url=data_url, num_epochs=epochs)
    config["checkpoint"] = {"every_steps": every_steps, "keep": 2}
    config["fault_tolerance"].update(max_restarts=1, heartbeat_timeout=30.0, startup_timeout=120.0)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path)


def run(config: JobConfig) -> tuple[JobResult, str]:
    """Run the job with the engine the supervisor makes, and closes, itself."""
    console = io.StringIO()
    result = Supervisor(config, console=console).run()
    return result, console.getvalue()


def ray_daemons_left(timeout: float = 15.0) -> list[str]:
    """Ray's own processes (raylet, gcs_server) still running under this test, after ``timeout``."""
    def daemons() -> dict[int, str]:
        found = {}
        for pid in proctree.descendants(os.getpid()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "raylet" in cmdline or "gcs_server" in cmdline:
                found[pid] = cmdline.replace("\0", " ")[:80]
        return found

    left = daemons()
    proctree.wait_gone(left, timeout)
    return [cmd for pid, cmd in daemons().items() if proctree.alive(pid)]


def role_process(job_dir: Path, role: str, index: int, attempt: int) -> int | None:
    """The pid of the role process of this job (not its DataLoader workers, which share its env)."""
    want = {f"SHARDKIT_JOB_DIR={job_dir}", f"SHARDKIT_ROLE={role}", f"SHARDKIT_ROLE_INDEX={index}",
            f"SHARDKIT_ATTEMPT={attempt}"}
    found: dict[int, int] = {}
    for pid in proctree.descendants(os.getpid()):
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"))
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if want <= env:
            found[pid] = ppid
    tops = [pid for pid, ppid in found.items() if ppid not in found]
    return tops[0] if len(tops) == 1 else None


def kill_after_first_checkpoint(job_dir: Path, index: int, out: dict[str, Any],
                                timeout: float = 150.0) -> None:
    """Watch for the first committed checkpoint, then SIGKILL the parent of worker ``index``'s process (the
    engine's unit: a Ray actor, a Spark task's Python worker); what was done goes into ``out``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any((job_dir / "checkpoints").glob("step-*/COMMIT")):
            pid = role_process(job_dir, "worker", index, 0)
            if pid is not None:
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                out["cmdline"] = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace")
                out["role_pid"], out["parent"] = pid, parent
                os.kill(parent, signal.SIGKILL)
                return
        time.sleep(0.02)


def test_options_and_missing_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"engine\.adress = .*did you mean 'address'"):
        get_engine("ray", {"adress": "auto"})
    with pytest.raises(ConfigError, match=r"engine\.num_cpus = -1"):
        get_engine("ray", {"num_cpus": -1})
    with pytest.raises(ConfigError, match=r"engine\.runtime_env = "):
        get_engine("ray", {"runtime_env": ["pip"]})
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed: `import ray` fails
    with pytest.raises(MissingDependencyError, match=r"pip install 'shardkit\[ray\]'"):
        get_engine("ray", {"address": "auto"})


def test_placement_option_and_what_the_alive_nodes_can_never_hold(tmp_path: Path, digits: str) -> None:
    with pytest.raises(ConfigError, match=r"engine\.placement = 'sprad': .*use one of: spread, strict_"):
        get_engine("ray", {"placement": "sprad"})
    config = digits_config(tmp_path, digits, {"name": "ray", "placement": "strict_spread"}, epochs=1,
                           every_steps=10)
    one_node = (r"engine\.placement=strict_spread: .* the local Ray instance is one node and the job has 2 "
                r"processes\. Fix: engine\.placement: spread")
    with pytest.raises(ConfigError, match=one_node):
        get_engine("ray", config.engine.options).check_job(config)  # type: ignore[attr-defined]
    cpu, node = {"CPU": 1.0}, {"CPU": 2.0, "memory": 8.0 * 2**30}
    assert shortfall([cpu, cpu], "spread", [node]) is None  # both on the one node
    assert shortfall([cpu, cpu], "strict_spread", [node]) == "a node per process: 2 needed, 1 can hold one"
    assert shortfall([cpu, cpu], "strict_spread", [node, node]) is None
    assert shortfall([cpu, cpu], "strict_pack", [cpu, cpu]) == "one node for all: none has 2 CPU"
    assert shortfall([{"GPU": 1.0}], "pack", [node]) == "no alive node has 1 GPU for one process"
    assert shortfall([cpu] * 3, "spread", [cpu, cpu]) == "CPUs: 3 CPU asked, 2 CPU on the alive nodes"
    assert shortfall([{"memory": 4.0 * 2**30}] * 3, "spread", [node]) == (
        "memory: 12.0 GiB asked, 8.0 GiB on the alive nodes")
    assert bundle({"cpus": 1, "gpus": 0, "memory": 2**30}) == {"CPU": 1.0, "memory": 2.0**30}
    assert bundle({"cpus": 0}) == {"CPU": 0.01}  # Ray refuses an empty bundle


def test_an_address_that_refuses_is_an_error_naming_it_at_once() -> None:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    began = time.monotonic()
    refused = rf"engine\.address='{address}': no Ray cluster answers at {address} \(Connection refused, after"
    with pytest.raises(EngineUnreachableError, match=refused):
        check_answers(address)
    assert time.monotonic() - began < 10
    check_answers("auto")  # Ray's to find: nothing is checked


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_digits_job_on_a_local_ray_instance(tmp_path: Path, digits: str) -> None:
    with proctree.reaped():
        result, out = run(digits_config(tmp_path, digits, "ray", epochs=3, every_steps=30))
        import ray

        assert not ray.is_initialized()  # the supervisor shut down the instance its engine started
        assert ray_daemons_left() == []
    assert result.ok, out
    assert (result.steps, result.restarts) == (72, 0)  # 3 epochs of 24 steps per worker
    assert [c.step for c in result.checkpoints] == [30, 60, 72]
    assert result.metrics["loss"] < 2.0  # below chance (ln 10 = 2.30): it learned
    assert result.metrics["test_accuracy"] > 0.5
    logs = tmp_path / "job" / "logs" / "attempt-0"
    assert "rank 1/2 attempt 0: starting, 72 steps" in (logs / "worker-1.log").read_text()
    assert "TRAIN_STATS" in (logs / "worker-0.log").read_text()
    assert "[worker-0] test accuracy:" in out  # output relayed from the actors to the console


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_killed_actor_is_restarted_and_the_job_finishes_from_its_checkpoint(tmp_path: Path,
                                                                              digits: str) -> None:
    config = digits_config(tmp_path, digits, {"name": "ray", "grace": 2}, epochs=6, every_steps=10)
    job_dir = tmp_path / "job"
    killed: dict[str, Any] = {}
    with proctree.reaped():
        watcher = threading.Thread(target=kill_after_first_checkpoint, args=(job_dir, 1, killed), daemon=True)
        watcher.start()
        try:
            result, out = run(config)
        finally:
            watcher.join(10)
        assert killed, f"the actor was never killed:\n{out}"
        assert killed["cmdline"].startswith("ray::_RoleActor"), killed  # the role ran in a Ray actor
        assert proctree.wait_gone([killed["role_pid"]], 10) == set()  # it died with its actor
    assert result.ok, out
    assert result.restarts == 1, out
    failure = result.failures[0]
    assert failure.name == "worker-1", out
    # it has no exit status of its own: what the engine saw is said instead (not "killed by SIGKILL")
    assert failure.reason.startswith("lost: the Ray actor of worker-1 died (node "), failure.reason
    assert any("the Ray actor of worker-1 died" in line for line in failure.last_lines), failure.last_lines
    resumed = result.attempts[1].resumed_from
    assert resumed is not None
    assert resumed >= 10
    assert result.steps == 144  # 6 epochs of 24 steps: finished
    worker0 = (job_dir / "logs" / "attempt-1" / "worker-0.log").read_text()
    assert f"rank 0/2 attempt 1: resuming at step {resumed}" in worker0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sigterm_to_shardkit_train_on_ray_stops_the_job_as_interrupted(tmp_path: Path, digits: str) -> None:
    """``ray.init`` replaces the SIGTERM handler with Ray's own (``sys.exit(15)``): a regression, SIGTERM to
    ``shardkit train`` ended it with exit code 15 and summary ``failed``. The supervisor's handler is put
    back: exit 143, ``interrupted``, and nothing of the job or of Ray left."""
    config = digits_config(tmp_path, digits, "ray", epochs=40, every_steps=10)
    job_dir = tmp_path / "job"
    argv = [sys.executable, "-m", "shardkit.cli", "train", str(tmp_path / "job.yaml")]
    trainer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not any((job_dir / "checkpoints").glob("step-*/COMMIT")):
            time.sleep(0.05)
        assert any((job_dir / "checkpoints").glob("step-*/COMMIT")), "the job never checkpointed"
        started = proctree.descendants(trainer.pid)
        trainer.send_signal(signal.SIGTERM)
        out, _ = trainer.communicate(timeout=90)
    finally:
        proctree.kill([trainer.pid])
    assert trainer.returncode == 143, out[-3000:]
    assert json.loads((job_dir / "summary.json").read_text())["status"] == "interrupted"
    assert proctree.wait_gone(started, timeout=20) == set(), "processes of the job or of Ray outlived it"
    assert config.engine.name == "ray"

