"""The supervisor with real processes (``tests/trainer/scripts/behave.py``, no torch): restarts, timeouts,
exhausted restarts, Ctrl-C and SIGTERM without orphans, secrets kept out of every file, TensorBoard."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardkit.cluster import run_job
from shardkit.cluster.monitor.heartbeats import HeartbeatReceiver
from shardkit.cluster.monitor.report import JobResult
from shardkit.cluster.supervisor import driver_roles
from shardkit.errors import ConfigError, JobError
from shardkit.job.config import load_config
from tests.trainer.scripts import proctree

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "trainer" / "scripts" / "behave.py"
ROLE = REPO / "tests" / "cluster" / "scripts" / "role.py"  # what a role can do to its supervisor
COUNT = REPO / "tests" / "cluster" / "scripts" / "count.py"  # trains known samples, raises or is killed
pytestmark = [pytest.mark.distributed]


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


def write_config(folder: Path, *, workers: int = 2, steps: int = 20, sleep: float = 0.02,
                 max_restarts: int = 2, heartbeat_timeout: float = 3.0, startup_timeout: float = 30.0,
                 env: dict[str, str] | None = None, secrets: dict[str, Any] | None = None,
                 script: Path = SCRIPT, data: dict[str, Any] | None = None, **params: Any) -> Path:
    config = {
        "name": "behave", "entrypoint": str(script), "framework": "tensorflow", "strategy": "allreduce",
        "roles": {"worker": {"count": workers}},
        "checkpoint": {"every_steps": 5, "keep": 3} if script == SCRIPT else {},
        "fault_tolerance": {"max_restarts": max_restarts, "heartbeat_interval": 0.2,
                            "heartbeat_timeout": heartbeat_timeout, "startup_timeout": startup_timeout},
        "logdir": str(folder / "job"), "params": {"steps": steps, "sleep": sleep, **params},
        "env": env or {}, "secrets": secrets or {}, **({"data": data} if data else {}),
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(folder: Path, **kwargs: Any) -> tuple[JobResult, str]:
    console = io.StringIO()
    result = run_job(load_config(write_config(folder, **kwargs)), console=console)
    return result, console.getvalue()


def starts(job_dir: Path, name: str) -> list[dict[str, Any]]:
    path = job_dir / f"record-{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(60)
def test_success_writes_logs_summary_job_json_and_tensorboard(tmp_path: Path) -> None:
    result, console = run(tmp_path)
    job = tmp_path / "job"
    assert result.ok
    assert result.steps == 20
    assert result.restarts == 0
    assert not result.failures
    assert [c.step for c in result.checkpoints] == [5, 10, 15, 20]
    assert result.samples == 2 * 20 * 4
    for name in ("worker-0", "worker-1"):
        log = (job / "logs" / "attempt-0" / f"{name}.log").read_text()
        assert f"{name} attempt 0 starts at step 0" in log
        assert f"[{name}] {name} attempt 0 starts at step 0" in console  # echoed with the role's prefix
    job_json = json.loads((job / "job.json").read_text())
    assert job_json["name"] == "behave"
    assert job_json["params"]["steps"] == 20
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "succeeded"
    assert summary["steps"] == 20
    assert summary["samples"] == 160
    assert summary["metrics"]["counter"] == 20
    assert "job behave succeeded" in console
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(job / "tensorboard"))
    acc.Reload()
    assert {"loss", "counter", "samples_per_s", "restarts"} <= set(acc.Tags()["scalars"])
    assert acc.Scalars("loss")[-1].step == 20
    assert acc.Scalars("loss")[-1].value == pytest.approx(1 / 20)


@pytest.mark.timeout(60)
def test_killed_worker_restarts_from_checkpoint(tmp_path: Path) -> None:
    result, console = run(tmp_path, fault={"index": 1, "step": 8, "how": "kill"})
    job = tmp_path / "job"
    assert result.ok
    assert result.restarts == 1
    assert result.steps == 20
    assert (result.failures[0].name, result.failures[0].reason) == ("worker-1", "killed by SIGKILL")
    assert "fault kill at step 8" in result.failures[0].last_lines
    for name in ("worker-0", "worker-1"):
        assert [(r["attempt"], r["start"], r["counter"]) for r in starts(job, name)] == [(0, 0, 0), (1, 5, 5)]
    assert result.attempts[1].resumed_from == 5
    assert "attempt 1 (from checkpoint step 5)" in console


def count_job(folder: Path, *, workers: int, fault: dict[str, Any], framework: str = "tensorflow",
              heartbeat: tuple[float, float] = (5.0, 30.0), **params: Any) -> tuple[JobResult, str]:
    """A job of ``scripts/count.py`` (worker i trains 4 + i samples a step, 20 steps, a checkpoint every
    5), heartbeating every 5 s (``heartbeat``: interval and timeout): after its first step, a process
    heartbeats only at the checkpoints."""
    config = {
        "name": "count", "entrypoint": str(COUNT), "framework": framework, "strategy": "allreduce",
        "roles": {"worker": {"count": workers}}, "checkpoint": {"every_steps": 5, "keep": 5},
        "fault_tolerance": {"max_restarts": 1, "heartbeat_interval": heartbeat[0],
                            "heartbeat_timeout": heartbeat[1], "startup_timeout": 60.0},
        "logdir": str(folder / "job"), "params": {"steps": 20, "batch": 4, "fault": fault, **params},
        "env": {"OMP_NUM_THREADS": "1"},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    console = io.StringIO()
    result = run_job(load_config(path), console=console)
    return result, console.getvalue()


@pytest.mark.timeout(60)
def test_samples_of_a_worker_that_raised_are_counted_up_to_its_last_step(tmp_path: Path) -> None:
    """Heartbeats are rate-limited: the last one before the crash said step 5 (20 samples), but the worker
    trained 6 steps (24 samples) before it raised at step 7. Its last words (`with ctx` on the way out)
    give the exact count; the step after the checkpoint (4 samples) is trained again by the restart."""
    result, console = count_job(tmp_path, workers=1, fault={"index": 0, "step": 7, "how": "raise"})
    assert result.ok, console
    assert result.restarts == 1
    assert result.attempts[1].resumed_from == 5
    assert [a.samples for a in result.attempts] == [6 * 4, 15 * 4]
    assert result.samples == 84  # was 80: the 4 samples of step 6 were missing
    assert (result.samples_lost, result.samples_kept) == (4, 80)  # 20 steps of 4: the final model's
    assert [a.samples_lost for a in result.attempts] == [4, 0]
    assert result.samples_unreported == []
    assert result.samples_exact
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert (summary["samples"], summary["samples_lost"], summary["samples_kept"]) == (84, 4, 80)
    assert summary["samples_exact"] is True
    assert "20 steps, 84 samples trained" in console
    assert "80 in the final model; 4 trained again after restarts" in console


@pytest.mark.timeout(60)
def test_the_attempt_records_the_checkpoint_the_lead_restored_not_a_newer_damaged_one(tmp_path: Path) -> None:
    """The newest checkpoint (step 10) keeps its sizes but not its contents: the workers skip it and
    restore step 5. The attempt, the console and the sample accounting follow them (a regression: they
    named step 10, which only its sizes made look complete)."""
    result, console = count_job(tmp_path, workers=1, fault={"index": 0, "step": 12, "how": "corrupt"})
    assert result.ok, console
    assert result.attempts[1].resumed_from == 5
    assert "worker-0 restored checkpoint step 5, not step 10: that one did not verify" in console
    assert [a.samples for a in result.attempts] == [11 * 4, 15 * 4]
    assert (result.samples_lost, result.samples_kept) == (6 * 4, 20 * 4)  # steps 6-11 trained again
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["attempts"][1]["resumed_from"] == 5


@pytest.mark.timeout(90)
def test_a_sigkilled_worker_is_named_and_the_samples_in_the_model_stay_exact(tmp_path: Path) -> None:
    """Two torch workers step together (an all_reduce a step). Worker 1 is SIGKILLed at step 8: it
    cannot report the 2 steps it trained after its heartbeat at the checkpoint of step 5, and the summary
    says so. Worker 0, whose all_reduce fails, reports its 7 steps as it leaves `with ctx` (then it may
    hang tearing down the broken gloo group until it is stopped: listed as well). The samples in the
    final model are exact: the checkpoint's (both workers' heartbeats at step 5) and the restart's."""
    pytest.importorskip("torch")
    result, console = count_job(tmp_path, workers=2, framework="torch", allreduce=True,
                                fault={"index": 1, "step": 8, "how": "kill"})
    assert result.ok, console
    assert result.restarts == 1
    assert result.attempts[1].resumed_from == 5
    assert result.attempts[1].samples_resumed == 5 * 4 + 5 * 5
    assert result.attempts[1].samples == 15 * 4 + 15 * 5
    assert result.samples_kept == 20 * 4 + 20 * 5  # exact, whatever the killed worker could not report
    assert "attempt 0: worker-1 (killed by SIGKILL)" in (result.samples_unreported or [])
    assert not result.samples_exact
    assert result.samples == result.samples_kept + (result.samples_lost or 0)
    # Worker 0's last count, unless the supervisor stopped it before its all_reduce failed.
    assert result.attempts[0].samples in (7 * 4 + 5 * 5, 5 * 4 + 5 * 5)  # worker 1's stops at step 5
    assert f"at least {result.samples:,} samples trained" in console
    assert "attempt 0: worker-1 (killed by SIGKILL)" in console


@pytest.mark.timeout(60)
def test_hang_is_detected_by_heartbeat_timeout(tmp_path: Path) -> None:
    result, _ = run(tmp_path, heartbeat_timeout=2.0, fault={"index": 1, "step": 8, "how": "hang"})
    assert result.ok
    assert result.restarts == 1
    failure = result.failures[0]
    assert failure.name == "worker-1"
    assert failure.returncode is None
    assert failure.reason.startswith("silent for")
    assert "heartbeat_timeout 2 s" in failure.reason
    assert failure.silent_s is not None
    assert 2.0 < failure.silent_s < 2.0 + 5.0  # within the timeout (plus polling, on a busy machine)


@pytest.mark.timeout(60)
def test_silent_start_is_detected_by_startup_timeout(tmp_path: Path) -> None:
    with pytest.raises(JobError) as info:
        run(tmp_path, workers=1, max_restarts=0, startup_timeout=2.0, env={"BEHAVE_SILENT_START": "1"})
    failure = info.value.result.failures[0]  # type: ignore[attr-defined]
    assert failure.reason.startswith("no heartbeat in")
    assert "startup_timeout 2 s" in failure.reason


@pytest.mark.timeout(60)
def test_abort_after_done_counts_as_finished(tmp_path: Path) -> None:
    """gloo sometimes aborts at exit after the work is done (ENGINES.md): that is not a failure."""
    result, _ = run(tmp_path, fault={"index": 1, "how": "abort_after_done"})
    assert result.ok
    assert result.restarts == 0
    assert any("worker-1 killed by SIGABRT after it reported done" in note for note in result.notes)


@pytest.mark.timeout(90)
def test_a_process_that_lingers_after_done_is_counted_as_finished_not_restarted(tmp_path: Path) -> None:
    """A thread that is not a daemon kept worker-1 alive after its work: the job failed it after
    startup_timeout and restarted, for nothing (every step was trained and saved)."""
    result, _ = run(tmp_path, heartbeat_timeout=2.0, fault={"index": 1, "how": "linger_after_done"})
    assert result.ok
    assert result.restarts == 0, result.failures
    assert result.steps == 20
    (note,) = [n for n in result.notes if "worker-1 reported done but had not exited" in n]
    assert "counted as finished and stopped with the group" in note


@pytest.mark.timeout(90)
def test_a_process_done_before_the_others_waits_for_them_unremarked(tmp_path: Path) -> None:
    """worker-1 ends at step 2 and waits for worker-0, as torch ranks wait at `finish`'s barrier, for
    longer than heartbeat_timeout: that is no lingering (it was noted as one)."""
    result, _ = run(tmp_path, heartbeat_timeout=3.0, steps=40, sleep=0.1,
                    fault={"index": 1, "step": 2, "how": "done_early"})
    assert result.ok
    assert result.restarts == 0, result.failures
    assert result.steps == 40
    assert not [n for n in result.notes if "had not exited" in n], result.notes


@pytest.mark.timeout(90)
def test_restarts_exhausted_fail_with_the_history(tmp_path: Path) -> None:
    config = write_config(tmp_path, max_restarts=2, fault={"index": 0, "step": 3, "how": "exit",
                                                           "attempts": [0, 1, 2]})
    proc = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(config), "--quiet"],
                          capture_output=True, text=True, timeout=80, start_new_session=True, check=False)
    assert proc.returncode == 1
    for attempt in range(3):
        assert f"attempt {attempt}: worker-0 exit code 3" in proc.stderr
    assert proc.stderr.count("| fault exit at step 3") == 3  # each failure with the end of its log
    assert "max_restarts=2 exhausted" in proc.stderr
    assert "[worker-0]" not in proc.stdout  # --quiet: no role output on the console
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["restarts"] == 2
    assert len(summary["failures"]) == 3


@pytest.mark.timeout(60)
def test_secrets_reach_the_roles_and_no_file_or_output(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    env_secret, file_secret = "s3cr3t-from-env-0123", "s3cr3t-from-file-4567"
    monkeypatch.setenv("BEHAVE_TOKEN", env_secret)
    (tmp_path / "token").write_text(file_secret + "\n")
    result, console = run(tmp_path, workers=1, secret_env="API_TOKEN", leak=True,
                          secrets={"API_TOKEN": {"env": "BEHAVE_TOKEN"},
                                   "OTHER": {"file": str(tmp_path / "token")}})
    assert result.ok
    job = tmp_path / "job"
    assert starts(job, "worker-0")[0]["secret_sha256"] == hashlib.sha256(env_secret.encode()).hexdigest()
    assert "the secret is ***" in console  # echoed output is masked
    assert "the secret is ***" in (job / "logs" / "attempt-0" / "worker-0.log").read_text()  # its log too
    for secret in (env_secret, file_secret):
        assert secret not in console
        for path in job.rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), path
    processes = json.loads((job / "logs" / "attempt-0" / "processes.json").read_text())
    assert processes[0]["env"]["API_TOKEN"] == "<redacted>"
    assert json.loads((job / "job.json").read_text())["secrets"] == ["API_TOKEN", "OTHER"]


@pytest.mark.timeout(60)
def test_a_metric_beyond_float32_does_not_stop_the_job(tmp_path: Path) -> None:
    """perplexity = exp(loss) early in training (exp(99) = 1e43) is +inf in TensorBoard, not a crash."""
    result, console = run(tmp_path, workers=1, steps=10, script=ROLE, exp_metric=100)
    assert result.ok, console
    assert result.metrics["ppl"] == pytest.approx(math.exp(90))
    assert "warning" not in console
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(tmp_path / "job" / "tensorboard"))
    acc.Reload()
    ppl = acc.Scalars("ppl")
    assert ppl
    assert all(e.value == math.inf for e in ppl)
    assert acc.Scalars("loss")[-1].value == pytest.approx(0.1)


@pytest.mark.timeout(60)
def test_tensorboard_errors_are_shown_once_and_the_job_goes_on(tmp_path: Path) -> None:
    """A file where the TensorBoard folder goes: a warning line, and the job runs and sums up anyway."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "tensorboard").write_text("not a folder")
    result, console = run(tmp_path, workers=1, steps=6)
    assert result.ok, console
    warnings = [line for line in console.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert "[shardkit] warning: opening TensorBoard's event file" in warnings[0]
    assert "the job goes on" in warnings[0]
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["status"] == "succeeded"


def test_a_missing_local_dataset_fails_before_anything_starts(tmp_path: Path) -> None:
    """A data.url on this machine that holds no dataset: every restart would fail the same way."""
    config = load_config(write_config(tmp_path, data={"url": str(tmp_path / "no-such-dataset")}))
    with pytest.raises(ConfigError) as info:
        run_job(config, console=io.StringIO())
    for word in ("data.url", str(tmp_path / "no-such-dataset"), "does not exist", "Fix:"):
        assert word in str(info.value)
    assert not (tmp_path / "job").exists()  # nothing started, nothing cleared


def _start_cli(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "shardkit.cli", "train", str(config)],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_running(job: Path, names: list[str], timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = [starts(job, n) for n in names]
        if all(records):
            return [r[-1] for r in records]
        time.sleep(0.1)
    raise AssertionError(f"{names} did not start in {timeout} s")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_interrupt_stops_every_process_without_orphans(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C, SIGTERM, and SIGHUP (the terminal or SSH session closed) stop the job cleanly."""
    config = write_config(tmp_path, steps=100000, sleep=0.05, spawn_child=True)
    trainer = _start_cli(config)
    try:
        running = _wait_running(tmp_path / "job", ["worker-0", "worker-1"])
        pids = [r["pid"] for r in running] + [r["child"] for r in running]
        assert all(proctree.alive(pid) for pid in pids)
        trainer.send_signal(sig)
        out, _ = trainer.communicate(timeout=30)
    finally:
        proctree.kill([trainer.pid])
    assert trainer.returncode == 128 + sig
    assert proctree.wait_gone(pids, timeout=5) == set(), "roles or their children outlived the trainer"
    assert proctree.in_groups([trainer.pid, *pids]) == set()
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert "stopping every process" in out


@pytest.mark.timeout(60)
def test_sigkilled_trainer_takes_its_roles_and_their_children_along(tmp_path: Path) -> None:
    """The roles get a parent-death signal, what they started is stopped by the group watcher: even a
    SIGKILLed trainer leaves nothing running."""
    trainer = _start_cli(write_config(tmp_path, workers=1, steps=100000, sleep=0.05, spawn_child=True))
    try:
        (running,) = _wait_running(tmp_path / "job", ["worker-0"])
        watchers = [pid for pid in proctree.descendants(trainer.pid)
                    if b"watcher.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        trainer.kill()
        trainer.wait(timeout=10)
        left = proctree.wait_gone([running["pid"], running["child"], *watchers], timeout=15)
        assert left == set(), "a role, its child or the watcher outlived the SIGKILLed trainer"
        assert len(watchers) == 1
    finally:
        proctree.kill([trainer.pid])
        if trainer.stdout is not None:
            trainer.stdout.close()


@pytest.mark.timeout(60)
def test_a_second_sigterm_while_stopping_still_exits_143(tmp_path: Path) -> None:
    """The second SIGTERM cuts the grace period short; the exit still says SIGTERM, not Ctrl-C."""
    trainer = _start_cli(write_config(tmp_path, workers=1, steps=100000, sleep=0.05, script=ROLE,
                                      ignore_term=True))
    try:
        _wait_running(tmp_path / "job", ["worker-0"])
        time.sleep(0.5)  # past the role's signal(SIGTERM, SIG_IGN)
        trainer.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the role ignores it: the trainer waits out its 5 s grace period
        trainer.send_signal(signal.SIGTERM)
        out, _ = trainer.communicate(timeout=30)
    finally:
        proctree.kill([trainer.pid])
    assert trainer.returncode == 128 + signal.SIGTERM, out
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.timeout(90)
def test_a_second_run_with_the_same_logdir_is_refused(tmp_path: Path) -> None:
    """It would clear the first run's logs and write the same checkpoints and summary."""
    config = write_config(tmp_path, workers=1, steps=100000, sleep=0.05)
    first = _start_cli(config)
    try:
        _wait_running(tmp_path / "job", ["worker-0"])
        log = tmp_path / "job" / "logs" / "attempt-0" / "worker-0.log"
        inode = log.stat().st_ino
        second = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(config)], cwd=REPO,
                                capture_output=True, text=True, timeout=60, start_new_session=True,
                                check=False)
        assert second.returncode == 2, second.stderr
        for word in ("shardkit train: error:", "logdir", str(tmp_path / "job"), f"pid {first.pid}",
                     "Fix: wait until that run ends", "--set logdir="):
            assert word in second.stderr, (word, second.stderr)
        assert "attempt 0" not in second.stdout
        assert log.stat().st_ino == inode  # the first run's log is untouched
        assert first.poll() is None
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    finally:
        proctree.kill([first.pid])
    result, _ = run(tmp_path, workers=1, steps=3)  # the lock went with the first run
    assert result.ok


def test_rendered_engines_and_bad_options_fail_before_anything_starts(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path), ["engine=kubernetes"])
    with pytest.raises(ConfigError, match=r"does not start processes on kubernetes.*shardkit render"):
        run_job(config, console=io.StringIO())
    config = load_config(write_config(tmp_path), ["engine.gpus_per_node=2"])
    with pytest.raises(ConfigError, match="gpus_per_node"):
        run_job(config, console=io.StringIO())
    assert not (tmp_path / "job" / "logs").exists()


def test_missing_secret_fails_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BEHAVE_UNSET", raising=False)
    config = load_config(write_config(tmp_path, secrets={"TOKEN": {"env": "BEHAVE_UNSET"}}))
    with pytest.raises(ConfigError, match="BEHAVE_UNSET is not set"):
        run_job(config, console=io.StringIO())
    assert not (tmp_path / "job").exists()


def test_driver_roles_per_strategy(tmp_path: Path) -> None:
    base = load_config(write_config(tmp_path))
    assert driver_roles(base) == {"worker", "chief"}
    tf_ps = load_config(write_config(tmp_path), ["strategy=parameter_server", "roles.ps.count=1"])
    assert driver_roles(tf_ps) == {"chief"}


def test_heartbeat_receiver_drops_malformed_datagrams() -> None:
    import socket

    from shardkit.job.protocol import Heartbeat, parse_addr

    with HeartbeatReceiver() as receiver, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        good = Heartbeat(role="worker", index=1, attempt=0, pid=os.getpid(), kind="step", step=3)
        for data in (b"not json", b'{"v": 2}', good.to_bytes(), b"\xff" * 10):
            sock.sendto(data, parse_addr(receiver.addr))
        beats: list[Heartbeat] = []
        deadline = time.monotonic() + 5
        while not beats and time.monotonic() < deadline:
            beats = receiver.receive(0.1)
        time.sleep(0.05)
        beats += receiver.receive(0.0)
    assert beats == [good]
    assert receiver.malformed == 3


def hang_job(folder: Path, *, fault: dict[str, Any]) -> tuple[JobResult, str]:
    """Two torch workers of ``scripts/count.py`` stepping together (an all_reduce a step, 20 steps, a
    checkpoint every 5), heartbeating every 0.2 s with a 3 s timeout: when one hangs, the other waits in
    its next all_reduce and falls silent too."""
    return count_job(folder, workers=2, fault=fault, framework="torch", heartbeat=(0.2, 3.0), sleep=0.05,
                     allreduce=True)


@pytest.mark.timeout(120)
def test_a_stopped_worker_is_named_not_the_one_waiting_for_it_in_the_allreduce(tmp_path: Path) -> None:
    """Worker 1 SIGSTOPs itself at step 8; worker 0 waits for it in the all_reduce, silent too. The OS
    says which one is stopped: the failure names worker 1 (it named worker 0, whose log shows nothing
    wrong), with worker 0 as waiting for it. The stop wakes the stopped worker (SIGCONT after the
    SIGTERM), so it ends by the SIGTERM rather than by a SIGKILL after the grace period."""
    pytest.importorskip("torch")
    result, console = hang_job(tmp_path, fault={"index": 1, "step": 8, "how": "stop"})
    assert result.ok, console
    assert result.restarts == 1
    assert result.steps == 20
    failure = result.failures[0]
    assert failure.name == "worker-1", failure.reason
    assert failure.returncode is None
    assert failure.reason.startswith("silent for"), failure.reason
    assert "; stopped (SIGSTOP or a debugger): state T" in failure.reason
    assert "; worker-0 silent too (" in failure.reason
    assert failure.reason.endswith("s), waiting for it"), failure.reason
    assert "fault stop at step 8" in failure.last_lines
    assert f"attempt 0: worker-1 {failure.reason}" in console  # the summary's restarts line
    assert "attempt 0: worker-1 (killed by SIGTERM)" in (result.samples_unreported or [])
    assert result.attempts[1].resumed_from == 5


@pytest.mark.timeout(120)
def test_a_hang_names_one_silent_worker_and_says_the_other_was_silent_too(tmp_path: Path) -> None:
    """Worker 1 hangs (sleeping, not stopped) at step 8, worker 0 waits for it in the all_reduce: nothing
    tells them apart, so the reason names the other one as silent too and says either may be the cause
    (it named one, as if it alone had hung)."""
    pytest.importorskip("torch")
    result, console = hang_job(tmp_path, fault={"index": 1, "step": 8, "how": "hang"})
    assert result.ok, console
    assert result.restarts == 1
    failure = result.failures[0]
    assert failure.name in ("worker-0", "worker-1")
    other = "worker-1" if failure.name == "worker-0" else "worker-0"
    assert failure.returncode is None
    assert failure.reason.startswith("silent for"), failure.reason
    assert "(heartbeat_timeout 3 s)" in failure.reason
    assert f"; {other} silent too (" in failure.reason
    assert failure.reason.endswith("in an allreduce job every process waits for the slowest one, so any "
                                   "of them may be the cause"), failure.reason
    assert "stopped" not in failure.reason
    assert f"attempt 0: {failure.name} {failure.reason}" in console


@pytest.mark.timeout(60)
def test_stopping_a_group_ends_a_stopped_process_by_its_sigterm(tmp_path: Path) -> None:
    """SIGTERM reaches a stopped process only once it runs again: the stop sends SIGCONT after it, so a
    stopped process ends now, by the SIGTERM, not by the SIGKILL after the grace period (30 s here)."""
    from shardkit.cluster._spec import ClusterSpec, ProcessSpec
    from shardkit.cluster.engines.local import LocalEngine

    code = "import os, signal, time; os.kill(os.getpid(), signal.SIGSTOP); time.sleep(3600)"
    spec = ClusterSpec([ProcessSpec("worker", 0, [sys.executable, "-c", code], {})], "127.0.0.1", 0,
                       tmp_path, None, [])
    group = LocalEngine({"grace": 30}).start(spec, log_dir=tmp_path)
    try:
        (proc,) = group.processes
        deadline = time.monotonic() + 20
        while (info := proctree._stat(proc.pid)) is None or info[0] != "T":  # read /proc/<pid>/stat
            assert time.monotonic() < deadline, f"the process did not stop itself: {info}"
            time.sleep(0.02)
        group.stop()
        assert proc.returncode == -signal.SIGTERM
    finally:
        group.stop(0)


@pytest.mark.timeout(60)
def test_procstate_reports_a_stopped_process_of_this_machine(tmp_path: Path) -> None:
    """The supervisor's evidence: `procstate.stopped` is ``T`` for a SIGSTOPped role process, None for a
    running one; `os_state` is None where there is nothing to read (no such pid, pid 0)."""
    from shardkit.cluster._spec import ClusterSpec, ProcessSpec
    from shardkit.cluster.engines import procstate
    from shardkit.cluster.engines.local import LocalEngine

    code = "import time; time.sleep(3600)"
    spec = ClusterSpec([ProcessSpec("worker", i, [sys.executable, "-c", code], {}) for i in range(2)],
                       "127.0.0.1", 0, tmp_path, None, [])
    group = LocalEngine({"grace": 0}).start(spec, log_dir=tmp_path)
    try:
        stopped, running = group.processes
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while procstate.stopped(stopped) is None:
            assert time.monotonic() < deadline, procstate.os_state(stopped.pid)
            time.sleep(0.02)
        assert procstate.stopped(stopped) == "T"
        assert procstate.os_state(running.pid) in ("R", "S")
        assert procstate.stopped(running) is None
        assert procstate.here(running)
    finally:
        group.stop()  # grace 0: SIGTERM or SIGKILL, whichever lands first (see the test above for SIGTERM)
    assert stopped.returncode in (-signal.SIGTERM, -signal.SIGKILL)
    assert procstate.os_state(stopped.pid) is None  # reaped: gone
    assert procstate.os_state(0) is None


@pytest.mark.timeout(120)
def test_a_logdir_inside_the_dataset_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """``runs/<name>`` is the default logdir, and a dataset written to ``runs/<name>`` (as the demo writes
    ``runs/digits``) had the run's lock, logs and checkpoints land among its Parquet files."""
    import numpy as np

    import shardkit
    from shardkit.job.config import JobConfig

    data = tmp_path / "runs" / "behave"
    shardkit.write_dataset({"x": np.arange(32, dtype=np.float32)}, str(data), row_group_size=8)
    files = sorted(p.name for p in data.iterdir())
    config = yaml.safe_load(write_config(tmp_path, workers=1, steps=3).read_text())
    del config["logdir"]  # the default: runs/behave beside the config
    config["data"] = {"url": "runs/behave", "batch_size": 4}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))

    refused = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(path)], cwd=REPO,
                             capture_output=True, text=True, timeout=100, check=False)

    assert refused.returncode == 2, refused.stdout + refused.stderr
    message = refused.stderr
    assert f"logdir = '{data}'" in message
    assert "the default logdir (runs/behave, in the config file's folder) is the dataset folder " in message
    assert f"{data} (data.url, line " in message
    assert f"Fix: give the job a logdir outside the dataset, e.g. logdir: {data}-job" in message
    assert "attempt 0" not in refused.stdout
    assert sorted(p.name for p in data.iterdir()) == files, "nothing was written into the dataset"

    inside = subprocess.run([sys.executable, "-m", "shardkit.cli", "validate", str(path), "--set",
                             f"logdir={data / 'job'}"], cwd=REPO, capture_output=True, text=True,
                            timeout=100, check=False)
    assert inside.returncode == 2
    said = f"logdir = '{data / 'job'}' (from --set logdir): it is inside the dataset folder {data}"
    assert said in inside.stderr

    # built in Python: the supervisor refuses it as load_config does
    built = JobConfig.from_dict({**config, "logdir": str(data / "job")}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match="it is inside the dataset folder"):
        run_job(built, console=io.StringIO())
    assert sorted(p.name for p in data.iterdir()) == files
    ok = subprocess.run([sys.executable, "-m", "shardkit.cli", "validate", str(path), "--set",
                         f"logdir={data}-job"], cwd=REPO, capture_output=True, text=True, timeout=100,
                        check=False)
    assert ok.returncode == 0, ok.stderr  # the logdir the message suggests
