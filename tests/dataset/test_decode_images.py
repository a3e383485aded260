"""Images whose layout is not the field's pixels as stored: palettes and 16-bit PNGs.

Every PNG here is a real file (built chunk by chunk, CRCs valid, or written by OpenCV), decoded by the
`ImageCodec` with every fast path allowed and with Pillow alone, and compared with what OpenCV
(libpng: Petastorm's decoder) gives for it.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

import shardkit
from shardkit import Field, ImageCodec
from shardkit.dataset.codecs import image as image_module
from shardkit.dataset.write import EncodedTables
from shardkit.errors import CorruptDatasetError, ImageShapeError, SchemaMismatchError
from tests.dataset.test_codecs import decode_both

H, W = 5, 11


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def palette_png(indices: np.ndarray, palette: np.ndarray, alpha: list[int] | None = None, depth: int = 8
                ) -> bytes:
    """A palette PNG (colour type 3) of ``depth``-bit ``indices`` into ``palette`` (n x 3), with a ``tRNS``
    chunk of ``alpha`` when given (fewer entries than the palette: the rest are opaque)."""
    per = 8 // depth
    rows = []
    for row in indices.tolist():
        packed = bytearray()
        for k in range(0, len(row), per):
            packed.append(sum(v << (8 - depth * (j + 1)) for j, v in enumerate(row[k : k + per])))
        rows.append(b"\x00" + bytes(packed))
    height, width = indices.shape
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, 3, 0, 0, 0))
    out += chunk(b"PLTE", np.asarray(palette, np.uint8).tobytes())
    if alpha is not None:
        out += chunk(b"tRNS", bytes(alpha))
    return out + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b"")


def opencv(blob: bytes, flag: int) -> np.ndarray:
    pixels = cv2.imdecode(np.frombuffer(blob, np.uint8), flag)
    assert pixels is not None
    return np.asarray(pixels)


@pytest.mark.parametrize("depth", [1, 2, 4, 8])
@pytest.mark.parametrize("transparency", ["opaque", "one transparent entry", "alphas"])
def test_a_palette_png_decodes_to_its_colours_as_opencv_gives_them(
        depth: int, transparency: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow gives a palette image's indices: an RGB field read (H, W, 1) of them and failed on the shape,
    an RGBA one too, a field of varying size held the indices. Now the colours, in the field's layout,
    exactly OpenCV's (RGB: ``IMREAD_COLOR``; RGBA: ``IMREAD_UNCHANGED``, alpha 255 where it gives none)."""
    rng = np.random.default_rng(depth)
    n = 1 << depth
    palette = rng.integers(0, 256, (n, 3))
    alpha = {"opaque": None, "one transparent entry": [255] * (n - 1) + [0],
             "alphas": rng.integers(0, 256, max(1, n // 2)).tolist()}[transparency]
    blobs = [palette_png(rng.integers(0, n, (H, W)), palette, alpha, depth) for _ in range(3)]
    rgb = np.stack([opencv(b, cv2.IMREAD_COLOR)[:, :, ::-1] for b in blobs])
    unchanged = [opencv(b, cv2.IMREAD_UNCHANGED) for b in blobs]
    rgba = np.stack([u[:, :, [2, 1, 0, 3]] if u.shape[2] == 4 else
                     np.concatenate([u[:, :, ::-1], np.full((H, W, 1), 255, np.uint8)], axis=2)
                     for u in unchanged])
    assert (unchanged[0].shape[2] == 4) == (alpha is not None)
    for shape, want in (((H, W, 3), rgb), ((None, None, 3), rgb), ((H, W, 4), rgba), ((H, None, 4), rgba)):
        field = Field("img", "uint8", shape, codec=ImageCodec("png"))
        for got in decode_both(field, blobs, monkeypatch):
            assert len(got) == 3
            for i in range(3):
                assert got[i].dtype == np.uint8
                np.testing.assert_array_equal(got[i], want[i], err_msg=f"{shape} row {i}")


def test_a_palette_of_greys_decodes_to_its_greys_and_one_of_colours_is_refused_in_a_grey_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A grey field read a palette image's indices as grey levels: wrong pixels, without a word. A
    palette of greys (what optimizers write for grey images of few levels) is its greys, OpenCV's
    ``IMREAD_GRAYSCALE``; one of colours is refused as an RGB PNG is, naming the row and the fix."""
    rng = np.random.default_rng(7)
    greys = np.repeat(rng.integers(0, 256, (16, 1)), 3, axis=1)
    blobs = [palette_png(rng.integers(0, 16, (H, W)), greys, [255] * 15 + [0], 4) for _ in range(2)]
    want = np.stack([opencv(b, cv2.IMREAD_GRAYSCALE) for b in blobs])
    for shape in ((H, W), (H, W, 1), (None, None)):
        field = Field("img", "uint8", shape, codec=ImageCodec("png"))
        for got in decode_both(field, blobs, monkeypatch):
            for i in range(2):
                np.testing.assert_array_equal(np.reshape(got[i], (H, W)), want[i])
                assert got[i].shape == ((H, W, 1) if len(shape) == 3 else (H, W))

    colours = palette_png(rng.integers(0, 16, (H, W)), rng.integers(0, 256, (16, 3)))
    field = Field("img", "uint8", (H, W), codec=ImageCodec("png"))
    for use_opencv in (True, False):
        monkeypatch.setattr(image_module, "USE_OPENCV", use_opencv)
        with pytest.raises(ImageShapeError, match=r"field 'img': row 1 is a PNG palette image of colours "
                                                  r"\(not greys\), but the field holds greyscale images of "
                                                  r"shape \(5, 11\)\. Declare the field as RGB \(shape "
                                                  r"\(5, 11, 3\)\), or convert the images to greyscale"):
            field.codec.decode(field, pa.array([blobs[0], colours]))


def test_a_palette_png_in_a_dataset_reads_as_opencv_decodes_it(tmp_path: Path) -> None:
    """Through a real dataset (its encoded images copied as they are, as Petastorm's are) and a reader."""
    rng = np.random.default_rng(3)
    blobs = [palette_png(rng.integers(0, 4, (H, W)), rng.integers(0, 256, (4, 3)), depth=2) for _ in range(4)]
    schema = shardkit.Schema([Field("img", "uint8", (H, W, 3), codec=ImageCodec("png"))])
    url = str(tmp_path / "ds")
    table = pa.table({"img": pa.array(blobs, pa.binary())}, schema=schema.storage_schema())
    shardkit.write_dataset(EncodedTables([table]), url, schema=schema)
    with shardkit.make_reader(url, batch_size=4, shuffle=False) as reader:
        (batch,) = list(reader)
    np.testing.assert_array_equal(batch["img"], [opencv(b, cv2.IMREAD_COLOR)[:, :, ::-1] for b in blobs])


# --- 16 bits per sample in a uint8 field -----------------------------------------------------------------


def png16(pixels: np.ndarray) -> bytes:
    """A 16-bit PNG of ``pixels`` (uint16, grey, RGB or RGBA) written by OpenCV (which takes BGR(A))."""
    order = {3: [2, 1, 0], 4: [2, 1, 0, 3]}.get(pixels.shape[2] if pixels.ndim == 3 else 1)
    ok, blob = cv2.imencode(".png", pixels[:, :, order] if order else pixels)
    assert ok
    return bytes(blob.tobytes())


@pytest.mark.parametrize("shape", [(H, W), (H, W, 1), (None, None), (H, W, 3), (None, None, 3), (H, W, 4)])
def test_a_16_bit_png_in_a_uint8_field_is_refused_naming_the_field_its_depth_and_the_fix(
        shape: tuple[int | None, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16-bit grey PNG came out of a uint8 field wrapped (its values modulo 256: noise), a colour one with
    its low bytes dropped (Pillow), without a word. The codec holds 8-bit pixels, so such an image is
    refused by its header, before decoding, naming the fix (convert the images, or store uint16 arrays)."""
    channels = shape[2] if len(shape) == 3 else 1
    deep = np.random.default_rng(5).integers(0, 1 << 16, (H, W, channels) if channels > 1 else (H, W),
                                             dtype=np.uint16)
    eight = np.zeros((H, W, channels) if len(shape) == 3 else (H, W), np.uint8)
    field = Field("img", "uint8", shape, codec=ImageCodec("png"))
    codec = "tensor" if None not in shape else "ndarray"
    column = pa.array([field.codec._encode_one(eight), png16(deep)])
    for use_opencv in (True, False):
        monkeypatch.setattr(image_module, "USE_OPENCV", use_opencv)
        with pytest.raises(ImageShapeError) as raised:
            field.codec.decode(field, column)
        assert str(raised.value) == (
            f"field 'img': row 1 is a 16-bit PNG image by its header (not decoded), but the field holds "
            f"8-bit (uint8) images: read as uint8 it would lose its low bits (or wrap). Convert the images "
            f"to 8 bits, or store the pixels as uint16 arrays (Field('img', 'uint16', {shape}, "
            f"codec={codec!r}))")
        assert isinstance(raised.value, CorruptDatasetError | SchemaMismatchError)  # skippable, as a shape


def test_an_image_of_more_than_8_bits_that_pillow_decodes_is_refused_too() -> None:
    """Formats without a header shardkit reads (a 16-bit TIFF) are sized by Pillow's lazy open: its mode
    tells the bits per sample, refused before the pixels are decoded."""
    buf = io.BytesIO()
    Image.fromarray(np.full((H, W), 40000, np.uint16)).save(buf, format="TIFF")
    field = Field("img", "uint8", (None, None), codec=ImageCodec("png"))
    with pytest.raises(ImageShapeError, match=r"row 0 is a 16-bit TIFF image by its header"):
        field.codec.decode(field, pa.array([buf.getvalue()]))
    eight = io.BytesIO()
    Image.fromarray(np.full((H, W), 200, np.uint8)).save(eight, format="TIFF")
    (pixels,) = field.codec.decode(field, pa.array([eight.getvalue()]))
    np.testing.assert_array_equal(pixels, np.full((H, W), 200, np.uint8))


# --- channels: a field of varying size holds its own, as a fixed-shape one does ------------------------


def pillow_encoded(pixels: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format=fmt)
    return buf.getvalue()


def layouts() -> dict[str, bytes]:
    """Real images of every channel count: PNGs by Pillow and by OpenCV, JPEGs by Pillow."""
    rng = np.random.default_rng(11)
    grey, rgb, rgba = (rng.integers(0, 256, (H, W, c), dtype=np.uint8) for c in (1, 3, 4))
    return {"grey png": pillow_encoded(grey[:, :, 0], "PNG"), "rgb png": pillow_encoded(rgb, "PNG"),
            "rgba png": pillow_encoded(rgba, "PNG"),
            "grey+alpha png": pillow_encoded(rgba[:, :, :2], "PNG", "LA"),
            "grey png (opencv)": bytes(cv2.imencode(".png", grey)[1].tobytes()),
            "rgb png (opencv)": bytes(cv2.imencode(".png", rgb)[1].tobytes()),
            "grey jpeg": pillow_encoded(grey[:, :, 0], "JPEG"), "rgb jpeg": pillow_encoded(rgb, "JPEG")}


CHANNELS = {"grey png": 1, "rgb png": 3, "rgba png": 4, "grey+alpha png": 2, "grey png (opencv)": 1,
            "rgb png (opencv)": 3, "grey jpeg": 1, "rgb jpeg": 3}
LAYOUT = {1: "grey", 2: "grey+alpha", 3: "RGB", 4: "RGBA"}


@pytest.mark.parametrize("dims", [(), (1,), (3,), (4,)])
def test_an_image_of_other_channels_than_its_field_is_refused_in_a_field_of_varying_size_as_in_a_fixed_one(
        dims: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """A grey PNG in a ``(None, None, 3)`` field came out ``(H, W, 1)`` (an RGB one in a grey field
    ``(H, W, 3)``): a batch mixed channel counts, where a fixed-shape field refused the row. Now a field
    of varying size refuses it too, by its header (before decoding), naming the row, what it is and the
    fix; an image of the field's channels decodes to the field's layout, as before."""
    blobs = layouts()
    want = dims[0] if dims else 1
    first = blobs[{1: "grey png", 3: "rgb png", 4: "rgba png"}[want]]  # a row of the field's channels
    for name, blob in blobs.items():
        got_channels = CHANNELS[name]
        outcomes = []
        for shape in ((H, W, *dims), (None, None, *dims), (H, None, *dims)):
            field = Field("img", "uint8", shape, codec=ImageCodec("png"))
            column = pa.array([first, blob])
            if got_channels != want:
                for use_opencv in (True, False):
                    monkeypatch.setattr(image_module, "USE_OPENCV", use_opencv)
                    with pytest.raises(ImageShapeError) as raised:
                        field.codec.decode(field, column)
                    fmt = "JPEG" if "jpeg" in name else "PNG"
                    plural = "s" if got_channels > 1 else ""
                    mode = "L" if want == 1 else LAYOUT[want]
                    assert str(raised.value) == (
                        f"field 'img': row 1 is a {fmt} image of {got_channels} channel{plural} "
                        f"({LAYOUT[got_channels]}) by its header (not decoded), but the field holds "
                        f"{LAYOUT[want]} images of shape {shape}; the row is corrupt or was written for "
                        f"another schema. Rewrite it with the images converted to {LAYOUT[want]} (Pillow: "
                        f"image.convert('{mode}')), or read with on_error='skip'"), (name, shape)
                outcomes.append("refused")
                continue
            reference = np.asarray(Image.open(io.BytesIO(blob)))  # PNG lossless; JPEG: Pillow decodes it
            for decoded in decode_both(field, [blob], monkeypatch):
                assert decoded[0].shape == ((H, W, *dims) if dims else (H, W)), (name, shape)
                np.testing.assert_array_equal(np.reshape(decoded[0], reference.shape), reference)
            outcomes.append("decoded")
        assert len(set(outcomes)) == 1, (name, dims, outcomes)  # fixed and varying sizes agree


def test_a_reader_of_a_field_of_varying_size_never_mixes_channel_counts_in_a_batch(tmp_path: Path) -> None:
    """Through a real dataset (encoded images copied as they are, as other writers store them) and a
    reader: a batch of a ``(None, None, 3)`` field held one ``(H, W, 1)`` image among ``(H, W, 3)`` ones."""
    blobs = layouts()
    schema = shardkit.Schema([Field("img", "uint8", (None, None, 3), codec=ImageCodec("png"))])
    url = str(tmp_path / "ds")
    column = [blobs["rgb png"], blobs["rgb png (opencv)"], blobs["grey png"], blobs["rgb jpeg"]]
    table = pa.table({"img": pa.array(column, pa.binary())}, schema=schema.storage_schema())
    shardkit.write_dataset(EncodedTables([table]), url, schema=schema)
    refused = (r"field 'img': row 2 is a PNG image of 1 channel \(grey\) by its header .* holds RGB images "
               r"of shape \(None, None, 3\)")
    with shardkit.make_reader(url, batch_size=4, shuffle=False) as reader, pytest.raises(
            ImageShapeError, match=refused):
        list(reader)
