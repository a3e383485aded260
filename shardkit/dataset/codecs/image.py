"""Image codec: uint8 pixels stored as PNG (lossless) or JPEG bytes, decoded on read.

Encoding and decoding run in a thread pool: Pillow releases the GIL inside its codecs, so images of
one column are compressed in parallel. PNG uses zlib level 1 (Petastorm's OpenCV default too): on
training images it gives nearly the size of level 6 at several times the speed.
"""

from __future__ import annotations

import dataclasses
import io
import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa

from shardkit.dataset.codecs.base import ArrowColumn, Codec, as_masked, combine, mask_of, null_error
from shardkit.dataset.codecs.tensor import rows_of, stack_rows
from shardkit.errors import CorruptDatasetError, SchemaError, SchemaMismatchError

if TYPE_CHECKING:
    from shardkit.dataset.schema import Field

_MODES = {(2, 1): "L", (3, 1): "L", (3, 3): "RGB", (3, 4): "RGBA"}


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="shardkit-image")


def decode_image(data: bytes, field: Field) -> np.ndarray:
    """Decode one PNG/JPEG blob to a numpy array in the field's layout (HxW or HxWxC)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            pixels = np.asarray(im)
    except Exception as e:  # Pillow raises many types for bad bytes
        raise CorruptDatasetError(
            f"field {field.name!r}: an image could not be decoded ({type(e).__name__}: {e}); "
            "the file is corrupt or was not written as PNG/JPEG"
        ) from e
    if len(field.shape) == 3 and pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return pixels


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

    def arrow_type(self, field: Field) -> pa.DataType:
        return pa.binary()

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
    nulls = mask_of(arr)
    blobs = arr.to_pylist()
    images = list(_pool().map(lambda b: None if b is None else decode_image(b, field), blobs))
    if all(d is not None for d in field.shape):
        shape = tuple(int(d) for d in field.shape if d is not None)
        for i, im in enumerate(images):
            if im is not None and im.shape != shape:
                raise SchemaMismatchError(
                    f"field {field.name!r}: row {i} decodes to an image of shape {im.shape}, "
                    f"but the schema declares {shape}"
                )
        out = np.zeros((len(images), *shape), np.uint8)
        for i, im in enumerate(images):
            if im is not None:
                out[i] = im
        return as_masked(out, nulls)
    result = np.empty(len(images), dtype=object)
    result[:] = images
    return result
