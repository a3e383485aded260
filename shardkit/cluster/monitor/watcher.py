"""The group watcher: a tiny process that stops a job's process groups if the trainer dies without
stopping them (SIGKILL, a crash), so that even what the roles started goes with it.

This file is also the watcher's program: it is run by path (``python -I -S watcher.py GRACE``), and so
imports nothing but the standard library (not shardkit, whose package import pulls in numpy and pyarrow:
the watcher starts fast and holds little memory).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

__all__ = ["GroupWatcher"]

_POLL_S = 0.05


class GroupWatcher:
    """The trainer's end: starts the watcher and tells it, over its stdin, which groups exist.

    Example:
        >>> watcher = GroupWatcher(grace=5.0)
        >>> watcher.started(popen.pid)     # a role's process group now exists
        >>> watcher.gone(popen.pid)        # its members are dead: say so *before* reaping the leader
        >>> watcher.close()                # the normal end: nothing is listed, the watcher just exits

    Choices:
    - Why a process: a role gets a parent-death signal (Linux ``PR_SET_PDEATHSIG``), but what the role
      started (a subprocess, DataLoader workers without their own watchdog) does not, and nothing in a
      SIGKILLed trainer can run. The watcher is the part that outlives it: its own session (a signal
      to the trainer's process group, such as Ctrl-C in the terminal or a hangup, does not reach it;
      it also ignores SIGINT and SIGHUP), and no parent-death signal.
    - The channel is a pipe: each line ``+PGID`` or ``-PGID``. The pipe's write end is only in the
      trainer (not inheritable; the roles start with ``close_fds``), so end of file means the trainer
      closed it or died. The watcher then sends SIGTERM (then SIGCONT, so that a stopped process gets
      it now) to every group still listed, waits ``grace`` seconds for them to empty, SIGKILLs what
      is left, and exits. After `close` nothing is listed, so it exits at once; `close` waits for it
      (no watcher outlives a normal run).
    - A group is never signalled after the watcher was told it is gone. The trainer says ``-PGID``
      only while the group's leader is still an unreaped zombie (which keeps the number from being
      reused) and reaps it afterwards; lines are read in order, so a trainer killed in between has
      told the watcher already. A group still listed when the trainer dies has a leader that is
      alive, or a zombie that init now reaps: only if that empties the group could its number be
      reused, and only in the milliseconds before the watcher's SIGTERM, with the kernel cycling
      through every other free pid first.
    - The watcher runs on this interpreter (``sys.executable``), not the job's ``python``: it needs
      only the standard library.
    - If it cannot start, or dies, the job goes on without it (the roles still die with the trainer).
    """

    def __init__(self, *, grace: float) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), repr(float(grace))],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, bufsize=0,
            )
        except OSError:
            self.proc = None

    def _send(self, line: str) -> None:
        if self.proc is None or self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(line.encode())  # one write of a few bytes: atomic on a pipe
        except OSError:  # the watcher died (killed by someone): go on without it
            self.proc.stdin.close()

    def started(self, pgid: int) -> None:
        """Process group ``pgid`` exists (send it right after the leader was started)."""
        if pgid > 1:  # the watcher ignores 0 and 1 too: killpg(1) would signal every process
            self._send(f"+{pgid}\n")

    def gone(self, pgid: int) -> None:
        """Process group ``pgid`` has no live member and its leader is not reaped yet: forget it."""
        self._send(f"-{pgid}\n")

    def close(self, timeout: float = 5.0) -> None:
        """End the watcher: it signals the groups still listed (none, if each was `gone`), then exits."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:  # pragma: no cover - it exits at once when nothing is listed
            proc.kill()
            proc.wait()


# -- the watcher itself (run by path) ---------------------------------------------------------------


def _listed(data: bytes) -> list[int]:
    """The groups that ``+PGID``/``-PGID`` lines leave listed, in the order they started.

    Never 0 or 1, nor the watcher's own group: ``killpg(0)`` signals the caller's group and
    ``killpg(1)`` is ``kill(-1)``, every process the caller may signal.
    """
    groups: dict[int, None] = {}
    for line in data.split(b"\n"):
        with contextlib.suppress(ValueError):
            if line[:1] == b"+":
                groups[int(line[1:])] = None
            elif line[:1] == b"-":
                groups.pop(int(line[1:]), None)
    own = os.getpgid(0)
    return [pgid for pgid in groups if pgid > 1 and pgid != own]


def _signal(groups: Iterable[int], sig: int) -> list[int]:
    """Send ``sig`` to each group; the ones that still exist."""
    alive = []
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except OSError:  # no member left (ProcessLookupError), or not ours any more
            continue
        alive.append(pgid)
    return alive


def main(argv: list[str]) -> int:
    """Read the trainer's lines until end of file, then stop what is still listed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    grace = float(argv[0]) if argv else 5.0
    data = sys.stdin.buffer.read()  # blocks until the trainer closes the pipe or dies
    left = _signal(_listed(data), signal.SIGTERM)
    left = _signal(left, signal.SIGCONT)  # a stopped process gets its SIGTERM once it runs again
    deadline = time.monotonic() + grace
    while left and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        left = _signal(left, 0)
    _signal(left, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
