"""Roles on a cluster engine's nodes (ray, spark): what starts one process on its node and relays it."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardkit.cluster._spec import ClusterSpec, ProcessSpec
from shardkit.cluster.engines.local import LocalEngine, LocalGroup
from shardkit.job import protocol as p
from shardkit.job.config.sections import DEFAULT_LOST_JOB_TIMEOUT
from shardkit.job.layout import free_ports
from shardkit.job.masking import Masker

__all__ = ["NodeRunner", "Update", "Watchdog", "free_port", "lost_job_timeout", "place"]



@dataclass
class Update:
    """What a node runner saw since its last report: heartbeat datagrams (JSON text), output lines,
    and the exit code once the process is gone (``-signal`` when a signal ended it); in its first
    report, the environment the process was started with on its node (secrets ``<redacted>``), which
    the trainer records in ``processes.json`` (`shardkit.cluster.engines.mirror.MirrorGroup`)."""

    beats: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    returncode: int | None = None
    pid: int = 0
    env: dict[str, str] | None = None

    def to_json(self) -> str:
        return json.dumps({"beats": self.beats, "lines": self.lines, "returncode": self.returncode,
                           "pid": self.pid, "env": self.env}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Update:
        data = json.loads(text)
        return cls([str(b) for b in data["beats"]], [str(x) for x in data["lines"]], data["returncode"],
                   int(data["pid"]), data.get("env"))


class NodeRunner:
    """Starts one role process on this node and collects what it does, without blocking.

    Example (inside a Ray actor or a Spark task):
        >>> runner = NodeRunner(proc, grace=5.0)
        >>> update = runner.collect()            # again and again, until update.returncode is not None
        >>> runner.close()

    Choices: the process is started by the local engine (its own process group, a parent-death signal,
    so that it dies with the actor or task that started it, even on SIGKILL), its output goes to a
    temporary folder on this node, and its heartbeats to a UDP socket of the runner on 127.0.0.1:
    the runner hands them on with the output (``collect``), so that nothing but the engine's own
    channel has to reach the trainer's machine.
    """

    def __init__(self, proc: ProcessSpec, *, grace: float) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        env = dict(proc.env)
        if p.ENV_HEARTBEAT_ADDR in env:
            env[p.ENV_HEARTBEAT_ADDR] = p.format_addr("127.0.0.1", self.sock.getsockname()[1])
        self.dir = Path(tempfile.mkdtemp(prefix=f"shardkit-{proc.name}-"))
        self.group: LocalGroup | None = None
        self.returncode: int | None = None
        try:
            self.group = LocalEngine({"grace": grace}).start(
                ClusterSpec([replace(proc, env=env)], "127.0.0.1", 0, self.dir, None, []), log_dir=self.dir)
        except BaseException:
            self.close()
            raise
        self.process = self.group.processes[0]
        self.pid = self.process.pid
        started = replace(proc, env=env)  # what the process got here: the addresses its node placed
        masker = Masker(env[name] for name in proc.secret_names if name in env)
        self._env: dict[str, str] | None = masker.deep(started.redacted_env())  # sent with the first update

    def collect(self) -> Update:
        """Heartbeats and complete output lines since the last call; after the exit, all that is left."""
        if self.returncode is not None:
            return Update(returncode=self.returncode, pid=self.pid)
        code = self.process.returncode  # first: what it wrote before exiting is then all in the log
        update = Update(self._beats(), self.process.new_lines(final=code is not None), code, self.pid,
                        self._env)
        self.returncode, self._env = code, None
        return update

    def stop(self, grace: float | None = None) -> Update:
        """Stop the process (SIGTERM, SIGKILL after ``grace``) and report what was left."""
        if self.group is None:
            return Update(returncode=self.returncode, pid=0)
        before = self.collect()
        self.group.stop(grace)
        rest = [line for _, line in self.group.final_output()]
        code = self.process.returncode
        self.returncode = code
        return Update(before.beats + self._beats(), before.lines + rest, code, self.pid, before.env)

    def _beats(self) -> list[str]:
        beats = []
        while True:
            try:
                beats.append(self.sock.recv(p.MAX_DATAGRAM_BYTES + 1).decode("utf-8", "replace"))
            except (BlockingIOError, InterruptedError):
                return beats

    def close(self) -> None:
        """Stop the process if it still runs (an exited one is reaped, and what it left behind stopped),
        and remove the temporary folder."""
        if self.group is not None:
            self.group.stop(0)  # once only: a second call does nothing
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def place(procs: Sequence[ProcessSpec], where: Sequence[tuple[str, int]],
          own_devices: Sequence[bool] | None = None) -> list[dict[str, str]]:
    """Each process's environment once it is known where each runs.

    Example:
        >>> envs = place(spec.processes, [("10.0.0.5", 29500), ("10.0.0.6", 41234)])

    ``where[i]`` is the host of process ``i`` and a port free there. The spec was built for one
    machine; this rewrites what depends on the hosts: torch's ``MASTER_ADDR``/``MASTER_PORT`` become
    rank 0's host and port, ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` count the ranked processes on each
    host (0 and 1 for a process whose engine shows it only its own GPUs, ``own_devices[i]``), and
    ``TF_CONFIG``'s cluster lists every member at its host and port.
    """
    envs = [dict(proc.env) for proc in procs]
    ranked = sorted((int(env[p.RANK]), i) for i, env in enumerate(envs) if p.RANK in env)
    if ranked:
        master = where[ranked[0][1]]
        by_host: dict[str, list[int]] = {}
        for _, i in ranked:
            by_host.setdefault(where[i][0], []).append(i)
        for _, i in ranked:
            peers = by_host[where[i][0]]
            local, local_world = peers.index(i), len(peers)
            if own_devices is not None and own_devices[i]:
                local, local_world = 0, 1
            envs[i].update({p.MASTER_ADDR: master[0], p.MASTER_PORT: str(master[1]), p.LOCAL_RANK: str(local),
                            p.LOCAL_WORLD_SIZE: str(local_world)})
    addr = {(proc.role, proc.index): p.format_addr(*where[i]) for i, proc in enumerate(procs)}
    for env in envs:
        if p.TF_CONFIG in env:
            tf_config = json.loads(env[p.TF_CONFIG])
            tf_config["cluster"] = {role: [addr[(role, index)] for index in range(len(members))]
                                    for role, members in tf_config["cluster"].items()}
            env[p.TF_CONFIG] = json.dumps(tf_config, separators=(",", ":"))
    return envs


def free_port() -> int:
    """A TCP port free now on this node (for `place`; the same race as `shardkit.job.layout.free_ports`)."""
    return free_ports(1)[0]


class Watchdog:
    """Ends a node's part of a job once the trainer has not been heard from for ``timeout`` seconds.

    Example (in a Ray actor or a Spark task, beside a `NodeRunner`):
        >>> dog = Watchdog(10.0, on_lost=lambda: runner.close(), what="worker-1")
        >>> dog.heard()       # at every call or byte from the trainer
        >>> dog.cancel()      # the trainer asked for the stop itself

    A partition is silence: neither Ray nor Spark ends the processes on a cut-off node soon (a Ray
    node's processes live until its raylet gives up on the head, a Spark task until its collective
    times out), while the trainer restarts the group elsewhere. Like a torchrun node that lost its
    rendezvous store, the node then ends its own processes after ``fault_tolerance.lost_job_timeout``
    seconds without a word from the trainer (`lost_job_timeout`): ``on_lost`` runs once, in the
    watchdog's thread, after a line on stderr (the engine's log of the actor or executor) says why.
    """

    def __init__(self, timeout: float, on_lost: Callable[[], None], *, what: str) -> None:
        self.timeout, self.on_lost, self.what = timeout, on_lost, what
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardkit-watchdog", daemon=True)
        self._thread.start()

    def heard(self) -> None:
        self._last = time.monotonic()

    def cancel(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout / 4)):
            silent = time.monotonic() - self._last
            if silent >= self.timeout:
                self._done.set()
                print(f"[shardkit] {self.what}: no word from the trainer for {silent:.1f} s "
                      f"(fault_tolerance.lost_job_timeout {self.timeout:g} s): it is unreachable (a network "
                      "partition, or it is gone); stopping the process", file=sys.stderr, flush=True)
                self.on_lost()


def lost_job_timeout(spec: ClusterSpec) -> float:
    """``fault_tolerance.lost_job_timeout`` of the job, from the ``job.json`` the supervisor wrote before the
    attempt (the `ClusterSpec` does not hold it); its default when that cannot be read."""
    try:
        data = json.loads((spec.job_dir / p.JOB_CONFIG_FILE).read_text(encoding="utf-8"))
        return float(data["fault_tolerance"]["lost_job_timeout"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_LOST_JOB_TIMEOUT
