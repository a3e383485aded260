"""The supervisor's end of heartbeats: a UDP socket on loopback that collects datagrams without blocking,
and what they tell about each process and about the samples a job trained (`SampleLedger`)."""

from __future__ import annotations

import select
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

from shardkit.job import protocol

__all__ = ["HeartbeatReceiver", "Quiet", "SampleLedger", "Watched", "apply_beat", "suspects"]

PROGRESS_KINDS = frozenset({"step", "checkpoint", "done"})
_RECENT = 64  # per process: the counts of its last heartbeats, kept for a checkpoint reported after them


class Watched(Protocol):
    """What a supervisor (the local one, or a torchrun node's monitor) keeps about one process."""

    last_beat: float | None
    done_at: float | None
    step: int
    samples: int
    metrics: dict[str, float]


def apply_beat(w: Watched, beat: protocol.Heartbeat, now: float) -> bool:
    """Record ``beat`` on ``w``; True when it shows training progress (a step, a checkpoint, done).

    "start" does not count as a heartbeat for the silence timeout: the startup window lasts until the
    first step or "alive" beat, so a process stuck in its imports or rendezvous is caught by
    ``startup_timeout``. Every other beat carries the process's step and the samples it trained in this
    attempt up to that step (an "alive" beat too, and the last "step" beat a failing process sends
    on its way out of ``with ctx``), so each one updates them; "start" is sent before the restore. The
    "alive" beat that says which checkpoint the process restored (``checkpoint`` set) comes before the
    first step too, so it does not end the startup window either.
    """
    if beat.kind != "start":
        if not (beat.kind == "alive" and beat.checkpoint is not None):  # a restore's report (see below)
            w.last_beat = now
        w.step, w.samples = beat.step, beat.samples
    if beat.kind == "done":
        w.done_at = now
    progress = beat.kind in PROGRESS_KINDS
    if beat.metrics:
        w.metrics = dict(beat.metrics)
    return progress


W = TypeVar("W")


class Quiet(NamedTuple, Generic[W]):
    """How long process ``who`` has been silent (seconds), its limit, and the words for it (``{:.1f}``:
    the seconds)."""

    who: W
    silent: float
    limit: float
    what: str


def suspects(quiet: Sequence[Quiet[W]], beat: float) -> list[Quiet[W]]:
    """The processes to suspect of a hang, longest past its limit first (ties in the given order); none
    while no process is silent past its limit.

    In an allreduce job a process that hangs holds up every other one in the next collective, so they
    all fall silent within a beat of each other, and the first to pass its limit need not be the cause.
    Heartbeats are paced (at most one a ``heartbeat_interval``, one a step when steps are slower), so
    the last beats of processes that stopped together differ by up to one ``beat``: every process
    silent for more than its limit less two beats (at most half the limit) is a suspect. The supervisor
    and a torchrun node's monitor name among them the one the OS reports stopped, else the first.
    """
    if not any(q.silent > q.limit for q in quiet):
        return []
    found = [q for q in quiet if q.silent > q.limit - min(2 * beat, q.limit / 2)]
    return sorted(found, key=lambda q: q.limit - q.silent)


@dataclass
class _Counts:
    """One process's samples trained in this attempt, at some of its steps."""

    recent: dict[int, int] = field(default_factory=dict)  # step -> samples of its last `_RECENT` heartbeats
    pinned: dict[int, int] = field(default_factory=dict)  # step -> samples at a checkpoint step not settled

    def at(self, step: int) -> int:
        """Samples trained up to ``step``: its heartbeat of that step, else its last one before it."""
        if step in self.pinned:
            return self.pinned[step]
        if step in self.recent:
            return self.recent[step]
        before = [(s, n) for s, n in (*self.pinned.items(), *self.recent.items()) if s <= step]
        return max(before)[1] if before else 0


class SampleLedger:
    """How many of the samples a job run trained are in each checkpoint, so a restart knows what it lost.

    Example:
        >>> ledger = SampleLedger()
        >>> ledger.beat("worker-0", step=5, samples=20); ledger.checkpoint(5)
        >>> ledger.restart(trained=24, resumed_from=5)        # (4, 20): 4 samples to train again
        (4, 20)

    A heartbeat carries the samples its process trained in the current attempt up to its step. Before a
    checkpoint is saved, every process of an allreduce job heartbeats that step (``ctx.step``), so the
    samples in checkpoint step S are those in the checkpoint the attempt resumed from plus each process's
    count at S. When a restart resumes from S, the samples the failed attempt trained beyond it are lost:
    not in the model, trained again. Counts are of this run (a checkpoint of an earlier run counts 0).

    Exact where the processes step together (allreduce; the chief of a TensorFlow parameter-server job
    trains every step), given each process's count of the attempt. In a torch parameter-server job each
    worker runs at its own pace, and a checkpoint holds each worker's pushes up to the moment worker 0
    saves: the ledger counts a worker at its own heartbeat of the checkpoint's step (or its last one
    before), which is off by as many samples as the worker was ahead of or behind worker 0 then.
    """

    def __init__(self) -> None:
        self.in_checkpoint: dict[int, int] = {}  # checkpoint step -> samples of this run in it
        self.resumed = 0  # samples of this run in the checkpoint the current attempt resumed from
        self._ended = 0  # samples of this run when the current attempt began (`restart`)
        self._pending: list[int] = []  # this attempt's checkpoint steps, not settled yet
        self._counts: dict[str, _Counts] = {}

    def beat(self, name: str, step: int, samples: int) -> None:
        """Process ``name`` (``worker-1``) had trained ``samples`` in this attempt at ``step``."""
        counts = self._counts.setdefault(name, _Counts())
        if step in self._pending:
            counts.pinned[step] = samples
            return
        counts.recent[step] = samples
        if len(counts.recent) > _RECENT:
            del counts.recent[next(iter(counts.recent))]

    def checkpoint(self, step: int) -> None:
        """The chief reported checkpoint ``step`` (saved: committed)."""
        # A process heartbeats step S before it takes part in any later step, and the chief saves a
        # later checkpoint only after such a step: every count at an earlier checkpoint has arrived.
        for earlier in [s for s in self._pending if s < step]:
            self._settle(earlier)
        if step not in self._pending:
            self._pending.append(step)
        for counts in self._counts.values():
            if step in counts.recent:
                counts.pinned[step] = counts.recent[step]

    def _settle(self, step: int) -> None:
        self.in_checkpoint[step] = self.resumed + sum(c.at(step) for c in self._counts.values())
        self._pending.remove(step)
        for counts in self._counts.values():
            counts.pinned.pop(step, None)

    def restart(self, trained: int, resumed_from: int | None) -> tuple[int, int]:
        """End the current attempt, which trained ``trained`` samples, and begin one that resumes from
        checkpoint step ``resumed_from`` (None: from scratch). Returns the samples the ended attempt lost
        (trained again by the new one) and the samples of this run in that checkpoint."""
        for step in list(self._pending):
            self._settle(step)
        self._ended = self.resumed + trained
        self._counts.clear()
        return self.resumed_instead(resumed_from)

    def resumed_instead(self, resumed_from: int | None) -> tuple[int, int]:
        """The current attempt resumed from checkpoint step ``resumed_from`` after all (its chief said so:
        the newest checkpoint did not verify, say), not from the one `restart` was given; the same
        returns as `restart`. Called before the attempt saves a checkpoint."""
        self.resumed = self.in_checkpoint.get(resumed_from, 0) if resumed_from is not None else 0
        return max(0, self._ended - self.resumed), self.resumed


class HeartbeatReceiver:
    """A UDP socket on loopback that collects heartbeat datagrams without blocking.

    Example:
        >>> with HeartbeatReceiver() as hb:
        ...     env = {"SHARDKIT_HEARTBEAT_ADDR": hb.addr}
        ...     beats = hb.receive(timeout=0.1)
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind((host, 0))
        self.sock.setblocking(False)
        self.addr = protocol.format_addr(host, self.sock.getsockname()[1])
        self.malformed = 0

    def receive(self, timeout: float = 0.0) -> list[protocol.Heartbeat]:
        """Every heartbeat that arrived, waiting up to ``timeout`` seconds for the first; malformed
        datagrams are counted in ``malformed`` and dropped."""
        select.select([self.sock], [], [], timeout)
        beats: list[protocol.Heartbeat] = []
        while True:
            try:
                data = self.sock.recv(protocol.MAX_DATAGRAM_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return beats
            beat = protocol.Heartbeat.decode(data)
            if beat is None:
                self.malformed += 1
            else:
                beats.append(beat)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> HeartbeatReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
