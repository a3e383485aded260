"""Columnar batch helpers: gathering rows from many chunks, and cutting chunks into batches."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from shardkit.reader import batching


def _chunks(sizes: list[int], masked: int | None) -> list[batching.Columns]:
    out, start = [], 0
    for k, n in enumerate(sizes):
        ids = np.arange(start, start + n)
        values = ids.astype(np.float32)[:, None] * np.ones((1, 3), np.float32)
        chunk: batching.Columns = {
            "id": ids,
            "x": values,
            "s": np.array([f"s{i}" for i in ids], dtype=object),
            "m": np.ma.MaskedArray(ids, mask=ids % 3 == 0) if k == masked else ids.copy(),
        }
        out.append(chunk)
        start += n
    return out


@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=8), data=st.data())
@settings(max_examples=200, deadline=None)
def test_gather_equals_concatenate_then_index(sizes: list[int], data: st.DataObject) -> None:
    total = sum(sizes)
    masked = data.draw(st.none() | st.integers(0, len(sizes) - 1))
    chunks = _chunks(sizes, masked)
    index = np.array(data.draw(st.lists(st.integers(0, max(0, total - 1)), max_size=40) if total else
                               st.just([])), dtype=np.int64)
    bounds = np.cumsum(sizes)
    owner = np.searchsorted(bounds, index, side="right")
    local = index - (bounds - np.asarray(sizes))[owner] if len(index) else index
    got = batching.gather(chunks, owner, local)
    want = batching.take(batching.concat(chunks), index)
    for name in want:
        np.testing.assert_array_equal(np.ma.getdata(got[name]), np.ma.getdata(want[name]))
        np.testing.assert_array_equal(np.ma.getmaskarray(got[name]), np.ma.getmaskarray(want[name]))
        assert got[name].shape == want[name].shape


def test_gather_copies_once_and_keeps_dtypes() -> None:
    chunks = _chunks([4, 4], None)
    got = batching.gather(chunks, np.array([1, 0, 1]), np.array([3, 0, 0]))
    assert got["id"].tolist() == [7, 0, 4]
    assert got["s"].tolist() == ["s7", "s0", "s4"]
    assert got["x"].dtype == np.float32
    assert got["x"].shape == (3, 3)
    got["id"][0] = -1
    assert chunks[1]["id"][3] == 7  # a new array, not a view of the chunk


@given(sizes=st.lists(st.integers(0, 30), max_size=10), batch=st.integers(1, 16))
def test_batcher_cuts_any_chunks_into_full_batches(sizes: list[int], batch: int) -> None:
    batcher = batching.Batcher(batch)
    seen, start, out = [], 0, []
    for n in sizes:
        assert 1 <= batcher.need() <= batch
        out.extend(batcher.add({"id": np.arange(start, start + n)}))
        start += n
    out.extend(batcher.flush())
    for b in out[:-1]:
        assert len(b["id"]) == batch
    seen = [int(i) for b in out for i in b["id"]]
    assert seen == list(range(start))


def test_a_chunk_of_the_needed_size_completes_the_batch_without_a_copy() -> None:
    batcher = batching.Batcher(4)
    assert list(batcher.add({"id": np.arange(3)})) == []
    assert batcher.need() == 1
    (first,) = batcher.add({"id": np.arange(3, 4)})
    assert first["id"].tolist() == [0, 1, 2, 3]
    chunk = {"id": np.arange(4, 8)}
    (second,) = batcher.add(chunk)
    assert np.shares_memory(second["id"], chunk["id"])
