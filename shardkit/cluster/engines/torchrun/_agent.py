"""One torchrun node at work: torch's elastic agent with a shared attempt number, run to the end of the
job with the thread that watches this node's workers (`shardkit.cluster.engines.torchrun._monitor`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from shardkit.cluster._addresses import collective_env
from shardkit.cluster._rerun import prepare_rerun
from shardkit.cluster.engines.torchrun import ENV_AGENT_PID, ENV_LOG_DIR, TorchrunOptions
from shardkit.cluster.engines.torchrun._backstop import Backstop
from shardkit.cluster.engines.torchrun._monitor import NodeMonitor
from shardkit.cluster.engines.torchrun._rendezvous import Formation
from shardkit.cluster.monitor.heartbeats import HeartbeatReceiver
from shardkit.cluster.monitor.preflight import check_here, prepare_logdir
from shardkit.cluster.monitor.report import JobResult, Status, scrub
from shardkit.cluster.monitor.stop_signals import signals_raise
from shardkit.errors import JobError, LostJobError, one_line
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig
from shardkit.job.masking import Masker
from shardkit.trainer.rerun import Rerun

__all__ = ["LostJobWatch", "NodeInterrupted", "ShardkitAgent", "launch"]

_ATTEMPT_KEY = "shardkit/attempt"
_AGENT_END_S = 3.0  # how long a node that lost the job waits for torch's agent to end before ending it
_STOP_GRACE_S = 1.0  # SIGTERM to SIGKILL for the workers when a signal ends a node stuck in a store call


class NodeInterrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP reached the agent: its workers were stopped (or never started)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class LostJobWatch:
    """Notices that this node lost its job: the rendezvous store (hosted by node 0) has not accepted a
    TCP connection for ``timeout`` seconds (``fault_tolerance.lost_job_timeout``) since it last did,
    counted once armed (the first attempt started: before, nodes wait for each other as long as the
    rendezvous's ``join_timeout``). Then ``on_lost(message)`` runs in the watch's thread, once.

    Why a connection and not a store request: torch's agent blocks in its own store requests for up to
    ``rdzv_conf.read_timeout`` and a TCPStore client logs every failed try; a connection attempt is
    bounded by its own timeout, says nothing to the store, and sees both silence (a partition, a
    machine gone: no answer) and refusal (node 0's agent gone, its machine up). A store process alive
    but hung (SIGSTOP) still has its connections accepted by the kernel: torch's timeouts cover that.
    """

    def __init__(self, endpoint: str, *, timeout: float, on_lost: Callable[[str], None]) -> None:
        self.host, self.port = p.parse_addr(endpoint)
        self.timeout = timeout
        self.interval = min(1.0, timeout / 5)
        self.probe_timeout = max(0.5, min(2.0, timeout / 3))
        self.on_lost = on_lost
        self.lost: str | None = None
        self._last_ok: float | None = None  # None: not armed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shardkit-lost-job-watch", daemon=True)

    @property
    def endpoint(self) -> str:
        return p.format_addr(self.host, self.port)

    def arm(self) -> None:
        if self._last_ok is None:
            self._last_ok = time.monotonic()

    @property
    def armed(self) -> bool:
        return self._last_ok is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def probe(self) -> str | None:
        """None when the store accepts a connection now, else why not."""
        try:
            with socket.create_connection((self.host, self.port), timeout=self.probe_timeout):
                return None
        except TimeoutError:
            return f"no answer within {self.probe_timeout:g} s"
        except OSError as e:
            return e.strerror or str(e)

    def message(self, what: str) -> str:
        """Why this node left: ``what`` the store did (``did not answer for 12 s (...)``) and what to do."""
        return (f"lost the job: the rendezvous store at {self.endpoint} (node 0) {what}: a network "
                "partition between this host and node 0, or node 0's machine or agent gone. This node "
                "stopped its workers and left the job. Fix: check node 0's log and summary, and this host's "
                f"network path to {self.host}; if node 0 still runs, the job goes on there (where "
                "engine.nnodes allows) and this node may rejoin it (start it again with the same rdzv_id); "
                "if node 0 is gone, start the job again: it resumes from its newest checkpoint")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self._last_ok is None:
                continue
            why = self.probe()
            now = time.monotonic()
            if why is None:
                self._last_ok = now
            elif now - self._last_ok >= self.timeout and not self._stop.is_set():
                self.lost = self.message(f"did not answer for {now - self._last_ok:.0f} s ({why}; "
                                         f"fault_tolerance.lost_job_timeout {self.timeout:g} s)")
                self.on_lost(self.lost)
                return


class _Ending:
    """Who ends this node's run (stops the monitor, writes the summary): the main thread when the agent
    returns, or the `LostJobWatch` thread when the main thread is stuck in one of torch's store
    requests; whoever claims it first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by: str | None = None
        self.done = threading.Event()

    def claim(self, who: str) -> bool:
        with self._lock:
            if self.by is None:
                self.by = who
            return self.by == who


class ShardkitAgent(LocalElasticAgent):
    """torch's `LocalElasticAgent` that numbers attempts the same on every node and reports to a monitor.

    The attempt number (``SHARDKIT_ATTEMPT``) is agreed through the round's rendezvous store: each node
    proposes one more than the attempt it ran last (0 when new) and all take the largest, so it grows
    by one per round on every node, unlike ``TORCHELASTIC_RESTART_COUNT``, which counts this node's
    own failures only.
    """

    def __init__(self, spec: WorkerSpec, monitor: NodeMonitor, *, log_dir: Path,
                 shutdown_timeout: int, watch: LostJobWatch | None = None,
                 formation: Formation | None = None) -> None:
        super().__init__(spec, DefaultLogsSpecs(log_dir=str(log_dir)), start_method="spawn",
                         shutdown_timeout=shutdown_timeout)
        self.monitor = monitor
        self.watch = watch
        self.formation = formation
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
        if self.formation is not None:  # the first rendezvous formed: startup_timeout no longer applies
            self.formation.set_formed()
        if self.watch is not None:  # the job has started: from now on a silent store means it is lost
            self.watch.arm()
        self.attempt = self._agree_attempt(worker_group)
        os.environ[p.ENV_ATTEMPT] = str(self.attempt)  # the workers inherit the agent's environment
        ranks = [w.global_rank for w in worker_group.workers]
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        self.monitor.attempt_started(self.attempt, nodes=worker_group.group_world_size or 1, world=world,
                                     ranks=ranks)
        pids: dict[int, Any] = super()._start_workers(worker_group)
        self.monitor.workers_started({w.global_rank: int(pids[w.local_rank]) for w in worker_group.workers})
        return pids

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # SIGTERM to the workers whatever stopped the agent, as the supervisor sends: torch's agent
        # would pass them a Ctrl-C's SIGINT, and a worker's KeyboardInterrupt prints a traceback, then
        # exits slowly (gloo's teardown with its peers still there) until SIGKILLed ``grace`` later
        super()._shutdown(signal.SIGTERM, timeout)

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
    interrupt: status ``interrupted``, exit 128 + the signal. It stays the handler throughout
    (``TORCHELASTIC_SIGNALS_TO_HANDLE`` leaves torch's agent only SIGQUIT), so that the backstop knows
    when the main thread took a signal (`Backstop.took`).
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


def launch(config: JobConfig, opts: TorchrunOptions, *, echo: bool, console: TextIO,
           rerun: Rerun = "refuse") -> JobResult:
    """Run this node's agent to the end of the job (`shardkit.cluster.engines.torchrun.run_node`).

    Before anything starts: the secrets are read, a local ``data.url`` is checked (this node's workers
    read it), so are the GPUs this node's workers ask for and their interpreter (`check_here`), and
    the logdir is locked for this node (`shardkit.cluster.monitor.preflight.LogdirLock`: nodes may share
    it,
    two agents of one node rank may not) and this node's logs of an earlier run cleared. Node 0 first
    decides what to do with a completed run (``rerun``, `shardkit.cluster._rerun.prepare_rerun`).
    """
    secrets = config.secret_values()  # first: a missing secret fails before anything starts
    config = check_here(config, {"worker": opts.nproc_per_node or config.roles["worker"].count})
    logdir = Path(config.logdir)
    node_dir = logdir / "logs" / f"node-{opts.node_rank}"
    clear = [node_dir] + ([logdir / "tensorboard"] if opts.node_rank == 0 else [])
    if opts.node_rank == 0:
        hidden = Masker(secrets.values())
        tag = "[shardkit node 0]"
        prepare_rerun(config, rerun, node=0,
                      say=lambda text: _print(text.replace("[shardkit]", tag), console, hidden))
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
    hidden = Masker(secrets.values())  # what it prints, with every secret value as ***
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
    ft = config.fault_tolerance
    ending = _Ending()

    def signalled(signum: int) -> SignalException:  # the main thread's handler: it took the signal
        backstop.took()
        return _signal_exception(signum)

    def stuck_signal(signum: int) -> None:  # in the backstop's thread: the main thread did not take it
        if not ending.claim("signal"):
            return
        try:
            monitor.stop_workers(min(opts.grace, _STOP_GRACE_S))
            finish("interrupted")
        finally:
            os._exit(128 + signum)  # `shardkit train`'s exit code for a signal

    def stuck_late() -> None:  # in the backstop's thread: the first rendezvous is past its deadline
        if not ending.claim("late"):
            return
        try:
            message = formation.message(stuck=True)
            monitor.notes.append(message)
            finish("failed", show=False)
            with contextlib.suppress(OSError):
                print(f"shardkit train: job {config.name}, node {opts.node_rank}: {message}", file=sys.stderr,
                      flush=True)
        finally:
            os._exit(1)  # the exit code of a failed job

    backstop = Backstop(on_signal=stuck_signal, on_late=stuck_late,
                        late=lambda: ending.by is None and formation.late())
    with signals_raise(signalled), HeartbeatReceiver() as receiver:
        local_addr = opts.local_addr or "127.0.0.1"
        bind = collective_env(local_addr, {**os.environ, **config.env})  # only what the user left unset
        env = {p.ENV_JOB_CONFIG: str(Path(config.logdir) / p.JOB_CONFIG_FILE),
               p.ENV_JOB_DIR: str(config.logdir), p.ENV_HEARTBEAT_ADDR: receiver.addr,
               p.ENV_COLLECTIVE_TIMEOUT: f"{ft.collective_timeout:g}",
               ENV_LOG_DIR: str(node_dir), ENV_AGENT_PID: str(os.getpid()),
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **_quiet_workers(), **bind, **config.env, **secrets,
               # torch's agent leaves our handlers (`signalled`) on the stop signals when it starts workers
               "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGQUIT"}
        monitor = NodeMonitor(config, opts, node_dir=node_dir, receiver=receiver, say=say, echo=echo,
                              latest=_latest(config))
        formation = Formation(config, opts, started=monitor.t0)
        if bind:
            monitor.notes.append(f"this node's workers bind their collectives to {local_addr}: "
                                 + ", ".join(f"{k}={v}" for k, v in sorted(bind.items())))

        def finish(status: Status, show: bool = True) -> JobResult:
            monitor.stop()
            result = monitor.result(status)
            summary = result.write() if opts.node_rank == 0 else _write_node_summary(result, node_dir)
            text = result.format().replace(f"summary: {result.summary_path}", f"summary: {summary}")
            if show:
                say(f"{monitor.tag} {text}")
            return result

        def lost(message: str) -> None:  # in the watch's thread
            monitor.job_lost(message)
            monitor.stop_workers(opts.grace)
            # torch's agent, its workers gone, ends by itself at once unless it is stuck in a store
            # request (up to rdzv_conf.read_timeout): then this thread ends the run, within the bound
            if ending.done.wait(_AGENT_END_S) or not ending.claim("watch"):
                ending.done.wait(30.0)
                return
            try:
                finish("failed")
                with contextlib.suppress(OSError):
                    print(f"shardkit train: job {config.name}, node {opts.node_rank}: {message}",
                          file=sys.stderr, flush=True)
            finally:
                os._exit(1)  # the exit code of a failed job (`shardkit train`)

        # node 0 hosts the store: it cannot lose it (it waits for lost peers as the rendezvous does)
        watch = None if opts.node_rank == 0 else LostJobWatch(
            opts.rdzv_endpoint, timeout=ft.lost_job_timeout, on_lost=lost)
        with backstop:
            try:
                with _environment(env, p.ALL_ENV):
                    status, error = _run_agent(config, opts, monitor, node_dir, watch=watch,
                                                   formation=formation)
            except SignalException as e:  # before or after the agent ran (in the agent: _run_agent's)
                status, error = "interrupted", NodeInterrupted(int(e.sigval))
            finally:
                if watch is not None:
                    watch.stop()
                    if watch.lost is not None and status != "succeeded":
                        status, error = "failed", LostJobError(f"job {config.name}, node {opts.node_rank}: "
                                                               f"{watch.lost}")
                if not ending.claim("main"):
                    ending.done.wait()  # the watch or the backstop ends the run, and the process
                never_formed = isinstance(error, _NeverFormedError)
                if never_formed:
                    monitor.notes.append(formation.message())
                result = finish(status, show=not never_formed)  # its one line says why, not a summary
                ending.done.set()
    return result, error


class _NeverFormedError(JobError):
    """The first rendezvous did not form within ``startup_timeout`` (`Formation.message`)."""


def _quiet_workers() -> dict[str, str]:
    """The workers' C++ log level (``TORCH_CPP_LOG_LEVEL``), unless set: errors only. c10d's warnings
    (a store connection retried, ...) come with a C++ stack trace each, on the console through the
    echo; the errors behind a failure reach the worker's Python exception anyway."""
    return {} if "TORCH_CPP_LOG_LEVEL" in os.environ else {"TORCH_CPP_LOG_LEVEL": "ERROR"}


def _run_agent(config: JobConfig, opts: TorchrunOptions, monitor: NodeMonitor, node_dir: Path, *,
               watch: LostJobWatch | None, formation: Formation) -> tuple[Status, BaseException | None]:
    local_addr = opts.local_addr or ("127.0.0.1" if opts.endpoint_is_loopback else None)
    entry = [config.entrypoint] if config.entrypoint_kind == "script" else [
        "-m", "shardkit.trainer.run", config.entrypoint]
    run_id = opts.rdzv_id or config.name
    monitor.say(f"{monitor.tag} joining rendezvous {run_id!r} at {opts.rdzv_endpoint} "
                f"({opts.min_nodes}:{opts.max_nodes} nodes) as {local_addr}"
                f"{', hosting it' if opts.node_rank == 0 else ''}")
    monitor.start()
    if watch is not None:
        watch.start()
    handler = None
    leave_open = False  # torch's rendezvous stays open for the other nodes (else this node closes it)
    try:
        if formation.phase == "store" and not formation.wait_for_store():
            return "failed", _never_formed(config, opts, formation)
        params = RendezvousParameters(
            backend="c10d", endpoint=opts.rdzv_endpoint, run_id=run_id,
            min_nodes=opts.min_nodes, max_nodes=opts.max_nodes, local_addr=local_addr,
            is_host=opts.node_rank == 0, **{**opts.rdzv_conf, "join_timeout": formation.join_timeout()})
        handler = rdzv_registry.get_rendezvous_handler(params)
        formation.handler = handler
        spec = WorkerSpec(
            role="worker", local_world_size=opts.nproc_per_node or config.roles["worker"].count,
            entrypoint=os.fspath(config.python),
            args=("-u", "-m", "shardkit.cluster.engines.torchrun", "--worker", *entry),
            rdzv_handler=handler, monitor_interval=opts.monitor_interval, local_addr=local_addr,
            max_restarts=config.fault_tolerance.max_restarts if opts.max_restarts is None
            else opts.max_restarts)
        agent = ShardkitAgent(spec, monitor, log_dir=node_dir / "torchelastic",
                              shutdown_timeout=math.ceil(opts.grace), watch=watch, formation=formation)
        return ("failed" if agent.run().is_failed() else "succeeded"), None
    except SignalException as e:
        leave_open = True  # the other nodes may go on without this one
        return "interrupted", NodeInterrupted(int(e.sigval))
    except RendezvousClosedError as e:
        return "failed", JobError(
            f"job {config.name}, node {opts.node_rank}: the rendezvous was closed ({e}): another node ended "
            "the job (its workers failed more than max_restarts times, or it was stopped). Fix: see that "
            "node's log and summary")
    except RendezvousTimeoutError as e:
        if not formation.formed:  # torch's join got the time startup_timeout left; it left the round
            leave_open = True  # a node started again may still join the others
            return "failed", _never_formed(config, opts, formation)
        return "failed", _rendezvous_failed(config, opts, e)
    except (RendezvousError, DistError) as e:
        if watch is not None and watch.armed:  # the job had started: its store is gone
            leave_open = True  # nothing to close: the store does not answer
            if watch.lost is None:
                watch.lost = watch.message(f"failed ({type(e).__name__}: {_first_line(e)})")
                monitor.job_lost(watch.lost)
            return "failed", LostJobError(f"job {config.name}, node {opts.node_rank}: {watch.lost}")
        return "failed", _rendezvous_failed(config, opts, e)
    finally:
        if handler is not None and not leave_open:
            handler.shutdown()


def _never_formed(config: JobConfig, opts: TorchrunOptions, formation: Formation) -> JobError:
    return _NeverFormedError(f"job {config.name}, node {opts.node_rank}: {formation.message()}")


def _first_line(error: BaseException) -> str:
    """An error of torch's, and the one it was raised from, as one line: c10d's can carry a C++ stack
    trace after their first line, and torch's rendezvous errors say "see inner exception"."""

    def line(e: BaseException) -> str:
        text = str(e).strip()
        return text.splitlines()[0] if text else type(e).__name__

    cause = error.__cause__
    return one_line(line(error) + ("" if cause is None else f" ({type(cause).__name__}: {line(cause)})"))


def _rendezvous_failed(config: JobConfig, opts: TorchrunOptions, e: BaseException) -> JobError:
    return JobError(
        f"job {config.name}, node {opts.node_rank}: the rendezvous at {opts.rdzv_endpoint} failed "
        f"({type(e).__name__}: {_first_line(e)}). Fix: start node 0 (it hosts the rendezvous) at that "
        "address, check engine.rdzv_endpoint, rdzv_id and nnodes, and that the port is free there and "
        "reachable")


def _print(text: str, console: TextIO, hidden: Masker) -> None:
    with contextlib.suppress(OSError):  # the terminal is gone: the job goes on
        print(scrub(text, hidden), file=console, flush=True)


def _write_node_summary(result: JobResult, node_dir: Path) -> Path:
    path = node_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path
