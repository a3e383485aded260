"""Keeps the random-access benchmark (`benchmarks.take`, issue 40) from rotting: its smoke run for shardkit
alone (no peer venv), the shape of what it saves, and the page bytes it compares fetched bytes with."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

import shardkit
from benchmarks import data

ROOT = Path(__file__).resolve().parent.parent


def test_take_benchmark_quick_runs_shardkit_locally_and_through_the_relay(tmp_path: Path) -> None:
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("*.json")}
    out = tmp_path / "take.json"
    env = {**os.environ, "SHARDKIT_BENCH_DIR": str(tmp_path / "bench")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.take", "--quick", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed" not in proc.stdout
    for workload in ("rows", "images"):
        for where in ("local", "s3-0ms", "s3-50ms"):
            for kind in ("single", "batch"):
                for system in ("shardkit", "shardkit-map"):
                    row = rf"^\| {workload} +\| {where} +\| {kind} +\| {system} +\| +[\d,.]+ \|"
                    assert re.search(row, proc.stdout, re.M), (row, proc.stdout)
    for peer in ("hf", "mosaic", "litdata", "lance"):
        assert f"| {peer} " not in proc.stdout, proc.stdout  # shardkit alone: no peer venv needed

    doc = json.loads(out.read_text())
    assert (doc["benchmark"], doc["rounds"], doc["batch"]) == ("take", 1, 256)
    assert len(doc["runs"]) == 2 * 3 * 2 * 2
    for key, runs in doc["runs"].items():
        workload, where, system, kind = key.split("|")
        (run,) = runs
        assert run["lookups"] >= 1
        assert run["seconds"] > 0
        assert run["cpu_seconds"] >= 0
        assert run["rows"] == run["lookups"] * (1 if kind == "single" else 256)
        assert run["id_sum"] == run["expected_id_sum"], key  # the rows asked for, in the files' order
        assert run["page_bytes"] > 0
        if where == "local":
            assert "fetched_bytes" not in run
        else:
            assert run["fetched_bytes"] > 0, key  # counted by the relay
            assert run["requests"] > 0, key
    targets = {t["target"]: t for t in doc["targets"]}
    assert "rows, 50 ms store, batch: shardkit bytes fetched per row <= 2x its pages'" in targets
    assert all(t["result"] in ("PASS", "MISS") for t in doc["targets"])
    assert doc["table"].startswith("| workload ")
    after = {p.name: p.stat().st_mtime_ns for p in results.glob("*.json")}
    assert after == before, "a --quick run must not touch the committed results"


def test_page_bytes_of_every_row_are_the_column_chunks_and_of_a_row_its_own_pages(tmp_path: Path) -> None:
    from benchmarks.take import Pages

    path = tmp_path / "ds"
    shardkit.write_dataset(data.iter_batches(3000, "tensor"), path, schema=data.shardkit_schema("tensor"),
                           compression=data.COMPRESSION, progress=False, row_group_size=1000)
    pages = Pages(path)
    chunks = []  # per row group: the bytes of its column chunks
    for part in sorted(path.glob("*.parquet")):
        md = pq.read_metadata(part)
        chunks += [sum(md.row_group(g).column(j).total_compressed_size for j in range(md.num_columns))
                   for g in range(md.num_row_groups)]
    assert len(chunks) == 3
    assert pages.bytes_of(np.arange(3000)) == sum(chunks)
    one = pages.bytes_of(np.array([1500]))  # in the second row group: at most its chunks
    assert 0 < one <= chunks[1]
    assert pages.bytes_of(np.array([1500, 1500, 1501])) == pages.bytes_of(np.array([1500, 1501]))
    assert pages.bytes_of(np.array([0, 1500])) == pages.bytes_of(np.array([0])) + one
