"""Secret values masked as ``***`` in what the roles print, before it reaches a log file or the console.

Where it is applied: a role's stdout and stderr go through a pipe to a `MaskedStream` before its log
file (the local engine's pump threads, `LocalEngine`; the Ray and Spark engines' node runners start
their process with the local engine; a torchrun worker's own tee, `redirect_output`), so every line
read from a log afterwards (the console echo, a failure's last lines in the summary and the job's
error) is masked already; the supervisor and the torchrun agent mask what they print once more
(`shardkit.cluster.monitor.report.scrub`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shardkit.errors import SecretTooShortWarning

__all__ = ["MASK", "MIN_SECRET_LENGTH", "MaskedStream", "Masker", "OutputPump", "job_masker",
           "redirect_output", "warn_short_secrets"]

#: What a secret's value becomes, as CI systems show it.
MASK = "***"
#: A shorter value is not masked: "abc" or "" would mask ordinary output everywhere.
MIN_SECRET_LENGTH = 4
_CHUNK = 64 << 10


def warn_short_secrets(values: Mapping[str, str]) -> None:
    """Warn (`SecretTooShortWarning`) for each secret too short to be masked, naming it, never its value."""
    for name, value in sorted(values.items()):
        if len(value) < MIN_SECRET_LENGTH:
            what = "empty" if not value else f"{len(value)} character(s) long"
            warnings.warn(SecretTooShortWarning(
                f"secrets.{name}: the value is {what}, shorter than {MIN_SECRET_LENGTH} characters, so it "
                "is not masked in the roles' output (masking it would mask ordinary text everywhere). Fix: "
                f"give {name} a real secret value, or move it to env: if it is not a secret"), stacklevel=2)


def _forms(value: str) -> set[str]:
    """``value`` as printed, and inside a JSON or Python string literal."""
    return {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1], repr(value)[1:-1]}


class Masker:
    """Replaces every secret value (of `MIN_SECRET_LENGTH` characters or more) by ``***``.

    Example:
        >>> Masker(["hunter22"]).text("password=hunter22")
        'password=***'

    Choices: the exact value (its UTF-8 bytes in a byte stream), as GitHub Actions and GitLab mask a
    secret, and the forms it takes inside a string that a structured log prints: JSON's (``\\"``,
    ``\\\\``, ``\\u00fc``, with and without ``ensure_ascii``) and Python's ``repr`` (a dict printed).
    Not base64, URL-quoted or other derived forms, which a script could produce in endless ways. Longer
    values are replaced first, so a secret that holds another is masked whole.
    """

    def __init__(self, values: Iterable[str]) -> None:
        forms = {form for v in values if len(v) >= MIN_SECRET_LENGTH for form in _forms(v)}
        self.values = sorted(forms, key=len, reverse=True)
        self._encoded = [v.encode("utf-8") for v in self.values]
        self._bytes = re.compile(b"|".join(re.escape(v) for v in self._encoded)) if self.values else None
        self._text = re.compile("|".join(re.escape(v) for v in self.values)) if self.values else None
        self.longest = len(self._encoded[0]) if self._encoded else 0

    def __bool__(self) -> bool:
        return bool(self.values)

    def text(self, text: str) -> str:
        """``text`` with every secret value replaced by ``***``."""
        return text if self._text is None else self._text.sub(MASK, text)

    def deep(self, value: Any) -> Any:
        """``value`` (JSON-able data) with every string in it masked: before ``json.dumps``, whose escapes
        (``\\"``, ``\\uXXXX``) would hide a value from `text`."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.deep(k): self.deep(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.deep(v) for v in value]
        return value

    def data(self, data: bytes) -> bytes:
        """``data`` with every secret value (UTF-8) replaced by ``b"***"``."""
        return data if self._bytes is None else self._bytes.sub(MASK.encode(), data)

    def held(self, data: bytes) -> int:
        """How many bytes at the end of ``data`` could be the start of a secret value (the longest such
        end), which a stream must hold back until the next bytes tell."""
        for size in range(min(self.longest - 1, len(data)), 0, -1):
            end = data[-size:]
            if any(v.startswith(end) for v in self._encoded):
                return size
        return 0

    def stream(self) -> MaskedStream:
        return MaskedStream(self)


class MaskedStream:
    """A byte stream masked as it comes: a secret split across two writes (or two reads of a pipe) is
    masked as one.

    Example:
        >>> stream = Masker(["hunter22"]).stream()
        >>> stream.feed(b"pass hun") + stream.feed(b"ter22\\n") + stream.flush()
        b'pass ***\\n'

    The bytes at the end that could begin a secret are held back until the next ones tell whether they
    do, never longer: a prefix written out and its rest later would put the whole value in the file. At
    the end of the stream (`flush`: the process was stopped midway through a secret, say) a held start of
    `MIN_SECRET_LENGTH` bytes or more is masked, a shorter one written as it is.
    """

    def __init__(self, masker: Masker) -> None:
        self.masker = masker
        self._rest = b""

    def feed(self, data: bytes) -> bytes:
        """What can be written of ``data`` now, masked."""
        if not self.masker:
            return data
        pending = self._rest + data
        masked = self.masker.data(pending)
        # the held end is looked for only after the last mask: masked text is final
        last = masked.rfind(MASK.encode())
        tail_from = last + len(MASK) if last >= 0 else 0
        keep = self.masker.held(masked[tail_from:])
        cut = len(masked) - keep
        self._rest = masked[cut:]
        return masked[:cut]

    def flush(self) -> bytes:
        """The bytes held back, at the end of the stream: as they are when shorter than
        `MIN_SECRET_LENGTH`, else ``***`` (the start of a secret whose writer was stopped midway)."""
        rest, self._rest = self._rest, b""
        return MASK.encode() if len(rest) >= MIN_SECRET_LENGTH else rest


class OutputPump:
    """Copies what a process writes into a pipe to its log file, masked (`MaskedStream`), in a thread.

    Example:
        >>> read_end, write_end = os.pipe()
        >>> pump = OutputPump(read_end, Path("worker-0.log"), masker)   # Popen(..., stdout=write_end)
        >>> pump.wait(0.5); pump.close()

    The log file is written as the bytes come (each read of the pipe, masked, at once), so a reader of
    the log (the echo, `tail`) sees the output as it would without masking, less the held-back bytes.
    """

    def __init__(self, read_fd: int, log_path: Path, masker: Masker) -> None:
        self.log_path = log_path
        self._fd = read_fd
        self._stream = masker.stream()
        self._log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardkit-output-{log_path.stem}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import selectors

        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self._fd, selectors.EVENT_READ)
                while True:
                    if not sel.select(0.2):
                        if self._stop.is_set():
                            break  # stopped, and nothing more came: something that escaped holds the pipe
                        continue
                    data = os.read(self._fd, _CHUNK)
                    if not data:
                        break
                    _write_all(self._log, self._stream.feed(data))
            _write_all(self._log, self._stream.flush())
        except OSError:  # the log's disk is full or gone: the process goes on, its output is dropped
            pass
        finally:
            for fd in (self._fd, self._log):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the end of the output (every writer gone); whether it came."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float = 2.0) -> None:
        """Copy what is left, then stop even if a process that escaped the group still holds the pipe."""
        self._stop.set()
        self._thread.join(timeout)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def job_masker(env: Mapping[str, str]) -> Masker:
    """The `Masker` of a role started with ``env``: its job's secrets are named in ``job.json``
    (``SHARDKIT_JOB_CONFIG``), their values are its environment's. Nothing to mask where either is
    missing."""
    from shardkit.job import protocol

    try:
        with open(env[protocol.ENV_JOB_CONFIG], encoding="utf-8") as f:
            names = json.load(f).get("secrets") or []
    except (KeyError, OSError, ValueError, AttributeError):
        return Masker([])
    return Masker(env[name] for name in names if isinstance(name, str) and name in env)


def redirect_output(log_path: Path, masker: Masker) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at ``log_path``, appending;
    with secrets to mask, through a pipe and a forked tee process that masks them on the way.

    Example (a torchrun worker, before it runs the training script):
        >>> redirect_output(worker_log(node_dir, attempt, rank), Masker(secret_values))

    Choices: a process, not a thread, so that what the process wrote before it died (SIGKILL, a crash)
    is still copied: the tee reads until every writer is gone. It starts its own session, so a signal
    to the process's group does not stop it before it has copied the rest; it ignores SIGINT, SIGTERM
    and SIGHUP and exits at the end of the stream.
    """
    if not masker:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for stream in (1, 2):
            os.dup2(fd, stream)
        os.close(fd)
        return
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the tee
        code = 0
        try:
            os.close(write_fd)
            os.setsid()
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            null = os.open(os.devnull, os.O_RDWR)
            for stream in (0, 1, 2):  # hold no end of the process's own streams open
                os.dup2(null, stream)
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            stream_ = masker.stream()
            while data := os.read(read_fd, _CHUNK):
                _write_all(log, stream_.feed(data))
            _write_all(log, stream_.flush())
        except BaseException:
            code = 1
        os._exit(code)
    os.close(read_fd)
    for stream in (1, 2):
        os.dup2(write_fd, stream)
    os.close(write_fd)
