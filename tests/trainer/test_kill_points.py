"""Workers SIGKILLed at every point of a checkpoint interval: every id exactly once per epoch along the
checkpointed lineage, in every run (issue 38, "a run lost a batch").

Each run is a real ``shardkit train`` job (local engine, 2 torch DDP workers over gloo) of
``tests/trainer/scripts/ddp_ids.py``, which records the ids of every step it trains after ``ctx.step``;
its faults SIGKILL a worker at a chosen point (see that script). The lineage is each attempt's steps up
to the step the next attempt resumed from; the property: those steps are 1 .. all, and each epoch's
ids are the dataset's, once each.

The interleaving these runs pin down: a checkpoint committed inside ``ctx.step(s)`` was the newest
before the script had finished step ``s``; a worker killed in between (or stopped by the supervisor
because its peer was killed there) left the job resuming at ``s + 1`` with the rest of step ``s`` in no
attempt: the record of a trained batch was lost. The default run covers the window kills (one run with
a kill just after the checkpointed step, one with two kills in one interval); ``SHARDKIT_FULL=1`` runs
every kill point from one checkpoint to the next on each rank (about 20 runs of ~25 s each: the ``full``
marker, left out of the run otherwise by ``tests/conftest.py``).
"""

from __future__ import annotations

import io
import json
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

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "trainer" / "scripts" / "ddp_ids.py"
ROWS, BATCH, WORLD, EPOCHS, EVERY = 80, 4, 2, 2, 4
STEPS_PER_EPOCH = ROWS // WORLD // BATCH  # 10
STEPS = EPOCHS * STEPS_PER_EPOCH  # 20; checkpoints at 4, 8, 12, 16, 20
pytestmark = [pytest.mark.distributed]


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)).astype(np.float32)
    schema = shardkit.Schema([shardkit.Field("id", "int64"), shardkit.Field("x", "float32", (4,)),
                              shardkit.Field("y", "float32")])
    url = str(tmp_path_factory.mktemp("data") / "ids")
    shardkit.write_dataset({"id": np.arange(ROWS), "x": list(x), "y": y}, url, schema=schema,
                           row_group_size=8)
    return url


def run(folder: Path, data_url: str, faults: list[dict[str, Any]]) -> JobResult:
    config = {
        "name": "kill-points", "entrypoint": str(SCRIPT), "framework": "torch", "strategy": "allreduce",
        "roles": {"worker": {"count": WORLD}},
        "data": {"url": data_url, "batch_size": BATCH, "seed": 5, "num_epochs": EPOCHS,
                 "options": {"shuffle_buffer": 16, "workers": 1}},
        "checkpoint": {"every_steps": EVERY, "keep": 2},
        "fault_tolerance": {"max_restarts": len(faults), "heartbeat_interval": 0.2,
                            "heartbeat_timeout": 6.0, "startup_timeout": 90.0},
        "logdir": str(folder / "job"), "params": {"faults": faults}, "env": {"OMP_NUM_THREADS": "1"},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return run_job(load_config(path), console=io.StringIO())


def lineage(job_dir: Path) -> tuple[dict[tuple[int, int], list[int]], list[int]]:
    """(rank, step) -> the ids trained there along the checkpointed lineage, and each attempt's start."""
    starts: dict[int, int] = {}
    trained: dict[int, dict[tuple[int, int], list[int]]] = {}
    for rank in range(WORLD):
        for line in (job_dir / f"ids-rank{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "start" in rec:
                assert starts.setdefault(rec["attempt"], rec["start"]) == rec["start"], "ranks resumed apart"
            else:
                trained.setdefault(rec["attempt"], {})[(rank, rec["step"])] = rec["ids"]
    kept: dict[tuple[int, int], list[int]] = {}
    for attempt in sorted(starts):
        until = starts.get(attempt + 1, STEPS)
        for (rank, step), batch in trained.get(attempt, {}).items():
            assert step > starts[attempt], f"attempt {attempt} trained step {step} before its start"
            if step <= until:
                kept[(rank, step)] = batch
    return kept, [starts[a] for a in sorted(starts)]


def check_exactly_once(kept: dict[tuple[int, int], list[int]]) -> None:
    for rank in range(WORLD):
        steps = sorted(s for r, s in kept if r == rank)
        assert steps == list(range(1, STEPS + 1)), f"rank {rank}: steps {steps} along the lineage"
    for epoch in range(EPOCHS):
        span = range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
        seen = Counter(i for (_, s), batch in kept.items() if s in span for i in batch)
        missing = sorted(set(range(ROWS)) - set(seen))
        twice = sorted(i for i, n in seen.items() if n > 1)
        assert seen == Counter(range(ROWS)), f"epoch {epoch}: missing ids {missing}, repeated {twice}"


def kill_run(tmp_path: Path, ids: str, faults: list[dict[str, Any]]) -> list[int]:
    result = run(tmp_path, ids, faults)
    assert result.ok, result.format()
    assert [f.reason for f in result.failures] == ["killed by SIGKILL"] * len(faults)
    kept, starts = lineage(tmp_path / "job")
    check_exactly_once(kept)
    assert all(s % EVERY == 0 for s in starts), starts  # every attempt resumed a checkpoint (or none)
    return starts


# Kill points of the interval from the checkpoint of step EVERY to that of 2 * EVERY: ``kill`` SIGKILLs
# a worker before step k, ``kill_after_step`` once ``ctx.step(k)`` returned (before the script recorded
# step k: the rest of the step), ``kill_after_commit`` (rank 0) as soon as step k's COMMIT is written.
_POINTS = ([(rank, "kill", k) for rank in range(WORLD) for k in range(EVERY + 1, 2 * EVERY + 1)]
           + [(rank, "kill_after_step", k) for rank in range(WORLD) for k in range(EVERY, 2 * EVERY)]
           + [(0, "kill_after_commit", EVERY), (0, "crash_commit", EVERY)])
_DEFAULT = {(1, "kill_after_step", EVERY)}  # the window: a peer killed as the chief saves


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("rank", "how", "step"), [
    pytest.param(*point, id=f"rank{point[0]}-{point[1]}-{point[2]}",
                 marks=[] if point in _DEFAULT else [
                     pytest.mark.slow, pytest.mark.full])
    for point in _POINTS])
def test_one_kill_at_every_point_of_a_checkpoint_interval(ids: str, tmp_path: Path, rank: int, how: str,
                                                          step: int) -> None:
    starts = kill_run(tmp_path, ids, [{"rank": rank, "step": step, "how": how, "attempts": [0]}])
    assert len(starts) == 2


@pytest.mark.timeout(300)
def test_two_kills_in_one_checkpoint_interval(ids: str, tmp_path: Path) -> None:
    """The chief killed as the checkpoint of step 4 is committed, then, resumed there, the other worker
    killed at the end of step 8 as the chief saves it: the second attempt resumes from step 4 again."""
    starts = kill_run(tmp_path, ids, [
        {"rank": 0, "step": EVERY, "how": "kill_after_commit", "attempts": [0]},
        {"rank": 1, "step": 2 * EVERY, "how": "kill_after_step", "attempts": [1]},
    ])
    assert starts == [0, EVERY, EVERY]


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize(("first", "second"), [(EVERY + 2, EVERY + 3), (EVERY + 3, 2 * EVERY)])
def test_two_kills_before_steps_of_one_interval(ids: str, tmp_path: Path, first: int, second: int) -> None:
    starts = kill_run(tmp_path, ids, [
        {"rank": 1, "step": first, "how": "kill", "attempts": [0]},
        {"rank": 0, "step": second, "how": "kill", "attempts": [1]},
    ])
    assert starts == [0, EVERY, EVERY]
