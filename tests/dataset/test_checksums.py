"""Corrupt bytes never become training data: a bit flipped anywhere in a part file's pages (or a 4 KiB
block of zeros) is caught by the page checksums shardkit writes; the reader raises, or with
``on_error="skip"`` leaves the damaged row group out and counts it, never delivering a wrong value;
``shardkit verify`` names every such damage and none on intact data."""

from __future__ import annotations

import glob
import io
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.dataset._pages import MISMATCH, ChunkReport, PageError, check_chunk, chunk_range, walk_pages
from shardkit.dataset.verify import verify_dataset
from shardkit.errors import CorruptDatasetError

N = 6_000
SCHEMA = [shardkit.Field("id", "int64"), shardkit.Field("label", "int64"),
          shardkit.Field("x", "float32", (16,))]
REPO = Path(__file__).resolve().parents[2]


def _data() -> dict[str, object]:
    rng = np.random.default_rng(0)
    return {"id": np.arange(N), "label": rng.integers(0, 10, N),
            "x": list(rng.normal(size=(N, 16)).astype(np.float32))}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    url = tmp_path_factory.mktemp("pristine") / "ds"
    shardkit.write_dataset(_data(), str(url), schema=SCHEMA, row_group_size=1_000)
    return url


def _part(ds: Path) -> Path:
    return Path(sorted(glob.glob(str(ds / "part-*.parquet")))[0])


def _pages_end(part: Path) -> int:
    """Where the file's pages end (its footer starts)."""
    data = part.read_bytes()
    return len(data) - 8 - int.from_bytes(data[-8:-4], "little")


def _damaged(pristine: Path, tmp_path: Path, *flips: tuple[int, int, int | None, int]) -> tuple[Path, Path]:
    """A copy of ``pristine`` at ``tmp_path/ds`` with, for each ``(row group, column, at, mask)``, a byte of
    that column chunk XORed with ``mask``: its middle byte (``at`` None), else the ``at``-th (negative:
    from the chunk's end). Returns the copy and its part file."""
    ds = tmp_path / "ds"
    shutil.copytree(pristine, ds)
    part = _part(ds)
    meta = pq.read_metadata(part)
    data = bytearray(part.read_bytes())
    for group, column, at, mask in flips:
        start, length = chunk_range(meta.row_group(group).column(column))
        data[start + (length // 2 if at is None else at % length)] ^= mask
    part.write_bytes(bytes(data))
    return ds, part


def _rows(ds: Path, **kw: object) -> tuple[dict[int, tuple[int, bytes]], dict[str, int]]:
    """id -> (label, x bytes) of every row a reader delivers, and its stats."""
    got: dict[int, tuple[int, bytes]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {"cache": None, **kw}
        with shardkit.make_reader(str(ds), batch_size=100, shuffle=False, **kw) as reader:
            for batch in reader:
                for i, label, x in zip(batch["id"], batch["label"], batch["x"], strict=True):
                    got.setdefault(int(i), (int(label), x.tobytes()))
            return got, dict(reader.stats)


def test_every_page_shardkit_writes_carries_a_checksum(pristine: Path) -> None:
    meta = pq.read_metadata(_part(pristine))
    data = _part(pristine).read_bytes()
    pages = 0
    for i in range(meta.num_row_groups):
        for j in range(meta.num_columns):
            start, length = chunk_range(meta.row_group(i).column(j))
            report = check_chunk(data[start:start + length], start)
            assert report.problems == []
            assert report.unchecked == 0
            pages += report.pages
    assert pages >= meta.num_row_groups * meta.num_columns
    assert verify_dataset(str(pristine)).ok


def _walked(data: bytes, start: int) -> ChunkReport:
    """`check_chunk` as the general page walk alone gives it (`walk_pages`: every header read field by
    field), the reference of its one-match fast path."""
    report = ChunkReport()
    try:
        for page in walk_pages(data, start):
            report.pages += 1
            if page.ok is None:
                report.unchecked += 1
            elif not page.ok:
                report.problems.append(f"the {page.kind} at byte {page.offset} {MISMATCH}")
    except PageError as e:
        report.problems.append(str(e))
    return report


@settings(max_examples=60, deadline=None)
@given(version=st.sampled_from(["1.0", "2.0"]), crc=st.booleans(), dictionary=st.booleans(),
       statistics=st.booleans(), compression=st.sampled_from(["none", "snappy", "zstd"]),
       page_size=st.sampled_from([256, 4096, 1 << 20]), rows=st.integers(1, 3000),
       flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)), max_size=3))
def test_the_fast_page_walk_finds_what_the_general_walk_finds(version: str, crc: bool, dictionary: bool,
                                                              statistics: bool, compression: str,
                                                              page_size: int, rows: int,
                                                              flips: list[tuple[float, int]]) -> None:
    """Page headers of every shape pyarrow writes (v1 and v2 data pages, dictionary pages, statistics,
    with and without a crc), pristine and with bits flipped anywhere (headers included): the same
    pages, unchecked pages and problems as the general walk."""
    rng = np.random.default_rng(rows)
    table = pa.table({"id": np.arange(rows), "cat": rng.integers(0, 7, rows).astype(np.int32),
                      "x": pa.array([rng.bytes(int(n)) for n in rng.integers(0, 300, rows)]),
                      "s": [f"v{i % 13}" for i in range(rows)]})
    sink = io.BytesIO()
    pq.write_table(table, sink, data_page_version=version, write_page_checksum=crc, use_dictionary=dictionary,
                   write_statistics=statistics, compression=compression, data_page_size=page_size)
    data = bytearray(sink.getvalue())
    meta = pq.read_metadata(io.BytesIO(bytes(data)))
    for where, bit in flips:
        data[4 + int(where * (len(data) - 12))] ^= 1 << bit
    for i in range(meta.num_row_groups):
        for j in range(meta.num_columns):
            start, length = chunk_range(meta.row_group(i).column(j))
            chunk = bytes(data[start:start + length])
            assert check_chunk(chunk, start) == _walked(chunk, start)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7), block=st.booleans())
def test_a_damaged_page_never_becomes_a_value(pristine: Path, tmp_path_factory: pytest.TempPathFactory,
                                              where: float, bit: int, block: bool) -> None:
    ds = tmp_path_factory.mktemp("damaged") / "ds"
    shutil.copytree(pristine, ds)
    part = _part(ds)
    data = bytearray(part.read_bytes())
    at = 4 + int(where * (_pages_end(part) - 4))  # anywhere in the pages: headers, dictionaries, data
    if block:
        start = at - at % 4096
        data[start:start + 4096] = bytes(len(data[start:start + 4096]))
    else:
        data[at] ^= 1 << bit
    if bytes(data) == part.read_bytes():
        return  # a block of zeros over zeros changes nothing
    part.write_bytes(bytes(data))
    truth = _data()
    report = verify_dataset(str(ds))
    try:
        got, _ = _rows(ds)
    except CorruptDatasetError:
        assert not report.ok, "the reader raised where verify found nothing"
    else:  # the change hit nothing a value depends on (a statistic, padding): every value is right
        assert len(got) == N
    skipped, stats = _rows(ds, on_error="skip")
    for i, (label, x) in skipped.items():  # nothing wrong is ever delivered
        assert label == truth["label"][i]  # type: ignore[index]
        assert x == truth["x"][i].tobytes()  # type: ignore[index]
    lost = N - len(skipped)
    assert lost == 0 or stats["skipped_row_groups"] >= 1
    assert (lost > 0) <= (not report.ok)  # what the reader loses, verify names


def test_resume_after_a_skipped_row_group_is_exactly_once(pristine: Path, tmp_path: Path) -> None:
    ds, _ = _damaged(pristine, tmp_path, (2, 2, None, 0x10))
    kw = {"batch_size": 50, "seed": 3, "on_error": "skip", "num_shards": 2, "cache": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = []
        for shard in range(2):
            with shardkit.make_reader(str(ds), shard=shard, **kw) as r:
                whole += [int(i) for b in r for i in b["id"]]
        resumed = []
        for shard in range(2):
            with shardkit.make_reader(str(ds), shard=shard, **kw) as r:
                it = iter(r)
                resumed += [int(i) for _ in range(7) for i in next(it)["id"]]
                state = r.state_dict()
            with shardkit.make_reader(str(ds), shard=shard, **kw) as r:
                r.load_state_dict(state)
                resumed += [int(i) for b in r for i in b["id"]]
    assert sorted(resumed) == sorted(whole)
    assert not set(whole) & set(range(2_000, 3_000))  # row group 2's rows are lost, none delivered


def test_the_reader_names_the_file_row_group_column_and_fix(pristine: Path, tmp_path: Path) -> None:
    ds, part = _damaged(pristine, tmp_path, (4, 1, -3, 1))
    with pytest.raises(CorruptDatasetError) as e:
        _rows(ds)
    text = str(e.value)
    assert f"row group 4 of {str(part)!r}" in text
    assert "column 'label'" in text
    assert "does not match its checksum" in text
    assert "Restore the file from its source" in text


def _verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", "verify", *args], capture_output=True, text=True,
                          timeout=120, check=False, cwd=REPO)


def test_verify_exits_0_on_intact_data_and_1_naming_every_damage(pristine: Path, tmp_path: Path) -> None:
    ok = _verify(str(pristine), "--no-progress")
    assert ok.returncode == 0, ok.stderr
    assert "no damage found" in ok.stdout
    ds, _ = _damaged(pristine, tmp_path, (1, 0, None, 4), (3, 2, None, 4))
    bad = _verify(str(ds), "--json")
    assert bad.returncode == 1, bad.stderr
    found = {(d["row_group"], d["column"]) for d in json.loads(bad.stdout)["damaged"]}
    assert found == {(1, "id"), (3, "x")}
    text = _verify(str(ds), "--no-progress")
    assert text.returncode == 1
    assert text.stdout.count("DAMAGED") == 2
    assert "Fix: restore the damaged files" in text.stdout


def test_verify_says_which_pages_carry_no_checksum_and_a_truncated_file(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    pq.write_table(pa.table({"id": np.arange(1000)}), plain / "a.parquet")  # pyarrow's default: no CRC
    shardkit.write_summary(str(plain))
    report = verify_dataset(str(plain))
    assert report.ok
    assert report.unchecked_pages == report.pages > 0
    out = _verify(str(plain), "--no-progress")
    assert out.returncode == 0
    assert "carry no page checksum" in out.stdout
    assert "shardkit write" in out.stdout
    part = plain / "a.parquet"
    part.write_bytes(part.read_bytes()[:-100])
    truncated = verify_dataset(str(plain))
    assert [d.row_group for d in truncated.damaged] == [None]
    assert "footer cannot be read" in truncated.damaged[0].problem


def test_shardkit_write_rewrites_a_folder_with_checksums(tmp_path: Path) -> None:
    src = tmp_path / "src.parquet"
    pq.write_table(pa.table({"id": np.arange(500)}), src)
    dest = tmp_path / "dest"
    proc = subprocess.run([sys.executable, "-m", "shardkit", "write", str(src), str(dest), "--no-progress"],
                          capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    report = verify_dataset(str(dest))
    assert report.ok
    assert report.unchecked_pages == 0
    assert report.pages > 0


def test_pyarrow_alone_delivers_wrong_values_without_checksums() -> None:
    """Why: the same flip in a file written without page checksums reads without an error."""
    table = pa.table({"x": np.arange(50_000, dtype=np.float64)})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="none", use_dictionary=False)
    data = bytearray(buf.getvalue())
    data[1000] ^= 2
    assert not pq.read_table(io.BytesIO(bytes(data))).equals(table)


def _inspect(url: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", "inspect", str(url), *args], capture_output=True,
                          text=True, timeout=120, check=False, cwd=REPO)


def test_inspect_says_whether_the_files_carry_checksums(pristine: Path, tmp_path: Path) -> None:
    out = _inspect(pristine)
    assert out.returncode == 0, out.stderr
    assert "page checksums: yes" in out.stdout
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(pa.table({"id": np.arange(100)}), mixed / "a.parquet")  # pyarrow's default: none
    pq.write_table(pa.table({"id": np.arange(100, 200)}), mixed / "b.parquet", write_page_checksum=True)
    shardkit.write_summary(str(mixed))
    out = _inspect(mixed)
    assert "page checksums: in 1 of 2 files looked at" in out.stdout
    assert "shardkit write URL NEW_URL" in out.stdout
    info = json.loads(_inspect(mixed, "--json").stdout)
    assert info["page_checksums"] == {"files_checked": 2, "with_checksums": 1, "unreadable": 0}
    report = verify_dataset(str(mixed))  # the scrub checks what is there and says what is not
    assert report.ok
    assert [f.unchecked_pages > 0 for f in sorted(report.files, key=lambda f: f.file)] == [True, False]


def test_the_cache_keeps_no_entry_of_a_damaged_row_group(pristine: Path, tmp_path: Path) -> None:
    """A cache fill verifies what it caches: after a read with on_error='skip' filled the cache, the
    damaged row group is still read from the file (and still raises), never served from the cache."""
    ds, _ = _damaged(pristine, tmp_path, (3, 0, None, 0x20))
    cache = str(tmp_path / "cache")
    truth = _data()
    for _ in range(2):  # the second read is served by the cache, but for the damaged row group
        got, stats = _rows(ds, on_error="skip", cache=cache)
        assert stats["skipped_row_groups"] == 1
        assert len(got) == N - 1_000
        for i, (label, _x) in got.items():
            assert label == truth["label"][i]  # type: ignore[index]
    with pytest.raises(CorruptDatasetError, match="fails its page checksums"):
        _rows(ds, cache=cache)


# -- fetched row groups (a remote store): their pages checked as pyarrow reads them ----------------------

def _fetched_file(data: bytes, meta: pq.FileMetaData, group: int, *, fail: frozenset[int] = frozenset(),
                  asked: list[tuple[int, int]] | None = None, part: int = 1 << 16) -> Any:
    """Row group ``group`` of the Parquet bytes ``data`` as the fetch-ahead serves it (a `Fetcher` over
    the bytes, parts of ``part`` bytes; the parts in ``fail`` fail once), wrapped in a checking
    `FetchedFile` for pyarrow; ``asked`` collects the ranges asked for once more."""
    from shardkit.dataset.fetch import FetchedFile, Fetcher

    rg = meta.row_group(group)
    chunks = []
    for j in range(rg.num_columns):
        start, length = chunk_range(rg.column(j))
        chunks.append((rg.column(j).path_in_schema, start, start + length))
    parts = iter(range(1 << 30))
    failing = set(fail)

    def get(path: str, start: int, end: int) -> bytes:
        if next(parts) in failing:
            raise OSError("connection reset")
        return data[start:end]

    def again(start: int, end: int) -> bytes:
        if asked is not None:
            asked.append((start, end))
        return data[start:end]

    fetcher = Fetcher(get, max_bytes=1 << 30, part=part)
    fetcher.plan([(group, "part", [(a, b) for _, a, b in chunks])])
    fetched = fetcher.take(group)
    assert fetched is not None
    return pa.PythonFile(FetchedFile(fetched, again, lambda e: None, chunks), mode="r")


def _read_fetched(source: Any, meta: pq.FileMetaData, group: int) -> pa.Table:
    pf = pq.ParquetFile(source, metadata=meta, buffer_size=1 << 12, page_checksum_verification=False)
    return pf.read_row_group(group)


@pytest.fixture(scope="module")
def long_headers() -> tuple[bytes, pq.FileMetaData]:
    """A Parquet file whose pages carry checksums and, for a string column of long values, page headers
    longer than the first read of a header (`_pages.HEADER_BYTES`: their statistics)."""
    rng = np.random.default_rng(3)
    n = 3_000
    table = pa.table({"id": np.arange(n), "x": rng.normal(size=n).astype(np.float32),
                      "s": [f"k{i:05d}" * 60 for i in rng.integers(0, 99_999, n)]})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=1_000, data_page_size=1 << 13, write_page_checksum=True,
                   write_statistics=True, use_dictionary=False)
    data = buf.getvalue()
    return data, pq.read_metadata(io.BytesIO(data))


def test_a_fetched_row_group_reads_whole_with_its_pages_checked(long_headers: tuple[bytes, pq.FileMetaData]
                                                                ) -> None:
    from shardkit.dataset._pages import HEADER_BYTES, page_header, walk_pages

    data, meta = long_headers
    start, length = chunk_range(meta.row_group(1).column(2))
    pages = list(walk_pages(data[start:start + length], start))
    assert all(p.crc is not None for p in pages)
    assert max(page_header(data[p.offset:])[3] for p in pages) > HEADER_BYTES  # read again, longer
    truth = pq.read_table(io.BytesIO(data)).slice(1_000, 1_000)
    assert _read_fetched(_fetched_file(data, meta, 1), meta, 1).equals(truth)


def test_a_failed_part_is_asked_for_once_more_and_its_bytes_kept(long_headers: tuple[bytes, pq.FileMetaData]
                                                                 ) -> None:
    """The check and the decoder read the same bytes: a part whose request failed is fetched again once,
    whole, not once for the check and again for the decoder."""
    data, meta = long_headers
    asked: list[tuple[int, int]] = []
    source = _fetched_file(data, meta, 0, fail=frozenset({0, 2}), asked=asked, part=1 << 13)
    assert _read_fetched(source, meta, 0).equals(pq.read_table(io.BytesIO(data)).slice(0, 1_000))
    assert len(asked) == 2
    assert len(set(asked)) == 2


@settings(max_examples=60, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7), group=st.integers(0, 2))
def test_a_damaged_fetched_page_never_reaches_the_decoder(long_headers: tuple[bytes, pq.FileMetaData],
                                                          where: float, bit: int, group: int) -> None:
    """A bit flipped anywhere in a fetched row group's column chunks: the read raises before pyarrow
    decodes the damaged page (its own check is off), or the flip hit nothing a value depends on and the
    values are right."""
    data, meta = long_headers
    rg = meta.row_group(group)
    first = chunk_range(rg.column(0))[0]
    last = chunk_range(rg.column(rg.num_columns - 1))
    at = first + int(where * (last[0] + last[1] - first))
    damaged = bytearray(data)
    damaged[at] ^= 1 << bit
    truth = pq.read_table(io.BytesIO(data)).slice(group * 1_000, 1_000)
    try:
        got = _read_fetched(_fetched_file(bytes(damaged), meta, group), meta, group)
    except pa.ArrowException:
        return  # a page header's field changed (headers carry no checksum): pyarrow refuses it
    except OSError as e:  # the check's (pyarrow passes on what a Python file raises, as it is)
        caught = str(e)
    else:
        assert got.equals(truth)
        return
    assert "checksum" in caught or "cannot be read" in caught or "past the end" in caught, caught
