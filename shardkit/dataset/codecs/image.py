"""Image codec: uint8 pixels stored as PNG (lossless) or JPEG bytes, decoded on read.

Encoding and decoding run in a thread pool, one task per slice of `IMAGE_SLICE` images (a task per
image costs as much as decoding a small one). PNG uses zlib level 1 (Petastorm's OpenCV default too):
on training images it gives nearly the size of level 6 at several times the speed.

Decoding, for a fixed-shape field: the 8-bit PNGs filtered as OpenCV (hence Petastorm) writes them
are decoded a slice at a time by `shardkit.dataset.codecs._png` (numpy, and one inflate call per
image: faster than OpenCV). The rest of PNG goes through OpenCV's ``cv2.imdecode`` when ``cv2``
is importable (``pip install 'shardkit[image]'``, which also brings ``isal``'s faster inflate): it
releases the GIL for the whole decode and is much faster than Pillow on small images, whose
cost is mostly Pillow's Python-level parsing. PNG is lossless, so all three give the same pixels;
OpenCV is used only for 8-bit grey, RGB and RGBA PNGs and only where its result has the expected
layout, every other image (JPEG, whose decoders may differ by a rounding, palettes, transparency keys)
goes through Pillow. Where Pillow's layout is not libpng's, the pixels are made libpng's (OpenCV's, so
Petastorm's): a 1-bit image is 0 and 255, not booleans; a palette image is its colours in the field's
layout, not its indices (`_palette_colours`). Images of more than 8 bits per sample (16-bit PNGs) are
refused by their header, naming the fix: the field holds uint8 (see `headers.check_image`); so are
images of other channels than the field's, in a field of varying size as in a fixed-shape one (a grey
image in an RGB field is not expanded as OpenCV's ``IMREAD_COLOR`` would: see `headers`).

Nothing is decoded before its header is checked (`shardkit.dataset.codecs.headers`): an image of a
fixed-shape field must be the field's size, an image of varying size at most
`headers.max_image_pixels()` pixels, so a few crafted bytes claiming gigapixels never reach a decoder.
That limit is the only one: Pillow's own (``PIL.Image.MAX_IMAGE_PIXELS``, an error past 179 Mpx) is
not applied to the images decoded here (`open_image`), and an image past OpenCV's (2**30 pixels, for a
raised shardkit limit) goes to Pillow; neither library's setting is changed for the rest of the process.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa

from shardkit.dataset.codecs import _png as png
from shardkit.dataset.codecs import headers
from shardkit.dataset.codecs.base import (
    ArrowColumn,
    Codec,
    as_masked,
    combine,
    is_bytes_type,
    is_text_type,
    mask_of,
    null_error,
)
from shardkit.dataset.codecs.tensor import rows_of, stack_rows
from shardkit.errors import CorruptDatasetError, ImageShapeError, SchemaError, SchemaMismatchError

if TYPE_CHECKING:
    from PIL.Image import Image
    from PIL.ImageFile import ImageFile

    from shardkit.dataset._field import Field

_MODES = {(2, 1): "L", (3, 1): "L", (3, 3): "RGB", (3, 4): "RGBA"}
IMAGE_SLICE = 256  # images per thread-pool task when decoding a column
USE_OPENCV = True  # decode PNG with OpenCV when it is installed (see the module docstring)
USE_INFLATE = True  # decode the 8-bit PNGs `png.decode_pngs` takes with it (fixed-shape fields)
_PNG_CHANNELS = {t: c for c, t in png.COLOUR_TYPE.items()}  # colour type -> channels OpenCV returns
_FROM_BGR: dict[int, Any] = {3: np.s_[::-1], 4: [2, 1, 0, 3]}  # channels -> last-axis index: BGR(A) to RGB(A)


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="shardkit-image")


@cache
def _opencv_decode() -> Callable[[np.ndarray, int], np.ndarray | None] | None:
    try:
        import cv2
    except ImportError:
        return None
    flag = cv2.IMREAD_UNCHANGED

    def decode(blob: np.ndarray, channels: int) -> np.ndarray | None:
        try:
            pixels = cv2.imdecode(blob, flag)
        except cv2.error:  # past OpenCV's own limit (2**30 pixels), which shardkit's may be raised above
            return None
        got = 0 if pixels is None else pixels.shape[2] if pixels.ndim == 3 else 1
        if pixels is None or pixels.dtype != np.uint8 or got != channels:
            return None
        return pixels[..., _FROM_BGR[channels]] if channels in _FROM_BGR else pixels  # OpenCV's BGR(A)

    return decode


def decode_image(data: bytes | np.ndarray, field: Field, row: int = 0, limit: int | None = None
                 ) -> np.ndarray:
    """Decode one PNG/JPEG blob, row ``row`` of its column, to a numpy array in the field's layout (HxW or
    HxWxC), once its header passed `headers.check_image` (``limit``: `headers.max_image_pixels()`)."""
    blob = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data
    limit = headers.max_image_pixels() if limit is None else limit
    found = headers.claim(blob)
    if found is not None:
        headers.check_image(field, row, found, limit)
    pixels = _opencv_png(blob) if found is not None and found.format == "PNG" else None
    if pixels is None:
        pixels = _pillow(blob.tobytes(), field, row, limit)
    if len(field.shape) == 3 and pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return pixels


def _opencv_png(blob: np.ndarray) -> np.ndarray | None:
    """The pixels of an 8-bit grey/RGB/RGBA PNG (by its header: `headers.claim`) by OpenCV, or None (not
    such a PNG, no OpenCV)."""
    if not USE_OPENCV or len(blob) < 33 or blob[24] != 8:
        return None
    channels = _PNG_CHANNELS.get(int(blob[25]))
    decode = _opencv_decode() if channels else None
    return None if decode is None or channels is None else decode(blob, channels)


def _pillow(data: bytes, field: Field, row: int, limit: int) -> np.ndarray:
    try:
        with open_image(data) as im:  # lazy: it reads the header only, whatever the format
            headers.check_image(field, row, pillow_claim(im), limit)
            im.load()
            pixels = _palette_colours(im, field, row) if im.mode in ("P", "PA") else np.asarray(im)
    except CorruptDatasetError:  # refused by its header, or a palette of colours in a grey field
        raise
    except Exception as e:  # Pillow raises many types for bad bytes
        raise CorruptDatasetError(
            f"field {field.name!r}: an image could not be decoded ({type(e).__name__}: {e}); "
            "the file is corrupt or was not written as PNG/JPEG"
        ) from e
    if pixels.dtype == np.bool_:  # a 1-bit image (Pillow's mode "1"): 0 and 255, as libpng expands it
        pixels = np.multiply(pixels, 255, dtype=np.uint8)
    return pixels


def _palette_colours(im: Image, field: Field, row: int) -> np.ndarray:
    """A palette image's colours in the field's layout, as libpng (OpenCV, Petastorm's decoder) expands a
    palette; Pillow would give its indices.

    RGB: each index's colour (the palette's alpha, if any, left out, as ``cv2.IMREAD_COLOR`` leaves
    it). RGBA: the colour and its alpha from the ``tRNS`` chunk, 255 for the entries it does not cover
    (PNG's rule; OpenCV gives 3 channels where there is no ``tRNS``, the same colours). Grey: the
    colours when every pixel's is a grey (R = G = B, exact; alpha left out, as ``cv2.IMREAD_GRAYSCALE``
    leaves it); a palette image with other colours is refused (`ImageShapeError`), as an RGB PNG in a
    grey field is: turning colour into grey is a choice (which weights?) for the user to make when
    converting, not one a reader makes silently.
    """
    channels = field.shape[2] if len(field.shape) == 3 else 1
    rgba = np.asarray(im.convert("RGBA"))  # to "RGB", Pillow warns about a tRNS of alphas
    if channels in (3, 4):
        return rgba if channels == 4 else np.ascontiguousarray(rgba[:, :, :3])
    rgb = rgba[:, :, :3]
    grey = rgb[:, :, 0]
    if (rgb[:, :, 1] == grey).all() and (rgb[:, :, 2] == grey).all():
        return grey
    raise ImageShapeError(
        f"field {field.name!r}: row {row} is a {im.format} palette image of colours (not greys), but the "
        f"field holds greyscale images of shape {field.shape}. Declare the field as RGB (shape "
        f"{(*field.shape[:2], 3)}), or convert the images to greyscale"
    )


def pillow_claim(im: ImageFile) -> headers.Claim:
    """What an image opened by `open_image` is, as `headers.claim` says it from a PNG's or a JPEG's header
    (before ``load()``): its format, size, channels, bits per sample (by its mode: ``"I;16"`` 16, ``"1"``
    8, as libpng expands it) and whether it is a palette image (modes ``"P"``, ``"PA"``)."""
    from PIL import ImageMode

    bits = 8 * np.dtype(ImageMode.getmode(im.mode).typestr).itemsize
    return headers.Claim(im.format or "image", im.height, im.width, len(im.getbands()), bits,
                         im.mode in ("P", "PA"))


def open_image(data: bytes) -> ImageFile:
    """``data`` opened by Pillow, lazily (its header read, its pixels not), with no size limit of Pillow's.

    As ``PIL.Image.open`` opens it (each registered format whose prefix check accepts the bytes, the
    common ones first), but without its ``_decompression_bomb_check``: that compares the size with
    ``PIL.Image.MAX_IMAGE_PIXELS`` (a warning past 89 Mpx, an error past 179 Mpx), so an image that
    shardkit's limit (`headers.max_image_pixels`, raised or not: 268 Mpx by default) lets through was
    refused by Pillow's. The caller checks the size against shardkit's limit before ``load()``; Pillow's
    global is neither changed nor read. Plugins that check a size themselves (a GIF's or an MPO's later
    frames, TIFF tiles) still do.

    Example:
        >>> with open_image(blob) as im:
        ...     headers.check_image(field, row, pillow_claim(im), limit)
        ...     im.load()
    """
    from PIL import Image, UnidentifiedImageError

    prefix = data[:16]
    for load_plugins in (Image.preinit, Image.init):  # as Image.open: the common formats, then all
        load_plugins()
        for name in list(Image.ID):
            factory, accept = Image.OPEN[name]
            accepted = accept is None or accept(prefix)
            if not accepted or isinstance(accepted, str):  # a str: a format it is not (Pillow's warning)
                continue
            try:
                return factory(io.BytesIO(data), "")
            except (SyntaxError, IndexError, TypeError, struct.error):  # not this format, as Image.open
                continue
    raise UnidentifiedImageError("cannot identify image file")


@dataclasses.dataclass(frozen=True)
class ImageCodec(Codec):
    """Images as compressed bytes: ``ImageCodec("png")`` (lossless) or ``ImageCodec("jpeg", quality=90)``.

    The field's shape is ``(H, W)`` (grayscale) or ``(H, W, C)`` with C in 1, 3, 4 (JPEG: 1 or 3);
    H and W may be None for images of varying size, which then decode to an object array.
    """

    name = "image"
    format: Literal["png", "jpeg"] = "png"
    quality: int = 95

    def __post_init__(self) -> None:
        if self.format not in ("png", "jpeg"):
            raise SchemaError(f"image codec format {self.format!r} is not supported; use 'png' or 'jpeg'")
        if not 1 <= int(self.quality) <= 100:
            raise SchemaError(f"image codec quality {self.quality!r} is outside 1..100")

    def check(self, field: Field) -> None:
        if field.dtype != np.uint8:
            raise SchemaError(
                f"field {field.name!r}: images hold uint8 pixels, not {field.dtype}; "
                "scale the data to uint8 or store it with codec='tensor'"
            )
        channels = field.shape[2] if len(field.shape) == 3 else 1
        if (len(field.shape), channels) not in _MODES or (self.format == "jpeg" and channels == 4):
            raise SchemaError(
                f"field {field.name!r}: image shape {field.shape} is not (H, W) or (H, W, C) with C in "
                f"1, 3, 4 ({self.format} supports {'1 or 3' if self.format == 'jpeg' else '1, 3 or 4'})"
            )
        if 0 in field.shape:
            raise SchemaError(
                f"field {field.name!r}: image shape {field.shape} has a dimension of size 0, and PNG and "
                "JPEG cannot hold an empty image; give the height and width as positive sizes (or None)"
            )

    def arrow_type(self, field: Field) -> pa.DataType:
        return pa.binary()

    def stored_problem(self, field: Field, stored: pa.DataType) -> str | None:
        """Encoded images are bytes (a string column is read as its bytes too, as `decode` does)."""
        if is_bytes_type(stored) or is_text_type(stored):
            return None
        return f"encoded images cannot be read from a column of type {stored}"

    def _encode_one(self, pixels: np.ndarray) -> bytes:
        from PIL import Image

        if pixels.ndim == 3 and pixels.shape[2] == 1:
            pixels = pixels[:, :, 0]
        buf = io.BytesIO()
        image = Image.fromarray(np.ascontiguousarray(pixels))
        if self.format == "png":
            image.save(buf, format="PNG", compress_level=1)
        else:
            image.save(buf, format="JPEG", quality=int(self.quality))
        return buf.getvalue()

    def encode(self, field: Field, values: Any) -> pa.Array:
        rows = rows_of(values)
        if all(d is not None for d in field.shape):
            stacked, mask = stack_rows(field, rows, "writing")
            images: list[np.ndarray | None] = [None if mask is not None and mask[i] else stacked[i]
                                               for i in range(len(rows))]
        else:
            images = [None if v is None else self._checked(field, np.asarray(v), i)
                      for i, v in enumerate(rows)]
            if not field.nullable and any(v is None for v in images):
                raise null_error(field, next(i for i, v in enumerate(images) if v is None), "writing")
        blobs = list(_pool().map(lambda a: None if a is None else self._encode_one(a), images))
        return pa.array(blobs, type=pa.binary())

    def _checked(self, field: Field, a: np.ndarray, row: int) -> np.ndarray:
        ok = a.ndim == len(field.shape) and all(
            d is None or d == s for d, s in zip(field.shape, a.shape, strict=True)
        )
        if not ok or a.dtype != np.uint8:
            raise SchemaMismatchError(
                f"field {field.name!r} declares uint8 images of shape {field.shape} but row {row} is "
                f"{a.dtype} {a.shape}; convert or resize the image"
            )
        return a

    def decode(self, field: Field, column: ArrowColumn) -> np.ndarray:
        return decode_images(field, column)


def decode_images(field: Field, column: ArrowColumn) -> np.ndarray:
    """Decode a column of PNG/JPEG blobs; stacked to ``(n, *shape)`` when the field's shape is fixed."""
    arr = combine(column)
    if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):  # views, strings
        arr = arr.cast(pa.large_binary() if pa.types.is_large_string(arr.type) else pa.binary())
    nulls = mask_of(arr)
    n = len(arr)
    _validity, offsets_buf, data_buf = arr.buffers()
    offset_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(offsets_buf, offset_type)[arr.offset : arr.offset + n + 1]
    data = np.zeros(0, np.uint8) if data_buf is None else np.frombuffer(data_buf, np.uint8)
    fixed = all(d is not None for d in field.shape)
    shape = field.dims
    if not fixed:
        out = np.empty(n, dtype=object)
    else:  # rows left as they are (nulls) are zeros
        out = np.zeros((n, *shape), np.uint8) if nulls is not None else np.empty((n, *shape), np.uint8)

    fast = _fast_png(field, shape) if fixed else None
    limit = 0 if fixed else headers.max_image_pixels()  # a fixed shape is checked exactly instead

    def run(lo: int, hi: int) -> None:
        rows: Any = range(lo, hi)
        if fast is not None:
            rows = fast(data, offsets, lo, hi, nulls=nulls, out=out)  # the rows it left to the general path
        for i in rows:
            if nulls is not None and nulls[i]:
                continue
            im = decode_image(data[offsets[i] : offsets[i + 1]], field, i, limit)
            if im.ndim != len(field.shape) or any(
                    d not in (None, g) for d, g in zip(field.shape, im.shape, strict=True)):
                raise ImageShapeError(  # a layout its header did not tell (`headers.check_image`: the rest)
                    f"field {field.name!r}: row {i} decodes to an image of shape {im.shape}, "
                    f"but the schema declares {field.shape}"
                )
            out[i] = im

    cuts = list(range(0, n, IMAGE_SLICE))
    if len(cuts) > 1:
        list(_pool().map(lambda lo: run(lo, min(n, lo + IMAGE_SLICE)), cuts))
    else:
        run(0, n)
    return as_masked(out, nulls) if fixed else out


FastPng = Callable[..., np.ndarray]  # (data, offsets, lo, hi, *, nulls, out) -> rows left


def _fast_png(field: Field, shape: tuple[int, ...]) -> FastPng | None:
    """For a fixed-shape 8-bit grey/RGB/RGBA field: decode rows ``[lo, hi)`` straight into ``out`` and
    return the rows left for the general path (None: no fast path for this shape).

    First `png.decode_pngs` (headers checked for the whole slice with numpy, each image inflated by one
    call, the slice unfiltered together: faster than OpenCV on small images); the images it does not
    take go to OpenCV when it is installed, whose slice-wide checks replace `_opencv_png`'s per image,
    its pixels landing in one scratch array that changes channel order (OpenCV's BGR) in one copy; what
    is left after both goes to the general path.
    """
    if len(shape) not in (2, 3):
        return None
    channels = shape[2] if len(shape) == 3 else 1
    if channels not in png.COLOUR_TYPE:
        return None
    height, width = shape[0], shape[1]
    use_opencv = USE_OPENCV and _opencv_decode() is not None
    if not (USE_INFLATE or use_opencv):
        return None
    cv_shape = shape[:2] if channels == 1 else shape
    swap = _FROM_BGR.get(channels)

    def opencv(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, done: np.ndarray, *, lo: int,
               out: np.ndarray) -> None:
        """OpenCV for the images not ``done`` that look like 8-bit PNGs of the field's colour type."""
        todo = ~done & (ends - starts >= 33)
        head = data[np.where(todo, starts, 0)[:, None] + np.arange(26)]  # up to IHDR's colour type
        todo &= png.ihdr_matches(head, (height, width, channels))
        picked = np.flatnonzero(todo)
        if not len(picked):
            return
        import cv2

        scratch = np.empty((len(picked), *cv_shape), np.uint8)
        good = np.zeros(len(picked), bool)
        for j, k in enumerate(picked.tolist()):
            try:
                pixels = cv2.imdecode(data[starts[k] : ends[k]], cv2.IMREAD_UNCHANGED)
            except cv2.error:  # past OpenCV's limit: left to the general path (Pillow), as undecoded
                continue
            if pixels is not None and pixels.dtype == np.uint8 and pixels.shape == cv_shape:
                scratch[j] = pixels
                good[j] = True
        pixels = scratch[good]
        if swap is not None:
            pixels = pixels[..., swap]
        out[lo + picked[good]] = pixels.reshape(-1, *shape)
        done[picked[good]] = True

    def run(data: np.ndarray, offsets: np.ndarray, lo: int, hi: int, *, nulls: np.ndarray | None,
            out: np.ndarray) -> np.ndarray:
        starts = offsets[lo:hi].astype(np.int64)
        ends = offsets[lo + 1 : hi + 1].astype(np.int64)
        if len(data) < 33:
            return lo + np.flatnonzero(np.ones(hi - lo, bool) if nulls is None else ~nulls[lo:hi])
        ok = np.zeros(hi - lo, bool)
        if USE_INFLATE:
            pixels, ok = png.decode_pngs(data, starts, ends, (height, width, channels))
            if nulls is not None:
                ok &= ~nulls[lo:hi]
            if ok.all():
                out[lo:hi] = pixels.reshape(hi - lo, *shape)
            elif ok.any():
                got = np.flatnonzero(ok)
                out[lo + got] = pixels[got].reshape(len(got), *shape)
        done = ok if nulls is None else ok | nulls[lo:hi]  # nulls stay as they are
        if use_opencv and not done.all():
            opencv(data, starts, ends, done, lo=lo, out=out)
        return lo + np.flatnonzero(~done)

    return run
