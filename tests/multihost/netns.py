"""Several hosts on one machine: Linux network namespaces joined by a bridge, for the multi-host tests.

Each `Host` is a network namespace with its own interface and address on a private /24; the hosts
are joined by a bridge that lives in a namespace of its own (the "switch"), so nothing of the machine's
own network is touched or reachable: a process started on a host (`Host.popen`) sees only that host's
loopback and the other hosts' addresses. The filesystem is shared, as an NFS home would be.

The host name resolves to 127.0.0.1 in every namespace (as it does on many Debian hosts and in
containers): the tests run in exactly the setting where a process that advertises "its" address from
the host name advertises loopback.

Everything made here is removed by `Network.close` (the context manager's exit), also when a test
fails: the processes in each namespace are killed, then the namespaces (and with them their links).
Namespaces are named ``skmh<pid>-...``: a run that was killed before its cleanup leaves namespaces that
the next `Network` removes (their creator's pid is gone).

Needs root (CI runs as root on this machine kind); without it `Network` fails naming what it needs.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "skmh"
SUBNET = "10.77.0"  # a private /24 that exists only inside the namespaces a Network makes


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _kill_namespace(ns: str) -> None:
    for _ in range(50):
        pids = _ns_pids(ns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    _ip("netns", "delete", ns, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone; returns their names."""
    removed = []
    for ns in _namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-.*", ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_namespace(ns)
            removed.append(ns)
    return removed


@dataclass
class Host:
    """One host: a network namespace with one interface (``ifname``) holding ``addr``/24."""

    name: str
    ns: str
    addr: str
    ifname: str
    _switch: str
    _switch_port: str
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, clean_env: bool = False,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host in a session of its own (`Network.close` kills it). ``env`` adds to
        this process's environment, or with ``clean_env`` is the whole of it (what this test process
        holds, a local Spark session's ``SPARK_LOCAL_IP=127.0.0.1`` say, is then left out)."""
        full = dict(env or {}) if clean_env else {**os.environ, **(env or {})}
        proc = subprocess.Popen(self.argv(argv), env=full, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to its end (killed with its session after ``timeout`` s); output is
        captured as text."""
        proc = self.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(argv)} on {self.name} ran past {timeout} s\n"
                                 f"stdout: {out}\nstderr: {err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def cut(self) -> None:
        """Partition this host: its link goes down on the switch's side (no RST, no FIN: silence)."""
        _ip("-n", self._switch, "link", "set", self._switch_port, "down")

    def heal(self) -> None:
        _ip("-n", self._switch, "link", "set", self._switch_port, "up")

    def kill_all(self) -> None:
        """SIGKILL every process in this host's namespace (a machine that lost power)."""
        for pid in _ns_pids(self.ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def pids(self) -> list[int]:
        return _ns_pids(self.ns)


def kill_session(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


class Network:
    """``count`` hosts ``h0, h1, ...`` at 10.77.0.1, .2, ... joined by a bridge; a context manager.

    Example::

        with Network(2) as net:
            a, b = net.hosts
            server = b.popen([sys.executable, "-m", "http.server", "-b", b.addr, "8000"])
            a.run(["curl", f"http://{b.addr}:8000/"], timeout=10)
    """

    def __init__(self, count: int = 2) -> None:
        if os.geteuid() != 0:
            raise PermissionError("the multi-host tests make network namespaces (`ip netns add`), which "
                                  "needs root: run them as root (CI does), or deselect -m 'not multihost'")
        remove_stale()
        tag = f"{PREFIX}{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.switch = f"{tag}-sw"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        try:
            self._make(tag, count)
        except BaseException:
            self.close()
            raise

    def _make(self, tag: str, count: int) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(count):
            ns = f"{tag}-h{i}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            # a different interface name on every host: one GLOO_SOCKET_IFNAME for all cannot fit them
            ifname, port = f"sk{i}net", f"port{i}"
            _ip("link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", port, "netns",
                self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            addr = f"{SUBNET}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts.append(Host(f"h{i}", ns, addr, ifname, self.switch, port))
        # the links are up once both ends of every veth say so (the bridge forwards at once: no STP)
        deadline = time.monotonic() + 10
        for host in self.hosts:
            while not all("state UP" in _ip(*where, "link", "show", name, check=False).stdout
                          for where, name in ((("-n", host.ns), host.ifname),
                                              (("-n", self.switch), host._switch_port))):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{host.name}'s link is not up 10 s after the network was made")
                time.sleep(0.05)

    def close(self) -> None:
        for host in self.hosts:
            for proc in host._procs:
                kill_session(proc)
        for ns in reversed(self._made):
            _kill_namespace(ns)
        for host in self.hosts:
            for proc in host._procs:
                with contextlib.suppress(Exception):
                    proc.wait(timeout=5)
        self._made.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def leftover() -> list[str]:
        """This process's namespaces that still exist (a test asserts none after `close`)."""
        return [ns for ns in _namespaces() if ns.startswith(f"{PREFIX}{os.getpid()}-")]


@contextlib.contextmanager
def network(count: int = 2) -> Iterator[Network]:
    with Network(count) as net:
        yield net
