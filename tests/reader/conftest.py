"""Reader test fixtures: a real S3-protocol server (moto) on loopback whose request log counts reads.

``s3_server`` (one per session) runs ``python -m moto.server`` in its own process group and logs every
request werkzeug serves (``"GET /bucket/key HTTP/1.1" 206``) to a file, so a test can count the remote
reads of a piece of code: ``m = s3_server.mark(); ...; s3_server.count_gets(r"/ds/part-", since=m)``.
``s3_bucket`` makes a fresh bucket per test and forbids connections to anything but loopback, so
nothing can reach real AWS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_REQUEST = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours non-200 lines even in a file


@dataclasses.dataclass
class S3Server:
    """A running moto S3 server: where it listens, the s3fs options for it, and its request log."""

    endpoint_url: str
    storage_options: dict[str, Any]
    log_path: Path
    process: subprocess.Popen[bytes]

    def mark(self) -> int:
        """A position in the request log; requests counted ``since`` it happened after this call."""
        self._sync()
        return self.log_path.stat().st_size

    def requests(self, since: int = 0) -> list[tuple[str, str, int]]:
        """(method, path with query, status) of every request logged after ``since``."""
        self._sync()
        with open(self.log_path, "rb") as f:
            f.seek(since)
            text = _ANSI.sub("", f.read().decode("utf-8", "replace"))
        return [(m["method"], m["path"], int(m["status"])) for m in _REQUEST.finditer(text)]

    def count_gets(self, pattern: str, since: int = 0) -> int:
        """GET requests since ``since`` whose path (with query) matches the regex ``pattern``."""
        return sum(1 for method, path, _ in self.requests(since)
                   if method == "GET" and re.search(pattern, path))

    def _sync(self) -> None:
        # werkzeug logs a request before sending its body, so every request a client has seen answered
        # is in the log once a later request of ours shows up there.
        probe = f"/shardkit-log-sync-{uuid.uuid4().hex}"
        _http_get(self.endpoint_url, probe)
        deadline = time.monotonic() + 10
        while probe.encode() not in self.log_path.read_bytes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto did not log {probe} within 10 s; see {self.log_path}")
            time.sleep(0.01)


def _http_get(endpoint_url: str, path: str, timeout: float = 5) -> int:
    host, port = endpoint_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)  # no proxy, unlike urllib
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            _http_get(url, "/", timeout=1)
            return proc, url
        time.sleep(0.1)
    _stop(proc)
    raise RuntimeError(f"moto server on port {port} did not answer: {log_path.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill the server's whole process group and check that nothing of it is left."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            break
    deadline = time.monotonic() + 5
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"moto server process group {proc.pid} leaked processes")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.05)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto S3 server on 127.0.0.1 for the session (see the module docstring)."""
    pytest.importorskip("moto.server", reason="needs moto[server]: pip install 'shardkit[dev]'")
    pytest.importorskip("s3fs", reason="needs s3fs: pip install 'shardkit[s3]'")
    log_path = tmp_path_factory.mktemp("moto") / "requests.log"
    with pytest.MonkeyPatch.context() as mp:
        # Credentials and region come from the storage options; nothing may be looked up elsewhere.
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("AWS_CONFIG_FILE", str(log_path.parent / "no-aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(log_path.parent / "no-aws-credentials"))
        for name in ("NO_PROXY", "no_proxy"):
            mp.setenv(name, ",".join(filter(None, [os.environ.get(name), "127.0.0.1", "localhost"])))
        proc, url = _start(log_path)
        try:
            client = {"endpoint_url": url, "region_name": "us-east-1"}
            yield S3Server(url, {"key": "x", "secret": "x", "client_kwargs": client}, log_path, proc)
        finally:
            _stop(proc)


@pytest.fixture
def no_internet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse any socket connection that is not to loopback (or a Unix socket) during the test."""
    connect = socket.socket.connect
    connect_ex = socket.socket.connect_ex

    def check(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = str(address[0])
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(host.split("%", maxsplit=1)[0]).is_loopback:
                    return
            if host != "localhost":
                raise OSError(f"test guard: connection to {address!r} refused; tests use loopback only")

    def guarded(sock: socket.socket, address: Any) -> None:
        check(sock, address)
        connect(sock, address)

    def guarded_ex(sock: socket.socket, address: Any) -> int:
        check(sock, address)
        return connect_ex(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_ex)


@pytest.fixture
def s3_bucket(s3_server: S3Server, no_internet: None) -> str:
    """The name of a fresh, empty bucket on ``s3_server``."""
    import s3fs

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**s3_server.storage_options).call_s3("create_bucket", Bucket=name)
    return name


def _children() -> set[int]:
    """Live descendants of this process (DataLoader workers), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.fixture
def reap() -> Iterator[None]:
    """Kill, by pid, any process the test started that is still alive at its end (a hung worker)."""
    before = _children()
    yield
    for pid in _children() - before:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
