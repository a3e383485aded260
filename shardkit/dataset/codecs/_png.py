"""PNG decoding without a PNG library, for the common case: many small 8-bit images of one shape.

A PNG is a signature, an ``IHDR`` chunk, ``IDAT`` chunks holding one zlib stream of filtered
scanlines (a filter byte, then the row's bytes), and ``IEND``. For a column of such images the work
that libpng (behind OpenCV and Pillow) does per image besides inflating — setting up its reader,
checking every chunk's CRC, unfiltering row by row through callbacks — costs about as much as the
inflate itself on a small image. Here the headers of a slice of images are checked with numpy in one
pass, each image's ``IDAT`` is inflated by one call that releases the GIL (`isal` when installed,
faster than zlib on small streams, else `zlib`), and the scanlines of the whole slice are unfiltered
together: ``Sub`` rows are a cumulative sum along the row (uint8 wraps like PNG's modulo 256), ``Up``
rows add the row above.

Taken only where it is exact: 8-bit, non-interlaced, the field's width, height and colour type, one
``IDAT`` followed by ``IEND``, the inflated size exactly ``height * (1 + width * channels)``, and rows
filtered with None, Sub or Up (what OpenCV, hence Petastorm, writes). Everything else — ``Average``
and ``Paeth`` rows (Pillow's adaptive filtering picks them), palettes, 16 bits, other chunks before
the data — is left to the caller's general decoder. A damaged stream fails zlib's Adler-32 check or
the size check and is left to the general decoder too, which raises on it. Chunk CRCs are not
checked (libpng checks them): the Adler-32 covers every byte the pixels come from, so a file whose
only damage is a CRC decodes here to its right pixels where libpng would refuse it.

Inflating never allocates much more than the image, whatever the stream: one of at most `ONE_SHOT`
bytes is inflated by one call (deflate expands at most 1032:1, so never past 8.3 MB), a longer one by
a decompressor that stops one byte past the expected size (a 1 MB stream inflating to a gigabyte is
left to the general decoder at the cost of a few kilobytes; libpng too stops at the image's end).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"  # every PNG's first 8 bytes
COLOUR_TYPE = {1: 0, 3: 2, 4: 6}  # channels -> PNG colour type (grey, RGB, RGBA), 8-bit
START = SIGNATURE + b"\x00\x00\x00\x0dIHDR"  # 16 bytes, then IHDR's data
_START = np.frombuffer(START, np.uint8)
_IDAT = np.frombuffer(b"IDAT", np.uint8)
_IEND = np.frombuffer(b"\x00\x00\x00\x00IEND", np.uint8)
_HEAD = 41  # signature 8, IHDR chunk 25, the next chunk's length and type 8
_GIVE_UP_AFTER = 8  # a slice whose first images all need the general decoder is left to it whole
ONE_SHOT = 8 << 10  # streams up to this many bytes are inflated by one call (see the module docstring)
_NONE, _SUB, _UP = 0, 1, 2


@cache
def _inflate() -> Callable[..., bytes]:
    try:
        from isal import isal_zlib  # optional: shardkit[image]
    except ImportError:
        return zlib.decompress
    return isal_zlib.decompress


@cache
def _decompressor() -> Callable[[], Any]:
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib.decompressobj
    return isal_zlib.decompressobj


def _inflate_at_most(stream: np.ndarray, limit: int) -> bytes | None:
    """The zlib ``stream`` inflated, or None where its output would pass ``limit`` bytes (inflating
    stops there) or the stream ends early."""
    inflate = _decompressor()()
    out: bytes = inflate.decompress(stream, limit + 1)
    return out if len(out) <= limit and inflate.eof else None


def ihdr_matches(head: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """For each row of ``head`` (the first 26 or more bytes of a blob), whether it starts as an 8-bit PNG
    of ``shape`` (height, width, channels) does: the signature, an IHDR of that size and colour type.
    Read before anything is inflated or decoded, so a header claiming another size is never a bomb."""
    height, width, channels = shape
    ok: np.ndarray = (head[:, :16] == _START).all(axis=1)
    ok &= (be32(head[:, 16:20]) == width) & (be32(head[:, 20:24]) == height)
    ok &= (head[:, 24] == 8) & (head[:, 25] == COLOUR_TYPE.get(channels, -1))  # 8 bits, the colour type
    return ok


def be32(b: np.ndarray) -> np.ndarray:
    """The big-endian uint32 in each row of ``b`` (rows of 4 bytes)."""
    return np.ascontiguousarray(b).view(">u4")[:, 0].astype(np.int64)


def decode_pngs(data: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Decode the PNGs ``data[starts[i]:ends[i]]`` that fit the fast path, as ``(n, H, W, C)`` uint8.

    Returns the pixels and a boolean mask of the images decoded; the others' pixels are unset and
    are the caller's to decode (see the module docstring for what is taken).
    """
    height, width, channels = shape
    n = len(starts)
    stride = 1 + width * channels
    out = np.empty((n, height, stride), np.uint8)  # filter byte + the row, as inflated
    ok = np.zeros(n, bool)
    if n == 0 or len(data) < 57:
        return out[:, :, 1:].reshape(n, height, width, channels), ok
    ends = ends.astype(np.int64)
    fits = ends - starts.astype(np.int64) >= 57  # 57: signature, IHDR, an empty IDAT, IEND
    starts = np.where(fits, starts, 0).astype(np.int64)
    head = data[starts[:, None] + np.arange(_HEAD)]  # one gather for every header field below
    fits &= ihdr_matches(head, shape)
    fits &= (head[:, 26:29] == 0).all(axis=1)  # deflate, filter method 0, not interlaced
    fits &= (head[:, 37:41] == _IDAT).all(axis=1)  # the first chunk after IHDR (33: IHDR's CRC ends)
    size = np.where(fits, be32(head[:, 33:37]), 0)
    tail = starts + 45 + size  # IDAT: length, type, data, CRC; then IEND's 12 bytes end the file
    fits &= tail + 12 == ends
    fits &= (data[np.where(fits, tail, 0)[:, None] + np.arange(8)] == _IEND).all(axis=1)

    inflate, want = _inflate(), height * stride
    flat = out.reshape(n, want)
    todo = np.flatnonzero(fits).tolist()
    for j, k in enumerate(todo):
        if j == _GIVE_UP_AFTER and not (ok & (out[:, :, 0] <= _UP).all(axis=1)).any():
            ok[:] = False  # e.g. Pillow's files, Paeth rows throughout: inflating them twice would cost more
            break
        stream = data[starts[k] + 41 : starts[k] + 41 + size[k]]
        try:
            raw = inflate(stream) if size[k] <= ONE_SHOT else _inflate_at_most(stream, want)
        except Exception:  # zlib.error or isal's: the general decoder will name the damage
            continue
        if raw is not None and len(raw) == want:
            flat[k] = np.frombuffer(raw, np.uint8)
            ok[k] = True
    ok &= (out[:, :, 0] <= _UP).all(axis=1)  # unset rows are never read: ok is False there
    _unfilter(out, ok, channels)
    return out[:, :, 1:].reshape(n, height, width, channels), ok


def _unfilter(out: np.ndarray, ok: np.ndarray, channels: int) -> None:
    """Undo the None/Sub/Up filters of the images ``ok`` in place (``out``: (n, H, 1 + W*C))."""
    sel = np.flatnonzero(ok)
    if not len(sel):
        return
    n, height, stride = len(sel), out.shape[1], out.shape[2]
    rows = out[sel] if n < len(out) else out
    filters = rows[:, :, 0]
    pixels = rows[:, :, 1:].reshape(n, height, (stride - 1) // channels, channels)
    sub = filters == _SUB
    if sub.all():  # a Sub row is the running sum of its pixels, per channel (OpenCV's files: all rows)
        np.add.accumulate(pixels, axis=2, dtype=np.uint8, out=pixels)
    elif sub.any():
        pixels[sub] = np.add.accumulate(pixels[sub], axis=1, dtype=np.uint8)
    if (filters[:, 1:] == _UP).any():  # an Up row adds the row above, itself already undone
        for y in range(1, height):
            up = filters[:, y] == _UP
            if up.any():
                pixels[up, y] += pixels[up, y - 1]
    if n < len(out):
        out[sel] = rows
