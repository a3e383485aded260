"""`Reader.profile`: where a reader's time went, and the stage it names as the limit, on planted cases:
a slow transform, a slow training step (the consumer), a slow store (a relay that holds each response
back), and images decoded per batch. The consumer's side adds up to the iteration by construction."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from tests.reader.conftest import S3Server


def _ids(path: Path, rows: int = 64, row_group_size: int = 16) -> str:
    url = str(path / "ids")
    rng = np.random.default_rng(0)
    x = list(rng.standard_normal((rows, 8)).astype(np.float32))
    shardkit.write_dataset({"id": np.arange(rows), "x": x}, url, row_group_size=row_group_size)
    return url


def _adds_up(b: dict[str, Any]) -> None:
    assert b["consumer_seconds"] + b["waited_seconds"] == pytest.approx(b["elapsed_seconds"], abs=1e-6)
    parts = b["wait_read_seconds"] + b["wait_stage_seconds"] + b["wait_assemble_seconds"]
    assert parts == pytest.approx(b["waited_seconds"], abs=1e-6)


def _slow_transform(sample: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.005)
    return sample


def test_a_reader_that_never_ran_profiles_as_zeros(tmp_path: Path) -> None:
    with shardkit.make_reader(_ids(tmp_path), batch_size=8, seed=0) as reader:
        b = reader.profile(as_dict=True)
        assert b["batches"] == 0
        assert b["elapsed_seconds"] == b["waited_seconds"] == b["read_busy_seconds"] == 0.0
        assert b["limited_by"] == "nothing yet"
        assert "0 batches" in reader.profile()


def test_a_slow_transform_is_named(tmp_path: Path) -> None:
    with shardkit.make_reader(_ids(tmp_path), batch_size=8, seed=0, transform=_slow_transform) as reader:
        assert len(list(reader)) == 8
        b = reader.profile(as_dict=True)
    _adds_up(b)
    assert b["limited_by"] == "the transform"
    assert b["transform_busy_seconds"] >= 64 * 0.005
    assert "transform_workers=" in b["advice"]


def test_a_slow_training_step_is_named(tmp_path: Path) -> None:
    with shardkit.make_reader(_ids(tmp_path), batch_size=8, seed=0) as reader:
        for _ in reader:
            time.sleep(0.05)  # the training step
        b = reader.profile(as_dict=True)
        text = reader.profile()
    _adds_up(b)
    assert b["consumer_seconds"] >= 7 * 0.05  # the steps between the first batch and the last
    assert b["limited_by"] == "the consumer"
    assert "limited by: the consumer" in text


def test_images_decoded_per_batch_are_named(tmp_path: Path) -> None:
    from tests.reader.test_image_pipeline import jpeg_dataset

    url, _ = jpeg_dataset("jpeg", 60)
    with shardkit.make_reader(url, batch_size=8, seed=0) as reader:
        list(reader)
        b = reader.profile(as_dict=True)
    _adds_up(b)
    assert b["decode_busy_seconds"] > 0
    if b["limited_by"] != "the consumer":  # the whole read may be quicker than a tenth of the loop
        assert b["limited_by"] in ("image decoding", "reading (fetch and Parquet)", "batch assembly")


@pytest.mark.timeout(180)
def test_a_slow_store_is_named(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    from benchmarks.relay import Relay

    url, options = f"s3://{s3_bucket}/profile", s3_server.storage_options
    rng = np.random.default_rng(0)
    x = list(rng.standard_normal((256, 64)).astype(np.float32))
    shardkit.write_dataset({"id": np.arange(256), "x": x}, url, storage_options=options, row_group_size=32)
    with Relay(s3_server.endpoint_url, delay=0.05) as relay:  # 50 ms before each response
        slow = {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": relay.url}}
        with shardkit.make_reader(url, batch_size=16, seed=0, storage_options=slow, workers=1,
                                  prefetch=1) as reader:
            assert sum(len(b["id"]) for b in reader) == 256
            b = reader.profile(as_dict=True)
    _adds_up(b)
    assert b["limited_by"] == "reading (fetch and Parquet)"
    assert b["wait_read_seconds"] >= 0.05  # the first row group's response, at least
    assert 0 < b["read_checksum_seconds"] < b["read_arrow_seconds"]  # fetched pages, checked as decoded
    assert "prefetch=" in b["advice"]


def test_page_checksums_are_shown_as_their_share_of_reading(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import shardkit.dataset._dataset as opened

    url = _ids(tmp_path, rows=2048, row_group_size=256)
    with shardkit.make_reader(url, batch_size=64, seed=0) as reader:
        assert len(list(reader)) == 32
        b = reader.profile(as_dict=True)
        text = reader.profile()
    assert 0 < b["read_checksum_seconds"] <= b["read_arrow_seconds"]
    assert re.search(r"^      of which page checksums +\d+\.\d\d s$", text, re.M), text
    monkeypatch.setattr(opened, "VERIFY_PAGE_CHECKSUMS", False)  # nothing checked: nothing counted
    with shardkit.make_reader(url, batch_size=64, seed=0) as reader:
        list(reader)
        assert reader.profile(as_dict=True)["read_checksum_seconds"] == 0


def test_a_mixture_profiles_its_sources_reading(tmp_path: Path) -> None:
    a, b = _ids(tmp_path / "a"), _ids(tmp_path / "b")
    with shardkit.make_reader({"a": a, "b": b}, batch_size=8, seed=0) as reader:
        batches = len(list(reader))
        profile = reader.profile(as_dict=True)
        text = reader.profile()
    _adds_up(profile)
    assert profile["batches"] == batches > 0
    assert profile["read_tasks"] > 0  # the sources' reading, summed
    assert "shardkit mixture of a, b" in text
