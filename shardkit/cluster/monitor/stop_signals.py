"""The signals that stop a job cleanly (`STOP_SIGNALS`) and `signals_raise`, which makes them raise an
exception in the main thread. Apart from the supervisor: a torchrun node's agent and the Ray engine stop
on the same signals.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["STOP_SIGNALS", "signals_raise"]


#: The signals that stop a job cleanly: Ctrl-C, a polite kill, the terminal or SSH session closed.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextmanager
def signals_raise(exception: Callable[[int], BaseException]) -> Iterator[None]:
    """In the main thread, each of `STOP_SIGNALS` raises ``exception(signum)``, so the job is stopped
    cleanly and summed up; the previous handlers come back after. Elsewhere (signals reach only the
    main thread) nothing changes. The supervisor raises `_Terminated`, a torchrun agent torch's own
    ``SignalException``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise exception(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
