"""JPEG decoding by a decoder chosen by name: a slice of a fixed-shape field straight into its array.

`decode_jpegs` decodes the JPEGs of a slice of a column (its data buffer and the start and end of each
blob) into a preallocated ``out``, one image per row, and says which rows it did; every row it did not
take (not a JPEG, a header that does not match the field, an empty or null row) is left to the general
path (`shardkit.dataset.codecs.image.decode_image`), exactly as the PNG fast path leaves its rows.
`decode_jpeg_one` decodes one blob, for per-sample use. Both check each image's header first
(`headers.claim`, as every decode does), so no decoder ever allocates what a crafted header claims.

Decoders, by name (`DECODERS`):

- ``"simplejpeg"``: libjpeg-turbo's TurboJPEG API, decoding into the row of ``out`` itself, the GIL
  released for the whole decode (``pip install 'shardkit[image]'``);
- ``"opencv"``: ``cv2.imdecode`` (the GIL released; a copy into ``out``); it recovers from some damage
  Pillow refuses (extraneous bytes in a tiny image), giving pixels where the others raise;
- ``"pillow"``: Pillow's JPEG plugin opened directly (not through ``Image.open``'s format probing),
  the GIL released in the decode only, two copies into ``out`` (Pillow stores RGB as 4 bytes a pixel);
- ``"auto"`` (the default): the first of `AUTO` that is installed, by measurement the fastest that
  gives libjpeg-turbo's default pixels (the benchmark: ``python -m benchmarks.decoders``).

Every decoder runs libjpeg-turbo with its defaults (the accurate integer IDCT, fancy upsampling), so the
pixels are Pillow's, which is what shardkit decoded before there was a choice; the faster and less
accurate options (simplejpeg's ``fastdct``/``fastupsample``, Pillow's draft mode) are opt-in only
(``fast=True``). A JPEG a decoder refuses (simplejpeg refuses libjpeg's recoverable warnings, such as
extraneous bytes, and sampling factors TurboJPEG does not name) is decoded by Pillow, which takes what
it took before; one Pillow refuses too raises `CorruptDatasetError` naming the field and the row.

Resize-on-decode, opt-in (``scale=``): libjpeg's DCT scaling decodes an image at 1/2, 1/4 or 1/8 of its
size for a fraction of the cost (it skips most of the inverse DCT), for transforms that shrink anyway
(``RandomResizedCrop(224)`` of a 1024-pixel photo). ``scale`` is the factor (``0.5``, ``Fraction(1, 4)``)
or the smallest size the decoded image may have, ``(min_height, min_width)``: the strongest of the
factors that keeps it at least that large. An image is then ``ceil(H / n) x ceil(W / n)`` (`scaled_shape`);
every decoder gives the same pixels at a given factor. The factor is never more than the image's
smaller side (1/8 of a 5-pixel image would be libjpeg's, but not Pillow's).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from fractions import Fraction
from functools import cache
from typing import TYPE_CHECKING, Literal, get_args

import numpy as np

from shardkit.dataset.codecs import headers
from shardkit.errors import ConfigError, CorruptDatasetError, ImageShapeError, MissingDependencyError

if TYPE_CHECKING:
    from shardkit.dataset._field import Field

Decoder = Literal["auto", "simplejpeg", "opencv", "pillow"]
#: A DCT scale factor (1/2, 1/4, 1/8, or 1), or the smallest (height, width) the decoded image may have.
Scale = Fraction | float | tuple[int, int] | None
DECODERS: dict[str, str] = {"simplejpeg": "simplejpeg", "opencv": "opencv-python-headless",
                            "pillow": "pillow"}  # name -> the package that brings it
AUTO: tuple[str, ...] = ("simplejpeg", "pillow")  # "auto": the first installed (see the module docstring)
DCT_DENOMINATORS = (8, 4, 2, 1)  # the factors 1/n that libjpeg, Pillow's draft and OpenCV all take
_COLOURS = {1: "L", 3: "RGB"}  # channels -> Pillow's mode (CMYK and others: left to the general path)

# (blob, its claim, the DCT denominator, a C-contiguous destination or None) -> its pixels (the destination
# itself where it was decoded into), or None where the decoder refused the blob (Pillow then decides).
_Decode = Callable[[np.ndarray, headers.Claim, int, "np.ndarray | None"], "np.ndarray | None"]


def decode_jpegs(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, out: np.ndarray, *,
                 channels: int, decoder: Decoder = "auto", scale: Scale = None, fast: bool = False,
                 size: tuple[int, int] | None = None, rows: np.ndarray | None = None,
                 field: str = "image") -> np.ndarray:
    """Decode the JPEGs ``data[starts[k]:ends[k]]`` into ``out[rows[k]]``; return which ``k`` were done.

    Args:
        data: the column's data buffer (uint8).
        starts, ends: where each blob starts and ends in ``data``.
        out: the output, ``(rows, H', W')`` (grey) or ``(rows, H', W', C)``; ``(H', W')`` is the
            field's size, or `scaled_shape` of it with ``scale``.
        channels: the field's channels (1 or 3); a JPEG of other channels (CMYK, grey in an RGB field)
            is left to the general path, which refuses it by its header.
        decoder: a name of `DECODERS`, or ``"auto"``.
        scale: resize-on-decode, opt-in (see the module docstring).
        fast: libjpeg's fast IDCT and upsampling (simplejpeg) or Pillow's draft mode: faster, pixels that
            differ from the default decode by a few levels. Opt-in; OpenCV has no such option.
        size: the field's (H, W), the size every image's header must claim; by default ``out``'s
            (required with ``scale``).
        rows: the row of ``out`` (and of the column, for messages) of each blob; by default ``k``.
        field: the field's name, for messages.

    Returns:
        A bool per blob: True where its pixels are in ``out``. A False row is untouched: the general
        path decodes it, or skips it (a null), or refuses it by its header, naming the fix.

    Raises:
        CorruptDatasetError: a JPEG whose header matches the field but whose data does not decode.
        ConfigError: an unknown ``decoder``, a bad ``scale``, an ``out`` of another shape than ``scale``
            gives. MissingDependencyError: the named decoder is not installed.

    Example:
        >>> out = np.empty((n, 256, 256, 3), np.uint8)
        >>> done = decode_jpegs(data, offsets[:-1], offsets[1:], out, channels=3)
    """
    decode = _decoder(resolve_decoder(decoder), fast)
    full = (int(out.shape[1]), int(out.shape[2])) if size is None else (int(size[0]), int(size[1]))
    if size is None and scale is not None:
        raise ConfigError("decode_jpegs: give size=(H, W), the images' stored size, with scale=")
    denominator = dct_denominator(full, scale)
    want = scaled_shape((*full, channels), scale)[:2]
    if tuple(out.shape[1:3]) != want or out.dtype != np.uint8:
        raise ConfigError(f"decode_jpegs: out is {out.dtype} {out.shape[1:]} per row, but {full} images "
                          f"decoded at scale {scale!r} are uint8 {want}")
    done = np.zeros(len(starts), bool)
    for k, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        if end - start < 4 or data[start] != 0xFF or data[start + 1] != 0xD8:
            continue
        blob = data[start:end]
        found = headers.claim(blob)
        if (found is None or found.format != "JPEG" or (found.height, found.width) != full
                or found.channels != channels or found.bits != 8):
            continue
        row = k if rows is None else int(rows[k])
        _decode_into(decode, blob, found, denominator, out[row], field=field, row=row, fast=fast)
        done[k] = True
    return done


def decode_jpeg_one(blob: bytes | np.ndarray, channels: int = 3, decoder: Decoder = "auto", *,
                    scale: Scale = None, fast: bool = False, field: Field | None = None,
                    row: int = 0) -> np.ndarray:
    """One JPEG's pixels, ``(H, W, channels)`` (``(H, W)`` for a field of shape ``(H, W)``).

    Its header is checked first, as every read checks it (`headers.check_image`): against ``field``
    where given (its size, if fixed; its channels), else against ``channels`` and
    `headers.max_image_pixels()`. ``scale`` and ``fast``: as `decode_jpegs` (opt-in).

    Raises:
        CorruptDatasetError: not a JPEG, or a JPEG that does not decode (naming the field and row).
        ImageShapeError: a header that does not match the field (size, channels, more than 8 bits).

    Example:
        >>> pixels = decode_jpeg_one(blob, 3)  # (H, W, 3) uint8, Pillow's pixels
    """
    data = np.frombuffer(blob, np.uint8) if isinstance(blob, bytes | bytearray | memoryview) else blob
    name = field.name if field is not None else "image"
    decode = _decoder(resolve_decoder(decoder), fast)
    found = headers.claim(data)
    if found is None or found.format != "JPEG":
        if found is not None or len(data) < 2 or data[0] != 0xFF or data[1] != 0xD8:
            raise CorruptDatasetError(
                f"field {name!r}: row {row}: an image could not be decoded (not a JPEG by its header: "
                f"{bytes(data[:4])!r}...); the file is corrupt or was not written as JPEG")
        found = _pillow_claim(data, name, row)  # a JPEG whose frame header `claim` did not reach
    if field is None:
        from shardkit.dataset._field import Field
        from shardkit.dataset.codecs.image import ImageCodec

        field = Field(name, "uint8", (None, None, channels), codec=ImageCodec("jpeg"))
    headers.check_image(field, row, found, headers.max_image_pixels())
    full = (found.height, found.width)
    denominator = dct_denominator(full, scale)
    out = np.empty((*scaled_shape(full, scale), found.channels), np.uint8)
    _decode_into(decode, data, found, denominator, out, field=name, row=row, fast=fast)
    return out[:, :, 0] if len(field.shape) == 2 else out


def resolve_decoder(decoder: str) -> str:
    """The decoder ``decoder`` names (``"auto"``: the first of `AUTO` installed); `ConfigError` for an
    unknown name, `MissingDependencyError` for one not installed."""
    if decoder == "auto":
        return next(name for name in AUTO if _installed(name))
    if decoder not in DECODERS:
        raise ConfigError(f"JPEG decoder {decoder!r} is not one of {list(get_args(Decoder))}; "
                          "use 'auto' (the fastest installed) or name one")
    if not _installed(decoder):
        raise MissingDependencyError(DECODERS[decoder], "image", f"the JPEG decoder {decoder!r}")
    return decoder


def dct_denominator(size: Sequence[int], scale: Scale) -> int:
    """The n of the DCT scale 1/n that ``scale`` means for images of ``size`` (H, W); 1 for None.

    A factor must be 1, 1/2, 1/4 or 1/8; a minimum size ``(min_height, min_width)`` gives the largest n
    whose ``ceil(H / n) x ceil(W / n)`` is at least that large. n is at most the smaller side.
    """
    height, width = int(size[0]), int(size[1])
    if scale is None:
        return 1
    if isinstance(scale, tuple):
        if len(scale) != 2 or not all(isinstance(v, int) and v > 0 for v in scale):
            raise ConfigError(f"scale={scale!r}: a minimum size is (min_height, min_width), positive ints")
        fits = [n for n in DCT_DENOMINATORS if -(-height // n) >= scale[0] and -(-width // n) >= scale[1]]
        denominator = fits[0] if fits else 1
    else:
        try:
            factor = Fraction(scale).limit_denominator(64)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"scale={scale!r} is not a factor (1/2, 1/4, 1/8) or (min_height, "
                              "min_width)") from e
        if factor.numerator != 1 or factor.denominator not in DCT_DENOMINATORS:
            raise ConfigError(f"scale={scale!r}: JPEG's DCT scaling decodes at 1, 1/2, 1/4 or 1/8 of the "
                              "size; give one of those, or a minimum size (min_height, min_width)")
        denominator = factor.denominator
    return max(n for n in DCT_DENOMINATORS if n <= denominator and n <= min(height, width))


def scaled_shape(shape: Sequence[int], scale: Scale) -> tuple[int, ...]:
    """The shape images of ``shape`` ((H, W) or (H, W, C)) decode to at ``scale``: H and W divided by
    `dct_denominator`, rounded up (libjpeg's rule); the channels as they are.

    Example:
        >>> scaled_shape((256, 256, 3), 0.5), scaled_shape((375, 500, 3), (100, 100))
        ((128, 128, 3), (188, 250, 3))
    """
    n = dct_denominator(shape[:2], scale)
    return (-(-int(shape[0]) // n), -(-int(shape[1]) // n), *(int(d) for d in shape[2:]))


def _decode_into(decode: _Decode | None, blob: np.ndarray, found: headers.Claim, denominator: int,
                 dst: np.ndarray, *, field: str, row: int, fast: bool) -> None:
    target = dst if dst.flags.c_contiguous else None
    pixels = None if decode is None else decode(blob, found, denominator, target)
    if pixels is None or pixels.shape[:2] != dst.shape[:2]:  # Pillow's turn: refused, or a scale it chose
        pixels = _pillow(blob, found, denominator, target, field=field, row=row, fast=fast)
    if pixels.size != dst.size:
        raise ImageShapeError(f"field {field!r}: row {row} decodes to an image of shape {pixels.shape}, "
                              f"not the {dst.shape} its JPEG header claims; the row is corrupt")
    if pixels is not target:
        dst[...] = pixels.reshape(dst.shape)


@cache  # a failed import is not cached by Python: without this, "auto" would retry it on every call
def _installed(name: str) -> bool:
    try:
        _library(name)
    except ImportError:
        return False
    return True


def _library(name: str) -> object:
    if name == "simplejpeg":
        import simplejpeg

        return simplejpeg
    if name == "opencv":
        import cv2

        return cv2
    from PIL import JpegImagePlugin

    return JpegImagePlugin


@cache
def _decoder(name: str, fast: bool) -> _Decode | None:
    """The decoder ``name``; None for Pillow, which `_decode_into` calls itself (it names the row)."""
    if name == "simplejpeg":
        return _simplejpeg(fast)
    if name == "opencv":
        return _opencv()
    return None


def _simplejpeg(fast: bool) -> _Decode:
    import simplejpeg

    def decode(blob: np.ndarray, found: headers.Claim, n: int, dst: np.ndarray | None) -> np.ndarray | None:
        if n > 1 and not _only_factor(found.height, found.width, n):
            return None
        scaled = {} if n == 1 else {"min_height": -(-found.height // n), "min_width": -(-found.width // n)}
        try:
            pixels: np.ndarray = simplejpeg.decode_jpeg(
                blob, "GRAY" if found.channels == 1 else "RGB", fastdct=fast, fastupsample=fast, buffer=dst,
                **scaled)
        except ValueError:  # strict: libjpeg's recoverable warnings too; Pillow decides (module docstring)
            return None
        return pixels

    return decode


@cache
def _only_factor(height: int, width: int, n: int) -> bool:
    """Whether 1/n is the only one of TurboJPEG's factors (k/8, k = 1..16) that decodes a ``height`` x
    ``width`` image to its size: simplejpeg picks a factor by the smallest size wanted, and a tiny image
    (5 x 5 at 1/4: 3/8 gives 2 x 2 too) could get another factor, hence other pixels (Pillow's then)."""
    want = (-(-height // n), -(-width // n))
    return all((-(-height * k // 8), -(-width * k // 8)) != want for k in range(1, 17) if k * n != 8)


def _opencv() -> _Decode:
    import cv2

    keep = cv2.IMREAD_IGNORE_ORIENTATION  # Pillow does not apply EXIF's orientation; OpenCV does by default
    rgb = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.10: no BGR-to-RGB copy
    grey = {1: cv2.IMREAD_GRAYSCALE, 2: cv2.IMREAD_REDUCED_GRAYSCALE_2, 4: cv2.IMREAD_REDUCED_GRAYSCALE_4,
            8: cv2.IMREAD_REDUCED_GRAYSCALE_8}
    colour = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
              8: cv2.IMREAD_REDUCED_COLOR_8}

    def decode(blob: np.ndarray, found: headers.Claim, n: int, dst: np.ndarray | None) -> np.ndarray | None:
        flags = grey[n] | keep if found.channels == 1 else colour[n] | keep | (rgb or 0)
        try:
            pixels = cv2.imdecode(blob, flags)
        except cv2.error:
            return None
        if pixels is None or pixels.dtype != np.uint8:
            return None
        if found.channels == 3 and rgb is None:
            pixels = pixels[:, :, ::-1]
        return pixels

    return decode


def _pillow(blob: np.ndarray, found: headers.Claim, n: int, dst: np.ndarray | None, *, field: str,
            row: int, fast: bool) -> np.ndarray:
    """Pillow's pixels of a JPEG, or `CorruptDatasetError` naming the field and row (the words of
    `shardkit.dataset.codecs.image`'s Pillow path)."""
    from PIL import JpegImagePlugin

    try:
        with JpegImagePlugin.JpegImageFile(io.BytesIO(blob.tobytes())) as im:  # lazy: the header only
            if (im.height, im.width, im.mode) != (found.height, found.width, _COLOURS.get(found.channels)):
                raise ImageShapeError(
                    f"field {field!r}: row {row} is a {im.mode} JPEG of {im.width} x {im.height} pixels by "
                    f"Pillow, not the {found.layout} {found.width} x {found.height} its frame header claims")
            if n > 1 or fast:
                im.draft(im.mode, (found.width // n, found.height // n))
                if fast:
                    im.decoderconfig = (n, 1)  # Pillow's draft flag: libjpeg's fastest IDCT and upsampling
            im.load()
            pixels = np.asarray(im)
    except CorruptDatasetError:
        raise
    except Exception as e:  # Pillow raises many types for bad bytes
        raise CorruptDatasetError(
            f"field {field!r}: row {row}: an image could not be decoded ({type(e).__name__}: {e}); "
            "the file is corrupt or was not written as PNG/JPEG"
        ) from e
    if dst is not None:
        dst[...] = pixels.reshape(dst.shape)
        return dst
    return pixels


def _pillow_claim(data: np.ndarray, field: str, row: int) -> headers.Claim:
    """The claim of a JPEG whose frame header `headers.claim` did not find, by Pillow's lazy open."""
    from PIL import JpegImagePlugin

    try:
        with JpegImagePlugin.JpegImageFile(io.BytesIO(data.tobytes())) as im:
            return headers.Claim("JPEG", im.height, im.width, len(im.getbands()), int(getattr(im, "bits", 8)))
    except Exception as e:
        raise CorruptDatasetError(
            f"field {field!r}: row {row}: an image could not be decoded ({type(e).__name__}: {e}); "
            "the file is corrupt or was not written as PNG/JPEG"
        ) from e
