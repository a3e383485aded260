"""Lookups that read only the pages holding their rows (`Dataset.read_rows`, Parquet's offset index, which
`write_dataset` writes): the rows of a full read, from a few pages of each column; a damaged page fails
the lookups of its rows only, naming its column; files without a page index are read whole, once noted."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
import shardkit.dataset.write as write_module
from shardkit.dataset import RowAccess
from shardkit.errors import CorruptDatasetError

N = 6_000


def _columns() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {"id": np.arange(N), "label": rng.integers(0, 10, N),
            "x": list(rng.standard_normal((N, 8)).astype("f4")),
            "name": [f"name-{i % 97}" for i in range(N)],
            "v": [rng.integers(0, 9, i % 6).astype(np.int16) for i in range(N)],
            "maybe": [None if i % 5 == 0 else float(i) for i in range(N)]}


@pytest.fixture(scope="module")
def paged(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """A dataset of 2 row groups whose column chunks hold many pages each (pages of ~4 KiB)."""
    url = str(tmp_path_factory.mktemp("paged") / "ds")
    columns = _columns()
    schema = [shardkit.Field("id", "int64"), shardkit.Field("label", "int64"),
              shardkit.Field("x", "float32", (8,)), shardkit.Field("name", "str"),
              shardkit.Field("v", "int16", (None,)), shardkit.Field("maybe", "float64", nullable=True)]
    with mock.patch.object(write_module, "PAGE_BYTES", 4096):
        shardkit.write_dataset(columns, url, schema=schema, row_group_size=N // 2, progress=False,
                               compression="zstd")
    return url, columns


def _pages(url: str) -> int:
    """The data and dictionary pages of every column chunk of the dataset's files."""
    from shardkit.dataset._pages import chunk_range, walk_pages

    total = 0
    for part in sorted(Path(url).glob("part-*.parquet")):
        data = part.read_bytes()
        md = pq.read_metadata(part)
        for g in range(md.num_row_groups):
            for j in range(md.num_columns):
                start, length = chunk_range(md.row_group(g).column(j))
                total += sum(1 for _ in walk_pages(data[start:start + length], start))
    return total


def test_a_lookup_reads_only_the_pages_of_its_rows(paged: tuple[str, dict[str, Any]]) -> None:
    url, columns = paged
    ds = shardkit.open_dataset(url)
    rows = RowAccess(ds, cache_bytes=0)
    picked = [0, 2_999, 3_000, 4_321, N - 1, 17, 17]
    got = rows.take(picked)
    np.testing.assert_array_equal(got["id"], picked)
    np.testing.assert_array_equal(got["label"], columns["label"][picked])
    np.testing.assert_array_equal(np.stack(got["x"]), np.stack([columns["x"][i] for i in picked]))
    assert list(got["name"]) == [columns["name"][i] for i in picked]
    for value, i in zip(got["v"], picked, strict=True):
        np.testing.assert_array_equal(value, columns["v"][i])
    assert [None if np.ma.is_masked(m) else float(m) for m in got["maybe"]] == [columns["maybe"][i]
                                                                                 for i in picked]
    assert rows.stats["page_reads"] == 2  # one per row group
    # (a column whose few pages are mostly needed, as a dictionary page is, is read whole: counted here)
    assert rows.stats["row_groups_read"] <= 2
    total = _pages(url)
    assert total > 50, total
    # 6 rows in 2 row groups: per column at most a page or two per row (and a dictionary page)
    assert rows.stats["pages_read"] <= 6 * 6 * 2 + 2 * 6, (rows.stats, total)
    one = RowAccess(ds, ["x"], cache_bytes=0)
    np.testing.assert_array_equal(one.take([4_321])["x"][0], columns["x"][4_321])
    assert one.stats["pages_read"] <= 2, one.stats


def test_lookups_keep_the_row_groups_they_read_whole(paged: tuple[str, dict[str, Any]]) -> None:
    """A dataset's lookups share what they keep (`Dataset.lookups`): a row group asked again after a lookup
    read its pages is read whole and kept; a lookup of most of a column's pages reads it whole and keeps
    it; what is kept answers the next lookups with no read; a budget of 0 keeps nothing."""
    url, columns = paged
    ds = shardkit.open_dataset(url)
    first = RowAccess(ds, ["x"], kept=ds.lookups)
    np.testing.assert_array_equal(first.take([10])["x"][0], columns["x"][10])
    assert (first.stats["page_reads"], first.stats["row_groups_read"], ds.lookups.nbytes) == (1, 0, 0)
    np.testing.assert_array_equal(first.take([20])["x"][0], columns["x"][20])  # again: whole, kept
    assert (first.stats["page_reads"], first.stats["row_groups_read"]) == (1, 1)
    kept = ds.lookups.nbytes
    assert kept > 0
    got = ds.take([30, 2_999, 5], ["x"])  # a take of its own, from what the first kept
    np.testing.assert_array_equal(np.stack(got["x"]), np.stack([columns["x"][i] for i in (30, 2_999, 5)]))
    assert ds.lookups.nbytes == kept
    dense = RowAccess(ds, ["x"], kept=ds.lookups)
    second_group = np.arange(N // 2, N, 7)  # every page of the second row group's x holds one of them
    np.testing.assert_array_equal(np.stack(dense.take(second_group)["x"]),
                                  np.stack([columns["x"][i] for i in second_group]))
    assert (dense.stats["row_groups_read"], dense.stats["page_reads"]) == (1, 1)  # its pages: read whole
    assert ds.lookups.nbytes > kept
    dense.take(second_group[:3])
    assert dense.stats["row_groups_kept_hits"] == 1
    other = shardkit.open_dataset(url)
    other.lookups.budget = 0
    fresh = RowAccess(other, ["x"], kept=other.lookups)
    for _ in range(3):
        np.testing.assert_array_equal(fresh.take([100])["x"][0], columns["x"][100])
    assert (fresh.stats["page_reads"], fresh.stats["row_groups_read"], other.lookups.nbytes) == (3, 0, 0)


def test_a_damaged_page_fails_only_the_lookups_of_its_rows(paged: tuple[str, dict[str, Any]],
                                                            tmp_path: Path) -> None:
    import shutil

    from shardkit.dataset._pages import chunk_range, walk_pages

    url = str(tmp_path / "ds")
    shutil.copytree(paged[0], url)
    part = sorted(Path(url).glob("part-*.parquet"))[0]
    md = pq.read_metadata(part)
    j = next(j for j in range(md.num_columns) if md.row_group(0).column(j).path_in_schema == "x")
    start, length = chunk_range(md.row_group(0).column(j))
    data = bytearray(part.read_bytes())
    pages = [p for p in walk_pages(bytes(data[start:start + length]), start) if p.kind == "data page"]
    assert len(pages) >= 3
    damaged = pages[-1]
    data[damaged.offset + damaged.size] ^= 0xFF  # a byte of its body (the header is shorter than its size)
    part.write_bytes(bytes(data))
    ds = shardkit.open_dataset(url)
    ds.lookups.budget = 0  # (else the row group is read whole at its second lookup: it fails whole)
    assert int(ds.take([0], ["x", "id"])["id"][0]) == 0  # the first page: read, checked, fine
    with pytest.raises(CorruptDatasetError, match=rf"column 'x': the page at byte {damaged.offset} "
                                                  "does not match its checksum"):
        ds.take([N // 2 - 1], ["id", "x"])
    assert int(ds.take([1], ["x", "id"])["id"][0]) == 1
    kept = shardkit.open_dataset(url)
    kept.take([0], ["x"])
    with pytest.raises(CorruptDatasetError, match=rf"column 'x': the data page at byte {damaged.offset} "):
        kept.take([1], ["x"])  # its second lookup: the row group read whole, its damaged page named


def test_files_without_a_page_index_are_read_whole_once_noted(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    table = pa.table({"id": np.arange(1_000), "y": np.arange(1_000) * 2.0})
    pq.write_table(table, folder / "a.parquet", row_group_size=250, write_page_index=False)
    shardkit.write_summary(str(folder))
    ds = shardkit.open_dataset(str(folder))
    rows = RowAccess(ds, cache_bytes=0)
    with caplog.at_level(logging.INFO, logger="shardkit.dataset"):
        np.testing.assert_array_equal(rows.take([3, 600, 999])["y"], [6.0, 1200.0, 1998.0])
        rows.take([5])
        ds.take([7])  # a RowAccess of its own: no second note for the same dataset
    assert (rows.stats["row_groups_read"], rows.stats["page_reads"]) == (4, 0)
    notes = [r.getMessage() for r in caplog.records if "page index" in r.getMessage()]
    assert len(notes) == 1, notes
    assert "reads whole column chunks: its files have no page index" in notes[0]
    pq.write_table(table, folder / "a.parquet", row_group_size=250, write_page_index=True)
    shardkit.write_summary(str(folder))
    indexed = RowAccess(shardkit.open_dataset(str(folder)), cache_bytes=0)  # pyarrow's own page index
    np.testing.assert_array_equal(indexed.take([3, 600, 999])["y"], [6.0, 1200.0, 1998.0])
    assert indexed.stats["page_reads"] == 3


@settings(max_examples=200, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 500)), max_size=30),
       gap=st.sampled_from([0, 64, 4096]), spare=st.sampled_from([0.0, 0.5, 2.0]))
def test_coalesced_requests_cover_every_range_once_within_the_bytes_allowed(
        spans: list[tuple[int, int]], gap: int, spare: float) -> None:
    from shardkit.dataset._page_reads import coalesced

    ranges = [(start, start + length) for start, length in spans]
    requests = coalesced(ranges, gap, spare)
    assert requests == sorted(requests)
    assert all(s < e for s, e in requests)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(requests))  # disjoint, apart
    for start, end in ranges:
        assert sum(1 for s, e in requests if s <= start and end <= e) == 1
    covered = np.zeros(10_600, dtype=bool)
    for start, end in ranges:
        covered[start:end] = True
    wanted = int(covered.sum())
    gaps_within = sum(e - s for s, e in coalesced(ranges, gap, 0.0)) - wanted  # merged for the gap alone
    assert sum(e - s for s, e in requests) <= wanted + gaps_within + spare * (wanted + gaps_within)
    assert len(requests) <= len(coalesced(ranges, gap, 0.0))


def test_kept_rows_drop_the_least_recently_used_past_their_budget() -> None:
    from shardkit.dataset import KeptRows

    kept = KeptRows(100)
    kept.put_ranges("a.parquet", {(0, 40): b"x" * 40, (40, 80): b"y" * 40})
    assert set(kept.get_ranges("a.parquet", [(0, 40)])) == {(0, 40)}  # (now the most recently used)
    kept.put(3, pa.table({"n": pa.array(np.arange(5, dtype=np.int64))}))  # 40 bytes: (40, 80) dropped
    assert kept.nbytes == 80
    assert kept.get_ranges("a.parquet", [(0, 40), (40, 80)]).keys() == {(0, 40)}
    assert list(kept.get(3, ["n"])["n"].to_numpy()) == [0, 1, 2, 3, 4]
    kept.put_ranges("a.parquet", {(80, 281): b"z" * 201})  # larger than the budget: not kept
    assert kept.nbytes == 80
    nothing = KeptRows(0)
    nothing.put_ranges("a.parquet", {(0, 1): b"x"})
    nothing.put(0, pa.table({"n": [1]}))
    assert (nothing.nbytes, nothing.get(0, ["n"]), nothing.get_ranges("a.parquet", [(0, 1)])) == (0, {}, {})
