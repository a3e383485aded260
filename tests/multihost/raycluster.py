"""A real Ray cluster across the hosts of a `Network`: the head on h0, a worker node on each other host.

Each node is ``ray start --block`` in its host's namespace (the process owns its node: SIGTERM stops
it, and `Network.close` kills whatever is left), with ``--node-ip-address`` its host's address (the host
name resolves to loopback there) and a temp folder of its own under a short folder of this run (Ray's
socket paths must stay under 107 bytes). Token authentication is on, as a real cluster's should be:
the token is a file of this run, named by ``RAY_AUTH_TOKEN_PATH`` to the nodes and to the driver, so
nothing is read from or written to ``~/.ray``.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.multihost.netns import Host, Network

RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6379
#: Each node's object store: small, the jobs pass only a few kB through it.
OBJECT_STORE_BYTES = 100 * 2**20
#: Ray's node health checks made quicker: a lost node is declared dead after ~3 s, not ~15 s.
QUICK_HEALTH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
                "RAY_health_check_failure_threshold": "3"}
_STARTED = "Ray runtime started"
_WAIT_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="WARNING")
deadline = time.monotonic() + float(sys.argv[3])
while len([n for n in ray.nodes() if n["Alive"]]) < int(sys.argv[2]):
    if time.monotonic() > deadline:
        sys.exit(f"{len([n for n in ray.nodes() if n['Alive']])} of {sys.argv[2]} nodes joined")
    time.sleep(0.2)
"""


@dataclass
class RayCluster:
    """A running cluster: ``address`` for ``engine.address``, ``env`` for any driver (its token)."""

    net: Network
    address: str
    env: dict[str, str]
    folder: Path
    nodes: dict[str, subprocess.Popen[Any]] = field(default_factory=dict)

    def log(self, host: Host) -> str:
        return (self.folder / f"{host.name}.out").read_text(errors="replace")

    def start_node(self, host: Host, *, cpus: int, head: bool, env: Mapping[str, str],
                   timeout: float) -> None:
        args = ["--head", "--port", str(PORT), "--include-dashboard=false"] if head else [
            "--address", self.address]
        argv = [RAY, "start", "--block", *args, "--node-ip-address", host.addr, "--num-cpus", str(cpus),
                "--num-gpus", "0", "--object-store-memory", str(OBJECT_STORE_BYTES),
                "--temp-dir", str(self.folder / host.name), "--disable-usage-stats"]
        with open(self.folder / f"{host.name}.out", "wb") as out:
            proc = host.popen(argv, env={**self.env, **env}, stdout=out, stderr=subprocess.STDOUT)
        self.nodes[host.name] = proc
        deadline = time.monotonic() + timeout
        while _STARTED not in self.log(host):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`ray start` on {host.name} did not start its node "
                                   f"(exit {proc.returncode}):\n{self.log(host)[-3000:]}")
            time.sleep(0.1)

    def wait_nodes(self, count: int, timeout: float) -> None:
        """Until ``count`` nodes are alive (a node joins a moment after its `ray start` says it started)."""
        argv = [sys.executable, "-c", _WAIT_NODES, self.address, str(count), str(timeout)]
        got = self.net.hosts[0].run(argv, timeout=timeout + 30, env=self.env)
        if got.returncode != 0:
            raise RuntimeError(f"the Ray cluster did not reach {count} nodes: {got.stderr[-2000:]}")

    def stop(self) -> None:
        """SIGTERM each `ray start --block` (it stops its node's Ray processes), then wait for it."""
        for proc in self.nodes.values():
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)


@contextlib.contextmanager
def ray_cluster(net: Network, *, cpus: tuple[int, ...] = (2, 2), head_env: Mapping[str, str] | None = None,
                timeout: float = 90.0) -> Iterator[RayCluster]:
    """A head on ``net.hosts[0]`` and a worker node on each next host, ``cpus[i]`` CPUs on host ``i``;
    ``head_env`` adds Ray settings to the head (e.g. `QUICK_HEALTH`). Stopped (and its folder removed)
    on exit; `Network.close` ends what outlives that."""
    folder = Path(tempfile.mkdtemp(prefix="skray", dir="/tmp"))
    token = folder / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}
    head = net.hosts[0]
    cluster = RayCluster(net, f"{head.addr}:{PORT}", env, folder)
    try:
        cluster.start_node(head, cpus=cpus[0], head=True, env=head_env or {}, timeout=timeout)
        for host, n in zip(net.hosts[1:], cpus[1:], strict=False):
            cluster.start_node(host, cpus=n, head=False, env={}, timeout=timeout)
        cluster.wait_nodes(len(cpus), timeout)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
