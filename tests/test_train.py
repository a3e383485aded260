"""`shardkit train` end to end with torch DDP (gloo, 2 workers): faults injected by step, recovery checked
sample by sample and bit for bit; the README's digits job.

The role script is ``tests/trainer/scripts/ddp_ids.py``: a linear model on a small shardkit dataset
whose rows carry ids; every rank logs the ids of every step it trained, per attempt.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import shardkit
from shardkit.cluster import run_job
from shardkit.cluster.monitor.report import JobResult
from shardkit.job.config import load_config
from tests.trainer.scripts import proctree

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "trainer" / "scripts" / "ddp_ids.py"
ROWS, BATCH, WORLD, EPOCHS, EVERY = 96, 4, 2, 2, 5
STEPS_PER_EPOCH = ROWS // WORLD // BATCH  # 12
pytestmark = [pytest.mark.distributed]


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


@pytest.fixture(scope="module")
def ids_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1 * rng.normal(size=ROWS)).astype(np.float32)
    schema = shardkit.Schema([shardkit.Field("id", "int64"), shardkit.Field("x", "float32", (4,)),
                              shardkit.Field("y", "float32")])
    url = str(tmp_path_factory.mktemp("data") / "ids")
    shardkit.write_dataset({"id": np.arange(ROWS), "x": list(x), "y": y}, url, schema=schema,
                           row_group_size=8)
    return url


def write_config(folder: Path, data_url: str, checkpoint: dict[str, Any] | None = None,
                 **params: Any) -> Path:
    config = {
        "name": "ddp-ids", "entrypoint": str(SCRIPT), "framework": "torch", "strategy": "allreduce",
        "roles": {"worker": {"count": WORLD}},
        "data": {"url": data_url, "batch_size": BATCH, "seed": 3, "num_epochs": EPOCHS,
                 "options": {"shuffle_buffer": 24, "workers": 1}},
        "checkpoint": checkpoint or {"every_steps": EVERY, "keep": 2},
        "fault_tolerance": {"max_restarts": 2, "heartbeat_interval": 0.2, "heartbeat_timeout": 6.0,
                            "startup_timeout": 90.0},
        "logdir": str(folder / "job"), "params": params, "env": {"OMP_NUM_THREADS": "1"},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(folder: Path, data_url: str, checkpoint: dict[str, Any] | None = None,
        **params: Any) -> tuple[JobResult, str]:
    console = io.StringIO()
    result = run_job(load_config(write_config(folder, data_url, checkpoint, **params)), console=console)
    return result, console.getvalue()


def records(job_dir: Path) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for rank in range(WORLD):
        lines = (job_dir / f"ids-rank{rank}.jsonl").read_text().splitlines()
        out[rank] = [json.loads(line) for line in lines]
    return out


def effective_steps(job_dir: Path) -> tuple[dict[tuple[int, int], list[int]], list[int]]:
    """The steps that count: each attempt's steps up to where the next attempt resumed. Returns
    (rank, step) -> ids and the step each attempt started from."""
    starts: dict[int, int] = {}
    by_attempt: dict[int, dict[tuple[int, int], list[int]]] = {}
    for rank, lines in records(job_dir).items():
        for rec in lines:
            if "start" in rec:
                assert starts.setdefault(rec["attempt"], rec["start"]) == rec["start"], "ranks resumed apart"
            else:
                by_attempt.setdefault(rec["attempt"], {})[(rank, rec["step"])] = rec["ids"]
    attempts = sorted(starts)
    effective: dict[tuple[int, int], list[int]] = {}
    for a in attempts:
        resumed_next = starts.get(a + 1)
        for (rank, step), ids in by_attempt.get(a, {}).items():
            assert step > starts[a], f"attempt {a} retrained step {step} before its checkpoint {starts[a]}"
            if resumed_next is None or step <= resumed_next:
                effective[(rank, step)] = ids
    return effective, [starts[a] for a in attempts]


def check_every_sample_once(effective: dict[tuple[int, int], list[int]]) -> None:
    assert sorted({s for _, s in effective}) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    for epoch in range(EPOCHS):
        steps = range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
        ids = Counter(i for (_, s), batch in effective.items() if s in steps for i in batch)
        assert ids == Counter(range(ROWS)), f"epoch {epoch}: not every sample exactly once"


def final_weights(job_dir: Path) -> dict[str, Any]:
    return dict(torch.load(job_dir / "final.pt", weights_only=True))


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), f"{key} differs: {value} vs {b[key]}"


@pytest.fixture(scope="module")
def uninterrupted(ids_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[JobResult, Path]:
    folder = tmp_path_factory.mktemp("uninterrupted")
    with proctree.reaped():
        result, _ = run(folder, ids_dataset)
    return result, folder / "job"


@pytest.mark.timeout(120)
def test_uninterrupted_run_trains_every_sample_and_the_loss_falls(
    uninterrupted: tuple[JobResult, Path],
) -> None:
    result, job_dir = uninterrupted
    assert result.ok
    assert result.restarts == 0
    assert result.steps == EPOCHS * STEPS_PER_EPOCH
    effective, starts = effective_steps(job_dir)
    assert starts == [0]
    check_every_sample_once(effective)
    losses = [rec["loss"] for rec in records(job_dir)[0] if "loss" in rec]
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])
    assert [c.step for c in result.checkpoints] == [5, 10, 15, 20, 24]  # every 5 steps, and the last


@pytest.mark.timeout(180)
def test_sigkilled_worker_resumes_from_checkpoint_bitwise(ids_dataset: str, tmp_path: Path,
                                                           uninterrupted: tuple[JobResult, Path]) -> None:
    result, console = run(tmp_path, ids_dataset, fault={"rank": 1, "step": 8, "how": "kill"})
    job_dir = tmp_path / "job"
    assert result.ok
    assert result.restarts == 1
    failure = result.failures[0]
    assert (failure.attempt, failure.name, failure.reason) == (0, "worker-1", "killed by SIGKILL")
    effective, starts = effective_steps(job_dir)
    assert starts == [0, EVERY]  # attempt 1 resumed from the checkpoint of step 5, mid-epoch
    lost = {rec["step"] for rec in records(job_dir)[0] if rec.get("attempt") == 0 and "step" in rec}
    assert max(lost) > EVERY  # steps after the checkpoint were trained, then redone
    check_every_sample_once(effective)
    assert effective == effective_steps(uninterrupted[1])[0]  # the same batches at the same steps
    assert_bitwise_equal(final_weights(job_dir), final_weights(uninterrupted[1]))
    # per-role logs of both attempts, TensorBoard scalars, the summary
    for attempt in (0, 1):
        for rank in range(WORLD):
            assert (job_dir / "logs" / f"attempt-{attempt}" / f"worker-{rank}.log").is_file()
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(job_dir / "tensorboard"))
    acc.Reload()
    assert {"loss", "samples_per_s", "restarts"} <= set(acc.Tags()["scalars"])
    assert max(e.value for e in acc.Scalars("restarts")) == 1
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded"
    assert summary["restarts"] == 1
    assert summary["failures"][0]["reason"] == "killed by SIGKILL"
    assert "restart 1" in console


@pytest.mark.timeout(180)
def test_hung_worker_is_detected_and_the_job_recovers(ids_dataset: str, tmp_path: Path,
                                                      uninterrupted: tuple[JobResult, Path]) -> None:
    result, _ = run(tmp_path, ids_dataset, fault={"rank": 1, "step": 8, "how": "hang"})
    assert result.ok
    assert result.restarts == 1
    failure = result.failures[0]
    assert failure.returncode is None
    assert failure.reason.startswith("silent for")
    assert failure.silent_s is not None
    assert failure.silent_s < 6.0 + 5.0  # within the timeout (plus polling, on a busy machine)
    effective, starts = effective_steps(tmp_path / "job")
    assert starts == [0, EVERY]
    check_every_sample_once(effective)
    assert_bitwise_equal(final_weights(tmp_path / "job"), final_weights(uninterrupted[1]))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["crash_commit", "crash_write"])
def test_crash_during_checkpoint_save_resumes_from_the_previous_one(
    ids_dataset: str, tmp_path: Path, how: str, uninterrupted: tuple[JobResult, Path]
) -> None:
    result, _ = run(tmp_path, ids_dataset, fault={"rank": 0, "step": 2 * EVERY, "how": how})
    job_dir = tmp_path / "job"
    assert result.ok
    assert result.restarts == 1
    assert result.failures[0].name == "worker-0"
    assert result.failures[0].reason == "killed by SIGKILL"
    effective, starts = effective_steps(job_dir)
    assert starts == [0, EVERY]  # step 10 was never committed: the restart used step 5
    assert result.attempts[1].resumed_from == EVERY
    log = (job_dir / "logs" / "attempt-1" / "worker-0.log").read_text()
    assert "CheckpointWarning" in log
    assert "step-000000010" in log
    check_every_sample_once(effective)
    assert_bitwise_equal(final_weights(job_dir), final_weights(uninterrupted[1]))


@pytest.mark.timeout(120)
def test_every_seconds_saves_at_the_same_steps_on_every_rank(ids_dataset: str, tmp_path: Path) -> None:
    """With a time-based schedule rank 0's clock decides and broadcasts, so the ranks save together."""
    result, _ = run(tmp_path, ids_dataset, checkpoint={"every_seconds": 0.3, "keep": 10}, sleep=0.06)
    assert result.ok
    saved = {rank: [r["step"] for r in lines if r.get("saved")]
             for rank, lines in records(tmp_path / "job").items()}
    assert saved[0] == saved[1]
    assert len(saved[0]) >= 2
    # and the last step, which a time-based save may have made already
    assert [c.step for c in result.checkpoints] == list(dict.fromkeys([*saved[0], EPOCHS * STEPS_PER_EPOCH]))


@pytest.mark.timeout(180)
def test_a_job_reports_the_share_of_its_steps_spent_waiting_for_data(ids_dataset: str,
                                                                      tmp_path: Path) -> None:
    """A planted slow data stage (a transform that sleeps) shows a high ``data_wait``; a planted slow
    training step (a sleep after each step) a low one: in the summary, summary.json and TensorBoard."""
    for name in ("data", "step"):
        (tmp_path / name).mkdir()
    slow_data, console = run(tmp_path / "data", ids_dataset, slow_data=0.02)  # 0.08 s per 4-sample batch
    slow_step, _ = run(tmp_path / "step", ids_dataset, sleep=0.1)
    assert slow_data.ok
    assert slow_step.ok
    assert slow_data.metrics["data_wait"] > 0.5
    assert slow_data.metrics["data_wait/transform"] > 0.5  # what it waited for: the transform stage
    assert slow_step.metrics["data_wait"] < 0.5
    assert "data wait" in console
    assert "(transform " in console  # "last metrics: data wait 97% (transform 96%), loss ..."
    summary = json.loads((tmp_path / "data" / "job" / "summary.json").read_text())
    assert summary["metrics"]["data_wait"] == slow_data.metrics["data_wait"]
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(tmp_path / "data" / "job" / "tensorboard"))
    acc.Reload()
    assert max(e.value for e in acc.Scalars("data_wait")) > 0.5
    assert max(e.value for e in acc.Scalars("data_wait/transform")) > 0.5


@pytest.mark.timeout(180)
def test_a_stalled_data_stage_is_reported_before_the_heartbeat_timeout(ids_dataset: str,
                                                                         tmp_path: Path) -> None:
    """Rank 1's transform sleeps 30 s: the rank says on its console which stage it waits for before the
    supervisor, 6 s without a heartbeat later, restarts the job (which then trains every sample once)."""
    result, console = run(tmp_path, ids_dataset, stall_data={"rank": 1, "step": 6, "seconds": 30})
    assert result.ok
    assert result.restarts == 1
    assert result.failures[0].reason.startswith("silent for")
    lines = console.splitlines()
    stalled = [i for i, line in enumerate(lines) if "no batch for" in line]
    restarted = [i for i, line in enumerate(lines) if "silent for" in line]
    assert stalled, console
    assert restarted, console
    assert stalled[0] < restarted[0]
    assert "[worker-1]" in lines[stalled[0]]
    assert "the decode/transform stage" in lines[stalled[0]]
    effective, _ = effective_steps(tmp_path / "job")
    check_every_sample_once(effective)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_digits_example_reaches_95_percent(tmp_path: Path) -> None:
    """The README's main job, as `shardkit train` runs it from the command line."""
    data = tmp_path / "digits"
    subprocess.run([sys.executable, str(REPO / "examples" / "make_digits.py"), str(data)], check=True,
                   capture_output=True, timeout=60)
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "train", str(REPO / "examples" / "digits.yaml"),
         "--set", f"data.url={data}", "--set", f"logdir={tmp_path / 'job'}"],
        capture_output=True, text=True, timeout=170, start_new_session=True, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = json.loads(re.search(r"TRAIN_STATS (\{.*\})", proc.stdout).group(1))  # type: ignore[union-attr]
    assert stats["test_accuracy"] >= 0.95
    assert "test accuracy:" in proc.stdout
    assert "job digits succeeded" in proc.stdout
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    # The script's rate is over the steps after the first (their clock starts as the first one ends): it
    # counts their samples only, not the first step's 2 x 32 as well.
    assert stats["samples_per_s"] * stats["seconds"] == pytest.approx(summary["samples"] - 2 * 32)
    assert stats["samples"] == summary["samples"] - 2 * 32
    assert (summary["samples"], summary["samples_exact"]) == (20 * 1500, True)  # every epoch of both shards


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_torch_ps_example_reports_only_worker_0s_own_figures(tmp_path: Path, digits: str) -> None:
    """The workers of a parameter-server job run at their own pace: worker 0 knows its samples and its
    time, not the others' (it printed its samples x the number of workers / its own time, taken before
    the others were done, as the job's samples/s). The job's figures are the summary's, over every worker."""
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "train", str(REPO / "examples" / "digits_torch_ps.yaml"),
         "--set", f"data.url={digits}", "--set", "data.num_epochs=3", "--set", f"logdir={tmp_path / 'job'}"],
        capture_output=True, text=True, timeout=230, start_new_session=True, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "job" / "logs" / "attempt-0" / "worker-0.log").read_text()
    stats = json.loads(re.search(r"TRAIN_STATS (\{.*\})", log).group(1))  # type: ignore[union-attr]
    assert "samples_per_s" not in stats  # no claim about the job's rate
    assert (stats["worker"], stats["worker_samples"]) == (0, 3 * 750)  # 3 epochs of its 750 digits
    assert stats["worker_samples_per_s"] == pytest.approx(stats["worker_samples"] / stats["worker_seconds"])
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert (summary["samples"], summary["samples_exact"]) == (2 * 3 * 750, True)  # both workers, exactly
