"""ENGINE benchmark, Spark: the README's digits job through ``shardkit train`` with ``engine: spark``,
measured as in `benchmarks.engine_ray`: first step s (includes the JVM's start), samples/s, and recovery s.

- `measure_spark`: barrier mode on a ``local[2]`` session the engine starts; the kill SIGKILLs the Python
  worker that runs worker-1's task (the stage fails; the supervisor starts a new one from the checkpoint).
- `multihost`: a Spark standalone cluster across hosts (network namespaces, `tests.multihost.netns`; needs
  root): a master and a one-core worker in h0, one-core workers in h1 and h2, the driver (``shardkit
  train``) in h0. The kill is a lost machine: every process in the namespace of a host that runs a rank
  (not h0) is SIGKILLed right after the first checkpoint; the new stage runs on the two workers left.
  First step s counts from launching ``shardkit train`` on the running cluster (the driver's JVM, the
  executors, the tasks, the role processes, torch's rendezvous across hosts).

Usage (from the repository root):
    python -m benchmarks.engine_spark                # one clean run and one run with a kill; saves the result
    python -m benchmarks.engine_spark --quick        # 3 epochs, not saved (smoke test)
    python -m benchmarks.engine_spark --multihost    # the same across hosts (root); add --quick as above
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from benchmarks.common import ROOT, SCRATCH
from benchmarks.engine_ray import EXAMPLE, digits_data, follow_run, main, measure_engine

if TYPE_CHECKING:
    from tests.multihost.netns import Network

_STATS = re.compile(r"TRAIN_STATS (\{.*\})")


def measure_spark(epochs: int | None = None) -> dict[str, Any]:
    """The Spark row: ``engine: {name: spark, master: local[2]}``; the kill takes worker-1's task."""
    return measure_engine({"name": "spark", "master": "local[2]"}, epochs=epochs, kill="parent", name="spark")


def multihost(epochs: int | None = None) -> dict[str, Any]:
    """The multi-host Spark row (see the module's docstring): a clean run (first step s, samples/s), then a
    run that loses a worker host after the first checkpoint (recovery s: from the kill to the first step of
    the restarted stage), on one standalone cluster of three hosts. Needs root (``ip netns``).

    Example:
        >>> row = multihost(epochs=3)
        >>> row["engine"], row["recovery_s"]
        ('spark standalone, 3 hosts', 9.8)
    """
    from tests.multihost.netns import Network
    from tests.multihost.spark_cluster import start_cluster

    folder = SCRATCH / "engines" / "spark-multihost"
    shutil.rmtree(folder, ignore_errors=True)
    with Network(3) as net:
        started = time.monotonic()
        url = start_cluster(net.hosts[0], net.hosts, folder / "spark")
        cluster_s = time.monotonic() - started
        engine = {"name": "spark", "master": url, "grace": 2, "conf": {"spark.executor.memory": "512m"}}
        clean = _run_on(net, engine, folder / "clean", epochs=epochs)
        faulty = _run_on(net, engine, folder / "kill", epochs=epochs, kill=True)
    return {"engine": "spark standalone, 3 hosts", "first_step_s": clean["first_step_s"],
            "samples_per_s": clean["samples_per_s"], "recovery_s": faulty["recovery_s"],
            "killed": faulty["killed"], "cluster_start_s": cluster_s, "clean": clean, "kill": faulty}


def _run_on(net: Network, engine: dict[str, Any], run_dir: Path, *, epochs: int | None,
            kill: bool = False) -> dict[str, Any]:
    """``shardkit train`` on the digits job in h0 of ``net``; with ``kill``, once the first checkpoint is
    committed, every process of a host (not h0) that runs a rank is SIGKILLed."""
    from tests.multihost.spark_cluster import role_processes

    run_dir.mkdir(parents=True)
    config = yaml.safe_load(EXAMPLE.read_text())
    config.update(entrypoint=str(ROOT / "examples" / config["entrypoint"]), logdir=str(run_dir / "job"),
                  engine=engine)
    config["data"]["url"] = str(digits_data())
    if epochs is not None:  # a short run: checkpoints early enough for the kill to land mid-run
        config["data"]["num_epochs"] = epochs
        config["checkpoint"]["every_steps"] = 20
    path = run_dir / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    job_dir, log = run_dir / "job", run_dir / "train.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDKIT_", "SPARK_", "PYSPARK_"))}
    h0 = net.hosts[0]
    started_unix = time.time()
    with open(log, "wb") as out:
        proc = h0.popen([sys.executable, "-m", "shardkit.cli", "train", str(path)], env=env, cwd=ROOT,
                        clean_env=True, stdout=out, stderr=subprocess.STDOUT)

    def lose_host() -> dict[str, Any] | None:
        hosts = [host for host, _ in role_processes(net, job_dir, 0).values() if host is not h0]
        if not hosts:
            return None
        hosts[0].kill_all()
        return {"unix": time.time(), "what": f"host {hosts[0].name} (every process)"}

    def stop() -> None:
        if proc.poll() is None:
            proc.kill()

    return follow_run(proc, run_dir, started_unix, label="spark multihost", kill=lose_host if kill else None,
                      stop=stop)


if __name__ == "__main__":
    if "--multihost" in sys.argv:
        sys.argv.remove("--multihost")
        main(multihost, "engine-spark-multihost", __doc__)
    else:
        main(measure_spark, "engine-spark", __doc__)
