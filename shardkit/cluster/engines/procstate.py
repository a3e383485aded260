"""What the OS tells about a role process on this machine: whether it is stopped (SIGSTOP, a debugger).

The supervisor asks when a process falls silent: in an allreduce job every other process then falls
silent too (each waits for it in the next collective), and a process the OS reports stopped is the one
that holds the others up (`shardkit.cluster.supervisor`). Linux only (``/proc/<pid>/stat``); elsewhere,
or for a process on another machine, there is no evidence, never an error.
"""

from __future__ import annotations

from pathlib import Path

from shardkit.cluster.engines import RoleProcess
from shardkit.cluster.engines.local import LocalProcess
from shardkit.cluster.engines.mirror import is_local

__all__ = ["STOPPED_STATES", "here", "os_state", "stopped"]

#: ``/proc/<pid>/stat`` states of a stopped process: ``T`` stopped by a signal (SIGSTOP, SIGTSTP, a
#: debugger's stop), ``t`` stopped at a tracing stop (a debugger: gdb, py-spy --native, strace at a stop).
STOPPED_STATES = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a debugger (tracing stop)"}


def os_state(pid: int) -> str | None:
    """The state letter of process ``pid`` on this machine (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``...),
    from Linux's ``/proc/<pid>/stat``; None where it cannot be read (no ``/proc``, the process is gone).

    Example:
        >>> os_state(os.getpid())
        'R'
    """
    if pid <= 0:
        return None
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    end = text.rfind(")")
    fields = text[end + 1:].split() if end >= 0 else []
    return fields[0] if fields else None


def here(proc: RoleProcess) -> bool:
    """Whether ``proc``'s pid is a pid of this machine: a process of the local engine (started here,
    by this process), or a Ray or Spark process whose ``host`` is this machine (a local Ray instance,
    a ``local[...]`` Spark master; the Spark engine's stop trusts the same test). Other engines'
    processes (none today) have no evidence."""
    if isinstance(proc, LocalProcess):
        return True
    host = getattr(proc, "host", None)
    return isinstance(host, str) and bool(host) and is_local(host)


def stopped(proc: RoleProcess) -> str | None:
    """The state letter (``T`` or ``t``) when the OS reports ``proc`` stopped, else None (running,
    sleeping, gone, on another machine, or no ``/proc`` to ask). See `STOPPED_STATES`.

    Example:
        >>> stopped(group.processes[1])      # after os.kill(pid, signal.SIGSTOP)
        'T'
    """
    pid = getattr(proc, "pid", 0)
    if not isinstance(pid, int) or pid <= 0 or not here(proc):
        return None
    state = os_state(pid)
    return state if state in STOPPED_STATES else None
