"""One torchrun node at work: torch's elastic agent with a shared attempt number, and the thread that
watches this node's workers (heartbeats, hangs, logs, progress, the summary)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from torch.distributed import DistError, DistStoreError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from shardkit.cluster import procstate
from shardkit.cluster import protocol as p
from shardkit.cluster.config import JobConfig
from shardkit.cluster.engine_torchrun import ENV_AGENT_PID, ENV_LOG_DIR, TorchrunOptions, worker_log
from shardkit.cluster.heartbeats import HeartbeatReceiver, Quiet, apply_beat, suspects
from shardkit.cluster.output import LineSplitter
from shardkit.cluster.preflight import check_here, prepare_logdir
from shardkit.cluster.progress import Progress
from shardkit.cluster.report import (
    AttemptRecord,
    CheckpointRecord,
    Failure,
    JobResult,
    Status,
    exit_reason,
    scrub,
)
from shardkit.cluster.supervisor import signals_raise
from shardkit.errors import JobError

__all__ = ["NodeInterrupted", "NodeMonitor", "ShardkitAgent", "launch"]

_ATTEMPT_KEY = "shardkit/attempt"
_REGROUPED = "the group restarted with no failure here (a worker failed elsewhere, or a node left or joined)"


class NodeInterrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP reached the agent: its workers were stopped (or never started)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class ShardkitAgent(LocalElasticAgent):
    """torch's `LocalElasticAgent` that numbers attempts the same on every node and reports to a monitor.

    The attempt number (``SHARDKIT_ATTEMPT``) is agreed through the round's rendezvous store: each node
    proposes one more than the attempt it ran last (0 when new) and all take the largest, so it grows
    by one per round on every node, unlike ``TORCHELASTIC_RESTART_COUNT``, which counts this node's
    own failures only.
    """

    def __init__(self, spec: WorkerSpec, monitor: NodeMonitor, *, log_dir: Path,
                 shutdown_timeout: int) -> None:
        super().__init__(spec, DefaultLogsSpecs(log_dir=str(log_dir)), start_method="spawn",
                         shutdown_timeout=shutdown_timeout)
        self.monitor = monitor
        self.attempt: int | None = None

    def _agree_attempt(self, group: WorkerGroup) -> int:
        proposal = 0 if self.attempt is None else self.attempt + 1
        store = group.store
        if store is None or group.group_rank is None or group.group_world_size is None:
            return proposal
        try:
            store.set(f"{_ATTEMPT_KEY}/{group.group_rank}", str(proposal))
            keys = [f"{_ATTEMPT_KEY}/{rank}" for rank in range(group.group_world_size)]
            return max(int(value) for value in store.multi_get(keys))
        except DistError:  # a node died since the rendezvous: the workers will fail and regroup anyway
            return proposal

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.attempt = self._agree_attempt(worker_group)
        os.environ[p.ENV_ATTEMPT] = str(self.attempt)  # the workers inherit the agent's environment
        ranks = [w.global_rank for w in worker_group.workers]
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        self.monitor.attempt_started(self.attempt, nodes=worker_group.group_world_size or 1, world=world,
                                     ranks=ranks)
        pids: dict[int, Any] = super()._start_workers(worker_group)
        self.monitor.workers_started({w.global_rank: int(pids[w.local_rank]) for w in worker_group.workers})
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            if self.monitor.workers_failed({rank: f.exitcode for rank, f in result.failures.items()}):
                # every worker had reported done (its work saved); those that failed were stopped
                # lingering at exit: the group finished, as the supervisor counts it
                return RunResult(state=WorkerState.SUCCEEDED,
                                 return_values={w.global_rank: None for w in worker_group.workers})
        elif result.state == WorkerState.SUCCEEDED:
            self.monitor.workers_succeeded()
        return result


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
            if record.first_step_s is None:
                record.first_step_s = self._elapsed()
                self.progress.first_step(record.attempt, record.first_step_s - record.started_s)
            record.steps, record.last_step_s, self.metrics = beat.step, self._elapsed(), dict(w.metrics)
            self.progress.scalars(beat.step, self._samples(), w.metrics)

    def _samples(self) -> int:
        return sum(a.samples for a in self.attempts)

    def _check_silence(self, now: float) -> None:
        """Kill a worker silent past its limit (torch's agent then restarts the group), chosen among
        this node's workers as the supervisor chooses (`shardkit.cluster.heartbeats.suspects`, a beat
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
        reason = what.format(silent) + f" (limit {limit:g} s)"
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
                steps=self.attempts[-1].steps if self.attempts else 0,
                restarts=max(0, len(self.attempts) - 1), failures=list(self.failures),
                checkpoints=list(self.checkpoints), attempts=list(self.attempts), samples=self._samples(),
                wall_s=self._elapsed(), train_s=train_s, metrics=dict(self.metrics),
                notes=[f"node {self.node}: {note}" for note in self.notes])


@contextlib.contextmanager
def _environment(values: Mapping[str, str], drop: frozenset[str]) -> Iterator[None]:
    """``os.environ`` with ``drop`` removed and ``values`` set, restored afterwards: torch's agent starts
    its workers with a copy of the agent's environment."""
    saved = dict(os.environ)
    for key in drop:
        os.environ.pop(key, None)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _signal_exception(signum: int) -> SignalException:
    """What SIGINT, SIGTERM and SIGHUP raise in the main thread for the whole run (`signals_raise`).

    torch's agent installs the same handler, but only once it starts workers (and keeps it): before
    that, in the rendezvous, SIGTERM or SIGHUP would kill the agent with no summary, and SIGINT raise
    a KeyboardInterrupt counted as a failure. With this handler, a signal at any point is an
    interrupt: status ``interrupted``, exit 128 + the signal.
    """
    sig = signal.Signals(signum)
    return SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def _latest(config: JobConfig) -> Callable[[], int | None]:
    def latest() -> int | None:
        try:  # informative only: the workers restore the checkpoint themselves
            from shardkit.trainer.checkpoint import CheckpointManager

            info = CheckpointManager(config.checkpoint_dir, keep=None).latest()
        except Exception:  # remote storage without the workers' credentials, a missing extra, ...
            return None
        return None if info is None else info.step

    return latest


def launch(config: JobConfig, opts: TorchrunOptions, *, echo: bool, console: TextIO) -> JobResult:
    """Run this node's agent to the end of the job (`shardkit.cluster.engine_torchrun.run_node`).

    Before anything starts: the secrets are read, a local ``data.url`` is checked (this node's workers
    read it), so are the GPUs this node's workers ask for and their interpreter (`check_here`), and
    the logdir is locked for this node (`shardkit.cluster.preflight.LogdirLock`: nodes may share it,
    two agents of one node rank may not) and this node's logs of an earlier run cleared.
    """
    secrets = config.secret_values()  # first: a missing secret fails before anything starts
    check_here(config, {"worker": opts.nproc_per_node or config.roles["worker"].count})
    logdir = Path(config.logdir)
    node_dir = logdir / "logs" / f"node-{opts.node_rank}"
    clear = [node_dir] + ([logdir / "tensorboard"] if opts.node_rank == 0 else [])
    lock = prepare_logdir(config, clear=clear, node=opts.node_rank)
    try:
        node_dir.mkdir(parents=True, exist_ok=True)
        result, error = _launch(config, opts, node_dir, secrets, echo=echo, console=console)
    finally:
        lock.release()
    if error is not None:
        raise error
    if not result.ok:
        failed = JobError(f"job {config.name} failed on node {opts.node_rank}: {len(result.failures)} "
                          f"failure(s), max_restarts exhausted:\n{result.history()}\nFix: see the logs above")
        failed.result = result  # type: ignore[attr-defined]
        raise failed
    return result


def _launch(config: JobConfig, opts: TorchrunOptions, node_dir: Path, secrets: Mapping[str, str], *,
            echo: bool, console: TextIO) -> tuple[JobResult, BaseException | None]:
    hidden = list(secrets.values())
    console_lost = False

    def say(text: str) -> None:
        nonlocal console_lost
        if console_lost:
            return
        try:
            print(scrub(text, hidden), file=console, flush=True)
        except OSError:  # the terminal is gone (a hangup) or the pipe closed: the job and its files go on
            console_lost = True

    status: Status = "failed"
    error: BaseException | None = None
    with signals_raise(_signal_exception), HeartbeatReceiver() as receiver:
        env = {p.ENV_JOB_CONFIG: str(Path(config.logdir) / p.JOB_CONFIG_FILE),
               p.ENV_JOB_DIR: str(config.logdir), p.ENV_HEARTBEAT_ADDR: receiver.addr,
               ENV_LOG_DIR: str(node_dir), ENV_AGENT_PID: str(os.getpid()),
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **config.env, **secrets}
        monitor = NodeMonitor(config, opts, node_dir=node_dir, receiver=receiver, say=say, echo=echo,
                              latest=_latest(config))
        try:
            with _environment(env, p.ALL_ENV):
                status, error = _run_agent(config, opts, monitor, node_dir)
        except SignalException as e:  # before or after the agent ran (in the agent: _run_agent's)
            status, error = "interrupted", NodeInterrupted(int(e.sigval))
        finally:
            monitor.stop()
            result = monitor.result(status)
            summary = result.write() if opts.node_rank == 0 else _write_node_summary(result, node_dir)
            text = result.format().replace(f"summary: {result.summary_path}", f"summary: {summary}")
            say(f"{monitor.tag} {text}")
    return result, error


def _run_agent(config: JobConfig, opts: TorchrunOptions, monitor: NodeMonitor, node_dir: Path
               ) -> tuple[Status, BaseException | None]:
    local_addr = opts.local_addr or ("127.0.0.1" if opts.endpoint_is_loopback else None)
    entry = [config.entrypoint] if config.entrypoint_kind == "script" else [
        "-m", "shardkit.trainer.run", config.entrypoint]
    params = RendezvousParameters(
        backend="c10d", endpoint=opts.rdzv_endpoint, run_id=opts.rdzv_id or config.name,
        min_nodes=opts.min_nodes, max_nodes=opts.max_nodes, local_addr=local_addr,
        is_host=opts.node_rank == 0, **opts.rdzv_conf)
    monitor.say(f"{monitor.tag} joining rendezvous {params.run_id!r} at {opts.rdzv_endpoint} "
                f"({opts.min_nodes}:{opts.max_nodes} nodes){', hosting it' if opts.node_rank == 0 else ''}")
    monitor.start()
    handler = None
    interrupted = False
    try:
        handler = rdzv_registry.get_rendezvous_handler(params)
        spec = WorkerSpec(
            role="worker", local_world_size=opts.nproc_per_node or config.roles["worker"].count,
            entrypoint=os.fspath(config.python),
            args=("-u", "-m", "shardkit.cluster.engine_torchrun", "--worker", *entry),
            rdzv_handler=handler, monitor_interval=opts.monitor_interval, local_addr=local_addr,
            max_restarts=config.fault_tolerance.max_restarts if opts.max_restarts is None
            else opts.max_restarts)
        agent = ShardkitAgent(spec, monitor, log_dir=node_dir / "torchelastic",
                              shutdown_timeout=math.ceil(opts.grace))
        return ("failed" if agent.run().is_failed() else "succeeded"), None
    except SignalException as e:
        interrupted = True  # torch leaves the rendezvous open then: the other nodes may go on without it
        return "interrupted", NodeInterrupted(int(e.sigval))
    except RendezvousClosedError as e:
        return "failed", JobError(
            f"job {config.name}, node {opts.node_rank}: the rendezvous was closed ({e}): another node ended "
            "the job (its workers failed more than max_restarts times, or it was stopped). Fix: see that "
            "node's log and summary")
    except (RendezvousError, DistStoreError) as e:
        return "failed", JobError(
            f"job {config.name}, node {opts.node_rank}: the rendezvous at {opts.rdzv_endpoint} failed "
            f"({type(e).__name__}: {e}). Fix: start node 0 (it hosts the rendezvous) at that address, check "
            "engine.rdzv_endpoint, rdzv_id and nnodes, and that the port is free there and reachable")
    finally:
        if handler is not None and not interrupted:
            handler.shutdown()


def _write_node_summary(result: JobResult, node_dir: Path) -> Path:
    path = node_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path
