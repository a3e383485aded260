"""Image codec: uint8 pixels stored as PNG (lossless) or JPEG bytes, decoded on read.

Encoding and decoding run in a thread pool, one task per slice of `IMAGE_SLICE` images (a task per
image costs as much as decoding a small one). PNG uses zlib level 1 (Petastorm's OpenCV default too):
on training images it gives nearly the size of level 6 at several times the speed.

Images that are PNG or JPEG already (``bytes``, ``bytearray``, ``memoryview`` values, an Arrow binary
column) are written as they are, never decoded or encoded again, once their headers pass the checks a
read makes (`encoded_problem`): the field's format, size (or `headers.max_image_pixels()` where it
varies), channels and 8 bits. A column may mix them with pixels, value by value. A numpy array is always
pixels (`ImageCodec.encode`).

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

from shardkit.dataset.codecs import _jpeg, headers
from shardkit.dataset.codecs import _png as png
from shardkit.dataset.codecs.base import (
    ArrowColumn,
    Codec,
    as_masked,
    combine,
    first_null,
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
IMAGE_SLICE = 64  # images per thread-pool task when decoding a column
USE_OPENCV = True  # decode PNG with OpenCV when it is installed (see the module docstring)
USE_INFLATE = True  # decode the 8-bit PNGs `png.decode_pngs` takes with it (fixed-shape fields)
_PNG_CHANNELS = {t: c for c, t in png.COLOUR_TYPE.items()}  # colour type -> channels OpenCV returns
_FROM_BGR: dict[int, Any] = {3: np.s_[::-1], 4: [2, 1, 0, 3]}  # channels -> last-axis index: BGR(A) to RGB(A)


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="shardkit-image")


# A forked child (a DataLoader worker) makes its own pool: the parent's would take its tasks and never run
# them, its threads being the parent's
os.register_at_fork(after_in_child=_pool.cache_clear)


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
            try:
                accepted = accept is None or accept(prefix)
            except (struct.error, IndexError):  # a prefix too short for its check (DIB's on b""): not it
                continue
            if not accepted or isinstance(accepted, str):  # a str: a format it is not (Pillow's warning)
                continue
            try:
                return factory(io.BytesIO(data), "")
            except (SyntaxError, IndexError, TypeError, struct.error):  # not this format, as Image.open
                continue
    raise UnidentifiedImageError("cannot identify image file")


Given = Literal["column", "values"]  # encoded images of a file's column (convert), or values to write


def copy_encoded(field: Field, arr: pa.Array, *, given: Given = "column") -> pa.Array:
    """Encoded images as binary, as they are (never decoded, never encoded again), each checked as every
    read of the field checks it (`encoded_problem`), so that what is written reads: an image a read
    refuses is refused here, naming the row and the fix, before anything is committed, not at every read
    after. ``given``: what the images are, for the fix a message names (`encoded_problem`)."""
    if not (is_bytes_type(arr.type) or is_text_type(arr.type) or pa.types.is_null(arr.type)):
        raise SchemaMismatchError(f"field {field.name!r} is declared as images, but its column holds "
                                  f"{arr.type}, not encoded images; declare it as what it holds")
    arr = arr.cast(pa.binary())
    if arr.null_count and not field.nullable:
        raise null_error(field, first_null(arr), "writing")
    limit = headers.max_image_pixels()
    for i, blob in enumerate(arr.to_pylist()):
        problem = None if blob is None else encoded_problem(field, blob, i, limit, given=given)
        if problem is not None:
            raise SchemaMismatchError(f"field {field.name!r}: row {i} is {problem}")
    return arr


def encoded_problem(field: Field, blob: bytes, row: int, limit: int, *, given: Given = "column"
                    ) -> str | None:
    """Why the encoded image ``blob`` (row ``row``) cannot be stored as it is in image field ``field``;
    None: it can.

    By its header (`headers.claim`: bits per sample and colour type as stored, where Pillow's mode says
    "RGB" for a 16-bit RGB PNG too; Pillow's lazy `open_image` for the rest), without Pillow's own
    pixel limit (179 Mpx: shardkit's, ``limit``, is the one reads apply), and with the rules of
    `headers.check_image`: the field's format and size, 8 bits, at most ``limit`` pixels where the size
    varies, the field's channels. A palette image is decoded to the field's layout on read, so it is
    taken in RGB and RGBA fields; in a grey one only if its pixels are greys, which only decoding tells
    (`decode_image`, as a read: the one image decoded here). Opening checks the bytes Pillow parses
    before the pixels; the pixels themselves are not decoded (that would cost a read).

    An image in another format than the field's (a PNG in a JPEG field) is refused: every stored value of
    a field is in its codec's format, which a decoder elsewhere (``decode=False``) may rely on. The fix
    named for it, and for bytes that are no image, depends on what the bytes were ``given`` as: a column
    of a file (`shardkit.dataset.convert`: declare the column as it is) or values to write
    (`write_dataset`: or give the image's pixels, for the codec to encode).
    """
    fmt, shape = getattr(field.codec, "format", "").upper(), field.shape
    channels = headers.field_channels(field)
    holds = f"the field holds {fmt} images of shape {shape} ({headers.LAYOUTS[channels]})"
    claimed = headers.claim(blob)
    try:
        with open_image(blob) as im:  # lazy: what Pillow parses before the pixels
            found = pillow_claim(im) if claimed is None else claimed
    except OSError as e:  # Pillow's for bytes of no format it knows, or cut short
        fix = ("declare the column as what it holds" if given == "column" else
               f"give an encoded {fmt} image as bytes, or the image's pixels as a uint8 numpy array")
        return f"no PNG or JPEG image Pillow opens ({type(e).__name__}), but {holds}; {fix}"
    got = f"a {found.format} image of {found.height}x{found.width} pixels, {found.bits}-bit {found.layout}"
    if found.format != fmt:
        if given == "column":
            return f"{got}, but {holds}; declare it as the images are"
        other = {"PNG": "png", "JPEG": "jpeg"}.get(found.format)
        declare = f"declare the field with ImageCodec({other!r}) if its images are, or " if other else ""
        return (f"{got}, but {holds}, and encoded images are stored as they are, never encoded again; "
                f"{declare}give this image's pixels (a uint8 numpy array) for the field's codec to encode "
                f"as {fmt}")
    if shape[0] not in (None, found.height) or shape[1] not in (None, found.width):
        fix = ("declare it as the images are" if given == "column" else
               "resize the image before encoding it, or declare the field's height and width as None "
               "(images of varying size)")
        return f"{got}, but {holds}; {fix}"
    refused = f"{got}, but {holds}, and every read would refuse it"
    if found.bits > 8:
        codec = "tensor" if field.fixed_shape else "ndarray"
        return (f"{refused} (as uint8 it would lose its low bits). Convert the images to 8 bits before "
                f"writing them, or write their pixels as uint16 arrays (Field({field.name!r}, 'uint16', "
                f"{shape}, codec={codec!r}))")
    problem = headers.over_limit(found, limit) if None in shape[:2] else None
    if problem is not None:
        return f"{got}: {problem} (set where the dataset is read too: every read checks it)"
    layout = headers.LAYOUTS[channels]
    convert_to = (f"convert the images to {layout} before writing them (Pillow: "
                  f"image.convert({'L' if channels == 1 else layout!r}))")
    if found.palette and channels == 1:
        try:
            decode_image(blob, field, row, limit)
        except ImageShapeError:
            return (f"{refused}: its colours are not greys. Declare the field as RGB (shape "
                    f"{(*shape[:2], 3)}), or {convert_to}")
        except CorruptDatasetError as e:
            return f"{got} that does not decode ({e})"
    elif found.channels != channels and not found.palette:
        declared = (*shape[:2], found.channels)  # (a grey image here: a field of 3 dimensions)
        fits = found.channels in (1, 3) or (found.channels == 4 and fmt == "PNG")
        declare = f"declare the field's shape as {declared} if all its images are, or " if fits else ""
        return f"{refused} (the field's images must stack); {declare}{convert_to}"
    return None


@dataclasses.dataclass(frozen=True)
class ImageCodec(Codec):
    """Images as compressed bytes: ``ImageCodec("png")`` (lossless) or ``ImageCodec("jpeg", quality=90)``.

    The field's shape is ``(H, W)`` (grayscale) or ``(H, W, C)`` with C in 1, 3, 4 (JPEG: 1 or 3);
    H and W may be None for images of varying size, which then decode to an object array. Values written
    are pixels (uint8 arrays), which the codec encodes, or images in its format already (``bytes``), which
    are stored as they are (`encode`).
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
        """Pixels (uint8 arrays in the field's shape) encoded in the codec's format, and images encoded
        already (``bytes``, ``bytearray``, ``memoryview`` values, an Arrow binary column) stored as they
        are, each checked by its header first (`encoded_problem`); a column may mix both, row by row.

        A numpy array is always pixels: a 1-D uint8 array holding a PNG or JPEG is refused, naming
        ``a.tobytes()`` (OpenCV's ``imencode`` gives such arrays; an ``(N, 1)`` one could be a grey image).
        """
        if isinstance(values, pa.Array | pa.ChunkedArray) and is_bytes_type(values.type):
            return copy_encoded(field, combine(values), given="values")
        rows = rows_of(values)
        stored = self._stored(field, rows)
        if stored and len(stored) == len(rows):
            return pa.array(list(stored.values()), type=pa.binary())
        if stored:  # the stored rows' pixels' place in the checks below, dropped before encoding
            placeholder = np.zeros(tuple(d or 1 for d in field.shape), np.uint8)
            rows = [placeholder if i in stored else v for i, v in enumerate(rows)]
        if all(d is not None for d in field.shape):
            stacked, mask = stack_rows(field, rows, "writing")
            images: list[np.ndarray | None] = [None if mask is not None and mask[i] else stacked[i]
                                               for i in range(len(rows))]
        else:
            images = [None if v is None else self._checked(field, np.asarray(v), i)
                      for i, v in enumerate(rows)]
            if not field.nullable and any(v is None for v in images):
                raise null_error(field, next(i for i, v in enumerate(images) if v is None), "writing")
        for i in stored:
            images[i] = None
        blobs = list(_pool().map(lambda a: None if a is None else self._encode_one(a), images))
        for i, blob in stored.items():
            blobs[i] = blob
        return pa.array(blobs, type=pa.binary())

    def _stored(self, field: Field, rows: list[Any]) -> dict[int, bytes]:
        """The rows of ``rows`` that are encoded images, as ``bytes``, once their headers passed
        `encoded_problem`; raise `SchemaMismatchError` for one that does not, and for values that are
        neither pixels nor bytes (text; a 1-D uint8 array holding a PNG or JPEG)."""
        stored: dict[int, bytes] = {}
        limit = headers.max_image_pixels()
        for i, v in enumerate(rows):
            if isinstance(v, bytes | bytearray | memoryview):
                blob = v if type(v) is bytes else bytes(v)
                problem = encoded_problem(field, blob, i, limit, given="values")
                if problem is not None:
                    raise SchemaMismatchError(f"field {field.name!r}: row {i} is {problem}")
                stored[i] = blob
            elif isinstance(v, str):
                raise SchemaMismatchError(
                    f"field {field.name!r}: row {i} is a str ({v[:20]!r}), not an image; give pixels as a "
                    f"uint8 numpy array of shape {field.shape}, or an encoded PNG or JPEG as bytes")
            elif (isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype == np.uint8 and v.flags.c_contiguous
                  and (found := headers.claim(v)) is not None):
                raise SchemaMismatchError(
                    f"field {field.name!r}: row {i} is a 1-D uint8 array of {len(v)} bytes that holds a "
                    f"{found.format} image, but a numpy array in an image field is pixels (of shape "
                    f"{field.shape}); pass the encoded image as bytes (array.tobytes()) to store it as it "
                    "is, or its decoded pixels")
        return stored

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

    jpeg_first = isinstance(field.codec, ImageCodec) and field.codec.format == "jpeg"
    fast = _fast_png(field, shape) if fixed and not jpeg_first else None
    jpeg_channels = headers.field_channels(field) if fixed else 0
    limit = 0 if fixed else headers.max_image_pixels()  # a fixed shape is checked exactly instead

    def run(lo: int, hi: int) -> None:
        rows: Any = range(lo, hi)
        if fast is not None:
            rows = fast(data, offsets, lo, hi, nulls=nulls, out=out)  # the rows it left to the general path
        if jpeg_channels:  # JPEGs straight into out (`_jpeg`: simplejpeg, else Pillow); the rest go on
            left = np.asarray(rows, np.int64)
            done = _jpeg.decode_jpegs(data, offsets[left], offsets[left + 1], out, channels=jpeg_channels,
                                      rows=left, field=field.name)
            rows = left[~done]
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
