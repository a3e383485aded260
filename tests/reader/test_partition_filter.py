"""Filters on Hive partition keys (``year=2024/split=train/part-0.parquet``), against pyarrow.dataset's own
filtered read of the same folder (``partitioning="hive"``)."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.dataset import Dataset
from shardkit.errors import PartitionColumnsWarning, ReaderError
from shardkit.reader._filter import Partitions
from tests.reader.datasets import ids_of


def write_hive(path: Path, n: int = 600, *, summary: bool = False) -> str:
    """``id``, ``x`` in folders ``year=2022..2024/split=train|test/`` (pandas' ``partition_cols``), several
    row groups per file; with ``summary``, the ``_metadata`` file too."""
    rng = np.random.default_rng(0)
    table = pa.table({"id": np.arange(n), "x": rng.random(n),
                      "year": np.array([2022, 2023, 2024])[rng.integers(0, 3, n)],
                      "split": np.array(["train", "test"])[rng.integers(0, 2, n)]})
    url = os.fspath(path)
    pq.write_to_dataset(table, url, partition_cols=["year", "split"], row_group_size=30)
    if summary:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            shardkit.write_summary(url)
    return url


def open_hive(url: str) -> Dataset:
    """Open a Hive-partitioned folder: it warns that its partition columns are not read (and, without a
    summary, that it has none)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ds = shardkit.open_dataset(url)
    assert any(isinstance(w.message, PartitionColumnsWarning) for w in record)
    return ds


def reference(url: str, expr: pc.Expression) -> np.ndarray:
    """The ids pyarrow.dataset's own filtered read keeps, in its (file) order."""
    return pads.dataset(url, partitioning="hive").to_table(filter=expr).column("id").to_numpy()


@pytest.fixture(scope="module")
def hive(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_hive(tmp_path_factory.mktemp("hive") / "ds")


FILTERS: list[Any] = [
    pc.field("year") == 2024,
    [("year", "=", 2024)],
    [("split", "=", "train"), ("year", ">=", 2023)],
    [[("year", "=", 2022)], [("split", "=", "test")]],  # OR of ANDs
    (pc.field("year") == 2023) & (pc.field("x") < 0.5),
    (pc.field("year") == 2022) | (pc.field("x") < 0.1),
    ~pc.field("split").isin(["test"]),
    pc.field("year").cast(pa.string()) == "2023",
]


@pytest.mark.parametrize("filter", FILTERS, ids=[str(i) for i in range(len(FILTERS))])
def test_a_filter_on_partition_keys_reads_the_rows_pyarrow_reads(hive: str, filter: Any) -> None:
    """Before: ReaderError "No match for FieldRef.Name(year)", which never said that ``year`` is a
    partition key (the folders' ``year=...``)."""
    ds = open_hive(hive)
    expr = filter if isinstance(filter, pc.Expression) else pq.filters_to_expression(filter)
    want = reference(hive, expr)
    assert 0 < len(want) < 600
    with shardkit.make_reader(ds, filter=filter, shuffle=False, batch_size=64) as reader:
        assert reader.num_samples == len(want)
        assert ids_of(reader).tolist() == want.tolist()  # in the same (file) order
    shards = [shardkit.make_reader(ds, filter=filter, shard=s, num_shards=3, seed=4, shuffle_buffer=50,
                                   remainder="uneven", batch_size=16) for s in range(3)]
    got = np.concatenate([ids_of(r) for r in shards])
    assert sorted(got.tolist()) == sorted(want.tolist())


def test_a_filter_on_partition_keys_alone_prunes_files_and_reads_no_data(
        hive: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = open_hive(hive)
    files = [f for f in ds.files if f.startswith("year=2024/split=train/")]

    def no_read(self: Dataset, i: int, columns: Any = None) -> pa.Table:
        raise AssertionError(f"row group {i} read to count the rows of a partition filter")

    monkeypatch.setattr(Dataset, "read_row_group", no_read)
    reader = shardkit.make_reader(ds, filter=[("year", "=", 2024), ("split", "=", "train")], shuffle=False)
    monkeypatch.undo()
    groups = [rg for rg in ds.row_groups if rg.file in files]
    assert reader.stats["pruned_row_groups"] == len(ds.row_groups) - len(groups)
    assert reader.num_samples == sum(rg.num_rows for rg in groups)
    with reader:
        ids = ids_of(reader)
    both = (pc.field("year") == 2024) & (pc.field("split") == "train")
    assert ids.tolist() == reference(hive, both).tolist()


def test_a_partitioned_dataset_with_a_summary_filters_alike(tmp_path: Path) -> None:
    url = write_hive(tmp_path / "ds", summary=True)
    ds = open_hive(url)
    assert ds.metadata is not None
    expr = (pc.field("split") == "test") & (pc.field("x") > 0.3)
    with shardkit.make_reader(ds, filter=expr, shuffle=False) as reader:
        assert ids_of(reader).tolist() == reference(url, expr).tolist()


def test_a_filter_that_does_not_fit_a_partition_key_names_it_and_its_type(hive: str) -> None:
    ds = open_hive(hive)
    with pytest.raises(ReaderError, match=r"year == \"2024\".*partition keys.*year: int32, split: string.*"
                                          r"value of its type"):
        shardkit.make_reader(ds, filter=pc.field("year") == "2024")
    with pytest.raises(ReaderError, match=r"FieldRef.Name\(month\).*partition keys.*year: int32"):
        shardkit.make_reader(ds, filter=[("month", "=", 1)])


def test_a_partition_key_asked_for_as_a_column_says_what_it_is(hive: str) -> None:
    ds = open_hive(hive)
    with pytest.raises(ReaderError, match=r"\['year'\].*are Hive partition keys.*filter=\[\('year', '=', "
                                          r"\.\.\.\)\].*partitioning='hive'"):
        shardkit.make_reader(ds, columns=["id", "year"])


# ---- property: partition types and values as pyarrow infers them, filters as pyarrow applies them ------
ODD_VALUES = ["2024", "-5", "007", "0", "3000000000", "2147483647", "-2147483648", "1.5", "+4", "x",
              "a%20b", "a%2Fb", "__HIVE_DEFAULT_PARTITION__", "true", "7"]


@st.composite
def hive_layouts(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=2, unique=True))
    pools = {k: draw(st.lists(st.sampled_from(ODD_VALUES), min_size=1, max_size=4, unique=True))
             for k in keys}
    folders = draw(st.lists(st.tuples(*[st.sampled_from(pools[k]) for k in keys]), min_size=1, max_size=5,
                            unique=True))
    return {"keys": keys, "folders": folders, "rows": draw(st.integers(1, 30)),
            "probe": draw(st.sampled_from(ODD_VALUES)),
            "op": draw(st.sampled_from(["==", "!=", "<", "null"]))}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=hive_layouts())
def test_partition_types_values_and_filters_are_pyarrows(layout: dict[str, Any]) -> None:
    keys = layout["keys"]
    with tempfile.TemporaryDirectory() as tmp:
        start = 0
        for values in layout["folders"]:
            folder = Path(tmp, *(f"{k}={v}" for k, v in zip(keys, values, strict=True)))
            folder.mkdir(parents=True)
            ids = np.arange(start, start + layout["rows"])
            pq.write_table(pa.table({"id": ids}), folder / "part-0.parquet", row_group_size=7)
            start += layout["rows"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ds = shardkit.open_dataset(tmp)
        parts = Partitions.of(ds)
        assert parts is not None
        if pa.null() in parts.schema.types:  # a key whose folders all say null: pyarrow cannot type it
            with pytest.raises(pa.ArrowInvalid, match="couldn't infer type"):
                pads.dataset(tmp, partitioning="hive")
            null = next(f.name for f in parts.schema if f.type == pa.null())  # shardkit: the null type
            with shardkit.make_reader(ds, filter=pc.field(null).is_null(), shuffle=False) as reader:
                assert reader.num_samples == ds.num_rows
            return
        ref = pads.dataset(tmp, partitioning="hive")
        assert parts.schema == pa.schema([ref.schema.field(k) for k in keys])
        for frag in ref.get_fragments():
            file = os.path.relpath(frag.path, tmp)
            assert parts.values[file] == {k: pads.get_partition_keys(frag.partition_expression).get(k)
                                          for k in keys}
        key, field = keys[0], ref.schema.field(keys[0])
        if layout["op"] == "null":
            expr = pc.field(key).is_null()
        else:
            try:
                probe = pa.scalar(layout["probe"]).cast(field.type) if field.type != pa.null() else None
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                probe = None
            assume(probe is not None)
            expr = {"==": pc.field(key) == probe, "!=": pc.field(key) != probe, "<": pc.field(key) < probe}[
                layout["op"]]
        want = ref.to_table(filter=expr).column("id").to_numpy()
        assume(len(want))
        with shardkit.make_reader(ds, filter=expr, shuffle=False, batch_size=8) as reader:
            assert ids_of(reader).tolist() == want.tolist()
