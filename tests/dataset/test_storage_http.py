"""Datasets read over HTTP from real servers on loopback: one that answers range requests (a threaded
``http.server`` that stops and starts again on its port) and ``python -m http.server`` (which does not).

A server that goes away mid-read must stop the read with an error that names the URL, never pass for
a corrupt file (which ``on_error="skip"`` skips: rows lost to a network blip), and the reader's state
must resume with no row lost or repeated.
"""

from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

import shardkit
from shardkit.errors import CorruptDatasetError, DatasetError, ShardkitError

ROWS, GROUP = 2000, 50


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """``http.server``'s file handler, with single ranges (``Range: bytes=a-b``) answered by 206."""

    _left: int | None = None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_head(self) -> Any:
        self._left = None
        asked = re.fullmatch(r"bytes=(\d+)-(\d*)", (self.headers.get("Range") or "").strip())
        path = self.translate_path(self.path)
        if asked is None or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start, end = int(asked[1]), min(int(asked[2]) if asked[2] else size - 1, size - 1)
        f = open(path, "rb")  # noqa: SIM115 - http.server closes what send_head returns
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self._left = end - start + 1
        return f

    def copyfile(self, source: IO[bytes], outputfile: Any) -> None:  # type: ignore[override]
        if self._left is None:
            super().copyfile(source, outputfile)
        else:
            outputfile.write(source.read(self._left))


class Server:
    """A range-answering HTTP server for ``root`` on a fixed loopback port: `down` closes it (new
    connections are refused; http.server's HTTP/1.0 keeps none open), `up` serves again."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.up()

    def up(self) -> None:
        handler = type("Handler", (RangeHandler,), {})
        self._httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", self.port), lambda *a: handler(*a, directory=os.fspath(self.root)))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def down(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Server]:
    """A dataset of `ROWS` rows in row groups of `GROUP` at ``<server.url>/ds``."""
    shardkit.write_dataset({"x": np.arange(ROWS)}, tmp_path / "ds", row_group_size=GROUP)
    server = Server(tmp_path)
    try:
        yield server
    finally:
        server.down()


def reader(url: str | shardkit.Dataset, **kw: Any) -> shardkit.Reader:
    return shardkit.make_reader(url, cache=None, shuffle=False, batch_size=GROUP, prefetch=2, workers=2, **kw)


def drain(batches: Iterator[dict[str, np.ndarray]], seen: list[int]) -> None:
    for batch in batches:
        seen.extend(batch["x"].tolist())


def read_all(url: str | shardkit.Dataset) -> int:
    with reader(url) as r:
        return sum(len(b["x"]) for b in r)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_server_that_goes_down_mid_read_stops_the_read_and_loses_nothing(served: Server, on_error: str
                                                                          ) -> None:
    """The connection refused mid-read was an OSError that the Parquet layer took for a truncated file:
    "the file is truncated or corrupt: rewrite the dataset", and with on_error="skip" the row groups were
    skipped as corrupt (their rows lost). Now: a `DatasetError` naming the file and URL and saying that
    nothing was skipped, and the reader's state resumes on the server back up with every row once."""
    url = f"{served.url}/ds"
    seen: list[int] = []
    first = reader(url, on_error=on_error)
    batches = iter(first)
    for _ in range(3):
        seen.extend(next(batches)["x"].tolist())
    served.down()
    with pytest.raises(DatasetError) as raised:
        drain(batches, seen)
    assert not isinstance(raised.value, CorruptDatasetError), raised.value
    message = str(raised.value)
    assert re.search(rf"cannot read '{url}/part-[^']+\.parquet' of '{url}': the server could not be "
                     "reached or stopped answering", message), message
    assert "Nothing was skipped: read again once this is fixed (a reader's state_dict() resumes" in message
    state = first.state_dict()
    first.close()

    served.up()
    with reader(url) as resumed:
        resumed.load_state_dict(state)
        rest = [x for batch in resumed for x in batch["x"].tolist()]
    assert sorted(seen + rest) == list(range(ROWS))


def test_a_server_without_range_requests_is_named_as_such(tmp_path: Path) -> None:
    """``python -m http.server`` answers a range request with the whole file: fsspec raised a ValueError
    about its own ``block_size=0`` from inside the reader; now the message says what the server lacks."""
    shardkit.write_dataset({"x": np.arange(ROWS)}, tmp_path / "ds", row_group_size=GROUP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", os.fspath(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/ds"
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert shardkit.open_dataset(url).num_rows == ROWS  # the summary is read whole: no range needed
        with pytest.raises(ShardkitError, match=rf"cannot read '{url}/part-.*of '{url}': the HTTP server "
                                                r"does not answer range requests .*python -m http.server"):
            read_all(url)
    finally:
        proc.terminate()
        proc.wait(10)


def test_unknown_storage_options_for_http_are_refused_and_its_own_are_taken(served: Server) -> None:
    """fsspec's HTTP passes the options its constructor does not name to every aiohttp request, whose
    ``TypeError`` its ``exists`` hid: "no dataset at ...: the path does not exist". aiohttp's request
    options (headers, timeouts) still open it."""
    url = f"{served.url}/ds"
    with pytest.raises(ShardkitError, match=rf"the storage option 'bogus' for '{url}' is not taken by "
                                            r"fsspec's HTTPFileSystem.*headers.*client_kwargs") as raised:
        shardkit.open_dataset(url, storage_options={"bogus": 1})
    assert isinstance(raised.value, ValueError)
    ds = shardkit.open_dataset(url, storage_options={"headers": {"X-Trace": "1"}, "block_size": 1 << 16})
    assert read_all(ds) == ROWS
