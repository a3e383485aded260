"""What an encoded image claims to be, read from its header before it is decoded (decompression bombs).

A PNG or JPEG of a few kilobytes can claim 60000 x 60000 pixels, and its decoder (libpng behind
OpenCV, Pillow) allocates what the header claims before it finds the data missing: gigabytes for one
row of a dataset. `claim` reads the size from the header alone, a PNG's ``IHDR`` or a JPEG's first
``SOFn`` frame header (the segments before it skipped by their lengths), in a microsecond or two, and
`check_image` compares it with the field before anything is decoded:

- a fixed-shape field ``(H, W[, C])``: the image must be H x W; any other size is corruption
  (`ImageShapeError`, also the `SchemaMismatchError` a decoded image of another size raised before);
- a field of varying size (H or W None), and Petastorm's 16-bit PNGs of varying size: at most
  `max_image_pixels()` pixels;
- an `ImageCodec` field holds 8-bit images: one of more bits per sample (a 16-bit PNG, which shardkit
  never writes) is refused (`ImageShapeError`, naming the fix) rather than read with its low bits
  dropped (Pillow's colour modes; OpenCV's ``IMREAD_COLOR``) or its values wrapped into uint8 (Pillow's
  16-bit grey). The codec promises the pixels it stored; scaling would be a silent, lossy choice the
  user should make when converting the images (or keep every bit: uint16 arrays, ``codec='tensor'``);
- the image's channels must be the field's (C, or 1 for ``(H, W)``), whatever its size: a grey image
  in an RGB field is refused (`ImageShapeError`, naming the fix) in a field of varying size as in a
  fixed-shape one, rather than read as ``(H, W, 1)`` beside ``(H, W, 3)`` images (a batch of mixed
  channel counts, which no model takes). Expanding grey to RGB (OpenCV's ``IMREAD_COLOR``) or dropping
  an alpha would be a choice the reader makes silently, as would turning colour into grey; the user
  makes it when converting the images. A palette image is the exception: its colours are decoded to
  the field's layout (`shardkit.dataset.codecs.image`), which is what its pixels are.

Images in other formats (Pillow's fallback) are checked against the size Pillow's lazy open
(`shardkit.dataset.codecs.image.open_image`) reads from their header, before ``load()`` allocates their
pixels. The limit, the only one applied (Pillow's and OpenCV's own are not: see that module):
`DEFAULT_MAX_IMAGE_PIXELS` unless `MAX_IMAGE_PIXELS` or the environment variable
``SHARDKIT_MAX_IMAGE_PIXELS`` says otherwise (see `max_image_pixels`).
"""

from __future__ import annotations

import os
import struct
from functools import cache
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from shardkit.dataset.codecs import _png as png
from shardkit.errors import ConfigError, CorruptDatasetError, ImageShapeError

if TYPE_CHECKING:
    from shardkit.dataset._field import Field

# 2**28 pixels, 16384 x 16384: 1 GiB decoded as 8-bit RGBA (1.5 GiB as Petastorm's 16-bit RGB). No
# training pipeline decodes such an image whole (ImageNet's average is 0.2 Mpx, an 8K frame 33 Mpx, a
# 100-Mpx camera's photo 1e8; gigapixel slides are stored as tiles), and it stays below OpenCV's own
# limit (2**30), so a claim past it is refused here before either library allocates anything. Pillow's
# own check (``PIL.Image.MAX_IMAGE_PIXELS``: a warning past 89 Mpx, an error past 179 Mpx) is not made
# on the images shardkit decodes (JPEG and the PNGs OpenCV does not take): this limit is the one.
DEFAULT_MAX_IMAGE_PIXELS = 1 << 28
ENV_VAR = "SHARDKIT_MAX_IMAGE_PIXELS"
MAX_IMAGE_PIXELS: int | None = None  # set (in this process) to override the environment and the default

_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> channels (a palette: 1; image.py expands it)
_PNG_PALETTE = 3  # the colour type of a palette PNG
LAYOUTS = {1: "grey", 2: "grey+alpha", 3: "RGB", 4: "RGBA"}  # channels -> what they hold (a JPEG's 4: CMYK)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (C4, C8, CC: DHT, JPG, DAC)
_NO_LENGTH = frozenset([0x01, *range(0xD0, 0xD8)])  # TEM and RSTn: markers without a segment


class Claim(NamedTuple):
    """The size an encoded image's header claims: its format, height, width, channels decoded, bits
    per sample (a PNG's bit depth, a palette's index bits; a JPEG's precision), and whether its samples
    are indices into a palette (decoded to the field's layout, whatever ``channels`` says)."""

    format: str
    height: int
    width: int
    channels: int
    bits: int = 8
    palette: bool = False

    @property
    def layout(self) -> str:
        """What its pixels hold, in words: ``"grey"``, ``"RGB"``, ``"RGBA"``, ``"palette"``, ..."""
        if self.palette:
            return "palette"
        if self.format == "JPEG" and self.channels == 4:
            return "CMYK"
        return LAYOUTS.get(self.channels, f"{self.channels}-channel")

    def shape(self, ndim: int) -> tuple[int, ...]:
        """The shape the image would decode to in a field of ``ndim`` dimensions (as `decode_image`)."""
        if ndim == 2 and self.channels == 1:
            return self.height, self.width
        return self.height, self.width, self.channels


def field_channels(field: Field) -> int:
    """The channels an image field holds: C of ``(H, W, C)`` (never None: `ImageCodec.check`), 1 for
    ``(H, W)``."""
    return int(field.shape[2] or 0) if len(field.shape) == 3 else 1


def max_image_pixels() -> int:
    """The most pixels an image of a field of varying size may claim (see the module docstring).

    `MAX_IMAGE_PIXELS` when set, else the environment variable ``SHARDKIT_MAX_IMAGE_PIXELS``, else
    `DEFAULT_MAX_IMAGE_PIXELS`. The variable reaches worker processes, however they are started; an
    assignment reaches this process (and the processes it forks) only.

    Example:
        >>> from shardkit.dataset.codecs import headers
        >>> headers.MAX_IMAGE_PIXELS = 1 << 30  # or: export SHARDKIT_MAX_IMAGE_PIXELS=1073741824
    """
    if MAX_IMAGE_PIXELS is not None:
        return MAX_IMAGE_PIXELS
    return _from_environment(os.environ.get(ENV_VAR))


@cache
def _from_environment(text: str | None) -> int:
    if text is None or not text.strip():
        return DEFAULT_MAX_IMAGE_PIXELS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"the environment variable {ENV_VAR}={text!r} is not a positive number of pixels; "
                          f"set it to one (the default is {DEFAULT_MAX_IMAGE_PIXELS}) or unset it")
    return value


def claim(blob: np.ndarray | bytes) -> Claim | None:
    """The size a PNG's ``IHDR`` or a JPEG's first frame header claims; None for other data or a header
    cut short (the decoder then refuses it, or Pillow's lazy open gives the size)."""
    view = memoryview(blob) if isinstance(blob, bytes) else blob.data  # no copy
    if len(view) >= 26 and view[:16] == png.START:  # the signature, then IHDR's length (13) and type
        width, height = struct.unpack_from(">II", view, 16)
        colour = view[25]
        return Claim("PNG", height, width, _PNG_CHANNELS.get(colour, 1), view[24], colour == _PNG_PALETTE)
    if len(view) < 4 or view[0] != 0xFF or view[1] != 0xD8:
        return None
    at, end = 2, len(view) - 3
    while at < end:  # each segment: FF, its marker, then (most) a 2-byte length counting itself
        if view[at] != 0xFF:
            return None
        marker = view[at + 1]
        if marker == 0xFF or marker in _NO_LENGTH:  # a fill byte, a marker alone
            at += 1 if marker == 0xFF else 2
        elif marker in _SOF:  # length, precision, height, width, components
            if at + 10 > len(view):
                return None
            height, width = struct.unpack_from(">HH", view, at + 5)
            return Claim("JPEG", height, width, view[at + 9], view[at + 4])
        elif marker in (0xD9, 0xDA):  # the end, or the scan, before any frame header
            return None
        else:
            at += 2 + ((view[at + 2] << 8) | view[at + 3])
    return None


def over_limit(found: Claim, limit: int) -> str | None:
    """Why ``found`` is refused in a field of varying size (None: it is not)."""
    pixels = found.width * found.height
    if pixels <= limit:
        return None
    return (f"its {found.format} header claims {found.width} x {found.height} pixels ({pixels}), more than "
            f"the limit of {limit} for images of varying size: it is corrupt or a decompression bomb, and "
            f"was not decoded. If such images are real, raise the limit: {ENV_VAR}={pixels} in the "
            "environment, or shardkit.dataset.codecs.headers.MAX_IMAGE_PIXELS")


def check_image(field: Field, row: int, found: Claim, limit: int) -> None:
    """Refuse an image of `ImageCodec` field ``field`` (row ``row`` of the column) by its header: another
    size than a fixed-shape field's (`ImageShapeError`), more than ``limit`` pixels in a field of varying
    size (`CorruptDatasetError`), more than 8 bits per sample or other channels than the field's, a
    palette's aside (`ImageShapeError`: the field holds uint8 pixels of its layout; see the module
    docstring)."""
    height, width = field.shape[0], field.shape[1]
    if height is not None and width is not None:
        if (found.height, found.width) != (height, width):
            raise ImageShapeError(
                f"field {field.name!r}: row {row} is an image of shape {found.shape(len(field.shape))} by "
                f"its {found.format} header (not decoded), but the schema declares {field.shape}; the row "
                "is corrupt or was written for another schema. Rewrite it, or read with on_error='skip'"
            )
    else:
        problem = over_limit(found, limit)
        if problem is not None:
            raise CorruptDatasetError(f"field {field.name!r}: row {row}: {problem}")
    if found.bits > 8:
        codec = "tensor" if field.fixed_shape else "ndarray"
        raise ImageShapeError(
            f"field {field.name!r}: row {row} is a {found.bits}-bit {found.format} image by its header (not "
            f"decoded), but the field holds 8-bit (uint8) images: read as uint8 it would lose its low bits "
            f"(or wrap). Convert the images to 8 bits, or store the pixels as uint16 arrays "
            f"(Field({field.name!r}, 'uint16', {field.shape}, codec={codec!r}))"
        )
    channels = field_channels(field)
    if found.channels != channels and not found.palette:
        layout = LAYOUTS[channels]
        raise ImageShapeError(
            f"field {field.name!r}: row {row} is a {found.format} image of {found.channels} channel"
            f"{'s' * (found.channels != 1)} ({found.layout}) by its header (not decoded), but the field "
            f"holds {layout} images of shape {field.shape}; the row is corrupt or was written for another "
            f"schema. Rewrite it with the images converted to {layout} (Pillow: image.convert("
            f"{'L' if channels == 1 else layout!r})), or read with on_error='skip'"
        )
