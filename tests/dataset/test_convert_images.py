"""`shardkit.dataset.convert` copying encoded images (``shardkit write``): what a write copies, every read
decodes, and what a read decodes, a write copies.

Every image is a real file: written by Pillow or OpenCV, or built chunk by chunk with valid CRCs (the
helpers of `tests.dataset.test_decode_images` and `tests.dataset.test_image_bombs`). The writes are real
`convert` calls on Parquet files of encoded images, or `convert.column`, the step that checks them.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from shardkit import Field, ImageCodec
from shardkit.dataset.codecs import headers
from shardkit.dataset.convert import column, convert
from shardkit.errors import CorruptDatasetError, SchemaMismatchError
from tests.dataset.test_convert import raw_column
from tests.dataset.test_decode_images import palette_png, png16
from tests.dataset.test_image_bombs import one_bit_png, png_claiming

H, W = 5, 11


def encoded(pixels: np.ndarray, fmt: str = "PNG", mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format=fmt)
    return buf.getvalue()


def source(tmp_path: Path, blobs: list[bytes]) -> Path:
    """A Parquet file of ``id`` and ``img``: the encoded images ``blobs``."""
    path = tmp_path / "images.parquet"
    pq.write_table(pa.table({"id": np.arange(len(blobs)), "img": pa.array(blobs, pa.binary())}), path)
    return path


def png_field(shape: tuple[int | None, ...]) -> Field:
    return Field("img", "uint8", shape, codec=ImageCodec("png"))


def test_an_image_past_pillows_limit_but_within_shardkits_is_copied_and_reads(tmp_path: Path) -> None:
    """13380 x 13380 (179 Mpx): past Pillow's error limit, within shardkit's (268 Mpx), which reads
    apply. The write checked it with ``Image.open`` and failed: "no PNG or JPEG image Pillow opens
    (DecompressionBombError)"; it is copied now, and reads back."""
    side = 13380
    assert 2 * Image.MAX_IMAGE_PIXELS < side * side < headers.DEFAULT_MAX_IMAGE_PIXELS  # type: ignore[operator]
    big = one_bit_png(side, side)
    for shape in ((None, None), (side, side)):
        out = tmp_path / f"out{len(shape)}-{shape[0]}"
        ds = convert(source(tmp_path, [big]), out, schema=[png_field(shape)])
        assert raw_column(ds.url, "img") == [big]
    (pixels,) = ds.decode(ds.read_row_group(0))["img"]
    assert pixels.shape == (side, side)
    assert pixels[0, :4].tolist() == [255, 0, 255, 0]


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_a_16_bit_png_is_refused_when_written_naming_the_source_row_and_the_fix(
        tmp_path: Path, channels: int) -> None:
    """A 16-bit RGB(A) PNG was copied (Pillow calls its mode "RGB"), then every read refused it; a grey
    one was refused as "mode I;16", naming no fix. The header's bit depth decides now, at the write,
    naming the source's row and what to do; nothing is written."""
    rng = np.random.default_rng(channels)
    shape = (H, W, channels) if channels > 1 else (H, W)
    eight = [encoded(rng.integers(0, 256, shape, dtype=np.uint8)) for _ in range(3)]
    deep = png16(rng.integers(0, 1 << 16, shape, dtype=np.uint16))
    layout = {1: "grey", 3: "RGB", 4: "RGBA"}[channels]
    for field_shape, codec in ((shape, "tensor"), ((None, None, *shape[2:]), "ndarray")):
        with pytest.raises(SchemaMismatchError) as raised:
            convert(source(tmp_path, [*eight[:2], deep, eight[2]]), tmp_path / "out",
                    schema=[png_field(field_shape)])
        assert str(raised.value).endswith(
            f"field 'img': source row 2 is a PNG image of {H}x{W} pixels, 16-bit {layout}, but the field "
            f"holds PNG images of shape {field_shape} ({layout}), and every read would refuse it (as uint8 "
            f"it would lose its low bits). Convert the images to 8 bits before writing them, or write their "
            f"pixels as uint16 arrays (Field('img', 'uint16', {field_shape}, codec={codec!r}))"), raised.value
        assert not (tmp_path / "out").exists()


def test_palette_pngs_are_copied_where_the_fields_layout_takes_their_colours(tmp_path: Path) -> None:
    """Palette PNGs were refused (Pillow's mode "P"), though reads decode them to their colours in the
    field's layout. Copied now into RGB and RGBA fields, and into a grey field if their pixels are greys;
    one of colours in a grey field is refused, naming the fix, as its read would refuse it."""
    rng = np.random.default_rng(4)
    colours = [palette_png(rng.integers(0, 16, (H, W)), rng.integers(0, 256, (16, 3)), depth=4)
               for _ in range(3)]
    greys = [palette_png(rng.integers(0, 4, (H, W)), np.repeat(rng.integers(0, 256, (4, 1)), 3, axis=1),
                         [255, 0], depth=2) for _ in range(2)]
    for name, (blobs, shape) in {"rgb": (colours, (H, W, 3)), "rgba": (colours + greys, (None, None, 4)),
                                 "grey": (greys, (H, W)), "grey1": (greys, (None, None, 1))}.items():
        ds = convert(source(tmp_path, blobs), tmp_path / name, schema=[png_field(shape)])
        assert raw_column(ds.url, "img") == blobs
        decoded = ds.decode(ds.read_row_group(0))["img"]
        assert [np.shape(d) for d in decoded] == [(H, W, *shape[2:])] * len(blobs), name
    with pytest.raises(SchemaMismatchError) as raised:
        convert(source(tmp_path, [*greys, colours[0]]), tmp_path / "bad", schema=[png_field((None, None))])
    assert str(raised.value).endswith(
        f"field 'img': source row 2 is a PNG image of {H}x{W} pixels, 4-bit palette, but the field holds PNG "
        "images of shape (None, None) (grey), and every read would refuse it: its colours are not greys. "
        "Declare the field as RGB (shape (None, None, 3)), or convert the images to grey before writing "
        "them (Pillow: image.convert('L'))"), raised.value
    assert not (tmp_path / "bad").exists()


def test_an_image_past_shardkits_limit_is_refused_when_written(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The pixel limit of fields of varying size was not checked when writing: such an image was written
    and refused by every read. The header says its size (no decoding), refused at the write with the
    setting to raise; a fixed-shape field checks the size exactly instead, as reads do."""
    monkeypatch.setattr(headers, "MAX_IMAGE_PIXELS", 54)
    small, large = encoded(np.zeros((6, 9, 3), np.uint8)), encoded(np.zeros((6, 10, 3), np.uint8))
    with pytest.raises(SchemaMismatchError) as raised:
        convert(source(tmp_path, [small, large]), tmp_path / "out", schema=[png_field((None, None, 3))])
    assert str(raised.value).endswith(
        "field 'img': source row 1 is a PNG image of 6x10 pixels, 8-bit RGB: its PNG header claims 10 x 6 "
        "pixels (60), more than the limit of 54 for images of varying size: it is corrupt or a "
        "decompression bomb, and was not decoded. If such images are real, raise the limit: "
        "SHARDKIT_MAX_IMAGE_PIXELS=60 in the environment, or shardkit.dataset.codecs.headers."
        "MAX_IMAGE_PIXELS (set where the dataset is read too: every read checks it)"), raised.value
    assert not (tmp_path / "out").exists()
    bomb = png_claiming(60000, 60000)  # a few bytes claiming 3.6 gigapixels: refused, never decoded
    monkeypatch.setattr(headers, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(SchemaMismatchError, match=r"source row 0 is a PNG image of 60000x60000 pixels, "
                                                  r"8-bit RGB: its PNG header claims .* limit of 268435456 "):
        convert(source(tmp_path, [bomb]), tmp_path / "out", schema=[png_field((None, None, 3))])
    monkeypatch.setattr(headers, "MAX_IMAGE_PIXELS", 54)
    ds = convert(source(tmp_path, [large]), tmp_path / "fixed", schema=[png_field((6, 10, 3))])
    assert ds.decode(ds.read_row_group(0))["img"].shape == (1, 6, 10, 3)


def test_bytes_that_are_no_image_pillow_opens_are_refused_naming_the_row(tmp_path: Path) -> None:
    """A guard (so before too): a PNG cut short, and bytes of no image format."""
    good = encoded(np.zeros((H, W, 3), np.uint8))
    for bad in (good[:40], b"not an image"):
        with pytest.raises(SchemaMismatchError) as raised:
            convert(source(tmp_path, [good, bad]), tmp_path / "out", schema=[png_field((None, None, 3))])
        assert str(raised.value).endswith(
            "field 'img': source row 1 is no PNG or JPEG image Pillow opens (UnidentifiedImageError), but "
            "the field holds PNG images of shape (None, None, 3) (RGB); declare the column as what it "
            "holds"), raised.value


# --- what a write copies, every read decodes ---------------------------------------------------------


def corpus() -> dict[str, bytes]:
    """Real images of every layout a PNG or JPEG takes, 8 bits and not."""
    rng = np.random.default_rng(9)
    grey, rgb, rgba = (rng.integers(0, 256, (H, W, c), dtype=np.uint8) for c in (1, 3, 4))
    cmyk = io.BytesIO()
    Image.fromarray(rgba, "CMYK").save(cmyk, format="JPEG")
    return {
        "grey": encoded(grey[:, :, 0]), "rgb": encoded(rgb), "rgba": encoded(rgba),
        "grey+alpha": encoded(rgba[:, :, :2], mode="LA"), "1-bit": one_bit_png(W, H),
        "16-bit grey": png16(grey[:, :, 0].astype(np.uint16) * 257),
        "16-bit rgb": png16(rgb.astype(np.uint16) * 257),
        "palette": palette_png(rng.integers(0, 16, (H, W)), rng.integers(0, 256, (16, 3)), depth=4),
        "palette of greys": palette_png(rng.integers(0, 4, (H, W)), np.repeat([[0], [80], [160], [255]], 3,
                                                                               axis=1), depth=2),
        "palette with alpha": palette_png(rng.integers(0, 4, (H, W)), rng.integers(0, 256, (4, 3)),
                                          [9, 99]),
        "grey jpeg": encoded(grey[:, :, 0], "JPEG"), "rgb jpeg": encoded(rgb, "JPEG"),
        "cmyk jpeg": cmyk.getvalue(),
    }


FIELDS = [Field("img", "uint8", (*hw, *c), codec=ImageCodec(fmt)) for fmt, channels in
          (("png", ((), (1,), (3,), (4,))), ("jpeg", ((), (1,), (3,)))) for c in channels
          for hw in ((H, W), (None, None), (H, None))]


def outcome(call: Any, *args: Any) -> str:
    try:
        call(*args)
    except (SchemaMismatchError, CorruptDatasetError) as e:
        return f"refused: {type(e).__name__}"
    return "ok"


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f"{f.codec.format}{f.shape}")
def test_what_a_write_copies_every_read_decodes_and_what_reads_decode_a_write_copies(field: Field) -> None:
    """For every image of `corpus` in a field of its format: the write (`convert.column`) copies it if and
    only if the field's codec decodes it. Before, a write copied 16-bit RGB PNGs no read decodes, and
    refused palette and 1-bit PNGs every read decodes."""
    fmt = field.codec.format.upper()
    for name, blob in corpus().items():
        if headers.claim(blob).format != fmt:  # type: ignore[union-attr]
            continue  # (a write refuses another format; a read decodes what Pillow does)
        values = pa.array([blob], pa.binary())
        written = outcome(column, None, field, values)
        read = outcome(field.codec.decode, field, values)
        assert (written == "ok") == (read == "ok"), (name, written, read)
        if written == "ok":
            (pixels,) = field.codec.decode(field, column(None, field, values))
            assert pixels.shape == (H, W, *field.shape[2:]), name
