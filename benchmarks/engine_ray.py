"""ENGINE benchmark, Ray: the README's digits job through ``shardkit train`` with ``engine: ray`` (a local
Ray instance started by the engine), measured like every engine of the table (see `measure_engine`):

    first step s     from launching ``shardkit train`` to the first training step (Ray's start, the
                     actors, the role processes' imports, torch's rendezvous, the data plan)
    samples/s        the training loop's throughput (the script's own figure, rank 0, both ranks' samples)
    recovery s       from SIGKILLing the engine's unit of worker-1 right after the first checkpoint (here
                     its Ray actor) to the first step of the restarted attempt (detection, stopping the
                     group, new actors and processes, restoring the checkpoint)

`multihost` measures the same on a real Ray cluster of two hosts (network namespaces, needs root): the
head and the driver on h0, a worker node on h1, one worker per node; the fault is h1 lost (every process
of its namespace SIGKILLed: raylet, actor, role), and recovery runs from that kill to the first step of
the attempt restarted on h0 (Ray's default node health checks notice the node's death).

Usage (from the repository root):
    python -m benchmarks.engine_ray                # one clean run and one run with a kill; saves the result
    python -m benchmarks.engine_ray --quick        # 3 epochs, not saved (smoke test)
    python -m benchmarks.engine_ray --multihost    # the same on a 2-host Ray cluster (as root)
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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from benchmarks.common import ROOT, SCRATCH, descendants, save_results, table

if TYPE_CHECKING:  # imported where used: the multi-host harness is a test tool
    from tests.multihost.netns import Host
    from tests.multihost.raycluster import RayCluster

EXAMPLE = ROOT / "examples" / "digits.yaml"
_STATS = re.compile(r"TRAIN_STATS (\{.*\})")
_RUN_TIMEOUT_S = 600.0


def digits_data() -> Path:
    """The digits dataset (``examples/make_digits.py``), made once under the scratch folder."""
    url = SCRATCH / "train" / "digits"
    if not (url / "_metadata").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_digits.py"), str(url)], check=True,
                       capture_output=True, cwd=ROOT, timeout=300)
    return url


def _config(run_dir: Path, engine: str | dict[str, Any], epochs: int | None) -> Path:
    config = yaml.safe_load(EXAMPLE.read_text())
    config["entrypoint"] = str(ROOT / "examples" / config["entrypoint"])
    config["data"]["url"] = str(digits_data())
    if epochs is not None:  # a short run: checkpoints early enough for the kill to land mid-run
        config["data"]["num_epochs"] = epochs
        config["checkpoint"]["every_steps"] = 20
    config.update(logdir=str(run_dir / "job"), engine=engine)
    path = run_dir / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _role_process(root: int, job_dir: Path, index: int) -> int | None:
    """worker-``index`` of attempt 0 among ``root``'s descendants (not its DataLoader workers)."""
    want = {f"SHARDKIT_JOB_DIR={job_dir}", "SHARDKIT_ROLE=worker", f"SHARDKIT_ROLE_INDEX={index}",
            "SHARDKIT_ATTEMPT=0"}
    found: dict[int, int] = {}
    for pid in descendants(root):
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"))
            found[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if not want <= env:
            found.pop(pid)
    tops = [pid for pid, parent in found.items() if parent not in found]
    return tops[0] if len(tops) == 1 else None


def _command(pid: int) -> str:
    """``ray::_RoleActor``, ``python -m pyspark.daemon pyspark.worker``: what a process is, briefly."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace").strip("\0").split("\0")
    return " ".join([Path(args[0]).name, *args[1:]])[:60]


def run_train(engine: str | dict[str, Any], run_dir: Path, *, epochs: int | None = None,
              kill: str | None = None) -> dict[str, Any]:
    """``shardkit train`` on the digits job in a fresh process; with ``kill`` (``"role"``: worker-1's
    process; ``"parent"``: what started it, the engine's unit), SIGKILL it once the first checkpoint is
    committed. Returns the script's TRAIN_STATS (of the last attempt) and the timings."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = _config(run_dir, engine, epochs)
    job_dir = run_dir / "job"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    log = run_dir / "train.out"
    started_unix = time.time()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shardkit.cli", "train", str(config)], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def kill_one() -> dict[str, Any] | None:
        pid = _role_process(proc.pid, job_dir, 1)
        if pid is None:
            return None
        target = pid if kill == "role" else int(
            Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        what = _command(target)
        os.kill(target, signal.SIGKILL)
        return {"unix": time.time(), "pid": target, "what": what}

    return follow_run(proc, run_dir, started_unix, label=str(engine), kill=kill_one if kill else None)


def follow_run(proc: subprocess.Popen[bytes], run_dir: Path, started_unix: float, *, label: str,
               kill: Callable[[], dict[str, Any] | None] | None = None,
               stop: Callable[[], None] | None = None) -> dict[str, Any]:
    """Wait for the ``shardkit train`` process ``proc`` (its output in ``run_dir/train.out``, its logdir
    ``run_dir/job``) and measure it; with ``kill``, called once the first checkpoint is committed until
    it returns what it killed (``{"unix": ..., "what": ...}``; None: not yet). ``stop`` ends what is left
    (default: ``proc``'s process tree). Raises RuntimeError naming ``label`` when the run failed."""
    job_dir, log = run_dir / "job", run_dir / "train.out"
    killed: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + _RUN_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if kill is not None and not killed and any((job_dir / "checkpoints").glob("step-*/COMMIT")):
                killed = kill() or {}
            time.sleep(0.02)
        proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if stop is not None:
            stop()
        else:
            for pid in descendants(proc.pid) | {proc.pid}:  # timed out, or a Ray/Spark process left behind
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text(errors="replace")
    found = _STATS.findall(text)
    if proc.returncode != 0 or not found or (kill is not None and not killed):
        raise RuntimeError(f"{label} run failed ({proc.returncode}, killed={killed}):\n{text[-4000:]}")
    stats = json.loads(found[-1])
    summary = json.loads((job_dir / "summary.json").read_text())
    result = {"first_step_s": stats["first_step_unix"] - started_unix,
              "samples_per_s": stats["samples_per_s"], "wall_s": time.time() - started_unix,
              "steps": stats["steps"], "test_accuracy": stats["test_accuracy"],
              "restarts": summary["restarts"], "load_1m": os.getloadavg()[0]}
    if killed:
        result.update(recovery_s=stats["first_step_unix"] - killed["unix"], killed=killed["what"])
    return result


def measure_engine(engine: str | dict[str, Any], *, epochs: int | None = None, kill: str = "parent",
                   name: str | None = None) -> dict[str, Any]:
    """One engine's row of the table: a clean run (first step s, samples/s) and a run where worker-1's
    ``kill`` target is SIGKILLed after the first checkpoint (recovery s). Runs one after the other."""
    label = name or (engine if isinstance(engine, str) else str(engine["name"]))
    clean = run_train(engine, SCRATCH / "engines" / f"{label}-clean", epochs=epochs)
    faulty = run_train(engine, SCRATCH / "engines" / f"{label}-kill", epochs=epochs, kill=kill)
    return {"engine": label, "first_step_s": clean["first_step_s"], "samples_per_s": clean["samples_per_s"],
            "recovery_s": faulty["recovery_s"], "killed": faulty["killed"], "clean": clean, "kill": faulty}


def measure_ray(epochs: int | None = None) -> dict[str, Any]:
    """The Ray row: ``engine: ray`` on a local instance; the kill takes worker-1's Ray actor."""
    return measure_engine("ray", epochs=epochs, kill="parent")


def _on_host(host: Host, cluster: RayCluster, run_dir: Path, *, epochs: int | None,
             lose: Host | None = None) -> dict[str, Any]:
    """`run_train`'s measure of ``shardkit train`` started on ``host`` against ``cluster``; with ``lose`` (a
    `tests.multihost.netns.Host`), every process of that host is SIGKILLed once the first checkpoint is
    committed while a worker runs there."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = _config(run_dir, {"name": "ray", "address": cluster.address, "grace": 2}, epochs)
    job_dir = run_dir / "job"
    log = run_dir / "train.out"
    started_unix = time.time()
    with open(log, "wb") as out:
        proc = host.popen([sys.executable, "-m", "shardkit.cli", "train", str(config)], cwd=ROOT,
                          env=cluster.env, stdout=out, stderr=subprocess.STDOUT)

    def lose_host() -> dict[str, Any] | None:
        if lose is None or not _runs_a_worker(lose, job_dir):
            return None
        lose.kill_all()
        return {"unix": time.time(), "what": f"host {lose.name} (raylet, actor, worker)"}

    def stop() -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    return follow_run(proc, run_dir, started_unix, label="ray on 2 hosts",
                      kill=lose_host if lose is not None else None, stop=stop)


def _runs_a_worker(host: Host, job_dir: Path) -> bool:
    """Whether a worker of the job in ``job_dir`` runs in ``host``'s namespace."""
    want = (f"SHARDKIT_JOB_DIR={job_dir}".encode(), b"SHARDKIT_ROLE=worker")
    for pid in host.pids():
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if all(w in env for w in want):
                return True
    return False


def multihost(epochs: int | None = None) -> dict[str, Any]:
    """The Ray row on two hosts: a Ray cluster with its head on h0 and a worker node on h1 (network
    namespaces joined by a bridge, `tests.multihost.netns`; needs root), ``shardkit train`` on h0 with
    ``engine: {name: ray, address: h0:6379}``, one worker per node. A clean run (first step s,
    samples/s), then a run where h1 is lost after the first checkpoint (recovery s: from the kill to the
    first step of the group restarted on h0). Ray's default node health checks; both runs on one
    cluster, one after the other."""
    from tests.multihost.netns import Network
    from tests.multihost.raycluster import ray_cluster

    folder = SCRATCH / "engines"
    with Network(2) as net, ray_cluster(net, cpus=(2, 2)) as cluster:
        h0, h1 = net.hosts
        clean = _on_host(h0, cluster, folder / "ray-2hosts-clean", epochs=epochs)
        faulty = _on_host(h0, cluster, folder / "ray-2hosts-kill", epochs=epochs, lose=h1)
    return {"engine": "ray, 2 hosts", "first_step_s": clean["first_step_s"],
            "samples_per_s": clean["samples_per_s"], "recovery_s": faulty["recovery_s"],
            "killed": faulty["killed"], "clean": clean, "kill": faulty}


def report(row: dict[str, Any]) -> str:
    return table(["engine", "first step s", "samples/s", "recovery s", "killed", "test accuracy"],
                 [[row["engine"], f"{row['first_step_s']:.1f}", f"{row['samples_per_s']:,.0f}",
                   f"{row['recovery_s']:.1f}", row["killed"], f"{row['clean']['test_accuracy']:.3f}"]])


def main(measure: Any = measure_ray, name: str = "engine-ray", doc: str | None = __doc__) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 epochs, results not saved")
    if measure is measure_ray:
        parser.add_argument("--multihost", action="store_true", help="on a Ray cluster of 2 hosts (root)")
    args = parser.parse_args()
    if getattr(args, "multihost", False):
        measure, name = multihost, "engine-ray-multihost"
    row = measure(epochs=3 if args.quick else None)
    print(report(row))
    if not args.quick:
        print(f"saved {save_results(name, row).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
