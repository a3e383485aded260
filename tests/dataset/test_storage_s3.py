"""Datasets on a real S3-protocol server (moto on loopback) that refuses or stops answering: credentials
it does not know or that may not read, and an endpoint that goes down mid-read (a TCP relay in front of
moto, so that moto keeps what it stores). Every failure is a shardkit error naming the URL and the fix,
and nothing is skipped: a reader's state resumes with every row once.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import shardkit
from shardkit.errors import CorruptDatasetError, DatasetError, DatasetPermissionError
from tests.reader import conftest as s3_fixtures
from tests.reader.conftest import S3Server
from tests.reader.s3_tools import FAST, IAMServer, Link, allow, iam_server, s3_options

# the moto S3 server on loopback and a fresh bucket per test (tests/reader/conftest.py)
s3_server, s3_bucket, no_internet = s3_fixtures.s3_server, s3_fixtures.s3_bucket, s3_fixtures.no_internet

ROWS, GROUP = 2000, 50


# ------------------------------------------------------------------------------ an endpoint that goes down


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_endpoint_that_goes_down_mid_read_stops_the_read_and_loses_nothing(
        s3_server: S3Server, s3_bucket: str, on_error: str) -> None:
    """botocore's EndpointConnectionError (no OSError) came out of the reader as it was, a traceback from
    s3fs's open; now a `DatasetError` naming the file, the URL and the endpoint option, and no row is lost
    or repeated when the reader's state resumes against the endpoint back up."""
    url = f"s3://{s3_bucket}/ds"
    shardkit.write_dataset({"x": np.arange(ROWS)}, url, storage_options=s3_server.storage_options,
                           row_group_size=GROUP)
    relay = Link(s3_server.endpoint_url)
    kw: dict[str, Any] = {"cache": None, "shuffle": False, "batch_size": GROUP, "prefetch": 2, "workers": 2}
    seen: list[int] = []
    try:
        first = shardkit.make_reader(url, storage_options=s3_options(relay.url, **FAST), on_error=on_error,
                                     **kw)
        batches = iter(first)
        for _ in range(3):
            seen.extend(next(batches)["x"].tolist())
    finally:
        relay.down()
    with pytest.raises(DatasetError) as raised:
        seen.extend(x for batch in batches for x in batch["x"].tolist())
    assert not isinstance(raised.value, CorruptDatasetError), raised.value
    message = str(raised.value)
    assert re.search(rf"cannot read '{s3_bucket}/ds/part-[^']+' of '{url}': the storage service could not "
                     r"be reached: .*'endpoint_url'.*\. Nothing was skipped: read again once this is "
                     r"fixed", message), message
    state = first.state_dict()
    first.close()

    back = s3_options(s3_server.endpoint_url, **FAST)
    with shardkit.make_reader(url, storage_options=back, **kw) as resumed:
        resumed.load_state_dict(state)
        rest = [x for batch in resumed for x in batch["x"].tolist()]
    assert sorted(seen + rest) == list(range(ROWS))


# ------------------------------------------------------------------------------ credentials and permissions


@pytest.fixture(scope="module")
def iam(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[IAMServer]:
    """Users ``admin`` (everything), ``nobody`` (nothing), ``no-list`` (objects, no listing) and
    ``read-only`` (list the bucket and read objects: what a read needs, not a write), ``staging-only``
    (that, delete, and write only under a ``_staging`` folder: not what a commit needs); a summarized
    dataset at ``ds`` and a plain Parquet one (no summary) at ``plain``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    def policies(bucket: str) -> dict[str, str | None]:
        objects, listing = f"arn:aws:s3:::{bucket}/*", f"arn:aws:s3:::{bucket}"
        read = [(["s3:GetObject"], objects), (["s3:ListBucket"], listing)]
        staging = [*read, (["s3:PutObject"], f"arn:aws:s3:::{bucket}/*/_staging/*"),
                   # moto checks a bulk delete (s3fs's rm) against the bucket, AWS against each key
                   (["s3:DeleteObject"], [listing, objects])]
        return {"admin": allow((["*"], "*")), "nobody": None, "no-list": allow((["s3:GetObject"], objects)),
                "read-only": allow(*read), "staging-only": allow(*staging)}

    with iam_server(tmp_path_factory.mktemp("moto-iam"), policies) as server:
        shardkit.write_dataset({"x": np.arange(ROWS)}, f"s3://{server.bucket}/ds", row_group_size=GROUP,
                               storage_options=server.options("admin"))
        with s3fs.S3FileSystem(**server.options("admin")).open(f"{server.bucket}/plain/a.parquet", "wb") as f:
            pq.write_table(pa.table({"x": np.arange(ROWS)}), f)
        yield server


@pytest.mark.parametrize(("user", "name"), [("unknown key", "ds"), ("nobody", "ds"), ("nobody", "plain"),
                                            ("no-list", "plain")])
def test_refused_credentials_are_a_permission_error_naming_the_url(iam: IAMServer, no_internet: None,
                                                                   user: str, name: str) -> None:
    """A key the store does not know, credentials that may do nothing, or read objects but not list a
    folder with no summary: s3fs's ``exists`` raised a bare ``PermissionError: Forbidden`` from opening
    (no URL, no fix); now a `DatasetPermissionError` naming the URL and what the credentials need."""
    url = f"s3://{iam.bucket}/{name}"
    for call in (lambda: shardkit.open_dataset(url, storage_options=iam.options(user)),
                 lambda: shardkit.make_reader(url, storage_options=iam.options(user))):
        with pytest.raises(DatasetPermissionError, match=rf"permission denied: cannot open '{iam.bucket}/"
                                                         rf"{name}' \(.*\)\. Check that these credentials "
                                                         rf"may list the bucket and read objects under "
                                                         rf"'{url}'"):
            call()
    if (user, name) == ("no-list", "plain"):
        summarized = shardkit.open_dataset(f"s3://{iam.bucket}/ds", storage_options=iam.options(user))
        assert summarized.num_rows == ROWS  # a summary needs no listing


def test_a_bucket_that_does_not_exist_is_no_permission_error(s3_server: S3Server, s3_bucket: str,
                                                             tmp_path: Path) -> None:
    url = f"s3://missing-{s3_bucket}/ds"
    with pytest.raises(shardkit.errors.DatasetNotFoundError, match=rf"no dataset at '{url}'"):
        shardkit.open_dataset(url, storage_options=s3_server.storage_options)
    with pytest.raises(shardkit.errors.DatasetNotFoundError, match=rf"no dataset at 's3://{s3_bucket}/no'"):
        shardkit.open_dataset(f"s3://{s3_bucket}/no", storage_options=s3_server.storage_options)



def _keys(iam: IAMServer, prefix: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(**iam.options("admin"), skip_instance_cache=True)
    return sorted(str(p).removeprefix(f"{iam.bucket}/") for p in fs.find(f"{iam.bucket}/{prefix}"))


@pytest.mark.parametrize(("name", "mode"), [("ds", "overwrite"), ("ds", "append"), ("new", "error")])
def test_a_write_with_credentials_that_may_read_but_not_write_is_refused_before_any_input_is_read(
        iam: IAMServer, no_internet: None, name: str, mode: str) -> None:
    """Overwrite or append: a bare ``PermissionError: Access Denied`` from the first staged part, once the
    input was consumed; a new path: "the bucket ... does not exist, or these credentials cannot see it"
    (its ``HEAD`` was refused), though they list it. Now both a `DatasetPermissionError` naming the URL and
    what a write needs, before the input is read; the dataset is as it was and no staged file is left."""
    url = f"s3://{iam.bucket}/{name}"
    consumed: list[int] = []

    def batches() -> Iterator[pa.Table]:
        consumed.append(1)
        yield pa.table({"x": np.arange(10)})

    before = _keys(iam, "")
    with pytest.raises(DatasetPermissionError, match=rf"permission denied: cannot write to '{iam.bucket}/"
                                                     rf"{name}' \(.*Access Denied.*\)\. Check that these "
                                                     rf"credentials may list the bucket and read, write and "
                                                     rf"delete objects under '{url}'"):
        shardkit.write_dataset(batches(), url, mode=mode, storage_options=iam.options("read-only"))
    assert consumed == []
    assert _keys(iam, "") == before
    ds = shardkit.open_dataset(f"s3://{iam.bucket}/ds", storage_options=iam.options("read-only"))
    assert ds.num_rows == ROWS


def test_a_write_with_full_rights_still_writes_and_leaves_no_probe(iam: IAMServer, no_internet: None) -> None:
    url = f"s3://{iam.bucket}/full-{uuid.uuid4().hex[:8]}"
    opts = iam.options("admin")
    shardkit.write_dataset({"x": np.arange(10)}, url, storage_options=opts)
    shardkit.write_dataset({"x": np.arange(10, 15)}, url, mode="append", storage_options=opts)
    ds = shardkit.write_dataset({"x": np.arange(7)}, url, mode="overwrite", storage_options=opts)
    assert ds.num_rows == 7
    assert not [k for k in _keys(iam, url.rsplit("/", 1)[-1]) if "_staging" in k]
    missing = f"s3://missing-{iam.bucket}/ds"  # a bucket that is not there is still named as such
    with pytest.raises(shardkit.errors.DatasetNotFoundError, match=rf"the bucket 's3://missing-{iam.bucket}' "
                                                                   "does not exist"):
        shardkit.write_dataset({"x": np.arange(3)}, missing, storage_options=opts)


def test_a_write_refused_at_its_commit_names_the_url_and_leaves_no_staged_part(iam: IAMServer,
                                                                                no_internet: None) -> None:
    """Credentials that may write only under ``_staging`` pass the probe; the commit's move is refused:
    a `DatasetPermissionError` (not a bare ``PermissionError``), and the staged parts are removed."""
    url = f"s3://{iam.bucket}/ds"
    with pytest.raises(DatasetPermissionError, match=rf"cannot write to '{iam.bucket}/ds' .* read, write and "
                                                     rf"delete objects under '{url}'"):
        shardkit.write_dataset({"x": np.arange(10)}, url, mode="append",
                               storage_options=iam.options("staging-only"))
    assert not [k for k in _keys(iam, "ds") if "_staging" in k]
    assert shardkit.open_dataset(url, storage_options=iam.options("admin")).num_rows == ROWS

