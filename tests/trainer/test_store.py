"""The checkpoint store against a real S3-protocol server (moto on loopback) that refuses or cannot answer.

Rejected or missing credentials, credentials denied the bucket, its listing or its objects, a missing
bucket, and a server that goes down before or during a restore, a save or the pruning after it. None may
read as "no checkpoint" (a fresh start) or as a damaged checkpoint (skipped for an older one): each
raises a shardkit error naming the URL and the fix, and the committed checkpoints stay as they were.

A server "goes down" behind `Link` (tests/reader/s3_tools.py), a TCP forwarder on loopback that can
refuse connections (or take them and never answer) and come back, so moto keeps what it stores
meanwhile. Credentials are checked by a second moto server started with its IAM authentication on
(`iam`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from shardkit.errors import CheckpointError, CheckpointWarning, DatasetPermissionError
from shardkit.trainer.checkpoint import CheckpointManager
from shardkit.trainer.checkpoint._store import Store
from tests.reader import conftest as s3_fixtures
from tests.reader.conftest import S3Server
from tests.reader.s3_tools import FAST, IAMServer, Link, allow, iam_server, s3_options
from tests.trainer.helpers import linear, weight_of

# the moto S3 server on loopback and a fresh bucket per test (tests/reader/conftest.py)
s3_server, s3_bucket, no_internet = s3_fixtures.s3_server, s3_fixtures.s3_bucket, s3_fixtures.no_internet


def committed(url: str, options: dict[str, Any]) -> list[int]:
    return [info.step for info in CheckpointManager(url, storage_options=options).list()]


# ------------------------------------------------------------------------------------ a server that dies


@pytest.fixture
def link(s3_server: S3Server, no_internet: None) -> Iterator[Link]:
    link = Link(s3_server.endpoint_url)
    try:
        yield link
    finally:
        link.close()


def down_before(monkeypatch: pytest.MonkeyPatch, link: Link, method: str, *, hits: int = 1) -> None:
    """Take ``link`` down just before the ``hits``-th call of ``Store.<method>`` (the store dies there)."""
    original = getattr(Store, method)
    calls = 0

    def wrapper(self: Store, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == hits:
            link.down()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Store, method, wrapper)


# ------------------------------------------------------------------------------------ server down: restore


def test_server_down_at_restore_is_no_fresh_start(s3_server: S3Server, s3_bucket: str, link: Link) -> None:
    url, via_link = f"s3://{s3_bucket}/job", s3_options(link.url, **FAST)
    for step in (1, 2):
        CheckpointManager(url, storage_options=via_link).save(step, model=linear(float(step)))
    link.down()
    model = linear(0.0)
    with pytest.raises(CheckpointError, match=rf"{url}.*could not be reached.*endpoint_url.*"
                                              "committed there are intact, and none was skipped"):
        CheckpointManager(url, storage_options=via_link).restore(model=model)
    with pytest.raises(CheckpointError, match="could not be reached"):
        CheckpointManager(url, storage_options=via_link).list()
    assert weight_of(model) == 0.0
    restored = CheckpointManager(url, storage_options=s3_server.storage_options).restore(model=model)
    assert restored is not None
    assert (restored.step, weight_of(model)) == (2, 2.0)


@pytest.mark.parametrize("method", ["read_commit", "_sizes", "read"])
def test_server_down_during_restore_skips_nothing(s3_server: S3Server, s3_bucket: str, link: Link,
                                                   monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The folder was listed, then the store dies while the newest checkpoint is read: the restore stops;
    it neither skips to the older checkpoint nor starts from scratch."""
    url, via_link = f"s3://{s3_bucket}/job", s3_options(link.url, **FAST)
    for step in (1, 2):
        CheckpointManager(url, storage_options=via_link).save(step, model=linear(float(step)))
    down_before(monkeypatch, link, method)
    model = linear(0.0)
    with pytest.raises(CheckpointError, match=rf"cannot reach '{url}'.*could not be reached"):
        CheckpointManager(url, storage_options=via_link).restore(model=model)  # a warning would fail too
    assert weight_of(model) == 0.0
    monkeypatch.undo()
    assert committed(url, s3_server.storage_options) == [1, 2]


def test_server_that_hangs_at_restore(s3_server: S3Server, s3_bucket: str, link: Link,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that takes the connection and never answers: botocore's ReadTimeoutError."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs retries a timeout 5 times, with pauses
    url = f"s3://{s3_bucket}/job"
    CheckpointManager(url, storage_options=s3_server.storage_options).save(1, model=linear(1.0))
    link.hang()
    options = s3_options(link.url, **{**FAST, "read_timeout": 1})
    with pytest.raises(CheckpointError, match=rf"cannot reach '{url}'.*could not be reached.*ReadTimeout"):
        CheckpointManager(url, storage_options=options).restore(model=linear(0.0))


# --------------------------------------------------------------------------------------- server down: save


def test_server_down_at_save_is_no_missing_bucket(s3_server: S3Server, s3_bucket: str, link: Link) -> None:
    """s3fs's bucket probe answers "no bucket" to a server that is down: the error must say what it is."""
    url = f"s3://{s3_bucket}/job"
    CheckpointManager(url, storage_options=s3_server.storage_options).save(1, model=linear(1.0))
    link.down()
    with pytest.raises(CheckpointError, match="could not be reached") as raised:
        CheckpointManager(url, storage_options=s3_options(link.url, **FAST)).save(2, model=linear(2.0))
    assert "does not create buckets" not in str(raised.value)
    assert committed(url, s3_server.storage_options) == [1]


@pytest.mark.parametrize(("method", "hits"), [("write", 1), ("write", 2), ("commit", 1)])
def test_server_down_during_save_keeps_the_previous_checkpoint(
        s3_server: S3Server, s3_bucket: str, link: Link, monkeypatch: pytest.MonkeyPatch, method: str,
        hits: int) -> None:
    url, via_link = f"s3://{s3_bucket}/job", s3_options(link.url, **FAST)
    ckpt = CheckpointManager(url, keep=1, storage_options=via_link)
    ckpt.save(1, model=linear(1.0))
    down_before(monkeypatch, link, method, hits=hits)
    with pytest.raises(CheckpointError, match=rf"cannot reach '{url}'.*could not be reached"):
        ckpt.save(2, model=linear(2.0))
    monkeypatch.undo()
    assert committed(url, s3_server.storage_options) == [1]
    model = linear(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = CheckpointManager(url, storage_options=s3_server.storage_options).restore(model=model)
    assert restored is not None
    assert (restored.step, weight_of(model)) == (1, 1.0)
    for w in caught:  # the folder of the failed save, where it has one: uncommitted, so skipped
        assert w.category is CheckpointWarning, w
        assert "step-000000002/COMMIT is missing" in str(w.message), w


def test_server_down_while_pruning_keeps_the_committed_save(s3_server: S3Server, s3_bucket: str, link: Link,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The new checkpoint is committed; an old one that cannot be deleted is a warning, not a failed save."""
    url, via_link = f"s3://{s3_bucket}/job", s3_options(link.url, **FAST)
    ckpt = CheckpointManager(url, keep=1, storage_options=via_link)
    ckpt.save(1, model=linear(1.0))
    down_before(monkeypatch, link, "remove")
    with pytest.warns(CheckpointWarning, match=r"could not delete old checkpoint .*step-000000001 .*could "
                                               "not be reached"):
        assert ckpt.save(2, model=linear(2.0)) == f"{url}/step-000000002"
    assert committed(url, s3_server.storage_options) == [1, 2]


def test_server_down_before_the_prune_lists_keeps_the_committed_save(
        s3_server: S3Server, s3_bucket: str, link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store dies between the commit and the listing of older checkpoints: the save still returns
    its URL (a regression: it raised though committed), nothing is deleted, and a warning says so."""
    url, via_link = f"s3://{s3_bucket}/job", s3_options(link.url, **FAST)
    ckpt = CheckpointManager(url, keep=1, storage_options=via_link)
    ckpt.save(1, model=linear(1.0))
    down_before(monkeypatch, link, "steps")  # the bucket was checked by the first save: this is the prune
    with pytest.warns(CheckpointWarning, match=r"step-000000002 is committed, but the older ones .* could "
                                               "not be listed .*kept"):
        assert ckpt.save(2, model=linear(2.0)) == f"{url}/step-000000002"
    assert committed(url, s3_server.storage_options) == [1, 2]


# ---------------------------------------------------------------------------------------- missing bucket


def test_missing_bucket_at_restore_is_no_fresh_start(s3_server: S3Server, s3_bucket: str) -> None:
    """The save after a fresh start would fail on it (no bucket is created): say so before training."""
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    before = {b["Name"] for b in fs.call_s3("list_buckets")["Buckets"]}
    url = f"s3://typo-{s3_bucket}/job"
    ckpt = CheckpointManager(url, storage_options=s3_server.storage_options)
    for call in (lambda: ckpt.restore(model=linear(0.0)), ckpt.list, ckpt.latest):
        with pytest.raises(CheckpointError, match=rf"restored from {url}: the bucket s3://typo-{s3_bucket} "
                                                  "does not exist.*does not create buckets"):
            call()
    assert {b["Name"] for b in fs.call_s3("list_buckets")["Buckets"]} == before
    fresh = CheckpointManager(f"s3://{s3_bucket}/fresh", storage_options=s3_server.storage_options)
    assert fresh.restore(model=linear(0.0)) is None  # an existing bucket with no checkpoint yet
    assert fresh.list() == []


# ----------------------------------------------------------------------------- credentials and permissions


@pytest.fixture(scope="module")
def iam(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[IAMServer]:
    """Users: ``admin`` (everything), ``nobody`` (nothing), ``no-list`` (objects, but no listing),
    ``list-only`` (listing, but no object), ``read-only`` (listing and reading). ``s3_server`` for its
    environment: no credentials or endpoints from outside the test."""

    def policies(bucket: str) -> dict[str, str | None]:
        objects, listing = f"arn:aws:s3:::{bucket}/*", f"arn:aws:s3:::{bucket}"
        return {
            "admin": allow((["*"], "*")),
            "nobody": None,
            "no-list": allow((["s3:GetObject", "s3:PutObject", "s3:DeleteObject"], objects)),
            "list-only": allow((["s3:ListBucket"], listing)),
            "read-only": allow((["s3:ListBucket"], listing), (["s3:GetObject"], objects)),
        }

    with iam_server(tmp_path_factory.mktemp("moto-iam"), policies) as server:
        CheckpointManager(f"s3://{server.bucket}/job", storage_options=server.options("admin")).save(
            1, model=linear(1.0))
        yield server


@pytest.mark.parametrize("user", ["unknown key", "nobody", "no-list"])
def test_refused_listing_is_no_missing_checkpoint(iam: IAMServer, no_internet: None, user: str) -> None:
    """Credentials the store rejects (an unknown key), or that may not list the folder: restore and list
    raise `DatasetPermissionError` (not None, not a bare PermissionError); a save says the same."""
    url = f"s3://{iam.bucket}/job"
    ckpt = CheckpointManager(url, storage_options=iam.options(user))
    refused = (rf"permission denied: cannot list '{iam.bucket}/job' .*these credentials may list the bucket "
               rf"under '{url}'")
    model = linear(0.0)
    with pytest.raises(DatasetPermissionError, match=refused):
        ckpt.restore(model=model)
    with pytest.raises(DatasetPermissionError, match=refused):
        ckpt.list()
    with pytest.raises(CheckpointError, match=refused) as raised:
        ckpt.save(2, model=linear(2.0))
    assert "does not create buckets" not in str(raised.value)
    assert weight_of(model) == 0.0
    assert committed(url, iam.options("admin")) == [1]


def test_unreadable_checkpoint_is_not_skipped(iam: IAMServer, no_internet: None) -> None:
    """Credentials that may list but not read: the newest checkpoint is not taken for a damaged one."""
    url = f"s3://{iam.bucket}/job"
    model = linear(0.0)
    with pytest.raises(DatasetPermissionError, match=rf"cannot read '{iam.bucket}/job/step-000000001/COMMIT'"
                                                     r".*not corrupt.*may read objects under"):
        CheckpointManager(url, storage_options=iam.options("list-only")).restore(model=model)
    assert weight_of(model) == 0.0


def test_read_only_credentials_restore_and_cannot_save(iam: IAMServer, no_internet: None) -> None:
    """moto authorizes HEAD of a bucket as s3:HeadBucket, which these credentials lack: the save must not
    report the bucket as missing, but the write that is refused."""
    url = f"s3://{iam.bucket}/job"
    ckpt = CheckpointManager(url, storage_options=iam.options("read-only"))
    model = linear(0.0)
    restored = ckpt.restore(model=model)
    assert restored is not None
    assert (restored.step, weight_of(model)) == (1, 1.0)
    with pytest.raises(CheckpointError, match=rf"permission denied: cannot write in '{iam.bucket}/job/"
                                              "step-000000002'.*may write objects under") as raised:
        ckpt.save(2, model=model)
    assert "does not create buckets" not in str(raised.value)
    assert committed(url, iam.options("admin")) == [1]


def test_no_credentials(s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch,
                        tmp_path: Path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    url = f"s3://{s3_bucket}/job"
    ckpt = CheckpointManager(url, storage_options=s3_options(s3_server.endpoint_url, key=None, **FAST))
    with pytest.raises(CheckpointError, match=rf"cannot reach '{url}': no credentials were found"):
        ckpt.restore(model=linear(0.0))
    with pytest.raises(CheckpointError, match="no credentials were found"):
        ckpt.save(1, model=linear(1.0))
