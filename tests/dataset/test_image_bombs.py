"""Decompression bombs in image and Petastorm columns: refused by their headers, never allocated.

Every bomb is a real file (a PNG whose ``IHDR`` claims gigapixels, with a valid CRC; a zlib stream that
inflates to hundreds of megabytes; a JPEG whose frame header is forged) put into a real dataset: written
by `shardkit.write_dataset` (or by Petastorm: the repository's fixtures), then one blob replaced at the
Arrow level. Memory is measured in a child process (`probe`): for a claimed size, its address space
is capped at 384 MiB above what reading an intact copy left it, so a decoder that allocates the claimed
image fails there, loudly (in this process it would not fail, nor show in the resident size: the pages
are never touched); for an inflating stream, its peak resident size may grow by 128 MB at most.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import shardkit
from shardkit import Field, ImageCodec, Schema
from shardkit.errors import ConfigError, CorruptDatasetError, ImageShapeError, SchemaMismatchError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LIMIT = 1 << 28  # headers.DEFAULT_MAX_IMAGE_PIXELS
ROWS, GROUP, BAD = 24, 8, 11  # 3 row groups; the bomb in row group 1


# --- crafted files ----------------------------------------------------------------------------------


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_claiming(width: int, height: int, *, colour: int = 2, depth: int = 8, stream: bytes | None = None
                 ) -> bytes:
    """A PNG whose ``IHDR`` (CRC valid) claims ``width`` x ``height``; its data: a few zero rows unless
    ``stream`` is given."""
    stream = zlib.compress(bytes(4096)) if stream is None else stream
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", stream) + chunk(b"IEND", b""))


def deflate_zeros(total: int, *, wrapped: bool) -> bytes:
    """A deflate stream of ``total`` zero bytes (a multiple of 16 MiB) in about total/1000 bytes: one
    fully flushed 16 MiB part repeated (a full flush makes each part stand alone), zlib-wrapped with its
    Adler-32 or raw (as zip members are)."""
    part = 16 << 20
    raw = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = raw.compress(bytes(part)) + raw.flush(zlib.Z_FULL_FLUSH)
    stream = body * (total // part) + raw.flush()
    if not wrapped:
        return stream
    adler = 1
    zeros = bytes(part)
    for _ in range(total // part):
        adler = zlib.adler32(zeros, adler)
    return b"\x78\xda" + stream + struct.pack(">I", adler)


def jpeg_claiming(width: int, height: int) -> bytes:
    """A real 16 x 16 JPEG whose frame header (SOF0) is forged to claim ``width`` x ``height``."""
    buf = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), 128, np.uint8)).save(buf, format="JPEG")
    blob = bytearray(buf.getvalue())
    at = blob.index(b"\xff\xc0")
    assert struct.unpack_from(">HH", blob, at + 5) == (16, 16)
    struct.pack_into(">HH", blob, at + 5, height, width)
    return bytes(blob)


def zip_member(payload_stream: bytes, crc: int, size: int, name: bytes = b"arr.npy") -> bytes:
    """A one-member zip archive, as ``np.savez_compressed`` writes it, of a raw deflate stream."""
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, zlib.DEFLATED, 0, 0, crc,
                        len(payload_stream), size & 0xFFFFFFFF, len(name), 0)
    return local + name + payload_stream


# --- datasets ---------------------------------------------------------------------------------------


def smooth(rows: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, shape[0] // 4 + 1, shape[1] // 4 + 1, *shape[2:]))
    big = np.repeat(np.repeat(blocks, 4, axis=1), 4, axis=2)[:, : shape[0], : shape[1]]
    return np.clip(big + rng.integers(-6, 7, big.shape), 0, 255).astype(np.uint8)


def write_images(path: Path, field: Field, images: Any, bad: dict[int, bytes]) -> str:
    """``id`` and ``field`` (``images``) written by `shardkit.write_dataset` in row groups of `GROUP`
    rows, then the blobs of the rows in ``bad`` replaced by its values."""
    url = os.fspath(path)
    schema = Schema([Field("id", "int64"), field])
    shardkit.write_dataset({"id": np.arange(len(images)), field.name: images}, url, schema=schema,
                           row_group_size=GROUP, file_size=10**9)
    if bad:
        (file,) = shardkit.open_dataset(url).files
        replace_blobs(Path(url) / file, field.name, bad, row_group_size=GROUP)
        os.remove(os.path.join(url, "_metadata"))
        shardkit.write_summary(url)
    return url


def replace_blobs(file: Path, column: str, blobs: dict[int, bytes], *, row_group_size: int | None = None
                  ) -> None:
    table = pq.read_table(file)
    values = table.column(column).to_pylist()
    for row, blob in blobs.items():
        values[row] = blob
    k = table.schema.get_field_index(column)
    table = table.set_column(k, table.schema.field(k), pa.array(values, type=table.schema.field(k).type))
    pq.write_table(table, file, row_group_size=row_group_size)


def petastorm_copy(tmp_path: Path, name: str, column: str, blob: bytes) -> str:
    """A copy of a Petastorm fixture (written by Petastorm 0.13.1) whose first file's first row of
    ``column`` is ``blob``."""
    folder = tmp_path / Path(name).name
    shutil.copytree(FIXTURES / name, folder)
    first = sorted(folder.glob("part-*.parquet"))[0]
    replace_blobs(first, column, {0: blob})
    return os.fspath(folder)


def read(url: str, **kw: Any) -> list[dict[str, np.ndarray]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardkit.SummaryMissingWarning)  # Petastorm's fixtures have none
        with shardkit.make_reader(url, batch_size=GROUP // 2, shuffle=False, cache=None, **kw) as reader:
            return list(reader)


def read_skipping(url: str) -> dict[int, Any]:
    """Every row read with ``on_error="skip"`` (which warns of the skip), by id."""
    with pytest.warns(UserWarning, match="skipped 1 corrupt row group"):
        batches = read(url, on_error="skip")
    return {int(i): b["img"][k] for b in batches for k, i in enumerate(b["id"])}


PROBE = textwrap.dedent("""
    import json, resource, sys, warnings
    warnings.simplefilter("ignore")  # Pillow's DecompressionBombWarning: the old reader went on
    import shardkit

    def read(url):
        with shardkit.make_reader(url, batch_size=4, shuffle=False, cache=None) as reader:
            return [int(i) for b in reader for i in b["id"]]

    def status(key):  # VmSize: the address space; VmHWM: the peak resident size of this program
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    intact, bomb, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
    read(intact)  # libraries, codecs and thread pools loaded: what a read needs besides the bomb
    if cap:
        resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + cap, resource.RLIM_INFINITY))
    peak = status("VmHWM")
    out = {}
    try:
        out["ids"] = read(bomb)
    except BaseException as e:
        chain, x = [], e
        while x is not None:
            chain.append(type(x).__name__)
            x = x.__cause__ or x.__context__
        corrupt = isinstance(e, shardkit.errors.CorruptDatasetError)
        out.update(chain=chain, message=str(e)[:2000], corrupt=corrupt)
    out["grew_mb"] = (status("VmHWM") - peak) / 2**20
    print(json.dumps(out))
""")


def probe(intact: str, bomb: str, *, cap: int = 0) -> dict[str, Any]:
    """Read ``bomb`` in a child process, after ``intact``, with ``cap`` bytes more address space than
    that left it (0: no cap): what it read, or what it raised (the exception's chain of causes), and how
    much its peak resident size grew (MB). The peak is ``VmHWM``, not ``ru_maxrss``: a child starts with
    its parent's ``ru_maxrss`` (it survives fork and exec), whatever this test process read before."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "ARROW_DEFAULT_MEMORY_POOL": "system"}  # no reservations
    done = subprocess.run([sys.executable, "-c", PROBE, intact, bomb, str(cap)], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def assert_refused_unallocated(result: dict[str, Any]) -> None:
    """Refused as corrupt, and nothing on the way ran out of the capped memory (a cv2.error or a
    MemoryError that Pillow's wrapper turned into CorruptDatasetError, as the old reader did)."""
    assert result.get("corrupt") is True, result
    assert "MemoryError" not in result["chain"], result
    assert result["grew_mb"] < 128, result


# --- PNG and JPEG headers claiming gigapixels ------------------------------------------------------------

FIXED = Field("img", "uint8", (32, 32, 3), codec=ImageCodec("png"))
RGBA = Field("img", "uint8", (None, None, 4), codec=ImageCodec("png"))
GREY = Field("img", "uint8", (None, None), codec=ImageCodec("png"))
JPEG = Field("img", "uint8", (None, None, 3), codec=ImageCodec("jpeg"))
JPEG_FIXED = Field("img", "uint8", (32, 32, 3), codec=ImageCodec("jpeg"))

BOMBS = {  # name -> field, bomb, what the error names
    "png in a fixed-shape field": (FIXED, png_claiming(30000, 30000), ["(30000, 30000, 3)", "(32, 32, 3)"]),
    "rgba png of varying size": (RGBA, png_claiming(20000, 20000, colour=6),
                                 ["20000 x 20000", "400000000", str(LIMIT), "SHARDKIT_MAX_IMAGE_PIXELS"]),
    "grey png past OpenCV's limit": (GREY, png_claiming(40000, 40000, colour=0),
                                     ["40000 x 40000", str(LIMIT), "SHARDKIT_MAX_IMAGE_PIXELS"]),
    "jpeg of varying size": (JPEG, jpeg_claiming(60000, 20000),
                             ["60000 x 20000", "1200000000", str(LIMIT), "SHARDKIT_MAX_IMAGE_PIXELS"]),
    "jpeg in a fixed-shape field": (JPEG_FIXED, jpeg_claiming(13000, 13000),
                                    ["(13000, 13000, 3)", "(32, 32, 3)"]),
}
# What the old reader allocated: OpenCV took the PNGs (up to its 2^30 pixels, then raised cv2.error),
# Pillow the 169-Mpx JPEG (it only warns up to 179 Mpx); it refused the 1.2-Gpx JPEG itself, unallocated.
ALLOCATED = sorted(set(BOMBS) - {"jpeg of varying size"})


def images_for(field: Field) -> Any:
    if field.fixed_shape:
        return smooth(ROWS, field.dims)
    channels = field.shape[2:]
    return [smooth(1, (8 + k % 5, 9 + k % 3, *channels), seed=k)[0] for k in range(ROWS)]


def datasets(folder: Path, name: str) -> tuple[Field, Any, str, str, list[str]]:
    """(field, the images written, an intact dataset, the same with bomb ``name`` at row `BAD`, needles)."""
    field, blob, needles = BOMBS[name]
    images = images_for(field)
    intact = write_images(folder / "intact", field, images, {})
    return field, images, intact, write_images(folder / "bomb", field, images, {BAD: blob}), needles


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_claimed_gigapixel_image_is_refused_naming_its_size_and_skipped_on_error_skip(
        tmp_path: Path, name: str) -> None:
    """The old reader passed the claim to OpenCV (which allocated it, or raised cv2.error past its own
    2^30 pixels: not a CorruptDatasetError, so on_error="skip" did not skip it) or to Pillow (which
    refused past 179 Mpx without saying what was claimed)."""
    field, images, _intact, url, needles = datasets(tmp_path, name)
    with pytest.raises(CorruptDatasetError) as info:
        read(url)
    message = str(info.value)
    for needle in ["field 'img'", "row group 1 of", *needles]:
        assert needle in message, (needle, message)
    rows = read_skipping(url)
    assert set(rows) == set(range(ROWS)) - {BAD}
    for i, got in rows.items():
        want = images[i]
        if field.codec.format == "jpeg":  # lossy: what Pillow (the JPEG decoder used before) makes of it
            want = np.asarray(Image.open(io.BytesIO(field.codec._encode_one(want))))
        np.testing.assert_array_equal(got, want, err_msg=f"row {i}")


@pytest.mark.parametrize("name", ALLOCATED)
def test_the_claimed_image_is_never_allocated(tmp_path: Path, name: str) -> None:
    _field, _images, intact, url, _needles = datasets(tmp_path, name)
    assert_refused_unallocated(probe(intact, url, cap=384 << 20))


# --- streams inflating past their headers ---------------------------------------------------------------


def test_a_png_stream_inflating_far_past_its_header_is_cut_where_the_image_ends(tmp_path: Path) -> None:
    """An OpenCV-style 32x32 RGB PNG (one IDAT: the inflate fast path) whose stream inflates to 320 MB
    of zero rows. The old fast path inflated all of it in one call before seeing the size was wrong;
    now inflating stops a byte past the image, and the image is left to libpng, which reads its rows
    and ignores the rest (as it did before)."""
    bad = png_claiming(32, 32, stream=deflate_zeros(320 << 20, wrapped=True))
    images = smooth(ROWS, (32, 32, 3))
    intact = write_images(tmp_path / "intact", FIXED, images, {})
    url = write_images(tmp_path / "bomb", FIXED, images, {BAD: bad})
    got = {int(i): b["img"][k] for b in read(url) for k, i in enumerate(b["id"])}
    np.testing.assert_array_equal(got[BAD], np.zeros((32, 32, 3), np.uint8))
    for i in set(range(ROWS)) - {BAD}:
        np.testing.assert_array_equal(got[i], images[i])
    result = probe(intact, url)
    assert sorted(result["ids"]) == list(range(ROWS)), result
    assert result["grew_mb"] < 128, result


def npy_zip_bomb(array: np.ndarray, extra: int) -> bytes:
    """An ``np.savez_compressed``-style archive whose ``arr.npy`` is ``array`` followed by ``extra`` zero
    bytes (its CRC right for all of it)."""
    buf = io.BytesIO()
    np.save(buf, array)
    npy = buf.getvalue()
    raw = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = raw.compress(npy) + raw.flush(zlib.Z_FULL_FLUSH)
    stream = head + deflate_zeros(extra, wrapped=False)
    crc = zlib.crc32(npy)
    zeros = bytes(16 << 20)
    for _ in range(extra // len(zeros)):
        crc = zlib.crc32(zeros, crc)
    return zip_member(stream, crc, len(npy) + extra)


@pytest.mark.parametrize(("fixture", "column", "array", "needles"), [
    ("petastorm/tensors", "mat", np.zeros((4, 5), np.int16),  # fixed shape: bounded by the field
     ["field 'mat'", "inflates to more than 10052 bytes", "int16 (4, 5)"]),
    ("petastorm/varshape", "counts", np.zeros(10, np.uint16),  # varying: bounded by the .npy header
     ["field 'counts'", "inflates to more than the 148 bytes its .npy header declares", "uint16 (10,)"]),
])
def test_a_compressed_petastorm_array_inflating_past_its_header_is_refused_early(
        tmp_path: Path, fixture: str, column: str, array: np.ndarray, needles: list[str]) -> None:
    """Petastorm's CompressedNdarrayCodec column whose archive inflates to 320 MB: the old codec inflated
    all of it (and joined it with the column's other rows), then found the size wrong."""
    url = petastorm_copy(tmp_path, fixture, column, npy_zip_bomb(array, 320 << 20))
    with pytest.raises(CorruptDatasetError) as info:
        read(url)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    result = probe(os.fspath(FIXTURES / fixture), url)
    assert result.get("corrupt") is True, result
    assert result["grew_mb"] < 128, result


@pytest.mark.parametrize(("column", "blob", "needles"), [
    ("var16", png_claiming(2, 500_000_000, colour=0, depth=16),  # (None, 2): 1e9 px, 2 GB
     ["field 'var16'", "2 x 500000000", str(LIMIT), "SHARDKIT_MAX_IMAGE_PIXELS"]),
    ("grey16", png_claiming(60000, 60000, colour=0, depth=16),  # (4, 5)
     ["field 'grey16'", "(60000, 60000)", "(4, 5)"]),
])
def test_a_petastorm_16_bit_png_bomb_is_refused_before_opencv(tmp_path: Path, column: str, blob: bytes,
                                                               needles: list[str]) -> None:
    url = petastorm_copy(tmp_path, "petastorm_extra/png16", column, blob)
    with pytest.raises(CorruptDatasetError) as info:
        read(url)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert_refused_unallocated(probe(os.fspath(FIXTURES / "petastorm_extra/png16"), url, cap=384 << 20))


# --- sizes that are not the field's, the limit's configuration ---------------------------------------


def test_a_small_image_of_another_size_is_refused_by_its_header_and_skippable(tmp_path: Path) -> None:
    """Refused before decoding, as the SchemaMismatchError it was (after decoding) and as corruption, so
    on_error="skip" loses its row instead of stopping the reader."""
    wrong = io.BytesIO()
    Image.fromarray(np.zeros((32, 33, 3), np.uint8)).save(wrong, format="PNG")
    column = pa.array([FIXED.codec._encode_one(np.zeros((32, 32, 3), np.uint8)), wrong.getvalue()])
    with pytest.raises(SchemaMismatchError, match=r"'img'.*row 1.*\(32, 33, 3\).*PNG header") as info:
        FIXED.codec.decode(FIXED, column)
    assert isinstance(info.value, CorruptDatasetError)
    images = smooth(ROWS, (32, 32, 3))
    url = write_images(tmp_path / "ds", FIXED, images, {BAD: wrong.getvalue()})
    rows = read_skipping(url)
    assert set(rows) == set(range(ROWS)) - {BAD}
    with pytest.raises(SchemaMismatchError, match=r"row group \d+ of .*part-.*'img'") as info:
        read(url)  # the reader names the row group and keeps the class (it was a CorruptDatasetError)
    assert isinstance(info.value, ImageShapeError)


def test_the_limit_is_set_by_the_environment_or_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.dataset.codecs import headers

    assert headers.DEFAULT_MAX_IMAGE_PIXELS == LIMIT
    field = Field("img", "uint8", (None, None), codec=ImageCodec("png"))
    column = pa.array([field.codec._encode_one(np.zeros((50, 60), np.uint8))])
    assert field.codec.decode(field, column)[0].shape == (50, 60)
    monkeypatch.setenv("SHARDKIT_MAX_IMAGE_PIXELS", "2999")
    with pytest.raises(CorruptDatasetError, match=r"'img': row 0: .*60 x 50 pixels \(3000\).*limit of 2999"):
        field.codec.decode(field, column)
    monkeypatch.setenv("SHARDKIT_MAX_IMAGE_PIXELS", "3000")
    assert field.codec.decode(field, column)[0].shape == (50, 60)
    monkeypatch.setattr(headers, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(CorruptDatasetError, match="limit of 100 "):
        field.codec.decode(field, column)
    monkeypatch.setattr(headers, "MAX_IMAGE_PIXELS", None)
    monkeypatch.setenv("SHARDKIT_MAX_IMAGE_PIXELS", "lots")
    with pytest.raises(ConfigError, match="SHARDKIT_MAX_IMAGE_PIXELS='lots'"):
        field.codec.decode(field, column)


def test_other_formats_are_checked_by_pillows_lazy_header() -> None:
    """A GIF (no PNG/JPEG header to read): Pillow's lazy open gives its size before anything is loaded."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 9), np.uint8)).save(buf, format="GIF")
    fixed = Field("img", "uint8", (8, 8), codec=ImageCodec("png"))
    with pytest.raises(CorruptDatasetError, match=r"'img'.*row 0 .*\(8, 9\) by its GIF header"):
        fixed.codec.decode(fixed, pa.array([buf.getvalue()]))


# --- valid images decode as before ------------------------------------------------------------------


def test_valid_images_of_every_mode_still_decode_bit_identical(tmp_path: Path) -> None:
    """Grey, grey with a channel axis, RGB and RGBA PNGs and JPEGs, of fixed and of varying size: PNGs to
    the pixels written, JPEGs to Pillow's decoding of the stored bytes (their decoder before and now).
    A guard, not a bomb: it passes on the code before the header checks too."""
    n = 40
    fixed = {"grey": (16, 20), "grey1": (16, 20, 1), "rgb": (16, 20, 3), "rgba": (16, 20, 4)}
    columns: dict[str, Any] = {name: smooth(n, shape, seed=k)
                               for k, (name, shape) in enumerate(fixed.items())}
    columns["jpeg"] = smooth(n, (24, 24, 3), seed=7)
    columns["varpng"] = [smooth(1, (5 + k % 7, 3 + k % 4, 3), seed=k)[0] for k in range(n)]
    columns["vargrey"] = [smooth(1, (5 + k % 3, 3 + k % 5), seed=k)[0] for k in range(n)]
    columns["varrgba"] = [smooth(1, (2 + k % 4, 7 + k % 2, 4), seed=k)[0] for k in range(n)]
    columns["varjpeg"] = [smooth(1, (8 + k % 9, 16, 3), seed=k)[0] for k in range(n)]
    fields = [Field(name, "uint8", shape, codec=ImageCodec("png")) for name, shape in fixed.items()]
    fields += [Field("jpeg", "uint8", (24, 24, 3), codec=ImageCodec("jpeg", quality=85)),
               Field("varpng", "uint8", (None, None, 3), codec=ImageCodec("png")),
               Field("vargrey", "uint8", (None, None), codec=ImageCodec("png")),
               Field("varrgba", "uint8", (None, None, 4), codec=ImageCodec("png")),
               Field("varjpeg", "uint8", (None, None, 3), codec=ImageCodec("jpeg", quality=85))]
    url = os.fspath(tmp_path / "ds")
    schema = Schema([Field("id", "int64"), *fields])
    shardkit.write_dataset({"id": np.arange(n), **columns}, url, schema=schema, row_group_size=16)
    stored = pq.read_table(url).to_pydict()
    order = np.argsort(stored["id"])
    got: dict[str, list[np.ndarray]] = {f.name: [] for f in fields}
    for batch in read(url):
        for f in fields:
            got[f.name].extend(batch[f.name])
    for f in fields:
        for i in range(n):
            if f.codec.format == "jpeg":
                want = np.asarray(Image.open(io.BytesIO(stored[f.name][order[i]])))
            else:
                want = columns[f.name][i]
            assert got[f.name][i].dtype == np.uint8
            np.testing.assert_array_equal(got[f.name][i], want, err_msg=f"{f.name} row {i}")


# --- shardkit's limit is the only one ------------------------------------------------------------------


def one_bit_png(width: int, height: int) -> bytes:
    """A real 1-bit grey PNG of ``width`` x ``height``, columns alternating white and black (0xAA bytes):
    a few kilobytes per hundred megapixels, and decoded only by Pillow (OpenCV's path takes 8 bits)."""
    row = b"\x00" + b"\xaa" * ((width + 7) // 8)
    squeeze = zlib.compressobj(9)
    stream = b"".join(squeeze.compress(row) for _ in range(height)) + squeeze.flush()
    return png_claiming(width, height, colour=0, depth=1, stream=stream)


def test_an_image_past_pillows_limit_but_within_shardkits_decodes() -> None:
    """13380 x 13380 (179 Mpx): under shardkit's default limit (268 Mpx), past Pillow's error limit
    (``2 * PIL.Image.MAX_IMAGE_PIXELS``, 179 Mpx). Pillow refused it (DecompressionBombError, reported
    as a corrupt file); shardkit's limit is the one that applies, and Pillow's global stays as it was."""
    side = 13380
    assert 2 * Image.MAX_IMAGE_PIXELS < side * side < LIMIT  # type: ignore[operator]
    pillows = Image.MAX_IMAGE_PIXELS
    column = pa.array([one_bit_png(side, side)])
    (pixels,) = GREY.codec.decode(GREY, column)
    assert pixels.shape == (side, side)
    assert pixels.dtype == np.uint8
    np.testing.assert_array_equal(pixels[:: side // 7, :6], [[255, 0, 255, 0, 255, 0]] * 8)
    assert pixels[:, -4:].tolist() == [[255, 0, 255, 0]] * side  # the last byte's bits too
    del pixels
    assert pillows == Image.MAX_IMAGE_PIXELS


def test_pillows_own_limit_neither_refuses_nor_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's lower Pillow limit is theirs (for their own Image.open): shardkit's applies to its reads,
    in the fixed-shape and varying paths, for JPEG and the PNGs Pillow decodes (no warning either: the
    suite turns warnings into errors)."""
    from shardkit.dataset.codecs import headers

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # a warning past 1000 pixels, an error past 2000
    buf = io.BytesIO()
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(buf, format="JPEG")
    cases = [(GREY, one_bit_png(60, 40)), (Field("img", "uint8", (40, 60), codec=ImageCodec("png")),
                                          one_bit_png(60, 40)),
             (JPEG, buf.getvalue()), (Field("img", "uint8", (40, 60, 3), codec=ImageCodec("jpeg")),
                                      buf.getvalue())]
    for field, blob in cases:
        (pixels,) = field.codec.decode(field, pa.array([blob]))
        assert pixels.shape[:2] == (40, 60), field
        assert pixels.dtype == np.uint8, field
        assert int(pixels.max()) == (255 if field.codec.format == "png" else 200), field
    monkeypatch.setattr(headers, "MAX_IMAGE_PIXELS", 2399)
    with pytest.raises(CorruptDatasetError, match=r"60 x 40 pixels \(2400\).*limit of 2399"):
        GREY.codec.decode(GREY, pa.array([one_bit_png(60, 40)]))


def test_one_bit_pngs_decode_to_0_and_255_as_opencv_and_libpng_expand_them() -> None:
    """Pillow gives a 1-bit image as booleans: a uint8 field read 1 for white (fixed shape) or a bool
    array (varying size); OpenCV, Petastorm's decoder, gives 255."""
    import cv2

    blob = one_bit_png(12, 3)
    want = cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_UNCHANGED)
    assert want[0, :4].tolist() == [255, 0, 255, 0]
    for field in (GREY, Field("img", "uint8", (3, 12), codec=ImageCodec("png"))):
        (pixels,) = field.codec.decode(field, pa.array([blob]))
        assert pixels.dtype == np.uint8
        np.testing.assert_array_equal(pixels, want)


OPENCV_LIMITED = textwrap.dedent("""
    import numpy as np, pyarrow as pa
    from shardkit import Field, ImageCodec
    from shardkit.dataset.codecs import image

    image.USE_INFLATE = False  # so that OpenCV's paths take every image
    pixels = np.arange(3000, dtype=np.uint8).reshape(50, 60)
    for shape in ((None, None), (50, 60)):
        field = Field("img", "uint8", shape, codec=ImageCodec("png"))
        try:
            (got,) = field.codec.decode(field, pa.array([field.codec._encode_one(pixels)]))
            print(shape, "decoded" if (got == pixels).all() else "wrong pixels")
        except Exception as e:
            print(shape, type(e).__name__)
""")


def test_an_image_past_opencvs_limit_goes_to_pillow() -> None:
    """OpenCV refuses (raises ``cv2.error``) an image past its own limit, ``OPENCV_IO_MAX_IMAGE_PIXELS``
    (2**30 by default: shardkit's may be raised above it). It went up as a cv2.error; such an image is
    decoded by Pillow, for fixed-shape fields and fields of varying size. OpenCV's limit is lowered here,
    in a child process (it is read once), to keep the images small."""
    env = {**os.environ, "OPENCV_IO_MAX_IMAGE_PIXELS": "1000"}
    done = subprocess.run([sys.executable, "-c", OPENCV_LIMITED], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["(None, None) decoded", "(50, 60) decoded"], done.stderr[-3000:]


OPENCV_LIMITED_PNG16 = textwrap.dedent("""
    import cv2, numpy as np, pyarrow as pa
    from shardkit import Field

    grey = np.arange(3000, dtype=np.uint16).reshape(50, 60) * 21
    for shape, pixels in (((50, 60), grey), ((None, None), grey), ((50, 60, 3), np.stack([grey] * 3, -1))):
        field = Field("p", "uint16", shape, codec="petastorm.png16")
        blob = cv2.imencode(".png", pixels)[1].tobytes()
        try:
            (got,) = field.codec.decode(field, pa.array([blob]))
            print(shape, "decoded" if got.dtype == np.uint16 and (got == pixels).all() else "wrong pixels")
        except Exception as e:
            print(shape, type(e).__name__, e)
""")


def test_a_petastorm_16_bit_png_past_opencvs_limit_goes_to_pillow_or_names_the_setting() -> None:
    """Petastorm's 16-bit PNGs went to ``cv2.imdecode`` directly: past OpenCV's own limit (2**30 pixels,
    for a raised shardkit limit) a bare ``cv2.error`` came out of the reader. A grey one is decoded by
    Pillow now, every bit kept (``I;16``); Pillow reads 16-bit colour as 8 bits, so a colour one is
    refused, naming the OpenCV setting to raise. OpenCV's limit is lowered in a child process."""
    env = {**os.environ, "OPENCV_IO_MAX_IMAGE_PIXELS": "1000"}
    done = subprocess.run([sys.executable, "-c", OPENCV_LIMITED_PNG16], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:2] == ["(50, 60) decoded", "(None, None) decoded"], done.stdout + done.stderr[-3000:]
    assert lines[2].startswith("(50, 60, 3) CorruptDatasetError field 'p', row 0 of the batch: OpenCV "
                               "refused its 16-bit colour PNG of 60 x 50 pixels (3000) ("), lines[2]
    assert lines[2].endswith("past its own limit, OPENCV_IO_MAX_IMAGE_PIXELS, 2**30 pixels unless set), and "
                             "Pillow reads such PNGs as 8 bits only. Set OPENCV_IO_MAX_IMAGE_PIXELS=3000 (or "
                             "more) in the environment of the process before it starts"), lines[2]
