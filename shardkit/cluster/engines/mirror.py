"""The trainer's side of roles on a cluster engine (ray, spark): mirrors of the processes, engine options."""

from __future__ import annotations

import collections
import contextlib
import difflib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardkit.cluster._spec import ClusterSpec, ProcessSpec
from shardkit.cluster.engines._remote import Update
from shardkit.errors import ConfigError
from shardkit.job import protocol as p

__all__ = ["MirrorGroup", "MirrorProcess", "Options", "describe_error", "is_local", "job_settings"]

_TAIL_LINES = 200
# What a process's node sets as it starts it (`shardkit.cluster.engines._remote.place`): until then not known
_PLACED = (p.MASTER_ADDR, p.MASTER_PORT, p.LOCAL_RANK, p.LOCAL_WORLD_SIZE, p.TF_CONFIG)
_NOT_YET = "<set on its node as it starts>"


class MirrorProcess:
    """The trainer's view of a process on a node: the `RoleProcess` the supervisor watches.

    Output lines arrive with the runner's updates; they are appended to ``log_path`` here (the node's
    own log is temporary) and the last lines are kept for `tail`.
    """

    def __init__(self, spec: ProcessSpec, log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        self.started = time.monotonic()
        self.pid = 0
        self.host = ""
        self.reported = False
        self.lost_reason: str | None = None  # `MirrorGroup.lost`: gone without a last report
        self._returncode: int | None = None
        self._lock = threading.Lock()
        self._new: list[str] = []
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - open while the process lives

    role = property(lambda self: self.spec.role)
    index = property(lambda self: self.spec.index)
    name = property(lambda self: self.spec.name)

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def tail(self, lines: int = 20) -> list[str]:
        with self._lock:
            return list(self._tail)[-lines:]

    def add(self, lines: Sequence[str]) -> None:
        with self._lock:
            if not self._log.closed:
                self._log.writelines(line + "\n" for line in lines)
                self._log.flush()
            self._new.extend(lines)
            self._tail.extend(lines)

    def take(self) -> list[str]:
        with self._lock:
            new, self._new = self._new, []
            return new

    def exited(self, code: int) -> None:
        if self._returncode is None:
            self._returncode = code

    def close(self) -> None:
        with self._lock:
            self._log.close()

    def __repr__(self) -> str:
        return f"MirrorProcess({self.name}, host={self.host!r}, pid={self.pid}, returncode={self.returncode})"


class MirrorGroup:
    """What the supervisor sees of one attempt on a cluster engine; engines add starting and `stop`.

    `feed` hands on a runner's update: heartbeats first (to the trainer's UDP socket), then output,
    then the exit, the order the supervisor relies on (a process's heartbeats arrive before its exit).

    ``processes.json`` beside the logs (the supervisor writes it from the spec, built for one machine)
    gets each process's environment as its node started it (the runner's first update: the addresses
    and ports its node placed, `shardkit.cluster.engines._remote.place`) and the node's ``host``; until
    then, the variables the node sets read ``<set on its node as it starts>``.
    """

    def __init__(self, processes: list[MirrorProcess], heartbeat_addr: str | None) -> None:
        self.processes = processes
        self._to = p.parse_addr(heartbeat_addr) if heartbeat_addr else None
        self._sock = socket.socket(socket.AF_INET6 if self._to and ":" in self._to[0] else socket.AF_INET,
                                   socket.SOCK_DGRAM)
        self._record_lock = threading.Lock()
        self._record({proc.name: None for proc in processes})

    def _record(self, envs: Mapping[str, Mapping[str, str] | None]) -> None:
        """Write each named process's environment into ``processes.json``; None: not started yet."""
        if not self.processes:
            return
        path = self.processes[0].log_path.parent / "processes.json"
        with self._record_lock:
            try:
                entries = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):  # the engine started without a supervisor: nothing to correct
                return
            by_name = {proc.name: proc for proc in self.processes}
            for entry in entries:
                name = entry.get("name")
                if name not in envs:
                    continue
                env = envs[name]
                if env is None:
                    entry["env"] = {k: _NOT_YET if k in _PLACED else v for k, v in entry["env"].items()}
                else:
                    entry["env"] = dict(env)
                    if by_name[name].host:
                        entry["host"] = by_name[name].host
            with contextlib.suppress(OSError):
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(json.dumps(entries, indent=2), encoding="utf-8")
                os.replace(tmp, path)

    def feed(self, i: int, update: Update) -> None:
        proc = self.processes[i]
        if update.pid:
            proc.pid = update.pid
        if update.env is not None:
            self._record({proc.name: update.env})
        if self._to is not None:
            for beat in update.beats:
                with contextlib.suppress(OSError):  # a full buffer drops a heartbeat, as on the local engine
                    self._sock.sendto(beat.encode("utf-8"), self._to)
        if update.lines:
            proc.add(update.lines)
        if update.returncode is not None:
            proc.exited(update.returncode)

    def lost(self, i: int, why: str, code: int = -signal.SIGKILL) -> None:
        """Process ``i`` is gone without a last report (its actor or task died, its node unreachable):
        say why, in its log, and in short (``why`` up to its first colon) as its `lost_reason`: what the
        supervisor says of its end instead of ``code``, which stands for an exit status it lacks."""
        proc = self.processes[i]
        if proc.returncode is None:
            proc.add([f"[shardkit] {why}"])
            proc.lost_reason = f"lost: {why.split(': ', 1)[0]}"
            proc.exited(code)

    def poll(self) -> list[MirrorProcess]:
        exited = [proc for proc in self.processes if not proc.reported and proc.returncode is not None]
        for proc in exited:
            proc.reported = True
        return exited

    def output(self) -> Iterator[tuple[MirrorProcess, str]]:
        for proc in self.processes:
            for line in proc.take():
                yield proc, line

    def final_output(self) -> Iterator[tuple[MirrorProcess, str]]:
        """The lines that came with the last reports, after `stop`."""
        yield from self.output()

    def close(self) -> None:
        self._sock.close()
        for proc in self.processes:
            proc.close()


def describe_error(error: BaseException) -> str:
    """An engine's exception in one line, for a process's log."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:500]}" if text else type(error).__name__


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine (a loopback address or one of this host's names)."""
    if host.startswith("127.") or host in ("::1", "localhost"):
        return True
    try:
        names = {socket.gethostname(), socket.getfqdn(), *socket.gethostbyname_ex(socket.gethostname())[2]}
    except OSError:
        return False
    return host in names


class Options:
    """An engine's options (the config's ``engine:`` entry), checked one by one as the engine reads them.

    Example:
        >>> opts = Options("ray", {"address": "auto"}, ("address", "grace"))
        >>> opts.text("address"), opts.number("grace", 5.0)
    """

    def __init__(self, engine: str, options: Mapping[str, Any] | None, allowed: Sequence[str]) -> None:
        self.engine, self.values, self.allowed = engine, dict(options or {}), tuple(allowed)
        for key in self.values:
            if key not in self.allowed:
                close = difflib.get_close_matches(str(key), self.allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self._error(key, f"the {engine} engine has no option {key!r}",
                                  f"{hint}remove it, or use one of: {', '.join(self.allowed)}")

    def _error(self, key: str, what: str, fix: str) -> ConfigError:
        """As the config's own problems read: the file, the key's line (or ``--set``), the value, the fix
        (`shardkit.job.config.messages.located`)."""
        from shardkit.job.config.messages import option_error  # it imports the engines' config models

        return option_error([(("engine", key), self.values[key], what, fix)])

    def _bad(self, key: str, what: str, example: str) -> ConfigError:
        return self._error(key, what, example)

    def number(self, key: str, default: float | None, *, minimum: float = 0.0) -> float | None:
        value = self.values.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
            raise self._bad(key, f"not a number >= {minimum:g}", f"e.g. {key}: {default or 1}")
        return float(value)

    def text(self, key: str, example: str) -> str | None:
        value = self.values.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise self._bad(key, "not a non-empty string", f"e.g. {key}: {example}")
        return value

    def mapping(self, key: str, example: str) -> dict[str, Any]:
        value = self.values.get(key) or {}
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise self._bad(key, "not a mapping of names to values", f"e.g. {key}: {example}")
        return dict(value)


def job_settings(spec: ClusterSpec) -> tuple[dict[str, dict[str, Any]], float]:
    """Each role's ``resources`` and the job's ``startup_timeout``, from the ``job.json`` the supervisor
    wrote before starting the attempt (the `ClusterSpec` holds neither); defaults when it is missing."""
    try:
        data = json.loads((spec.job_dir / p.JOB_CONFIG_FILE).read_text(encoding="utf-8"))
        resources = {str(role): dict(conf.get("resources") or {}) for role, conf in data["roles"].items()}
        timeout = float(data.get("fault_tolerance", {}).get("startup_timeout", 120.0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, 120.0
    return resources, timeout
