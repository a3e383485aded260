"""The parameter-server side of `shardkit.trainer.strategies.torch_ps`: one shard of the parameters and its
optimizer.

Everything here runs inside a ps process. Workers reach it through the module-level ``_rpc_*``
functions, which ``torch.distributed.rpc`` calls by their qualified name on the ps's own copy of this
module (the ps imported it to serve), in the rpc agent's thread pool: hence the lock. The calls that
may have to wait for other workers' pushes (`Shard.push`, `Shard.snapshot`) return a future instead of
blocking a thread of that pool; their rpc entry points are in `shardkit.trainer.strategies.torch_ps`, since
``rpc.functions.async_execution`` needs torch where this module must not.

torch is imported where it is used, not with the module. The optimizers a ps applies are those of
`shardkit.job.config.optimizer`, whose spec the job config's validation checks where there may be no
torch.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from shardkit.job.config.optimizer import OPTIMIZERS

if TYPE_CHECKING:
    import torch
    from torch.futures import Future

    _Done = tuple[Future[Any], Any, BaseException | None]  # a future to complete: value or error

__all__ = ["Finished", "Shard"]

READY_TIMEOUT: Final = 600.0  # how long a pull waits for worker 0 to initialize the parameters


@dataclasses.dataclass
class _Push:
    """A worker's push waiting to be applied: its gradients, reader position and the future to complete."""

    grads: Mapping[str, torch.Tensor]
    position: str | None
    done: Future[int]


class Shard:
    """The parameters one ps holds, by name, with their optimizer.

    Example (what the rpc functions do; workers never build one):
        >>> shard = Shard()
        >>> shard.load({"fc.weight": w}, {"name": "sgd", "lr": 0.1}, state=None)
        >>> shard.push(worker=1, seq=1, grads={"fc.weight": grad}, position=None).wait()
        >>> shard.weights()["fc.weight"]

    An update is applied as soon as a gradient arrives (asynchronous SGD): pushes from different
    workers are serialized by a lock, never averaged or waited for. Each worker numbers its pushes
    (``seq`` 1, 2, ...) and a shard applies them in that order (one that arrives early waits, parked),
    so what a shard holds is, for every worker, exactly its first ``applied[worker]`` pushes.

    Consistent state (`hold`, then `snapshot`): the state of several shards must include the same
    pushes, and the reader positions saved with it (``position``: the worker's reader state after the
    batch of that push, JSON text, kept by the shard that receives it, ps 0) exactly those pushes.
    `hold` parks every new push and says how many of each worker's are applied; `snapshot` is given
    the most any shard had applied (``target``), applies the parked ones up to it (those still in
    flight to this shard as they arrive), takes the state, and lets the rest through. Nothing blocks
    a thread while it waits: pushes and snapshots complete futures (rpc ``async_execution``).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.params: dict[str, torch.Tensor] = {}
        self.spec: dict[str, Any] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.updates = 0
        self.applied: dict[int, int] = {}  # worker -> seq of its last push applied here
        self.positions: dict[int, str | None] = {}  # worker -> reader state after that push (since `load`)
        self._parked: dict[int, dict[int, _Push]] = {}  # worker -> seq -> a push not applied yet
        self._held = False
        self._target: dict[int, int] | None = None  # while held: the pushes a snapshot must include
        self._snapshot: Future[dict[str, Any]] | None = None

    def load(self, params: Mapping[str, torch.Tensor], spec: Mapping[str, Any],
             state: Mapping[str, Mapping[str, torch.Tensor]] | None, updates: int = 0) -> None:
        """(Re)initialize from worker 0: parameter values, optimizer spec and optional optimizer state.

        The reader positions are forgotten: they describe the pushes in the state replaced (worker 0
        seeds the loaded state's with `seed_positions`)."""
        with self.lock:
            self.params = {name: value.detach().clone().requires_grad_(True)
                           for name, value in params.items()}
            import torch

            self.spec = dict(spec)
            options = {key: value for key, value in spec.items() if key != "name"}
            names = list(self.params)
            cls = getattr(torch.optim, OPTIMIZERS[spec["name"]][0])
            self.optimizer = cls([self.params[n] for n in names], **options) if names else None
            if self.optimizer is not None and state:
                for name, slots in state.items():
                    if name in self.params:
                        self.optimizer.state[self.params[name]] = {k: v.clone() for k, v in slots.items()}
            self.updates = updates
            self.positions = {}
            self.ready.set()

    def wait_ready(self) -> None:
        if not self.ready.wait(READY_TIMEOUT):
            raise RuntimeError(f"worker 0 did not initialize this parameter server within "
                               f"{READY_TIMEOUT:.0f} s (is it running? it initializes the parameters on "
                               "its first pull, push, step or load_state_dict)")

    def apply(self, grads: Mapping[str, torch.Tensor]) -> int:
        """One optimizer step with these gradients (parameters without one are left alone), outside the
        workers' order (`push` is what workers call)."""
        self.wait_ready()
        with self.lock:
            return self._apply(grads)

    def _apply(self, grads: Mapping[str, torch.Tensor]) -> int:
        unknown = sorted(set(grads) - set(self.params))
        if unknown:
            raise KeyError(f"gradients for parameters this ps does not hold: {unknown[:5]}")
        if self.optimizer is None:
            return self.updates
        for name, param in self.params.items():
            param.grad = grads.get(name)
        self.optimizer.step()
        self.updates += 1
        return self.updates

    def push(self, worker: int, seq: int, grads: Mapping[str, torch.Tensor],
             position: str | None) -> Future[int]:
        """Apply worker ``worker``'s push number ``seq`` after its ``seq - 1`` earlier ones and outside a
        hold; a future of the update count then. ``position``: its reader state (JSON text) or None."""
        from torch.futures import Future

        self.wait_ready()
        done: Future[int] = Future()
        finished: list[_Done]
        with self.lock:
            if seq <= self.applied.get(worker, 0) or seq in self._parked.get(worker, {}):
                finished = [(done, None, ValueError(f"worker {worker} pushed number {seq} twice"))]
            else:
                self._parked.setdefault(worker, {})[seq] = _Push(grads, position, done)
                finished = self._drain()
        _complete(finished)
        return done

    def _may_apply(self, worker: int, seq: int) -> bool:
        if not self._held:
            return True
        return self._target is not None and seq <= self._target.get(worker, 0)

    def _drain(self) -> list[_Done]:
        """Apply every parked push that may go now, in each worker's order (lock held); the futures to
        complete once the lock is released (their callbacks may take it)."""
        finished: list[_Done] = []
        progress = True
        while progress:
            progress = False
            for worker, parked in self._parked.items():
                seq = self.applied.get(worker, 0) + 1
                while seq in parked and self._may_apply(worker, seq):
                    push = parked.pop(seq)
                    try:
                        finished.append((push.done, self._apply(push.grads), None))
                    except Exception as e:  # unknown parameters: that push fails, the order goes on
                        finished.append((push.done, None, e))
                    self.applied[worker] = seq
                    if push.position is not None:
                        self.positions[worker] = push.position
                    seq += 1
                    progress = True
            if self._snapshot is not None and self._target is not None and all(
                    self.applied.get(w, 0) >= n for w, n in self._target.items()):
                finished.append((self._snapshot, self._state(), None))
                self._held, self._target, self._snapshot = False, None, None
                progress = True  # released: the pushes past the target may go now
        self._parked = {w: parked for w, parked in self._parked.items() if parked}
        return finished

    def hold(self) -> dict[int, int]:
        """Park every push from now on (until `snapshot` or `release`); each worker's applied count."""
        with self.lock:
            if self._held:
                raise RuntimeError("this parameter server is held for a snapshot already: only worker 0 "
                                   "takes the ps state, one snapshot at a time")
            self._held = True
            return dict(self.applied)

    def snapshot(self, target: Mapping[int, int]) -> Future[dict[str, Any]]:
        """While held: the `state` with exactly each worker's first ``target[worker]`` pushes (and the
        reader positions after them), as soon as they are applied; then the hold ends."""
        from torch.futures import Future

        done: Future[dict[str, Any]] = Future()
        finished: list[_Done]
        with self.lock:
            if not self._held or self._snapshot is not None:
                finished = [(done, None, RuntimeError("snapshot() without a hold() before it"))]
            else:
                self._target, self._snapshot = dict(target), done
                finished = self._drain()
        _complete(finished)
        return done

    def release(self) -> None:
        """End a hold whose snapshot will not come (worker 0 failed between the two)."""
        with self.lock:
            pending = self._snapshot
            self._held, self._target, self._snapshot = False, None, None
            finished = self._drain()
        if pending is not None:
            finished.append((pending, None, RuntimeError("the snapshot was released before it completed")))
        _complete(finished)

    def seed_positions(self, positions: Mapping[int, str | None]) -> None:
        """Set the reader positions of workers with no push applied since the last `load` (worker 0,
        after a restore: the positions the loaded state was saved with); pushes carry newer ones."""
        with self.lock:
            for worker, position in positions.items():
                self.positions.setdefault(worker, position)

    def weights(self) -> dict[str, torch.Tensor]:
        self.wait_ready()
        with self.lock:
            return {name: param.detach().clone() for name, param in self.params.items()}

    def state(self) -> dict[str, Any]:
        """Parameters, optimizer state keyed by parameter name (so it reshards to any number of ps),
        spec, update count, each worker's applied pushes and reader position (not synchronized with
        other shards: see `hold`)."""
        self.wait_ready()
        with self.lock:
            return self._state()

    def _state(self) -> dict[str, Any]:
        import torch

        slots: dict[str, dict[str, torch.Tensor]] = {}
        if self.optimizer is not None:
            for name, param in self.params.items():
                entry = self.optimizer.state.get(param)
                if entry:
                    slots[name] = {key: torch.as_tensor(value).clone() for key, value in entry.items()}
        return {"params": {n: p.detach().clone() for n, p in self.params.items()}, "state": slots,
                "spec": dict(self.spec), "updates": self.updates, "applied": dict(self.applied),
                "positions": dict(self.positions)}


def _complete(finished: list[_Done]) -> None:
    for future, value, error in finished:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


class Finished:
    """Which workers have pushed their last gradient (kept on ps 0): worker 0 waits for all of them
    before the job's final checkpoint, so that it holds every worker's updates.

    Example (what the rpc functions do):
        >>> finished = Finished()
        >>> finished.add(1); finished.wait(2, timeout=0.0)
        [0]

    A set of worker indices, so a repeated message (``close`` after ``finish``) counts once.
    """

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.workers: set[int] = set()

    def add(self, worker: int) -> None:
        with self.changed:
            self.workers.add(worker)
            self.changed.notify_all()

    def wait(self, count: int, timeout: float) -> list[int]:
        """Wait at most ``timeout`` s for workers ``0 .. count - 1``; the ones still missing."""
        expected = set(range(count))
        with self.changed:
            self.changed.wait_for(lambda: expected <= self.workers, timeout)
            return sorted(expected - self.workers)


SHARD: Final = Shard()  # the one shard of this process (ps processes only)
FINISHED: Final = Finished()  # used on ps 0 only


def _rpc_load(params: dict[str, torch.Tensor], spec: dict[str, Any],
              state: dict[str, dict[str, torch.Tensor]] | None, updates: int) -> None:
    SHARD.load(params, spec, state, updates)


def _rpc_pull() -> dict[str, torch.Tensor]:
    return SHARD.weights()


def _rpc_hold() -> dict[int, int]:
    SHARD.wait_ready()
    return SHARD.hold()


def _rpc_release() -> None:
    SHARD.release()


def _rpc_seed_positions(positions: dict[int, str | None]) -> None:
    SHARD.seed_positions(positions)


def _rpc_finished(worker: int) -> None:
    FINISHED.add(worker)


def _rpc_wait_finished(count: int, timeout: float) -> list[int]:
    return FINISHED.wait(count, timeout)
