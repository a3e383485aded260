"""`write_dataset` with encoded PNG/JPEG values in an image field: stored as they are, byte for byte,
each checked by its header first; pixels and bytes mixed in one column; what is refused, and how.

Every image is a real file written by Pillow; every write a real `write_dataset` (or `write_spark` on a
local Spark session); the stored bytes are read back with pyarrow, around shardkit.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import shardkit
from shardkit import Field, ImageCodec, Schema
from shardkit.cli import main
from shardkit.dataset.codecs import headers
from shardkit.dataset.verify import verify_dataset
from shardkit.dataset.write._sources import BATCH_BYTES, BATCH_ROWS, iter_batches
from shardkit.errors import SchemaMismatchError
from tests.dataset.conftest import assert_nothing_written
from tests.dataset.test_decode_images import png16

H, W = 12, 20


def encoded(pixels: np.ndarray, fmt: str = "JPEG", **options: Any) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **options)
    return buf.getvalue()


def pillow(blob: bytes) -> np.ndarray:
    """What Pillow decodes ``blob`` to."""
    with Image.open(io.BytesIO(blob)) as im:
        return np.asarray(im)


def stored(url: str, name: str = "image") -> list[bytes | None]:
    """The column ``name`` of every data file of the dataset at ``url``, as pyarrow reads it (no shardkit)."""
    ds = shardkit.open_dataset(url)
    tables = [pq.read_table(Path(url) / f, columns=[name]) for f in ds.files]
    return [v for t in tables for v in t.column(name).to_pylist()]


def decoded(ds: shardkit.Dataset, name: str = "image") -> list[Any]:
    """Every decoded row of ``name``, None for a null."""
    out: list[Any] = []
    for i in range(len(ds.row_groups)):
        column = ds.decode(ds.read_row_group(i))[name]
        mask = np.ma.getmaskarray(column) if isinstance(column, np.ma.MaskedArray) else None
        out += [None if mask is not None and mask[j].all() else np.ma.getdata(column)[j]
                for j in range(len(column))]
    return out


def image_field(shape: tuple[int | None, ...] = (H, W, 3), fmt: str = "jpeg", **kw: Any) -> Field:
    return Field("image", "uint8", shape, codec=ImageCodec(fmt, quality=90), **kw)  # type: ignore[arg-type]


@pytest.fixture
def jpegs() -> list[bytes]:
    rng = np.random.default_rng(0)
    return [encoded(rng.integers(0, 256, (H, W, 3), dtype=np.uint8), quality=int(q))
            for q in rng.integers(30, 100, 6)]


def test_every_input_kind_stores_the_jpegs_byte_for_byte(tmp_path: Path, jpegs: list[bytes]) -> None:
    """A dict of columns, row dicts, a DataFrame, an Arrow table of each binary type, streamed record
    batches: the stored bytes are the given ones, and they decode to what Pillow decodes them to."""
    schema = Schema([Field("id", "int64"), image_field()])
    n, ids = len(jpegs), np.arange(len(jpegs))
    inputs: dict[str, Any] = {
        "dict": {"id": ids, "image": jpegs},
        "rows": [{"id": i, "image": b} for i, b in enumerate(jpegs)],
        "frame": pd.DataFrame({"id": ids, "image": jpegs}),
        "bytearray": {"id": ids, "image": [bytearray(b) for b in jpegs]},
        "memoryview": {"id": ids, "image": [memoryview(b) for b in jpegs]},
        "batches": (pa.record_batch({"id": ids[k:k + 2], "image": pa.array(jpegs[k:k + 2], pa.binary())})
                    for k in range(0, n, 2)),
    }
    for kind in (pa.binary(), pa.large_binary(), pa.binary_view()):
        inputs[str(kind)] = pa.table({"id": ids, "image": pa.array(jpegs, kind)})
    for name, data in inputs.items():
        url = str(tmp_path / name)
        ds = shardkit.write_dataset(data, url, schema=schema, row_group_size=4)
        assert stored(url) == jpegs, name
        for got, blob in zip(decoded(ds), jpegs, strict=True):
            assert np.array_equal(got, pillow(blob)), name


def test_batches_of_encoded_images_as_a_reader_gives_them_undecoded(tmp_path: Path,
                                                                    jpegs: list[bytes]) -> None:
    """A dict of numpy columns whose image column is a 1-D object array of bytes (a reader's batch with
    ``decode=False``) is a batch, not one row: with the schema, as ``iter(reader)`` is written back."""
    schema = Schema([Field("id", "int64"), image_field()])
    batches = []
    for k in (0, 3):
        column = np.empty(3, object)
        column[:] = jpegs[k:k + 3]
        batches.append({"id": np.arange(k, k + 3), "image": column})
    ds = shardkit.write_dataset(iter(batches), tmp_path / "ds", schema=schema)
    assert ds.num_rows == len(jpegs)
    assert stored(ds.url) == jpegs


def test_a_readers_undecoded_images_write_back_byte_identical(tmp_path: Path, jpegs: list[bytes]) -> None:
    """``make_reader(decode=False)`` gives the stored bytes; written back with the dataset's schema (its
    image field), they are stored as they are."""
    schema = Schema([Field("id", "int64"), image_field()])
    ds = shardkit.write_dataset({"id": np.arange(len(jpegs)), "image": jpegs}, tmp_path / "a", schema=schema,
                                row_group_size=2)
    reader = shardkit.make_reader(ds.url, decode=False, batch_size=4)
    copy = shardkit.write_dataset(iter(reader), tmp_path / "b", schema=ds.schema)
    assert copy.schema == schema
    by_id = dict(zip(decoded(copy, "id"), stored(copy.url), strict=True))
    assert [by_id[i] for i in range(len(jpegs))] == jpegs


def test_a_column_mixes_pixels_bytes_and_nulls_row_by_row(tmp_path: Path, jpegs: list[bytes]) -> None:
    """Bytes are stored as they are; pixels are encoded by the codec, as a column of pixels alone is."""
    rng = np.random.default_rng(1)
    pixels = [rng.integers(0, 256, (H, W, 3), dtype=np.uint8) for _ in range(3)]
    for shape in ((H, W, 3), (None, None, 3)):
        field = image_field(shape, nullable=True)
        values = [jpegs[0], pixels[0], None, jpegs[1], pixels[1], pixels[2], jpegs[2]]
        ds = shardkit.write_dataset({"image": values}, tmp_path / f"mixed{shape[0]}", schema=[field])
        only_pixels = shardkit.write_dataset({"image": pixels}, tmp_path / f"px{shape[0]}", schema=[field])
        by_codec = iter(stored(only_pixels.url))
        want = [v if isinstance(v, bytes) or v is None else next(by_codec) for v in values]
        assert stored(ds.url) == want
        got = decoded(ds)
        assert got[2] is None
        for g, blob in zip(got, want, strict=True):
            if blob is not None:
                assert np.array_equal(g, pillow(blob))


def test_appending_encoded_images_to_a_dataset_written_from_pixels(tmp_path: Path,
                                                                   jpegs: list[bytes]) -> None:
    rng = np.random.default_rng(2)
    url = str(tmp_path / "ds")
    shardkit.write_dataset({"image": rng.integers(0, 256, (3, H, W, 3), dtype=np.uint8)}, url,
                           schema=[image_field()])
    ds = shardkit.write_dataset({"image": jpegs}, url, mode="append")
    assert ds.num_rows == 3 + len(jpegs)
    assert stored(url)[3:] == jpegs


formats = st.sampled_from([("JPEG", 1), ("JPEG", 3), ("PNG", 1), ("PNG", 3), ("PNG", 4)])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_images_round_trip_byte_identical_and_decode_as_pillow(data: st.DataObject) -> None:
    """For any sizes, formats, layouts and JPEG qualities (and chroma subsampling, progressive or not),
    in a fixed-shape or a varying field, given as bytes among pixels: the bytes stored are the bytes
    given, and they decode to Pillow's pixels."""
    (fmt, channels) = data.draw(formats, label="format")
    height = data.draw(st.integers(1, 40), label="height")
    width = data.draw(st.integers(1, 40), label="width")
    n = data.draw(st.integers(1, 6), label="rows")
    fixed = data.draw(st.booleans(), label="fixed")
    grey_2d = channels == 1 and data.draw(st.booleans(), label="(H, W)")
    dims: tuple[int | None, ...] = (height, width) if fixed else (None, None)
    shape = dims if grey_2d else (*dims, channels)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    values: list[Any] = []
    for _ in range(n):
        h, w = (height, width) if fixed else (int(rng.integers(1, 41)), int(rng.integers(1, 41)))
        pixels = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
        pixels = pixels[:, :, 0] if channels == 1 else pixels
        if data.draw(st.booleans(), label="as pixels"):
            values.append(pixels if grey_2d or channels > 1 else pixels[:, :, None])
            continue
        options: dict[str, Any] = {}
        if fmt == "JPEG":
            options = {"quality": data.draw(st.integers(1, 100), label="quality"),
                       "subsampling": data.draw(st.sampled_from([0, 1, 2]), label="subsampling"),
                       "progressive": data.draw(st.booleans(), label="progressive")}
        else:
            options = {"compress_level": data.draw(st.integers(0, 9), label="level")}
        values.append(encoded(pixels, fmt, **options))
    field = Field("image", "uint8", shape, codec=ImageCodec(fmt.lower()))  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp:
        ds = shardkit.write_dataset({"image": values}, f"{tmp}/ds", schema=[field], row_group_size=3)
        got = stored(ds.url)
        rows = decoded(ds)
    for value, blob, pixels in zip(values, got, rows, strict=True):
        assert isinstance(blob, bytes)
        if isinstance(value, bytes):
            assert blob == value
        want = pillow(blob)
        assert np.array_equal(pixels.reshape(want.shape), want)
        assert pixels.shape == (want.shape if grey_2d or channels > 1 else (*want.shape[:2], 1))


def refused(tmp_path: Path, values: list[Any], field: Field) -> str:
    """The message of the `SchemaMismatchError` writing ``values`` raises; nothing is left written."""
    url = str(tmp_path / "refused")
    with pytest.raises(SchemaMismatchError) as raised:
        shardkit.write_dataset({"image": values}, url, schema=[field])
    assert_nothing_written(url)
    return str(raised.value)


def test_an_image_in_another_format_is_refused_naming_both_fixes(tmp_path: Path, jpegs: list[bytes]) -> None:
    """A PNG in a JPEG field (and a JPEG in a PNG field) is refused: every stored value of a field is in
    its codec's format, for a decoder elsewhere (``decode=False``). Its pixels are taken."""
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    assert refused(tmp_path, [jpegs[0], encoded(pixels, "PNG")], image_field()) == (
        f"field 'image': row 1 is a PNG image of {H}x{W} pixels, 8-bit RGB, but the field holds JPEG images "
        f"of shape ({H}, {W}, 3) (RGB), and encoded images are stored as they are, never encoded again; "
        "declare the field with ImageCodec('png') if its images are, or give this image's pixels (a uint8 "
        "numpy array) for the field's codec to encode as JPEG")
    assert "row 0 is a JPEG image" in refused(tmp_path, [jpegs[0]], image_field(fmt="png"))
    gif = io.BytesIO()
    Image.fromarray(pixels).save(gif, "GIF")
    assert refused(tmp_path, [gif.getvalue()], image_field()).startswith(
        f"field 'image': row 0 is a GIF image of {H}x{W} pixels, 8-bit palette, but the field holds JPEG")
    ds = shardkit.write_dataset({"image": [jpegs[0], pixels]}, tmp_path / "ok", schema=[image_field()])
    assert [headers.claim(b).format for b in stored(ds.url)] == ["JPEG", "JPEG"]  # type: ignore[union-attr,misc]


def test_bytes_that_are_no_image_are_refused_naming_the_row(tmp_path: Path, jpegs: list[bytes]) -> None:
    for bad in (b"not an image", b"", jpegs[0][:3]):
        assert refused(tmp_path, [jpegs[1], jpegs[2], bad], image_field()) == (
            f"field 'image': row 2 is no PNG or JPEG image Pillow opens (UnidentifiedImageError), but the "
            f"field holds JPEG images of shape ({H}, {W}, 3) (RGB); give an encoded JPEG image as bytes, or "
            "the image's pixels as a uint8 numpy array")


def test_a_refused_row_is_named_by_its_place_in_the_input(tmp_path: Path, jpegs: list[bytes]) -> None:
    """Past the first batch, the message names where the batch starts in the input."""
    batches = [pa.record_batch({"image": pa.array(jpegs[:3], pa.binary())}),
               pa.record_batch({"image": pa.array([jpegs[3], b"junk"], pa.binary())})]
    url = str(tmp_path / "ds")
    with pytest.raises(SchemaMismatchError, match=r"^in the batch that starts at input row 3: field 'image': "
                                                  r"row 1 is no PNG or JPEG image"):
        shardkit.write_dataset(iter(batches), url, schema=[image_field()])
    assert_nothing_written(url)


def test_what_its_header_says_is_checked_against_the_field(tmp_path: Path, jpegs: list[bytes],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Size (fixed shape: exactly; varying: within the pixel limit), channels and 8 bits, as reads check
    them: what a write stores, every read decodes."""
    rng = np.random.default_rng(4)
    small = encoded(rng.integers(0, 256, (H - 1, W, 3), dtype=np.uint8))
    assert refused(tmp_path, [jpegs[0], small], image_field()) == (
        f"field 'image': row 1 is a JPEG image of {H - 1}x{W} pixels, 8-bit RGB, but the field holds JPEG "
        f"images of shape ({H}, {W}, 3) (RGB); resize the image before encoding it, or declare the field's "
        "height and width as None (images of varying size)")
    grey = encoded(rng.integers(0, 256, (H, W), dtype=np.uint8))
    message = refused(tmp_path, [grey], image_field())
    assert message.startswith(f"field 'image': row 0 is a JPEG image of {H}x{W} pixels, 8-bit grey, but the "
                              f"field holds JPEG images of shape ({H}, {W}, 3) (RGB), and every read would "
                              "refuse it"), message
    assert "image.convert('RGB')" in message
    deep = png16(rng.integers(0, 1 << 16, (H, W), dtype=np.uint16))
    assert "16-bit grey" in refused(tmp_path, [deep], image_field((None, None), "png"))
    monkeypatch.setattr(headers, "MAX_IMAGE_PIXELS", H * W - 1)
    message = refused(tmp_path, [jpegs[0]], image_field((None, None, 3)))
    assert f"more than the limit of {H * W - 1} for images of varying size" in message, message
    assert f"SHARDKIT_MAX_IMAGE_PIXELS={H * W}" in message
    shardkit.write_dataset({"image": [jpegs[0]]}, tmp_path / "fixed", schema=[image_field()])  # exact size


def test_numpy_arrays_are_pixels_and_text_is_no_image(tmp_path: Path, jpegs: list[bytes]) -> None:
    """A 1-D uint8 array that holds a JPEG (``np.frombuffer``, OpenCV's ``imencode``) is not taken as
    encoded: a numpy array is pixels. The message names ``tobytes()``."""
    as_array = np.frombuffer(jpegs[0], np.uint8)
    assert refused(tmp_path, [as_array], image_field()) == (
        f"field 'image': row 0 is a 1-D uint8 array of {len(jpegs[0])} bytes that holds a JPEG image, but a "
        f"numpy array in an image field is pixels (of shape ({H}, {W}, 3)); pass the encoded image as bytes "
        "(array.tobytes()) to store it as it is, or its decoded pixels")
    assert refused(tmp_path, [jpegs[0], "image.jpg"], image_field()) == (
        "field 'image': row 1 is a str ('image.jpg'), not an image; give pixels as a uint8 numpy array of "
        f"shape ({H}, {W}, 3), or an encoded PNG or JPEG as bytes")
    ds = shardkit.write_dataset({"image": [as_array.tobytes()]}, tmp_path / "ok", schema=[image_field()])
    assert stored(ds.url) == [jpegs[0]]


def test_a_null_in_a_field_that_is_not_nullable(tmp_path: Path, jpegs: list[bytes]) -> None:
    for values in ([jpegs[0], None], pa.array([jpegs[0], None], pa.binary())):
        url = str(tmp_path / "ds")
        with pytest.raises(SchemaMismatchError, match=r"field 'image' \(writing\) is not nullable but "
                                                      r"row 1 is null"):
            shardkit.write_dataset({"image": values}, url, schema=[image_field()])
        assert_nothing_written(url)


def test_inspect_and_verify_a_dataset_of_stored_jpegs(tmp_path: Path, jpegs: list[bytes],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ds = shardkit.write_dataset({"id": np.arange(len(jpegs)), "image": jpegs}, tmp_path / "ds",
                                schema=[Field("id", "int64"), image_field()], row_group_size=2)
    report = verify_dataset(ds.url)
    assert report.ok
    assert report.pages > 0
    assert report.unchecked_pages == 0
    assert main(["verify", ds.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["inspect", ds.url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rows"] == len(jpegs)
    assert info["fields"][1]["codec"] == {"name": "image", "format": "jpeg", "quality": 90}


@pytest.mark.spark
@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning")
def test_write_spark_stores_a_binary_column_of_jpegs_as_it_is(spark: Any, tmp_path: Path,
                                                              jpegs: list[bytes]) -> None:
    pytest.importorskip("pyspark")
    from shardkit.dataset.spark import write_spark

    df = spark.createDataFrame([(i, bytearray(b)) for i, b in enumerate(jpegs)], "id long, image binary")
    schema = Schema([Field("id", "int64"), image_field()])
    ds = write_spark(df.coalesce(1), str(tmp_path / "ds"), schema=schema)
    assert stored(ds.url) == jpegs
    bad = spark.createDataFrame([(0, bytearray(b"junk"))], "id long, image binary")
    with pytest.raises(SchemaMismatchError, match="field 'image': row 0 is no PNG or JPEG image"):
        write_spark(bad, str(tmp_path / "bad"), schema=schema)


def test_a_stream_of_rows_is_cut_into_batches_by_their_bytes_too() -> None:
    """Row dicts are gathered into batches of at most ``BATCH_ROWS`` rows and about ``BATCH_BYTES`` of
    blobs and arrays: 4,096 photos of 1 MB would be 4 GB held at once (and copied) before a row group
    of 16 MiB is written."""
    blob = bytes(1 << 20)
    rows = ({"id": i, "image": blob} for i in range(40))
    sizes = [n for _, n in iter_batches(rows)]
    assert sum(sizes) == 40
    assert max(sizes) == BATCH_BYTES >> 20
    small = [n for _, n in iter_batches({"id": i, "image": b"x"} for i in range(BATCH_ROWS + 1))]
    assert small == [BATCH_ROWS, 1]


def test_pages_of_large_values_hold_about_a_mebibyte(tmp_path: Path) -> None:
    """A column of large values (JPEGs of ~50 KB) is cut into pages of about `PAGE_BYTES` (pyarrow alone
    writes pages of 1,024 values, ~50 MB here), while a column of numbers keeps pyarrow's batches: what a
    lookup or a reader's first batch checks and reads is a page, not a row group."""
    from shardkit.dataset._pages import chunk_range, walk_pages
    from shardkit.dataset.write import PAGE_BYTES

    rng = np.random.default_rng(1)
    blob = encoded(rng.integers(0, 256, (160, 160, 3), dtype=np.uint8), quality=95)
    n = 400
    schema = Schema([Field("id", "int64"), image_field((160, 160, 3))])
    ds = shardkit.write_dataset({"id": np.arange(n), "image": [blob] * n}, str(tmp_path / "d"), schema=schema,
                                row_group_size=n)
    (path,) = [Path(tmp_path / "d" / f) for f in ds.files]
    md = pq.read_metadata(path)
    data = path.read_bytes()
    sizes = {}
    for j in range(md.num_columns):
        column = md.row_group(0).column(j)
        start, length = chunk_range(column)
        sizes[column.path_in_schema] = [p.size for p in walk_pages(data[start:start + length], start)
                                        if p.kind.startswith("data page")]
    per_page = -(-PAGE_BYTES // len(blob))  # a page ends at the first batch that fills PAGE_BYTES
    assert len(sizes["image"]) == -(-n // per_page), (len(blob), sizes["image"])
    assert max(sizes["image"]) < PAGE_BYTES + 2 * len(blob)
    assert len(sizes["id"]) == 1
    assert stored(str(tmp_path / "d")) == [blob] * n
