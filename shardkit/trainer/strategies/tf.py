"""TensorFlow strategies for `shardkit train`: MultiWorkerMirrored (allreduce) and ParameterServer roles.

Allreduce (``framework: tensorflow, strategy: allreduce``): every worker (and the chief, if any) runs
the script; `strategy` is a ``MultiWorkerMirroredStrategy`` built from ``TF_CONFIG``. Each process
reads its own reader shard and hands its local batch to ``strategy.run`` (one replica per process).
Checkpoints: every worker takes part in the save (its variables sync through collectives) and only
the chief writes durably (``writer=ctx.is_chief``, which ``ctx.step`` passes). With
``checkpoint.every_seconds`` the chief's clock decides, and an all-reduce every few steps tells the others.

Parameter server (``strategy: parameter_server``): ``ps`` and ``worker`` roles are plain
``tf.distribute.Server`` processes (`serve`, run by ``shardkit.trainer.init()``); the chief runs the
script: a ``ParameterServerStrategy`` places the variables on the ps, and a ``ClusterCoordinator``
sends each step to a free worker. The chief alone reads the data (one shard of 1) and passes each batch
as the step's arguments (`Scheduler`).

Why not a dataset on the workers: a shardkit reader is Python, and a ``tf.data`` pipeline built from
Python (``from_generator``, ``py_function``) keeps calling a function that exists only in the chief's
process. With TensorFlow 2.21 such a per-worker dataset ran some steps, then the coordinator hung
on the next function it scheduled. A per-worker dataset from in-memory tensors works (a little
faster than passing batches) but copies the whole dataset into every worker and has no resume
position. Passing batches costs one transfer per batch from the chief, and makes checkpoints exact:
before a save the chief waits for every scheduled step (``coordinator.join()``), so the variables and
the reader's position match.

Updates in a parameter-server job are asynchronous: each step applies its gradients to the ps
variables when it finishes on its worker. A Keras 3 optimizer counts ``iterations`` with a read and a
write, so steps finishing together lose increments: Adam's bias correction and learning-rate
schedules see fewer steps than ran. Count steps with ``ctx.step_count``, or with a
``tf.Variable.assign_add`` in the step function, which is exact.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from shardkit.errors import ConfigError, require
from shardkit.job import protocol

__all__ = ["Scheduler", "cluster", "coordinator", "serve", "strategy"]


class _Context(Protocol):
    role: str
    role_index: int

    def heartbeat(self, kind: str = ...) -> None: ...


def _tf() -> Any:
    return require("tensorflow", extra="tf", purpose="TensorFlow strategies")


def cluster() -> dict[str, Any]:
    """This process's parsed ``TF_CONFIG`` (``{"cluster": {...}, "task": {"type", "index"}}``)."""
    raw = os.environ.get(protocol.TF_CONFIG)
    if not raw:
        raise ConfigError(f"{protocol.TF_CONFIG} is not set: run the script with `shardkit train job.yaml` "
                          "(framework: tensorflow)")
    try:
        config = json.loads(raw)
    except ValueError:
        config = None
    task = config.get("task") if isinstance(config, dict) else None
    if not (isinstance(config, dict) and isinstance(config.get("cluster"), dict) and isinstance(task, dict)
            and isinstance(task.get("type"), str) and isinstance(task.get("index"), int)):
        raise ConfigError(f"{protocol.TF_CONFIG}={raw[:200]!r} is not a TF_CONFIG with cluster and "
                          "task.type/index; `shardkit train` sets it: do not set it by hand")
    return config


def _is_parameter_server(config: Mapping[str, Any]) -> bool:
    return bool(config["cluster"].get("ps"))


def strategy(ctx: _Context) -> Any:
    """The ``tf.distribute`` strategy of this job, from ``TF_CONFIG``.

    Example:
        >>> strategy = shardkit.trainer.strategies.tf.strategy(ctx)        # first, before any other TF call
        >>> with strategy.scope():
        ...     model, optimizer = build()

    A cluster with ``ps`` gives a ``ParameterServerStrategy`` (chief only: ps and workers serve);
    otherwise a ``MultiWorkerMirroredStrategy``, which must be created before TensorFlow runs anything
    else in the process (it configures the collective runtime at creation).
    """
    config = cluster()
    if _is_parameter_server(config) and ctx.role != "chief":
        raise ConfigError(f"strategy() on a {ctx.role!r} role of a parameter-server job: only the chief "
                          "runs the script; ps and worker roles serve (shardkit.trainer.init() does it)")
    tf = _tf()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if _is_parameter_server(config):
        return tf.distribute.ParameterServerStrategy(resolver)
    made = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    checkpoints = getattr(ctx, "checkpoint", None)
    if checkpoints is not None:  # checkpoint.every_seconds: the chief's clock decides for every worker
        checkpoints.share_decisions(made)
    return made


def coordinator(strategy: Any) -> Any:
    """The ``ClusterCoordinator`` that dispatches a ``ParameterServerStrategy``'s steps to the workers."""
    tf = _tf()
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        raise ConfigError(f"coordinator() needs a ParameterServerStrategy, got {type(strategy).__name__}: "
                          "MultiWorkerMirrored workers run their own steps (strategy.run)")
    return tf.distribute.coordinator.ClusterCoordinator(strategy)


def serve(ctx: _Context, *, heartbeat_interval: float = 1.0, stop: threading.Event | None = None) -> None:
    """Run this process's ``tf.distribute.Server`` (ps and worker roles of a parameter-server job).

    Example (``shardkit.trainer.init()`` does this on those roles):
        >>> shardkit.trainer.strategies.tf.serve(ctx)  # returns when ``stop`` is set; else at SIGTERM

    The server runs on TensorFlow's own threads once started, so the calling thread is free to
    heartbeat ``alive`` every ``heartbeat_interval`` seconds (no second thread is needed). A
    TensorFlow server has no "job done": the supervisor stops it (SIGTERM) once the chief has exited.
    """
    config = cluster()
    task = config["task"]
    role, index = task["type"], int(task["index"])
    if (role, index) != (ctx.role, ctx.role_index) or role not in ("ps", "worker"):
        raise ConfigError(f"serve() is for the ps and worker roles of a TensorFlow parameter-server job; "
                          f"this is {ctx.role} {ctx.role_index} with TF_CONFIG task {task}")
    tf = _tf()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=role, task_index=index,
                                  protocol=resolver.rpc_layer or "grpc", start=True)
    ctx.heartbeat("alive")
    stop = stop or threading.Event()
    while not stop.wait(heartbeat_interval):
        ctx.heartbeat("alive")
    del server  # TensorFlow cannot stop a server in-process: it serves until the process exits


class _StepContext(Protocol):
    step_count: int
    checkpoint: Any

    def step(self, metrics: Mapping[str, float] | None = None, *, samples: int = 0) -> Any: ...


class Scheduler:
    """The chief's loop of a TensorFlow parameter-server job: one scheduled step per batch.

    Example:
        >>> coord = shardkit.trainer.strategies.tf.coordinator(strategy)
        >>> run = shardkit.trainer.strategies.tf.Scheduler(ctx, coord, train_step)  # a tf.function
        >>> for batch in reader:
        ...     run(batch["pixels"], batch["label"], samples=len(batch["label"]))
        >>> run.join()

    Each call schedules ``step_fn(*args)`` on a free worker (numpy arguments become tensors, sent with
    the step) and counts the step with ``ctx.step``, which heartbeats and saves when due. Choices:
    - At most ``inflight`` steps are outstanding (default 4 per worker): when more are scheduled, the
      call waits for the oldest. This bounds memory, and it makes a hung worker visible: the chief
      stops stepping, so its heartbeats stop.
    - Before a step at which a checkpoint is due, every scheduled step is awaited
      (``coordinator.join()``), so the saved variables and reader state both cover exactly the steps
      counted. A checkpoint therefore costs a pipeline drain.
    - The metrics ``ctx.step`` reports are those of the newest finished step (``step_fn`` returns a
      scalar, reported as ``loss``, or a dict of scalars): a few steps behind the one just scheduled.
    """

    def __init__(self, ctx: _StepContext, coordinator: Any, step_fn: Callable[..., Any], *,
                 inflight: int | None = None) -> None:
        workers = len(cluster()["cluster"].get("worker", [])) or 1
        self.ctx, self.coordinator, self.step_fn = ctx, coordinator, step_fn
        self.inflight = inflight if inflight is not None else 4 * workers
        if self.inflight < 1:
            raise ConfigError(f"Scheduler(inflight={inflight}): use 1 or more steps in flight")
        self._pending: deque[Any] = deque()
        self.metrics: dict[str, float] = {}

    def _fetch(self, value: Any) -> None:
        result = value.fetch()
        if isinstance(result, Mapping):
            self.metrics = {str(k): float(v) for k, v in result.items()}
        elif result is not None:
            self.metrics = {"loss": float(result)}

    def __call__(self, *args: Any, samples: int = 0) -> None:
        tf = _tf()
        tensors = tuple(tf.convert_to_tensor(a) for a in args)
        self._pending.append(self.coordinator.schedule(self.step_fn, args=tensors))
        if self.ctx.checkpoint is not None and self.ctx.checkpoint.due(self.ctx.step_count + 1):
            self.join()
        while len(self._pending) > self.inflight:
            self._fetch(self._pending.popleft())
        self.ctx.step(dict(self.metrics), samples=samples)

    def join(self) -> dict[str, float]:
        """Wait for every scheduled step; returns the metrics of the last one."""
        self.coordinator.join()
        while self._pending:
            self._fetch(self._pending.popleft())
        return dict(self.metrics)

