"""Ctrl-C for the commands: whether one arrived while a command ran, whatever error came out of it.

A SIGINT raises ``KeyboardInterrupt`` wherever Python is. When that is inside a Python file object that
pyarrow reads or writes through from C++, pyarrow can swallow it and fail later with its own error
(``ValueError: I/O operation on closed file``), sometimes with the interrupt as the error's context
(`shardkit.errors.interrupt_behind`), sometimes without. The command still stopped because of the Ctrl-C,
so it says ``interrupted`` and exits 130 rather than print that error's traceback: `counting` counts the
SIGINTs that arrive, and `behind` finds the interrupt behind an error either way."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from shardkit.errors import interrupt_behind

_seen: list[KeyboardInterrupt] = []


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    interrupt = KeyboardInterrupt()
    _seen.append(interrupt)
    raise interrupt


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """Count the SIGINTs that arrive inside the block (each still raises ``KeyboardInterrupt`` as
    Python's own handler does). Only where Python's handler is the one installed, in the main thread: a
    program that calls `shardkit.cli.main` with a handler of its own keeps it."""
    _seen.clear()  # an earlier command's, in a program that calls main more than once
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def behind(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C that ``error`` came from: one in its chain (`interrupt_behind`), else one that arrived
    inside `counting` (a library swallowed it and failed afterwards); ``None`` when there was none."""
    found = interrupt_behind(error)
    if found is None and _seen and not isinstance(error, KeyboardInterrupt):
        found = _seen[-1]
    return found
