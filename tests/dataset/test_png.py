"""`shardkit.dataset.codecs._png`: PNGs written here filter by filter, decoded against their pixels."""

from __future__ import annotations

import io
import itertools
import struct
import zlib

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from PIL import Image

from shardkit import Field, ImageCodec
from shardkit.dataset.codecs import _png as png
from shardkit.dataset.codecs import image as image_module
from shardkit.errors import CorruptDatasetError

NONE, SUB, UP, AVERAGE, PAETH = range(5)
COLOUR = {1: 0, 3: 2, 4: 6}


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _paeth(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a + b - c
    pa_, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
    return np.where((pa_ <= pb) & (pa_ <= pc), a, np.where(pb <= pc, b, c))


def write_png(pixels: np.ndarray, filters: list[int], *, idat_parts: int = 1, level: int = 1) -> bytes:
    """An 8-bit PNG of ``pixels`` (H, W, C) whose row y is filtered with ``filters[y]`` (PNG spec, 9.2)."""
    height, width, channels = pixels.shape
    rows = pixels.reshape(height, width * channels).astype(np.int64)
    prev = np.zeros(width * channels, np.int64)
    lines = []
    for y, kind in enumerate(filters):
        cur = rows[y]
        left = np.concatenate([np.zeros(channels, np.int64), cur[:-channels]])
        upleft = np.concatenate([np.zeros(channels, np.int64), prev[:-channels]])
        predicted = [0, left, prev, (left + prev) // 2, _paeth(left, prev, upleft)][kind]
        lines.append(bytes([kind]) + ((cur - predicted) % 256).astype(np.uint8).tobytes())
        prev = cur
    stream = zlib.compress(b"".join(lines), level)
    cut = [len(stream) * k // idat_parts for k in range(idat_parts + 1)]
    header = struct.pack(">IIBBBBB", width, height, 8, COLOUR[channels], 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + b"".join(_chunk(b"IDAT", stream[a:b]) for a, b in itertools.pairwise(cut))
            + _chunk(b"IEND", b""))


def _decode_pngs(blobs: list[bytes], shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    data = np.frombuffer(b"".join(blobs), np.uint8)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])])
    return png.decode_pngs(data, offsets[:-1], offsets[1:], shape)


def _field(shape: tuple[int, int, int]) -> Field:
    return Field("im", "uint8", shape[:2] if shape[2] == 1 else shape, codec=ImageCodec("png"))


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_every_filter_decodes_to_its_pixels_only_none_sub_up_take_the_fast_path(data: st.DataObject) -> None:
    shape = data.draw(st.sampled_from([(1, 1, 1), (5, 3, 1), (6, 5, 3), (4, 7, 4), (32, 32, 3)]))
    n = data.draw(st.integers(1, 12))
    images = data.draw(st.lists(hnp.arrays(np.uint8, shape), min_size=n, max_size=n))
    filters = data.draw(st.lists(st.lists(st.integers(0, 4), min_size=shape[0], max_size=shape[0]),
                                 min_size=n, max_size=n))
    blobs = [write_png(im, f) for im, f in zip(images, filters, strict=True)]
    for blob, im in zip(blobs, images, strict=True):  # the writer is right: Pillow reads the pixels
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(blob))).reshape(shape), im)
    pixels, ok = _decode_pngs(blobs, shape)
    assert ok.tolist() == [max(f) <= UP for f in filters] or not any(max(f) <= UP for f in filters[:8])
    for k in np.flatnonzero(ok):
        np.testing.assert_array_equal(pixels[k], images[k])
    field = _field(shape)
    decoded = field.codec.decode(field, pa.array(blobs, pa.binary()))  # the codec: fast path, then the rest
    np.testing.assert_array_equal(decoded.reshape(n, *shape), np.stack(images))


def test_zlib_and_isal_inflate_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(20)]
    blobs = [write_png(im, [k % 3] * 16) for k, im in enumerate(images)]
    got, ok = _decode_pngs(blobs, (16, 16, 3))
    monkeypatch.setattr(png, "_inflate", lambda: zlib.decompress)
    plain, ok_plain = _decode_pngs(blobs, (16, 16, 3))
    assert ok.all()
    assert ok_plain.all()
    np.testing.assert_array_equal(got, np.stack(images))
    np.testing.assert_array_equal(plain, got)


def test_opencv_and_pillow_files_decode_alike_whichever_path_takes_them() -> None:
    """OpenCV's files as Petastorm writes them (``imencode(".png", image)``, no parameters: every row Sub)
    take the fast path whole; libpng's adaptive filters (Pillow's files, or OpenCV given a compression
    level) have Paeth rows and leave it after a few images; every image decodes to its pixels."""
    cv2 = pytest.importorskip("cv2", reason="OpenCV is an optional extra (shardkit[image])")
    rng = np.random.default_rng(9)
    images = [(np.kron(rng.integers(0, 256, (4, 4, 3)), np.ones((8, 8, 1))) + rng.integers(0, 9, (32, 32, 3))
               ).astype(np.uint8) for _ in range(40)]
    opencv = [cv2.imencode(".png", im[..., ::-1])[1].tobytes() for im in images]
    pillow = []
    for im in images:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="PNG", compress_level=1)
        pillow.append(buf.getvalue())
    assert _decode_pngs(opencv, (32, 32, 3))[1].all()
    assert not _decode_pngs(pillow, (32, 32, 3))[1].any()
    field = _field((32, 32, 3))
    for blobs in (opencv, pillow):
        decoded = field.codec.decode(field, pa.array(blobs, pa.binary()))
        np.testing.assert_array_equal(decoded, np.stack(images))


def test_files_the_fast_path_does_not_take_decode_by_the_general_one() -> None:
    rng = np.random.default_rng(2)
    im = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    split = write_png(im, [SUB] * 8, idat_parts=3)  # several IDAT chunks
    text = write_png(im, [SUB] * 8)
    text = text[:33] + _chunk(b"tEXt", b"k\x00v") + text[33:]  # a chunk before the data
    wide = write_png(rng.integers(0, 256, (8, 9, 3), dtype=np.uint8), [NONE] * 8)  # another size
    pixels, ok = _decode_pngs([split, text, wide, write_png(im, [UP] * 8)], (8, 8, 3))
    assert ok.tolist() == [False, False, False, True]
    np.testing.assert_array_equal(pixels[3], im)
    field = _field((8, 8, 3))
    got = field.codec.decode(field, pa.array([split, text], pa.binary()))
    np.testing.assert_array_equal(got, np.stack([im, im]))


@pytest.mark.parametrize("use_opencv", [True, False])
def test_a_damaged_stream_is_not_trusted(use_opencv: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flipped byte in the zlib stream fails its Adler-32 (or the size check): the fast path leaves
    the image, and the general decoder (libpng checks the chunk's CRC) raises naming the field."""
    monkeypatch.setattr(image_module, "USE_OPENCV", use_opencv)
    rng = np.random.default_rng(4)
    good = write_png(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), [SUB] * 8)
    for at in (45, len(good) - 20):  # the stream's first bytes, its Adler-32
        bad = bytearray(good)
        bad[at] ^= 0x5A
        assert not _decode_pngs([bytes(bad)], (8, 8, 3))[1].any()
        field = _field((8, 8, 3))
        with pytest.raises(CorruptDatasetError, match="'im'"):
            field.codec.decode(field, pa.array([good, bytes(bad)], pa.binary()))
