"""What ends a torchrun node whose main thread is stuck in one of torch's C++ store calls (a store that
accepted the connection and does not answer blocks it for ``rdzv_conf.read_timeout``, 60 s by default):
a stop signal it has not taken within a few seconds, or a first rendezvous past its deadline.

Python runs a signal's handler in the main thread only between two bytecodes, so a Ctrl-C that lands
in such a call waits for it. The C-level handler does write the signal's number to the wakeup fd
(`signal.set_wakeup_fd`) at once: a thread reads it there and, when the main thread has not taken the
signal within `TAKEOVER_S` seconds, ends the node itself.
"""

from __future__ import annotations

import contextlib
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

from shardkit.cluster.monitor.stop_signals import STOP_SIGNALS

__all__ = ["TAKEOVER_S", "Backstop"]

#: Seconds a stop signal, or a first rendezvous past its deadline, is left to the main thread.
TAKEOVER_S = 2.5


class Backstop:
    """A thread that calls ``on_signal(signum)`` for a stop signal the main thread has not taken
    (`took`) within `TAKEOVER_S`, and ``on_late()`` when ``late()`` holds for `TAKEOVER_S` (the main
    thread should have ended the run by itself). Each callback ends the process; the first one wins.

    A context manager, entered in the main thread (elsewhere it does nothing: signals reach the main
    thread only); the previous wakeup fd comes back on exit.
    """

    def __init__(self, *, on_signal: Callable[[int], None], late: Callable[[], bool],
                 on_late: Callable[[], None]) -> None:
        self.on_signal, self.late, self.on_late = on_signal, late, on_late
        self._seen = 0
        self._taken = 0
        self._stop = threading.Event()
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._thread = threading.Thread(target=self._loop, name="shardkit-backstop", daemon=True)

    def took(self) -> None:
        """The main thread took a stop signal (called from its handler)."""
        self._taken += 1

    def __enter__(self) -> Backstop:
        if threading.current_thread() is not threading.main_thread():
            return self
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        try:
            self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            reader.close()
            writer.close()
            return self
        self._pair = reader, writer
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop.set()
        if self._pair is None:
            return
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous_fd)
        self._thread.join(TAKEOVER_S + 1.0)
        for end in self._pair:
            end.close()

    def _signals(self, reader: socket.socket, timeout: float) -> list[int]:
        try:
            ready, _, _ = select.select([reader], [], [], timeout)
            data = reader.recv(64) if ready else b""
        except OSError:
            return []
        return [n for n in data if n in STOP_SIGNALS]

    def _loop(self) -> None:
        if self._pair is None:  # started by __enter__ only once the pair exists
            return
        reader = self._pair[0]
        pending: float | None = None  # when the oldest signal the main thread has not taken came
        late_since: float | None = None
        signum = 0
        while not self._stop.is_set():
            for number in self._signals(reader, 0.2):
                self._seen += 1
                signum = number
                pending = pending or time.monotonic()
            now = time.monotonic()
            if self._taken >= self._seen:
                pending = None
            elif pending is not None and now - pending >= TAKEOVER_S and not self._stop.is_set():
                self.on_signal(signum)
                return
            if self.late():
                late_since = late_since or now
                if now - late_since >= TAKEOVER_S and not self._stop.is_set():
                    self.on_late()
                    return
