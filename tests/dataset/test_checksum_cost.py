"""Page checksums written by `ChecksumSink` (pyarrow writes no CRC, the sink adds it with ISA-L's CRC-32
and moves the footer's offsets): the files are byte for byte those pyarrow writes with its own
``write_page_checksum=True``, every page of what `write_dataset` writes carries a CRC that pyarrow's
verification accepts, the summary's footers are the files' own, and a damaged page of any kind (data,
dictionary, image) is named on local, cached and in-place reads."""

from __future__ import annotations

import glob
import io
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
import shardkit.dataset.write as writer
from shardkit.dataset._pages import (
    _FILE_META,
    _OFFSET_INDEX,
    ChecksumSink,
    PageError,
    _Compact,
    _Thrift,
    check_chunk,
    chunk_range,
    walk_pages,
)
from shardkit.dataset.verify import verify_dataset
from shardkit.errors import CorruptDatasetError


class _Kept(io.BytesIO):
    """An in-memory file whose bytes outlive its close."""

    value = b""

    def close(self) -> None:
        self.value = self.getvalue()
        super().close()


def _table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "i": np.arange(n),
        "f": rng.standard_normal(n).astype("f4"),
        "s": [f"x{i % 13}" for i in range(n)],
        "l": pa.array([list(range(i % 5)) if i % 7 else None for i in range(n)], pa.list_(pa.int64())),
        "b": pa.array([bytes(rng.integers(0, 255, i % 300, dtype=np.uint8)) for i in range(n)]),
        "t": pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 9, n * 12, dtype=np.uint8)), 12),
    })


def _both(table: pa.Table, row_group_size: int, **options: Any) -> tuple[bytes, bytes, ChecksumSink]:
    """The file pyarrow writes with its own checksums, and the one written through a `ChecksumSink`."""
    theirs = io.BytesIO()
    with pq.ParquetWriter(theirs, table.schema, write_page_checksum=True, **options) as w:
        if table.num_rows:
            w.write_table(table, row_group_size=row_group_size)
    ours = _Kept()
    sink = ChecksumSink(ours)
    with pq.ParquetWriter(sink, table.schema, write_page_checksum=False, **options) as w:
        if table.num_rows:
            w.write_table(table, row_group_size=row_group_size)
    sink.close()
    return theirs.getvalue(), ours.value, sink


@pytest.mark.parametrize("options", [
    {},
    {"compression": "snappy"},
    {"compression": "zstd", "use_dictionary": ["s"]},
    {"compression": "none", "data_page_size": 1_000},
    {"data_page_version": "2.0"},
    {"write_statistics": False, "use_dictionary": False},
    {"write_page_index": True, "compression": "zstd", "data_page_size": 1_000},
    {"write_page_index": True, "data_page_version": "2.0", "write_statistics": ["i", "s"]},
], ids=["defaults", "snappy", "zstd-dict", "small-pages", "v2-pages", "no-stats-no-dict", "page-index",
        "page-index-v2-some-stats"])
def test_the_sink_writes_the_bytes_pyarrow_writes_with_its_checksums(options: dict[str, Any]) -> None:
    theirs, ours, sink = _both(_table(10_000), 3_000, **options)
    assert ours == theirs
    assert sink.metadata is not None
    assert sink.metadata.to_dict() == pq.read_metadata(io.BytesIO(theirs)).to_dict()
    read = pq.ParquetFile(io.BytesIO(ours), page_checksum_verification=True).read()
    assert read.equals(_table(10_000))
    if options.get("write_page_index"):  # each page's place and size, its checksum in: where it was written
        assert _offset_indexes(ours) == _data_pages(ours, sink.metadata)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 3_000), group=st.integers(1, 2_000), page=st.sampled_from([64, 1_000, 1 << 20]),
       seed=st.integers(0, 3), index=st.booleans())
def test_any_table_and_page_size_gives_pyarrows_bytes(rows: int, group: int, page: int, seed: int,
                                                      index: bool) -> None:
    theirs, ours, _ = _both(_table(rows, seed), group, data_page_size=page, compression="snappy",
                            write_page_index=index)
    assert ours == theirs


@pytest.mark.parametrize("kind", [pa.binary(), pa.string(), pa.int64()])
def test_a_column_of_nulls_with_a_dictionary_gives_pyarrows_bytes(kind: pa.DataType) -> None:
    """A dictionary-encoded column of nulls only: pyarrow writes its empty dictionary page's body as a
    write of no bytes, which the sink takes for nothing (it took it for the footer's start)."""
    table = pa.table({"i": np.arange(3), "x": pa.nulls(3, kind)})
    theirs, ours, _ = _both(table, 3, use_dictionary=["x"], compression="none")
    assert ours == theirs


def test_what_the_sink_cannot_move_is_refused_not_written_wrong() -> None:
    table = _table(1_000)
    sink = ChecksumSink(_Kept())
    with pq.ParquetWriter(sink, table.schema, write_page_checksum=False,
                          bloom_filter_options={"i": {"ndv": 1_000, "fpp": 0.05}}) as w:
        w.write_table(table)
    with pytest.raises(PageError, match="bloom filter"):
        sink.close()
    with pytest.raises(PageError, match="starts with its magic bytes"):
        ChecksumSink(_Kept()).write(b"NOPE")
    torn = ChecksumSink(_Kept())
    torn.write(b"PAR1")
    torn.write(b"\x15\x00\x15")  # a page header cut short: not a page, so taken for the footer
    with pytest.raises(PageError, match="do not end in a Parquet footer"):
        torn.close()


def _offset_indexes(data: bytes) -> list[list[tuple[int, int]]]:
    """Per column chunk, the (offset, size with its header) of each page its offset index names, read
    back from the file ``data`` with the Thrift reader `ChecksumSink` uses (pyarrow does not give the
    page index)."""
    footer = data[-8 - int.from_bytes(data[-8:-4], "little"):-8]
    found = []
    for group in _Thrift(footer, 0).struct(_FILE_META)[4][0][1]:  # type: ignore[arg-type]
        for chunk in group[1][0][1]:
            at, length = chunk[4][0], chunk[5][0]
            index = _Thrift(data[at:at + length], 0).struct(_OFFSET_INDEX)  # type: ignore[arg-type]
            found.append([(loc[1][0], loc[2][0]) for loc in index[1][0][1]])
    return found


def _data_pages(data: bytes, meta: pq.FileMetaData) -> list[list[tuple[int, int]]]:
    """Per column chunk, the (offset, size with its header) of each data page, found by walking them."""
    found = []
    for g in range(meta.num_row_groups):
        for j in range(meta.num_columns):
            start, length = chunk_range(meta.row_group(g).column(j))
            pages = list(walk_pages(data[start:start + length], start))
            ends = [p.offset for p in pages[1:]] + [start + length]
            found.append([(p.offset, end - p.offset) for p, end in zip(pages, ends, strict=True)
                          if p.kind != "dictionary page"])
    return found


def _parts(ds: Path) -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(str(ds / "part-*.parquet")))]


def test_write_dataset_puts_a_checksum_on_every_page_that_pyarrow_accepts(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    n = 5_000
    data = {"id": np.arange(n), "label": rng.integers(0, 10, n),
            "x": list(rng.normal(size=(n, 16)).astype("f4")),
            "image": list(rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8)),
            "name": [f"n{i}" for i in range(n)]}
    schema = [shardkit.Field("id", "int64"), shardkit.Field("label", "int64"),
              shardkit.Field("x", "float32", (16,)), shardkit.Field("image", "uint8", (8, 8, 3)),
              shardkit.Field("name", "str")]
    url = tmp_path / "ds"
    shardkit.write_dataset(data, str(url), schema=schema, row_group_size=700, file_size=200_000,
                           progress=False)
    summary = pq.read_metadata(url / "_metadata")
    listed: dict[str, list[int]] = {}  # file -> its row groups in the summary
    for k in range(summary.num_row_groups):
        listed.setdefault(summary.row_group(k).column(0).file_path, []).append(k)
    groups = 0
    for part in _parts(url):
        pq.ParquetFile(part, page_checksum_verification=True).read()  # pyarrow's own check passes
        meta = pq.read_metadata(part)
        raw = part.read_bytes()
        for i in range(meta.num_row_groups):
            for j in range(meta.num_columns):
                column = meta.row_group(i).column(j)
                start, length = chunk_range(column)
                report = check_chunk(raw[start:start + length], start)
                assert report.problems == []
                assert report.unchecked == 0
                assert report.pages >= 1
                # the summary's footer says where the pages are, as the file's own does
                assert chunk_range(summary.row_group(listed[part.name][i]).column(j)) == (start, length)
            groups += 1
    assert groups == summary.num_row_groups > 2
    ds = shardkit.open_dataset(str(url))
    got = np.concatenate([ds.read_row_group(i).column("id").to_numpy() for i in range(len(ds.row_groups))])
    assert sorted(got.tolist()) == list(range(n))


def test_the_switch_off_writes_pages_without_checksums(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "PAGE_CHECKSUMS", False)
    shardkit.write_dataset({"id": np.arange(100)}, str(tmp_path / "ds"), progress=False)
    part = _parts(tmp_path / "ds")[0]
    meta = pq.read_metadata(part)
    start, length = chunk_range(meta.row_group(0).column(0))
    report = check_chunk(part.read_bytes()[start:start + length], start)
    assert report.unchecked == report.pages >= 1


# ---- reads: a damaged page of each kind ---------------------------------------------------------------

N = 3_000


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ids, a dictionary-encoded label, and an image stored as it is (PNG bytes) and as a tensor."""
    rng = np.random.default_rng(2)
    url = tmp_path_factory.mktemp("images") / "ds"
    pixels = rng.integers(0, 255, (N, 4, 4, 3), dtype=np.uint8)
    schema = [shardkit.Field("id", "int64"), shardkit.Field("label", "int64"),
              shardkit.Field("png", "uint8", (4, 4, 3), codec=shardkit.ImageCodec("png")),
              shardkit.Field("pixels", "uint8", (4, 4, 3))]
    shardkit.write_dataset({"id": np.arange(N), "label": rng.integers(0, 5, N), "png": list(pixels),
                            "pixels": list(pixels)}, str(url), schema=schema, row_group_size=1_000,
                           compression="none", progress=False)
    return url


def _damage(src: Path, dest: Path, column: str, kind: str) -> tuple[Path, int]:
    """A copy of ``src`` with one byte of the first ``kind`` page of ``column`` in row group 1 flipped
    (in its bytes, not its header); returns the file and the row group."""
    shutil.copytree(src, dest)
    part = _parts(dest)[0]
    meta = pq.read_metadata(part)
    raw = bytearray(part.read_bytes())
    group = meta.row_group(1)
    j = [group.column(c).path_in_schema.split(".")[0] for c in range(group.num_columns)].index(column)
    start, length = chunk_range(group.column(j))
    page = next(p for p in walk_pages(memoryview(raw)[start:start + length], start) if p.kind == kind)
    header = _Compact(memoryview(raw), page.offset)
    header.page_header()  # (to where the page's bytes start)
    raw[header.at + page.size // 2] ^= 0x08
    part.write_bytes(bytes(raw))
    return part, 1


def _read_all(url: Path, **kw: Any) -> list[int]:
    ids: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with shardkit.make_reader(str(url), batch_size=100, shuffle=False, **kw) as reader:
            for batch in reader:
                ids += [int(i) for i in batch["id"]]
    return ids


@pytest.mark.parametrize(("column", "kind"), [("id", "data page"), ("label", "dictionary page"),
                                              ("png", "data page"), ("pixels", "data page")])
@pytest.mark.parametrize("cache", [False, True], ids=["local", "cached"])
def test_a_damaged_page_of_any_kind_is_named_on_read(images: Path, tmp_path: Path, column: str, kind: str,
                                                     cache: bool) -> None:
    part, group = _damage(images, tmp_path / "ds", column, kind)
    kw: dict[str, Any] = {"cache": str(tmp_path / "cache") if cache else None}
    for _ in range(2 if cache else 1):  # a cached read: the fill is checked, then the cache has no entry
        with pytest.raises(CorruptDatasetError) as e:
            _read_all(tmp_path / "ds", **kw)
        text = str(e.value)
        assert f"row group {group} of {str(part)!r}" in text
        assert f"column '{column}" in text
        assert "fails its page checksums" in text
    ids = _read_all(tmp_path / "ds", on_error="skip", **kw)
    assert set(ids) == {i for i in range(N) if not 1_000 <= i < 2_000}  # (lost rows are made up by repeats)
    assert verify_dataset(str(tmp_path / "ds")).damaged[0].row_group == group
