"""What the torchrun engine tests share (on 127.0.0.1, tests/cluster/test_torchrun.py, and across
network namespaces, tests/multihost/test_torchrun.py): the ids dataset and worker script, job configs,
starting and waiting for nodes, and the sample-by-sample checks.

The worker script is ``tests/cluster/torchrun_scripts/ids.py``: every process logs the ids it trained on,
per step, under ``<logdir>/ids/attempt<a>-rank<r>.jsonl``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import shardkit
from shardkit.job.layout import free_ports

REPO = Path(__file__).resolve().parents[2]
IDS = REPO / "tests" / "cluster" / "torchrun_scripts" / "ids.py"
ROWS, BATCH, EVERY = 160, 4, 4  # world 2: 20 steps, a checkpoint every 4
# Fast membership changes: a dead node is noticed after 3 s, a 1:2 rendezvous waits 4 s for a second node.
FAST_RDZV = {"last_call_timeout": 4, "keep_alive_interval": 1, "keep_alive_max_attempt": 3,
             "join_timeout": 60}


def write_ids_dataset(folder: Path) -> str:
    """The ids dataset (``ROWS`` rows: ``id``, ``x``, ``y``, row groups of 8) under ``folder``; its URL."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)).astype(np.float32)
    schema = shardkit.Schema([shardkit.Field("id", "int64"), shardkit.Field("x", "float32", (4,)),
                              shardkit.Field("y", "float32")])
    url = str(folder / "ids")
    shardkit.write_dataset({"id": np.arange(ROWS), "x": list(x), "y": y}, url, schema=schema,
                           row_group_size=8)
    return url


def write_config(folder: Path, *, data: dict[str, Any], entrypoint: Path, nnodes: str, params: dict[str, Any],
                 checkpoint: dict[str, Any] | None = None, heartbeat_timeout: float = 30.0,
                 endpoint: str | None = None, fault_tolerance: dict[str, Any] | None = None) -> Path:
    """``folder/job.yaml``: a torchrun job of one worker per node, rendezvous at ``endpoint`` (default a
    free port on 127.0.0.1), logdir ``folder/job``; ``fault_tolerance`` adds to the test's settings."""
    config = {
        "name": "trun", "entrypoint": str(entrypoint), "framework": "torch",
        "roles": {"worker": {"count": 1}}, "data": data,
        "checkpoint": checkpoint or {"every_steps": EVERY, "keep": 3},
        "fault_tolerance": {"max_restarts": 2, "heartbeat_interval": 0.2,
                            "heartbeat_timeout": heartbeat_timeout, "startup_timeout": 90.0,
                            **(fault_tolerance or {})},
        "engine": {"name": "torchrun", "nnodes": nnodes,
                   "rdzv_endpoint": endpoint or f"127.0.0.1:{free_ports(1)[0]}",
                   "rdzv_id": folder.name, "rdzv_conf": FAST_RDZV, "grace": 2},
        "logdir": str(folder / "job"), "params": params, "env": {"OMP_NUM_THREADS": "1"},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def ids_config(folder: Path, data_url: str, nnodes: str, *, endpoint: str | None = None,
               fault_tolerance: dict[str, Any] | None = None, **params: Any) -> Path:
    """A job of ``ids.py`` on ``data_url``; ``params`` go to the script (``heartbeat_timeout`` aside)."""
    data = {"url": data_url, "batch_size": BATCH, "seed": 3, "num_epochs": 1,
            "options": {"shuffle_buffer": 24, "workers": 1}}
    timeout = params.pop("heartbeat_timeout", 30.0)
    return write_config(folder, data=data, entrypoint=IDS, nnodes=nnodes, params={"sleep": 0.15, **params},
                        heartbeat_timeout=timeout, endpoint=endpoint, fault_tolerance=fault_tolerance)


def start_nodes(config: Path, count: int = 2) -> list[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    procs = []
    for node in range(count):
        with open(config.parent / f"node-{node}.out", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "shardkit.cli", "train", str(config), "--node-rank", str(node)],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def output(config: Path, node: int) -> str:
    return (config.parent / f"node-{node}.out").read_text(errors="replace")


def wait_until(what: str, condition: Callable[[], bool], procs: list[subprocess.Popen[bytes]],
               timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        exited = [p.returncode for p in procs if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            why = f"agents exited with {exited}" if exited else "timeout"
            raise AssertionError(f"waiting for {what}: {why}")
        time.sleep(0.05)


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 90.0) -> list[int]:
    deadline = time.monotonic() + timeout
    return [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]


def records(job_dir: Path) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """(attempt, rank) -> the process's log lines (the first one is its start record)."""
    out = {}
    for path in (job_dir / "ids").glob("attempt*-rank*.jsonl"):
        attempt, rank = map(int, re.findall(r"\d+", path.name))
        out[(attempt, rank)] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def max_step(job_dir: Path, *, world: int) -> int:
    """The highest step logged by an attempt of ``world`` processes that had a checkpoint behind it."""
    best = 0
    for lines in records(job_dir).values():
        if lines and lines[0]["world"] == world and any(r.get("saved") for r in lines[1:]):
            best = max(best, *(r["step"] for r in lines[1:]))
    return best


def effective_ids(job_dir: Path) -> tuple[Counter[int], list[tuple[int, int, int]]]:
    """The ids of the steps that count (each attempt's steps up to the checkpoint the next attempt resumed
    from), and (attempt, world, start step) per attempt."""
    recs = records(job_dir)
    starts: dict[int, tuple[int, int]] = {}
    for (attempt, rank), lines in recs.items():
        head = lines[0]
        assert head["shard"] == [rank, head["world"]], f"attempt {attempt} rank {rank} read the wrong shard"
        assert head["env"]["RANK"] == str(rank)
        assert starts.setdefault(attempt, (head["world"], head["start"])) == (head["world"], head["start"]), \
            f"the ranks of attempt {attempt} resumed from different steps or disagree on the world"
    attempts = sorted(starts)
    ids: Counter[int] = Counter()
    for (attempt, _), lines in recs.items():
        later = [a for a in attempts if a > attempt]
        resumed_next = starts[later[0]][1] if later else None
        for rec in lines[1:]:
            assert rec["step"] > starts[attempt][1], f"attempt {attempt} retrained step {rec['step']}"
            if resumed_next is None or rec["step"] <= resumed_next:
                ids.update(rec["ids"])
    return ids, [(a, *starts[a]) for a in attempts]


def summary(job_dir: Path, node: int) -> dict[str, Any]:
    path = job_dir / ("summary.json" if node == 0 else f"logs/node-{node}/summary.json")
    return dict(json.loads(path.read_text()))


