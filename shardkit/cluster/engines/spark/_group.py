"""One attempt on the ``spark`` engine: the barrier stage's thread and the relay its tasks talk to."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from shardkit.cluster._addresses import local_addresses
from shardkit.cluster.engines._remote import Update
from shardkit.cluster.engines.local import group_members
from shardkit.cluster.engines.mirror import MirrorGroup, MirrorProcess, describe_error, is_local

__all__ = ["SparkGroup"]

_SELECT_S = 0.1
_CANCEL_WAIT_S = 30.0
_DRAIN_S = 5.0
#: How often the relay sends each task an empty line: a task that hears nothing for
#: ``fault_tolerance.lost_job_timeout`` ends its process (a partition; see `_BarrierTask._run`).
KEEPALIVE_S = 1.0
#: Seconds beyond ``engine.grace`` that `SparkGroup.stop` waits for the stage to end before cancelling
#: its job group (a process stopped on an executor that answers takes ``grace`` at most).
STOP_SLACK_S = 10.0


# The last Python exception in a Spark error (its text holds the worker's traceback among JVM frames).
_PYTHON_ERROR = re.compile(r"^(?!java|org|scala|py4j)([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$",
                           re.MULTILINE)
# Spark's error when a barrier stage's slot check gave up (its class, and its message's words).
_NO_SLOTS = ("BarrierJobSlotsNumberCheckFailed", "more slots than the total number of slots")


def _python_error(error: BaseException) -> str:
    """What went wrong in a Spark job, briefly: the Python worker's exception when there is one."""
    found = _PYTHON_ERROR.findall(str(error))
    if not found:  # a cancelled job (stop, Ctrl-C: PySpark cancels every job) says so in a long JVM trace
        return "it was cancelled" if "cancelled" in str(error) else describe_error(error)
    name, message = found[-1]
    text = f"{name}: {message.strip()} (raised in a Spark task's Python worker)"
    if name.endswith("ModuleNotFoundError"):
        text += (f". Fix: start the SparkSession with PYSPARK_PYTHON set to a Python that has shardkit "
                 f"(e.g. {sys.executable})")
    return text


def _given_up(host: str, grace: float) -> str:
    where = f" on {host}" if host else ""
    return (f"its Spark task{where} did not answer the request to stop it within {grace + STOP_SLACK_S:g} s "
            f"(engine.grace + {STOP_SLACK_S:g} s): its executor is unreachable (down, or cut off by a "
            "network partition) or too busy to answer; given up here, and the stage's job group cancelled. "
            "The task ends the process there within fault_tolerance.lost_job_timeout of its last word from "
            "this trainer")


@dataclass
class _Conn:
    sock: socket.socket
    buffer: bytes = b""
    index: int | None = None


class SparkGroup(MirrorGroup):
    """The processes of one attempt as the tasks of a barrier stage (see `shardkit.cluster.engines.spark`).

    Two threads: the Spark job (it blocks in ``collect`` until every task has ended), and the relay,
    which accepts one connection per task, answers its hello (``go``, or ``no`` to a stage Spark
    retried or one that comes after `stop`) and feeds its updates to the mirrors.
    """

    def __init__(self, processes: list[MirrorProcess], heartbeat_addr: str | None, *, host: str, token: str,
                 grace: float, slots_timeout: float = 60.0) -> None:
        super().__init__(processes, heartbeat_addr)
        self.token, self.grace, self.slots_timeout = token, grace, slots_timeout
        # A loopback driver listens on loopback only; a cluster's driver on every interface.
        bind = host if is_local(host) and host.startswith("127.") else ""
        self.listener = socket.create_server((bind, 0))
        self.port = self.listener.getsockname()[1]
        self._conns: dict[socket.socket, _Conn] = {}
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._stopping = False
        self._closing = threading.Event()
        self._drained_by = 0.0
        self._relay = threading.Thread(target=self._serve, name="shardkit-spark-relay", daemon=True)
        self._job: threading.Thread | None = None
        self._sc: Any = None
        self._job_group = ""

    def begin(self, sc: Any, task: Any, job_group: str) -> None:
        """Start the relay, then the barrier stage in a thread of its own (Spark jobs block)."""
        from pyspark import InheritableThread

        self._sc, self._job_group = sc, job_group
        self._relay.start()
        n = len(self.processes)

        def run() -> None:
            sc.setJobGroup(job_group, f"shardkit: {n} processes in barrier mode", interruptOnCancel=True)
            try:
                sc.parallelize(range(n), n).barrier().mapPartitions(task).collect()
            except Exception as e:  # the job failed or was cancelled: what has not ended is lost
                if self._stopping:  # cancelled by `stop`, which says what became of each process
                    return
                why = _python_error(e)
                if any(text in str(e) for text in _NO_SLOTS):  # Spark's check of the slots, given up
                    why = (f"the cluster ({sc.master}) did not have the {n} task slots that a barrier stage "
                           f"of this job's {n} processes needs (executor cores / spark.task.cpus, at once) "
                           f"within {self.slots_timeout:g} s (engine.slots_timeout): too few workers remain, "
                           "or they lack the cores or the memory (spark.executor.memory) an executor asks. "
                           "Fix: start or restart workers, give them more cores, or run fewer processes")
                for i in range(n):  # exit code 1: never started, or went down with the stage
                    self.lost(i, f"the Spark job of this attempt ended: {why}", code=1)

        self._job = InheritableThread(target=run, name="shardkit-spark-job", daemon=True)
        self._job.start()

    # -- the relay ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        # After stop, go on until every task has hung up (its last report read), or the drain time passed.
        beat = time.monotonic()
        while not (self._closing.is_set() and (not self._conns or time.monotonic() > self._drained_by)):
            with self._lock:
                socks = [self.listener, *self._conns]
                if time.monotonic() - beat >= KEEPALIVE_S:
                    beat = time.monotonic()
                    for state in self._conns.values():
                        if state.index is not None:  # never blocks: a cut-off task's buffer just fills
                            with contextlib.suppress(OSError):
                                state.sock.send(b"\n", socket.MSG_DONTWAIT)
            try:
                readable = select.select(socks, [], [], _SELECT_S)[0]
            except (OSError, ValueError):  # a socket closed under select by stop(): look again
                continue
            for sock in readable:
                if sock is self.listener:
                    with contextlib.suppress(OSError):
                        conn, _ = self.listener.accept()
                        with self._lock:
                            self._conns[conn] = _Conn(conn)
                    continue
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                state = self._conns[sock]
                if not data:
                    self._hangup(state)
                    continue
                state.buffer += data
                while b"\n" in state.buffer:
                    line, state.buffer = state.buffer.split(b"\n", 1)
                    self._message(state, line.decode("utf-8", "replace"))

    def _message(self, state: _Conn, line: str) -> None:
        if state.index is not None:
            self.feed(state.index, Update.from_json(line))
            return
        try:
            hello = json.loads(line)
            index = hello["index"]
            ok = (hello["token"] == self.token and isinstance(index, int) and 0 <= index < len(self.processes)
                  and index not in self._seen and not self._stopping)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:  # a retried stage, a stranger: nothing to start
            with contextlib.suppress(OSError):
                state.sock.sendall(b"no\n")
            return
        self._seen.add(index)
        state.index = index
        self.processes[index].host = str(hello.get("host", ""))
        with contextlib.suppress(OSError):
            state.sock.sendall(b"go\n")

    def _hangup(self, state: _Conn) -> None:
        with self._lock:
            self._conns.pop(state.sock, None)
        state.sock.close()
        if state.index is not None:
            self.lost(state.index, "its Spark task ended without reporting the exit (its Python worker died "
                      "or Spark killed the task)")

    # -- stopping ----------------------------------------------------------------------------------
    def stop(self, grace: float | None = None) -> None:
        """Tell every task to stop its process (SIGTERM, SIGKILL after ``grace``); wait ``grace`` +
        `STOP_SLACK_S` seconds for the stage to end, then cancel its job group (a task on an executor
        that does not answer, cut off say, is given up: its own watchdog ends its process there); then
        kill what is left on this machine."""
        grace = self.grace if grace is None else grace
        self._stopping = True
        with self._lock:
            conns = [c for c in self._conns.values() if c.index is not None]
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.sendall(b"stop\n")
        cancelled = False
        try:
            if self._job is not None:
                self._job.join(grace + STOP_SLACK_S)
                if self._job.is_alive():
                    cancelled = True
                    self._sc.cancelJobGroup(self._job_group)
                    self._job.join(_CANCEL_WAIT_S)
        finally:
            for proc in self.processes:  # a task Spark could not end: its process, if on this machine
                here = is_local(proc.host) or proc.host in local_addresses()
                if proc.pid and here and group_members(proc.pid):
                    with contextlib.suppress(OSError):
                        os.killpg(proc.pid, signal.SIGKILL)
            self._drained_by = time.monotonic() + _DRAIN_S
            self._closing.set()
            if self._relay.is_alive():
                self._relay.join()
            with self._lock:
                silent = {c.index for c in self._conns.values() if c.index is not None}
                for conn in list(self._conns.values()):
                    conn.sock.close()
                self._conns.clear()
            self.listener.close()
            for i, proc in enumerate(self.processes):
                if proc.returncode is None and i in silent and cancelled:
                    self.lost(i, _given_up(proc.host, grace))
                elif proc.returncode is None:
                    self.lost(i, f"stopped with its Spark task ({proc.name} had not reported its exit)")
            self.close()
