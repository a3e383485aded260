"""`shardkit.dataset.codecs._jpeg`: every decoder gives Pillow's pixels, leaves what it cannot take, and
names the field and row of a JPEG that does not decode.

Every JPEG is a real file written by Pillow (libjpeg-turbo) over sizes, qualities, chroma subsampling,
grey and RGB, baseline and progressive; the reference is what Pillow decodes, which is what shardkit
decoded before there was a choice of decoder.
"""

from __future__ import annotations

import io
import struct
import sys
from fractions import Fraction

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from PIL import Image

from shardkit import Field, ImageCodec
from shardkit.dataset.codecs import _jpeg
from shardkit.errors import ConfigError, CorruptDatasetError, ImageShapeError, MissingDependencyError

INSTALLED = [name for name in _jpeg.DECODERS if _jpeg._installed(name)]
DECODERS = ["auto", *INSTALLED]


def jpeg(pixels: np.ndarray, *, quality: int = 90, subsampling: int = 2, progressive: bool = False,
         **options: object) -> bytes:
    buf = io.BytesIO()
    image = Image.fromarray(pixels[:, :, 0] if pixels.ndim == 3 and pixels.shape[2] == 1 else pixels)
    image.save(buf, "JPEG", quality=quality, subsampling=subsampling, progressive=progressive, **options)
    return buf.getvalue()


def photo(rng: np.random.Generator, height: int, width: int, channels: int) -> np.ndarray:
    """Smooth colours plus noise: what a photo looks like to a JPEG encoder."""
    ys, xs = np.mgrid[0:height, 0:width]
    base = 128 + 60 * np.sin(ys[..., None] / (3 + rng.uniform(0, 20)) + rng.uniform(0, 6, channels))
    base += 50 * np.cos(xs[..., None] / (3 + rng.uniform(0, 20)))
    pixels = np.clip(base + rng.normal(0, 12, (height, width, channels)), 0, 255).astype(np.uint8)
    return pixels if channels == 3 else pixels[:, :, 0]


def pillow(blob: bytes, denominator: int = 1) -> np.ndarray:
    with Image.open(io.BytesIO(blob)) as im:
        if denominator > 1:
            im.draft(im.mode, (im.width // denominator, im.height // denominator))
        return np.asarray(im)


def column(blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A binary column's data buffer and each blob's start and end, as decode_images hands them."""
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
    return np.frombuffer(b"".join(blobs) or b"\0", np.uint8), offsets[:-1], offsets[1:]


images = st.fixed_dictionaries({
    "height": st.integers(1, 70), "width": st.integers(1, 70), "channels": st.sampled_from([1, 3]),
    "quality": st.integers(5, 100), "subsampling": st.sampled_from([0, 1, 2]),
    "progressive": st.booleans(), "seed": st.integers(0, 2**16),
})


def make(spec: dict[str, int], count: int = 3) -> tuple[list[bytes], tuple[int, ...]]:
    rng = np.random.default_rng(spec["seed"])
    shape = (spec["height"], spec["width"], spec["channels"])
    blobs = [jpeg(photo(rng, *shape), quality=spec["quality"], subsampling=spec["subsampling"],
                  progressive=bool(spec["progressive"])) for _ in range(count)]
    return blobs, shape


# --- pixels -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decoder", DECODERS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=images)
def test_pixels_are_pillows(decoder: str, spec: dict[str, int]) -> None:
    blobs, shape = make(spec)
    out_shape = shape if shape[2] == 3 else shape[:2]
    out = np.zeros((len(blobs), *out_shape), np.uint8)
    done = _jpeg.decode_jpegs(*column(blobs), out, channels=shape[2], decoder=decoder)  # type: ignore[arg-type]
    assert done.all()
    for blob, got in zip(blobs, out, strict=True):
        np.testing.assert_array_equal(got, pillow(blob))
        one = _jpeg.decode_jpeg_one(blob, shape[2], decoder)  # type: ignore[arg-type]
        np.testing.assert_array_equal(one, pillow(blob).reshape(shape))


@pytest.mark.parametrize("decoder", DECODERS)
@settings(max_examples=30, deadline=None)
@given(spec=images, denominator=st.sampled_from([2, 4, 8]), as_size=st.booleans())
def test_dct_scaling_gives_pillows_draft(decoder: str, spec: dict[str, int], denominator: int,
                                         as_size: bool) -> None:
    blobs, shape = make(spec, 2)
    size = shape[:2]
    n = min(denominator, *size)  # never more than the smaller side
    n = max(d for d in _jpeg.DCT_DENOMINATORS if d <= n)
    scale: _jpeg.Scale = Fraction(1, denominator)
    if as_size:  # the minimum size that this factor gives: the same factor
        scale = (-(-size[0] // n), -(-size[1] // n))
    assert _jpeg.dct_denominator(size, scale) == n
    want = _jpeg.scaled_shape(shape, scale)
    out = np.zeros((len(blobs), *want), np.uint8)
    done = _jpeg.decode_jpegs(*column(blobs), out, channels=shape[2], decoder=decoder,  # type: ignore[arg-type]
                              scale=scale, size=size)
    assert done.all()
    for blob, got in zip(blobs, out, strict=True):
        np.testing.assert_array_equal(got, pillow(blob, n).reshape(want))


def test_scale_examples() -> None:
    assert _jpeg.scaled_shape((256, 256, 3), 0.5) == (128, 128, 3)
    assert _jpeg.scaled_shape((375, 500, 3), (100, 100)) == (188, 250, 3)  # 1/4 gives 94 x 125: too small
    assert _jpeg.scaled_shape((375, 500), (90, 100)) == (94, 125)
    assert _jpeg.scaled_shape((5, 500), 0.125) == (2, 125)  # 1/4: never more than the smaller side


@pytest.mark.parametrize("decoder", DECODERS)
def test_fast_is_opt_in_and_close(decoder: str) -> None:
    rng = np.random.default_rng(1)
    blob = jpeg(photo(rng, 64, 48, 3))
    default = _jpeg.decode_jpeg_one(blob, 3, decoder)  # type: ignore[arg-type]
    np.testing.assert_array_equal(default, pillow(blob))
    fast = _jpeg.decode_jpeg_one(blob, 3, decoder, fast=True)  # type: ignore[arg-type]
    assert fast.shape == default.shape
    assert np.abs(fast.astype(int) - default).mean() < 3


@pytest.mark.parametrize("decoder", DECODERS)
def test_exif_orientation_is_not_applied(decoder: str) -> None:
    """Pillow does not rotate by EXIF's orientation, and neither does any decoder (OpenCV would)."""
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    blob = jpeg(photo(np.random.default_rng(2), 24, 40, 3), exif=exif.tobytes())
    out = np.zeros((1, 24, 40, 3), np.uint8)
    assert _jpeg.decode_jpegs(*column([blob]), out, channels=3, decoder=decoder).all()  # type: ignore[arg-type]
    np.testing.assert_array_equal(out[0], pillow(blob))


@pytest.mark.parametrize("subsampling", ["444", "422", "420", "440", "411"])
def test_every_chroma_subsampling_libjpeg_turbo_writes(subsampling: str) -> None:
    """JPEGs written by another encoder (TurboJPEG's, through simplejpeg), with the subsamplings Pillow
    cannot write (4:4:0, 4:1:1) too: every decoder gives Pillow's pixels."""
    simplejpeg = pytest.importorskip("simplejpeg")
    pixels = photo(np.random.default_rng(8), 37, 53, 3)
    blob = simplejpeg.encode_jpeg(pixels, 85, "RGB", subsampling)
    for decoder in DECODERS:
        np.testing.assert_array_equal(_jpeg.decode_jpeg_one(blob, 3, decoder), pillow(blob))  # type: ignore[arg-type]


@pytest.mark.parametrize("decoder", DECODERS)
def test_threads_decode_their_slices_at_once(decoder: str) -> None:
    """As decode_images runs it: slices of one column in a thread pool, into one output array."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(9)
    blobs = [jpeg(photo(rng, 32, 32, 3), quality=int(q)) for q in rng.integers(30, 100, 64)]
    data, starts, ends = column(blobs)
    out = np.zeros((len(blobs), 32, 32, 3), np.uint8)

    def run(lo: int) -> np.ndarray:
        return _jpeg.decode_jpegs(data, starts[lo : lo + 8], ends[lo : lo + 8], out, channels=3,
                                  decoder=decoder, rows=np.arange(lo, lo + 8))  # type: ignore[arg-type]

    with ThreadPoolExecutor(4) as pool:
        assert all(done.all() for done in pool.map(run, range(0, len(blobs), 8)))
    for blob, got in zip(blobs, out, strict=True):
        np.testing.assert_array_equal(got, pillow(blob))


# --- what is left to the general path --------------------------------------------------------------


@pytest.mark.parametrize("decoder", DECODERS)
def test_rows_it_cannot_take_are_left_untouched(decoder: str) -> None:
    rng = np.random.default_rng(3)
    rgb = photo(rng, 16, 16, 3)
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, "PNG")
    cmyk = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(cmyk, "JPEG")
    blobs = [
        jpeg(rgb),                          # taken
        png.getvalue(),                     # not a JPEG
        b"",                                # empty (a null)
        jpeg(photo(rng, 16, 16, 1)),        # grey in an RGB field: the general path refuses it, naming why
        cmyk.getvalue(),                    # CMYK
        jpeg(photo(rng, 16, 17, 3)),        # another size
        b"\xff\xd8\xff\xe0 not a header",   # a JPEG's start, no frame header: the general path decides
        jpeg(rgb, progressive=True),        # taken
    ]
    out = np.full((len(blobs), 16, 16, 3), 7, np.uint8)
    done = _jpeg.decode_jpegs(*column(blobs), out, channels=3, decoder=decoder)  # type: ignore[arg-type]
    assert done.tolist() == [True, False, False, False, False, False, False, True]
    assert (out[~done] == 7).all()
    np.testing.assert_array_equal(out[7], pillow(blobs[7]))


@pytest.mark.parametrize("decoder", DECODERS)
def test_rows_place_each_blob(decoder: str) -> None:
    """``rows=``: the rows of ``out`` that the blobs go to (the rows a PNG fast path left, say)."""
    rng = np.random.default_rng(4)
    blobs = [jpeg(photo(rng, 8, 12, 1)) for _ in range(3)]
    out = np.zeros((6, 8, 12), np.uint8)
    rows = np.array([5, 0, 3])
    assert _jpeg.decode_jpegs(*column(blobs), out, channels=1, decoder=decoder, rows=rows).all()  # type: ignore[arg-type]
    for blob, row in zip(blobs, rows, strict=True):
        np.testing.assert_array_equal(out[row], pillow(blob))
    assert not out[[1, 2, 4]].any()


@pytest.mark.parametrize("decoder", DECODERS)
def test_an_out_that_is_not_contiguous(decoder: str) -> None:
    rng = np.random.default_rng(5)
    blobs = [jpeg(photo(rng, 10, 10, 3)) for _ in range(2)]
    whole = np.zeros((2, 10, 10, 6), np.uint8)
    out = whole[..., ::2]
    assert _jpeg.decode_jpegs(*column(blobs), out, channels=3, decoder=decoder).all()  # type: ignore[arg-type]
    for blob, got in zip(blobs, out, strict=True):
        np.testing.assert_array_equal(got, pillow(blob))


# --- bytes that do not decode ----------------------------------------------------------------------


def outcome(fn: object) -> tuple[str, np.ndarray | None]:
    try:
        return "ok", fn()  # type: ignore[operator]
    except Exception as e:
        return type(e).__name__, None


@pytest.mark.parametrize("decoder", DECODERS)
@settings(max_examples=40, deadline=None)
@given(spec=images, cut=st.floats(0.05, 0.99), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)),
                                                               max_size=4), truncate=st.booleans())
def test_damaged_jpegs_fare_as_with_pillow(decoder: str, spec: dict[str, int], cut: float,
                                           flips: list[tuple[float, int]], truncate: bool) -> None:
    """A truncated JPEG, or one with bytes changed after its headers: where Pillow decodes it (libjpeg
    recovers from some damage) the pixels are Pillow's; where Pillow refuses it, CorruptDatasetError
    names the field and the row. OpenCV (a decoder asked for by name, never the default) recovers from
    some damage Pillow refuses (CI's build decoded a 1x1 JPEG with extraneous bytes): it then gives
    pixels of the field's shape."""
    blobs, shape = make(spec, 1)
    blob = bytearray(blobs[0])
    scan = blob.index(b"\xff\xda")  # damage after the headers: the header check still passes
    if truncate:
        del blob[max(scan + 4, int(len(blob) * cut)):]
    for where, xor in flips:
        at = scan + 2 + int(where * (len(blob) - scan - 3))
        blob[at] ^= xor
    damaged = bytes(blob)
    expected, pixels = outcome(lambda: pillow(damaged))
    event(f"Pillow: {expected}")
    out = np.zeros((3, *(shape if shape[2] == 3 else shape[:2])), np.uint8)
    data, starts, ends = column([damaged])

    def decode() -> np.ndarray:
        return _jpeg.decode_jpegs(data, starts, ends, out, channels=shape[2], decoder=decoder,  # type: ignore[arg-type]
                                  rows=np.array([2]), field="photo")

    if expected != "ok" and decoder == "opencv":
        got, done = outcome(decode)
        assert got == "CorruptDatasetError" or (got == "ok" and done is not None and done.all())
        return
    if expected != "ok":
        with pytest.raises(CorruptDatasetError, match="field 'photo': row 2: an image could not be decoded"):
            decode()
        return
    assert decode().all()
    np.testing.assert_array_equal(out[2], pixels)


@pytest.mark.parametrize("decoder", DECODERS)
def test_decode_one_refuses_by_header(decoder: str) -> None:
    rng = np.random.default_rng(6)
    blob = bytearray(jpeg(photo(rng, 20, 30, 3)))
    sof = blob.index(b"\xff\xc0")
    struct.pack_into(">HH", blob, sof + 5, 60000, 60000)  # a bomb: 3.6 Gpx claimed by a 1 KB file
    with pytest.raises(CorruptDatasetError, match=r"field 'image': row 4: .*60000 x 60000 pixels"):
        _jpeg.decode_jpeg_one(bytes(blob), 3, decoder, row=4)  # type: ignore[arg-type]
    grey = jpeg(photo(rng, 20, 30, 1))
    with pytest.raises(ImageShapeError, match=r"row 0 is a JPEG image of 1 channel \(grey\)"):
        _jpeg.decode_jpeg_one(grey, 3, decoder)  # type: ignore[arg-type]
    field = Field("img", "uint8", (20, 31), codec=ImageCodec("jpeg"))
    with pytest.raises(ImageShapeError, match=r"field 'img': row 9 is an image of shape \(20, 30\)"):
        _jpeg.decode_jpeg_one(grey, 1, decoder, field=field, row=9)  # type: ignore[arg-type]
    with pytest.raises(CorruptDatasetError, match=r"row 0: an image could not be decoded \(not a JPEG"):
        _jpeg.decode_jpeg_one(b"GIF89a....", 3, decoder)  # type: ignore[arg-type]
    field = Field("img", "uint8", (20, 30), codec=ImageCodec("jpeg"))
    assert _jpeg.decode_jpeg_one(grey, 1, decoder, field=field).shape == (20, 30)  # type: ignore[arg-type]


# --- arguments -------------------------------------------------------------------------------------


def test_bad_arguments_are_named() -> None:
    blobs = [jpeg(photo(np.random.default_rng(7), 16, 16, 3))]
    out = np.zeros((1, 16, 16, 3), np.uint8)
    with pytest.raises(ConfigError, match="JPEG decoder 'turbo' is not one of"):
        _jpeg.decode_jpegs(*column(blobs), out, channels=3, decoder="turbo")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"scale=0\.3.*1, 1/2, 1/4 or 1/8"):
        _jpeg.decode_jpegs(*column(blobs), out, channels=3, scale=0.3, size=(16, 16))
    with pytest.raises(ConfigError, match=r"give size=\(H, W\)"):
        _jpeg.decode_jpegs(*column(blobs), out, channels=3, scale=0.5)
    with pytest.raises(ConfigError, match=r"out is uint8 \(16, 16, 3\) per row, but \(16, 16\) images "
                                          r"decoded at scale 0\.5 are uint8 \(8, 8\)"):
        _jpeg.decode_jpegs(*column(blobs), out, channels=3, scale=0.5, size=(16, 16))
    with pytest.raises(ConfigError, match="minimum size"):
        _jpeg.dct_denominator((16, 16), (0, 4))


def test_a_decoder_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # import simplejpeg: ImportError
    _jpeg._installed.cache_clear()
    try:
        with pytest.raises(MissingDependencyError, match=r"pip install 'shardkit\[image\]'"):
            _jpeg.resolve_decoder("simplejpeg")
        assert _jpeg.resolve_decoder("auto") == "pillow"
    finally:
        _jpeg._installed.cache_clear()


# --- the benchmark -----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_decoders_benchmark_quick_runs() -> None:
    """`python -m benchmarks.decoders --quick` runs every installed decoder to the end, every default
    decode with Pillow's pixels, and leaves the committed results alone."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    results = root / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("*.json")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.decoders", "--quick"], cwd=root,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ["shardkit-general", *INSTALLED, *(f"{n}-1/2" for n in INSTALLED)]:
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"| {name} "))
        assert line.rstrip(" |").endswith("64/64"), line
    after = {p.name: p.stat().st_mtime_ns for p in results.glob("*.json")}
    assert after == before, "a --quick run must not touch the committed results"
