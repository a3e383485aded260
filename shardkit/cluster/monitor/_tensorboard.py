"""A minimal TensorBoard event-file writer for scalars (no tensorflow or tensorboard import).

The format, for readers of this file: an event file is a sequence of TFRecords, each
``uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)`` (little endian),
where ``data`` is a serialized ``tensorflow.Event`` protobuf. The first event carries
``file_version = "brain.Event:2"``; each later one a ``Summary`` with ``Value(tag, simple_value)``.
The handful of protobuf fields needed are encoded by hand below.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from pathlib import Path
from types import TracebackType

__all__ = ["ScalarWriter", "crc32c", "masked_crc32c"]


def _make_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
        table.append(c)
    return table


_TABLE = _make_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``; ``crc32c(b"123456789") == 0xE3069283``."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The masked CRC TFRecord uses (so that CRCs of CRCs stay well distributed)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 values are encoded as their 64-bit two's complement
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    """``value`` as a little-endian float32; finite values beyond its range become +-inf (what a cast to
    float32 gives in numpy, C or torch), where ``struct`` would raise OverflowError."""
    try:
        return struct.pack("<f", value)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, value))


def _event(wall_time: float, step: int, *, file_version: str | None = None,
           scalars: dict[str, float] | None = None) -> bytes:
    data = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        data += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + _float32(value))
            for tag, value in scalars.items()
        )
        data += _bytes_field(5, values)
    return data


def _record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


class ScalarWriter:
    """Append scalars to a new TensorBoard event file in ``logdir``.

    Example:
        >>> with ScalarWriter("runs/digits-job/tensorboard") as tb:
        ...     tb.add_scalars({"loss": 0.3, "samples_per_s": 2100.0}, step=17)

    Choices: one file per writer (``events.out.tfevents.<time>.<host>.<pid>``, as TensorBoard names
    them), flushed after every call so a live TensorBoard sees progress; values that are not finite
    numbers are written as they are (TensorBoard shows NaN), finite values beyond float32's range
    (``exp(100)``, a diverging loss) as +-inf, since TensorBoard stores float32; non-numbers are skipped.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.logdir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for the writer's lifetime
        self._file.write(_record(_event(now, 0, file_version="brain.Event:2")))
        self._file.flush()

    def add_scalars(self, scalars: dict[str, object], step: int, wall_time: float | None = None) -> None:
        """Write one event with every numeric value of ``scalars`` (tag -> value) at ``step``."""
        numeric = {tag: float(v) for tag, v in scalars.items()  # type: ignore[arg-type]
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        if not numeric or self._file.closed:
            return
        self._file.write(_record(_event(time.time() if wall_time is None else wall_time, step,
                                        scalars=numeric)))
        self._file.flush()

    def add_scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        """Write one scalar (see `add_scalars`)."""
        self.add_scalars({tag: value}, step, wall_time)

    def close(self) -> None:
        """Close the file (later writes are ignored)."""
        self._file.close()

    def __enter__(self) -> ScalarWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
