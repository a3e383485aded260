"""Datasets on a real S3-protocol server (moto on loopback): write, open, and read through the cache."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pytest

import shardkit
from shardkit.errors import CacheWarning, ReaderError, StorageOptionsError
from shardkit.reader._cache import CacheConfig

if TYPE_CHECKING:
    from tests.reader.conftest import S3Server

DATA_FILES = r"/ds/part-[^/?]*\.parquet"


def _frame(n: int) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({
        "id": np.arange(n, dtype=np.int64),
        "label": rng.integers(0, 10, n).astype(np.int32),
        "features": list(rng.standard_normal((n, 8)).astype(np.float32)),
        "text": [f"row {i}" for i in range(n)],
    })


def test_write_and_open_over_s3(s3_server: S3Server, s3_bucket: str) -> None:
    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    df = _frame(300)
    shardkit.write_dataset(df, url, storage_options=opts, row_group_size=100)

    ds = shardkit.open_dataset(url, storage_options=opts)
    assert ds.kind == "shardkit"
    assert ds.num_rows == 300
    assert len(ds.row_groups) == 3
    assert ds.schema.names == ["id", "label", "features", "text"]
    cols = ds.decode(ds.read_row_group(1))
    np.testing.assert_array_equal(cols["id"], np.arange(100, 200))
    np.testing.assert_array_equal(cols["features"], np.stack(df["features"][100:200]))
    assert list(cols["text"]) == list(df["text"][100:200])
    assert s3_server.count_gets(rf"/{s3_bucket}{DATA_FILES}") > 0  # really read from the server


def test_second_epoch_is_served_by_the_cache(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    n, batch_size = 1024, 64
    shardkit.write_dataset(_frame(n), url, storage_options=opts, row_group_size=128)
    data_files = rf"/{s3_bucket}{DATA_FILES}"
    per_epoch = n // batch_size

    start = s3_server.mark()
    epochs: list[list[int]] = [[], []]
    seen = 0
    with shardkit.make_reader(url, shard=0, num_shards=1, shuffle=False, num_epochs=2,
                              cache=CacheConfig(str(tmp_path / "cache"), 1 << 30), storage_options=opts,
                              batch_size=batch_size) as reader:
        for batch in reader:
            epochs[seen // per_epoch].extend(batch["id"].tolist())
            seen += 1
            if seen == per_epoch:  # the last batch of epoch 1 is out: every row group is cached
                boundary = s3_server.mark()
    assert seen == 2 * per_epoch

    in_epoch_2 = s3_server.count_gets(data_files, since=boundary)
    assert s3_server.count_gets(data_files, since=start) - in_epoch_2 > 0
    assert in_epoch_2 == 0, s3_server.requests(since=boundary)
    assert epochs[0] == list(range(n))
    assert epochs[1] == epochs[0]
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 8


def test_auto_cache_is_used_for_remote_data(s3_server: S3Server, s3_bucket: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    shardkit.write_dataset(_frame(256), url, storage_options=opts, row_group_size=128)
    monkeypatch.setenv("SHARDKIT_CACHE_DIR", str(tmp_path / "auto"))
    with shardkit.make_reader(url, shard=0, num_shards=1, shuffle=False, storage_options=opts) as reader:
        ids = np.concatenate([b["id"] for b in reader])
    np.testing.assert_array_equal(ids, np.arange(256))
    assert len(list((tmp_path / "auto").glob("*.arrow"))) == 2


def test_an_auto_cache_folder_that_cannot_be_made_warns_and_reads_uncached(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cache is an optimization: a cache folder that cannot be created (a home that is not
    writable; here, under a file) warns and reads without it (a regression: make_reader refused to
    start). A cache asked for by name still fails, naming the folder."""
    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    shardkit.write_dataset(_frame(256), url, storage_options=opts, row_group_size=128)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SHARDKIT_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(CacheWarning, match=r"cannot be created.*without the default row-group cache"), \
            shardkit.make_reader(url, shard=0, num_shards=1, shuffle=False, storage_options=opts) as reader:
        ids = np.concatenate([b["id"] for b in reader])
    np.testing.assert_array_equal(ids, np.arange(256))
    with pytest.raises(ReaderError, match="cannot be created"):
        shardkit.make_reader(url, storage_options=opts, cache=str(blocker / "cache"))


def test_opening_a_summarized_dataset_reads_only_the_summary(s3_server: S3Server, s3_bucket: str) -> None:
    import s3fs

    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    shardkit.write_dataset(_frame(300), url, storage_options=opts, row_group_size=100)
    s3fs.S3FileSystem.clear_instance_cache()  # as a new process: nothing listed yet
    since = s3_server.mark()
    ds = shardkit.open_dataset(url, storage_options=opts)
    assert len(ds.row_groups) == 3
    asked = [(m, p) for m, p, _ in s3_server.requests(since) if "shardkit-log-sync" not in p]
    assert all(p.split("?")[0] == f"/{s3_bucket}/ds/_metadata" for _, p in asked), asked
    assert asked == [("GET", f"/{s3_bucket}/ds/_metadata")], asked  # one request: its bytes, no listing


def test_an_uncached_epoch_fetches_each_row_group_once(s3_server: S3Server, s3_bucket: str) -> None:
    """One range request per row group, of its bytes only: no read-ahead past it (s3fs's default
    read-ahead fetched up to 50 MB more on every row group's opening: here, the rest of the file)."""
    import s3fs

    from benchmarks.relay import Relay

    url = f"s3://{s3_bucket}/ds"
    ds = shardkit.write_dataset(_frame(4000), url, storage_options=s3_server.storage_options,
                                row_group_size=500)
    files = {rg.file for rg in ds.row_groups}
    fs = s3fs.S3FileSystem(**s3_server.storage_options)
    file_bytes = sum(fs.size(f"{s3_bucket}/ds/{f}") for f in files)
    with Relay(s3_server.endpoint_url) as relay:
        opts = {**s3_server.storage_options, "client_kwargs": {**s3_server.storage_options["client_kwargs"],
                                                               "endpoint_url": relay.url}}
        with shardkit.make_reader(url, shard=0, num_shards=1, shuffle=False, cache=None, storage_options=opts,
                                  batch_size=100) as reader:
            ids = np.concatenate([b["id"] for b in reader])
        data = relay.stats.ranges("/part-")
    np.testing.assert_array_equal(ids, np.arange(4000))
    assert len(data) == len(ds.row_groups) == 8, data
    assert sum(end - start for start, end in data) <= file_bytes, (data, file_bytes)


def test_a_lookup_fetches_only_the_pages_of_its_rows(s3_server: S3Server, s3_bucket: str) -> None:
    """``take`` from a store: its row group's offset indexes (one range request), then the pages that
    hold the rows (coalesced range requests), never the column chunks whole."""
    from unittest import mock

    import s3fs

    import shardkit.dataset.write as write_module
    from benchmarks.relay import Relay
    from shardkit.dataset import RowAccess

    url = f"s3://{s3_bucket}/ds"
    frame = _frame(4000)
    frame["features"] = list(np.random.default_rng(1).standard_normal((4000, 64)).astype(np.float32))
    with mock.patch.object(write_module, "PAGE_BYTES", 4096):  # pages of ~4 KiB: many per column chunk
        ds = shardkit.write_dataset(frame, url, storage_options=s3_server.storage_options,
                                    row_group_size=2000)
    fs = s3fs.S3FileSystem(**s3_server.storage_options)
    file_bytes = sum(fs.size(f"{s3_bucket}/ds/{f}") for f in {rg.file for rg in ds.row_groups})
    with Relay(s3_server.endpoint_url) as relay:
        opts = {**s3_server.storage_options, "client_kwargs": {**s3_server.storage_options["client_kwargs"],
                                                               "endpoint_url": relay.url}}
        opened = shardkit.open_dataset(url, storage_options=opts)
        before = len(relay.stats.ranges("/part-"))
        got = opened.take([2345, 17])
        data = relay.stats.ranges("/part-")[before:]
        again = opened.take([2346, 3999])  # the same row groups: pages, never read whole
        second = relay.stats.ranges("/part-")[before + len(data):]
        third = opened.take([17, 2345])  # its pages and offset indexes kept: no request
        kept = relay.stats.ranges("/part-")[before + len(data) + len(second):]
        unkept = RowAccess(opened, ["features"], cache_bytes=0)  # its own budget of 0: fetched each time
        counts = []
        for _ in range(2):
            already = len(relay.stats.ranges("/part-"))
            np.testing.assert_array_equal(unkept.take([17])["features"][0], frame["features"][17])
            counts.append(len(relay.stats.ranges("/part-")) - already)
    assert list(again["id"]) == [2346, 3999]
    assert list(third["id"]) == [17, 2345]
    np.testing.assert_array_equal(np.stack(third["features"]), np.stack(frame["features"][[17, 2345]]))
    assert kept == []
    assert counts[0] > 0, counts
    assert counts[1] == counts[0], counts
    assert sum(end - start for start, end in second) < file_bytes / 10, (second, file_bytes)
    assert list(got["id"]) == [2345, 17]
    assert list(got["text"]) == ["row 2345", "row 17"]
    np.testing.assert_array_equal(np.stack(got["features"]), np.stack(frame["features"][[2345, 17]]))
    fetched = sum(end - start for start, end in data)
    assert fetched < file_bytes / 10, (data, file_bytes)
    assert len(data) <= 8, data  # per row group: its offset indexes, then its pages (coalesced)


def test_nothing_leaves_loopback(s3_bucket: str) -> None:
    import socket

    with socket.socket() as s, pytest.raises(OSError, match="test guard"):
        s.connect(("52.216.0.1", 443))  # an S3 address: refused before any packet is sent


def test_opening_a_petastorm_dataset_reads_its_common_metadata_once(s3_server: S3Server,
                                                                   s3_bucket: str) -> None:
    """Petastorm's pickled schema is in ``_common_metadata``: telling the kind and reading the schema
    share one read of it (each read of a footer is a request or two on an object store)."""
    import s3fs

    url, opts = f"s3://{s3_bucket}/pst", s3_server.storage_options
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "petastorm" / "tensors"
    fs = s3fs.S3FileSystem(**opts)
    for path in fixture.iterdir():
        fs.put_file(str(path), f"{s3_bucket}/pst/{path.name}")
    s3fs.S3FileSystem.clear_instance_cache()
    since = s3_server.mark()
    with pytest.warns(shardkit.SummaryMissingWarning):
        ds = shardkit.open_dataset(url, storage_options=opts)
    assert ds.kind == "petastorm"
    assert s3_server.count_gets(rf"/{s3_bucket}/pst/_common_metadata", since=since) == 1


@pytest.mark.filterwarnings("ignore::shardkit.SummaryMissingWarning")
def test_a_file_rewritten_in_place_is_fetched_again_and_versions_cost_one_listing(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    """The cache key holds the file's ETag, from one listing of the dataset per reader (no HEAD per file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    url, opts = f"s3://{s3_bucket}/plain", s3_server.storage_options
    fs = s3fs.S3FileSystem(**opts)
    config = CacheConfig(str(tmp_path / "cache"), 1 << 30)

    def put(offset: float) -> None:
        for k in range(3):
            with fs.open(f"{s3_bucket}/plain/data-{k}.parquet", "wb") as f:
                pq.write_table(pa.table({"v": np.arange(400, dtype=np.float64) + offset + 1000 * k}), f,
                               row_group_size=100, compression="none", use_dictionary=False,
                               write_statistics=False)
        fs.invalidate_cache()

    def read() -> tuple[np.ndarray, list[tuple[str, str]]]:
        ds = shardkit.open_dataset(url, storage_options=opts)
        since = s3_server.mark()
        with shardkit.make_reader(ds, shuffle=False, batch_size=1000, cache=config) as reader:
            values = np.concatenate([b["v"] for b in reader])
        return values, [(m, p) for m, p, _ in s3_server.requests(since) if "shardkit-log-sync" not in p]

    want = np.concatenate([np.arange(400, dtype=np.float64) + 1000 * k for k in range(3)])
    put(0)
    np.testing.assert_array_equal(read()[0], want)
    sizes = {p: fs.size(p) for p in fs.ls(f"{s3_bucket}/plain")}
    put(0.5)  # rewritten in place: same names, rows and sizes
    assert {p: fs.size(p) for p in fs.ls(f"{s3_bucket}/plain")} == sizes
    values, asked = read()
    np.testing.assert_array_equal(values, want + 0.5)
    assert [p for m, p in asked if "list-type" in p] == [
        f"/{s3_bucket}?list-type=2&prefix=plain/&delimiter=&encoding-type=url"], asked  # one listing
    assert [p for m, p in asked if m == "HEAD"] == [], asked  # no request per file for its version
    assert sum(m == "GET" and "/data-" in p for m, p in asked) == 12  # every row group fetched again

    values, asked = read()
    np.testing.assert_array_equal(values, want + 0.5)  # unchanged: every row group from the cache
    assert [p for m, p in asked if m == "GET" and "/data-" in p] == [], asked


def _buckets(s3_server: S3Server) -> set[str]:
    import s3fs

    answer = s3fs.S3FileSystem(**s3_server.storage_options).call_s3("list_buckets")
    return {b["Name"] for b in answer["Buckets"]}


def test_a_write_to_a_missing_bucket_creates_none_and_says_so(s3_server: S3Server, s3_bucket: str) -> None:
    """s3fs's makedirs creates a missing bucket: a typo in the URL must fail, not make a bucket."""
    opts = s3_server.storage_options
    missing = f"typo-{s3_bucket}"
    before = _buckets(s3_server)
    since = s3_server.mark()
    with pytest.raises(shardkit.errors.DatasetNotFoundError,
                       match=rf"the bucket 's3://{missing}' does not exist.*does not create buckets"):
        shardkit.write_dataset(_frame(3), f"s3://{missing}/ds", storage_options=opts)
    assert _buckets(s3_server) == before
    assert [(m, p) for m, p, _ in s3_server.requests(since) if m == "PUT"] == []

    # into a bucket that exists, a write makes no bucket and no folder either: only its keys
    since = s3_server.mark()
    shardkit.write_dataset(_frame(3), f"s3://{s3_bucket}/new/ds", storage_options=opts)
    puts = [p.split("?")[0] for m, p, _ in s3_server.requests(since) if m == "PUT"]
    assert puts, s3_server.requests(since)
    assert all(p.startswith(f"/{s3_bucket}/new/ds/") for p in puts), puts
    assert not [p for p in puts if p.endswith("/")], puts
    assert _buckets(s3_server) == before


# --- storage options the filesystem does not take ---------------------------------------------------------


def test_an_unknown_storage_option_is_refused_before_any_request(s3_server: S3Server, s3_bucket: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """s3fs hands the options it does not name to botocore's session, which raised ``TypeError`` at the
    first request (a traceback from aiobotocore): refused up front, naming the key, the URL and the fix."""
    from shardkit.cli import main

    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    shardkit.write_dataset(_frame(100), url, storage_options=opts)
    since = s3_server.mark()
    bad = {**opts, "bogus": 1}
    new = f"s3://{s3_bucket}/new"
    for at, call in ((url, lambda: shardkit.make_reader(url, storage_options=bad)),
                     (url, lambda: shardkit.open_dataset(url, storage_options=bad)),
                     (new, lambda: shardkit.write_dataset(_frame(3), new, storage_options=bad))):
        with pytest.raises(StorageOptionsError) as info:
            call()
        assert isinstance(info.value, ValueError)
        message = str(info.value)
        assert message.startswith(f"the storage option 'bogus' for {at!r} is not taken"), message
        assert "not taken by s3fs's S3FileSystem" in message, message
        assert re.search(r"use the options it takes: anon, .*endpoint_url, .*profile, .* botocore's options "
                         r"go inside 'client_kwargs' .* or 'config_kwargs'", message), message
    assert [r for r in s3_server.requests(since) if "shardkit-log-sync" not in r[1]] == []

    with pytest.raises(ValueError, match=r"'enpoint_url' for .* Did you mean 'endpoint_url'\?"):
        shardkit.open_dataset(url, storage_options={**opts, "enpoint_url": s3_server.endpoint_url})
    with pytest.raises(ValueError, match=r"options 'retries', 'bogus' for .* are not taken"):
        shardkit.open_dataset(url, storage_options={**opts, "s3": {"bogus": 1}, "retries": 2})

    assert main(["bench", url, "--storage-options", json.dumps(bad), "--warmup", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    assert err.startswith(f"shardkit bench: error: the storage option 'bogus' for {url!r}"), err


def test_the_options_s3fs_takes_are_not_refused(s3_server: S3Server, s3_bucket: str) -> None:
    """Options of s3fs's constructor, of fsspec's caches, and those it passes to botocore's session, also
    under a key named for the protocol, and fsspec.open's arguments (which fsspec drops) all open."""
    url = f"s3://{s3_bucket}/ds"
    shardkit.write_dataset(_frame(50), url, storage_options=s3_server.storage_options)
    for extra in ({"use_listings_cache": False, "skip_instance_cache": True, "default_block_size": 1 << 22},
                  {"s3": {"requester_pays": False}, "session_vars": {}}, {"compression": None}):
        ds = shardkit.open_dataset(url, storage_options={**s3_server.storage_options, **extra})
        assert ds.num_rows == 50, extra


def test_dataloader_workers_forked_from_a_remote_dataset_read_it_without_opening_it_again(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    """Forked DataLoader workers read the dataset `ShardkitIterableDataset` opened, each through a
    filesystem of its own (an async one made in the parent refuses to run in a child: "not fork-safe"):
    every row once, and the summary fetched once in all, not once more per worker."""
    import s3fs
    import torch

    from shardkit.torch import ShardkitIterableDataset

    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    shardkit.write_dataset(_frame(600), url, storage_options=opts, row_group_size=100)
    s3fs.S3FileSystem.clear_instance_cache()  # as a new process: nothing listed yet
    since = s3_server.mark()
    ds = ShardkitIterableDataset(url, batch_size=50, seed=0, storage_options=opts, cache=str(tmp_path / "c"))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    ids = np.concatenate([b["id"].numpy() for b in loader])
    assert sorted(ids.tolist()) == list(range(600))
    assert s3_server.count_gets(rf"/{s3_bucket}/ds/_metadata", since=since) == 1, s3_server.requests(since)
    assert s3_server.count_gets(rf"/{s3_bucket}{DATA_FILES}", since=since) > 0


def test_a_transform_s_fields_are_learned_from_the_first_pages_not_the_whole_row_group(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    """A reader with ``transform=`` learns the fields the transform returns from the dataset's first
    sample, in the process that makes the reader (before a DataLoader forks its workers): from a store,
    that sample costs the first pages of its row group's column chunks, not the row group (which
    waited for all of its bytes, serially, before the workers started)."""
    import s3fs

    from benchmarks.relay import Relay

    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    frame = _frame(4000)
    frame["features"] = list(np.random.default_rng(2).standard_normal((4000, 1024)).astype(np.float32))
    shardkit.write_dataset(frame, url, storage_options=opts, row_group_size=4000)  # ~16 MB, ~16 pages
    fs = s3fs.S3FileSystem(**opts)
    file_bytes = sum(info["size"] for info in fs.ls(f"{s3_bucket}/ds", detail=True)
                     if "/part-" in info["name"])

    def scaled(sample: dict) -> dict:
        return {"id": sample["id"], "half": (sample["features"][:4] / 2).astype(np.float16)}

    with Relay(s3_server.endpoint_url) as relay:
        relay_opts = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": relay.url}}
        with shardkit.make_reader(url, transform=scaled, shuffle=False, batch_size=1000,
                                  cache=str(tmp_path / "c"), storage_options=relay_opts) as reader:
            schema = reader.schema
            probed = sum(end - start for start, end in relay.stats.ranges("/part-"))
            batches = list(reader)
    assert schema.names == ["id", "half"]
    assert probed < file_bytes / 4, (probed, file_bytes)
    ids = np.concatenate([b["id"] for b in batches])
    np.testing.assert_array_equal(ids, np.arange(4000))
    half = np.concatenate([b["half"] for b in batches])
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, (np.stack(frame["features"])[:, :4] / 2).astype(np.float16))


def test_a_transform_s_first_sample_costs_the_first_page_of_a_column_of_wide_values(
        s3_server: S3Server, s3_bucket: str) -> None:
    """Wide values (images: a few dozen to a 1 MiB page) cost the first sample's page only: the look
    decodes one row, not a slice of 256 (which requested the pages of 256 values, one after another)."""
    from benchmarks.relay import Relay

    url, opts = f"s3://{s3_bucket}/wide", s3_server.storage_options
    rng = np.random.default_rng(5)
    frame = pd.DataFrame({"id": np.arange(400, dtype=np.int64),
                          "blob": [rng.bytes(16_000 + int(k)) for k in rng.integers(0, 1000, 400)]})
    shardkit.write_dataset(frame, url, storage_options=opts, row_group_size=400)  # ~6.5 MB, ~7 pages
    with Relay(s3_server.endpoint_url) as relay:
        relay_opts = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": relay.url}}
        with shardkit.make_reader(url, transform=lambda s: {"id": s["id"], "n": len(s["blob"])},
                                  shuffle=False, batch_size=100, storage_options=relay_opts) as reader:
            schema = reader.schema
            probed = sum(end - start for start, end in relay.stats.ranges("/part-"))
            ids = np.concatenate([b["id"] for b in reader])
    assert schema.names == ["id", "n"]
    assert probed <= 2 * 2**20 + 2**16, probed  # the blob column's first page, and the ids' (one piece)
    np.testing.assert_array_equal(ids, np.arange(400))


@pytest.mark.parametrize("quick_start", [True, False])
def test_a_quick_start_fetches_the_first_batchs_row_group_alone_before_the_rest(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path, quick_start: bool) -> None:
    """A window of the whole dataset (10 row groups, 2 a file): with the quick start, a shard's first
    batch comes from one row group, fetched alone, and the others are fetched once it is out; without it,
    the first batch waits for all of them. Every row still comes once."""
    url, opts = f"s3://{s3_bucket}/quick", s3_server.storage_options
    frame = _frame(1280)
    shardkit.write_dataset(frame, url, storage_options=opts, row_group_size=128,
                           file_size=int(frame.memory_usage(deep=True).sum()) // 20)
    files = shardkit.open_dataset(url, storage_options=opts).files
    assert len(files) == 5
    data_files = rf"/{s3_bucket}/quick/part-"
    start = s3_server.mark()
    with shardkit.make_reader(url, batch_size=64, shuffle_buffer=1280, seed=3, storage_options=opts,
                              cache=CacheConfig(str(tmp_path / "cache"), 1 << 30),
                              quick_start=quick_start) as reader:
        batches = iter(reader)
        first = next(batches)["id"]
        fetched = {path for method, path, _ in s3_server.requests(since=start)
                   if method == "GET" and re.search(data_files, path)}
        ids = [*first.tolist(), *(i for b in batches for i in b["id"].tolist())]
    assert sorted(ids) == list(range(1280))
    if quick_start:
        assert len(np.unique(first // 128)) == 1
        assert len(fetched) == 1, fetched
    else:
        assert len(np.unique(first // 128)) > 5
        assert len(fetched) == 5, fetched
