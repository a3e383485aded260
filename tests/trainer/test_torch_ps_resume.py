"""Exact per-worker resume of a torch parameter-server job: each worker's reader position is saved with
the ps state that holds its pushes, and given back to it on a restart.

End to end through `shardkit train` (the local engine, gloo/rpc on 127.0.0.1) with
``strategy_scripts/resume_ps.py``, whose model counts each worker's pushes in the ps state; plus the
pieces in process: a ps shard's push order and consistent snapshot, and the checkpoint's per-shard
reader states.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import shardkit
from shardkit.cluster import run_job
from shardkit.errors import CheckpointError, CheckpointWarning
from shardkit.job.config import load_config
from shardkit.trainer.checkpoint import CheckpointManager
from shardkit.trainer.strategies import torch_ps
from shardkit.trainer.strategies.torch_ps import _server as torch_ps_server
from tests.trainer.helpers import Counter
from tests.trainer.scripts import proctree

REPO = Path(__file__).resolve().parents[2]
RESUME_PS = REPO / "tests" / "trainer" / "strategy_scripts" / "resume_ps.py"
ROWS, BATCH, WORKERS = 400, 10, 2
SGD = {"name": "sgd", "lr": 0.5}


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


# ---------------------------------------------------------------------------------------- end to end


def write_job(folder: Path, *, stall_at: int, crash_at: int, every_steps: int, slow: float) -> Path:
    """2 ps and 2 workers over ROWS shuffled rows (200 per worker, 20 steps of BATCH)."""
    rng = np.random.default_rng(0)
    frame = {"id": np.arange(ROWS), "x": list(rng.normal(size=(ROWS, 4)).astype(np.float32)),
             "y": np.arange(ROWS) % 2}
    shardkit.write_dataset(pd.DataFrame(frame), str(folder / "data"), row_group_size=50,
                           schema=shardkit.Schema([shardkit.Field("id", "int64"),
                                                   shardkit.Field("x", "float32", (4,)),
                                                   shardkit.Field("y", "int64")]))
    config = {"name": "ps-resume", "entrypoint": str(RESUME_PS), "framework": "torch",
              "strategy": "parameter_server", "roles": {"ps": {"count": 2}, "worker": {"count": WORKERS}},
              "data": {"url": str(folder / "data"), "batch_size": BATCH, "num_epochs": 1, "shuffle": True,
                       "seed": 3},
              "checkpoint": {"every_steps": every_steps, "keep": 10},
              "fault_tolerance": {"max_restarts": 1, "heartbeat_timeout": 30.0, "startup_timeout": 90.0},
              "params": {"optimizer": SGD,
                         "test": {"stall_at": stall_at, "crash_at": crash_at, "slow": slow}},
              "env": {"OMP_NUM_THREADS": "1"}, "logdir": str(folder / "job")}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def shard_ids(url: str, shard: int) -> list[int]:
    with shardkit.make_reader(url, shard=shard, num_shards=WORKERS, batch_size=BATCH, shuffle=True, seed=3,
                              num_epochs=1, columns=["id"]) as reader:
        return sorted(int(i) for batch in reader for i in batch["id"])


def trained(job: Path, worker: int) -> list[dict[str, Any]]:
    path = job / f"ids-worker-{worker}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def counts(checkpoint: Path) -> list[int]:
    """How many of each worker's pushes the checkpoint's ps state holds (the model's ``count``)."""
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    values = state["params"]["count"].tolist()
    assert values == [round(v) for v in values], values  # whole pushes, exactly
    return [round(v) for v in values]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_each_worker_resumes_where_the_saved_ps_state_left_it(tmp_path: Path) -> None:
    """Worker 1 stalls after 3 steps; worker 0 runs on, saves at steps 5 and 10 (each holding 3 of worker
    1's pushes) and crashes at step 12. On the restart from step 10, each worker continues from its own
    position as of that state: the batches a worker trained before the checkpoint (its pushes the state
    holds) and those it trains after the restart are its shard, each sample once. Before, worker 1
    resumed at worker 0's position, 10 batches in, and skipped its batches 4 to 10 (70 samples)."""
    console = io.StringIO()
    result = run_job(load_config(write_job(tmp_path, stall_at=3, crash_at=12, every_steps=5, slow=0.05)),
                     console=console)
    log = console.getvalue()
    assert result.ok, log
    assert result.restarts == 1, log
    job = tmp_path / "job"
    assert result.attempts[1].resumed_from == 10, log
    saved = job / "checkpoints" / "step-000000010"
    included = counts(saved)
    assert included == [10, 3], log  # the premise: worker 1 was 7 batches behind worker 0
    for worker in range(WORKERS):
        records = trained(job, worker)
        before = [i for r in records if r["attempt"] == 0 and r["step"] <= included[worker] for i in r["ids"]]
        after = [i for r in records if r["attempt"] == 1 for i in r["ids"]]
        assert len(before) == included[worker] * BATCH
        both = before + after
        expected = shard_ids(str(tmp_path / "data"), worker)
        skipped, twice = len(set(expected) - set(both)), len(both) - len(set(both))
        assert (skipped, twice) == (0, 0), f"worker {worker}: {skipped} samples skipped, {twice} repeated"
        assert sorted(both) == expected
    state = json.loads((saved / "state.json").read_text())
    positions = state["reader_shards"]
    assert len(positions) == WORKERS
    assert positions[0] == state["reader"] != positions[1]  # each its own; worker 0's is also `reader`
    # The final checkpoint holds every push of both workers, and both at the end of the epoch.
    final = Path(result.checkpoints[-1].url)
    assert counts(final) == [ROWS // BATCH // WORKERS] * WORKERS
    ends = json.loads((final / "state.json").read_text())["reader_shards"]
    assert ends[0] == ends[1] not in positions


# ---------------------------------------------------------------------------------- a ps shard alone


def _grads(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((1,), value)}


def _shard() -> torch_ps_server.Shard:
    shard = torch_ps_server.Shard()
    shard.load({"a": torch.zeros(1)}, {"name": "sgd", "lr": 1.0}, state=None)
    return shard


def test_a_shard_applies_each_workers_pushes_in_their_order() -> None:
    """rpc may deliver a worker's pushes out of order (``push`` does not wait for the previous one): the
    later one waits, so the state always holds a worker's first n pushes and the position of the n-th."""
    shard = _shard()
    second = shard.push(1, 2, _grads(10.0), '"after 2"')
    assert not second.done()
    assert shard.applied == {}
    first = shard.push(1, 1, _grads(1.0), '"after 1"')
    assert (first.wait(), second.wait()) == (1, 2)
    assert shard.applied == {1: 2}
    assert shard.positions == {1: '"after 2"'}
    assert shard.weights()["a"].item() == -11.0
    with pytest.raises(ValueError, match="pushed number 2 twice"):
        shard.push(1, 2, _grads(1.0), None).wait()


def test_two_shards_snapshot_the_same_pushes_and_the_positions_after_them() -> None:
    """Worker 1's push 2 has reached ps 0 but not yet ps 1 when worker 0 takes the state: ps 1 waits for
    it, pushes arriving meanwhile wait for the snapshot, and both parts hold pushes 1-2 of worker 1 and
    none of worker 0, with worker 1's position after its push 2."""
    ps0, ps1 = _shard(), _shard()
    for shard, position in ((ps0, '"w1 after 1"'), (ps1, None)):
        shard.push(1, 1, _grads(1.0), position).wait()
    ps0.push(1, 2, _grads(1.0), '"w1 after 2"').wait()
    target: dict[int, int] = {}
    for applied in (ps0.hold(), ps1.hold()):
        for worker, n in applied.items():
            target[worker] = max(target.get(worker, 0), n)
    assert target == {1: 2}
    late = [ps0.push(0, 1, _grads(100.0), '"w0 after 1"'), ps1.push(0, 1, _grads(100.0), None)]
    parts = [ps0.snapshot(target), ps1.snapshot(target)]
    assert parts[0].done()
    assert not parts[1].done()
    assert not late[1].done()
    ps1.push(1, 2, _grads(1.0), None).wait()  # arrives at ps 1
    first, second = parts[0].wait(), parts[1].wait()
    assert first["applied"] == second["applied"] == {1: 2}
    assert first["params"]["a"].item() == second["params"]["a"].item() == -2.0
    assert first["positions"] == {1: '"w1 after 2"'}
    assert [f.wait() for f in late] == [3, 3]  # the hold ended with the snapshot: they went through
    assert ps0.positions == {1: '"w1 after 2"', 0: '"w0 after 1"'}


def test_a_released_hold_lets_the_parked_pushes_through_and_a_second_hold_is_refused() -> None:
    shard = _shard()
    assert shard.hold() == {}
    with pytest.raises(RuntimeError, match="held for a snapshot already"):
        shard.hold()
    parked = shard.push(2, 1, _grads(1.0), None)
    assert not parked.done()
    shard.release()
    assert parked.wait() == 1
    with pytest.raises(RuntimeError, match="without a hold"):
        shard.snapshot({}).wait()


def test_seeded_positions_never_replace_a_pushed_one_and_a_load_forgets_them() -> None:
    shard = _shard()
    shard.push(1, 1, _grads(1.0), '"pushed"').wait()
    shard.seed_positions({0: '"restored 0"', 1: '"restored 1"'})
    assert shard.positions == {1: '"pushed"', 0: '"restored 0"'}
    shard.load({"a": torch.zeros(1)}, {"name": "sgd", "lr": 1.0}, state=None)
    assert shard.positions == {}


def test_only_worker_0_takes_the_ps_state() -> None:
    client = torch_ps.ParameterServerClient(torch.nn.Linear(3, 2), num_ps=1, worker=1, optimizer=SGD)
    with pytest.raises(CheckpointError, match="worker 1 asked for the parameter-server state"):
        client.state_dict()


# ---------------------------------------------------------------------- per-shard reader states saved


def test_each_shard_gets_its_own_reader_state_and_another_count_gets_the_writers(tmp_path: Path) -> None:
    ckpt = CheckpointManager(tmp_path / "ckpt")
    ckpt.save(7, reader=Counter(30), reader_shards=[{"value": 30}, {"value": 12}, None])
    saved = json.loads((tmp_path / "ckpt" / "step-000000007" / "state.json").read_text())
    assert saved["reader"] == {"value": 30}
    assert saved["reader_shards"] == [{"value": 30}, {"value": 12}, None]
    for shard, value in ((0, 30), (1, 12), (2, 0)):  # shard 2 had read nothing: it starts afresh
        reader = Counter()
        restored = CheckpointManager(tmp_path / "ckpt").restore(reader=reader, reader_shard=(shard, 3))
        assert restored is not None
        assert reader.value == value
        assert restored.reader_shards == ({"value": 30}, {"value": 12}, None)
    reader = Counter()
    with pytest.warns(CheckpointWarning, match="positions of 3 workers .* this job has 2, so every worker "
                                                "continues from worker 0's position"):
        restored = CheckpointManager(tmp_path / "ckpt").restore(reader=reader, reader_shard=(1, 2))
    assert reader.value == 30
    assert restored is not None
    assert restored.reader_shards == ({"value": 30},) * 2
    reader = Counter()
    CheckpointManager(tmp_path / "ckpt").restore(reader=reader)  # no shard: the writer's, as before
    assert reader.value == 30
