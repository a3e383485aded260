"""TFRecord framing, the container of TensorBoard's event files: each record is its length, the masked
CRC-32C of the length, the bytes, and their masked CRC-32C (all little-endian).

Written here, in a few lines, because the writers that come with TensorBoard reach TensorFlow:
``EventFileWriter`` opens its file through ``tensorboard.compat.tf``, which imports TensorFlow wherever it
is installed (seconds of a job's start, and TensorFlow's log lines on its console), and
``RecordWriter``'s CRC lives in TensorBoard's TensorFlow stand-in, which imports numpy and some 500
modules. The records' contents are TensorBoard's own ``Event`` messages (`shardkit.cluster.monitor.
progress.ScalarWriter`).
"""

from __future__ import annotations

import struct

__all__ = ["crc32c", "frame", "masked_crc32c"]


def _table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli's polynomial, reflected
        table.append(c)
    return tuple(table)


_TABLE = _table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``: ``crc32c(b"123456789") == 0xE3069283``. Byte by byte: an event
    of scalars is a few hundred bytes."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC as TFRecord stores it: rotated right by 15 bits plus a constant (a CRC of data that holds
    CRCs is then not trivially related to theirs)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord record holding ``data``."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))
