"""Atomic writes: a writer killed with SIGKILL at any point leaves the old dataset (or none), never half.

Each trial runs a real writer in a subprocess (``python -c WRITER``) over a dataset of many row groups
and part files, kills it, then opens what is on disk and runs the next write. Two kinds of kill points:

- random (seeded): after a random input batch plus a random delay, or at a random moment of the commit;
- exact: the child turns its own N-th ``os.replace`` (the moves of the parts and of the summary files,
  see `shardkit.dataset.write.commit`) into a SIGKILL, just before or just after it happens.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import shardkit
from shardkit.errors import DatasetError, DatasetNotFoundError, NotADatasetError

REPO = Path(__file__).resolve().parents[2]
BATCHES = 40
ROWS = 50  # per batch and per row group
FILE_SIZE = "4KiB"  # a few row groups per part file: many parts to move in the commit

# The child: writes BATCHES record batches of ROWS rows whose "tag" column says which write they belong
# to. It hands over batch i once it reads a line on stdin (so the test knows how far it can be), and
# prints "batch i" as it does. With KILL_AT_REPLACE=n it SIGKILLs itself at its n-th os.replace, before
# it (KILL_WHEN=before) or after it.
WRITER = r"""
import os, signal, sys
import numpy as np, pyarrow as pa
import shardkit

url, mode, tag, batches, rows, file_size = sys.argv[1:7]
tag, batches, rows = int(tag), int(batches), int(rows)
kill_at, kill_when = int(os.environ.get("KILL_AT_REPLACE", "0")), os.environ.get("KILL_WHEN", "before")
calls = 0
real_replace = os.replace

def replace(src, dst, **kw):
    global calls
    calls += 1
    if calls == kill_at and kill_when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst, **kw)
    if calls == kill_at and kill_when == "after":
        os.kill(os.getpid(), signal.SIGKILL)

os.replace = replace

Field = shardkit.Field
fields = [Field("id", "int64"), Field("tag", "int64"), Field("vec", "float32", (8,))]
if tag % 2 == 0:  # the writes alternate between two schemas, so a mix of old and new would show
    fields.append(shardkit.Field("extra", "str"))
schema = shardkit.Schema(fields)

def data():
    for i in range(batches):
        sys.stdin.readline()  # paced by the test: one line per batch (an empty one at EOF)
        print(f"batch {i}", flush=True)
        ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        vec = np.repeat(ids[:, None], 8, 1).astype(np.float32)
        cols = {"id": ids, "tag": np.full(rows, tag, np.int64),
                "vec": pa.FixedShapeTensorArray.from_numpy_ndarray(vec)}
        if "extra" in schema:
            cols["extra"] = pa.array([f"row {j}" for j in ids])
        yield pa.record_batch(cols)

shardkit.write_dataset(data(), url, schema=schema, mode=mode, row_group_size=rows, file_size=file_size,
                       progress=False)
print("done", flush=True)
"""


def start_writer(url: str, mode: str, tag: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, url, mode, str(tag), str(BATCHES), str(ROWS), FILE_SIZE],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    """Wait for the child (killing it if it outlives ``timeout``); returns its exit code and stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


PHASES = ["mid-stream", "commit", "mid-stream", "startup", "commit", "mid-stream"]


def kill_at_random(url: str, mode: str, tag: int, phase: str, rng: random.Random) -> tuple[int, str]:
    """Run a writer and SIGKILL it at a random moment of ``phase``; returns its exit code and stderr.

    ``startup``: before any data; ``mid-stream``: while it encodes and writes a random input batch, or
    waits for the next one (it is let through no further); ``commit``: a random moment after the last
    batch (finishing the last part, moving the parts in, writing the summary), or after it finished.
    """
    proc = start_writer(url, mode, tag)
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        if phase == "startup":
            time.sleep(rng.uniform(0, 0.5))
        else:
            last = rng.randrange(BATCHES) if phase == "mid-stream" else BATCHES - 1
            proc.stdin.write("go\n" * (last + 1))
            proc.stdin.flush()
            for line in proc.stdout:
                if line.strip() == f"batch {last}":
                    break
            time.sleep(rng.uniform(0, 0.01) if phase == "mid-stream" else rng.uniform(0, 0.3))
        proc.send_signal(signal.SIGKILL)
        return finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def write_in_process(url: str, mode: str, tag: int, batches: int = 6) -> shardkit.Dataset:
    """The same data as the child writes for ``tag``, written here (the old dataset, or the next write)."""
    import pyarrow as pa

    schema = shardkit.Schema(
        [
            shardkit.Field("id", "int64"),
            shardkit.Field("tag", "int64"),
            shardkit.Field("vec", "float32", (8,)),
            *([shardkit.Field("extra", "str")] if tag % 2 == 0 else []),
        ]
    )
    ids = np.arange(batches * ROWS, dtype=np.int64)
    cols: dict[str, Any] = {
        "id": ids,
        "tag": np.full(len(ids), tag, np.int64),
        "vec": np.repeat(ids[:, None], 8, 1).astype(np.float32),
    }
    if tag % 2 == 0:
        cols["extra"] = pa.array([f"row {j}" for j in ids])
    return shardkit.write_dataset(
        cols, url, schema=schema, mode=mode, row_group_size=ROWS, file_size=FILE_SIZE
    )


def state_of(url: str, helpers: SimpleNamespace) -> tuple[str, int | None]:
    """What a reader sees: ("none", None) or ("dataset", tag), checking that it is one whole write."""
    try:
        ds = shardkit.open_dataset(url)
    except (NotADatasetError, DatasetNotFoundError):
        return "none", None
    rows = helpers.read_all(ds)
    tags = set(rows["tag"])
    assert len(tags) == 1, f"rows of several writes in one dataset: tags {tags}"
    tag = int(tags.pop())
    expected_rows = BATCHES * ROWS if 2 <= tag < 100 else 6 * ROWS  # children write tags 2..99
    assert sorted(rows["id"]) == list(range(expected_rows)), f"write {tag} is incomplete"
    assert ("extra" in ds.schema) == (tag % 2 == 0)
    for i, vec in zip(rows["id"], rows["vec"], strict=True):
        assert (vec == i).all()
    return "dataset", tag


def garbage(url: str, ds: shardkit.Dataset | None, helpers: SimpleNamespace) -> set[str]:
    """Files under ``url`` that the dataset does not need: staging, unlisted parts, temporary summaries."""
    needed = {"_metadata", "_common_metadata", *(ds.files if ds is not None else [])}
    staging = {"_staging/"} if os.path.isdir(os.path.join(url, "_staging")) else set()
    return (helpers.files_under(url) - needed) | staging


def assert_next_write_cleans_up(url: str, mode: str, tag: int, helpers: SimpleNamespace) -> None:
    ds = write_in_process(url, mode, tag)
    assert garbage(url, ds, helpers) == set()
    assert state_of(url, helpers) == ("dataset", tag)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("first_write", [False, True], ids=["overwrite", "first-write"])
def test_sigkill_at_random_points(tmp_path: Path, helpers: SimpleNamespace, first_write: bool) -> None:
    rng = random.Random(20240607 + first_write)
    interrupted = left_garbage = 0
    for trial, phase in enumerate(PHASES):
        url = str(tmp_path / f"trial-{trial}")
        if not first_write:
            write_in_process(url, "error", tag=1)
        new_tag = 2 + trial
        code, err = kill_at_random(url, "overwrite" if not first_write else "error", new_tag, phase, rng)
        assert code in (-signal.SIGKILL, 0), err  # killed, or it finished first; never crashed

        state = state_of(url, helpers)
        if code == -signal.SIGKILL and state != ("dataset", new_tag):
            interrupted += 1
        if first_write:
            assert state in (("none", None), ("dataset", new_tag)), state
        else:
            assert state in (("dataset", 1), ("dataset", new_tag)), state
        old = shardkit.open_dataset(url) if state[0] == "dataset" else None
        left_garbage += bool(garbage(url, old, helpers))

        # the next write succeeds and removes what the killed one left
        next_mode = "error" if state == ("none", None) else "overwrite"
        assert_next_write_cleans_up(url, next_mode, tag=100 + trial, helpers=helpers)
    # the kills really landed inside writes: the mid-stream ones at least (they cannot get past a batch)
    assert interrupted >= PHASES.count("mid-stream")
    assert left_garbage >= PHASES.count("mid-stream")


def count_replaces(tmp_path: Path) -> int:
    """How many os.replace calls the child's write makes over an existing dataset (parts + 2 summaries)."""
    url = str(tmp_path / "count")
    write_in_process(url, "error", tag=1)
    proc = start_writer(url, "overwrite", tag=2)
    code, err = finish(proc)
    assert code == 0, err
    return len(shardkit.open_dataset(url).files) + 2


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("first_write", [False, True], ids=["overwrite", "first-write"])
def test_sigkill_at_each_step_of_the_commit(
    tmp_path: Path, helpers: SimpleNamespace, first_write: bool
) -> None:
    total = count_replaces(tmp_path)
    assert total > 5  # several parts to move
    parts = total - 2
    # (n-th os.replace, before/after): first part move, a middle one, the last one, the _metadata
    # replace (the commit point), and the _common_metadata replace
    points = [
        (1, "before"),
        (parts // 2, "after"),
        (parts, "after"),
        (parts + 1, "before"),
        (parts + 1, "after"),
        (parts + 2, "after"),
    ]
    for i, (n, when) in enumerate(points):
        url = str(tmp_path / f"point-{i}")
        if not first_write:
            write_in_process(url, "error", tag=1)
        proc = start_writer(
            url,
            "error" if first_write else "overwrite",
            2,
            env={"KILL_AT_REPLACE": str(n), "KILL_WHEN": when},
        )
        code, err = finish(proc)
        assert code == -signal.SIGKILL, err

        committed = n > parts + 1 or (n == parts + 1 and when == "after")
        state = state_of(url, helpers)
        if committed:
            assert state == ("dataset", 2), (n, when, state)
        elif first_write:
            assert state == ("none", None), (n, when, state)
        else:
            assert state == ("dataset", 1), (n, when, state)
        if not committed:
            old = shardkit.open_dataset(url) if state[0] == "dataset" else None
            assert garbage(url, old, helpers), "a write killed before its commit left nothing to collect?"
        next_mode = "error" if state == ("none", None) else "overwrite"
        assert_next_write_cleans_up(url, next_mode, tag=101, helpers=helpers)


# --- overlapping writers ----------------------------------------------------------------------------


def test_a_write_that_overlaps_a_running_one_fails_and_changes_nothing(
    tmp_path: Path, helpers: SimpleNamespace
) -> None:
    # two writes used to both report success, one leaving a _metadata that lists the other's deleted files
    url = str(tmp_path / "ds")
    write_in_process(url, "error", tag=1)
    proc = start_writer(url, "overwrite", 2)
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "batch 0"  # the child is writing: it holds the lock
        others = (lambda: write_in_process(url, "overwrite", 3), lambda: shardkit.write_summary(url))
        for overlapping in others:
            with pytest.raises(DatasetError, match=rf"{re.escape(url)}.*lock.*must not overlap"):
                overlapping()
            assert state_of(url, helpers) == ("dataset", 1)
        proc.stdin.write("go\n" * BATCHES)
        code, err = finish(proc)
        assert code == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert state_of(url, helpers) == ("dataset", 2)
    assert garbage(url, shardkit.open_dataset(url), helpers) == set()  # the lock file too


def test_a_write_overlapped_by_another_never_commits_a_missing_file(
    any_url: str, helpers: SimpleNamespace
) -> None:
    # the other write runs inside this one's input. Local folders: it finds the lock and fails. Other
    # stores have no lock: it commits and removes this write's staged parts as garbage, and this write
    # must then fail clearly (it used to raise a bare FileNotFoundError, or commit missing files)
    schema = shardkit.Schema([shardkit.Field("x", "int64")])

    def data() -> Any:
        for i in range(4):
            if i == 2:  # two part files of this write are staged by now
                shardkit.write_dataset({"x": np.full(5, -1)}, any_url, schema=schema, mode="overwrite")
            yield {"x": pa.array(np.arange(i * 10, i * 10 + 10))}

    with pytest.raises(DatasetError, match=rf"{re.escape(any_url)}.*must not overlap"):
        shardkit.write_dataset(data(), any_url, schema=schema, row_group_size=10, file_size="1B")
    if not helpers.exists(any_url):  # local: the other write failed, and so this one (the first)
        helpers.assert_nothing_written(any_url)
        return
    ds = shardkit.open_dataset(any_url)
    assert set(ds.files) <= helpers.files_under(any_url)
    assert helpers.read_all(ds)["x"] == [-1] * 5
