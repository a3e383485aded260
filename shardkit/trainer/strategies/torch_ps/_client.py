"""A worker's handle on the parameter servers: `ParameterServerClient` (made by
`shardkit.trainer.strategies.torch_ps.connect`), where each parameter lives (`assign`), and the ps-side rpc
entry
points its pushes and checkpoints reach.

Apart from `shardkit.trainer.strategies.torch_ps`, which joins a process to the job's rpc group (`serve` on a
ps,
`connect` on a worker) and whose docstring tells the design; the names here are importable from there
too.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import rpc

from shardkit.errors import CheckpointError, CheckpointWarning, ConfigError
from shardkit.trainer.strategies.torch_ps import _server as server
from shardkit.trainer.strategies.torch_ps._optimizer import validate_optimizer

__all__ = ["FINAL_WAIT", "RPC_TIMEOUT", "WAIT_SLICE", "ParameterServerClient", "assign"]

RPC_TIMEOUT = timedelta(minutes=10)  # a pull may wait for worker 0's restore; heartbeats catch real hangs
# How long worker 0's final save waits for the other workers' last pushes: as long as an rpc may take,
# since a slower worker may be many steps behind; a dead worker stops the job sooner (the supervisor).
FINAL_WAIT = RPC_TIMEOUT
WAIT_SLICE = 1.0  # seconds per wait on ps 0 between two heartbeats


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


# The ps-side entry points that wait for other pushes: they return a future instead of holding a thread of
# the rpc pool (a hold parks the pushes of every worker). Here rather than in torch_ps_server, whose
# module imports without torch (config validation); the ps imported this module to serve (through
# torch_ps).
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
