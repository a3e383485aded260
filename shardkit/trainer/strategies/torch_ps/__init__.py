"""torch parameter server over ``torch.distributed.rpc``: ps processes hold the parameters, workers push
gradients and pull weights. This module joins a process to the rpc group (`serve`, `connect`); the
worker's handle (`ParameterServerClient`, `assign`) is `shardkit.trainer.strategies.torch_ps._client`,
importable
from here too.

A job with ``framework: torch, strategy: parameter_server`` has ``ps`` and ``worker`` roles. Ranks put
the ps first (ps ``i`` is rpc rank ``i``, named ``ps{i}``; worker ``j`` is rank ``num_ps + j``, named
``worker{j}``); ``shardkit.trainer.init()`` runs `serve` on ps roles, so the script's own code runs
only on workers::

    ctx = shardkit.trainer.init()                      # on a ps: serves, then exits
    model = Net()
    ps = shardkit.trainer.strategies.torch_ps.connect(ctx, model)  # optimizer from params.optimizer
    reader = ctx.reader()
    start = ctx.checkpoint.restore(model=model, optimizer=ps, reader=reader)   # the ps state rides as
    ps.pull()                                                                  # the "optimizer"
    with ps, ctx:                                       # this order: ctx.finish saves, then ps closes
        for batch in reader:
            model.zero_grad()
            loss = loss_fn(model(batch["x"]), batch["y"])
            loss.backward()
            ps.step()                                   # push gradients, pull fresh weights
            ctx.step({"loss": loss.detach()}, samples=len(batch["y"]))

Choices:
- Sharding: with several ps, each trainable parameter lives on exactly one ps, chosen greedily by size
  (largest first, onto the least loaded ps), the same on every worker since it depends only on the model.
  Buffers (BatchNorm statistics) are not served: each worker keeps its own.
- Updates are asynchronous (Downpour-style SGD): a ps applies each worker's gradient when it arrives,
  with the optimizer named in ``params.optimizer`` (``sgd`` or ``adam`` and their options). `step` is
  synchronous for its own worker (push, then the weights after the update, one round trip per ps);
  `push` alone returns a future, for overlapping the next forward pass with the push.
- Worker 0 owns the ps state: its first `pull`/`push`/`step` sends the model's parameters (or, after
  `load_state_dict`, the checkpoint's) to the ps; other workers' pulls wait for that. `state_dict` (on
  worker 0 only) takes parameters and optimizer state keyed by parameter name, so a checkpoint restores
  onto any number of ps, as one consistent cut: each worker numbers its pushes and every ps applies a
  worker's pushes in that order, so a ps holds exactly the first n of each worker's; worker 0 makes
  every ps park new pushes, takes the most of each worker's that any ps has applied, and each ps
  returns its part once it holds exactly those (`torch_ps_server.Shard`). Workers pause for that round
  trip; a ps never blocks a thread on it (rpc ``async_execution``).
- Reader positions: each push carries the worker's reader position (the state of the reader
  ``ctx.checkpoint`` tracks, as JSON text: the ps get plain text, nothing of the worker's to unpickle)
  after the batch it was computed on, and ps 0 keeps, per worker, the one of its last push applied. So
  the cut also says where each worker's reader was for exactly the pushes it holds
  (`ParameterServerClient.state_dict_with_readers`); ``ctx.checkpoint`` saves them in ``state.json``
  and gives each worker its own on a restore (with the same number of workers: with another, every
  worker continues from worker 0's, re-sharded by the reader, with a `CheckpointWarning`). A restarted
  worker trains again no batch the restored ps state holds, and skips none. A worker that has pushed
  nothing since the job started is saved as None (it starts its shard from the beginning); after a
  restore worker 0 tells ps 0 every worker's restored position (`load_reader_states`), for those that
  push nothing before the next save.
- Checkpoints: worker 0 writes them (``ctx.checkpoint`` with ``optimizer=ps``: the file is
  ``optimizer.pt``, tensors only, loaded with ``weights_only``). The final one holds every worker's
  updates: each worker tells ps 0 when it has pushed its last gradient (`finish`, which ``ctx.finish``
  and `close` call), and worker 0's ``ctx.finish`` waits for all of them, heartbeating, before it saves.
  The wait is bounded by `FINAL_WAIT` (then the state so far is saved, with a `CheckpointWarning`), so
  a hung worker cannot hang the job; a dead one is restarted by the supervisor anyway. Worker 0 would
  wait for the others in `close` in any case (``rpc.shutdown``), so the job ends no later.
- Trust: rpc pickles its messages (that is how ``torch.distributed.rpc`` works). The ps port must only
  be reachable by the job's own processes, as with every torch.distributed backend.
- Shutdown: `close` (and a ps's `serve`) call the graceful ``rpc.shutdown()``, which returns only when
  every ps and worker has called it: the ps serves until the last worker is done.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch.distributed import rpc

from shardkit.errors import ConfigError
from shardkit.job import protocol
from shardkit.trainer.strategies.torch_ps._client import (  # the client's names are importable from here too
    FINAL_WAIT,  # noqa: F401
    RPC_TIMEOUT,
    WAIT_SLICE,  # noqa: F401
    ParameterServerClient,
    assign,
)
from shardkit.trainer.strategies.torch_ps._optimizer import validate_optimizer

__all__ = ["ParameterServerClient", "assign", "connect", "serve"]

DEFAULT_OPTIMIZER: dict[str, Any] = {"name": "sgd", "lr": 0.01}


class _Checkpoints(Protocol):
    objects: dict[str, Any]

    @property
    def url(self) -> str | None: ...


class _Context(Protocol):
    role: str
    role_index: int
    params: Mapping[str, Any]

    @property
    def checkpoint(self) -> _Checkpoints: ...

    def heartbeat(self, kind: str = ...) -> None: ...

    def on_finish(self, callback: Callable[[], bool]) -> None: ...


def _rpc_options(timeout: timedelta = RPC_TIMEOUT) -> rpc.TensorPipeRpcBackendOptions:
    addr = os.environ.get(protocol.MASTER_ADDR)
    port = os.environ.get(protocol.MASTER_PORT)
    if not addr or not port:
        raise ConfigError(f"{protocol.MASTER_ADDR}/{protocol.MASTER_PORT} are not set: run the script with "
                          "`shardkit train job.yaml` (framework: torch, strategy: parameter_server)")
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{addr}:{port}",
                                           rpc_timeout=timeout.total_seconds())


def _init_rpc(name: str, rank: int, world: int) -> None:
    with warnings.catch_warnings():
        # torch's own rpc setup uses a deprecated ProcessGroup call (torch 2.13); not ours to fix.
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        rpc.init_rpc(name, rank=rank, world_size=world,  # type: ignore[no-untyped-call]
                     rpc_backend_options=_rpc_options())


def _world() -> tuple[int, int]:
    try:
        return int(os.environ[protocol.RANK]), int(os.environ[protocol.WORLD_SIZE])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{protocol.RANK}/{protocol.WORLD_SIZE} are missing or not integers ({e}): run "
                          "the script with `shardkit train job.yaml`") from e


def serve(ctx: _Context, *, heartbeat_interval: float = 1.0) -> None:
    """Serve one shard of the parameters until every worker has closed its connection (ps roles).

    Example (``shardkit.trainer.init()`` does this on ps roles):
        >>> if ctx.role == "ps":
        ...     shardkit.trainer.strategies.torch_ps.serve(ctx)

    Heartbeats ``alive`` from a thread every ``heartbeat_interval`` seconds while serving.
    """
    rank, world = _world()
    if rank != ctx.role_index:
        raise ConfigError(f"ps {ctx.role_index} has {protocol.RANK}={rank}; a torch parameter-server job "
                          "ranks the ps first (ps i is rank i): check the cluster spec")
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_interval):
            ctx.heartbeat("alive")

    thread = threading.Thread(target=beat, name="shardkit-ps-heartbeat", daemon=True)
    thread.start()
    try:
        _init_rpc(f"ps{ctx.role_index}", rank, world)
        rpc.shutdown()  # graceful: serves requests until every worker has called shutdown too
    finally:
        stop.set()
        thread.join()


def connect(ctx: _Context, model: torch.nn.Module, *,
            optimizer: Mapping[str, Any] | None = None) -> ParameterServerClient:
    """Join the job's rpc group as a worker and return the handle that pushes and pulls ``model``.

    Example:
        >>> ps = shardkit.trainer.strategies.torch_ps.connect(ctx, model,
        ...                                                  optimizer={"name": "adam", "lr": 3e-3})

    Args:
        ctx: this worker's `TrainContext`.
        model: its trainable parameters are served; it must be built the same way on every worker.
        optimizer: ``{"name": "sgd"|"adam", ...options}``; default ``ctx.params["optimizer"]``, else
            SGD with lr 0.01. Only worker 0's choice is used (it initializes the ps).
    """
    if ctx.role != "worker":
        raise ConfigError(f"torch_ps.connect is for worker roles, not {ctx.role!r} (ps roles run serve)")
    if optimizer is not None:
        spec = validate_optimizer(optimizer, "connect(optimizer=...)")
    else:
        spec = validate_optimizer(ctx.params.get("optimizer", DEFAULT_OPTIMIZER), "params.optimizer")
    rank, world = _world()
    num_ps = rank - ctx.role_index
    if num_ps < 1 or num_ps >= world:
        raise ConfigError(f"worker {ctx.role_index} has {protocol.RANK}={rank} of {world}: a torch "
                          "parameter-server job needs roles.ps.count >= 1, ranked before the workers")
    _init_rpc(f"worker{ctx.role_index}", rank, world)

    def position() -> Mapping[str, Any] | None:  # the reader ctx.checkpoint saves, if there is one
        reader = ctx.checkpoint.objects.get("reader") if ctx.checkpoint.url is not None else None
        return None if reader is None else reader.state_dict()  # type: ignore[no-any-return]

    client = ParameterServerClient(model, num_ps=num_ps, worker=ctx.role_index, optimizer=spec,
                                   num_workers=world - num_ps, heartbeat=lambda: ctx.heartbeat("alive"),
                                   position=position)
    ctx.on_finish(client.finish)  # before the final save: see `ParameterServerClient.finish`
    return client
