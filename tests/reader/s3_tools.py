"""S3 test tools shared by the reader, dataset and checkpoint tests: storage options for the moto server,
a link to it that can go down (`Link`), and a moto server that checks credentials against IAM users
(`iam_server`). The moto server itself and its fixtures are in ``tests/reader/conftest.py``."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.reader import conftest as s3_fixtures

#: botocore's own retries off and short timeouts: a refused connection fails in well under a second
FAST = {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10}


def s3_options(endpoint_url: str, key: str | None = "x", secret: str | None = "x",
               **config: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"}}
    if key is not None:
        options.update(key=key, secret=secret)
    if config:
        options["config_kwargs"] = config
    return options


class Link:
    """``127.0.0.1:<port>`` forwarded to ``target``; `down` refuses new connections and cuts the open
    ones, `hang` takes connections and never answers, `up` forwards again on the same port."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self._target = (host, int(port))
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._hanging = False
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._serve()

    def _serve(self) -> None:
        self._spawn(self._accept, self._server)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:  # closed by down()
                return
            with self._lock:
                self._open.add(client)
            if self._hanging:
                continue  # held open, never read nor answered
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                self._close(client)
                continue
            with self._lock:
                self._open.add(upstream)
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:  # closed here, not only by _cut: a connection accepted as the link went down would be
            for s in (src, dst):  # left to the garbage collector, whose ResourceWarning fails a later test
                self._close(s)
                with self._lock:
                    self._open.discard(s)

    def _close(self, s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()

    def _cut(self) -> None:
        with self._lock:
            sockets, self._open = self._open, set()
        for s in sockets:
            self._close(s)

    def down(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accept() of _accept: a close alone would not, and
            self._server.shutdown(socket.SHUT_RDWR)  # the socket would take one more connection
        self._server.close()
        self._cut()

    def hang(self) -> None:
        self._hanging = True
        self._cut()

    def up(self) -> None:
        self._hanging = False
        if self._server.fileno() == -1:
            self._server = socket.create_server(("127.0.0.1", self.port))
            self._serve()

    def close(self) -> None:
        self.down()
        for thread in self._threads:
            thread.join(10)


@dataclass(frozen=True)
class IAMServer:
    """A moto server that checks credentials against its IAM users: ``keys[user]`` = (key, secret)."""

    endpoint_url: str
    bucket: str
    keys: dict[str, tuple[str, str]]

    def options(self, user: str) -> dict[str, Any]:
        """Storage options of ``user`` (an unknown user: a key the server does not know)."""
        return s3_options(self.endpoint_url, *self.keys.get(user, ("AKIANOSUCHKEY0000000", "nope")), **FAST)


def allow(*statements: tuple[list[str], str | list[str]]) -> str:
    """An IAM policy allowing each (actions, resources)."""
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": actions, "Resource": resource} for actions, resource in statements]})


@contextlib.contextmanager
def iam_server(log_dir: Path, policies: Callable[[str], Mapping[str, str | None]]) -> Iterator[IAMServer]:
    """A moto server of its own with a fresh bucket and the users ``policies(bucket)`` names (user ->
    its policy, None: no rights), each with an access key; every request is checked from then on."""
    import boto3

    proc, url = s3_fixtures._start(log_dir / "requests.log")
    try:
        bucket = f"iam-{uuid.uuid4().hex[:12]}"
        login = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": "x",
                 "aws_secret_access_key": "x"}
        boto3.client("s3", **login).create_bucket(Bucket=bucket)
        client, keys = boto3.client("iam", **login), {}
        for user, policy in policies(bucket).items():
            client.create_user(UserName=user)
            if policy is not None:
                client.put_user_policy(UserName=user, PolicyName="test", PolicyDocument=policy)
            key = client.create_access_key(UserName=user)["AccessKey"]
            keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/moto-api/reset-auth", body=b"0")  # from now on every request is checked
        assert conn.getresponse().status == 200
        conn.close()
        yield IAMServer(url, bucket, keys)
    finally:
        s3_fixtures._stop(proc)
