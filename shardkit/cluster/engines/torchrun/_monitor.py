"""What one torchrun node knows of its workers: attempts, heartbeats, hangs, lingering workers, logs,
progress, and the records its summary is made of."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardkit.cluster.engines import procstate
from shardkit.cluster.engines.torchrun import TorchrunOptions, worker_log
from shardkit.cluster.monitor.heartbeats import HeartbeatReceiver, Quiet, apply_beat, suspects
from shardkit.cluster.monitor.output import LineSplitter
from shardkit.cluster.monitor.progress import Progress
from shardkit.cluster.monitor.report import (
    NO_STEP,
    AttemptRecord,
    CheckpointRecord,
    Failure,
    JobResult,
    Status,
    exit_reason,
    reached_step,
)
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig

__all__ = ["NodeMonitor"]

_REGROUPED = "the group restarted with no failure here (a worker failed elsewhere, or a node left or joined)"


@dataclass
class _Worker:
    rank: int
    log: Path
    started: float
    pid: int | None = None
    last_beat: float | None = None
    done_at: float | None = None
    failed: bool = False
    lingered: bool = False  # reported done, then did not exit: stopped here and counted as finished
    step: int = 0
    samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    offset: int = 0
    lines: LineSplitter = field(default_factory=LineSplitter)

    def new_lines(self, final: bool = False) -> list[str]:
        """What the worker wrote since the last call, as `LineSplitter` shows it (``\\r`` bars, long
        lines: a constant cost per call, however long an unterminated line grows)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        return self.lines.feed(data, final)

    def tail(self, count: int = 20) -> list[str]:
        try:
            return self.log.read_text(errors="replace").splitlines()[-count:]
        except OSError:
            return []


class NodeMonitor:
    """This node's view of the job, fed by the agent (attempts, exits) and by a thread (heartbeats, logs).

    A worker silent longer than ``heartbeat_timeout`` after a heartbeat that shows life (``startup_timeout``
    before it) is SIGKILLed with its process group: torch's agent, which sees exits only, then restarts
    the group. A worker that reported ``done`` and lingers is counted as finished (`_linger`), as the
    supervisor counts it.
    """

    def __init__(self, config: JobConfig, opts: TorchrunOptions, *, node_dir: Path,
                 receiver: HeartbeatReceiver, say: Callable[[str], None], echo: bool,
                 latest: Callable[[], int | None]) -> None:
        self.config, self.node, self.node_dir, self.receiver = config, opts.node_rank, node_dir, receiver
        self.say, self.echo, self.latest = say, echo, latest
        self.ft = config.fault_tolerance
        tb = Path(config.logdir) / "tensorboard"
        self.progress = Progress(tb, lambda text: say(text.replace("[shardkit]", self.tag, 1)))
        if self.node == 0:
            self.progress.open()
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.attempts: list[AttemptRecord] = []
        self.failures: list[Failure] = []
        self.checkpoints: list[CheckpointRecord] = []
        self.notes: list[str] = []
        self.metrics: dict[str, float] = {}
        self.workers: dict[int, _Worker] = {}
        self.loop_errors = 0  # errors caught in the watching thread; the first one was shown
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shardkit-node-monitor", daemon=True)

    @property
    def tag(self) -> str:
        return f"[shardkit node {self.node}]"

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    # -- from the agent (main thread) ------------------------------------------------------------------
    def attempt_started(self, attempt: int, *, nodes: int, world: int, ranks: list[int]) -> None:
        with self.lock:
            if self.attempts and self._end_attempt(_REGROUPED):
                self.notes.append(f"attempt {self.attempts[-1].attempt}: {_REGROUPED}")
            if self.attempts:
                self.progress.restarted(attempt, self.attempts[-1].steps)
            record = AttemptRecord(attempt, self._elapsed(), resumed_from=self.latest())
            self.attempts.append(record)
            now = time.monotonic()
            self.workers = {r: _Worker(r, worker_log(self.node_dir, attempt, r), now) for r in ranks}
            self.notes.append(f"attempt {attempt}: {nodes} node(s), world size {world}, ranks {ranks} here")
            step = record.resumed_from
            resumed = "no checkpoint yet" if step is None else f"from checkpoint step {step}"
            self.say(f"{self.tag} attempt {attempt}: {nodes} node(s), world size {world}, this node runs "
                     f"rank(s) {', '.join(map(str, ranks))} ({resumed}); logs in "
                     f"{self.node_dir / f'attempt-{attempt}'}")

    def workers_started(self, pids: Mapping[int, int]) -> None:
        with self.lock:
            for rank, pid in pids.items():
                if rank in self.workers:
                    self.workers[rank].pid = pid

    def workers_failed(self, codes: Mapping[int, int]) -> bool:
        """Torch's agent saw workers exit with ``codes`` (by rank); whether the group finished after all.

        It did when every one of them had reported done (its final checkpoint saved) and then was
        stopped here as lingering (`_linger`), was killed by SIGABRT at exit (gloo's destructor, see
        ENGINES.md; the supervisor counts it as finished too), or was stopped by torch's agent ending
        the group after one of those (SIGTERM, SIGKILL). Then each gets a note, not a failure, and the
        attempt succeeded; else the failures are recorded and torch's agent restarts the group.
        """
        with self.lock:
            attempt = self.attempts[-1].attempt if self.attempts else 0
            done = {rank: w for rank, w in self.workers.items() if w.done_at is not None}
            stops = (-signal.SIGABRT, -signal.SIGTERM, -signal.SIGKILL)
            excused = {r: r in done and (done[r].lingered or c in stops) for r, c in codes.items()}
            caused = any(r in done and (done[r].lingered or c == -signal.SIGABRT) for r, c in codes.items())
            if codes and caused and all(excused.values()):
                for rank, code in sorted(codes.items()):
                    if not done[rank].lingered:
                        self.notes.append(f"attempt {attempt}: worker-{rank} {exit_reason(code)} after it "
                                          "reported done; counted as finished")
                self._end_attempt("succeeded")
                return True
            for rank, code in sorted(codes.items(), key=lambda item: item[1] >= 0):  # signals first
                w = self.workers.get(rank)
                if w is None or w.failed:
                    continue
                w.failed = True
                self._fail(w, exit_reason(code), code, None)
            self._end_attempt("failed")
            return False

    def workers_succeeded(self) -> None:
        with self.lock:
            self._end_attempt("succeeded")

    # -- bookkeeping (lock held) -----------------------------------------------------------------------
    def _fail(self, w: _Worker, reason: str, code: int | None, silent: float | None) -> None:
        record = self.attempts[-1]
        self.failures.append(Failure(record.attempt, "worker", w.rank, reason, code, silent, w.step,
                                     str(w.log), w.tail()))
        if record.outcome == "running":
            record.outcome = f"worker-{w.rank} {reason}"
        self.say(f"{self.tag} attempt {record.attempt}: worker-{w.rank} {reason} (last reported step "
                 f"{w.step})")

    def _end_attempt(self, outcome: str) -> bool:
        """End the current attempt with ``outcome`` unless it has one; whether it took ``outcome``."""
        if not self.attempts or self.attempts[-1].ended_s is not None:
            return False
        self._echo(final=True)
        record = self.attempts[-1]
        record.ended_s = self._elapsed()
        if record.outcome != "running":
            return False
        record.outcome = outcome
        return True

    def _echo(self, final: bool = False) -> None:
        for w in self.workers.values():
            for line in w.new_lines(final):
                if self.echo:
                    self.say(f"[worker-{w.rank}] {line}")

    def _on_beat(self, beat: p.Heartbeat, now: float) -> None:
        record = self.attempts[-1] if self.attempts else None
        w = self.workers.get(beat.index)
        if record is None or w is None or beat.attempt != record.attempt or beat.role != "worker":
            return
        progress = apply_beat(w, beat, now)
        if beat.kind == "checkpoint":
            self.checkpoints.append(CheckpointRecord(record.attempt, beat.step, beat.checkpoint))
            self.progress.checkpoint(beat.step, beat.checkpoint)
        record.samples = sum(x.samples for x in self.workers.values())
        if w.rank == min(self.workers) and progress:
            # as the supervisor: a ``done`` (or a save) at the restored step is no first step
            trained = beat.kind == "step" or beat.step > (record.resumed_from or 0)
            if record.first_step_s is None and trained:
                record.first_step_s = self._elapsed()
                self.progress.first_step(record.attempt, record.first_step_s - record.started_s)
            record.steps, record.last_step_s, self.metrics = beat.step, self._elapsed(), dict(w.metrics)
            self.progress.scalars(beat.step, self._samples(), w.metrics)

    def _samples(self) -> int:
        return sum(a.samples for a in self.attempts)

    def _check_silence(self, now: float) -> None:
        """Kill a worker silent past its limit (torch's agent then restarts the group), chosen among
        this node's workers as the supervisor chooses (`shardkit.cluster.monitor.heartbeats.suspects`, a
        beat
        being ``heartbeat_interval``): one the OS reports stopped is the one killed, else the one
        longest past its limit, and the reason names the other suspects. Workers on other nodes are
        their nodes' to judge. One worker killed is enough: torch's agent restarts the whole group (the
        others, past their limits too, are not killed and counted as failures as well)."""
        if (self.attempts and self.attempts[-1].ended_s is not None) or any(
                w.failed for w in self.workers.values()):
            return
        ft = self.ft
        quiet: list[Quiet[_Worker]] = []
        for w in self.workers.values():
            if w.failed or w.pid is None or w.done_at is not None:  # done: `_linger`'s
                continue
            if w.last_beat is None:
                limit, since, what = ft.startup_timeout, w.started, "no heartbeat {:.1f} s after its start"
            else:
                limit, since, what = ft.heartbeat_timeout, w.last_beat, "silent for {:.1f} s"
            quiet.append(Quiet(w, now - since, limit, what))
        found = suspects(quiet, ft.heartbeat_interval)
        if not found:
            return
        states = {q.who.rank: procstate.os_state(q.who.pid) if q.who.pid else None for q in found}
        held = [q for q in found if states[q.who.rank] in procstate.STOPPED_STATES]
        w, silent, limit, what = (held or found)[0]
        reason = what.format(silent) + f" (limit {limit:g} s)" + ("" if w.last_beat is not None else NO_STEP)
        others = [f"worker-{q.who.rank} ({q.silent:.1f} s)" for q in found if q.who is not w]
        if held:
            state = states[w.rank] or ""
            reason += f"; {procstate.STOPPED_STATES[state]}: state {state}"
            if others:
                reason += f"; {', '.join(others)} silent too, waiting for it"
        elif others:
            reason += (f"; {', '.join(others)} silent too: in DDP every worker waits for the slowest one, so "
                       "any of them may be the cause")
        if w.pid:  # never 0: that would be this agent's own process group
            with contextlib.suppress(OSError):
                os.killpg(w.pid, signal.SIGKILL)  # torch starts each worker in its own session
        w.failed = True
        self._fail(w, reason + ": killed so the group restarts", None, silent)

    def _linger(self, now: float) -> None:
        """Stop the workers that reported done ``heartbeat_timeout`` seconds ago and have not exited,
        once every worker of this node has reported done, and count them as finished (torch's agent,
        which waits for every exit, would wait for ever; `workers_failed` then turns their exit into
        the group's success). What keeps such a worker alive is the script's code after ``with ctx:``
        (a ``destroy_process_group`` on a broken group, a wait) or an exit handler (the worker wrapper
        ends with ``os._exit``, so threads that are not daemons do not). Its work is saved (``done``
        follows the final checkpoint), so a restart would only resume at the end and linger again.
        The summary's notes name it. While a worker of this node is still at work, done ones wait
        (torch's agent ends a group at the first exit it counts as a failure, and would stop that
        worker); a done worker that still beats is waiting for the other nodes' workers (the barrier
        in `TrainContext.finish`), and the wait counts from its last beat."""
        if (not self.workers or self.attempts[-1].ended_s is not None
                or any(w.done_at is None or w.failed for w in self.workers.values())):
            return
        limit = self.ft.heartbeat_timeout
        for w in self.workers.values():
            if w.lingered or not w.pid or w.done_at is None:
                continue
            if now - max(w.done_at, w.last_beat or 0.0) <= limit:
                continue
            if procstate.os_state(w.pid) in (None, "Z"):  # exited: torch's agent will see it
                continue
            w.lingered = True
            self.notes.append(f"attempt {self.attempts[-1].attempt}: worker-{w.rank} reported done but had "
                              f"not exited {now - w.done_at:.1f} s later (heartbeat_timeout {limit:g} s): "
                              "counted as finished and stopped; something keeps it from exiting after its "
                              "work (code after `with ctx:`, an exit handler): see its log")
            with contextlib.suppress(OSError):
                os.killpg(w.pid, signal.SIGKILL)  # its own session (torch starts each so); never pid 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch_once()
            except Exception as e:  # the thread must go on: it is what notices hangs on this node
                self.loop_errors += 1
                if self.loop_errors == 1:
                    with contextlib.suppress(Exception):
                        self.say(f"{self.tag} warning: watching the workers failed ({type(e).__name__}: "
                                 f"{e}); it goes on (later such errors are not shown)")
                self._stop.wait(0.1)

    def _watch_once(self) -> None:
        beats = self.receiver.receive(0.1)
        with self.lock:
            now = time.monotonic()
            for beat in beats:
                self._on_beat(beat, now)
            self._echo()
            self._check_silence(now)
            self._linger(now)
            if self.attempts:
                self.progress.tick(self.attempts[-1].steps, self._samples(), self.metrics)

    # -- the job lost (`shardkit.cluster.engines.torchrun._agent.LostJobWatch`, from its thread)
    # -----------------
    def job_lost(self, message: str) -> None:
        """Record that this node lost the job: a note for the summary, the attempt's outcome, a line."""
        with self.lock:
            self.notes.append(message)
            if self.attempts and self.attempts[-1].outcome == "running":
                self.attempts[-1].outcome = "lost the job"
            self.say(f"{self.tag} {message}")

    def stop_workers(self, grace: float) -> None:
        """SIGTERM this node's workers (each in its own session, as torch starts them), SIGKILL those
        left after ``grace`` seconds."""
        with self.lock:
            pids = [w.pid for w in self.workers.values() if w.pid]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.killpg(pid, sig)  # never 0: that would be this agent's own process group
            deadline = time.monotonic() + grace
            while pids and time.monotonic() < deadline:
                pids = [pid for pid in pids if procstate.os_state(pid) not in (None, "Z")]
                time.sleep(0.05)

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        with self.lock:
            for beat in self.receiver.receive(0.0):
                self._on_beat(beat, time.monotonic())
            self._end_attempt("stopped")
        self.progress.close()

    def result(self, status: Status) -> JobResult:
        with self.lock:
            train_s = sum(a.last_step_s - a.first_step_s for a in self.attempts
                          if a.first_step_s is not None and a.last_step_s is not None)
            return JobResult(
                name=self.config.name, status=status, logdir=Path(self.config.logdir),
                steps=reached_step(self.attempts),
                restarts=max(0, len(self.attempts) - 1), failures=list(self.failures),
                checkpoints=list(self.checkpoints), attempts=list(self.attempts), samples=self._samples(),
                wall_s=self._elapsed(), train_s=train_s, metrics=dict(self.metrics),
                notes=[f"node {self.node}: {note}" for note in self.notes])
