"""Petastorm's codecs, read-only: the columns of a Petastorm dataset decoded as Petastorm wrote them.

`shardkit.dataset.petastorm` maps a Petastorm Unischema's fields to these (see its docstring):
``petastorm.ndarray`` (``np.save`` bytes per row), ``petastorm.compressed_ndarray``
(``np.savez_compressed(arr=...)``), ``petastorm.scalar`` (text as UTF-8 bytes, decimals as text) and
``petastorm.png16`` (16-bit PNGs, with OpenCV). They never unpickle (object arrays are refused, as
``np.load(allow_pickle=False)`` does) and decode a whole column at once: rows with identical ``.npy``
headers (every row of a fixed-shape field) become one ``np.frombuffer`` view of the column's bytes.
Writing with them is refused, naming the shardkit codec to write with instead.

Nothing is expanded past what it can hold: a compressed array is inflated no further than an ``.npy``
of the field's fixed shape takes, or, where the shape varies, than its ``.npy`` header (checked against
the field first) says, and one byte more to tell a longer stream; a 16-bit PNG is decoded only once its
``IHDR`` has the field's size, or at most `headers.max_image_pixels()` pixels where the size varies
(`shardkit.dataset.codecs.headers`). That limit is the one: a PNG within it that OpenCV refuses (past
its own, 2**30 pixels, for a raised shardkit limit) is decoded by Pillow, as `ImageCodec`'s are; Pillow
reads a 16-bit colour PNG as 8 bits, so such an image is refused instead, naming OpenCV's setting.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import io
import math
import struct
import sys
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from shardkit.dataset._field import Field
from shardkit.dataset.codecs import Codec, ScalarCodec, headers, register
from shardkit.dataset.codecs.base import ArrowColumn, as_masked, combine, is_text_type, mask_of, plain_type
from shardkit.dataset.codecs.image import open_image
from shardkit.errors import CorruptDatasetError, SchemaError, one_line, require

__all__ = ["PetastormCompressedNdarrayCodec", "PetastormNdarrayCodec", "PetastormPng16Codec",
           "PetastormScalarCodec"]

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header, 30 bytes
_NPY_HEAD = 12 + 10_000  # magic 6, version 2, header length 4 (or 2), a header of numpy's longest


@dataclasses.dataclass(frozen=True)
class PetastormNdarrayCodec(Codec):
    """Read-only: Petastorm's ``NdarrayCodec``, one ``np.save`` blob per row in a binary column."""

    name = "petastorm.ndarray"
    writable = False

    def arrow_type(self, field: Field) -> pa.DataType:
        return pa.binary()

    def encode(self, field: Field, values: Any) -> pa.Array:
        raise _read_only(self, field)

    def decode(self, field: Field, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
        data, starts, ends, nulls = _binary_rows(field, column)
        return _decode_npy_rows(field, data, starts, ends, nulls)


@dataclasses.dataclass(frozen=True)
class PetastormCompressedNdarrayCodec(PetastormNdarrayCodec):
    """Read-only: Petastorm's ``CompressedNdarrayCodec``, ``np.savez_compressed(arr=...)`` bytes per row."""

    name = "petastorm.compressed_ndarray"

    def decode(self, field: Field, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
        data, starts, ends, nulls = _binary_rows(field, column)
        buf = data.tobytes()
        most = _most_npy_bytes(field)
        blobs = [b"" if nulls is not None and nulls[i] else _unzip(field, buf[s:e], i, most)
                 for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True))]
        lengths = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        joined = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        return _decode_npy_rows(field, joined, offsets[:-1], offsets[1:], nulls)


@dataclasses.dataclass(frozen=True)
class PetastormScalarCodec(ScalarCodec):
    """Read-only: a Petastorm ``ScalarCodec`` column that Petastorm converted while reading it.

    A text column of a ``bytes`` field is read as its UTF-8 bytes, a decimal column as its exact text
    (``str`` field) or as float64 (a number field); anything else as `ScalarCodec` reads it.
    """

    name = "petastorm.scalar"
    writable = False

    def stored_problem(self, field: Field, stored: pa.DataType) -> str | None:
        t = plain_type(stored)
        if (field.dtype.kind == "S" and is_text_type(t)) or pa.types.is_decimal(t):
            return None
        return super().stored_problem(field, stored)

    def encode(self, field: Field, values: Any) -> pa.Array:
        raise _read_only(self, field)

    def decode(self, field: Field, column: ArrowColumn) -> np.ndarray:
        arr = combine(column)
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        if field.dtype.kind == "S" and is_text_type(arr.type):
            arr = arr.cast(pa.large_binary() if pa.types.is_large_string(arr.type) else pa.binary())
        elif pa.types.is_decimal(arr.type):
            arr = arr.cast(pa.string() if field.dtype.kind == "U" else pa.float64())
        return super().decode(field, arr)


@dataclasses.dataclass(frozen=True)
class PetastormPng16Codec(Codec):
    """Read-only: Petastorm's ``CompressedImageCodec('png')`` of ``uint16`` pixels (16-bit PNG), shape
    ``(H, W)`` or ``(H, W, 3)`` (what Petastorm wrote), decoded with OpenCV as Petastorm did, once its
    header passed shardkit's checks; Pillow where OpenCV refuses one (`_pillow_png16`)."""

    name = "petastorm.png16"
    writable = False

    def check(self, field: Field) -> None:
        if field.dtype != np.uint16 or not (len(field.shape) == 2 or field.shape[2:] == (3,)):
            raise SchemaError(f"field {field.name!r}: {self.name} holds uint16 images of shape (H, W) or "
                              f"(H, W, 3), not {field.dtype_name} {field.shape}")

    def arrow_type(self, field: Field) -> pa.DataType:
        return pa.binary()

    def encode(self, field: Field, values: Any) -> pa.Array:
        raise _read_only(self, field)

    def decode(self, field: Field, column: ArrowColumn) -> np.ndarray:
        data, starts, ends, nulls = _binary_rows(field, column)
        cv2: Any = require("cv2", extra="image",
                           purpose=f"decoding the 16-bit PNG images of the Petastorm field {field.name!r}")
        rows = np.flatnonzero(~nulls) if nulls is not None else np.arange(len(starts))
        n = len(starts)
        out = np.zeros((n, *field.dims), np.uint16) if field.fixed_shape else np.empty(n, object)
        limit = headers.max_image_pixels()
        for i in rows.tolist():
            blob = data[int(starts[i]) : int(ends[i])]
            found = headers.claim(blob)
            _check_png_header(field, i, found, limit)
            try:
                pixels = cv2.imdecode(blob, cv2.IMREAD_UNCHANGED)
            except cv2.error as e:  # past OpenCV's own limit (2**30 pixels): shardkit's may be raised above
                pixels = _pillow_png16(field, i, blob, found, e)
            if pixels is None:  # OpenCV refused it: Pillow names the damage (or decodes what OpenCV did not)
                pixels = _pillow_png16(field, i, blob, found, None)
            elif pixels.ndim == 3 and pixels.shape[2] == 3:
                pixels = np.ascontiguousarray(pixels[:, :, ::-1])  # OpenCV's BGR, as Petastorm swapped it
            if pixels.dtype != np.uint16 or pixels.ndim != len(field.shape) or any(
                    d not in (None, s) for d, s in zip(field.shape, pixels.shape, strict=True)):
                raise _corrupt(field, i, f"it decodes to a {pixels.dtype} image of shape {pixels.shape}, but "
                               f"the schema declares uint16 {field.shape}")
            out[i] = pixels
        return as_masked(out, nulls) if field.fixed_shape else out


for _cls in (PetastormNdarrayCodec, PetastormCompressedNdarrayCodec, PetastormScalarCodec,
             PetastormPng16Codec):
    register(_cls)


def _read_only(codec: Codec, field: Field) -> SchemaError:
    suggested = "scalar" if not field.shape else "tensor" if field.fixed_shape else "ndarray"
    return SchemaError(
        f"field {field.name!r} uses the Petastorm codec {codec.name!r}; Petastorm codecs are read-only in "
        f"shardkit. Write the data with a shardkit codec, e.g. Field({field.name!r}, {field.dtype_name!r}, "
        f"{field.shape}, codec={suggested!r})"
    )


def _check_png_header(field: Field, row: int, found: headers.Claim | None, limit: int) -> None:
    """Refuse what OpenCV should not decode: no PNG, another size than the field's, too many pixels."""
    if found is None or found.format != "PNG":
        raise _corrupt(field, row, "it is not a PNG image (no PNG signature and IHDR header)")
    if any(d not in (None, s) for d, s in zip(field.shape, (found.height, found.width), strict=False)):
        raise _corrupt(field, row, f"its PNG header claims an image of shape {found.shape(len(field.shape))} "
                       f"(not decoded), but the schema declares {field.shape}")
    problem = headers.over_limit(found, limit) if None in field.shape[:2] else None
    if problem is not None:
        raise _corrupt(field, row, problem)


def _pillow_png16(field: Field, row: int, blob: np.ndarray, found: headers.Claim | None,
                  refused: Exception | None) -> np.ndarray:
    """A PNG OpenCV did not decode (``refused``: the ``cv2.error`` it raised, past its own pixel limit;
    None: it returned nothing), decoded by Pillow, its header already checked (`_check_png_header`).

    Pillow reads a 16-bit grey PNG whole (``I;16``) but a 16-bit colour one as 8 bits, so such an image
    past OpenCV's limit is refused, naming the setting that raises it: Petastorm's 16-bit colour is kept
    whole or not read."""
    if refused is not None and found is not None and found.channels > 1:
        count = found.width * found.height
        raise CorruptDatasetError(
            f"field {field.name!r}, row {row} of the batch: OpenCV refused its {found.bits}-bit colour PNG "
            f"of {found.width} x {found.height} pixels ({count}) ({one_line(refused)}: past its own limit, "
            f"OPENCV_IO_MAX_IMAGE_PIXELS, 2**30 pixels unless set), and Pillow reads such PNGs as 8 bits "
            f"only. Set OPENCV_IO_MAX_IMAGE_PIXELS={count} (or more) in the environment of the process "
            "before it starts"
        ) from refused
    try:
        with open_image(blob.tobytes()) as im:
            im.load()
            pixels = np.asarray(im)
    except Exception as e:  # Pillow raises many types for bad bytes
        why = "" if refused is None else f" (OpenCV: {one_line(refused)})"
        raise _corrupt(field, row, f"it is not a PNG image OpenCV or Pillow can decode{why}: "
                       f"{type(e).__name__}: {e}") from e
    return pixels.astype(np.uint16) if pixels.dtype.kind == "u" and pixels.itemsize == 2 else pixels


def _corrupt(field: Field, row: int, problem: str) -> CorruptDatasetError:
    return CorruptDatasetError(f"field {field.name!r}, row {row} of the batch: {problem}; the Petastorm data "
                               "is corrupt or was not written by Petastorm's codec. Rewrite the dataset")


_Rows = tuple[np.ndarray, np.ndarray, np.ndarray, "np.ndarray | None"]


def _binary_rows(field: Field, column: pa.Array | pa.ChunkedArray) -> _Rows:
    """The column's bytes as one uint8 array, each row's [start, end) in it, and the null mask."""
    arr = combine(column)
    if pa.types.is_binary_view(arr.type):
        arr = arr.cast(pa.binary())
    if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
        raise CorruptDatasetError(f"field {field.name!r}: Petastorm stores it as binary, but the column "
                                  f"is {arr.type}; the data files do not match the Petastorm schema. "
                                  "Rewrite them")
    _validity, offsets_buf, data_buf = arr.buffers()
    offset_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(offsets_buf, offset_type)[arr.offset : arr.offset + len(arr) + 1].astype(np.int64)
    data = np.zeros(0, np.uint8) if data_buf is None else np.frombuffer(data_buf, np.uint8)
    return data, offsets[:-1], offsets[1:], mask_of(arr)


def _most_npy_bytes(field: Field) -> int | None:
    """The most bytes an ``.npy`` blob of the field takes (the longest header numpy writes, then the
    array); None where the field's shape varies or its strings' lengths do."""
    if not field.fixed_shape or field.dtype.kind in "US":
        return None
    return _NPY_HEAD + field.dtype.itemsize * math.prod(field.dims)


def _unzip(field: Field, blob: bytes, row: int, most: int | None) -> bytes:
    """The ``arr.npy`` member of one ``np.savez_compressed`` archive (no pickle, CRC checked), inflated
    no further than ``most`` bytes (`_most_npy_bytes`), or, where that is None, than its header says."""
    if len(blob) > 30:
        magic, _, flags, method, _, _, crc, _, _, name_len, extra_len = _ZIP_LOCAL.unpack_from(blob)
        if (magic == b"PK\x03\x04" and method == zlib.DEFLATED and not flags & 0x9
                and blob[30 : 30 + name_len] == b"arr.npy"):
            # the usual archive: one deflated member first; inflating it directly is much faster than zipfile
            inflate = zlib.decompressobj(-zlib.MAX_WBITS)
            stream = blob[30 + name_len + extra_len :]
            try:
                if most is not None:  # one call, as fast as inflating all of it
                    out = inflate.decompress(stream, most + 1)
                else:
                    out = _read_npy(field, row, _reader(inflate, stream))
            except zlib.error as e:
                raise _corrupt(field, row, f"its compressed array does not inflate ({e})") from e
            if most is not None and len(out) > most:
                raise _corrupt(field, row, f"its compressed array inflates to more than {most} bytes, the "
                               f"most an .npy of the field's {field.dtype_name} {field.shape} takes")
            if not inflate.eof or zlib.crc32(out) != crc:
                raise _corrupt(field, row, "its compressed array is truncated or fails its CRC check")
            return out
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive, archive.open("arr.npy") as member:
            return _read_npy(field, row, member.read)
    except CorruptDatasetError:
        raise
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, zlib.error) as e:
        raise _corrupt(field, row, f"it is not an np.savez_compressed archive of an 'arr' array ({e})") from e


def _reader(inflate: Any, stream: bytes) -> Callable[[int], bytes]:
    """``read(n)``: up to ``n`` more bytes of ``stream`` inflated by the decompressor ``inflate``."""
    tail = [stream]

    def read(n: int) -> bytes:
        out: bytes = inflate.decompress(tail[0], n)
        tail[0] = inflate.unconsumed_tail
        return out

    return read


def _read_npy(field: Field, row: int, read: Callable[[int], bytes]) -> bytes:
    """An ``.npy`` blob from ``read(n)`` (up to n more bytes of it), read no further than its header, once
    checked against the field, says it holds (and one byte more: a longer stream is corrupt)."""
    head = read(_NPY_HEAD)
    dtype, shape, _, body = _npy_parse(field, head, 0, len(head), row)
    size = body + dtype.itemsize * math.prod(shape)
    out = head + read(min(size + 1 - len(head), sys.maxsize)) if len(head) <= size else head
    if len(out) > size:
        raise _corrupt(field, row, f"its compressed array inflates to more than the {size} bytes its .npy "
                       f"header declares ({dtype} {shape})")
    return out


@functools.lru_cache(maxsize=4096)
def _npy_header(text: bytes, utf8: bool) -> tuple[np.dtype[Any], tuple[int, ...], bool]:
    """Parse an ``.npy`` header as ``np.load(allow_pickle=False)`` accepts it (ValueError if not)."""
    if len(text) > 10_000:
        raise ValueError(f"header of {len(text)} bytes is longer than numpy's 10000-byte limit")
    try:
        header = ast.literal_eval(text.decode("utf8" if utf8 else "latin1"))
    except (SyntaxError, RecursionError, MemoryError, UnicodeDecodeError) as e:
        raise ValueError(f"header {text[:80]!r} is not a Python literal") from e
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise ValueError(f"header {header!r} is not an .npy header")
    descr, shape, fortran = header["descr"], header["shape"], header["fortran_order"]
    if (not isinstance(descr, str) or not isinstance(fortran, bool) or not isinstance(shape, tuple)
            or not all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"header {header!r} is not a plain (non-structured) array header")
    dtype = np.dtype(descr)
    if dtype.hasobject:
        raise ValueError("it holds an object array, which only unpickling could read")
    return dtype, shape, fortran


def _npy_layout(field: Field, buf: np.ndarray, start: int, end: int, row: int
                ) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """dtype, shape, Fortran order and payload length of the ``.npy`` blob ``buf[start:end]``."""
    dtype, shape, fortran, body = _npy_parse(field, buf, start, end, row)
    if end - body != dtype.itemsize * math.prod(shape):
        raise _corrupt(field, row, f"its {end - body} data bytes do not hold a {dtype} array of {shape}")
    return dtype, shape, fortran, end - body


def _npy_parse(field: Field, buf: np.ndarray | bytes, start: int, end: int, row: int
               ) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """dtype, shape and Fortran order of the ``.npy`` blob ``buf[start:end]`` (checked against the
    field), and where its data begins: its header is all that is read."""
    major = int(buf[start + 6]) if end - start > 10 else 0
    if major not in (1, 2, 3) or bytes(buf[start : start + 6]) != _NPY_MAGIC:
        raise _corrupt(field, row, "it is not .npy data (no \\x93NUMPY v1-v3 header)")
    size = 2 if major == 1 else 4
    body = start + 8 + size + int.from_bytes(bytes(buf[start + 8 : start + 8 + size]), "little")
    try:
        dtype, shape, fortran = _npy_header(bytes(buf[start + 8 + size : body]), major == 3)
    except (ValueError, TypeError) as e:
        raise _corrupt(field, row, f".npy header refused: {e}") from e
    native = dtype.newbyteorder("=")
    same_dtype = dtype.kind == field.dtype.kind and (dtype.kind in "US" or native == field.dtype)
    same_shape = len(shape) == len(field.shape) and all(
        d in (None, s) for d, s in zip(field.shape, shape, strict=True))
    if not (same_dtype and same_shape):
        raise _corrupt(field, row, f"it holds a {dtype} array of shape {shape}, but the schema declares "
                       f"{field.dtype_name} {field.shape}")
    return dtype, shape, fortran, body


def _decode_npy_rows(field: Field, data: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                     nulls: np.ndarray | None) -> np.ndarray:
    """Decode ``.npy`` blobs ``data[starts[i]:ends[i]]``: stacked for fixed shapes, else an object array."""
    rows = np.flatnonzero(~nulls) if nulls is not None else np.arange(len(starts))
    if not field.fixed_shape:
        out = np.empty(len(starts), dtype=object)  # None where null
        for i in rows.tolist():
            out[i] = _one(field, data, int(starts[i]), int(ends[i]), i)
        return out
    shape = field.dims
    values = _stack_same_header(field, data, starts[rows], ends[rows], rows)
    if values is None:
        values = np.stack([_one(field, data, int(starts[i]), int(ends[i]), i) for i in rows.tolist()])
    if nulls is None:
        return values
    full = np.zeros((len(starts), *shape), dtype=values.dtype)
    full[rows] = values
    return as_masked(full, nulls)


def _one(field: Field, data: np.ndarray, start: int, end: int, row: int) -> np.ndarray:
    dtype, shape, fortran, nbytes = _npy_layout(field, data, start, end, row)
    flat = data[end - nbytes : end].view(dtype) if nbytes else np.zeros(0, dtype)
    values = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    return values if dtype.isnative else values.astype(dtype.newbyteorder("="))


def _stack_same_header(field: Field, data: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                       rows: np.ndarray) -> np.ndarray | None:
    """All rows in one vectorized step when they share one ``.npy`` header, else None."""
    if len(starts) == 0:
        return np.zeros((0, *field.dims), field.dtype)
    length = int(ends[0] - starts[0])
    if (ends - starts != length).any():
        return None
    dtype, shape, fortran, nbytes = _npy_layout(field, data, int(starts[0]), int(ends[0]), int(rows[0]))
    if fortran and len(shape) > 1:
        return None
    if (np.diff(starts) == length).all():
        block = data[int(starts[0]) : int(starts[0]) + length * len(starts)].reshape(len(starts), length)
    else:
        block = data[starts[:, None] + np.arange(length)]
    head = length - nbytes
    if not (block[:, :head] == block[0, :head]).all():
        return None
    values = np.ascontiguousarray(block[:, head:]).view(dtype).reshape((len(starts), *shape))
    return values if dtype.isnative else values.astype(dtype.newbyteorder("="))
