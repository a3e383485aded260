"""Remote row groups fetched ahead of their reads (`shardkit.dataset.fetch`), through a relay on loopback
that holds each response back as a far store would (`benchmarks.relay`) and counts what passes: the
bytes in flight stay within the budget, a row group is one request of the columns read, reads resume
and shard as before, and a server that stalls mid-read is named as before. No timing asserts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from benchmarks.relay import Relay
from shardkit.dataset import SummaryMissingWarning
from shardkit.dataset.fetch import coalesce
from shardkit.errors import CorruptDatasetError, DatasetError

if TYPE_CHECKING:
    from tests.reader.conftest import S3Server

pytestmark = pytest.mark.timeout(120)


def _frame(n: int) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    return pd.DataFrame({"id": np.arange(n, dtype=np.int64),
                         "label": rng.integers(0, 10, n).astype(np.int32),
                         "features": list(rng.standard_normal((n, 64)).astype(np.float32))})


@pytest.fixture
def dataset(s3_server: S3Server, s3_bucket: str) -> tuple[str, pd.DataFrame]:
    url, frame = f"s3://{s3_bucket}/ds", _frame(6000)
    shardkit.write_dataset(frame, url, storage_options=s3_server.storage_options, row_group_size=250)
    return url, frame


@pytest.fixture
def relay(s3_server: S3Server) -> Iterator[Relay]:
    with Relay(s3_server.endpoint_url, delay=0.02) as r:
        yield r


def _through(s3_server: S3Server, relay: Relay, **config: Any) -> dict[str, Any]:
    client = {**s3_server.storage_options["client_kwargs"], "endpoint_url": relay.url}
    options: dict[str, Any] = {**s3_server.storage_options, "client_kwargs": client}
    if config:
        options["config_kwargs"] = config
    return options


def _ids(reader: Any) -> list[int]:
    return [int(i) for batch in reader for i in batch["id"]]


def test_shuffled_shards_over_a_slow_store_read_what_a_local_copy_reads(
        s3_server: S3Server, dataset: tuple[str, pd.DataFrame], relay: Relay, tmp_path: Any) -> None:
    url, frame = dataset
    local = shardkit.write_dataset(frame, str(tmp_path / "local"), row_group_size=250)
    options = _through(s3_server, relay)
    for shard in range(3):
        kwargs = {"shard": shard, "num_shards": 3, "batch_size": 64, "seed": 7, "cache": None}
        with shardkit.make_reader(url, storage_options=options, **kwargs) as remote:
            got = list(remote)
        with shardkit.make_reader(local, **kwargs) as here:
            want = list(here)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a["id"], b["id"])
            np.testing.assert_array_equal(a["features"], b["features"])
    assert relay.stats.ranges("/part-"), "read through the relay"


def test_a_resumed_read_over_a_slow_store_goes_on_where_it_stopped(
        s3_server: S3Server, dataset: tuple[str, pd.DataFrame], relay: Relay) -> None:
    url, _ = dataset
    options = _through(s3_server, relay)
    kwargs = {"shard": 1, "num_shards": 2, "batch_size": 50, "seed": 3, "cache": None,
              "storage_options": options}
    with shardkit.make_reader(url, **kwargs) as whole:
        uninterrupted = _ids(whole)
    with shardkit.make_reader(url, **kwargs) as first:
        it = iter(first)
        before = [int(i) for _ in range(17) for i in next(it)["id"]]
        state = first.state_dict()
    with shardkit.make_reader(url, **kwargs) as second:
        second.load_state_dict(state)
        after = _ids(second)
    assert before + after == uninterrupted


def test_the_bytes_in_flight_stay_within_the_budget(
        s3_server: S3Server, dataset: tuple[str, pd.DataFrame], s3_bucket: str) -> None:
    url, _ = dataset
    budget = 200_000  # about three row groups of this dataset
    with Relay(s3_server.endpoint_url, delay=0.05) as relay:
        with shardkit.make_reader(url, storage_options=_through(s3_server, relay), cache=None,
                                  max_inflight_bytes=budget, batch_size=100) as reader:
            n = len(_ids(reader))
            held = reader._source._fetcher.stats["max_held"]  # type: ignore[union-attr]
        asked = relay.stats.ranges("/part-")
    assert n == 6000
    sizes = [b - a for a, b in asked]
    assert relay.stats.max_outstanding <= budget
    assert held <= budget
    assert relay.stats.max_outstanding > max(sizes), "more than one row group was in flight at once"


def test_a_row_group_is_one_request_of_the_columns_read(
        s3_server: S3Server, dataset: tuple[str, pd.DataFrame], relay: Relay) -> None:
    url, _ = dataset
    ds = shardkit.open_dataset(url, storage_options=s3_server.storage_options)
    with shardkit.make_reader(url, storage_options=_through(s3_server, relay), cache=None,
                              columns=["id", "label"], shuffle=False) as reader:
        assert len(_ids(reader)) == 6000
    asked = sorted(relay.stats.ranges("/part-"))
    chunks = []
    for i in range(len(ds.row_groups)):
        where = ds.chunk_ranges(i, ["id", "label"])
        assert where is not None
        chunks.append((min(a for a, _ in where[1]), max(b for _, b in where[1])))
    assert len(asked) == len(ds.row_groups)  # one request a row group ...
    assert asked == sorted(chunks)  # ... of its id and label chunks, not the features between them


def test_a_store_that_stalls_mid_read_is_named_as_a_direct_read_names_it(
        s3_server: S3Server, dataset: tuple[str, pd.DataFrame], relay: Relay,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries: 5, a minute a stall
    url, _ = dataset
    options = _through(s3_server, relay, retries={"max_attempts": 1}, read_timeout=2, connect_timeout=2)
    with shardkit.make_reader(url, storage_options=options, cache=None, batch_size=100,
                              shuffle=False, max_inflight_bytes=100_000) as reader:  # most are to come
        it = iter(reader)
        next(it)
        relay.stall(after_bytes=1000)
        named = r"cannot read '[^']*/ds/part-[^']*\.parquet' of 's3://"
        with pytest.raises(DatasetError, match=named) as info:
            for _ in it:
                pass
    # a request never answered (a timeout), not corruption: nothing is skipped, the state resumes
    assert "Timeout" in str(info.value)
    assert "Nothing was skipped" in str(info.value)


@pytest.mark.parametrize("cached", [False, True])
def test_a_damaged_page_on_the_store_is_caught_before_it_is_decoded(
        s3_server: S3Server, dataset: tuple[str, pd.DataFrame], tmp_path: Any, cached: bool) -> None:
    """Row groups fetched ahead have their pages checked as they are decoded (shardkit's CRC, pyarrow's
    own check off): a flipped bit in a data page on the store is named, and ``on_error="skip"`` leaves
    its row group out, uncached too, and delivers every other row right."""
    import s3fs

    from shardkit.dataset._pages import chunk_range

    url, frame = dataset
    fs = s3fs.S3FileSystem(**s3_server.storage_options)
    ds = shardkit.open_dataset(url, storage_options=s3_server.storage_options)
    group = ds.row_groups[5]
    path = f"{url.removeprefix('s3://')}/{group.file}"
    meta = pq.read_metadata(fs.open(path))
    start, length = chunk_range(meta.row_group(group.index).column(2))  # the features
    data = bytearray(fs.cat_file(path))
    data[start + length // 2] ^= 0x10
    fs.pipe_file(path, bytes(data))
    options = {"storage_options": s3_server.storage_options, "batch_size": 100, "shuffle": False,
               "cache": str(tmp_path / "cache") if cached else None}
    damaged = rf"row group {group.index} of .* fails its page checksums"
    with pytest.raises(CorruptDatasetError, match=damaged), shardkit.make_reader(url, **options) as reader:
        _ids(reader)
    with shardkit.make_reader(url, on_error="skip", **options) as reader:
        with pytest.warns(UserWarning, match=r"skipped 1 corrupt row group.*fails its page checksums"):
            batches = list(reader)
        assert reader.stats["skipped_row_groups"] == 1
    rows = {int(i): x for batch in batches for i, x in zip(batch["id"], batch["features"], strict=True)}
    assert len(rows) == len(frame) - group.num_rows
    for i, x in rows.items():
        np.testing.assert_array_equal(x, frame["features"][i])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 3_000)), max_size=30),
       st.integers(0, 2_000))
def test_coalesced_ranges_cover_exactly_what_was_asked_and_the_small_gaps(
        spans: list[tuple[int, int]], gap: int) -> None:
    ranges = [(a, a + n) for a, n in spans]
    merged = coalesce(ranges, gap)
    assert merged == sorted(merged)
    for a, b in ranges:  # every byte asked for is in one merged range
        assert any(x <= a and b <= y for x, y in merged)
    for (_, b1), (a2, _) in itertools.pairwise(merged):
        assert a2 - b1 >= gap  # ranges closer than the gap were merged
    covered = set().union(*(range(a, b) for a, b in ranges)) if ranges else set()
    for x, y in merged:  # a merged range starts and ends at asked bytes
        assert x in covered
        assert y - 1 in covered


def test_a_dataset_without_summary_is_fetched_ahead_by_its_footers(
        s3_server: S3Server, s3_bucket: str, relay: Relay) -> None:
    """Plain Parquet files (no shardkit summary): the footers read at opening place the ranges."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_server.storage_options)
    for k in range(3):
        table = pa.table({"id": np.arange(k * 1000, (k + 1) * 1000)})
        with fs.open(f"{s3_bucket}/plain/part-{k}.parquet", "wb") as f:
            pq.write_table(table, f, row_group_size=300)
    with pytest.warns(SummaryMissingWarning):
        reader = shardkit.make_reader(f"s3://{s3_bucket}/plain", storage_options=_through(s3_server, relay),
                                      cache=None, shuffle=False)
    with reader:
        assert sorted(_ids(reader)) == list(range(3000))
        assert reader._source._fetcher.stats["requests"] == 12  # type: ignore[union-attr]
