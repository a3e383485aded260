"""The ``spark`` engine: the processes of a job as the tasks of one Spark barrier stage."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import select
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.cluster._addresses import collective_env, is_loopback, local_addresses, resolve, route_source
from shardkit.cluster._spec import ClusterSpec, ProcessSpec
from shardkit.cluster.engines._remote import NodeRunner, Update, free_port, lost_job_timeout, place
from shardkit.cluster.engines.mirror import MirrorProcess, Options
from shardkit.cluster.engines.spark._group import SparkGroup
from shardkit.errors import ConfigError, EngineUnreachableError, require
from shardkit.job.config.sections import DEFAULT_LOST_JOB_TIMEOUT

if TYPE_CHECKING:
    from shardkit.job.config import JobConfig

__all__ = ["SparkEngine", "check_master", "executor_heartbeats"]

_OPTIONS = ("master", "conf", "grace", "connect_timeout", "slots_timeout")
_POLL_S = 0.1
_LOCAL = re.compile(r"local(?:\[(\d+|\*)(?:,\s*\d+)?\])?\Z")
_STANDALONE = "spark://"
_SLOTS_CHECK_S = 2  # how often Spark looks again for the slots of a barrier stage (its default: 15 s)


def _own_address(executor_host: str, driver_host: str) -> str:
    """The address this task's processes bind their collectives to and advertise to their peers.

    The executor's own address as Spark knows it (the worker's ``--host``) when this node holds it
    (loopback only with a loopback driver: a local master); else, as for a worker started under a host
    name that resolves to loopback here, the address of the interface that routes to the driver, which
    the other executors reach too.
    """
    with contextlib.suppress(OSError, ValueError):
        addr = resolve(executor_host)
        if is_loopback(addr) if is_loopback(driver_host) else addr in local_addresses():
            return addr
    return route_source(driver_host)


@dataclass(frozen=True)
class _BarrierTask:
    """What every task of the barrier stage runs; plain data, its class imported on the executors."""

    processes: list[ProcessSpec]
    relay: tuple[str, int]
    token: str
    grace: float
    lost_after: float = DEFAULT_LOST_JOB_TIMEOUT  # the relay silent this long, the task ends

    def __call__(self, _: Iterator[int]) -> Iterator[int]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        i = ctx.partitionId()
        host = _own_address(ctx.getTaskInfos()[i].address.rpartition(":")[0].strip("[]"), self.relay[0])
        where = [tuple(json.loads(m)) for m in ctx.allGather(json.dumps([host, free_port()]))]
        gpus = ctx.resources().get("gpu")
        envs = place(self.processes, where, [gpus is not None] * len(where))  # type: ignore[arg-type]
        env = envs[i] if gpus is None else {**envs[i], "CUDA_VISIBLE_DEVICES": ",".join(gpus.addresses)}
        env.update(collective_env(host, {**os.environ, **env}))  # gloo/NCCL on this node's interface
        with socket.create_connection(self.relay, timeout=60) as conn:
            conn.sendall((json.dumps({"token": self.token, "index": i, "host": host}) + "\n").encode())
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = conn.recv(1)
                if not chunk:
                    break
                answer += chunk
            if answer != b"go\n":  # a stage Spark retried, or the attempt is over: nothing to start
                yield -1
                return
            yield self._run(conn, replace(self.processes[i], env=env))

    def _run(self, conn: socket.socket, proc: ProcessSpec) -> int:
        """Run the process, reporting to the relay, until it exits or the relay says ``stop`` (or hangs up).

        The relay sends an empty line every `_KEEPALIVE_S`: a relay silent for ``lost_after`` seconds
        (``fault_tolerance.lost_job_timeout``; this executor cut off from the driver, or the trainer
        gone) ends the process and the task, as a torchrun node that lost its store does; else the task
        would run until the process's collective times out, long after the stage was restarted
        elsewhere. A report that cannot be sent for as long ends them too."""
        try:
            runner = NodeRunner(proc, grace=self.grace)
        except OSError as e:  # reported like an exit: a failed task would make Spark retry the stage
            why = f"[shardkit] could not start {proc.argv[0]} on this executor: {e}"
            conn.sendall((Update(lines=[why], returncode=127).to_json() + "\n").encode())
            return 127
        conn.settimeout(self.lost_after)  # a send that makes no progress this long fails
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: unacknowledged data this long aborts the connection
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.lost_after * 1000))
        heard, received = time.monotonic(), b""
        try:
            update = Update(pid=runner.pid)
            while True:
                if update.beats or update.lines or update.pid or update.env or update.returncode is not None:
                    try:
                        conn.sendall((update.to_json() + "\n").encode())
                    except OSError:
                        return self._lost(runner, proc, time.monotonic() - heard)
                if update.returncode is not None:
                    return update.returncode
                if not select.select([conn], [], [], _POLL_S)[0]:
                    if time.monotonic() - heard > self.lost_after:
                        return self._lost(runner, proc, time.monotonic() - heard)
                    update = runner.collect()
                    update.pid = 0
                    continue
                try:
                    data = conn.recv(256)
                except OSError:
                    data = b""
                if not data:  # EOF: the trainer is gone; the process ends now
                    return runner.stop().returncode or 0
                heard, received = time.monotonic(), received + data
                if b"stop\n" not in received:  # keep-alives
                    received = received[received.rfind(b"\n") + 1:]
                    update = Update()
                    continue
                update = runner.stop()
        finally:
            runner.close()

    def _lost(self, runner: NodeRunner, proc: ProcessSpec, silent: float) -> int:
        relay = f"{self.relay[0]}:{self.relay[1]}"
        print(f"[shardkit] {proc.name}: no word from the trainer's relay at {relay} for {silent:.1f} s "
              f"(fault_tolerance.lost_job_timeout {self.lost_after:g} s): it is unreachable (a network "
              "partition, or the trainer is gone); stopping the process", file=sys.stderr, flush=True)
        return runner.stop().returncode or 1


@contextlib.contextmanager
def _environ_defaults(values: dict[str, str]) -> Iterator[None]:
    """Set the variables that are not set, for the block only."""
    added = [key for key in values if key not in os.environ]
    os.environ.update({key: values[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _slots(master: str) -> int | None:
    """How many tasks a ``local[...]`` master runs at once; None for a cluster (Spark checks it)."""
    match = _LOCAL.match(master)
    if match is None:
        return None
    threads = match.group(1)
    return 1 if threads is None else (os.cpu_count() or 1) if threads == "*" else int(threads)


def _masters(master: str) -> list[tuple[str, int]]:
    """Each ``(host, port)`` of a standalone master URL, ``spark://H:P`` or ``spark://H1:P1,H2:P2`` (HA)."""
    out = []
    for part in master[len(_STANDALONE):].split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"engine.master={master!r}: {part.strip()!r} is not HOST:PORT. Fix: "
                              "engine: {name: spark, master: 'spark://HOST:7077'}")
        out.append((host.strip("[]"), int(port)))
    return out


def check_master(master: str, *, timeout: float) -> str:
    """Connect to the standalone master(s) of ``master``; return this host's address that reached the first
    that answered (the driver's address: the executors connect back to it).

    Example:
        >>> check_master("spark://10.0.0.5:7077", timeout=5.0)
        '10.0.0.7'

    Raises:
        EngineUnreachableError: no master accepts a connection within ``timeout`` seconds each (without
            this, Spark's client retries its registration for a minute and then leaves a dead context).
    """
    problems = []
    for host, port in _masters(master):
        try:
            with socket.create_connection((host, port), timeout=timeout) as conn:
                return str(conn.getsockname()[0])
        except OSError as e:
            problems.append(f"{host}:{port}: {e.strerror or e or type(e).__name__}")
    raise EngineUnreachableError(
        f"engine.master={master!r}: no Spark master answers there ({'; '.join(problems)}; each given "
        f"{timeout:g} s, engine.connect_timeout). Fix: start the master (pyspark's bin/spark-class "
        "org.apache.spark.deploy.master.Master --host HOST --port PORT), or correct engine.master")


def executor_heartbeats(lost_after: float) -> dict[str, str]:
    """Spark settings under which an executor that cannot reach its driver exits after about
    ``lost_after`` seconds (within one heartbeat of it) rather than Spark's default of ten minutes (60
    failed heartbeats, 10 s apart): a heartbeat every quarter of it (1 to 10 s), each failing after as
    long, and as many failures in a row as span ``lost_after`` less one heartbeat (at least 3) end the
    executor, and its Python workers with it.

    Example:
        >>> executor_heartbeats(20.0)
        {'spark.executor.heartbeatInterval': '5000ms', 'spark.executor.heartbeat.maxFailures': '3'}
        >>> executor_heartbeats(60.0)["spark.executor.heartbeat.maxFailures"]
        '5'
    """
    interval = max(1.0, min(10.0, lost_after / 4))
    failures = max(3, math.ceil(lost_after / interval - 1e-9) - 1)
    return {"spark.executor.heartbeatInterval": f"{round(interval * 1000)}ms",
            "spark.executor.heartbeat.maxFailures": str(failures)}


def _check_driver_address(master: str, driver: str, conf: dict[str, Any]) -> None:
    """`ConfigError` when the driver was told to listen on loopback (``SPARK_LOCAL_IP``, or
    ``engine.conf``'s ``spark.driver.host``) while the master, and so its executors, are on another host:
    they would connect back to their own loopback, and the barrier stage would wait for executors that
    never register (``engine.slots_timeout`` later, a misleading "too few slots")."""
    if is_loopback(driver):
        return
    for where, value in (("engine.conf spark.driver.host", conf.get("spark.driver.host")),
                         ("engine.conf spark.driver.bindAddress", conf.get("spark.driver.bindAddress")),
                         ("the environment's SPARK_LOCAL_IP", os.environ.get("SPARK_LOCAL_IP"))):
        if value and is_loopback(str(value)):
            raise ConfigError(
                f"engine.master={master!r} is another host, but {where} = {value!r} puts the driver on "
                "loopback, where the executors there cannot reach it. Fix: leave it out (shardkit then "
                f"uses {driver}, this host's address that reaches the master) or set it to this host's "
                "address")


def _check_slots(master: str, task_cpus: str, n: int) -> None:
    """`ConfigError` when a local ``master`` runs fewer than ``n`` tasks at a time with ``spark.task.cpus``
    = ``task_cpus`` (a cluster's slots are Spark's to check)."""
    slots = _slots(master)
    if slots is None:
        return
    try:
        cpus = int(task_cpus)
        if cpus < 1:
            raise ValueError(task_cpus)
    except ValueError as e:
        raise ConfigError(f"engine.conf.spark.task.cpus={task_cpus!r}: not a number of cores >= 1. Fix: "
                          "spark.task.cpus: 1") from e
    if slots // cpus < n:
        per = f" of {cpus} cores each (spark.task.cpus)" if cpus > 1 else ""
        raise ConfigError(f"engine spark: master {master!r} runs {slots // cpus} task(s){per} at a time, "
                          f"but the job has {n} processes, which a barrier stage starts together. Fix: "
                          f"engine: {{name: spark, master: 'local[{n * cpus}]'}}"
                          + (", or spark.task.cpus: 1" if cpus > 1 else "") + ", or fewer processes")


class SparkEngine:
    """Runs each process of a job as one task of a Spark barrier stage.

    Example:
        >>> engine = SparkEngine({"master": "local[2]"})      # YAML: engine: {name: spark, master: local[2]}
        >>> group = engine.start(spec, log_dir=Path("logs"))
        >>> group.stop(); engine.close()

    Options: ``master`` (``spark://HOST:7077``, ``yarn``, ``k8s://...``, ``local[N]``; default ``local[N]``
    for the job's N processes), ``conf`` (more Spark settings for a session the engine creates),
    ``grace`` (seconds between SIGTERM and SIGKILL when stopping a process, default 5),
    ``connect_timeout`` (seconds a ``spark://`` master has to accept a connection, default 5),
    ``slots_timeout`` (seconds a barrier stage waits for the cluster to have a task slot for every
    process, default 60). If a SparkSession is already active in this process it is used as it is, and
    not stopped: a program can materialize the dataset with `shardkit.dataset.write_spark` and then train in
    the same session.

    Choices:
    - One barrier stage, one task per process (``sc.parallelize(range(n), n).barrier().mapPartitions``):
      barrier mode starts all tasks together or none, as TensorFlowOnSpark and Horovod-on-Spark need.
      Each task shares its executor's host and a free port through ``BarrierTaskContext.allGather``;
      from those every task derives its environment (rank 0's ``MASTER_ADDR/MASTER_PORT``, TensorFlow's
      ``TF_CONFIG``) and runs the role's ordinary process, as the local engine would.
    - Output, heartbeats and the exit come back over one TCP connection per task to a relay in the
      trainer (on ``spark.driver.host``, which executors reach anyway; a random token per attempt);
      ``stop`` goes the same way. A task does not fail when its process fails: it reports the exit
      and ends, so Spark never retries the stage (which would start the old attempt again); the
      supervisor stops the stage and starts a new one from the newest checkpoint. A task that dies
      anyway (its Python worker killed) loses its connection, which counts as its process killed, and
      a stage Spark retries is told to start nothing. Cancelling the job group (``interruptOnCancel``)
      is the fallback for tasks that do not answer ``stop``.
    - Resources: Spark gives every task of a stage the same (``spark.task.cpus``, and
      ``spark.task.resource.gpu.amount`` with GPU scheduling); roles' ``resources`` are not applied.
      A task with GPUs gets ``CUDA_VISIBLE_DEVICES`` set to its own and ``LOCAL_RANK=0``.
    - A session the engine creates runs the tasks with this interpreter (``PYSPARK_PYTHON``, unless
      set; the executors need shardkit) and, for a local master, on 127.0.0.1; the role processes run
      with ``python:`` from the config. The environment, secrets included, travels in the task.
    - Across machines (a standalone ``spark://`` master), nothing is taken from the host name, which
      often resolves to loopback: the master must accept a TCP connection within ``connect_timeout``
      (else `EngineUnreachableError` names it and ``engine.master``, instead of Spark's minute of silent
      registration retries and a dead context), and the address of this host that reached it becomes
      ``spark.driver.host`` and ``spark.driver.bindAddress`` (unless ``conf`` or ``SPARK_LOCAL_IP`` say
      otherwise): the executors connect back to it, and so do the tasks to the relay. Each task takes
      its executor's address (the worker's ``--host``, from ``BarrierTaskContext``; the address that
      routes to the driver where this node does not hold it): rank 0's becomes every process's
      ``MASTER_ADDR`` and TensorFlow's ``TF_CONFIG`` lists each member at its own, and each process's
      gloo and NCCL are pinned to that address's interface (``GLOO_SOCKET_IFNAME``,
      ``NCCL_SOCKET_IFNAME``, unless the job's ``env:`` or the executor set them).
    - A lost worker (its machine down, its executor gone) fails the stage: Spark's own answer in
      barrier mode is to run the whole stage again, and so does the supervisor, from the newest
      checkpoint, with the same number of processes (a barrier stage's size is the job's world; the
      reader resumes the epoch exactly). The new stage runs as soon as Spark has a slot for every task:
      at once on the workers that remain when they have free cores, or once workers join (the lost
      machine back, a spare started); Spark's slot check looks every 2 s for up to ``slots_timeout``,
      after which the attempt fails with a message naming the slots it lacked, and when
      ``max_restarts`` is spent, the job. Waiting longer is a matter of ``slots_timeout``: Spark's own
      default (15 s x 40 checks) is set down so that too few workers is an error in about a minute.
    - A worker cut off (a partition: silence, not an error) is noticed by the supervisor as silence
      (``heartbeat_timeout``). Stopping the stage waits ``grace`` + 10 s (`SparkGroup.stop`), then
      cancels the stage's job group; a task that had not answered is given up, its log naming its host
      as unreachable. On the cut-off host the task ends its process once the relay, which sends it a
      line every second, has been silent for ``lost_job_timeout`` seconds; the executors of a session
      the engine creates give up on the driver after about as long (`executor_heartbeats`), where
      Spark's default is ten minutes.
    """

    name = "spark"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        opts = Options("spark", options, _OPTIONS)
        self.master = opts.text("master", "local[2]")
        self.conf = {k: str(v) for k, v in opts.mapping("conf", "{spark.executor.memory: 4g}").items()}
        self.grace = opts.number("grace", 5.0) or 0.0
        self.connect_timeout = opts.number("connect_timeout", 5.0, minimum=0.1) or 5.0
        self.slots_timeout = opts.number("slots_timeout", 60.0, minimum=1.0) or 60.0
        require("pyspark", extra="spark", purpose="engine: spark (Spark barrier mode)")
        self._own: Any = None

    @property
    def runs_here(self) -> bool:
        """Whether the tasks will run on this machine (a ``local[...]`` master: the active session's, or
        the one the engine would create); the supervisor then checks a local ``data.url`` and the GPUs
        asked for first."""
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        master = active.sparkContext.master if active is not None else self.master
        return _slots(str(master or "local")) is not None

    def session(self, processes: int = 2, *, lost_after: float | None = None) -> Any:
        """The active SparkSession, or one this engine creates (``local[processes]`` unless ``master``).

        On a cluster, its executors give up on a driver they have not reached for about ``lost_after``
        seconds (``fault_tolerance.lost_job_timeout``; see `executor_heartbeats`), unless ``conf`` sets
        Spark's heartbeat settings itself."""
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            master = active.sparkContext.master
            if self.master is not None and self.master != master and active is not self._own:
                raise ConfigError(f"engine.master={self.master!r}: this process already has a SparkSession "
                                  f"on {master!r}. Fix: remove engine.master, or stop that session first")
            return active
        master = self.master or f"local[{processes}]"
        builder = SparkSession.builder.master(master).appName("shardkit").config(
            "spark.ui.showConsoleProgress", "false")
        # Read when the session starts: the tasks' Python (else the system's, without shardkit), and
        # for a local master, loopback only.
        env = {"PYSPARK_PYTHON": sys.executable}
        settings = {"spark.scheduler.barrier.maxConcurrentTasksCheck.interval": f"{_SLOTS_CHECK_S}s",
                    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures":
                        str(max(1, math.ceil(self.slots_timeout / _SLOTS_CHECK_S)))}
        if not _LOCAL.match(master) and lost_after is not None:
            settings.update(executor_heartbeats(lost_after))
        if _LOCAL.match(master):
            env["SPARK_LOCAL_IP"] = "127.0.0.1"
            settings.update({"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"})
        elif master.startswith(_STANDALONE):
            driver = check_master(master, timeout=self.connect_timeout)
            _check_driver_address(master, driver, self.conf)
            if not {"spark.driver.host", "spark.driver.bindAddress"} & self.conf.keys() and not (
                    os.environ.get("SPARK_LOCAL_IP") or os.environ.get("SPARK_LOCAL_HOSTNAME")):
                # never the host name's resolution (often loopback): the executors could not reach it
                env["SPARK_LOCAL_IP"] = driver
                settings.update({"spark.driver.host": driver, "spark.driver.bindAddress": driver})
        for key, value in {**settings, **self.conf}.items():
            builder = builder.config(key, value)
        with _environ_defaults(env):
            self._own = builder.getOrCreate()
        self._own.sparkContext.setLogLevel("ERROR")
        return self._own

    def check_job(self, config: JobConfig) -> None:
        """Refuse a job whose processes a local master cannot start together (a barrier stage waits for
        all its tasks: too few slots would wait forever). Before anything starts: the supervisor and
        ``shardkit validate`` (`shardkit.cluster.engines.check_engine`) call it."""
        from pyspark.sql import SparkSession

        n = sum(role.count for role in config.roles.values())

        active = SparkSession.getActiveSession()  # used as it is by `start` (see `session`)
        if active is not None and (self.master is None or self.master == active.sparkContext.master):
            sc = active.sparkContext
            _check_slots(str(sc.master), str(sc.getConf().get("spark.task.cpus", "1")), n)
        else:
            _check_slots(self.master or f"local[{n}]", self.conf.get("spark.task.cpus", "1"), n)

    def start(self, spec: ClusterSpec, *, log_dir: Path) -> SparkGroup:
        """Start the barrier stage (in a thread); it runs until every process has ended, or `stop`."""
        n = len(spec.processes)
        lost_after = lost_job_timeout(spec)
        sc = self.session(n, lost_after=lost_after).sparkContext
        _check_slots(str(sc.master), str(sc.getConf().get("spark.task.cpus", "1")), n)  # the session's own
        log_dir.mkdir(parents=True, exist_ok=True)
        mirrors = [MirrorProcess(proc, log_dir / f"{proc.name}.log") for proc in spec.processes]
        host = sc.getConf().get("spark.driver.host") or "127.0.0.1"
        token = secrets.token_hex(16)
        group = SparkGroup(mirrors, spec.heartbeat_addr, host=host, token=token, grace=self.grace,
                           slots_timeout=self.slots_timeout)
        try:
            task = _BarrierTask(list(spec.processes), (host, group.port), token, self.grace, lost_after)
            group.begin(sc, task, f"shardkit-{spec.job_dir.name}-{spec.attempt}-{token[:8]}")
        except BaseException:
            group.stop(0)
            raise
        for mirror in mirrors:
            mirror.started = time.monotonic()
        return group

    def close(self) -> None:
        """Stop the SparkSession this engine created (never one that was active before)."""
        own, self._own = self._own, None
        if own is not None:
            own.stop()
