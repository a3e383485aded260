"""A Spark standalone cluster on the hosts of a `tests.multihost.netns.Network`, started with PySpark's own
launcher, and the job's processes found on its hosts: for tests/multihost/test_spark.py and
``benchmarks.engine_spark.multihost``.

The pip package has no ``start-master.sh``: ``pyspark/bin/spark-class org.apache.spark.deploy.master.Master``
starts a master and ``... deploy.worker.Worker`` a worker. Each daemon is bound to its host's address
(``--host`` and ``SPARK_LOCAL_IP``), each worker has one core, 1 GiB for executors and its own work folder;
their output goes to ``<folder>/<master|worker>-<host>.log``. `Network.close` ends them with their hosts.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.multihost.netns import Host, Network

PORT = 7077
#: The JVMs' JIT at its first tier (C1) only: a daemon or a job's JVM here lives a minute at most, and the
#: C2 compiler's threads would take a 2-core machine's CPU from the job (a master starts in ~8 s, not ~17).
QUICK_JVM = "-XX:TieredStopAtLevel=1"
_STARTED = {"Master": "I have been elected leader", "Worker": "Successfully registered with master"}


def spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def wait_for(what: str, condition: Callable[[], bool], timeout: float) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waiting for {what}: not after {timeout} s")
        time.sleep(0.1)


def start_daemon(host: Host, kind: str, folder: Path, *args: str) -> Path:
    """A Spark standalone ``Master`` or ``Worker`` on ``host``, bound to its address; returns its log."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"{kind.lower()}-{host.name}.log"
    env = {"SPARK_LOCAL_IP": host.addr, "SPARK_DAEMON_MEMORY": "384m", "SPARK_DAEMON_JAVA_OPTS": QUICK_JVM,
           "SPARK_LOCAL_DIRS": str(folder / f"local-{host.name}")}
    with open(log, "ab") as out:
        host.popen([spark_class(), f"org.apache.spark.deploy.{kind.lower()}.{kind}", "--host", host.addr,
                    *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    return log


def start_cluster(master: Host, workers: list[Host], folder: Path, *, timeout: float = 90.0) -> str:
    """A master on ``master`` and a one-core worker on each of ``workers``; returns the master's URL once
    every worker has registered with it."""
    logs = [start_daemon(master, "Master", folder, "--port", str(PORT), "--webui-port", "0")]
    wait_for("the Spark master", lambda: _STARTED["Master"] in logs[0].read_text(errors="replace"), timeout)
    url = f"spark://{master.addr}:{PORT}"
    for host in workers:
        logs.append(start_daemon(host, "Worker", folder, "--cores", "1", "--memory", "1g", "--webui-port",
                                 "0", "--work-dir", str(folder / f"work-{host.name}"), url))
    for log in logs[1:]:
        wait_for(f"{log.name} to register",
                 lambda log=log: _STARTED["Worker"] in log.read_text(errors="replace"), timeout)  # type: ignore[misc]
    return url


def role_processes(net: Network, job_dir: Path, attempt: int) -> dict[int, tuple[Host, dict[str, str]]]:
    """``{role index: (host, environment)}`` of the job's worker processes of ``attempt`` running now."""
    found: dict[int, tuple[Host, dict[str, str]]] = {}
    for host in net.hosts:
        for pid in host.pids():
            try:
                raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            except OSError:
                continue
            env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
            if (env.get("SHARDKIT_JOB_DIR") == str(job_dir) and env.get("SHARDKIT_ROLE") == "worker"
                    and env.get("SHARDKIT_ATTEMPT") == str(attempt)):
                found[int(env["SHARDKIT_ROLE_INDEX"])] = (host, env)
    return found
