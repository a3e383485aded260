"""The HF ``datasets`` cases of the read benchmark; they run in HF's own venv (``.bench/hf-venv``).

``datasets`` pins fsspec (and its own pyarrow floor), so it gets a venv of its own, with the same
pyarrow and numpy as shardkit's (see `benchmarks.read.ensure_hf_venv`). This module imports nothing
outside the standard library at import time, so ``benchmarks.common``'s child runner can call it there:
    run_case("benchmarks.read_hf:case_iter", {...}, python=HF_PYTHON)
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing here needs the Hub; never wait on it
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def case_build(parquet: str, out: str) -> dict[str, Any]:
    """HF's map-style first pass: ``Dataset.from_parquet`` builds its Arrow cache; saved to ``out``."""
    import datasets

    cache = out + ".hf-cache"
    started = time.perf_counter()
    ds = datasets.Dataset.from_parquet(parquet, cache_dir=cache)
    built = time.perf_counter() - started
    ds.save_to_disk(out)
    shutil.rmtree(cache, ignore_errors=True)
    return {"rows": ds.num_rows, "build_seconds": built, "features": str(ds.features)}


def case_iter(path: str, batch_size: int = 256, keep_dtype: bool = False) -> dict[str, Any]:
    """One pass over the saved (memory-mapped) Arrow cache, ``.with_format("numpy")``, in batches.

    ``keep_dtype=False`` is what a user gets: HF's numpy formatter widens every integer column to
    int64 (uint8 pixels become 8 bytes each). ``keep_dtype=True`` passes ``dtype=None`` through to
    ``np.asarray``, which keeps uint8/int32 and is HF's fastest numpy path.
    """
    import datasets
    import numpy as np

    from benchmarks.common import phase_peak_rss, tree_cpu_seconds
    from benchmarks.petastorm_side._consume import Consumer

    load = os.getloadavg()[0]
    started, cpu0 = time.perf_counter(), tree_cpu_seconds()
    ds = datasets.load_from_disk(path)
    ds = ds.with_format("numpy", dtype=None) if keep_dtype else ds.with_format("numpy")
    rows = id_sum = batches = 0
    first = None
    dtypes: dict[str, str] = {}
    consumer = Consumer()
    for batch in ds.iter(batch_size=batch_size):
        consumer.consume(batch)
        if first is None:
            first = time.perf_counter() - started
            dtypes = {k: f"{v.dtype}{list(v.shape[1:])}" for k, v in batch.items()}
        ids = batch["id"]
        rows += len(ids)
        id_sum += int(np.sum(ids))
        batches += 1
    seconds = time.perf_counter() - started
    cpu = tree_cpu_seconds() - cpu0

    return {"rows": rows, "id_sum": id_sum, "batches": batches, "seconds": seconds,
            "first_batch_seconds": first if first is not None else seconds, "rss": phase_peak_rss(),
            "cpu_seconds": cpu,
            "dtypes": str(dtypes), "datasets_version": datasets.__version__,
            "load_1m": max(load, os.getloadavg()[0])}
