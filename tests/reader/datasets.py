"""Small datasets for the reader tests (written with `shardkit.write_dataset`, many row groups) and helpers.

Import what a test needs from here (``from tests.reader.datasets import ...``); the fixtures below are
plain functions too, so subprocess workers (`read_shard_ids`) can use them.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

import shardkit
from shardkit import Field, ImageCodec, Schema

#: the repository's own copy of a dataset the real Petastorm wrote (tests/fixtures/petastorm/README.md)
PETASTORM_TENSORS = Path(__file__).resolve().parents[1] / "fixtures" / "petastorm" / "tensors"

ALL_CODECS = Schema([
    Field("id", "int64"),
    Field("label", "int32"),
    Field("score", "float64"),
    Field("flag", "bool"),
    Field("name", "str"),
    Field("blob", "bytes"),
    Field("vec", "float32", (4,)),
    Field("mat", "int16", (2, 3)),
    Field("var", "float32", (None,)),
    Field("var2", "int32", (None, 2)),
    Field("img", "uint8", (8, 8, 3), codec=ImageCodec("png")),
    Field("gray", "uint8", (8, 8), codec=ImageCodec("png")),
    Field("maybe", "float32", nullable=True),
    Field("maybe_vec", "float32", (3,), nullable=True),
    Field("note", "str", nullable=True),
])


def all_codecs_columns(n: int, seed: int = 0) -> dict[str, Any]:
    """``n`` rows for `ALL_CODECS` (nulls in every nullable field), in id order."""
    rng = np.random.default_rng(seed)
    return {
        "id": np.arange(n, dtype=np.int64),
        "label": (np.arange(n) % 5).astype(np.int32),
        "score": rng.random(n),
        "flag": np.arange(n) % 2 == 0,
        "name": [f"row-{i}" for i in range(n)],
        "blob": [bytes([i % 256]) * (i % 4) for i in range(n)],
        "vec": rng.random((n, 4)).astype(np.float32),
        "mat": rng.integers(-100, 100, (n, 2, 3)).astype(np.int16),
        "var": [np.arange(i % 4, dtype=np.float32) * i for i in range(n)],
        "var2": [np.full((i % 3, 2), i, dtype=np.int32) for i in range(n)],
        "img": rng.integers(0, 256, (n, 8, 8, 3)).astype(np.uint8),
        "gray": rng.integers(0, 256, (n, 8, 8)).astype(np.uint8),
        "maybe": [None if i % 7 == 0 else float(i) for i in range(n)],
        "maybe_vec": [None if i % 5 == 0 else np.full(3, i, np.float32) for i in range(n)],
        "note": [None if i % 3 == 0 else f"n{i}" for i in range(n)],
    }


def write_all_codecs(path: Path | str, n: int = 90, *, row_group_size: int = 7) -> tuple[str, dict[str, Any]]:
    """A dataset with every codec, ``row_group_size`` rows per row group, several files."""
    columns = all_codecs_columns(n)
    url = os.fspath(path)
    shardkit.write_dataset(columns, url, schema=ALL_CODECS, row_group_size=row_group_size, file_size=12_000)
    return url, columns


def ids_frame(n: int, seed: int = 0) -> pd.DataFrame:
    """``id`` 0..n-1 with a few small columns derived from it (``label = id % 10``)."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "id": np.arange(n, dtype=np.int64),
        "label": (np.arange(n) % 10).astype(np.int32),
        "group": np.array(["a", "b", "c"])[np.arange(n) % 3],
        "x": list(rng.random((n, 2)).astype(np.float32)),
    })


def write_ids(path: Path | str, n: int = 500, *, row_group_size: int = 23, file_size: int = 4_000) -> str:
    """A dataset of ``ids_frame(n)``: row groups of ``row_group_size`` rows over several files."""
    url = os.fspath(path)
    shardkit.write_dataset(ids_frame(n), url, row_group_size=row_group_size, file_size=file_size)
    return url


def write_layout(path: Path | str, rows_per_group: Sequence[int], *, files: int = 3) -> str:
    """A Parquet dataset whose row groups hold exactly ``rows_per_group`` rows (empty ones left out:
    Parquet writers skip them), over up to ``files`` files, with its ``_metadata`` summary; ``id`` runs
    0..n-1 in file order."""
    sizes = [int(s) for s in rows_per_group if s]
    if not sizes:
        raise ValueError("an empty layout")
    folder = Path(path)
    folder.mkdir(parents=True)
    per_file = -(-len(sizes) // files)
    start = 0
    for f in range(0, len(sizes), per_file):
        with pq.ParquetWriter(folder / f"part-{f:05d}.parquet", pa.schema([("id", pa.int64())])) as writer:
            for size in sizes[f : f + per_file]:
                writer.write_table(pa.table({"id": np.arange(start, start + size, dtype=np.int64)}),
                                   row_group_size=size)
                start += size
    shardkit.write_summary(os.fspath(folder))
    return os.fspath(folder)


def ids_of(batches: Iterable[dict[str, np.ndarray]]) -> np.ndarray:
    """The ``id`` column of every batch, concatenated."""
    parts = [np.asarray(b["id"]) for b in batches]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def assert_exactly_once(ids: Iterable[int], n: int) -> None:
    """Every id of 0..n-1 exactly once (names what is missing or repeated)."""
    counts = Counter(int(i) for i in ids)
    missing = sorted(set(range(n)) - set(counts))
    repeated = sorted(i for i, c in counts.items() if c > 1)
    extra = sorted(set(counts) - set(range(n)))
    what = (f"{len(missing)} missing (first {missing[:10]}), {len(repeated)} repeated (first "
            f"{repeated[:10]}), unknown {extra[:10]}")
    assert not missing, what
    assert not repeated, what
    assert not extra, what


def read_shard_ids(url: str, shard: int | None, num_shards: int | None, batch_size: int,
                   remainder: str, env: dict[str, str] | None = None) -> tuple[list[int], int]:
    """Read one shard's epoch in this process: (ids, number of batches). Used by subprocess workers."""
    if env:
        os.environ.update(env)
    kwargs: dict[str, Any] = {"shard": shard, "batch_size": batch_size, "remainder": remainder, "seed": 3}
    if num_shards is not None:
        kwargs["num_shards"] = num_shards
    with shardkit.make_reader(url, **kwargs) as reader:
        batches = list(reader)
        assert len(batches) == len(reader)
    return [int(i) for i in ids_of(batches)], len(batches)


def _probe(x: int, j: int, n: int) -> int:
    """splitmix64 of (x, j) mod n, in Python ints (the reader's `shardkit.reader._lost.probe`, in numpy)."""
    mask = 2**64 - 1
    z = (x * 0x9E3779B97F4A7C15 + j * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) % n


def substitutes(pi_ids: Sequence[int] | np.ndarray, lost: Iterable[int]) -> dict[int, int]:
    """The id that takes each lost id's place with ``on_error="skip"``: ``pi_ids`` are an epoch's ids in
    its order (an intact reader's, one shard), ``lost`` the ids that cannot be read. The rule, computed
    independently of the reader: the id half an epoch further (cyclically) if readable, else the first
    readable of 31 places hashed from the lost one's place, else the first readable after the last."""
    ids = np.asarray(pi_ids)
    n = len(ids)
    bad = np.isin(ids, list(lost))
    if bad.all():
        raise AssertionError("no readable id")
    out = {}
    for x in np.flatnonzero(bad).tolist():
        j = (x + n // 2) % n
        for k in range(1, 32):
            if not bad[j]:
                break
            j = _probe(x, k, n)
        while bad[j]:
            j = (j + 1) % n
        out[int(ids[x])] = int(ids[j])
    return out


def with_substitutes(ids: Iterable[int], table: dict[int, int]) -> list[int]:
    """``ids`` with each lost one replaced by its substitute (see `substitutes`)."""
    return [table.get(int(i), int(i)) for i in ids]


def corrupt_ids(url: str, groups: list[int]) -> set[int]:
    """Overwrite the first page header of the ``id`` column of each of ``groups`` (index order); the
    ``label`` column stays readable, so a filter on it still counts these rows. Returns their ids."""
    ds = shardkit.open_dataset(url)
    lost: set[int] = set()
    for k in groups:
        rg = ds.row_groups[k]
        path = os.path.join(url, rg.file)
        chunk = pq.read_metadata(path).row_group(rg.index).column(0)
        with open(path, "r+b") as f:
            f.seek(chunk.dictionary_page_offset or chunk.data_page_offset)
            f.write(b"\xff" * 32)
        first = int(ds.rows_per_group[:k].sum())
        lost.update(range(first, first + rg.num_rows))
    return lost
