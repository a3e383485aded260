"""`ctx.checkpoint` (`Checkpoints`): each rank's RNG states in a real two-process torch DDP job (gloo),
and what a restore does with RNG states saved for another number of processes; the ranks' end."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from shardkit.errors import CheckpointError, CheckpointWarning
from shardkit.job import protocol as p
from shardkit.trainer.checkpoint import CheckpointManager
from shardkit.trainer.checkpoint._state import capture_rng

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "trainer" / "scripts" / "rng_draws.py"
TOGETHER = REPO / "tests" / "trainer" / "scripts" / "finish_together.py"
WORLD = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ddp(folder: Path, config: Path, out: Path, script: Path = SCRIPT) -> list[dict[str, Any]]:
    """Run ``script`` (rng_draws.py) as ranks 0 and 1 of a gloo group (as torchrun would); each rank's
    output. A rank that wrote its output and then aborted at exit passes: gloo's destructor does that
    now and then (ENGINES.md), and shardkit's supervisors count it as finished too."""
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if k not in p.ALL_ENV and not k.startswith("SHARDKIT_")}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                    "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD),
                    "SHARDKIT_CONFIG": str(config), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        procs.append(subprocess.Popen([sys.executable, str(script), str(out)], env=env, cwd=folder,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        for rank, proc in enumerate(procs):
            output, _ = proc.communicate(timeout=90)
            aborted_after = proc.returncode == -signal.SIGABRT and Path(f"{out}.rank{rank}").exists()
            assert proc.returncode == 0 or aborted_after, output
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(WORLD)]


@pytest.mark.timeout(240)
@pytest.mark.distributed
def test_each_ddp_rank_resumes_its_own_random_streams(tmp_path: Path) -> None:
    """Ranks seeded apart (100 + rank) draw, after a restore, what an uninterrupted run draws, rank by
    rank: every rank's RNG states are saved, and each rank gets its own back."""
    (tmp_path / "x.py").touch()
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "name": "rng", "entrypoint": str(tmp_path / "x.py"), "framework": "torch", "strategy": "allreduce",
        "roles": {"worker": {"count": WORLD}}, "logdir": str(tmp_path / "job"),
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 2, "keep": 5}}))
    whole = _ddp(tmp_path, config, tmp_path / "uninterrupted")
    assert [r["start"] for r in whole] == [0, 0]
    assert whole[0]["draws"]["3"] != whole[1]["draws"]["3"]  # the ranks' streams differ

    shutil.rmtree(tmp_path / "ckpt" / "step-000000004")  # a crash after step 2's checkpoint
    resumed = _ddp(tmp_path, config, tmp_path / "resumed")
    for rank in range(WORLD):
        assert resumed[rank]["start"] == 2
        assert resumed[rank]["draws"] == {s: whole[rank]["draws"][s] for s in ("3", "4")}, f"rank {rank}"
    state = json.loads((tmp_path / "ckpt" / "step-000000002" / "state.json").read_text())
    assert len(state["rng_ranks"]) == WORLD
    assert state["rng_ranks"][0] == state["rng"]  # the writer's own


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_ranks_end_the_group_together(tmp_path: Path) -> None:
    """``with ctx:`` returns on a rank only once every rank has finished (rank 0's last save took two
    seconds): a rank that left first aborted at exit now and then, in gloo's destructor."""
    (tmp_path / "x.py").touch()
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "name": "together", "entrypoint": str(tmp_path / "x.py"), "framework": "torch",
        "strategy": "allreduce", "roles": {"worker": {"count": WORLD}}, "logdir": str(tmp_path / "job")}))
    first, second = _ddp(tmp_path, config, tmp_path / "out", TOGETHER)
    assert second["left"] >= first["hook_end"]


def _draws() -> list[float]:
    return [random.random(), float(np.random.rand()), torch.rand(1).item()]


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_restore_gives_each_rank_its_states_or_keeps_the_seeded_ones(tmp_path: Path) -> None:
    ranks = []
    for rank in range(WORLD):
        _seed(100 + rank)
        ranks.append(capture_rng())
    expected = []
    for rank in range(WORLD):
        _seed(100 + rank)
        expected.append(_draws())
    ckpt = CheckpointManager(tmp_path)
    _seed(100)
    ckpt.save(2, rng_ranks=ranks)  # as rank 0 of two writes it

    for rank in range(WORLD):  # the same world size: each rank its own (a warning would fail the test)
        _seed(7)
        assert ckpt.restore(rank=rank, world_size=WORLD) is not None
        assert _draws() == expected[rank]

    _seed(7)
    seeded = _draws()
    for rank, world in ((0, 1), (2, 3)):  # another world size: the seeded streams, and a warning
        _seed(7)
        with pytest.warns(CheckpointWarning, match=rf"holds the random states of 2 processes; process {rank} "
                                                   rf"of {world} keeps its python, numpy and torch random "
                                                   "generators as the script seeded them"):
            assert ckpt.restore(rank=rank, world_size=world) is not None
        assert _draws() == seeded

    _seed(7)
    assert ckpt.restore() is not None  # one process, as before: the writer's states
    assert _draws() == expected[0]

    with pytest.raises(CheckpointError, match=r"restore\(rank=2, world_size=2\) .*0 <= rank < world_size"):
        ckpt.restore(rank=2, world_size=2)


def test_only_the_writers_states_reach_the_writer_alone(tmp_path: Path) -> None:
    """A checkpoint with one process's states (TensorFlow MultiWorkerMirrored, an older save): the
    writer's rank gets them, any other rank keeps its seeded streams and is warned."""
    ckpt = CheckpointManager(tmp_path)
    _seed(100)
    ckpt.save(1)
    _seed(100)
    expected = _draws()
    _seed(7)
    assert ckpt.restore(rank=0, world_size=2) is not None
    assert _draws() == expected
    _seed(7)
    seeded = _draws()
    _seed(7)
    with pytest.warns(CheckpointWarning, match=r"holds the random states of the process that wrote it only; "
                                               r"process 1 of 2 keeps"):
        assert ckpt.restore(rank=1, world_size=2) is not None
    assert _draws() == seeded

