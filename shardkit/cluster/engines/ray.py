"""The ``ray`` engine: each process of a job in its own Ray actor, on a Ray cluster or a local instance."""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.cluster._addresses import collective_env
from shardkit.cluster._spec import ClusterSpec, ProcessSpec
from shardkit.cluster.engines._remote import NodeRunner, Update, Watchdog, free_port, lost_job_timeout, place
from shardkit.cluster.engines.mirror import MirrorGroup, MirrorProcess, Options, describe_error, job_settings
from shardkit.errors import ConfigError, EngineUnreachableError, JobError, require
from shardkit.job import protocol

if TYPE_CHECKING:
    from shardkit.job.config import JobConfig

__all__ = ["RayEngine", "RayGroup"]

_POLL_S = 0.1
_OPTIONS = ("address", "num_cpus", "num_gpus", "runtime_env", "grace", "placement")
#: engine.placement -> Ray's placement group strategy (as Ray Train's ``ScalingConfig.placement_strategy``)
PLACEMENTS = {"spread": "SPREAD", "strict_spread": "STRICT_SPREAD", "pack": "PACK",
              "strict_pack": "STRICT_PACK"}
_CONNECT_S = 5.0  # how long a cluster address may take to accept a connection before the job is refused
_SETTLE_S = 5.0  # how long the alive nodes may stay unable to hold the group (a node joining) ere failing
#: Seconds beyond ``engine.grace`` that `RayGroup.stop` waits for an actor to answer (a process stopped
#: on a node that answers takes ``grace`` at most); an actor silent past that is given up.
STOP_SLACK_S = 10.0
_NODE_ID_LABEL = "ray.io/node-id"  # every node's label: its id (for a placement group's label selector)
_RAY_CLIENT_PORT = 10001  # ray://HOST without a port
#: The most seconds the head may stay silent before the job fails (`HeadWatch`): well under the minute
#: after which Ray's core worker ends a driver that lost its GCS (``gcs_rpc_server_reconnect_timeout_s``,
#: 60 s), leaving time to stop the group (``engine.grace`` + `STOP_SLACK_S`) and write the summary.
HEAD_SILENCE_MAX_S = 20.0
_HEAD_PROBE_S = 1.0  # how often, and how long each time, the head's GCS port is tried
_HEAD_QUIET_S = 3.0  # silent this long, the head is not asked (no call that would wait on it)
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a local instance stays on 127.0.0.1


class _RoleActor:
    """Runs one role process on its node (wrapped by ``ray.remote`` with the role's resources).

    Every call of the trainer's (``ping`` each second while the group starts, ``collect`` ten a second
    once the process runs) feeds a `Watchdog`: after ``fault_tolerance.lost_job_timeout`` seconds
    without one (``silence_limit``: this node cut off from the trainer, or the trainer gone), the actor
    stops the process and exits, where Ray would leave both running until this node's raylet gives up
    on the head."""

    def __init__(self, silence_limit: float | None = None) -> None:
        self.runner: NodeRunner | None = None
        self.lock = threading.Lock()  # the actor's calls and the watchdog's thread
        self.grace = 0.0
        self.watchdog = None if silence_limit is None else Watchdog(silence_limit, self._lost,
                                                                     what="a role's actor (not started)")

    def address(self) -> tuple[str, int]:
        """This node's address as Ray knows it (``ray start --node-ip-address``, never the host name's
        resolution), and a port free on it."""
        self.ping()
        return _node_ip(), free_port()

    def ping(self) -> None:
        if self.watchdog is not None:
            self.watchdog.heard()

    def start(self, proc: ProcessSpec, grace: float, lost_after: float | None = None) -> int:
        # the collectives bind to this node's address: across machines gloo would otherwise advertise the
        # host name's address, often 127.0.x.1, and its peers fail in connectFullMesh
        env = {**proc.env, **collective_env(_node_ip(), {**os.environ, **proc.env})}
        with self.lock:
            self.runner = NodeRunner(replace(proc, env=env), grace=grace)
            self.grace = grace
            pid: int = self.runner.pid
            if lost_after is not None and self.watchdog is not None:
                self.watchdog.timeout, self.watchdog.what = lost_after, proc.name
                self.watchdog.heard()
            elif lost_after is not None:
                self.watchdog = Watchdog(lost_after, self._lost, what=proc.name)
        return pid

    def collect(self) -> Update:
        if self.watchdog is not None:
            self.watchdog.heard()
        with self.lock:
            return self.runner.collect() if self.runner is not None else Update()

    def stop(self, grace: float, leave: bool = False) -> Update:
        """Stop the process; ``leave``: then end this actor's process too, a moment after the answer
        (the head is gone: Ray's own end for the actor, through the head, does not come)."""
        if self.watchdog is not None:
            self.watchdog.cancel()
        try:
            with self.lock:
                runner, self.runner = self.runner, None
                if runner is None:
                    return Update()
                try:
                    return runner.stop(grace)
                finally:
                    runner.close()
        finally:
            if leave:
                threading.Timer(0.5, os._exit, (0,)).start()

    def _lost(self) -> None:
        """The trainer is unreachable: stop the process, then end this actor's process (nobody is left to
        call it, and Ray's own end for it comes only with the raylet's)."""
        with self.lock:
            runner, self.runner = self.runner, None
            if runner is not None:
                try:
                    runner.stop(self.grace)
                finally:
                    runner.close()
        os._exit(1)


def _node_ip() -> str:
    import ray

    ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return ip


class HeadWatch:
    """Whether the Ray cluster's head answers this trainer: a thread tries a connection to its GCS port
    (``host:port``) each second.

    Ray's core worker ends a driver whose GCS has not answered for a minute, without a word the job
    could log; once no connection has been accepted for ``limit`` seconds (``lost_job_timeout``, at most
    `HEAD_SILENCE_MAX_S`) `check` raises a `JobError` naming ``engine.address`` (``given``) instead, and
    the supervisor stops the group and writes the summary before Ray's end comes. The head gone, nothing
    can be placed: the job fails rather than restart."""

    def __init__(self, given: str, host: str, port: int, limit: float) -> None:
        self.given, self.gcs, self.limit = given, protocol.format_addr(host, port), limit
        self._target = (host, port)
        self.heard = time.monotonic()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._probe, name="shardkit-ray-head", daemon=True)
        self._thread.start()

    def _probe(self) -> None:
        while not self._closed.is_set():
            began = time.monotonic()
            if _answers(*self._target, timeout=_HEAD_PROBE_S):
                self.heard = began
            self._closed.wait(max(0.0, _HEAD_PROBE_S - (time.monotonic() - began)))

    def silent(self) -> float:
        """Seconds since the head last accepted a connection (about 1 while it answers)."""
        return time.monotonic() - self.heard

    def check(self) -> None:
        """Raise `JobError` when the head has been silent for ``limit`` seconds."""
        silent = self.silent()
        if silent < self.limit:
            return
        raise JobError(
            f"engine.address={self.given!r}: the Ray cluster's head ({self.gcs}) stopped answering: no "
            f"connection from this trainer for {silent:.0f} s (fault_tolerance.lost_job_timeout, at most "
            f"{HEAD_SILENCE_MAX_S:g} s). It is unreachable: a network partition between this machine and "
            "the head, or the head is down. Without the head no group can be placed, so the job fails, "
            "before Ray would end this process (60 s without its head); the processes still answering "
            "are stopped, and on the nodes cut off with the head each actor ends its process after "
            "fault_tolerance.lost_job_timeout without a word from this trainer. Fix: check the head "
            f"(`ray status --address {self.gcs}` on this machine) and the network to it, then run "
            "`shardkit train` again: the job resumes from its newest checkpoint")

    def wait(self) -> None:
        """Return once the head answers (at once while it does); `check`'s `JobError` when it stays silent."""
        while self.silent() >= _HEAD_QUIET_S:
            self.check()
            time.sleep(0.2)

    def close(self) -> None:
        self._closed.set()


class RayGroup(MirrorGroup):
    """The processes of one attempt, each in a Ray actor; a thread polls the actors (see `RayEngine`)."""

    def __init__(self, ray: Any, processes: list[MirrorProcess], heartbeat_addr: str | None,
                 grace: float, unreachable: set[str] | None = None, *,
                 head: HeadWatch | None = None) -> None:
        super().__init__(processes, heartbeat_addr)
        self.ray, self.grace = ray, grace
        self.head = head  # None: not watched (a local instance, Ray Client)
        #: the placement group `stop` left (the head silent then), for the engine to remove later
        self.left_placement: Any = None
        #: hosts whose actors did not answer `stop` (the engine waits for Ray's verdict on them)
        self.unreachable = unreachable if unreachable is not None else set()
        self.actors: list[Any] = []
        self.placement_group: Any = None  # one bundle per process; removed by `stop`
        self._gone: set[int] = set()  # actors Ray reported dead
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="shardkit-ray-poll", daemon=True)

    def begin(self) -> None:
        self._thread.start()

    def poll(self) -> list[MirrorProcess]:
        """The processes that ended; a `JobError` once the head has been silent too long (`HeadWatch`):
        the job cannot go on without it, and is not restarted."""
        if self.head is not None:
            self.head.check()
        return super().poll()

    def _poll(self) -> None:
        # Every actor is called until `stop`, its process ended or not: the calls are what tells the
        # actor's watchdog that the trainer is still there.
        ray, pending = self.ray, dict[Any, int]()
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        try:
            while not self._done.is_set():
                began = time.monotonic()
                busy = set(pending.values())
                for i, actor in enumerate(self.actors):
                    if i not in busy and i not in self._gone:
                        pending[actor.collect.remote()] = i
                if pending:
                    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_POLL_S)
                    for ref in ready:
                        i = pending.pop(ref)
                        try:
                            self.feed(i, ray.get(ref))
                        except unavailable:  # a network blip: Ray says whether it comes back
                            continue
                        except ray.exceptions.RayActorError as e:
                            self.actor_lost(i, e)
                self._done.wait(max(0.0, _POLL_S - (time.monotonic() - began)))
        except Exception as e:  # never leave the supervisor waiting on processes nobody watches
            for i, proc in enumerate(self.processes):
                self.lost(i, f"polling the Ray actor of {proc.name} failed: {describe_error(e)}", code=1)

    def _headless(self) -> bool:
        """Whether the head has been silent for a few seconds: no call that waits on it is made then."""
        return self.head is not None and self.head.silent() >= _HEAD_QUIET_S

    def _where(self, i: int) -> str:
        host = self.processes[i].host
        return f" (node {host})" if host else ""

    def actor_lost(self, i: int, error: BaseException, when: str = "") -> None:
        """Ray reported the actor of process ``i`` dead: so is the process, as far as the job goes."""
        self._gone.add(i)
        self.lost(i, self.actor_died(i, error) + when)

    def actor_died(self, i: int, error: BaseException) -> str:
        """Why the actor of process ``i`` is gone, in words: when Ray has marked its node dead, that (the node
        down, or cut off from the head), else Ray's error."""
        name, host = self.processes[i].name, self.processes[i].host
        with contextlib.suppress(Exception):
            if self._headless():  # Ray's table of nodes is the head's: asking would wait for it
                raise LookupError
            nodes = [n for n in self.ray.nodes() if n.get("NodeManagerAddress") == host]
            if host and nodes and not any(n.get("Alive") for n in nodes):
                return (f"the Ray actor of {name} is lost: {_node_dead(host)}. What runs there ends "
                        "within fault_tolerance.lost_job_timeout of its last word from this trainer")
        return f"the Ray actor of {name} died{self._where(i)}: {describe_error(error)}"

    def stop(self, grace: float | None = None) -> None:
        """Stop each process through its actor (SIGTERM, SIGKILL after ``grace``), then kill the actors.

        An actor that has not answered ``grace`` + `STOP_SLACK_S` seconds later is given up: its node is
        down, cut off or too busy to answer. Its actor is killed through Ray (which cannot reach a cut-off
        node), and the actor's watchdog ends the process there (``fault_tolerance.lost_job_timeout``)."""
        grace = self.grace if grace is None else grace
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(None if not self._headless() else 2 * _HEAD_QUIET_S)
        ray, headless = self.ray, self._headless()
        try:
            refs = {actor.stop.remote(grace, headless): i for i, actor in enumerate(self.actors)
                    if i not in self._gone}
            ready, late = ([], []) if not refs else ray.wait(list(refs), num_returns=len(refs),
                                                              timeout=grace + STOP_SLACK_S)
            for ref in ready:
                i = refs[ref]
                try:
                    self.feed(i, ray.get(ref))
                except ray.exceptions.RayActorError as e:
                    self.lost(i, self.actor_died(i, e))
                except ray.exceptions.RayError as e:
                    self.lost(i, f"the Ray actor of {self.processes[i].name} died{self._where(i)}: "
                                 f"{describe_error(e)}")
            for ref in late:
                i = refs[ref]
                if self.processes[i].host:
                    self.unreachable.add(self.processes[i].host)
                self.lost(i, f"the Ray actor of {self.processes[i].name}{self._where(i)} did not answer the "
                             f"request to stop it within {grace + STOP_SLACK_S:g} s (engine.grace + "
                             f"{STOP_SLACK_S:g} s): its node is unreachable (down, or cut off by a network "
                             "partition) or too busy to answer; given up here. Its watchdog ends the "
                             "process there within fault_tolerance.lost_job_timeout of its last word from "
                             "this trainer")
        finally:
            # Its process gone, the parent-death signal takes the role with it. Without the head, killing
            # an actor or removing the placement group would wait on it: each actor that answered ends
            # itself instead, and the placement group is left for the engine to remove once it answers.
            for actor in self.actors if not headless else ():
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            if self.placement_group is not None and headless:
                self.left_placement = self.placement_group
            elif self.placement_group is not None:
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
            for i, proc in enumerate(self.processes):
                if proc.returncode is None:
                    self.lost(i, "stopped with its Ray actor")
            self.close()


@contextlib.contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """Put back this process's handlers of the stop signals after ``ray.init``, which replaces SIGTERM's
    with its own (``sys.exit(15)``; its core worker's prints "SIGTERM received" and aborts): the
    supervisor's handler must stay, so that ``shardkit train`` stopped with SIGTERM stops its processes,
    writes its summary ("interrupted") and exits 143, and Ray is shut down by the engine's `close`."""
    from shardkit.cluster.monitor.stop_signals import STOP_SIGNALS

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set outside Python, nothing to put back
                signal.signal(sig, handler)


class RayEngine:
    """Starts each process of a job in a Ray actor: on an existing Ray cluster, or a local instance.

    Example:
        >>> engine = RayEngine({"address": "10.0.0.5:6379"})   # YAML: engine: {name: ray, address: ...}
        >>> group = engine.start(spec, log_dir=Path("logs"))
        >>> group.stop(); engine.close()

    Options: ``address`` (a running cluster: ``auto``, ``HOST:PORT`` as ``ray start --head`` prints it,
    or ``ray://HOST:10001``; left out, a local instance is started on 127.0.0.1 for the job and shut
    down by `close`), ``placement`` (how the processes spread over the nodes: ``spread``, the default,
    ``strict_spread``, ``pack`` or ``strict_pack``, Ray's placement group strategies), ``num_cpus`` and
    ``num_gpus`` (the local instance's size; default: what the roles ask for), ``runtime_env`` (Ray's
    runtime environment for the actors, e.g. ``{working_dir: ., pip: [...]}``), ``grace`` (seconds
    between SIGTERM and SIGKILL when stopping a process, default 5). If this process is already
    connected to Ray (``ray.init`` was called), that connection is used and left open.

    Choices:
    - One actor per process, each asking for its role's ``resources`` (``num_cpus``, ``num_gpus``,
      ``memory``), running the role's ordinary process (the same argv and environment as on the local
      engine) and relaying its output and heartbeats through Ray calls, so the script is the same on
      every engine and no port of the trainer has to be reachable from the nodes. Not Ray Train's
      ``TorchTrainer``: it owns the process group, the restarts and the checkpoints (through
      ``ray.train.report``, slow per call) that shardkit's supervisor and ``ctx.step`` own, and it
      runs only torch (no TensorFlow, no parameter servers).
    - The actors of an attempt share one placement group of a bundle per process, so that they are
      placed together or not at all (never half a group waiting for the rest). ``spread`` (Ray
      Train's ``SPREAD``) puts each process on a node of its own while there are nodes to spare, and
      packs them onto fewer otherwise: two workers on a two-node cluster get a node (and its network
      and CPUs) each, and after a node is lost they restart together on the one left if it can hold
      them. ``strict_spread`` insists on a node per process.
    - Ray does not restart the actors (``max_restarts=0``): a dead actor is a dead process, and the
      supervisor restarts the whole group from the newest checkpoint with new actors, as on any engine.
    - A node lost (its raylet gone: the machine died or was cut off) ends its processes' actors; the
      others' collectives fail (or their heartbeats stop), and the supervisor restarts the group from
      the newest checkpoint, with the same number of processes, on the nodes that remain, as Ray Train
      restarts a fixed-size worker group (``FailureConfig``). The group keeps its size: the data shards
      and the ranks follow the config, and the reader resumes the epoch exactly where the checkpoint
      left it. Where the remaining nodes cannot hold the group (too few nodes for ``strict_spread``,
      or too few CPUs, GPUs or memory in all), the attempt fails at once with an error naming the
      alive and the lost nodes and what the group asks for, and the job ends: shardkit does not wait
      for nodes to join (Ray Train would wait for an autoscaler), beyond a few seconds for a node that
      is registering. A cluster whose nodes can hold the group but are busy is waited for, up to
      ``startup_timeout``.
    - A node cut off (a partition: silence, not an error) is noticed by the supervisor as silence
      (``heartbeat_timeout``), or by Ray once its health checks mark the node dead, whichever is first.
      Stopping the group waits ``grace`` + `STOP_SLACK_S` seconds for each actor; one that has not
      answered is given up, its log naming its node as unreachable. The next group is placed on the
      other nodes (a label selector on ``ray.io/node-id``) while Ray still counts that node alive and
      it does not accept a connection: a group that Ray places on a cut-off node waits minutes for the
      reservation there to fail. On the cut-off node each actor's `Watchdog` ends the
      process and the actor after ``lost_job_timeout`` seconds without a call from the trainer, where
      Ray would leave them until the node's raylet gives up on the head.
    - The head cut off from this trainer (a partition, the head down) is the end of the job: nothing can
      be placed without it, and Ray's core worker ends a driver a minute after it lost its GCS. A
      `HeadWatch` fails the job (`JobError`, naming ``address``) once the head has not accepted a
      connection for ``lost_job_timeout`` seconds (at most `HEAD_SILENCE_MAX_S`); the group is stopped
      without calls that would wait on the head (each actor that answers ends itself), and the
      supervisor writes the summary, before Ray's end comes. The group is not started again.
    - Where the actors land decides the addresses: each actor reports its node's IP as Ray knows it
      (``ray start --node-ip-address``; never the host name's resolution, which is 127.0.x.1 on many
      hosts) and a free port, and the processes get rank 0's as ``MASTER_ADDR/MASTER_PORT``
      (TensorFlow: every member's, in ``TF_CONFIG``). Each process's collectives bind to its node's
      address: ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` name the interface that holds it, unless
      the job's ``env:`` or the node's environment set them. A process with GPUs sees only its own
      (Ray sets ``CUDA_VISIBLE_DEVICES``), so it gets ``LOCAL_RANK=0``.
    - A cluster ``address`` that does not accept a connection within a few seconds fails the job
      before anything starts (`EngineUnreachableError`, naming the address), rather than leave it to
      ``ray.init``'s retries.
    - The nodes need the same Python (``python:`` in the config), shardkit and the script at the same
      paths (or a ``runtime_env`` that provides them); the environment, secrets included, goes to the
      actors through Ray. A cluster with token authentication (``RAY_AUTH_MODE=token``) needs the same
      setting and the cluster's token (``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) where
      ``shardkit train`` runs.
    """

    name = "ray"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        opts = Options("ray", options, _OPTIONS)
        self.address = opts.text("address", "auto")
        self.num_cpus = opts.number("num_cpus", None)
        self.num_gpus = opts.number("num_gpus", None)
        self.runtime_env = opts.mapping("runtime_env", "{working_dir: .}")
        self.grace = opts.number("grace", 5.0) or 0.0
        placement = opts.text("placement", "spread") or "spread"
        if placement not in PLACEMENTS:
            from shardkit.job.config.messages import option_error  # it imports the engines' config models

            raise option_error([(("engine", "placement"), placement, "not a placement of the Ray engine",
                                 f"use one of: {', '.join(PLACEMENTS)}")])
        self.placement = placement
        self.ray: Any = require("ray", extra="ray", purpose="engine: ray (the job's processes as Ray actors)")
        self._owned = False
        self._suspects: set[str] = set()  # nodes the last group's actors did not answer from
        self._head: HeadWatch | None = None  # from the first group on a cluster (`_watch_head`)
        self._last_group: RayGroup | None = None  # the last group (its placement may be left to remove)

    def check_job(self, config: JobConfig) -> None:
        """Refuse a job the local instance sized by ``num_cpus``/``num_gpus`` can never place (its actors
        would wait until ``startup_timeout``, then again each restart): the roles' requests, all at
        once, must fit it, and on its one node ``strict_spread`` can hold one process only. Before
        anything starts: the supervisor and ``shardkit validate`` call it. A running cluster
        (``address``) is Ray's to judge: it may grow."""
        if self.address is not None or self.ray.is_initialized():
            return
        asks = {name: role.resources for name, role in config.roles.items()}
        counts = {name: role.count for name, role in config.roles.items()}
        if self.placement == "strict_spread" and sum(counts.values()) > 1:
            raise ConfigError(
                f"engine.placement=strict_spread: a node per process, but the local Ray instance is one "
                f"node and the job has {sum(counts.values())} processes. Fix: engine.placement: spread "
                "(or set engine.address to a cluster of enough nodes)")
        for option, have, key in (("num_cpus", self.num_cpus, "cpus"), ("num_gpus", self.num_gpus, "gpus")):
            if have is None:
                continue
            need = sum(getattr(asks[r], key) * counts[r] for r in asks)
            if need > have:
                each = ", ".join(f"{counts[r]} {r} x {getattr(asks[r], key):g}" for r in asks)
                raise ConfigError(
                    f"engine.{option}={have:g}: the local Ray instance would have {have:g} {key.upper()}, "
                    f"but the job's processes, which start together, ask for {need:g} ({each}). Fix: "
                    f"engine.{option}: {math.ceil(need)} (or leave it out: the instance is sized from the "
                    f"roles), or lower roles.<role>.resources.{key}"
                )

    @property
    def runs_here(self) -> bool:
        """Whether the roles will run on this machine: a local instance the engine starts (no
        ``address``, no connection yet); the supervisor then checks a local ``data.url`` and the GPUs
        asked for first."""
        return self.address is None and not self.ray.is_initialized()

    def _connect(self, spec: ClusterSpec, resources: dict[str, dict[str, Any]]) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        if self.address is not None:
            check_answers(self.address)
        with _own_signal_handlers():
            self._init(ray, spec, resources)
        self._owned = True

    def _init(self, ray: Any, spec: ClusterSpec, resources: dict[str, dict[str, float]]) -> None:
        quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
        if self.address is not None:
            try:
                ray.init(address=self.address, **quiet)
            except (ConnectionError, TimeoutError, ray.exceptions.RayError) as e:
                with contextlib.suppress(Exception):
                    ray.shutdown()
                raise EngineUnreachableError(
                    f"engine.address={self.address!r}: connecting to the Ray cluster there failed: "
                    f"{describe_error(e)}. Fix: check that it is the head's address (as `ray start --head` "
                    "printed it), and on a cluster with token authentication set RAY_AUTH_MODE=token and "
                    "the cluster's token (RAY_AUTH_TOKEN_PATH) where shardkit train runs") from e
        else:
            need = [resources.get(proc.role, {}) for proc in spec.processes]
            cpus = self.num_cpus if self.num_cpus is not None else math.ceil(
                sum(r.get("cpus", 1) for r in need))
            gpus = self.num_gpus if self.num_gpus is not None else sum(r.get("gpus", 0) for r in need)
            saved = os.environ.get(_LOOPBACK_ENV)
            os.environ[_LOOPBACK_ENV] = "0"  # read by the Ray processes started now (they inherit it)
            try:
                ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                         **quiet)
            finally:
                if saved is None:
                    os.environ.pop(_LOOPBACK_ENV, None)
                else:
                    os.environ[_LOOPBACK_ENV] = saved

    def start(self, spec: ClusterSpec, *, log_dir: Path) -> RayGroup:
        """Place a bundle per process (a placement group), start an actor in each, then the processes."""
        ray = self.ray
        resources, timeout = job_settings(spec)
        self._connect(spec, resources)
        log_dir.mkdir(parents=True, exist_ok=True)
        mirrors = [MirrorProcess(proc, log_dir / f"{proc.name}.log") for proc in spec.processes]
        lost_after = lost_job_timeout(spec)
        head = self._watch_head(min(lost_after, HEAD_SILENCE_MAX_S))
        if head is not None:
            head.wait()  # a silent head: Ray's calls below would wait for it
        self._remove_left()
        group = RayGroup(ray, mirrors, spec.heartbeat_addr, self.grace, self._suspects, head=head)
        self._last_group = group
        try:
            asks = [resources.get(proc.role, {}) for proc in spec.processes]
            group.placement_group = self._placement_group([bundle(ask) for ask in asks], resources, timeout,
                                                          self._avoid())
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            actor = ray.remote(_RoleActor)
            for i, ask in enumerate(asks):
                strategy = PlacementGroupSchedulingStrategy(group.placement_group,
                                                            placement_group_bundle_index=i)
                options: dict[str, Any] = {"num_cpus": ask.get("cpus", 1), "num_gpus": ask.get("gpus", 0),
                                           "max_restarts": 0, "max_concurrency": 1,
                                           "scheduling_strategy": strategy}
                if ask.get("memory"):
                    options["memory"] = ask["memory"]
                if self.runtime_env:
                    options["runtime_env"] = self.runtime_env
                group.actors.append(actor.options(**options).remote(lost_after))
            where = self._placed(group, resources, timeout, lost_after)
            if where is None:
                group.begin()
                return group
            for mirror, (host, _) in zip(mirrors, where, strict=True):
                mirror.host = host
            own_devices = [bool(ask.get("gpus")) for ask in asks]
            envs = place(spec.processes, where, own_devices)
            started = [a.start.remote(replace(proc, env=env), self.grace, lost_after)
                       for a, proc, env in zip(group.actors, spec.processes, envs, strict=True)]
            self._started(group, started, timeout, lost_after)
        except BaseException:
            group.stop(0)
            raise
        group.begin()
        return group

    def _watch_head(self, limit: float) -> HeadWatch | None:
        """The `HeadWatch` of the cluster's GCS this process is connected to (``engine.address``
        resolved, ``auto`` too), started with the first group; None for a local instance (no partition)
        or Ray Client (``ray://``: its server speaks for the head)."""
        if self._head is not None or self.address is None or self.address.startswith("ray://"):
            return self._head
        try:
            host, port = protocol.parse_addr(str(self.ray.get_runtime_context().gcs_address))
        except Exception:  # no GCS address to watch: the groups run unwatched
            return None
        self._head = HeadWatch(self.address, host, port, limit)
        return self._head

    def _remove_left(self) -> None:
        """Remove the placement group the last group left while the head was silent (it answers now)."""
        last, self._last_group = self._last_group, None
        if last is not None and last.left_placement is not None:
            with contextlib.suppress(Exception):
                self.ray.util.remove_placement_group(last.left_placement)
            last.left_placement = None

    def _started(self, group: RayGroup, started: list[Any], timeout: float, lost_after: float) -> None:
        """Wait for each actor's start of its process (its pid). An actor lost meanwhile (see `_answers`)
        is a process lost, as after the start: the supervisor stops the group and starts it again."""
        why = (f"engine ray: the actors did not start their processes in {timeout:g} s (startup_timeout). "
               "Fix: check the nodes' load and logs")
        pids = self._answers(group, dict(zip(started, range(len(started)), strict=True)), timeout, lost_after,
                             when=" while it started its process", unplaced=why)
        for i, pid in pids.items():
            group.processes[i].pid = pid
        for mirror in group.processes:
            mirror.started = time.monotonic()

    def _answers(self, group: RayGroup, calls: dict[Any, int], timeout: float, lost_after: float, *,
                 when: str, unplaced: str) -> dict[int, Any]:
        """``{process index: answer}`` of the actors' ``calls`` (``{ref: process index}``) that answered.

        Meanwhile the actors that answered are called (``ping``) every second: their watchdogs must know
        that the trainer is there while it waits for the others. An actor that has not answered is a
        process lost, named with its node: once Ray marks the node dead; once it has been silent for
        ``lost_after`` seconds and its node does not accept a connection (cut off as the job starts); or
        at ``timeout`` (`JobError` ``unplaced`` where Ray does not say which node holds it).
        """
        ray = self.ray
        pending, answers = dict(calls), dict[int, Any]()
        began = time.monotonic()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=1.0)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    answers[i] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    group.actor_lost(i, e, f" ({when.strip()})")
            if not pending:
                break
            for i in answers:
                group.actors[i].ping.remote()
            waited = time.monotonic() - began
            nodes = self._bundle_nodes(group.placement_group)
            for ref, i in list(pending.items()):
                host, alive, port = nodes.get(i, ("", True, None))
                name = group.processes[i].name
                if host and not alive:
                    group.lost(i, f"the Ray actor of {name} is lost: " + _node_dead(host) + when)
                elif host and (waited > timeout or (waited > lost_after and not _answers(host, port))):
                    group.unreachable.add(host)
                    silent = (f"did not answer for {waited:.0f} s{when}, and its node does not accept a "
                              "connection: it is unreachable (cut off by a network partition, or down)"
                              if waited <= timeout else f"did not answer within {timeout:g} s "
                              f"(startup_timeout){when}: its node is unreachable or too busy to answer")
                    group.lost(i, f"the Ray actor of {name} (node {host}) {silent}")
                elif waited > timeout:
                    raise JobError(unplaced)
                else:
                    continue
                pending.pop(ref)
        return answers

    def _placement_group(self, bundles: list[dict[str, float]], resources: dict[str, dict[str, Any]],
                         timeout: float, avoid: Mapping[str, str]) -> Any:
        """The attempt's placement group, once Ray has reserved every bundle, on nodes other than
        ``avoid`` (see `_avoid`). Fails at once (after `_SETTLE_S`, for a node still registering) when
        the alive nodes can never hold it."""
        ray = self.ray
        strategy = PLACEMENTS[self.placement]
        selector = [{_NODE_ID_LABEL: f"!in({','.join(avoid)})"}] * len(bundles) if avoid else None
        pg = ray.util.placement_group(bundles, strategy=strategy, bundle_label_selector=selector)
        ready = pg.ready()
        began = time.monotonic()
        short_since: float | None = None
        try:
            while not ray.wait([ready], timeout=1.0)[0]:
                now = time.monotonic()
                nodes = ray.nodes()
                usable = [n["Resources"] for n in nodes if n.get("Alive") and n.get("NodeID") not in avoid]
                short = shortfall(bundles, self.placement, usable)
                if short is None:
                    short_since = None
                elif short_since is None:
                    short_since = now
                elif now - short_since >= min(_SETTLE_S, timeout):
                    raise JobError(self._too_few(nodes, bundles, short, avoid))
                if now - began > timeout:
                    raise JobError(self._unplaced(resources, timeout))
        except BaseException:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(pg)
            raise
        return pg

    def _avoid(self) -> dict[str, str]:
        """The nodes to keep the next group off, ``{node id: address}``: those the last group's actors did
        not answer from (`RayGroup.unreachable`) that Ray still counts alive and that do not accept a
        connection now (the partition not healed). Ray counts a cut-off node alive until its health checks
        fail (``RAY_health_check_*`` on the head), and a group placed on it meanwhile waits minutes for
        the reservation there to fail, holding its places on the other nodes."""
        suspects = set(self._suspects)
        self._suspects.clear()  # the set the new group fills
        if not suspects:
            return {}
        return {str(n["NodeID"]): str(n["NodeManagerAddress"]) for n in self.ray.nodes()
                if n.get("Alive") and n.get("NodeManagerAddress") in suspects
                and not _answers(n["NodeManagerAddress"], n.get("NodeManagerPort"))}

    def _too_few(self, nodes: Sequence[Mapping[str, Any]], bundles: list[dict[str, float]],
                 short: str, avoid: Mapping[str, str]) -> str:
        alive = [describe_node(n) for n in nodes if n.get("Alive") and n.get("NodeID") not in avoid]
        lost = [str(n.get("NodeManagerAddress")) for n in nodes if not n.get("Alive")]
        if len(lost) > 5:  # a long-lived cluster remembers every node it lost
            lost = [*lost[-5:], f"and {len(lost) - 5} earlier"]
        where = f" at {self.address}" if self.address else ""
        share = "engine.placement: spread (processes may then share a node), "
        return (
            f"engine ray: the Ray cluster{where} has {len(alive)} alive node(s) "
            f"({'; '.join(alive) or 'none'})" + (f", {len(lost)} lost ({', '.join(lost)})" if lost else "")
            + (f", {len(avoid)} unreachable from here, its actors silent ({', '.join(avoid.values())})"
               if avoid else "")
            + f": too few for the job's {len(bundles)} processes with engine.placement={self.placement} "
            f"({short}). Fix: start nodes (`ray start --address HEAD:PORT` on each), or "
            + (share if self.placement == "strict_spread" else "")
            + "or lower roles.<role>.count or roles.<role>.resources")

    def _unplaced(self, resources: dict[str, dict[str, Any]], timeout: float) -> str:
        asks = {role: {k: v for k, v in r.items() if v} for role, r in resources.items()}
        return (f"engine ray: the cluster did not place the job's processes in {timeout:g} s "
                f"(startup_timeout); the roles ask for {asks}, the cluster has "
                f"{self.ray.available_resources()} free. Fix: lower roles.*.resources or the role counts, "
                "or add nodes")

    def _placed(self, group: RayGroup, resources: dict[str, dict[str, Any]], timeout: float,
                lost_after: float) -> list[tuple[str, int]] | None:
        """Each actor's node address and a free port there; None when an actor was lost meanwhile (see
        `_answers`): that process is lost and the others are not started (the supervisor starts the group
        again)."""
        calls = {a.address.remote(): i for i, a in enumerate(group.actors)}
        where = self._answers(group, calls, timeout, lost_after, when=" before it started its process",
                              unplaced=self._unplaced(resources, timeout))
        if len(where) < len(group.actors):
            for i in range(len(group.processes)):
                group.lost(i, "not started: another actor of the group was lost as it started", code=1)
            return None
        return [tuple(where[i]) for i in range(len(group.actors))]  # type: ignore[misc]

    def _bundle_nodes(self, pg: Any) -> dict[int, tuple[str, bool, Any]]:
        """``{bundle index: (its node's address, whether Ray counts the node alive, its raylet's port)}``."""
        try:
            table = self.ray.util.placement_group_table(pg)
            nodes = {n.get("NodeID"): n for n in self.ray.nodes()}
        except Exception:  # a look that failed: the actors are waited for as before
            return {}
        out = {}
        for index, node_id in (table.get("bundles_to_node_id") or {}).items():
            node = nodes.get(node_id)
            if node is not None:
                out[int(index)] = (str(node.get("NodeManagerAddress", "")), bool(node.get("Alive")),
                                   node.get("NodeManagerPort"))
        return out

    def close(self) -> None:
        """Shut down the local Ray instance this engine started (disconnect from a cluster it joined).

        From a head that has gone silent (`HeadWatch`) nothing is disconnected: ``ray.shutdown`` would
        wait on it for good, then as now at this process's exit (Ray's ``atexit`` hook, taken off), and
        Ray's teardown without its head crashes the process (SIGSEGV): so this process then ends at its
        exit with status 1 (its job failed), before that teardown (`_exit_before_ray`)."""
        headless = self._head is not None and self._head.silent() >= _HEAD_QUIET_S
        if self._head is not None:
            self._head.close()
        if self._owned:
            self._owned = False
            if headless:
                atexit.unregister(self.ray.shutdown)
                atexit.register(_exit_before_ray)
            else:
                self.ray.shutdown()


def _exit_before_ray() -> None:
    """End this process at its exit, status 1, before Ray's teardown (its head gone: `RayEngine.close`)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def bundle(ask: Mapping[str, Any]) -> dict[str, float]:
    """A process's placement bundle in Ray's resource names, from its role's ``resources`` (Ray refuses an
    empty bundle: a process that asks for nothing reserves a sliver of a CPU)."""
    out = {"CPU": float(ask.get("cpus", 1) or 0), "GPU": float(ask.get("gpus", 0) or 0),
           "memory": float(ask.get("memory", 0) or 0)}
    out = {k: v for k, v in out.items() if v > 0}
    return out or {"CPU": 0.01}


def shortfall(bundles: Sequence[Mapping[str, float]], placement: str,
              nodes: Sequence[Mapping[str, float]]) -> str | None:
    """Why ``nodes`` (their total resources) can never hold ``bundles`` under ``placement``, or None when
    they might (a necessary condition only: packing bins is Ray's to try, and a busy cluster to wait
    for).

    Example:
        >>> shortfall([{"CPU": 1}, {"CPU": 1}], "strict_spread", [{"CPU": 4}])
        'a node per process: 2 needed, 1 can hold one'
    """
    def fits(b: Mapping[str, float], node: Mapping[str, float]) -> bool:
        return all(node.get(k, 0.0) >= v for k, v in b.items())

    for b in bundles:
        if not any(fits(b, n) for n in nodes):
            return f"no alive node has {format_resources(b)} for one process"
    if placement == "strict_pack":
        total = {k: sum(b.get(k, 0.0) for b in bundles) for k in {k for b in bundles for k in b}}
        if not any(fits(total, n) for n in nodes):
            return f"one node for all: none has {format_resources(total)}"
    elif placement == "strict_spread":
        free = list(nodes)
        for b in sorted(bundles, key=lambda b: -sum(b.values())):  # the largest take their node first
            node = next((n for n in free if fits(b, n)), None)
            if node is None:
                able = sum(any(fits(x, n) for x in bundles) for n in nodes)
                return f"a node per process: {len(bundles)} needed, {able} can hold one"
            free.remove(node)
    for key in {k for b in bundles for k in b}:
        need, have = sum(b.get(key, 0.0) for b in bundles), sum(n.get(key, 0.0) for n in nodes)
        if need > have:
            return f"{_name(key)}: {_amount(key, need)} asked, {_amount(key, have)} on the alive nodes"
    return None


def describe_node(node: Mapping[str, Any]) -> str:
    """``10.0.0.5 (4 CPU, 1 GPU, 12.0 GiB)``: a node of ``ray.nodes()`` in a few words."""
    return f"{node.get('NodeManagerAddress')} ({format_resources(node.get('Resources') or {})})"


def format_resources(res: Mapping[str, float]) -> str:
    return ", ".join(_amount(k, res[k]) for k in ("CPU", "GPU", "memory") if res.get(k)) or "nothing"


def _name(key: str) -> str:
    return {"CPU": "CPUs", "GPU": "GPUs"}.get(key, key)


def _amount(key: str, value: float) -> str:
    return f"{value / 2**30:.1f} GiB" if key == "memory" else f"{value:g} {key}"


def _node_dead(host: str) -> str:
    return (f"Ray marked its node {host} dead (it did not answer Ray's health checks: the node is down, or "
            "unreachable, e.g. cut off by a network partition)")


def _answers(host: str, port: Any, timeout: float = 1.0) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout`` seconds."""
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError, TypeError):
        return False
    return True


def check_answers(address: str, timeout: float = _CONNECT_S) -> None:
    """Raise `EngineUnreachableError` when nothing accepts a TCP connection at the Ray ``address``
    (``HOST:PORT``, ``ray://HOST[:PORT]``) within ``timeout`` seconds; ``auto`` and ``local`` are Ray's
    to find. Only a connection is made: nothing is sent.

    Example:
        >>> check_answers("10.0.0.5:6379")
    """
    if address in ("auto", "local"):
        return
    client = address.startswith("ray://")
    target = address.removeprefix("ray://")
    try:
        host, port = protocol.parse_addr(target)
    except ValueError:
        if not client:
            return  # not HOST:PORT: Ray says what it makes of it
        host, port = target.strip("[]"), _RAY_CLIENT_PORT
    began = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        waited = time.monotonic() - began
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or describe_error(e))
        raise EngineUnreachableError(
            f"engine.address={address!r}: no Ray cluster answers at {protocol.format_addr(host, port)} "
            f"({why}, after {waited:.1f} s). Fix: start the cluster's head there (`ray start --head "
            f"--node-ip-address {host} --port {port}`), or set engine.address to the head's HOST:PORT as "
            "`ray start --head` printed it, and check that this machine can reach it") from e
