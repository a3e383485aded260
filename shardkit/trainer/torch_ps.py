"""torch parameter server over ``torch.distributed.rpc``: ps processes hold the parameters, workers push
gradients and pull weights.

A job with ``framework: torch, strategy: parameter_server`` has ``ps`` and ``worker`` roles. Ranks put
the ps first (ps ``i`` is rpc rank ``i``, named ``ps{i}``; worker ``j`` is rank ``num_ps + j``, named
``worker{j}``); ``shardkit.trainer.init()`` runs `serve` on ps roles, so the script's own code runs
only on workers::

    ctx = shardkit.trainer.init()                      # on a ps: serves, then exits
    model = Net()
    ps = shardkit.trainer.torch_ps.connect(ctx, model)  # optimizer from params.optimizer
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

import contextlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch.distributed import rpc

from shardkit.cluster import protocol
from shardkit.errors import CheckpointError, CheckpointWarning, ConfigError
from shardkit.trainer import torch_ps_server as server
from shardkit.trainer.ps_optimizer import validate_optimizer

__all__ = ["ParameterServerClient", "assign", "connect", "serve"]

DEFAULT_OPTIMIZER: dict[str, Any] = {"name": "sgd", "lr": 0.01}
RPC_TIMEOUT = timedelta(minutes=10)  # a pull may wait for worker 0's restore; heartbeats catch real hangs
# How long worker 0's final save waits for the other workers' last pushes: as long as an rpc may take,
# since a slower worker may be many steps behind; a dead worker stops the job sooner (the supervisor).
FINAL_WAIT = RPC_TIMEOUT
WAIT_SLICE = 1.0  # seconds per wait on ps 0 between two heartbeats


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


def assign(sizes: Iterable[tuple[str, int]], num_ps: int) -> dict[str, int]:
    """Which ps holds each parameter: largest first onto the least loaded ps (ties: lowest index).

    Example:
        >>> assign([("a", 10), ("b", 7), ("c", 5)], 2)
        {'a': 0, 'b': 1, 'c': 1}
    """
    if num_ps < 1:
        raise ConfigError(f"roles.ps.count={num_ps}: a parameter-server job needs at least one ps")
    load = [0] * num_ps
    placed: dict[str, int] = {}
    for name, size in sorted(sizes, key=lambda item: -item[1]):  # stable: model order breaks ties
        target = min(range(num_ps), key=lambda i: (load[i], i))
        placed[name] = target
        load[target] += size
    return placed


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
        ...     shardkit.trainer.torch_ps.serve(ctx)

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


# The ps-side entry points that wait for other pushes: they return a future instead of holding a thread of
# the rpc pool (a hold parks the pushes of every worker). Here rather than in torch_ps_server, whose
# module imports without torch (config validation); the ps imported this module to serve.
@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _rpc_push(worker: int, seq: int, grads: dict[str, torch.Tensor],
              position: str | None) -> torch.futures.Future[int]:
    return server.SHARD.push(worker, seq, grads, position)


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _rpc_push_pull(worker: int, seq: int, grads: dict[str, torch.Tensor],
                   position: str | None) -> torch.futures.Future[dict[str, torch.Tensor]]:
    def weights(done: torch.futures.Future[int]) -> dict[str, torch.Tensor]:
        done.wait()  # raises the push's error
        return server.SHARD.weights()

    return server.SHARD.push(worker, seq, grads, position).then(weights)


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _rpc_snapshot(target: dict[int, int]) -> torch.futures.Future[dict[str, Any]]:
    return server.SHARD.snapshot(target)


class ParameterServerClient:
    """A worker's handle on the parameter servers (create with `connect`)."""

    def __init__(self, model: torch.nn.Module, *, num_ps: int, worker: int,
                 optimizer: Mapping[str, Any], num_workers: int = 1,
                 heartbeat: Callable[[], None] | None = None,
                 position: Callable[[], Mapping[str, Any] | None] | None = None) -> None:
        self.model = model
        self.worker = worker
        self.num_workers = num_workers
        self._heartbeat = heartbeat  # called while worker 0 waits in `finish`
        self._position = position  # this worker's reader state now, sent with each push
        self._seq = 0  # pushes sent: the ps apply each worker's in this order
        self._inflight: list[torch.futures.Future[list[Any]]] = []  # `push` futures not yet waited for
        self._finished = False
        self.optimizer = dict(optimizer)
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.placement = assign(((n, p.numel()) for n, p in self.params.items()), num_ps)
        self.ps_names = [f"ps{i}" for i in range(num_ps)]
        self._initialized = worker != 0  # only worker 0 initializes the ps
        self._pending: dict[str, Any] | None = None  # a restored state to send instead of the model
        self._closed = False

    def _split(self, values: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        parts: list[dict[str, torch.Tensor]] = [{} for _ in self.ps_names]
        for name, value in values.items():
            parts[self.placement[name]][name] = value
        return parts

    def _ensure_initialized(self) -> None:
        if self._closed:
            raise RuntimeError("this parameter-server connection is closed; close it last (`with ps, ctx:` "
                               "lets ctx.finish save the ps state before the connection closes)")
        if self._initialized:
            return
        state = self._pending or {"params": {n: p.detach() for n, p in self.params.items()}, "state": {},
                                  "spec": self.optimizer, "updates": 0}
        values = state["params"]
        misfit = sorted(n for n, p in self.params.items()
                        if n not in values or tuple(values[n].shape) != tuple(p.shape))
        if misfit or set(values) - set(self.params):
            raise ConfigError(f"the parameter-server state does not fit this model (parameters {misfit[:5]} "
                              f"missing or of another shape, {sorted(set(values) - set(self.params))[:5]} "
                              "unknown): restore a checkpoint saved from the same model")
        params = self._split(values)
        slots = self._split({n: v for n, v in state["state"].items() if n in self.params})
        futures = [rpc.rpc_async(ps, server._rpc_load, args=(params[i], state["spec"], slots[i] or None,
                                                             int(state["updates"])))
                   for i, ps in enumerate(self.ps_names)]
        torch.futures.wait_all(futures)
        self._initialized, self._pending = True, None

    def _grads(self) -> dict[str, torch.Tensor]:
        # Cloned: rpc may still be sending a tensor when the next backward pass writes into .grad.
        return {n: p.grad.detach().clone() for n, p in self.params.items() if p.grad is not None}

    def _assign(self, weights: Iterable[Mapping[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for part in weights:
                for name, value in part.items():
                    self.params[name].copy_(value)

    def pull(self) -> None:
        """Copy the current weights from every ps into the model (blocks)."""
        self._ensure_initialized()
        futures = [rpc.rpc_async(ps, server._rpc_pull) for ps in self.ps_names]
        self._assign(torch.futures.wait_all(futures))

    def _reader_state(self) -> str | None:
        """This worker's reader position as JSON text (rpc pickles its messages: the ps get plain text)."""
        state = self._position() if self._position is not None else None
        if state is None:
            return None
        try:
            return json.dumps(state, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"worker {self.worker}: the tracked reader's state_dict() is not JSON "
                                  f"({e}); its position goes with every push, to be saved with the ps state: "
                                  "track a reader whose state holds numbers, strings, lists and dicts only"
                                  ) from e

    def _send(self, entry: Callable[..., Any], grads: Mapping[str, torch.Tensor] | None
              ) -> list[torch.futures.Future[Any]]:
        """One push to every ps (numbered; the reader position goes to ps 0, which keeps them)."""
        self._ensure_initialized()
        parts = self._split(self._grads() if grads is None else grads)
        self._seq += 1
        position = self._reader_state()
        return [rpc.rpc_async(ps, entry, args=(self.worker, self._seq, part, position if i == 0 else None))
                for i, (ps, part) in enumerate(zip(self.ps_names, parts, strict=True))]

    def push(self, grads: Mapping[str, torch.Tensor] | None = None) -> torch.futures.Future[list[Any]]:
        """Send gradients (default: the model's ``.grad``) to the ps; returns a future of the updates.

        The reader position sent with it is the tracked reader's now (``ctx.checkpoint``'s
        ``reader``): push the gradients of a batch before reading the next one."""
        future = torch.futures.collect_all(self._send(_rpc_push, grads))
        self._inflight = [f for f in self._inflight if not f.done()]
        self._inflight.append(future)
        return future

    def step(self) -> None:
        """Push the model's gradients and load the updated weights: one round trip per ps (blocks)."""
        self._assign(torch.futures.wait_all(self._send(_rpc_push_pull, None)))

    def state_dict(self) -> dict[str, Any]:
        """The ps state (parameters, optimizer state by parameter name, spec, update count); worker 0.

        Every ps part holds the same pushes (see `state_dict_with_readers`)."""
        return self.state_dict_with_readers()[0]

    def state_dict_with_readers(self) -> tuple[dict[str, Any], list[dict[str, Any] | None]]:
        """The ps state and, by worker index, each worker's reader state after the last batch whose
        gradient that state includes (None: none of its pushes since the job started); worker 0 only.

        A consistent cut: every ps parks new pushes (``hold``), the most pushes of each worker any ps
        has applied becomes the target, and each ps returns its state once it has applied exactly
        those (pushes in flight to it arrive; later ones wait). Workers pause for one round trip.
        ``ctx.checkpoint`` saves the positions in ``state.json`` (``reader_shards``).

        Raises:
            CheckpointError: on a worker other than 0 (two cuts at once would spoil each other).
        """
        if self.worker != 0:
            raise CheckpointError(f"worker {self.worker} asked for the parameter-server state: worker 0 owns "
                                  "it and takes it for the checkpoints (ctx.checkpoint saves on worker 0); "
                                  "call state_dict() on worker 0 only")
        self._ensure_initialized()
        try:
            applied = torch.futures.wait_all([rpc.rpc_async(ps, server._rpc_hold) for ps in self.ps_names])
            target: dict[int, int] = {}
            for counts in applied:
                for worker, count in counts.items():
                    target[worker] = max(target.get(worker, 0), count)
            parts = torch.futures.wait_all([rpc.rpc_async(ps, _rpc_snapshot, args=(target,))
                                            for ps in self.ps_names])
        except BaseException:
            with contextlib.suppress(Exception):  # the other workers' pushes go on; the error is the news
                torch.futures.wait_all([rpc.rpc_async(ps, server._rpc_release) for ps in self.ps_names])
            raise
        spec = parts[0]["spec"] if parts else self.optimizer  # the ps's: a restore may have changed it
        merged: dict[str, Any] = {"version": 1, "params": {}, "state": {}, "spec": spec,
                                  "updates": max((int(p["updates"]) for p in parts), default=0)}
        for part in parts:
            merged["params"].update(part["params"])
            merged["state"].update(part["state"])
        positions = parts[0]["positions"] if parts else {}
        readers = [json.loads(positions[w]) if positions.get(w) is not None else None
                   for w in range(self.num_workers)]
        return merged, readers

    def load_reader_states(self, states: Sequence[Mapping[str, Any] | None]) -> None:
        """Worker 0, after `load_state_dict`: tell ps 0 the reader position each worker restored (by
        worker index), for the workers that push nothing before the next save; others: ignored."""
        if self.worker != 0:
            return
        positions = {w: None if state is None else json.dumps(state, separators=(",", ":"))
                     for w, state in enumerate(states)}
        rpc.rpc_sync(self.ps_names[0], server._rpc_seed_positions, args=(positions,))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Worker 0: put a `state_dict` back on the ps now; other workers: ignored (worker 0 owns it).

        The saved optimizer spec wins over ``params.optimizer``, as torch's own ``load_state_dict``
        restores the saved learning rate; the parameters may be spread over another number of ps.
        """
        if self.worker != 0:
            return
        if not isinstance(state, Mapping) or state.get("version") != 1 or "params" not in state:
            raise ConfigError("load_state_dict got something that is not a torch_ps state_dict "
                              "(version 1 with params): restore with the same strategy that saved it")
        self._pending = {"params": state["params"], "state": state.get("state", {}),
                         "spec": validate_optimizer(state.get("spec", self.optimizer), "state.spec"),
                         "updates": int(state.get("updates", 0))}
        self._initialized = False
        self._ensure_initialized()

    def finish(self, timeout: timedelta = FINAL_WAIT) -> bool:
        """Tell ps 0 this worker has pushed its last gradient; worker 0 also waits until every worker has.

        ``ctx.finish`` calls it before the final save (`connect` registers it), and `close` too; only
        the first call acts. Outstanding `push` futures are waited for first, so the message follows
        the last update. Worker 0 waits at most ``timeout``, heartbeating every `WAIT_SLICE` seconds;
        past it, it warns (`CheckpointWarning`) and goes on, so its save holds what the ps has.

        Returns whether the ps state may have changed since worker 0's last save (worker 0 of several
        workers: ``ctx.finish`` then saves even a step it has saved already); False elsewhere.
        """
        if self._finished or self._closed:
            return False
        self._tell_finished()
        if self.worker != 0 or self.num_workers <= 1:
            return False
        first = self.ps_names[0]
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left = deadline - time.monotonic()
            missing: list[int] = rpc.rpc_sync(first, server._rpc_wait_finished,
                                              args=(self.num_workers, max(0.0, min(WAIT_SLICE, left))))
            if not missing:
                return True
            if left <= 0:
                warnings.warn(f"worker 0 waited {timeout.total_seconds():.0f} s (torch_ps.FINAL_WAIT) for "
                              f"worker(s) {missing} to push their last gradients; the final checkpoint "
                              "holds the ps state without the updates they push later. Look for a "
                              "worker that hangs, or pass a longer timeout to ps.finish() before "
                              "ctx.finish", CheckpointWarning, stacklevel=2)
                return True
            if self._heartbeat is not None:
                self._heartbeat()

    def _tell_finished(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._inflight:
            torch.futures.wait_all(self._inflight)
            self._inflight = []
        rpc.rpc_sync(self.ps_names[0], server._rpc_finished, args=(self.worker,))

    def close(self) -> None:
        """Tell ps 0 this worker is done (`finish`), wait for every worker and ps to finish, then leave
        rpc (graceful ``rpc.shutdown``)."""
        if not self._closed:
            try:
                self._tell_finished()  # without ctx.finish there is no final save to wait for
            finally:
                self._closed = True
                rpc.shutdown()

    def __enter__(self) -> ParameterServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(ctx: _Context, model: torch.nn.Module, *,
            optimizer: Mapping[str, Any] | None = None) -> ParameterServerClient:
    """Join the job's rpc group as a worker and return the handle that pushes and pulls ``model``.

    Example:
        >>> ps = shardkit.trainer.torch_ps.connect(ctx, model, optimizer={"name": "adam", "lr": 3e-3})

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
