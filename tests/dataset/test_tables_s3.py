"""Delta Lake and Iceberg tables on a real S3-protocol server (moto, on loopback): the same snapshot
rows, time travel and resume as on a local disk, through ``storage_options``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deltalake  # noqa: F401  (installed by [dev]: a missing one is a broken install, not a skip)
import numpy as np
import pyarrow as pa
import pyiceberg  # noqa: F401
import pytest

import shardkit
from tests.dataset.tables import rows
from tests.reader import conftest as s3_fixtures
from tests.reader.conftest import S3Server

s3_server, s3_bucket, no_internet = s3_fixtures.s3_server, s3_fixtures.s3_bucket, s3_fixtures.no_internet


def delta_options(server: S3Server) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": server.endpoint_url, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
            "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true", "AWS_S3_ALLOW_UNSAFE_RENAME": "true"}


def ids_of(url: str, server: S3Server, **kw: Any) -> list[int]:
    kw = {"shuffle": False, "remainder": "uneven", "batch_size": 50, "workers": 1, "cache": None, **kw}
    with shardkit.make_reader(url, storage_options=server.storage_options, **kw) as reader:
        return sorted(int(i) for batch in reader for i in batch["id"])


def test_delta_on_s3_reads_the_snapshot_and_travels_in_time(s3_server: S3Server, s3_bucket: str,
                                                            tmp_path: Path) -> None:
    from deltalake import write_deltalake

    url = f"s3://{s3_bucket}/delta"
    options = delta_options(s3_server)
    write_deltalake(url, rows(range(300)), storage_options=options)
    write_deltalake(url, rows(range(300, 400)), mode="overwrite", storage_options=options)
    write_deltalake(url, rows(range(400, 450)), mode="append", storage_options=options)
    assert ids_of(url, s3_server) == list(range(300, 450))
    assert ids_of(url, s3_server, version=0) == list(range(300))
    ds = shardkit.open_dataset(url, storage_options=s3_server.storage_options)
    assert ds.snapshot is not None
    assert ds.snapshot.version == 2
    cache = str(tmp_path / "cache")  # the files never change in place: cached row groups serve every read
    assert ids_of(url, s3_server, cache=cache) == ids_of(url, s3_server, cache=cache) == list(range(300, 450))
    assert ids_of(url, s3_server, cache=cache, version=0) == list(range(300))


@pytest.fixture
def iceberg_catalog(s3_server: S3Server, s3_bucket: str) -> Any:
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("s3", uri="sqlite:///:memory:", warehouse=f"s3://{s3_bucket}/wh", **{
        "s3.endpoint": s3_server.endpoint_url, "s3.access-key-id": "x", "s3.secret-access-key": "x",
        "s3.region": "us-east-1"})
    catalog.create_namespace("ns")
    return catalog


def test_iceberg_on_s3_reads_the_snapshot_and_resumes_on_it(
        s3_server: S3Server, s3_bucket: str, iceberg_catalog: Any) -> None:
    table = iceberg_catalog.create_table("ns.t", schema=rows([]).schema)
    table.append(rows(range(200)))
    table.overwrite(rows(range(200, 330)))
    url = f"s3://{s3_bucket}/wh/ns/t"
    assert ids_of(url, s3_server) == list(range(200, 330))
    assert ids_of(table, s3_server) == list(range(200, 330))  # the catalog's table object
    first = table.snapshots()[0].snapshot_id
    assert ids_of(url, s3_server, version=first) == list(range(200))
    with shardkit.make_reader(url, storage_options=s3_server.storage_options, batch_size=20, seed=2,
                              remainder="uneven", cache=None) as reader:
        it = iter(reader)
        seen = [int(i) for _ in range(2) for i in next(it)["id"]]
        state = reader.state_dict()
    table.append(pa.table({"id": np.arange(900, 905), "x": np.arange(900, 905) * 0.5}))
    for shard in range(2):
        with shardkit.make_reader(url, storage_options=s3_server.storage_options, batch_size=20, seed=2,
                                  shard=shard, num_shards=2, remainder="uneven", cache=None) as reader:
            reader.load_state_dict(state)
            seen += [int(i) for batch in reader for i in batch["id"]]
    assert sorted(seen) == list(range(200, 330))
