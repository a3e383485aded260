"""The ``local`` engine: every process of the job on this machine, each in its own process group."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from shardkit.cluster._spec import ClusterSpec, ProcessSpec
from shardkit.cluster.monitor.output import LineSplitter
from shardkit.cluster.monitor.watcher import GroupWatcher
from shardkit.job import protocol
from shardkit.job.masking import Masker, OutputPump

__all__ = ["LocalEngine", "LocalGroup", "LocalProcess", "group_members"]

DEFAULT_GRACE = 5.0
_PR_SET_PDEATHSIG = 1
_TAIL_BYTES = 64 << 10
_PUMP_WAIT = 0.5  # seconds an exit waits for the process's last output to reach the log


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    except OSError:
        return None


_LIBC = _libc()  # loaded here, not in the forked child (where loading could take a lock)
# Linux: an exit can be seen without reaping the process (waitid's WNOWAIT); elsewhere Popen.poll reaps.
_PEEK = sys.platform.startswith("linux") and hasattr(os, "waitid")


def _exit_code(pid: int, *, block: bool) -> int | None:
    """The exit code of child ``pid`` (``-signal`` when a signal ended it), None while it runs, without
    reaping it: the zombie keeps its pid, and so its process group's id, from being reused."""
    flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
    info = os.waitid(os.P_PID, pid, flags)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class LocalProcess:
    """One role process: its `subprocess.Popen`, log file and the part of the log already echoed.

    Its exit is seen without reaping it (Linux): it stays a zombie until `LocalGroup.stop` has
    signalled its process group for the last time, so that the group's id cannot meanwhile be given
    to an unrelated process, which a ``killpg`` would then hit. ``returncode`` is the same before
    and after the reaping (``popen.returncode`` once reaped).
    """

    def __init__(self, spec: ProcessSpec, popen: subprocess.Popen[bytes], log_path: Path,
                 started: float, pump: OutputPump | None = None) -> None:
        self.spec, self.popen, self.log_path, self.started = spec, popen, log_path, started
        self.pump = pump  # copies its output to the log, secrets masked (None: it writes the log itself)
        self.reported = False
        self.lost_reason: str | None = None  # a local process always has its exit status
        self._exit: int | None = None
        self._reader: IO[bytes] | None = None
        self._lines = LineSplitter()
        self._closed = False

    role = property(lambda self: self.spec.role)
    index = property(lambda self: self.spec.index)
    name = property(lambda self: self.spec.name)
    pid = property(lambda self: self.popen.pid)

    @property
    def returncode(self) -> int | None:
        if self.popen.returncode is not None:
            return self.popen.returncode
        if self._exit is None:
            self._exit = self._peek(block=False)
            if self._exit is not None and self.pump is not None:
                # what it wrote last is in the log before its exit is reported (a failure's last lines),
                # unless something it started still holds its output open
                self.pump.wait(_PUMP_WAIT)
        return self._exit

    def _peek(self, *, block: bool) -> int | None:
        if not _PEEK:
            return self.popen.wait() if block else self.popen.poll()
        try:
            return _exit_code(self.popen.pid, block=block)
        except ChildProcessError:  # reaped by someone else (SIGCHLD ignored, os.wait): Popen says what
            return self.popen.wait() if block else self.popen.poll()

    def wait_exit(self) -> int:
        """Wait for the exit, still without reaping (see the class docstring)."""
        while self._exit is None and self.popen.returncode is None:
            self._exit = self._peek(block=True)
        return self.returncode  # type: ignore[return-value]

    def reap(self) -> None:
        """Reap the exited process (its group's id is free again afterwards)."""
        self.popen.wait()

    def tail(self, lines: int = 20) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
                data = f.read()
        except OSError:
            return []
        return data.decode("utf-8", "replace").splitlines()[-lines:]

    def new_lines(self, final: bool = False) -> list[str]:
        """Lines appended to the log since the last call (``final``: the unterminated rest too), as
        `shardkit.cluster.monitor.output.LineSplitter` shows them (``\\r`` progress bars, long lines)."""
        if self._closed:
            return []
        if self._reader is None:
            try:
                self._reader = open(self.log_path, "rb")  # noqa: SIM115 - kept open while the job runs
            except OSError:
                return []
        lines = self._lines.feed(self._reader.read(), final)
        if final:
            self._reader.close()
            self._closed = True
        return lines

    def __repr__(self) -> str:
        return f"LocalProcess({self.name}, pid={self.pid}, returncode={self.returncode})"


def _child_setup(parent: int) -> Any:
    """Run in the forked child before exec: die with the trainer, even when it is SIGKILLed."""

    def setup() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the trainer died before prctl took effect
            os._exit(1)

    return setup


class LocalGroup:
    """The processes of one attempt on this machine (see `LocalEngine`), and their `GroupWatcher`."""

    def __init__(self, processes: list[LocalProcess], grace: float,
                 watcher: GroupWatcher | None = None) -> None:
        self.processes = processes
        self.grace = grace
        self.watcher = watcher
        self._stopped = False
        self._rest: list[tuple[LocalProcess, str]] = []  # output read when the group stopped

    def poll(self) -> list[LocalProcess]:
        exited = [p for p in self.processes if not p.reported and p.returncode is not None]
        for p in exited:
            p.reported = True
        return exited

    def output(self) -> Iterator[tuple[LocalProcess, str]]:
        for p in self.processes:
            for line in p.new_lines():
                yield p, line

    def final_output(self) -> Iterator[tuple[LocalProcess, str]]:
        """What was left of the output (the unterminated last line too) when the group stopped."""
        rest, self._rest = self._rest, []
        yield from rest

    def _signal(self, sig: signal.Signals) -> None:
        # Each process leads its own group; signalling the group also reaches what it started
        # (DataLoader workers, TensorFlow servers), even after the leader itself has exited: an exited
        # leader is not reaped before `stop` ends (see LocalProcess), so the group id is still its own.
        for p in self.processes:
            if p.popen.returncode is not None:  # reaped: the id may belong to another process by now
                continue
            try:
                os.killpg(p.popen.pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:  # pragma: no cover - only if reaped by someone else and reused
                pass

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds, wait for all,
        then reap. A second call does nothing.

        SIGCONT follows the SIGTERM (as a shell's ``kill`` does for a stopped job): a process stopped by
        a signal (SIGSTOP, SIGTSTP) gets a SIGTERM only once it runs again, and would otherwise wait out
        the whole grace period for its SIGKILL. A running process is not affected (SIGCONT's default
        action); one held by a debugger (ptrace) is not resumed by it and gets the SIGKILL.

        A KeyboardInterrupt while waiting (a second Ctrl-C or SIGTERM) skips the rest of the grace
        period; the first one is raised again, as it was (with the signal it came from), once every
        process is gone.
        """
        if self._stopped:
            return
        grace = self.grace if grace is None else grace
        interrupt: KeyboardInterrupt | None = None
        try:
            self._signal(signal.SIGTERM)
            self._signal(signal.SIGCONT)
            deadline = time.monotonic() + grace
            while any(p.returncode is None for p in self.processes) and time.monotonic() < deadline:
                time.sleep(0.02)
        except KeyboardInterrupt as e:
            interrupt = e
        while True:
            try:
                self._signal(signal.SIGKILL)
                for p in self.processes:
                    p.wait_exit()
                self._reap_groups()
                self._release()
                for p in self.processes:
                    if p.pump is not None:
                        p.pump.close()
                self._rest += [(p, line) for p in self.processes for line in p.new_lines(final=True)]
                break
            except KeyboardInterrupt as e:
                interrupt = interrupt or e
        self._stopped = True
        if interrupt is not None:
            raise interrupt

    def _reap_groups(self, timeout: float = 2.0) -> None:
        """Wait until no live member of any group is left (its grandchildren are reaped by init)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(group_members(p.popen.pid) for p in self.processes
                                                  if p.popen.returncode is None):
            self._signal(signal.SIGKILL)
            time.sleep(0.02)

    def _release(self) -> None:
        """Every group is empty and every leader a zombie: tell the watcher, then reap, then end it."""
        for p in self.processes:
            if p.popen.returncode is None:
                if self.watcher is not None:
                    self.watcher.gone(p.popen.pid)  # before the reaping that frees the id
                p.reap()
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid`` (Linux ``/proc``; elsewhere a
    probe with signal 0 that cannot tell zombies apart)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except OSError:
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")"
        fields = stat[stat.rindex(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


class LocalEngine:
    """Starts each process of a job as its own process group on this machine.

    Example:
        >>> group = LocalEngine({}).start(build_spec(config, heartbeat_addr=addr), log_dir=Path("logs"))
        >>> group.stop()

    Choices: each process gets a new session (``start_new_session``), so a Ctrl-C in the terminal
    reaches only the trainer, which then stops every group itself; and on Linux a parent-death signal
    (SIGKILL), so that even a SIGKILLed trainer leaves no role running. What a role starts gets no
    parent-death signal: for that, each group of processes has a `GroupWatcher`, a small process
    outside the trainer's session that stops the groups still running when the trainer dies without
    stopping them (SIGKILL: SIGTERM, then SIGKILL after ``grace``). stdout and stderr go to one
    file per process, ``<log_dir>/<role>-<index>.log``: straight, or, when the process has secrets (of 4
    characters or more), through a pipe and a thread of the trainer that masks their values as ``***``
    on the way (`shardkit.job.masking.OutputPump`), so that no value reaches the file. The
    environment is the trainer's, without any variable the trainer sets itself (``RANK``,
    ``TF_CONFIG``, ...: from an enclosing job they would mislead the roles), plus the spec's.
    Options: ``grace`` (seconds between SIGTERM and SIGKILL when stopping, default 5).

    Why not torch's elastic agent: it starts only torch workers (no TensorFlow, no parameter servers),
    it knows exits but not hangs, and its restarts reuse a rendezvous store that often hung restarted
    gloo workers (ENGINES.md). Each attempt here gets fresh ports instead, and torch's own ``env://``
    rendezvous.
    """

    name = "local"
    runs_here = True  # the roles run on this machine: the supervisor checks a local data.url and GPUs first

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        from shardkit.job.config.messages import option_error  # it imports the config models

        options = dict(options or {})
        grace = options.pop("grace", DEFAULT_GRACE)
        if isinstance(grace, bool) or not isinstance(grace, int | float) or grace < 0:
            raise option_error([(("engine", "grace"), grace, "not a number >= 0 of seconds between SIGTERM "
                                 "and SIGKILL when stopping a process", "e.g. grace: 5")])
        if options:
            raise option_error([(("engine", str(key)), value, "not an option of the local engine",
                                 "remove it (the local engine takes: grace)")
                                for key, value in options.items()])
        self.grace = float(grace)

    def start(self, spec: ClusterSpec, *, log_dir: Path) -> LocalGroup:
        """Start every process of ``spec`` in order; if one cannot start, stop those already started."""
        log_dir.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if k not in protocol.ALL_ENV}
        processes: list[LocalProcess] = []
        group = LocalGroup(processes, self.grace, GroupWatcher(grace=self.grace))
        try:
            for proc in spec.processes:
                log_path = log_dir / f"{proc.name}.log"
                masker = Masker(proc.env[name] for name in proc.secret_names if name in proc.env)
                pump: OutputPump | None = None
                if masker:  # through a pipe and a pump that masks the secrets, to the log
                    read_fd, write_fd = os.pipe()
                    pump = OutputPump(read_fd, log_path, masker)
                    try:
                        popen = self._popen(proc, base, write_fd)
                    finally:  # the child holds its own copy: the pump ends with the child (or at once)
                        os.close(write_fd)
                else:
                    with open(log_path, "wb") as log:
                        popen = self._popen(proc, base, log.fileno())
                processes.append(LocalProcess(proc, popen, log_path, time.monotonic(), pump))
                if group.watcher is not None:
                    group.watcher.started(popen.pid)
        except BaseException:
            group.stop(0)
            raise
        return group

    @staticmethod
    def _popen(proc: ProcessSpec, base: Mapping[str, str], out: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            proc.argv, env={**base, **proc.env}, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            preexec_fn=_child_setup(os.getpid()),  # noqa: PLW1509 - no lock is taken in it
        )
