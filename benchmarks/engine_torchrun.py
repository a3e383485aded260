"""ENGINE benchmark, torchrun: the README's digits job with ``engine: torchrun`` as two "nodes" on
127.0.0.1 (two agent processes, ``python -m shardkit.cluster.engine_torchrun job.yaml --node-rank K``,
one worker each), measured like every engine of the table (see `benchmarks.engine_ray`):

    first step s     from launching both agents to the first training step (imports, the c10d
                     rendezvous, the workers' start and torch.distributed's rendezvous, the data plan)
    samples/s        the training loop's throughput (the script's own figure, rank 0, both ranks' samples)
    recovery s       from SIGKILLing the worker process of rank 1 right after the first checkpoint to
                     the first step of the restarted attempt (torch's agent sees the exit, both agents
                     stop their workers and meet again in a new rendezvous round, new workers restore
                     the checkpoint)
    node removed s   (extra) the same, when node 1 (its agent and worker) is SIGKILLed in a job
                     with ``nnodes: "1:2"``: the remaining node waits for the dead node's rendezvous
                     keep-alives to expire (keep_alive_interval 1 s x keep_alive_max_attempt 3 here)
                     and the last call (last_call_timeout 2 s), then goes on alone with world size 1

Usage (from the repository root):
    python -m benchmarks.engine_torchrun            # a clean run and two runs with a kill; saves the result
    python -m benchmarks.engine_torchrun --quick    # 3 epochs, not saved (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import ROOT, SCRATCH, descendants, save_results
from benchmarks.engine_ray import digits_data, report

EXAMPLE = ROOT / "examples" / "digits.yaml"
_STATS = re.compile(r"TRAIN_STATS (\{.*\})")
_RUN_TIMEOUT_S = 600.0
_FAST_RDZV = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 3}


def _free_port() -> int:
    from shardkit.cluster.spec import free_ports

    return free_ports(1)[0]


def _config(run_dir: Path, nnodes: str, epochs: int | None) -> Path:
    config = yaml.safe_load(EXAMPLE.read_text())
    config["entrypoint"] = str(ROOT / "examples" / config["entrypoint"])
    config["data"]["url"] = str(digits_data())
    if epochs is not None:
        config["data"]["num_epochs"] = epochs
        config["checkpoint"]["every_steps"] = 20  # a short run still has a checkpoint to kill after
    config["roles"]["worker"]["count"] = 1  # per node: 2 nodes x 1 worker, the example's 2 workers
    config.update(logdir=str(run_dir / "job"), engine={
        "name": "torchrun", "nnodes": nnodes, "rdzv_endpoint": f"127.0.0.1:{_free_port()}",
        "rdzv_id": run_dir.name, **({"rdzv_conf": _FAST_RDZV} if ":" in nnodes else {})})
    path = run_dir / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _rank_process(roots: list[int], job_dir: Path, rank: int) -> tuple[int, int] | None:
    """(agent index, pid) of the attempt-0 worker of ``rank``, found by its environment."""
    want = {f"SHARDKIT_JOB_DIR={job_dir}", f"RANK={rank}", "SHARDKIT_ATTEMPT=0"}
    for node, root in enumerate(roots):
        for pid in descendants(root):
            with contextlib.suppress(OSError):
                env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
                if want <= set(env):
                    return node, pid
    return None


def run_nodes(run_dir: Path, *, epochs: int | None = None, kill: str | None = None) -> dict[str, Any]:
    """The digits job on two agents; with ``kill`` (``"worker"``: rank 1's worker process; ``"node"``:
    node 1's agent and worker, in a ``1:2`` job), SIGKILL it once the first checkpoint is committed."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = _config(run_dir, "1:2" if kill == "node" else "2", epochs)
    job_dir = run_dir / "job"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    started_unix = time.time()
    procs = []
    for node in (0, 1):
        with open(run_dir / f"node-{node}.out", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "shardkit.cluster.engine_torchrun", str(config), "--node-rank",
                 str(node)],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    killed: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + _RUN_TIMEOUT_S
        while procs[0].poll() is None and time.monotonic() < deadline:
            if kill and not killed and any((job_dir / "checkpoints").glob("step-*/COMMIT")):
                found = _rank_process([p.pid for p in procs], job_dir, 1)
                if found is not None and kill == "worker":
                    os.kill(found[1], signal.SIGKILL)
                    killed = {"unix": time.time(), "what": f"rank 1's worker process (node {found[0]})"}
                elif found is not None:  # node 1: node 0 hosts the rendezvous store, the job ends with it
                    for target in [procs[1].pid, *descendants(procs[1].pid)]:
                        os.kill(target, signal.SIGKILL)
                    killed = {"unix": time.time(), "what": "node 1 (its agent and worker)"}
            time.sleep(0.02)
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            for pid in descendants(proc.pid) | {proc.pid}:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    text = "".join((run_dir / f"node-{n}.out").read_text(errors="replace") for n in (0, 1))
    found_stats = _STATS.findall(text)
    survivors = procs[:1] if kill == "node" else procs
    if any(p.returncode != 0 for p in survivors) or not found_stats or (kill and not killed):
        raise RuntimeError(f"torchrun run failed ({[p.returncode for p in procs]}, killed={killed}):\n"
                           f"{text[-4000:]}")
    stats = json.loads(found_stats[-1])
    summary = json.loads((job_dir / "summary.json").read_text())
    result = {"first_step_s": stats["first_step_unix"] - started_unix,
              "samples_per_s": stats["samples_per_s"],
              "wall_s": time.time() - started_unix, "steps": stats["steps"], "world": stats["world"],
              "test_accuracy": stats["test_accuracy"], "restarts": summary["restarts"],
              "load_1m": os.getloadavg()[0]}
    if killed:
        result.update(recovery_s=stats["first_step_unix"] - killed["unix"], killed=killed["what"])
    return result


def measure_torchrun(epochs: int | None = None, *, node_removal: bool = True) -> dict[str, Any]:
    """The torchrun row: a clean run (first step s, samples/s), a run where rank 1's worker is SIGKILLed
    after the first checkpoint (recovery s) and, with ``node_removal``, one where its whole node is."""
    folder = SCRATCH / "engines"
    clean = run_nodes(folder / "torchrun-clean", epochs=epochs)
    faulty = run_nodes(folder / "torchrun-kill", epochs=epochs, kill="worker")
    row = {"engine": "torchrun", "first_step_s": clean["first_step_s"],
           "samples_per_s": clean["samples_per_s"],
           "recovery_s": faulty["recovery_s"], "killed": faulty["killed"], "clean": clean, "kill": faulty}
    if node_removal:
        removed = run_nodes(folder / "torchrun-node", epochs=epochs, kill="node")
        row.update(node_removed_recovery_s=removed["recovery_s"], node_removed=removed)
    return row


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 epochs, results not saved")
    args = parser.parse_args()
    row = measure_torchrun(epochs=3 if args.quick else None)
    print(report(row))
    conf = _FAST_RDZV
    print(f"node removed (world 2 -> 1): recovery {row['node_removed_recovery_s']:.1f} s (rendezvous "
          f"keep-alive {conf['keep_alive_interval']} s x {conf['keep_alive_max_attempt']}, last call "
          f"{conf['last_call_timeout']} s)")
    if not args.quick:
        print(f"saved {save_results('engine-torchrun', row).relative_to(ROOT)}")


if __name__ == "__main__":
    _main()
