"""The supervisor: starts a job's processes on an engine, watches heartbeats and exits, restarts, sums up.

The rules it judges a silent or lingering process by are `shardkit.cluster.supervisor._watch`; what it
watches with (heartbeats, output, progress, the report, the signals that stop a job) is
`shardkit.cluster.monitor`, shared with the torchrun node.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from shardkit.cluster._rerun import prepare_rerun
from shardkit.cluster._spec import build_spec
from shardkit.cluster.engines import Engine, ProcessGroup, RoleProcess, check_job, get_engine
from shardkit.cluster.monitor.heartbeats import HeartbeatReceiver, SampleLedger, apply_beat
from shardkit.cluster.monitor.preflight import LogdirLock, check_here, prepare_logdir
from shardkit.cluster.monitor.progress import Progress
from shardkit.cluster.monitor.report import (
    AttemptRecord,
    CheckpointRecord,
    Failure,
    JobResult,
    Status,
    exit_reason,
    newest_checkpoint,
    reached_step,
    scrub,
)
from shardkit.cluster.monitor.stop_signals import signals_raise
from shardkit.cluster.supervisor._watch import _Watch, lingering, silence, unreported
from shardkit.errors import JobError
from shardkit.job import protocol
from shardkit.job.config import JobConfig
from shardkit.job.config.load import check_locations
from shardkit.job.config.messages import located
from shardkit.job.masking import Masker
from shardkit.trainer.rerun import Rerun, check_rerun

__all__ = ["Supervisor", "driver_roles"]

_POLL_S = 0.1


def driver_roles(config: JobConfig) -> frozenset[str]:
    """The roles whose successful exit ends the job: the chief of a TensorFlow parameter-server job (the
    coordinator), the workers otherwise (and a TensorFlow allreduce chief). Other roles (ps, TensorFlow
    workers serving a coordinator, an evaluator) are stopped when these are done."""
    if config.framework == "tensorflow" and config.strategy == "parameter_server":
        return frozenset({"chief"})
    return frozenset({"worker", "chief"})


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the trainer (SIGINT too): handled like Ctrl-C (stop everything, then exit)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Supervisor:
    """Runs one job to its end. Use `shardkit.cluster.run_job`; see its docstring for the policy.

    ``engine``: one the caller made (and closes: a Ray or Spark connection it keeps using); by default
    the supervisor makes the config's engine and closes it when the job ends (``close()``: a local Ray
    instance or a SparkSession it started is shut down, nothing is left running).
    """

    def __init__(self, config: JobConfig, *, echo: bool = True, console: TextIO | None = None,
                 engine: Engine | None = None, progress_interval: float = 5.0,
                 rerun: Rerun = "refuse") -> None:
        self.config = config
        self.rerun = check_rerun(rerun)  # what to do with the run the logdir holds (`prepare_rerun`)
        self._owns_engine = engine is None
        if engine is None:
            with located(config):
                engine = get_engine(config.engine.name, config.engine.options)
        self.engine = engine
        check_job(self.engine, config)  # as `shardkit validate`: before anything starts
        check_locations(config)  # as `load_config`, for a config built in Python
        self.console = console if console is not None else sys.stdout
        self.echo = echo
        self.ft = config.fault_tolerance
        self.drivers = driver_roles(config)
        self.lead = "chief-0" if "chief" in config.roles else "worker-0"
        self.logdir = Path(config.logdir)
        self.progress = Progress(self.logdir / "tensorboard", self._say, progress_interval)
        self._masker = Masker([])  # the secrets' values, read when the job starts
        self._group: ProcessGroup | None = None
        self._t0 = time.monotonic()
        self._checkpoints: list[CheckpointRecord] = []
        self._attempts: list[AttemptRecord] = []
        self._listed_step: int | None = None  # the newest checkpoint as the attempt starts (0: none)
        self._failures: list[Failure] = []
        self._notes: list[str] = []
        self._metrics: dict[str, float] = {}
        self._console_lost = False
        self._ledger = SampleLedger()
        self._current: tuple[AttemptRecord, dict[str, _Watch]] | None = None  # the attempt being watched

    # -- output ------------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self._console_lost:
            return
        try:
            print(scrub(text, self._masker), file=self.console, flush=True)
        except OSError:  # the terminal is gone (a hangup) or the pipe closed: the job and its files go on
            self._console_lost = True

    def _echo(self, lines: Iterator[tuple[RoleProcess, str]]) -> None:
        for proc, line in lines:
            if self.echo:
                self._say(f"[{proc.name}] {line}")

    def _elapsed(self) -> float:
        return time.monotonic() - self._t0

    # -- the job -----------------------------------------------------------------------------------
    def run(self) -> JobResult:
        """Run every attempt until the job succeeds, fails for good, or is interrupted."""
        try:
            return self._run()
        finally:
            self._close_engine()

    def _run(self) -> JobResult:
        self._masker = Masker(self.config.secret_values().values())  # a missing secret fails before any start
        if getattr(self.engine, "runs_here", False):  # the roles run on this machine
            given = self.config
            self.config = check_here(self.config)  # a local table's version pinned for every role
            data, before = self.config.data, given.data
            if data is not None and before is not None and before != data:
                if data.sources is not None and before.sources is not None:  # a mixture's tables
                    for name, source in data.sources.items():
                        if source.version != before.sources[name].version:
                            self._say(f"[shardkit] data: the table {source.url} (source {name}) is read at "
                                      f"version {source.version} by every role of this run")
                else:
                    self._say(f"[shardkit] data: the table {data.url} is read at version "
                              f"{data.options['version']} by every role of this run")
        prepare_rerun(self.config, self.rerun, say=self._say)  # a completed run: refused, resumed or moved
        lock = self._prepare_logdir()
        try:
            result = self._attempts_and_summary()
        finally:
            lock.release()
        if not result.ok:
            error = JobError(
                f"job {self.config.name} failed: {len(self._failures)} failure(s), "
                f"max_restarts={self.ft.max_restarts} exhausted:\n{result.history()}\n"
                f"Fix: see the logs above; summary in {result.summary_path}"
            )
            error.result = result  # type: ignore[attr-defined]
            raise error
        return result

    def _attempts_and_summary(self) -> JobResult:
        status: Status = "failed"
        with signals_raise(_Terminated), HeartbeatReceiver() as receiver:
            try:
                for attempt in range(self.ft.max_restarts + 1):
                    failure = self._attempt(attempt, receiver)
                    if failure is None:
                        status = "succeeded"
                        break
                    self._failures.append(failure)
                    if attempt < self.ft.max_restarts:
                        self.progress.restarted(attempt + 1, self._attempts[-1].steps)
            except KeyboardInterrupt as e:
                status = "interrupted"
                why = str(e) or type(e).__name__
                self._say(f"[shardkit] {why}: stopping every process")
                with contextlib.suppress(KeyboardInterrupt):  # a second one while stopping: raise the first
                    self._stop()
                raise
            finally:
                self._stop()
                self._close_attempt(receiver)
                self.progress.close()
                result = self._result(status)
                result.write(self._masker)
                self._say(f"[shardkit] {result.format()}")
        return result

    def _prepare_logdir(self) -> LogdirLock:
        """Lock the logdir for this run, clear one run's outputs (checkpoints stay: the job resumes from
        them), write job.json, open TensorBoard (`shardkit.cluster.monitor.preflight.prepare_logdir`)."""
        lock = prepare_logdir(self.config, clear=[self.logdir / "logs", self.logdir / "tensorboard"])
        self.progress.open()
        return lock

    def _close_engine(self) -> None:
        """Close an engine the supervisor made (a local Ray instance, a SparkSession it started)."""
        close = getattr(self.engine, "close", None) if self._owns_engine else None
        if close is None:
            return
        try:
            close()
        except Exception as e:  # the job's result stands; say what may be left running
            self._say(f"[shardkit] warning: closing engine {self.config.engine.name} failed "
                      f"({type(e).__name__}: {e}); its processes may still run")

    def _attempt(self, attempt: int, receiver: HeartbeatReceiver) -> Failure | None:
        record = AttemptRecord(attempt, self._elapsed(), resumed_from=self._latest_checkpoint())
        self._count_restart(record)
        self._attempts.append(record)
        spec = build_spec(self.config, attempt=attempt, job_dir=self.logdir, heartbeat_addr=receiver.addr,
                          resume_step=self._listed_step)
        log_dir = self.logdir / "logs" / f"attempt-{attempt}"
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "processes.json").write_text(json.dumps(self._masker.deep(
            [{"name": p.name, "argv": p.argv, "env": p.redacted_env()} for p in spec.processes]), indent=2))
        step = record.resumed_from
        resumed = f"from checkpoint step {step}" if step is not None else "no checkpoint yet"
        self._say(f"[shardkit] attempt {attempt} ({resumed}): starting "
                  f"{', '.join(p.name for p in spec.processes)}; logs in {log_dir}")
        try:
            self._group = self.engine.start(spec, log_dir=log_dir)
        except OSError as e:
            record.outcome = f"could not start: {e}"
            raise JobError(f"job {self.config.name}: could not start its processes ({e}). Fix: check "
                           f"`python` ({self.config.python}) and the entrypoint in the config") from e
        watches = {p.name: _Watch(p, p.role in self.drivers) for p in self._group.processes}
        self._current = (record, watches)
        failure = self._watch(self._group, watches, receiver, record)
        if failure is not None:
            self._say(f"[shardkit] attempt {attempt} failed: {failure.name} {failure.reason} (last reported "
                      f"step {failure.step}); stopping the other processes")
        self._stop()
        self._close_attempt(receiver)
        record.ended_s = self._elapsed()
        record.outcome = "succeeded" if failure is None else f"{failure.name} {failure.reason}"
        return failure

    def _count_restart(self, record: AttemptRecord) -> None:
        """The samples of this run in the checkpoint ``record`` resumes from, and those the previous
        attempt trained past it: lost, trained again (`SampleLedger`)."""
        previous = self._attempts[-1] if self._attempts else None
        resumed = record.resumed_from
        if resumed is None and previous is not None:  # the checkpoints could not be listed from here
            resumed = max((c.step for c in self._checkpoints), default=None)
        lost, record.samples_resumed = self._ledger.restart(previous.samples if previous else 0, resumed)
        if previous is not None:
            previous.samples_lost = lost

    def _close_attempt(self, receiver: HeartbeatReceiver) -> None:
        """Once the attempt's processes are gone: read the heartbeats they sent before they ended (the
        last count of a process that failed while another's failure was being handled), total the
        samples, and name the processes whose count stops at their last heartbeat."""
        current, self._current = self._current, None
        if current is None:
            return
        record, watches = current
        lead = watches.get(self.lead)
        for beat in receiver.receive(0.0):
            w = watches.get(f"{beat.role}-{beat.index}")
            if beat.attempt == record.attempt and w is not None:
                self._on_beat(beat, w, w is lead, record, time.monotonic(), late=True)
        record.samples = sum(w.samples for w in watches.values())
        record.unreported = [f"{w.proc.name} ({why})" for w in watches.values()
                             if (why := unreported(w)) is not None]

    def _stop(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.stop()
            final = getattr(group, "final_output", None)
            if final is not None:
                self._echo(final())

    def _latest_checkpoint(self) -> int | None:
        """The newest checkpoint's step, None when there is none or it cannot be listed from here; the
        newest folder's step (0 for none) is kept for the attempt's processes as the newest they may
        restore."""
        self._listed_step = None
        try:  # the script restores the checkpoint itself; this is what the attempt starts from
            from shardkit.trainer.checkpoint import CheckpointManager

            manager = CheckpointManager(self.config.checkpoint_dir, keep=None)
            info, newest = manager.latest(), manager.newest_folder()
        except Exception:  # remote storage without the roles' credentials, a missing extra, ...
            return None
        # an uncommitted folder too: the processes then skip it with a warning naming it (a crash's)
        self._listed_step = newest
        return None if info is None else info.step

    # -- watching one attempt ------------------------------------------------------------------------
    def _watch(self, group: ProcessGroup, watches: dict[str, _Watch], receiver: HeartbeatReceiver,
               record: AttemptRecord) -> Failure | None:
        attempt = record.attempt
        lead = watches.get(self.lead)
        base_samples = sum(a.samples for a in self._attempts[:-1])
        while True:
            # Exits first, then the socket: a process's heartbeats are in the socket before its exit
            # shows, so those of every exited process are read before its exit is judged.
            exited = sorted(group.poll(), key=lambda p: (p.returncode or 0) >= 0)  # signals first
            self._echo(group.output())
            now = time.monotonic()
            for beat in receiver.receive(0.0 if exited else _POLL_S):
                w = watches.get(f"{beat.role}-{beat.index}")
                if beat.attempt != attempt or w is None:
                    continue
                self._on_beat(beat, w, w is lead, record, now)
            record.samples = sum(w.samples for w in watches.values())
            for proc in exited:
                w = watches[proc.name]
                w.exited_at = now
                code = proc.returncode if proc.returncode is not None else 0
                if code == 0 or (w.done_at is not None and code == -signal.SIGABRT):
                    if code != 0:  # gloo sometimes aborts at exit after the work is done (ENGINES.md)
                        self._notes.append(f"attempt {attempt}: {proc.name} {exit_reason(code)} after it "
                                           "reported done; counted as finished")
                    w.finished = True
                    continue
                return self._failure(attempt, w, proc.lost_reason or exit_reason(code), code, None)
            self._notes += lingering(attempt, watches, now, self.ft)
            drivers = [w for w in watches.values() if w.driver]
            if drivers and all(w.finished for w in drivers):
                return None
            failure = self._silence(attempt, watches, now)
            if failure is not None:
                return failure
            self.progress.tick(record.steps, base_samples + record.samples, self._metrics)

    def _on_beat(self, beat: protocol.Heartbeat, w: _Watch, is_lead: bool, record: AttemptRecord,
                 now: float, *, late: bool = False) -> None:
        """Record ``beat``; ``late``: read after the attempt's processes were stopped, so it counts
        (samples, checkpoints, the lead's step and metrics) but does not time the attempt."""
        before = w.last_beat
        progress = apply_beat(w, beat, now)
        if before is not None and w.last_beat is not None and w.last_beat > before:
            w.gap = w.last_beat - before  # beats read in one poll share a time: only a real gap counts
        if is_lead and beat.kind == "alive" and beat.checkpoint is not None and not late:
            self._restored(w.proc.name, beat.step if beat.checkpoint else None, record)
        if beat.kind != "start":
            self._ledger.beat(w.proc.name, beat.step, beat.samples)
        if beat.kind == "checkpoint":
            self._checkpoints.append(CheckpointRecord(record.attempt, beat.step, beat.checkpoint))
            self._ledger.checkpoint(beat.step)
            self.progress.checkpoint(beat.step, beat.checkpoint)
        if is_lead and progress and late:
            record.steps, self._metrics = beat.step, dict(w.metrics)
        elif is_lead and progress:
            # A process that resumed at the end of its training ends without a step: its ``done`` (or a
            # save) at the restored step is no first step.
            trained = beat.kind == "step" or beat.step > (record.resumed_from or 0)
            if record.first_step_s is None and trained:
                record.first_step_s = self._elapsed()
                self.progress.first_step(record.attempt, record.first_step_s - record.started_s)
            record.steps, record.last_step_s = beat.step, self._elapsed()
            self._metrics = dict(w.metrics)
            samples = sum(a.samples for a in self._attempts[:-1]) + record.samples
            self.progress.scalars(beat.step, samples, w.metrics)

    def _restored(self, name: str, step: int | None, record: AttemptRecord) -> None:
        """The lead process says which checkpoint it restored (None: none). The attempt was announced with
        the newest one that looked complete from here (`_latest_checkpoint` checks sizes, not contents):
        where the lead restored another (the newest did not verify), the record and the sample
        accounting follow the lead, and the console says so."""
        if step == record.resumed_from:
            return
        before = record.resumed_from
        record.resumed_from = step
        lost, record.samples_resumed = self._ledger.resumed_instead(step)
        previous = self._attempts[-2] if len(self._attempts) > 1 else None
        if previous is not None:
            previous.samples_lost = lost
        what = f"checkpoint step {step}" if step is not None else "no checkpoint (it starts from step 0)"
        if before is None:  # the checkpoints could not be listed from here
            self._say(f"[shardkit] {name} restored {what}")
        else:
            self._say(f"[shardkit] {name} restored {what}, not step {before}: that one did not verify "
                      f"(see {name}'s log)")

    def _silence(self, attempt: int, watches: dict[str, _Watch], now: float) -> Failure | None:
        """The failure when a running process is silent past its limit, named among the whole group
        (`shardkit.cluster.supervisor._watch.silence`)."""
        found = silence(watches, now, self.ft, self.config.strategy)
        if found is None:
            return None
        who, reason, silent = found
        return self._failure(attempt, who, reason, None, silent)

    def _failure(self, attempt: int, w: _Watch, reason: str, code: int | None,
                 silent: float | None) -> Failure:
        lines = [scrub(line, self._masker) for line in w.proc.tail(20)]
        return Failure(attempt, w.proc.role, w.proc.index, reason, code, silent, w.step,
                       str(w.proc.log_path), lines)

    def _end_at_newest_checkpoint(self, status: Status) -> None:
        """A job that did not succeed leaves its newest checkpoint as its model (a new run resumes it):
        what its last attempt trained after that checkpoint is counted lost, as a restart would count
        it, so that ``samples_kept`` is what the checkpoint holds."""
        if status == "succeeded" or not self._attempts:
            return
        last = self._attempts[-1]
        newest = newest_checkpoint(self._checkpoints, self._attempts)
        last.samples_lost, _ = self._ledger.restart(last.samples, newest)

    def _result(self, status: Status) -> JobResult:
        self._end_at_newest_checkpoint(status)
        end = self._elapsed()
        train_s = sum(a.last_step_s - a.first_step_s for a in self._attempts
                      if a.first_step_s is not None and a.last_step_s is not None)
        for a in self._attempts:
            if a.ended_s is None:
                a.ended_s, a.outcome = end, status
        return JobResult(
            name=self.config.name, status=status, logdir=self.logdir,
            steps=reached_step(self._attempts),
            restarts=max(0, len(self._attempts) - 1), failures=list(self._failures),
            checkpoints=list(self._checkpoints), attempts=list(self._attempts),
            samples=sum(a.samples for a in self._attempts), wall_s=end,
            train_s=train_s, metrics=dict(self._metrics),
            notes=list(self._notes),
            samples_lost=sum(a.samples_lost for a in self._attempts),
            samples_unreported=[f"attempt {a.attempt}: {u}" for a in self._attempts for u in a.unreported],
        )
