"""The script side of heartbeats: UDP datagrams to the supervisor that never block and never raise."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from shardkit.job import protocol

__all__ = ["Beacon"]


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Metrics as floats; values that are not numbers (or 0-d tensors, numpy scalars) are left out."""
    out = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
            continue
        out[str(key)] = number
    return out


class Beacon:
    """Sends this process's heartbeats to ``SHARDKIT_HEARTBEAT_ADDR``; a no-op when there is none.

    Example:
        >>> beacon = Beacon("127.0.0.1:41000", role="worker", index=0, attempt=0)
        >>> beacon.send("step", step=17, samples=1088, metrics={"loss": loss})

    Sending is a non-blocking ``sendto`` on a UDP socket: a full buffer, a supervisor that is gone or a
    metric that cannot be sent drops the datagram (or the metric), never stalls or fails the training
    loop. Metrics are converted to floats only here, when a heartbeat is actually sent, so a loss
    tensor on a GPU is synchronized at most once per heartbeat interval.
    """

    def __init__(self, addr: str | None, *, role: str, index: int, attempt: int) -> None:
        self.role, self.index, self.attempt = role, index, attempt
        self.sent = 0
        self._target: tuple[str, int] | None = None
        self._sock: socket.socket | None = None
        if addr:
            try:
                host, port = protocol.parse_addr(addr)
                sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
                sock.setblocking(False)
            except (ValueError, OSError):
                return
            self._target, self._sock = (host, port), sock

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, kind: protocol.HeartbeatKind, *, step: int = 0, samples: int = 0,
             metrics: Mapping[str, Any] | None = None, checkpoint: str | None = None) -> None:
        """Send one heartbeat now (see the class docstring: never blocks, never raises)."""
        if self._sock is None or self._target is None:
            return
        try:
            values = _numbers(metrics or {})
            try:
                data = self._encode(kind, step, samples, values, checkpoint)
            except ValueError:  # too many metrics for one datagram, or a bad value: send the beat without
                data = self._encode(kind, step, samples, {}, checkpoint)
            self._sock.sendto(data, self._target)
            self.sent += 1
        except Exception:  # a heartbeat must never take the training loop down
            return

    def _encode(self, kind: protocol.HeartbeatKind, step: int, samples: int, metrics: dict[str, float],
                checkpoint: str | None) -> bytes:
        return protocol.Heartbeat(role=self.role, index=self.index, attempt=self.attempt, pid=os.getpid(),
                                  kind=kind, step=step, time=time.time(), samples=samples, metrics=metrics,
                                  checkpoint=checkpoint).to_bytes()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
