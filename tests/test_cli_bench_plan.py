"""``shardkit bench --plan`` (`shardkit.bench.plan.plan_egress`): the estimate against a real read.

The dataset lies in a moto S3 server on loopback; the real reads go through a relay in front of it
(`benchmarks.relay`) that counts every request and the bytes of its range. The plan's GET requests and
bytes fetched must equal the counted ones, for 1 and 2 epochs, 1 and 2 ranks, with and without a
row-group cache; its cached bytes per host must be within 25% of the cache folder's entries. A store
that cannot be reached is a `DatasetError` (no hang: the test's timeout bounds it). No timing asserts.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pytest

import shardkit
from benchmarks.relay import Relay
from shardkit.bench.plan import plan_egress
from shardkit.cli import main
from shardkit.dataset import SummaryMissingWarning
from shardkit.errors import DatasetError, ReaderError
from shardkit.reader import CacheConfig
from tests.reader import conftest as s3_fixtures

if TYPE_CHECKING:
    from tests.reader.conftest import S3Server

pytestmark = pytest.mark.timeout(180)
s3_server, s3_bucket, no_internet = s3_fixtures.s3_server, s3_fixtures.s3_bucket, s3_fixtures.no_internet
N, ROW_GROUP = 3000, 250


@pytest.fixture(autouse=True)
def _no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_reader takes num_shards from a job's WORLD_SIZE/RANK: these tests run outside one."""
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def url(s3_server: S3Server, s3_bucket: str) -> str:
    rng = np.random.default_rng(1)
    frame = pd.DataFrame({"id": np.arange(N, dtype=np.int64),
                          "label": rng.integers(0, 10, N).astype(np.int32),
                          "features": list(rng.standard_normal((N, 64)).astype(np.float32))})
    url = f"s3://{s3_bucket}/ds"
    shardkit.write_dataset(frame, url, storage_options=s3_server.storage_options, row_group_size=ROW_GROUP)
    return url


@pytest.fixture
def relay(s3_server: S3Server) -> Iterator[Relay]:
    with Relay(s3_server.endpoint_url) as r:
        yield r


def _through(s3_server: S3Server, relay: Relay) -> dict[str, Any]:
    return {**s3_server.storage_options,
            "client_kwargs": {**s3_server.storage_options["client_kwargs"], "endpoint_url": relay.url}}


def _counted(relay: Relay) -> tuple[int, int]:
    """GETs of data files that passed the relay, and the bytes of their ranges."""
    gets = [r for m, p, r in relay.stats.requests if m == "GET" and "/part-" in p]
    assert all(r is not None for r in gets), "every data GET is a range"
    return len(gets), sum(b - a + 1 for a, b in (r for r in gets if r is not None))


def _read(url: str, options: dict[str, Any], *, world_size: int, epochs: int, cache: Any,
          columns: list[str] | None, shuffle: bool = True) -> int:
    """Every rank's shard read for ``epochs`` epochs, rank after rank (as separate hosts, or as the
    ranks of one host sharing ``cache``); the rows read."""
    rows = 0
    for rank in range(world_size):
        cache_of_rank = cache(rank) if callable(cache) else cache
        with shardkit.make_reader(url, shard=rank, num_shards=world_size, num_epochs=epochs, batch_size=64,
                                  columns=columns, cache=cache_of_rank, shuffle=shuffle, seed=5,
                                  storage_options=options) as reader:
            rows += sum(len(next(iter(b.values()))) for b in reader)
    return rows


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("columns", [None, ["id", "label"]], ids=["all", "id+label"])
def test_the_plan_counts_the_requests_and_bytes_a_real_read_makes(
        s3_server: S3Server, url: str, relay: Relay, tmp_path: Path, world_size: int, epochs: int,
        cached: bool, columns: list[str] | None) -> None:
    options = _through(s3_server, relay)
    cache = (lambda rank: CacheConfig(str(tmp_path / f"host{rank}"), 1 << 30)) if cached else None
    plan = plan_egress(url, world_size=world_size, epochs=epochs, columns=columns, seed=5, batch_size=64,
                       cache=str(tmp_path / "any") if cached else None, probe_reads=0,
                       storage_options=s3_server.storage_options)
    relay.reset()
    rows = _read(url, options, world_size=world_size, epochs=epochs, cache=cache, columns=columns)
    assert rows == epochs * (N // world_size) // 64 * 64 or rows > 0
    requests, fetched = _counted(relay)
    assert (plan.requests, plan.bytes_fetched) == (requests, fetched)
    assert plan.cache is cached
    opening = [p for m, p, _ in relay.stats.requests if m == "GET" and "/part-" not in p]
    assert plan.open_requests == len(opening)  # each rank: its _metadata, and a listing with a cache
    if cached:
        held = max(sum(f.stat().st_size for f in (tmp_path / f"host{r}").glob("*.arrow"))
                   for r in range(world_size))
        assert abs(plan.cached_bytes_per_host - held) <= 0.25 * held, (plan.cached_bytes_per_host, held)
    else:
        assert plan.cached_bytes_per_host == 0


def test_ranks_of_one_host_share_its_cache_and_in_order_reads_plan_too(
        s3_server: S3Server, url: str, relay: Relay, tmp_path: Path) -> None:
    """Two ranks on one host with one cache folder: each row group fetched once between them."""
    folder = str(tmp_path / "host")
    plan = plan_egress(url, world_size=2, ranks_per_host=2, epochs=2, cache=folder, shuffle=False,
                       seed=5, batch_size=64, probe_reads=0, storage_options=s3_server.storage_options)
    relay.reset()
    _read(url, _through(s3_server, relay), world_size=2, epochs=2, cache=folder, columns=None, shuffle=False)
    assert (plan.requests, plan.bytes_fetched) == _counted(relay)
    assert plan.requests == N // ROW_GROUP  # one GET a row group, once for the host
    assert plan.hosts == 1


def test_plain_parquet_without_summary_plans_by_its_footers(
        s3_server: S3Server, s3_bucket: str, relay: Relay) -> None:
    """Plain Parquet files (no shardkit summary): the footers read at opening place the ranges."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    fs = s3fs.S3FileSystem(**s3_server.storage_options)
    for k in range(3):
        table = pa.table({"id": np.arange(k * 1000, (k + 1) * 1000), "x": np.ones(1000)})
        with fs.open(f"{s3_bucket}/plain/part-{k}.parquet", "wb") as f:
            pq.write_table(table, f, row_group_size=300)
    url = f"s3://{s3_bucket}/plain"
    with pytest.warns(SummaryMissingWarning):
        plan = plan_egress(url, world_size=2, epochs=2, cache=None, probe_reads=0, seed=5, batch_size=64,
                           storage_options=s3_server.storage_options)
    relay.reset()
    with pytest.warns(SummaryMissingWarning):
        _read(url, _through(s3_server, relay), world_size=2, epochs=2, cache=None, columns=None)
    requests, fetched = _counted(relay)
    footers = 2 * 3  # each rank's open reads each file's footer: one ranged GET of these small files
    assert (plan.requests + footers, plan.row_groups) == (requests, 12)
    assert plan.open_requests == footers + 2  # and lists the folder
    assert plan.bytes_fetched < fetched  # the footers' bytes are not counted


def test_a_row_group_larger_than_a_request_is_fetched_in_parts(
        s3_server: S3Server, s3_bucket: str, relay: Relay) -> None:
    """A row group of more than `PART` (32 MiB): the plan counts the parts the reader asks for."""
    from shardkit.dataset.fetch import PART

    rows = (PART + (4 << 20)) // 8
    values = np.random.default_rng(0).standard_normal(rows)  # incompressible: its chunk stays > PART
    url = f"s3://{s3_bucket}/big"
    shardkit.write_dataset({"x": values}, url, storage_options=s3_server.storage_options, row_group_size=rows)
    plan = plan_egress(url, cache=None, probe_reads=0, shuffle=False,
                       storage_options=s3_server.storage_options)
    assert plan.requests == 2
    assert plan.bytes_fetched > PART
    relay.reset()
    _read(url, _through(s3_server, relay), world_size=1, epochs=1, cache=None, columns=None, shuffle=False)
    assert (plan.requests, plan.bytes_fetched) == _counted(relay)


def test_a_cache_smaller_than_a_host_reads_is_said(s3_server: S3Server, url: str, tmp_path: Path) -> None:
    plan = plan_egress(url, cache=CacheConfig(str(tmp_path / "small"), 10_000), probe_reads=0,
                       storage_options=s3_server.storage_options)
    assert plan.cache_too_small
    assert "evicted row groups are fetched again" in plan.summary()
    roomy = plan_egress(url, cache=CacheConfig(str(tmp_path / "big"), 1 << 30), probe_reads=0,
                        storage_options=s3_server.storage_options)
    assert not roomy.cache_too_small


def test_without_cache_every_epoch_fetches_again(s3_server: S3Server, url: str) -> None:
    options = s3_server.storage_options
    one, two = (plan_egress(url, epochs=e, cache=None, probe_reads=0, storage_options=options)
                for e in (1, 2))
    assert two.requests == 2 * one.requests
    assert two.bytes_fetched == 2 * one.bytes_fetched
    cached = plan_egress(url, epochs=2, cache="auto", probe_reads=0, storage_options=options)
    assert (cached.requests, cached.bytes_fetched) == (one.requests, one.bytes_fetched)


def test_the_probe_measures_real_row_group_reads_and_prices_the_run(
        s3_server: S3Server, url: str, relay: Relay) -> None:
    relay.reset()
    plan = plan_egress(url, world_size=2, epochs=3, cache=None, probe_reads=2, price_per_gb=0.09,
                       price_per_1k_requests=0.0004, storage_options=_through(s3_server, relay))
    assert plan.probe is not None
    assert plan.probe.reads == 2
    assert plan.probe.requests == 2
    assert plan.probe.bytes > 0
    probe_gets = [r for m, p, r in relay.stats.requests if m == "GET" and "/part-" in p]
    assert len(probe_gets) == 2 * 2  # a small read for the latency and the row group, each
    assert plan.probe.mb_per_second > 0
    assert plan.probe.latency_s > 0
    low, high = plan.seconds or (0.0, 0.0)
    assert 0 < low <= high
    assert plan.open_requests == 2  # each rank's GET of _metadata (no cache: no listing)
    assert plan.open_bytes > 0
    gb, thousands = (plan.bytes_fetched + plan.open_bytes) / 1e9, (plan.requests + plan.open_requests) / 1000
    assert plan.cost == pytest.approx(0.09 * gb + 0.0004 * thousands)


def test_cli_text_fits_one_screen_and_json_has_the_numbers(
        s3_server: S3Server, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", url, "--plan", "--world-size", "2", "--epochs", "2", "--no-cache", "--probe-reads", "1",
            "--price-per-gb", "0.09", "--storage-options", json.dumps(s3_server.storage_options)]
    assert main(base) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert len(lines) <= 24, text
    assert max(map(len, lines)) <= 160, text
    for word in ("requests", "fetched", "cached", "store rate", "fetch time", "cost", "cache        off"):
        assert word in text, text
    assert main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = plan_egress(url, world_size=2, epochs=2, cache=None, probe_reads=0,
                       storage_options=s3_server.storage_options)
    assert (out["requests"], out["bytes_fetched"]) == (plan.requests, plan.bytes_fetched)
    assert out["world_size"] == 2
    assert out["epochs"] == 2
    assert out["cache"] is False
    assert out["probe"]["mb_per_second"] > 0
    assert out["seconds_low"] > 0
    assert out["cost"] > 0


def test_a_local_dataset_plans_no_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local = shardkit.write_dataset({"id": np.arange(100)}, tmp_path / "ds", row_group_size=10).url
    plan = plan_egress(local, world_size=3, epochs=2)
    assert (plan.local, plan.requests, plan.bytes_fetched, plan.probe) == (True, 0, 0, None)
    assert main(["bench", local, "--plan"]) == 0
    assert "no requests" in capsys.readouterr().out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_store_that_cannot_be_reached_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    options = {"key": "x", "secret": "x",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    with pytest.raises(DatasetError) as e:
        plan_egress("s3://nobucket/ds", storage_options=options, timeout=5)
    assert "s3://nobucket/ds" in str(e.value)
    assert endpoint in str(e.value)
    assert "connection refused" in str(e.value)
    assert main(["bench", "s3://nobucket/ds", "--plan", "--timeout", "5",
                 "--storage-options", json.dumps(options)]) != 0
    err = capsys.readouterr().err
    assert "s3://nobucket/ds" in err
    assert "Traceback" not in err


def test_a_store_that_never_answers_is_an_error_at_the_deadline() -> None:
    """A server that takes the connection and never answers: the deadline ends the wait."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        port = server.getsockname()[1]
        options = {"key": "x", "secret": "x", "client_kwargs": {
            "endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}}
        with pytest.raises(DatasetError, match=r"did not answer within 2 s \(opening the dataset\)"):
            plan_egress("s3://silent/ds", storage_options=options, timeout=2)
    finally:
        server.close()


def test_bad_arguments_name_the_value(s3_server: S3Server, url: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    for kwargs in ({"world_size": 0}, {"epochs": -1}, {"ranks_per_host": 1.5}, {"price_per_gb": -1.0},
                   {"timeout": 0}):
        with pytest.raises(ReaderError, match=next(iter(kwargs))):
            plan_egress(url, storage_options=s3_server.storage_options, **kwargs)
    with pytest.raises(ReaderError, match="world_size=5000"):
        plan_egress(url, world_size=5000, storage_options=s3_server.storage_options, probe_reads=0)
    for argv, words in ((["--world-size", "2"], "only a plan takes it"),
                        (["--plan", "--shard", "1"], "--shard is a flag of a measured read"),
                        (["--plan", "--world-size", "0"], "not a count")):
        with pytest.raises(SystemExit):
            main(["bench", url, *argv])
        assert words in capsys.readouterr().err
