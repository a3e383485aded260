"""What the supervisor knows of each process of an attempt (`_Watch`), and the rules it judges them by:
a process that reported done but does not exit (`lingering`), the one to name when the group falls
silent (`silence`), a sample count that may stop short of what a process trained (`unreported`).

Apart from `shardkit.cluster.supervisor`, which starts the attempts and feeds their exits and heartbeats
into these records: the rules are functions of the records, the time and the job's fault-tolerance
limits, and say nothing to the console.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardkit.cluster.engines import RoleProcess, procstate
from shardkit.cluster.monitor.heartbeats import Quiet, suspects
from shardkit.cluster.monitor.report import NO_STEP, exit_reason
from shardkit.job.config import FaultTolerance

__all__ = ["lingering", "quiet", "silence", "unreported"]


@dataclass
class _Watch:
    """What the supervisor knows about one process of the current attempt."""

    proc: RoleProcess
    driver: bool
    last_beat: float | None = None  # monotonic time of the last heartbeat that shows progress or life
    gap: float = 0.0  # seconds between its last two such heartbeats (their pace: `silence`)
    done_at: float | None = None
    exited_at: float | None = None  # when its exit was seen
    step: int = 0
    samples: int = 0
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def lingering(attempt: int, watches: dict[str, _Watch], now: float, ft: FaultTolerance) -> list[str]:
    """Count as finished a process that reported done ``heartbeat_timeout`` seconds ago and has not
    exited: its work is saved (``done`` follows the final checkpoint), and what keeps it alive is
    its way out: a thread that is not a daemon, a child process, a hung destructor (gloo's at exit).
    It is stopped with the group when the job ends, and the summary's notes name it. (It was a
    failure: the restart resumed from the final checkpoint, lingered again, and the job ended
    failed, its restarts spent, with every step trained.)

    The wait starts when every driver has reported done, and again at each heartbeat: a process
    that is done waits for the others by design (torch ranks end their group together, at a
    barrier in `TrainContext.finish` that beats while it waits), however long the others' last
    steps, evaluation and save take.

    Returns the notes for the job's summary, one for each process counted as finished here."""
    limit = ft.heartbeat_timeout
    notes: list[str] = []
    ends = [w.done_at if w.done_at is not None else w.exited_at for w in watches.values() if w.driver]
    if None in ends:
        return notes
    all_done = max((t for t in ends if t is not None), default=0.0)
    for w in watches.values():
        if w.finished or w.done_at is None or w.proc.returncode is not None:
            continue
        if now - max(w.done_at, w.last_beat or 0.0, all_done) <= limit:
            continue
        w.finished = True
        notes.append(f"attempt {attempt}: {w.proc.name} reported done but had not exited "
                     f"{now - w.done_at:.1f} s later (heartbeat_timeout {limit:g} s): counted as "
                     "finished and stopped with the group; something keeps it alive after its "
                     "work (a thread that is not a daemon, a child process): see its log")
    return notes


def quiet(w: _Watch, now: float, ft: FaultTolerance) -> Quiet[_Watch]:
    """How long ``w`` has been silent, against which limit (a process that reported done is
    `lingering`'s)."""
    if w.last_beat is None:
        limit, since = ft.startup_timeout, w.proc.started
        what = (f"no heartbeat in {{:.1f}} s since its start (startup_timeout {ft.startup_timeout:g} s)"
                + NO_STEP)
    else:
        limit, since = ft.heartbeat_timeout, w.last_beat
        what = f"silent for {{:.1f}} s (heartbeat_timeout {ft.heartbeat_timeout:g} s)"
    return Quiet(w, now - since, limit, what)


def silence(watches: dict[str, _Watch], now: float, ft: FaultTolerance,
            strategy: str) -> tuple[_Watch, str, float] | None:
    """The process to name when a running process is silent past its limit, named among the whole group,
    with the reason and its seconds of silence; None while no process is silent past its limit.

    In an allreduce job (torch DDP, Horovod) a process that hangs holds up every other one in the
    next collective, so they all fall silent within a beat of each other, and the first to pass its
    limit need not be the cause (naming the first one checked named worker-0, whose log showed
    nothing wrong, when worker-1 was SIGSTOPped). So the suspects are those `suspects` finds, a beat
    being the longer of ``heartbeat_interval`` and the latest gap between two beats of any process
    (one a step, when steps are slower). The one named is:

    - a suspect the OS reports stopped (SIGSTOP, a debugger; for processes on this machine, see
      `shardkit.cluster.engines.procstate`), the other suspects listed as waiting for it; else
    - the suspect longest past its limit (the one named if it were alone), ties in the group's
      order. Nothing tells it apart from the others (each just waits), so the reason lists them as
      silent too and says that any of them may be the cause: their logs tell which.
    """
    running = [quiet(w, now, ft) for w in watches.values()
               if not w.finished and w.proc.returncode is None and w.done_at is None]
    beat = max([ft.heartbeat_interval, *(q.who.gap for q in running)])
    found = suspects(running, beat)
    if not found:
        return None
    states = {q.who.proc.name: procstate.stopped(q.who.proc) for q in found}
    held = [q for q in found if states[q.who.proc.name]]
    named = (held or found)[0]
    reason = named.what.format(named.silent)
    others = [(q.who.proc.name, q.silent) for q in found if q is not named]
    state = states[named.who.proc.name]
    if state is not None:
        reason += f"; {procstate.STOPPED_STATES[state]}: state {state}"
        also = [(name, silent) for name, silent in others if states[name]]
        if also:
            reason += "; " + _listing(also, "stopped")
        waiting = [(name, silent) for name, silent in others if not states[name]]
        if waiting:
            reason += f"; {_listing(waiting, 'silent')}, waiting for {'them' if also else 'it'}"
    elif others:
        reason += f"; {_listing(others, 'silent')}: {_WAITING[strategy]}"
    return named.who, reason, named.silent


#: Why the other silent processes may be the cause, per strategy (`silence`).
_WAITING = {
    "allreduce": "in an allreduce job every process waits for the slowest one, so any of them may be "
                 "the cause",
    "parameter_server": "in a parameter-server job the workers wait for a hung parameter server and the "
                        "parameter servers or the chief for hung workers, so any of them may be the cause",
}
_LISTED = 8  # processes named in a failure's reason; the rest are counted


def _listing(items: list[tuple[str, float]], what: str) -> str:
    """``worker-0 silent too (30.4 s)``, ``worker-0 (30.4 s), worker-2 (30.1 s) silent too``."""
    if len(items) == 1:
        return f"{items[0][0]} {what} too ({items[0][1]:.1f} s)"
    shown = ", ".join(f"{name} ({t:.1f} s)" for name, t in items[:_LISTED])
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return f"{shown}{more} {what} too"


def unreported(w: _Watch) -> str | None:
    """Why the samples ``w`` reported may be fewer than it trained, or None when they are its count at
    its end: it reported done, or exited by itself (leaving ``with ctx``, a failing script reports its
    count; see `shardkit.trainer.TrainContext.__exit__`), or never reported a sample (it trained none:
    the first ``ctx.step`` always heartbeats)."""
    if w.done_at is not None or w.samples == 0:
        return None
    code = w.proc.returncode
    if w.proc.lost_reason is not None:
        return "lost without its last report"
    if code is not None and code >= 0:
        return None
    return exit_reason(code) if code is not None else "no exit status"

