"""ENGINE benchmark, torchrun: the README's digits job with ``engine: torchrun`` as two "nodes" on
127.0.0.1 (two agent processes, ``python -m shardkit.cluster.engines.torchrun job.yaml --node-rank K``,
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

Across hosts (`measure_torchrun_multihost`, root: two network namespaces of `tests.multihost.netns`,
each node's agent on its own host, with its own address and interface, the host name resolving to
127.0.0.1 and no GLOO_SOCKET_IFNAME given):

    first step s     as above, the rendezvous and gloo across the two hosts' addresses
    samples/s        as above
    recovery s       from losing host 1 (every process on it SIGKILLed, as a machine that lost power,
                     right after the first checkpoint) to node 0's first step alone (world 2 -> 1)
    partition s      from cutting host 1's link (silence, no reset) to node 1's agent having stopped its
                     worker and exited (fault_tolerance.lost_job_timeout, `_LOST_JOB_TIMEOUT` here)
    partition recovery s   (extra) from the cut to node 0's first step alone: node 0's worker, blocked
                     in an allreduce with the silent peer, is stopped after heartbeat_timeout

Usage (from the repository root):
    python -m benchmarks.engine_torchrun            # a clean run and two runs with a kill; saves the result
    python -m benchmarks.engine_torchrun --quick    # 3 epochs, not saved (smoke test)
    python -m benchmarks.engine_torchrun --multihost [--quick]   # across 2 hosts (root)
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
_LOST_JOB_TIMEOUT = 15.0  # the multi-host runs' fault_tolerance.lost_job_timeout (seconds)
_HOST_PORT = 29500  # node 0's rendezvous store, on host 0's address (a fresh namespace: every port free)


def _free_port() -> int:
    from shardkit.job.layout import free_ports

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
                [sys.executable, "-m", "shardkit.cluster.engines.torchrun", str(config), "--node-rank",
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


def run_hosts(run_dir: Path, *, epochs: int | None = None, fault: str | None = None) -> dict[str, Any]:
    """The digits job on two hosts (network namespaces), node K's agent on host K; with ``fault``
    (``"node"``: SIGKILL every process of host 1; ``"partition"``: cut host 1's link), in a ``1:2`` job
    once the first checkpoint is committed. Needs root (`tests.multihost.netns.Network`)."""
    from tests.multihost.netns import Network

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    path = _config(run_dir, "1:2" if fault else "2", epochs)
    job_dir = run_dir / "job"
    env = {k: "" for k in os.environ if k.endswith("_SOCKET_IFNAME")}  # shardkit finds each host's own
    with Network(2) as net:
        config = yaml.safe_load(path.read_text())
        config["engine"]["rdzv_endpoint"] = f"{net.hosts[0].addr}:{_HOST_PORT}"
        config["fault_tolerance"]["lost_job_timeout"] = _LOST_JOB_TIMEOUT
        path.write_text(yaml.safe_dump(config))
        started_unix = time.time()
        procs = []
        for node, host in enumerate(net.hosts):
            with open(run_dir / f"node-{node}.out", "wb") as out:
                procs.append(host.popen([sys.executable, "-m", "shardkit.cluster.engines.torchrun", str(path),
                                         "--node-rank", str(node)], env=env, cwd=ROOT, stdout=out,
                                        stderr=subprocess.STDOUT))
        faulted: dict[str, Any] = {}
        deadline = time.monotonic() + _RUN_TIMEOUT_S
        while procs[0].poll() is None and time.monotonic() < deadline:
            if fault and not faulted and any((job_dir / "checkpoints").glob("step-*/COMMIT")):
                if fault == "node":
                    net.hosts[1].kill_all()
                else:
                    net.hosts[1].cut()
                faulted = {"unix": time.time(), "monotonic": time.monotonic()}
            if faulted and "node1_exit_s" not in faulted and procs[1].poll() is not None:
                faulted["node1_exit_s"] = time.monotonic() - faulted["monotonic"]
            time.sleep(0.02)
        for proc in procs if not fault else procs[:1]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(1.0, deadline - time.monotonic()))
        if faulted and "node1_exit_s" not in faulted:
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[1].wait(max(1.0, faulted["monotonic"] + _LOST_JOB_TIMEOUT + 60 - time.monotonic()))
                faulted["node1_exit_s"] = time.monotonic() - faulted["monotonic"]
        codes = [p.poll() for p in procs]
    text = "".join((run_dir / f"node-{n}.out").read_text(errors="replace") for n in (0, 1))
    found_stats = _STATS.findall(text)
    if codes[0] != 0 or (not fault and codes[1] != 0) or not found_stats or (fault and not faulted):
        raise RuntimeError(f"torchrun run on 2 hosts failed ({codes}, fault={fault}):\n{text[-4000:]}")
    stats = json.loads(found_stats[-1])
    summary = json.loads((job_dir / "summary.json").read_text())
    result = {"first_step_s": stats["first_step_unix"] - started_unix,
              "samples_per_s": stats["samples_per_s"], "wall_s": time.time() - started_unix,
              "steps": stats["steps"], "world": stats["world"],
              "test_accuracy": stats["test_accuracy"], "restarts": summary["restarts"], "codes": codes,
              "load_1m": os.getloadavg()[0]}
    if faulted:
        result["recovery_s"] = stats["first_step_unix"] - faulted["unix"]
        result["node1_exit_s"] = faulted.get("node1_exit_s")
    return result


def measure_torchrun_multihost(epochs: int | None = None) -> dict[str, Any]:
    """The torchrun row across two hosts (root): a clean run (first step s, samples/s), host 1 lost after
    the first checkpoint (recovery s) and host 1 cut off (partition s: its node's exit; partition
    recovery s: node 0's first step alone). The keys of `measure_torchrun`'s row, plus
    ``partition_noticed_s``, ``partition_recovery_s``, ``lost_job_timeout_s`` and the three runs."""
    folder = SCRATCH / "engines"
    clean = run_hosts(folder / "torchrun-hosts-clean", epochs=epochs)
    lost = run_hosts(folder / "torchrun-hosts-node", epochs=epochs, fault="node")
    cut = run_hosts(folder / "torchrun-hosts-partition", epochs=epochs, fault="partition")
    return {"engine": "torchrun (2 hosts)", "first_step_s": clean["first_step_s"],
            "samples_per_s": clean["samples_per_s"], "recovery_s": lost["recovery_s"],
            "killed": "host 1 (every process, SIGKILL)", "partition_noticed_s": cut["node1_exit_s"],
            "partition_recovery_s": cut["recovery_s"], "lost_job_timeout_s": _LOST_JOB_TIMEOUT,
            "clean": clean, "lost_node": lost, "partition": cut}


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 epochs, results not saved")
    parser.add_argument("--multihost", action="store_true", help="across 2 hosts (network namespaces, root)")
    args = parser.parse_args()
    if args.multihost:
        hosts = measure_torchrun_multihost(epochs=3 if args.quick else None)
        print(report(hosts))
        print(f"partition: node 1 left {hosts['partition_noticed_s']:.1f} s after the cut (lost_job_timeout "
              f"{_LOST_JOB_TIMEOUT:g} s); node 0 went on alone {hosts['partition_recovery_s']:.1f} s "
              "after it")
        if not args.quick:
            print(f"saved {save_results('engine-torchrun-multihost', hosts).relative_to(ROOT)}")
        return
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
