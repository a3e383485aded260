"""Columnar batch helpers: gathering rows from many chunks, and cutting chunks into batches."""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

import shardkit
from shardkit.reader._pipeline import batching


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


# --- windows placed by the workers, in arrays used again ------------------------------------------


@given(window_rows=st.lists(st.integers(1, 50), min_size=1, max_size=5), batch=st.integers(1, 12),
       max_batches=st.integers(1, 6), max_bytes=st.integers(1, 4000))
@settings(max_examples=200, deadline=None)
def test_runs_cut_back_into_batches_are_the_batches(window_rows: list[int], batch: int, max_batches: int,
                                                   max_bytes: int) -> None:
    # batches as the reader makes them: views of one array per window (a shuffle window), cut by a
    # Batcher, so a batch may straddle two windows (a copy) and the epoch may end with a short one
    batcher, batches, start = batching.Batcher(batch), [], 0
    for n in window_rows:
        ids = np.arange(start, start + n)
        window = {"id": ids, "x": np.repeat(ids, 3).reshape(n, 3).astype(np.float32),
                  "s": np.array([str(i) for i in ids], dtype=object)}
        batches += list(batcher.add(window))
        start += n
    batches += list(batcher.flush())
    runs = list(batching.runs(batches, batch, max_bytes, max_batches))
    cut = [batching.take(r, slice(i, i + batch)) for r in runs for i in range(0, batching.num_rows(r), batch)]
    assert len(cut) == len(batches)
    for got, want in zip(cut, batches, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    for r in runs:
        n = batching.num_rows(r)
        assert n <= max(batch, 1) * max_batches
        assert all(not a.flags.writeable for a in r.values()) or n <= batch  # joined: read-only views
    row_bytes = 8 + 12 + 8  # id, x, and s's references
    one_window = len(window_rows) == 1 and window_rows[0] >= 2 * batch
    if max_batches > 1 and max_bytes >= 2 * batch * row_bytes and one_window:
        assert len(runs[0]["id"]) > batch  # batches of one window are joined


def test_runs_join_only_batches_that_follow_in_memory() -> None:
    a, b = np.arange(8), np.arange(8, 16)
    apart = list(batching.runs([{"x": a[:4]}, {"x": b[:4]}], 4, 1 << 20))  # other arrays
    assert [len(r["x"]) for r in apart] == [4, 4]
    gap = list(batching.runs([{"x": a[:4]}, {"x": a[5:]}], 4, 1 << 20, 8))  # a row between them
    assert [len(r["x"]) for r in gap] == [4, 3]
    short = list(batching.runs([{"x": a[:3]}, {"x": a[3:6]}], 4, 1 << 20))  # a short batch ends a run
    assert [len(r["x"]) for r in short] == [3, 3]
    masked = np.ma.MaskedArray(a, mask=a > 5)
    assert [len(r["x"]) for r in batching.runs([{"x": masked[:4]}, {"x": masked[4:]}], 4, 1 << 20)] == [4, 4]
    joined = next(iter(batching.runs([{"x": a[:4]}, {"x": a[4:]}], 4, 1 << 20)))["x"]
    assert np.shares_memory(joined, a)
    assert joined.tolist() == a.tolist()


def test_recycler_arrays_start_aligned() -> None:
    recycler = batching.Recycler(keep_bytes=1 << 20)
    for shape in [(3,), (100, 7), (1000,), (5, 5)]:
        a = recycler.empty(shape, np.dtype(np.float32))
        assert a.__array_interface__["data"][0] % batching.ALIGN == 0
        del a  # freed: the next one may reuse it, still aligned


def test_recycler_reuses_an_array_only_when_nothing_refers_to_it() -> None:
    recycler = batching.Recycler(keep_bytes=1 << 20)
    first = recycler.empty((100, 4), np.dtype(np.float32))
    first[:] = 1.0
    view = first[10:20]  # a batch the consumer still holds
    del first
    second = recycler.empty((100, 4), np.dtype(np.float32))
    assert not np.shares_memory(second, view)
    second[:] = 2.0
    assert (view == 1.0).all()
    del view
    third = recycler.empty((90, 4), np.dtype(np.float32))  # smaller fits in the freed one
    assert (third.shape, third.dtype, recycler.reused) == ((90, 4), np.float32, 1)
    assert recycler.empty((1, 2), np.dtype(object)).dtype == object  # never pooled: holds references


def test_recycler_held_by_torch_tensor_is_not_reused() -> None:
    torch = __import__("torch")
    recycler = batching.Recycler(keep_bytes=1 << 20)
    arr = recycler.empty((64,), np.dtype(np.int64))
    arr[:] = 7
    tensor = torch.from_numpy(arr[:8])
    del arr
    again = recycler.empty((64,), np.dtype(np.int64))
    again[:] = 0
    assert tensor.tolist() == [7] * 8


def test_recycler_clear_lets_go_of_kept_arrays() -> None:
    recycler = batching.Recycler(keep_bytes=1 << 20)
    first = recycler.empty((10,), np.dtype(np.int64))
    del first
    recycler.clear()
    assert recycler._arrays == []
    recycler.empty((10,), np.dtype(np.int64))
    assert recycler.reused == 0  # the freed array was not kept, so not handed out again


def test_recycler_keeps_arrays_in_use_and_lets_free_ones_go_past_keep_bytes() -> None:
    recycler = batching.Recycler(keep_bytes=3 * 4096)
    held = [recycler.empty((4096,), np.dtype(np.uint8)) for _ in range(10)]  # all in use: new each time
    assert len({a.__array_interface__["data"][0] for a in held}) == 10
    assert len(recycler._arrays) == 10  # in use: memory held anyway, reused once free
    del held[:5]
    again = [recycler.empty((4096,), np.dtype(np.uint8)) for _ in range(5)]
    assert (recycler.reused, recycler.allocated) == (5, 10)
    del held, again
    recycler.empty((8192,), np.dtype(np.uint8))  # fits none: the free ones go down to the budget
    assert sum(a.nbytes for a in recycler._arrays) <= 3 * 4096 * 9 // 8 + 2 * batching.ALIGN + 8192 * 9 // 8


def test_recycler_gives_a_request_the_smallest_free_array_that_fits() -> None:
    recycler = batching.Recycler(keep_bytes=1 << 30)
    big = recycler.empty((1 << 20,), np.dtype(np.uint8))
    small = recycler.empty((1 << 10,), np.dtype(np.uint8))
    big_at, small_at = big.__array_interface__["data"][0], small.__array_interface__["data"][0]
    del big, small
    # a window's small column first: it must not take the large column's array
    assert recycler.empty((1000,), np.dtype(np.uint8)).__array_interface__["data"][0] == small_at
    kept = recycler.empty((1 << 20,), np.dtype(np.uint8))
    assert kept.__array_interface__["data"][0] == big_at
    assert (recycler.reused, recycler.allocated) == (2, 2)


@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=6), data=st.data())
@settings(max_examples=100, deadline=None)
def test_scatter_places_parts_in_emission_order(sizes: list[int], data: st.DataObject) -> None:
    total = sum(sizes)
    perm = np.asarray(data.draw(st.permutations(range(total)))) if total else np.zeros(0, np.int64)
    inverse = np.empty(total, np.int64)
    inverse[perm] = np.arange(total)
    rows = np.arange(total)
    values = {"i": rows, "t": np.stack([rows, -rows], axis=1) if total else np.zeros((0, 2), np.int64),
              "s": np.array([f"r{i}" for i in rows], dtype=object)}
    scatter = batching.Scatter(total, batching.Recycler(1 << 20))
    bounds = np.cumsum([0, *sizes])
    parts = []
    for k in range(len(sizes)):  # each part in one or two chunks, placed in any order
        lo, hi = bounds[k], bounds[k + 1]
        cut = data.draw(st.integers(lo, hi))
        parts.append([{n: v[lo:cut] for n, v in values.items()}, {n: v[cut:hi] for n, v in values.items()}])
    for k in data.draw(st.permutations(range(len(sizes)))):
        scatter.place(parts[k], inverse[bounds[k] : bounds[k + 1]])
    assert scatter.placed(parts) is scatter.columns is not None
    if total:
        np.testing.assert_array_equal(scatter.columns["i"], perm)
        np.testing.assert_array_equal(scatter.columns["t"], values["t"][perm])
        assert scatter.columns["s"].tolist() == values["s"][perm].tolist()


def test_scatter_of_masked_columns_falls_back() -> None:
    scatter = batching.Scatter(4)
    masked = np.ma.MaskedArray(np.arange(2.0), mask=[False, True])
    scatter.place([{"x": np.arange(2.0)}], np.array([0, 1]))
    scatter.place([{"x": masked}], np.array([2, 3]))
    assert scatter.placed([[{"x": np.arange(2.0)}], [{"x": masked}]]) is None


def test_a_reader_puts_shuffled_batches_in_the_memory_it_is_given(tmp_path: Path) -> None:
    """`Reader.set_batch_memory`: what shardkit.torch uses to shuffle straight into pinned memory."""
    url = str(tmp_path / "ds")
    shardkit.write_dataset({"id": np.arange(2000), "x": np.random.default_rng(0).random((2000, 8))}, url,
                           row_group_size=100)
    made: list[np.ndarray] = []

    def allocate(nbytes: int) -> np.ndarray:
        made.append(np.empty(nbytes, np.uint8))
        return made[-1]

    with shardkit.make_reader(url, batch_size=50, seed=3) as plain:
        want = [b["id"].copy() for b in plain]
    with shardkit.make_reader(url, batch_size=50, seed=3) as reader:
        reader.set_batch_memory(allocate)
        got, inside = [], 0
        for batch in reader:
            got.append(batch["id"].copy())
            inside += any(np.shares_memory(batch["id"], a) for a in made)
    assert made
    assert inside >= len(got) // 2  # batches that span two windows are joined in ordinary memory
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    assert len(made) < len(got)  # the arrays are reused, not made per batch
