"""Summaries that tell the truth (issue 25), from the user's side: ``shardkit train`` in a subprocess.

A failed job says the step it reached and its newest checkpoint; a process that never reported a step
is named with ``ctx.step()``; a job that exits 0 without a step is a warning, in the console and in
``summary.json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.trainer.scripts import proctree

REPO = Path(__file__).resolve().parents[2]
BEHAVE = REPO / "tests" / "trainer" / "scripts" / "behave.py"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def _no_orphans() -> Any:
    with proctree.reaped():
        yield


Run = tuple[subprocess.CompletedProcess[str], dict[str, Any]]


def _train(tmp_path: Path, entrypoint: Path, **changes: Any) -> Run:
    job = {"name": "sum", "entrypoint": str(entrypoint), "framework": "torch",
           "roles": {"worker": {"count": 1}}, "logdir": str(tmp_path / "job"),
           "fault_tolerance": {"max_restarts": 1, "heartbeat_interval": 0.2, "startup_timeout": 60},
           **changes}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(tmp_path / "job.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=150, check=False)
    return done, json.loads((tmp_path / "job" / "summary.json").read_text())


def test_a_failed_job_says_the_step_it_reached_and_its_newest_checkpoint(tmp_path: Path) -> None:
    fault = {"role": "worker", "index": 0, "step": 5, "attempts": [0, 1], "how": "exit"}
    done, summary = _train(tmp_path, BEHAVE, checkpoint={"every_steps": 2},
                           params={"steps": 10, "sleep": 0.05, "fault": fault})
    assert done.returncode == 1
    assert summary["status"] == "failed"
    # the last attempt resumed at step 4 and failed before reporting a step: the job still reached 4
    assert summary["steps"] == 4
    assert summary["newest_checkpoint"] == 4
    assert "reached step 4, newest checkpoint step 4" in done.stdout + done.stderr
    assert summary["samples"] > 0


def test_a_failed_job_counts_the_samples_its_newest_checkpoint_holds(tmp_path: Path) -> None:
    """Every attempt exits 3 at step 5; the newest checkpoint is step 3's: 2 workers x 3 steps x 4 samples.
    What each attempt trained after it (step 4) is in no model: the summary said the job's samples less
    those of restarts were "in the final model", counting the last attempt's step 4 too."""
    fault = {"role": "worker", "index": 0, "step": 5, "attempts": [0, 1, 2], "how": "exit"}
    done, summary = _train(tmp_path, BEHAVE, roles={"worker": {"count": 2}}, checkpoint={"every_steps": 3},
                           fault_tolerance={"max_restarts": 2, "heartbeat_interval": 0.2,
                                            "startup_timeout": 60},
                           params={"steps": 10, "sleep": 0.05, "fault": fault})
    assert done.returncode == 1
    assert summary["newest_checkpoint"] == 3
    state = json.loads((tmp_path / "job" / "checkpoints" / "step-000000003" / "state.json").read_text())
    held = 2 * state["reader"]["value"] * 4  # the steps it holds (a counter), of 2 workers, 4 samples each
    assert held == 24
    assert summary["samples_kept"] == held
    assert summary["samples_lost"] == summary["samples"] - held
    out = done.stdout + done.stderr
    assert f"samples: {held} in the newest checkpoint (step 3), where a new run resumes" in out
    assert "in the final model" not in out


def test_a_failed_job_without_restarts_counts_what_it_trained_after_its_checkpoint(tmp_path: Path) -> None:
    fault = {"role": "worker", "index": 0, "step": 5, "attempts": [0], "how": "exit"}
    done, summary = _train(tmp_path, BEHAVE, checkpoint={"every_steps": 3},
                           fault_tolerance={"max_restarts": 0, "heartbeat_interval": 0.2,
                                            "startup_timeout": 60},
                           params={"steps": 10, "sleep": 0.05, "fault": fault})
    assert done.returncode == 1
    assert (summary["samples"], summary["samples_kept"], summary["samples_lost"]) == (16, 12, 4)
    assert ("samples: 12 in the newest checkpoint (step 3), where a new run resumes; 4 trained but not in it"
            in done.stdout + done.stderr)


def test_a_process_that_never_reports_a_step_is_named_with_ctx_step(tmp_path: Path) -> None:
    script = tmp_path / "no_step.py"
    script.write_text("import time, shardkit.trainer\n"
                      "with shardkit.trainer.init() as ctx:\n"
                      "    time.sleep(120)\n")
    done, summary = _train(tmp_path, script, fault_tolerance={"max_restarts": 0, "heartbeat_interval": 0.2,
                                                              "startup_timeout": 4})
    assert done.returncode == 1
    (failure,) = summary["failures"]
    assert "startup_timeout 4 s" in failure["reason"]
    assert "never reported a training step" in failure["reason"]
    assert "ctx.step()" in failure["reason"]
    assert "ctx.step()" in done.stderr
    assert summary["newest_checkpoint"] is None
    assert "reached step 0, newest checkpoint none" in done.stdout + done.stderr


def test_a_job_that_exits_0_without_a_step_is_a_warning(tmp_path: Path) -> None:
    script = tmp_path / "idle.py"
    script.write_text("import shardkit.trainer\n"
                      "with shardkit.trainer.init() as ctx:\n"
                      "    pass\n")
    done, summary = _train(tmp_path, script)
    assert done.returncode == 0, done.stderr
    assert summary["status"] == "succeeded"
    (warning,) = summary["warnings"]
    assert "without reporting a training step" in warning
    assert "ctx.step()" in warning
    assert "warning: the job succeeded without reporting a training step" in done.stdout + done.stderr


def test_a_job_that_reports_steps_has_no_warning(tmp_path: Path) -> None:
    done, summary = _train(tmp_path, BEHAVE, params={"steps": 3, "sleep": 0.01})
    assert done.returncode == 0, done.stderr
    assert summary["warnings"] == []
    assert summary["steps"] == 3
    assert "warning:" not in done.stdout + done.stderr
