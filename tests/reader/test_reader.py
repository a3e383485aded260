"""`make_reader` on real datasets: batch types and values, sizes, columns, filters, epochs, threads."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit import SummaryMissingWarning
from shardkit.errors import ReaderError
from shardkit.reader._filter import filter_columns
from tests.reader.datasets import (
    ALL_CODECS,
    PETASTORM_TENSORS,
    assert_exactly_once,
    ids_frame,
    ids_of,
    write_all_codecs,
    write_ids,
)


@pytest.fixture(scope="module")
def codecs_ds(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    return write_all_codecs(tmp_path_factory.mktemp("codecs") / "ds", 90, row_group_size=7)


@pytest.fixture(scope="module")
def ids_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    """500 rows, ``id`` 0..499 in file order, row groups of 23 rows over several files."""
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", 500, row_group_size=23)


def rows_of(column: np.ndarray) -> list[Any]:
    """Per-row values of a decoded column; a masked (null) row is None."""
    if isinstance(column, np.ma.MaskedArray):
        mask = np.ma.getmaskarray(column)
        return [None if mask[i].all() else column.data[i] for i in range(len(column))]
    return list(column)


def same_value(expected: Any, got: Any) -> bool:
    if expected is None or got is None:
        return expected is None and got is None
    if isinstance(expected, str | bytes):
        return type(got) is type(expected) and got == expected
    return bool(np.array_equal(np.asarray(got), np.asarray(expected)))


# ---- batches ---------------------------------------------------------------------------------------
def test_batches_are_numpy_columns_with_the_schema_types_for_every_codec(codecs_ds: tuple[str, dict[str, Any]]
                                                                          ) -> None:
    url, written = codecs_ds
    with shardkit.make_reader(url, batch_size=16, seed=1, shuffle_buffer=20) as reader:
        batches = list(reader)
    n = len(written["id"])
    assert [len(b["id"]) for b in batches] == [16] * (n // 16) + [n % 16]
    for batch in batches:
        assert list(batch) == ALL_CODECS.names
        rows = len(batch["id"])
        for field in ALL_CODECS:
            col = batch[field.name]
            assert isinstance(col, np.ndarray), field.name
            assert len(col) == rows
            if field.dtype.kind in "US" or not field.fixed_shape:
                assert col.dtype == object, field.name  # str, bytes, variable shapes: one object per row
                kinds = {type(v) for v in col if v is not None}
                expected = {"U": {str}, "S": {bytes}}.get(field.dtype.kind, {np.ndarray})
                assert kinds <= expected, (field.name, kinds)
                if not field.fixed_shape:
                    assert all(v.dtype == field.dtype and v.ndim == len(field.shape) for v in col), field.name
            else:
                assert col.dtype == field.dtype, field.name
                assert col.shape == (rows, *field.shape), field.name
    # values, put back in id order, are what was written
    merged = {name: [v for b in batches for v in rows_of(b[name])] for name in ALL_CODECS.names}
    order = np.argsort(np.asarray(merged["id"]))
    assert np.array_equal(np.asarray(merged["id"])[order], np.arange(n))
    for name in ALL_CODECS.names:
        got = [merged[name][i] for i in order]
        want = list(written[name])
        bad = [i for i in range(n) if not same_value(want[i], got[i])]
        assert not bad, f"{name}: rows {bad[:5]} differ, e.g. wrote {want[bad[0]]!r}, read {got[bad[0]]!r}"
    # a nullable field with nulls in a batch comes as a MaskedArray
    assert any(isinstance(b["maybe"], np.ma.MaskedArray) for b in batches)


@pytest.mark.parametrize(
    ("num_shards", "batch_size", "remainder", "drop_last"),
    [(1, 7, "drop", False), (3, 10, "drop", False), (3, 10, "drop", True), (4, 9, "pad", False),
     (4, 9, "pad", True), (3, 8, "uneven", False), (3, 8, "uneven", True), (7, 500, "drop", False),
     (13, 4, "uneven", False)],
)
def test_len_is_the_number_of_batches_yielded(ids_ds: str, num_shards: int, batch_size: int, remainder: str,
                                              drop_last: bool) -> None:
    counts, every = [], []
    for shard in range(num_shards):
        with shardkit.make_reader(ids_ds, shard=shard, num_shards=num_shards, batch_size=batch_size,
                                  remainder=remainder, drop_last=drop_last, shuffle_buffer=50,
                                  seed=7) as reader:
            batches = list(reader)
            assert len(batches) == len(reader)
            sizes = [len(b["id"]) for b in batches]
            assert all(s == batch_size for s in sizes[:-1])
            if drop_last:
                assert all(s == batch_size for s in sizes)
            counts.append(len(batches))
            every.append(ids_of(batches))
    if remainder != "uneven":
        assert len(set(counts)) == 1, f"shards yield different numbers of batches: {counts}"
        assert len({len(e) for e in every}) == 1
    ids = np.concatenate(every)
    if remainder == "uneven" and not drop_last:
        assert_exactly_once(ids, 500)
    elif remainder == "drop":
        assert len(np.unique(ids)) == len(ids)
        assert 500 - len(ids) < (num_shards * batch_size if drop_last else num_shards)


def test_columns_selection(codecs_ds: tuple[str, dict[str, Any]]) -> None:
    url, written = codecs_ds
    with shardkit.make_reader(url, columns=["note", "id", "vec"], batch_size=100, shuffle=False) as reader:
        (batch,) = list(reader)
    assert set(batch) == {"note", "id", "vec"}
    assert np.array_equal(batch["id"], written["id"])
    assert np.array_equal(batch["vec"], written["vec"])
    assert reader.schema.names == ["note", "id", "vec"]


def test_unshuffled_reading_is_in_file_order(ids_ds: str) -> None:
    with shardkit.make_reader(ids_ds, batch_size=64, shuffle=False, prefetch=0, workers=1) as reader:
        assert np.array_equal(ids_of(reader), np.arange(500))


def test_shuffled_reading_mixes_rows_of_several_row_groups(ids_ds: str) -> None:
    with shardkit.make_reader(ids_ds, batch_size=50, seed=9, shuffle_buffer=200) as reader:
        batches = list(reader)
    ids = ids_of(batches)
    assert_exactly_once(ids, 500)
    assert not np.array_equal(ids, np.arange(500))
    groups_per_batch = [len(np.unique(b["id"] // 23)) for b in batches[:-1]]
    # the first batch (the quick start's lead) from the fewest row groups that hold 50 rows, neighbours
    # in the stream (23 rows each: 3); every later one across the window (200 rows span ~9 row groups)
    assert groups_per_batch[0] <= 3, groups_per_batch
    assert min(groups_per_batch[1:]) >= 4, groups_per_batch



@pytest.mark.parametrize("quick_start", [True, False])
def test_a_shards_first_batch_waits_for_its_leads_row_group_only(tmp_path: Path, quick_start: bool) -> None:
    """The quick start: each of 2 shards' first batch is read from one row group of the window (the whole
    dataset here), so a row group elsewhere that cannot be read fails a later batch, not the first;
    without it, the first batch needs every row group of the window and fails."""
    from shardkit.errors import CorruptDatasetError
    from tests.reader.datasets import corrupt_ids
    from tests.reader.test_skip_resume import write_groups

    kw: dict[str, Any] = {"batch_size": 50, "num_shards": 2, "shuffle_buffer": 1000, "workers": 1,
                          "quick_start": quick_start}
    intact = write_groups(tmp_path / "intact", [100] * 10)
    leads = []
    for shard in range(2):
        with shardkit.make_reader(intact, shard=shard, **kw) as reader:
            leads.append(np.unique(next(iter(reader))["id"] // 100).tolist())
    if not quick_start:
        assert all(len(groups) > 1 for groups in leads), leads
        bad = 0
    else:
        assert all(len(groups) == 1 for groups in leads), leads
        bad = next(g for g in range(10) if [g] not in leads)
    broken = write_groups(tmp_path / "broken", [100] * 10)
    corrupt_ids(broken, [bad])
    for shard in range(2):
        with shardkit.make_reader(broken, shard=shard, **kw) as reader:
            batches = iter(reader)
            if quick_start:
                assert np.unique(next(batches)["id"] // 100).tolist() == leads[shard]
            with pytest.raises(CorruptDatasetError):
                list(batches)


# ---- filters ---------------------------------------------------------------------------------------
FILTERS = [
    (pc.field("id") < 100, lambda df: df[df.id < 100], 17),  # row groups 5.. hold ids >= 115: pruned
    ([("id", ">=", 300), ("label", "<", 4)], lambda df: df[(df.id >= 300) & (df.label < 4)], 13),
    ([[("id", "<", 30)], [("id", ">=", 470)]], lambda df: df[(df.id < 30) | (df.id >= 470)], 18),
    ([("group", "=", "b")], lambda df: df[df.group == "b"], 0),  # every row group has some b
    ((pc.field("label") == 3) | pc.field("group").isin(["c"]),
     lambda df: df[(df.label == 3) | (df.group == "c")], 0),
]


@pytest.mark.parametrize(("filter_", "expected", "pruned"), FILTERS)
def test_filter_matches_pandas_and_prunes_by_statistics(ids_ds: str, filter_: Any, expected: Any,
                                                        pruned: int) -> None:
    want = expected(ids_frame(500))
    every, counts = [], []
    for shard in range(3):
        with shardkit.make_reader(ids_ds, shard=shard, num_shards=3, filter=filter_, batch_size=8,
                                  remainder="uneven", shuffle_buffer=40) as reader:
            assert reader.stats["pruned_row_groups"] == pruned
            assert reader.num_samples == len(want)
            batches = list(reader)
            assert len(batches) == len(reader)
            counts.append(sum(len(b["id"]) for b in batches))
            every.extend(batches)
    assert max(counts) - min(counts) <= 1
    got = pd.DataFrame({"id": ids_of(every), "label": np.concatenate([b["label"] for b in every]),
                        "group": np.concatenate([b["group"] for b in every])}).sort_values("id")
    assert got.id.tolist() == want.id.tolist()
    assert got.label.tolist() == want.label.tolist()
    assert got.group.tolist() == want.group.tolist()


def test_filtered_shards_are_equal_with_drop(ids_ds: str) -> None:
    want = ids_frame(500).query("label < 7").id.to_numpy()  # 350 rows
    shards = [ids_of(shardkit.make_reader(ids_ds, shard=s, num_shards=4, filter=[("label", "<", 7)],
                                          batch_size=16)) for s in range(4)]
    assert {len(s) for s in shards} == {350 // 4}
    got = np.concatenate(shards)
    assert len(np.unique(got)) == len(got)
    assert set(got.tolist()) <= set(want.tolist())


def test_filter_on_a_column_that_is_not_read(ids_ds: str) -> None:
    with shardkit.make_reader(ids_ds, columns=["id"], filter=pc.field("label") == 0, batch_size=1000,
                              shuffle=False) as reader:
        (batch,) = list(reader)
    assert list(batch) == ["id"]
    assert batch["id"].tolist() == list(range(0, 500, 10))


@pytest.fixture(scope="module")
def big_groups_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    """3,000 rows in row groups of 1,000: each is read in many 256-row slices."""
    return write_ids(tmp_path_factory.mktemp("big") / "ds", 3000, row_group_size=1000, file_size=1 << 30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lo=st.integers(0, 3000), width=st.integers(1, 3000), modulus=st.sampled_from([1, 3, 7]),
       num_shards=st.integers(1, 3), shuffle=st.booleans(), window=st.sampled_from([50, 700, 5000]),
       cache=st.booleans(), batch_size=st.sampled_from([16, 300]))
def test_a_filter_reads_every_matching_row_once_in_row_groups_of_many_slices(
        big_groups_ds: str, tmp_path_factory: pytest.TempPathFactory, lo: int, width: int, modulus: int,
        num_shards: int, shuffle: bool, window: int, cache: bool, batch_size: int) -> None:
    # the selected rows lie anywhere in a row group, past the rows a task covers (a filtered task's
    # rows index the selection): reading only as far as the task's stop failed with "Index out of bounds"
    filter_ = [("id", ">=", lo), ("id", "<", lo + width), ("label", "in", list(range(0, 10, modulus)))]
    want = ids_frame(3000).query(f"{lo} <= id < {lo + width} and label % {modulus} == 0").id.to_numpy()
    assume(len(want) >= num_shards)
    kwargs = {"cache": str(tmp_path_factory.mktemp("cache")) if cache else None}
    got = []
    for shard in range(num_shards):
        with shardkit.make_reader(big_groups_ds, shard=shard, num_shards=num_shards, filter=filter_,
                                  batch_size=batch_size, remainder="uneven", shuffle=shuffle,
                                  shuffle_buffer=window, **kwargs) as reader:
            got.append(ids_of(reader))
    assert sorted(np.concatenate(got).tolist()) == want.tolist()
    assert max(map(len, got)) - min(map(len, got)) <= 1


# ---- epochs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
def test_two_epochs(ids_ds: str, shuffle: bool) -> None:
    with shardkit.make_reader(ids_ds, batch_size=32, num_epochs=2, shuffle=shuffle,
                              shuffle_buffer=60) as reader:
        per_epoch = len(reader)
        batches = list(reader)
        assert reader.epoch == 2
    assert len(batches) == 2 * per_epoch
    first, second = ids_of(batches[:per_epoch]), ids_of(batches[per_epoch:])
    assert_exactly_once(first, 500)
    assert_exactly_once(second, 500)
    assert np.array_equal(first, second) is not shuffle


def test_held_batches_keep_their_rows_while_later_windows_reuse_memory(tmp_path: Path) -> None:
    """Shuffled windows are assembled in arrays that are used again once no batch refers to them: a
    batch the consumer keeps (as numpy or as a torch tensor) never changes, one it drops is reused."""
    import torch

    n = 600
    ids = np.arange(n, dtype=np.int64)
    shardkit.write_dataset({"id": ids, "vec": np.stack([ids, 2 * ids, 3 * ids], axis=1).astype(np.float32)},
                           tmp_path / "ds", row_group_size=40)
    with shardkit.make_reader(tmp_path / "ds", batch_size=25, num_epochs=4, shuffle_buffer=100) as reader:
        held = []
        for k, batch in enumerate(reader):
            if k % 10 == 0:  # some windows keep a batch alive, the others are dropped
                held.append((batch, torch.from_numpy(batch["vec"]), batch["id"].copy()))
        assert reader._recycler.reused > 0
    for batch, tensor, ids_then in held:
        np.testing.assert_array_equal(batch["id"], ids_then)
        expected = np.stack([ids_then, 2 * ids_then, 3 * ids_then], axis=1).astype(np.float32)
        np.testing.assert_array_equal(batch["vec"], expected)
        np.testing.assert_array_equal(tensor.numpy(), expected)


def test_rows(codecs_ds: tuple[str, dict[str, Any]]) -> None:
    url, written = codecs_ds
    with shardkit.make_reader(url, batch_size=16, shuffle=False) as reader:
        rows = list(reader.rows())
    assert len(rows) == 90
    assert [r["id"] for r in rows] == list(range(90))
    assert set(rows[5]) == set(ALL_CODECS.names)
    assert rows[5]["name"] == "row-5"
    assert np.array_equal(rows[5]["mat"], written["mat"][5])
    assert rows[4]["maybe"] == 4.0


def test_iterating_again_after_break_continues_the_epoch(ids_ds: str) -> None:
    with shardkit.make_reader(ids_ds, batch_size=20, seed=4, shuffle_buffer=70) as reader:
        first = []
        for i, batch in enumerate(reader):
            first.append(batch)
            if i == 6:
                break
        rest = list(reader)
        assert len(first) + len(rest) == len(reader)
    assert_exactly_once(ids_of(first + rest), 500)


def read_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shardkit-read")]


def test_context_manager_stops_the_threads(ids_ds: str) -> None:
    assert read_threads() == []
    with shardkit.make_reader(ids_ds, batch_size=10, workers=3, prefetch=6, num_epochs=None) as reader:
        it = iter(reader)
        next(it)
        assert read_threads(), "the reader reads in named worker threads"
    assert read_threads() == []
    with pytest.raises(StopIteration):  # the iteration the close interrupted ends
        next(it)
    # a new iteration of a closed reader is refused: it read nothing more rather than every row again
    for again in (lambda: iter(reader), reader.iter_epoch):
        with pytest.raises(ReaderError, match=r"was closed .* make a new reader"):
            next(again())
    assert read_threads() == []
    reader.close()  # closing again is harmless


def test_a_closed_mixture_refuses_a_new_iteration(ids_ds: str) -> None:
    reader = shardkit.make_reader({"a": ids_ds, "b": ids_ds}, weights={"a": 1, "b": 1}, batch_size=10)
    next(iter(reader))
    reader.close()
    with pytest.raises(ReaderError, match=r"MixedReader\(.* was closed"):
        next(iter(reader))


def test_prefetch_zero_and_one_worker(ids_ds: str) -> None:
    with shardkit.make_reader(ids_ds, batch_size=64, prefetch=0, workers=1, seed=2) as reader:
        assert_exactly_once(ids_of(reader), 500)


# ---- other sources ---------------------------------------------------------------------------------
def test_reads_the_petastorm_fixture() -> None:
    expected = np.load(PETASTORM_TENSORS.parent / "tensors.expected.npz", allow_pickle=False)
    with pytest.warns(SummaryMissingWarning):
        reader = shardkit.make_reader(PETASTORM_TENSORS, batch_size=50, seed=1)
    with reader:
        batches = list(reader)
    assert len(batches) == len(reader)
    ids = ids_of(batches)
    order = np.argsort(ids)
    assert np.array_equal(ids[order], expected["id"])
    for name in ("label", "score", "vec", "mat"):
        got = np.concatenate([b[name] for b in batches])[order]
        assert got.dtype == expected[name].dtype, name
        assert np.array_equal(got, expected[name]), name
    names = np.concatenate([b["name"] for b in batches])[order]
    assert names.tolist() == expected["name"].tolist()
    maybe = np.ma.concatenate([b["maybe"] for b in batches])[order]
    isnull = np.ma.getmaskarray(maybe).all(axis=1)
    assert np.array_equal(isnull, expected["maybe__isnull"])
    assert np.array_equal(np.ma.getdata(maybe)[~isnull], expected["maybe"][~isnull])


def test_reads_a_plain_pyarrow_parquet_folder(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    for i in range(3):
        ids = np.arange(i * 40, (i + 1) * 40)
        table = pa.table({"id": ids, "x": pa.array(ids * 0.5), "tag": pa.array([f"t{j}" for j in ids])})
        pq.write_table(table, folder / f"chunk-{i}.parquet", row_group_size=9)
    with pytest.warns(SummaryMissingWarning):
        readers = [shardkit.make_reader(folder, shard=s, num_shards=2, batch_size=7, remainder="uneven")
                   for s in range(2)]
    batches = [b for r in readers for b in r]
    ids = ids_of(batches)
    assert_exactly_once(ids, 120)
    x = np.concatenate([b["x"] for b in batches])
    tags = np.concatenate([b["tag"] for b in batches])
    assert np.array_equal(x, ids * 0.5)
    assert tags.tolist() == [f"t{j}" for j in ids]


# ---- the job's world -------------------------------------------------------------------------------
def test_num_shards_comes_from_world_size(ids_ds: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    explicit = [ids_of(shardkit.make_reader(ids_ds, shard=s, num_shards=3, batch_size=50)) for s in range(3)]
    for s in range(3):
        reader = shardkit.make_reader(ids_ds, shard=s, batch_size=50)
        assert (reader.shard, reader.num_shards) == (s, 3)
        assert np.array_equal(ids_of(reader), explicit[s])
    reader = shardkit.make_reader(ids_ds, batch_size=50)  # shard from RANK
    assert (reader.shard, reader.num_shards) == (2, 3)


def test_shard_without_a_job_fails_clearly(ids_ds: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ReaderError, match=r"shard=1 was given without num_shards.*num_shards="):
        shardkit.make_reader(ids_ds, shard=1)
    with pytest.raises(ReaderError, match="without shard="):
        shardkit.make_reader(ids_ds, num_shards=2)
    reader = shardkit.make_reader(ids_ds)  # outside a job, with neither: the one and only shard
    assert (reader.shard, reader.num_shards) == (0, 1)


def test_world_size_without_rank_needs_the_shard(ids_ds: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ReaderError, match="RANK"):
        shardkit.make_reader(ids_ds)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ReaderError, match="WORLD_SIZE"):
        shardkit.make_reader(ids_ds, shard=0)


def test_filter_reads_only_the_columns_it_names() -> None:
    schema = pa.schema([("a", pa.int64()), ("ab", pa.string()), ("image", pa.binary()),
                        ("label", pa.int32())])
    assert filter_columns(pc.field("ab") == "image", schema) == ["ab"]  # not "a", not "image"
    assert filter_columns((pc.field("label") < 3) | (pc.field("a") > 1), schema) == ["a", "label"]
    assert filter_columns(pc.scalar(True), schema) == []


def test_default_shuffle_buffer_is_sized_by_what_a_window_holds(tmp_path: Path) -> None:
    from shardkit.reader.api import HANDLE_BYTES, SPILL_BYTES
    from shardkit.reader.reader import WINDOW_BYTES

    schema = shardkit.Schema([shardkit.Field("id", "int64"),
                              shardkit.Field("im", "uint8", (64, 64, 3), codec=shardkit.ImageCodec("png"))])
    n = 64
    url = tmp_path / "png"
    shardkit.write_dataset({"id": np.arange(n), "im": list(np.zeros((n, 64, 64, 3), np.uint8))}, url,
                           schema=schema)
    with shardkit.make_reader(url, batch_size=8) as reader:
        # images are shuffled as spill handles, decoded per batch: a row of the window holds 8 + 16 bytes,
        # and the window spills at most SPILL_BYTES of encoded images
        encoded = reader.dataset.encoded_row_bytes(["im"])
        assert reader.shuffle_buffer == min(WINDOW_BYTES // (8 + HANDLE_BYTES), SPILL_BYTES // encoded)
        # a mixture decodes before it shuffles: its window counts the 8 + 12,288 bytes decoded
        assert reader._eager_window == WINDOW_BYTES // (8 + 64 * 64 * 3)
        assert sorted(np.concatenate([b["id"] for b in reader]).tolist()) == list(range(n))
    with shardkit.make_reader(url, batch_size=8, columns=["id"]) as reader:
        assert reader.shuffle_buffer == WINDOW_BYTES // 8


def _open_fds_under(folder: str) -> list[str]:
    """The files under ``folder`` this process holds open (Linux's /proc)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(folder):
                out.append(target)
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_closed_reader_holds_no_file_open_while_its_iterator_lives(tmp_path: Path, shuffle: bool) -> None:
    """tf.data keeps every generator it ran, and with it the reader: each `shardkit bench --adapter tf`
    (or make_dataset) read stopped midway left the row groups it was reading open, 2 files a time."""
    url = str(tmp_path / "ds")
    shardkit.write_dataset({"id": np.arange(20_000), "x": np.arange(20_000) * 0.5}, url, row_group_size=2_000,
                           file_size=1)  # a file per row group
    kept = []
    for _ in range(3):
        reader = shardkit.make_reader(url, batch_size=100, shuffle=shuffle)
        it = iter(reader)
        # a row group being read is open: its first batch's task reads it partway, until the row group's
        # last task (the reading threads may have read that far already: the next batches, then)
        seen = any(next(it) is not None and _open_fds_under(url) for _ in range(20))
        assert seen, "a row group being read is open (the test sees open files)"
        reader.close()
        kept.append((reader, it))  # alive, as tf.data keeps them
        assert _open_fds_under(url) == []
