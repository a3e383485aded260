"""A relay on loopback that makes a local object store as far away as a real one: each HTTP response is
held back ``delay`` seconds from its request, as a store 2 x ``delay`` of round trip away would answer
(the bandwidth is the server's own).

Example:
    >>> with Relay("http://127.0.0.1:5000", delay=0.05) as relay:      # in this process (tests)
    ...     fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": relay.url}, ...)
    $ python -m benchmarks.relay --target http://127.0.0.1:5000 --delay 0.05 --port-file port.txt

It also counts what passed (`stats`): each request's method, path and ``Range``, and the most bytes
asked for in ranged GETs whose responses had not ended yet (``max_outstanding``), which is what a
reader's budget of bytes in flight bounds. `stall` makes it stop forwarding responses after some
more bytes, as a server that hangs mid-read.

HTTP/1.1 with keep-alive and no pipelining (botocore's, aiohttp's): a connection carries one request
at a time, so a response begins after the request before it. Bodies are counted by their
``Content-Length`` (chunked responses are forwarded, not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Relay", "RelayStats"]

_RANGE = re.compile(rb"\r\nrange:\s*bytes=(\d+)-(\d+)", re.I)
_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.I)


@dataclass
class RelayStats:
    """What passed the relay (all connections)."""

    requests: list[tuple[str, str, tuple[int, int] | None]] = field(default_factory=list)
    outstanding: int = 0  # bytes of ranged GETs whose responses have not ended
    max_outstanding: int = 0
    bytes_out: int = 0  # response bytes forwarded

    def ranges(self, path_part: str = "") -> list[tuple[int, int]]:
        """(start, end exclusive) of every ranged request whose path holds ``path_part``."""
        return [(r[0], r[1] + 1) for _, p, r in self.requests if r is not None and path_part in p]


class Relay:
    """``url`` forwards to ``target`` with each response ``delay`` seconds after its request; runs its
    own event loop in a thread (`close` ends it, and every connection)."""

    def __init__(self, target: str, delay: float = 0.0, *, port: int = 0) -> None:
        host, _, target_port = target.removeprefix("http://").rpartition(":")
        self._target = (host, int(target_port))
        self.delay = delay
        self.stats = RelayStats()
        self._lock = threading.Lock()
        self._stall_after: int | None = None
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(port,), daemon=True, name="relay")
        self._thread.start()
        self._started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    # -- control ------------------------------------------------------------------------------------
    def reset(self) -> None:
        with self._lock:
            self.stats = RelayStats()

    def stall(self, after_bytes: int = 0) -> None:
        """Forward ``after_bytes`` more response bytes, then nothing (connections stay open)."""
        with self._lock:
            self._stall_after = self.stats.bytes_out + after_bytes

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._shutdown)
        self._thread.join(10)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop -----------------------------------------------------------------------------------
    def _run(self, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", port))
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._tasks: set[asyncio.Task[None]] = set()
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _shutdown(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        self._loop.call_later(0.05, self._loop.stop)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        asked: asyncio.Queue[tuple[float, int, bytes]] = asyncio.Queue()  # (time, range bytes, method)
        try:
            await asyncio.gather(self._requests(reader, up_writer, asked),
                                 self._responses(up_reader, writer, asked))
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
            self._tasks.discard(task)

    async def _requests(self, reader: asyncio.StreamReader, up: asyncio.StreamWriter,
                        asked: asyncio.Queue[tuple[float, int, bytes]]) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            now = time.monotonic()
            method, path = head.split(b" ", 2)[:2]
            m = _RANGE.search(head)
            span = (int(m[1]), int(m[2])) if m else None
            nbytes = span[1] - span[0] + 1 if span and method == b"GET" else 0
            with self._lock:
                self.stats.requests.append((method.decode(), path.decode(), span))
                self.stats.outstanding += nbytes
                self.stats.max_outstanding = max(self.stats.max_outstanding, self.stats.outstanding)
            length = _LENGTH.search(head)
            body = await reader.readexactly(int(length[1])) if length else b""
            await asked.put((now, nbytes, method))
            up.write(head + body)
            await up.drain()

    async def _responses(self, up: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         asked: asyncio.Queue[tuple[float, int, bytes]]) -> None:
        while True:
            head = await up.readuntil(b"\r\n\r\n")
            sent_at, nbytes, method = await asked.get()
            wait = sent_at + self.delay - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._forward(writer, head)
            length = _LENGTH.search(head)
            status = head.split(b" ", 2)[1]
            bodiless = method == b"HEAD" or status in (b"204", b"304") or status.startswith(b"1")
            left = int(length[1]) if length and not bodiless else 0
            while left > 0:
                data = await up.read(min(left, 1 << 16))
                if not data:
                    raise asyncio.IncompleteReadError(b"", left)
                left -= len(data)
                await self._forward(writer, data)
            with self._lock:
                self.stats.outstanding -= nbytes

    async def _forward(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        with self._lock:
            stall = self._stall_after
            if stall is not None:
                data = data[:max(0, stall - self.stats.bytes_out)]
            self.stats.bytes_out += len(data)
        if data:
            writer.write(data)
            await writer.drain()
        if stall is not None and self.stats.bytes_out >= stall:
            await asyncio.Event().wait()  # stalled: this connection never moves again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="http://HOST:PORT of the server")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each response is held back")
    parser.add_argument("--port-file", type=Path, help="write the relay's port here once it listens")
    args = parser.parse_args()
    relay = Relay(args.target, args.delay)
    if args.port_file is not None:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(relay.port))
        tmp.replace(args.port_file)
    with contextlib.suppress(KeyboardInterrupt):
        relay._thread.join()


if __name__ == "__main__":
    main()
