"""Process-tree checks for the distributed tests: who is still alive, and killing what is left."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2])


def processes() -> dict[int, tuple[str, int, int]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            info = _stat(int(entry.name))
            if info is not None:
                out[int(entry.name)] = info
    return out


def alive(pid: int) -> bool:
    """Running (a zombie is dead)."""
    info = _stat(pid)
    return info is not None and info[0] != "Z"


def descendants(root: int) -> set[int]:
    """Live descendants of ``root`` (by parent pid)."""
    table = processes()
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return {pid for pid in out if table[pid][0] != "Z"}


def in_groups(pgids: Iterable[int]) -> set[int]:
    """Live processes whose process group is one of ``pgids``."""
    wanted = set(pgids)
    return {pid for pid, (state, _, pgid) in processes().items() if pgid in wanted and state != "Z"}


def kill(pids: Iterable[int]) -> None:
    """SIGKILL each process and the process group it leads."""
    for pid in pids:
        for fn in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                fn(pid, signal.SIGKILL)


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> set[int]:
    """Wait until none of ``pids`` is alive; the ones still alive after ``timeout``."""
    pids = set(pids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = {pid for pid in pids if alive(pid)}
        if not left:
            return set()
        time.sleep(0.05)
    return {pid for pid in pids if alive(pid)}


@contextlib.contextmanager
def reaped(extra_groups: list[int] | None = None) -> Iterator[None]:
    """Kill every process this test started (descendants and the groups they lead) when it ends, and
    fail the test if any was still alive: a distributed test must leave no process behind."""
    before = descendants(os.getpid())
    groups = extra_groups if extra_groups is not None else []
    try:
        yield
    finally:
        left = (descendants(os.getpid()) - before) | in_groups(groups)
        left |= in_groups(left)
        kill(left)
        wait_gone(left, 5)
    if left:
        raise AssertionError(f"processes left behind by the test (killed now): {sorted(left)}")
