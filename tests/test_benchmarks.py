"""Keeps benchmarks/ from rotting: the write benchmark's smoke run, and the benchmark data's contract."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks import data

ROOT = Path(__file__).resolve().parent.parent


def test_write_benchmark_quick_runs(tmp_path: Path) -> None:
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("*.json")}
    env = {**os.environ, "SHARDKIT_BENCH_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.write", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case in ("pyarrow", "shardkit-arrow", "shardkit-pandas", "shardkit-numpy-png"):
        assert f"| {case} " in proc.stdout, proc.stdout
    assert "failed" not in proc.stdout
    after = {p.name: p.stat().st_mtime_ns for p in results.glob("*.json")}
    assert after == before, "a --quick run must not touch the committed results"


def test_benchmark_rows_are_deterministic_and_prefix_stable() -> None:
    small = data.numpy_columns(10)
    big = data.numpy_columns(data.CHUNK_ROWS + 10)
    for name, values in small.items():
        np.testing.assert_array_equal(values, big[name][:10])
    assert data.ROW_BYTES == 3636
    assert small["image"].shape == (10, 32, 32, 3)
    assert small["image"].dtype == np.uint8
    assert all(len(t) == data.TEXT_CHARS for t in small["text"])
    assert big["id"].tolist() == list(range(data.CHUNK_ROWS + 10))
