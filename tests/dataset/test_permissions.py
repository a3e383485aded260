"""Files and folders this user may not read: `DatasetPermissionError` naming them and the fix, never
"corrupt, remove it", and never skipped by ``on_error="skip"``.

Real permission errors: the reads run in a child process as a user the chmod-ed files refuse (as root,
who may read anything, uid 65534 through ``setpriv``; otherwise this user, the files' owner).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardkit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "petastorm"

# Opens or reads each (url, reader options) and prints what happened, as JSON.
_READ = r"""
import json, sys, warnings
import shardkit
warnings.simplefilter("ignore")
out = []
for url, options in json.loads(sys.argv[1]):
    try:
        if options is None:
            out.append({"rows": shardkit.open_dataset(url).num_rows})
            continue
        with shardkit.make_reader(url, shuffle=False, **options) as reader:
            out.append({"rows": sum(len(b["id"]) for b in reader), "stats": reader.stats})
    except Exception as e:
        out.append({"type": type(e).__name__, "permission": isinstance(e, PermissionError),
                    "corrupt": isinstance(e, shardkit.errors.CorruptDatasetError), "message": str(e)})
print(json.dumps(out))
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder the other user can reach (pytest's ``tmp_path`` lies under a folder only we may enter)."""
    path = Path(tempfile.mkdtemp(prefix="shardkit-perm-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for folder, dirs, files in os.walk(path):
            for name in dirs + files:
                os.chmod(os.path.join(folder, name), 0o755, follow_symlinks=False)
        shutil.rmtree(path)


def _read_as_other_user(cases: list[tuple[str, dict[str, Any] | None]], home: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-c", _READ, json.dumps(cases)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root (who may read anything) this needs setpriv to read as another user")
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "HOME": str(home)})
    assert done.returncode == 0, done.stderr
    results: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def _check_permission_error(result: dict[str, Any], path: str) -> None:
    assert result.get("type") == "DatasetPermissionError", result
    assert result["permission"], result
    assert not result["corrupt"], result
    message = result["message"]
    assert f"'{path}'" in message, message
    for words in ("permission denied", "mode", "chmod"):
        assert words in message, message
    assert "remove" not in message.lower(), message
    assert "truncated" not in message, message


def test_an_unreadable_data_file_is_a_permission_error_even_with_on_error_skip(shared_dir: Path) -> None:
    url = str(shared_dir / "sk")
    ds = shardkit.write_dataset(pd.DataFrame({"id": np.arange(100)}), url, row_group_size=50, file_size=1)
    assert len(ds.files) == 2
    blocked = f"{url}/{ds.files[0]}"
    os.chmod(blocked, 0)
    results = _read_as_other_user([(url, {}), (url, {"on_error": "skip"})], shared_dir)
    for result in results:
        _check_permission_error(result, blocked)
        assert "----------" in result["message"], result  # the file's mode, as ls -l shows it


def test_an_unreadable_petastorm_schema_is_a_permission_error(shared_dir: Path) -> None:
    url = str(shared_dir / "petastorm")
    shutil.copytree(FIXTURES / "tensors", url)
    os.chmod(f"{url}/_common_metadata", 0)
    [result] = _read_as_other_user([(url, None)], shared_dir)
    _check_permission_error(result, f"{url}/_common_metadata")


def test_a_folder_that_cannot_be_listed_is_a_permission_error_not_an_empty_one(shared_dir: Path) -> None:
    root, nested = shared_dir / "plain", shared_dir / "nested"
    for folder in (root, nested / "more"):
        folder.mkdir(parents=True)
        pq.write_table(pa.table({"id": np.arange(10)}), folder / "part-0.parquet")
    os.chmod(root, 0o311)  # may enter, may not list
    os.chmod(nested / "more", 0o700)  # a subfolder: fsspec's listing leaves it out, and its rows with it
    plain, sub = _read_as_other_user([(str(root), None), (str(nested), None)], shared_dir)
    _check_permission_error(plain, str(root))
    assert "cannot list" in plain["message"], plain
    assert "holds no Parquet" not in plain["message"], plain
    _check_permission_error(sub, str(nested / "more"))
    assert "cannot list" in sub["message"], sub
