"""The supervisor's end of heartbeats: a UDP socket on loopback that collects datagrams without blocking."""

from __future__ import annotations

import select
import socket
from typing import Protocol

from shardkit.cluster import protocol

__all__ = ["HeartbeatReceiver", "Watched", "apply_beat"]

PROGRESS_KINDS = frozenset({"step", "checkpoint", "done"})


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
    ``startup_timeout``.
    """
    if beat.kind != "start":
        w.last_beat = now
    if beat.kind == "done":
        w.done_at = now
    progress = beat.kind in PROGRESS_KINDS
    if progress:
        w.step, w.samples = beat.step, beat.samples
    if beat.metrics:
        w.metrics = dict(beat.metrics)
    return progress


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
