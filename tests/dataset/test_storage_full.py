"""A disk that fills during a write: a real tmpfs of 2 MiB, mounted by the test (root, as CI runs) and
unmounted also when it fails. The write raises `StorageFullError` naming the URL, the bytes staged and
the space left; the dataset already there is intact and reads as before."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import StorageFullError


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True, timeout=30)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def test_a_full_disk_is_named_and_the_dataset_there_is_intact(small_disk: Path) -> None:
    url = str(small_disk / "ds")
    shardkit.write_dataset({"id": np.arange(1000)}, url)
    noise = np.random.default_rng(0).normal(size=(4000, 256)).astype(np.float32)  # 4 MB: does not fit
    with pytest.raises(StorageFullError) as e:
        shardkit.write_dataset({"id": np.arange(4000), "x": list(noise)}, url, mode="overwrite",
                               row_group_size=200)
    text = str(e.value)
    assert repr(url) in text
    assert "is full" in text
    assert "bytes are left of" in text
    assert "staged" in text
    assert "Free space there" in text
    assert isinstance(e.value, OSError)
    with shardkit.make_reader(url, shuffle=False) as reader:
        assert [int(i) for b in reader for i in b["id"]] == list(range(1000))
    assert not list((small_disk / "ds" / "_staging").glob("*/*"))  # nothing staged is left behind
