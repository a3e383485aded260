"""Delta Lake and Iceberg tables: reading a table against the same files as a plain folder, against Ray
Data's own readers of the table (where installed), and the time to open (plan) tables of many files.

    python -m benchmarks.tables            # the full run; results in benchmarks/results/tables-<machine>.json
    python -m benchmarks.tables --quick    # small sizes, nothing saved (a smoke run)
    python -m benchmarks.tables --no-ray   # without Ray Data's readers

Cases, in one run, each repeated (median):

- ``read``: one epoch of one reader (unshuffled and shuffled) over a Delta table and an Iceberg table of
  the same rows, each against a plain folder holding hard links to the very files of its snapshot (so
  the bytes read are the same); the ratio table/folder is the price of reading a table (target
  >= 0.95x).
- ``ray``: ``ray.data.read_delta`` / ``ray.data.read_iceberg`` iterated in numpy batches, against
  shardkit's reader of the same table (ratio printed); skipped when Ray Data cannot run here.
- ``plan``: ``open_dataset`` of a table of 1,000 and 10,000 files (every footer read: cold, and again
  with the footers cached in the process) plus ``make_reader``'s plan.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import SCRATCH, machine_id, machine_info, save_results, table, tree_cpu_seconds

VECTOR = 16  # float32 values per row besides the id: rows of 72 bytes


def rows(start: int, n: int) -> pa.Table:
    ids = np.arange(start, start + n, dtype=np.int64)
    vec = np.random.default_rng(start).random((n, VECTOR), dtype=np.float32)
    return pa.table({"id": ids, "vec": pa.FixedSizeListArray.from_arrays(vec.reshape(-1), VECTOR)})


def build_tables(root: Path, total: int, files: int) -> dict[str, str]:
    """A Delta table, an Iceberg table (SQL catalog on sqlite) and a plain folder of the Delta files."""
    from deltalake import DeltaTable, write_deltalake
    from pyiceberg.catalog.sql import SqlCatalog

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    per = total // files
    delta = root / "delta"
    write_deltalake(str(delta), rows(0, per))
    write_deltalake(str(delta), rows(0, per), mode="overwrite")  # an older snapshot's file stays there
    for k in range(1, files):
        write_deltalake(str(delta), rows(k * per, per), mode="append")
    catalog = SqlCatalog("bench", uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}/wh")
    catalog.create_namespace("ns")
    ice = catalog.create_table("ns.t", schema=rows(0, 1).schema)
    for k in range(files):
        ice.append(rows(k * per, per))
    urls = {"delta": str(delta), "iceberg": str(root / "wh" / "ns" / "t")}
    snapshots = {"delta": DeltaTable(str(delta)).file_uris(),
                 "iceberg": [t.file.file_path for t in catalog.load_table("ns.t").scan().plan_files()]}
    for fmt, uris in snapshots.items():  # each table's own files (the writers compress differently)
        plain = root / f"{fmt}-folder"
        plain.mkdir()
        for uri in uris:
            os.link(uri.removeprefix("file://"), plain / Path(uri).name)
        urls[f"{fmt} as folder"] = str(plain)
    return urls


def read_epoch(url: str, *, shuffle: bool) -> dict[str, float]:
    import shardkit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardkit.SummaryMissingWarning)
        started, cpu = time.perf_counter(), tree_cpu_seconds()
        n = 0
        with shardkit.make_reader(url, batch_size=1024, shuffle=shuffle, seed=1) as reader:
            for batch in reader:
                n += len(batch["id"])
        return _speed(n, time.perf_counter() - started, tree_cpu_seconds() - cpu)


def _speed(rows: int, seconds: float, cpu_seconds: float) -> dict[str, float]:
    """Rows, wall and CPU seconds, rows/s and rows per CPU-second (steadier on a shared machine)."""
    return {"rows": rows, "seconds": seconds, "cpu_seconds": cpu_seconds, "rows_per_s": rows / seconds,
            "rows_per_cpu_s": rows / max(cpu_seconds, 1e-9)}


def ray_epoch(fmt: str, url: str) -> dict[str, float]:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    started, cpu = time.perf_counter(), tree_cpu_seconds(children=True)  # Ray's workers are processes
    if fmt == "delta":
        ds = ray.data.read_delta(url)
    else:
        ds = ray.data.read_iceberg(table_identifier="ns.t", catalog_kwargs={
            "name": "bench", "type": "sql", "uri": f"sqlite:///{Path(url).parents[2]}/catalog.db",
            "warehouse": f"file://{Path(url).parents[2]}/wh"})
    n = 0
    for batch in ds.iter_batches(batch_size=1024, batch_format="numpy"):
        n += len(batch["id"])
    return _speed(n, time.perf_counter() - started, tree_cpu_seconds(children=True) - cpu)


def build_many_files(root: Path, files: int) -> dict[str, str]:
    """A Delta table and an Iceberg table of ``files`` one-row-group files each (written in one commit)."""
    from deltalake import write_deltalake
    from pyiceberg.catalog.sql import SqlCatalog

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    data = rows(0, files * 10).append_column("part", pa.array(np.repeat(np.arange(files), 10)))
    delta = root / "delta"
    write_deltalake(str(delta), data, partition_by=["part"])  # one file per partition
    loose = root / "loose"
    loose.mkdir()
    paths = []
    for k in range(files):
        path = loose / f"part-{k:05d}.parquet"
        pq.write_table(rows(k * 10, 10), path)
        paths.append(f"file://{path}")
    catalog = SqlCatalog("plan", uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}/wh")
    catalog.create_namespace("ns")
    ice = catalog.create_table("ns.t", schema=rows(0, 1).schema, location=f"file://{loose}")
    ice.add_files(paths)
    return {"delta": str(delta), "iceberg": str(loose)}


def plan_time(url: str) -> dict[str, float]:
    import shardkit
    from shardkit.dataset.tables import _files

    _files._cache.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardkit.errors.PartitionColumnsWarning)
        started = time.perf_counter()
        ds = shardkit.open_dataset(url)
        cold = time.perf_counter() - started
        started = time.perf_counter()
        ds = shardkit.open_dataset(url)
        warm = time.perf_counter() - started
        started = time.perf_counter()
        with shardkit.make_reader(ds, shard=0, num_shards=8, seed=1) as reader:
            len(reader)
        plan = time.perf_counter() - started
        _files._cache.clear()
        started = time.perf_counter()  # a filter on 1% of the ids: the other files pruned by the log
        filtered = shardkit.open_dataset(url, filter=[("id", "<", ds.num_rows // 100)])
        pruned = time.perf_counter() - started
    return {"files": len(ds.files), "open_cold_s": cold, "open_warm_s": warm, "plan_s": plan,
            "open_filtered_cold_s": pruned, "files_filtered": len(filtered.files)}


def median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; nothing saved")
    parser.add_argument("--no-ray", action="store_true", help="leave Ray Data's readers out")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    total, files, many = (20_000, 4, [100, 300]) if args.quick else (2_000_000, 20, [1_000, 10_000])
    repeat = 1 if args.quick else args.repeat
    info = machine_info()
    load = os.getloadavg()[0]  # other work on the machine skews a run: keep the evidence with it
    print(f"tables benchmark on {machine_id(info)} ({info['cpu_model']}): {total:,} rows in {files} files; "
          f"load {load:.2f}")
    urls = build_tables(SCRATCH / "tables", total, files)
    reads: dict[str, dict[str, float]] = {}
    for url in urls.values():  # untimed: imports (deltalake, pyiceberg), page cache, footer cache
        read_epoch(url, shuffle=False)
    for shuffle in (False, True):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
        for _ in range(repeat):  # interleaved, so that drift on a shared machine hits every case alike
            for name, url in urls.items():
                runs[name].append(read_epoch(url, shuffle=shuffle))
        for name in urls:
            reads[f"{name}{' shuffled' if shuffle else ''}"] = median(runs[name])
    rows_out = []
    for name, r in reads.items():
        fmt, shuffled = name.split(" ")[0], " shuffled" if "shuffled" in name else ""
        ratio = r["rows_per_s"] / reads[f"{fmt} as folder{shuffled}"]["rows_per_s"]
        cpu_ratio = r["rows_per_cpu_s"] / reads[f"{fmt} as folder{shuffled}"]["rows_per_cpu_s"]
        rows_out.append([name, f"{r['rows']:,.0f}", f"{r['rows_per_s']:,.0f}", f"{r['rows_per_cpu_s']:,.0f}",
                         f"{ratio:.2f}x", f"{cpu_ratio:.2f}x"])
    print(table(["case", "rows", "rows/s", "rows/CPU-s", "vs folder", "vs folder (CPU)"], rows_out))
    ray_results: dict[str, Any] = {}
    if not args.no_ray:
        for fmt in ("delta", "iceberg"):
            try:
                ray_results[fmt] = median([ray_epoch(fmt, urls[fmt]) for _ in range(repeat)])
            except Exception as e:  # Ray Data absent, or its reader of this format: say so, go on
                ray_results[fmt] = {"error": f"{type(e).__name__}: {e}"[:300]}
        ray_rows = []
        for fmt, r in ray_results.items():
            if "error" in r:
                ray_rows.append([fmt, "-", "-", "-", r["error"][:60]])
            else:
                ratio = reads[fmt]["rows_per_s"] / r["rows_per_s"]
                cpu_ratio = reads[fmt]["rows_per_cpu_s"] / r["rows_per_cpu_s"]
                ray_rows.append([fmt, f"{r['rows']:,.0f}", f"{r['rows_per_s']:,.0f}",
                                 f"{reads[fmt]['rows_per_s']:,.0f}", f"{ratio:.2f}x", f"{cpu_ratio:.2f}x"])
        print(table(["table", "Ray Data rows", "Ray Data rows/s", "shardkit rows/s", "shardkit vs Ray",
                     "per CPU-s"], ray_rows))
    plans: dict[str, dict[str, float]] = {}
    for n in many:
        built = build_many_files(SCRATCH / f"plan-{n}", n)
        for fmt, url in built.items():
            plans[f"{fmt} {n:,} files"] = median([plan_time(url) for _ in range(repeat)])
    print(table(["table", "files", "open (cold)", "open (footers cached)", "plan", "open, 1% filter (cold)"],
                [[k, f"{v['files']:,.0f}", f"{v['open_cold_s']:.2f} s", f"{v['open_warm_s']:.2f} s",
                  f"{v['plan_s'] * 1000:.0f} ms",
                  f"{v['open_filtered_cold_s']:.2f} s ({v['files_filtered']:,.0f} files)"]
                 for k, v in plans.items()]))
    if not args.quick:
        from importlib.metadata import version

        libraries = {name: version(name) for name in ("deltalake", "pyiceberg", "ray")}
        path = save_results("tables", {"rows": total, "files": files, "libraries": libraries, "read": reads,
                                       "ray": ray_results, "plan": plans,
                                       "load_1m": max(load, os.getloadavg()[0])})
        print(f"saved {path}")


if __name__ == "__main__":
    main()
