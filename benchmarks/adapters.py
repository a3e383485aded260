"""ADAPTERS benchmark: shardkit's torch, tf.data and JAX adapters vs the plain reader and Petastorm's.

Every case runs in a fresh process (see `benchmarks.common`) on the ANCHORS rows of `benchmarks.data`
(the shardkit tensor dataset; Petastorm reads the same rows and row groups from the plain ``list<>``
copy that `benchmarks.read` makes, since it drops ``fixed_size_list`` columns), page cache warm. The clock
starts before the reader/loader is made (imports not counted) and stops after the last batch. Each batch's
image and features are copied once into a preallocated buffer (`_consume.Consumer`, what a collate does),
and every case sums ``id`` (an epoch that ends early is seen). Each process reads ``--epochs`` epochs
(default 3: a short training run; the start of a process, TensorFlow's or DataLoader workers', counts
once, and a fresh process's own noise on this machine, up to 2x in a single 0.3-0.6 s epoch, averages
out). Peak RSS is the measured process's VmHWM, plus the peak of live DataLoader workers. Cases run
round-robin, ``--repeat`` times each; medians kept.

Cases (batch 256, default shuffle, CPU):
    reader             shardkit.make_reader                                   (the reference, 5 columns)
    reader-4           the same, 4 columns (no text): the reference of the 4-column cases
    torch-loader       shardkit.torch.make_loader (host tensors)
    torch-loader-4     the same, 4 columns: Petastorm's torch loaders cannot take strings
    torch-dataloader   ShardkitIterableDataset + torch DataLoader(num_workers=2, batch_size=None)
    tf-dataset         shardkit.tf.make_dataset (tf.data from a generator with the schema's spec)
    jax-loader         shardkit.jax.make_loader (jax.Array on the CPU device, prefetch 2; jax_enable_x64
                       on, so ``id`` stays int64 as in the other cases; Petastorm has no JAX adapter)
    pst-batched        Petastorm BatchedDataLoader(make_batch_reader(thread x2), 256), 4 columns
    pst-loader         Petastorm DataLoader(make_batch_reader(thread x2), 256), 4 columns
    pst-tf             make_petastorm_dataset(make_batch_reader(thread x2)).unbatch().batch(256)

Every case is compared with the reader reading the same columns ("vs reader"), and with the Petastorm
case that does the same thing ("vs Petastorm").

Usage (from the repository root):
    python -m benchmarks.adapters              # 200,000 rows x 3 epochs, Petastorm included, saves results/
    python -m benchmarks.adapters --quick      # 4,000 rows, shardkit cases once, no Petastorm, not saved
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from benchmarks import data
from benchmarks.common import (
    descendants_peak_rss,
    fmt_bytes,
    machine_id,
    machine_info,
    phase_peak_rss,
    round_robin,
    run_case,
    save_results,
    table,
    tree_cpu_seconds,
    write_json,
)
from benchmarks.petastorm_env import SIDE, ensure_venv, run_in_petastorm
from benchmarks.petastorm_side._consume import drain

BATCH = 256
READER_RATIO = 0.9  # ANCHORS: an adapter >= 0.9x the plain reader
PETASTORM_RATIO = 2.0  # ANCHORS: >= 2x Petastorm's BatchedDataLoader (and its other adapters here)
SHARDKIT = ["reader", "reader-4", "torch-loader", "torch-loader-4", "torch-dataloader", "tf-dataset",
            "jax-loader"]
PETASTORM = ["pst-batched", "pst-loader", "pst-tf"]
READERS = ("reader", "reader-4")
FOUR = ["id", "label", "features", "image"]
FOUR_COLUMN_CASES = {"reader-4", "torch-loader-4", "pst-batched", "pst-loader"}  # the others read all 5
#: what each case is compared with: Petastorm doing the same (its torch loaders take 4 columns)
PETASTORM_REF = {"torch-loader": "pst-batched", "torch-loader-4": "pst-batched",
                 "torch-dataloader": "pst-batched", "tf-dataset": "pst-tf",
                 "pst-loader": "pst-batched"}


def reference(name: str) -> str:
    """The reader case that reads the same columns as case ``name``."""
    return "reader-4" if name in FOUR_COLUMN_CASES else "reader"


def _drain(batches: Iterable[Mapping[str, Any]], started: float, cpu0: float) -> dict[str, Any]:
    return drain(batches, started, cpu0, lambda: tree_cpu_seconds(children=True))


def case(kind: str, url: str, columns: list[str] | None = None, epochs: int = 1) -> dict[str, Any]:
    """``epochs`` epochs of ``kind`` (a shardkit case name) over ``url``, in this (fresh) process."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import shardkit

    kw: dict[str, Any] = {"batch_size": BATCH, "num_epochs": epochs}
    if columns:
        kw["columns"] = columns
    if kind.startswith("torch"):
        import shardkit.torch  # imported before the clock, like the others' frameworks
    if kind == "tf-dataset":
        import shardkit.tf
    if kind == "jax-loader":
        import jax

        jax.config.update("jax_enable_x64", True)  # id stays int64: the bytes the other cases move
        import shardkit.jax
    started, cpu0 = time.perf_counter(), tree_cpu_seconds(children=True)
    children = 0
    if kind in READERS:
        with shardkit.make_reader(url, **kw) as reader:
            result = _drain(reader, started, cpu0)
    elif kind in ("torch-loader", "torch-loader-4"):
        with shardkit.torch.make_loader(url, **kw) as loader:
            result = _drain(loader, started, cpu0)
    elif kind == "torch-dataloader":
        from torch.utils.data import DataLoader

        ds = shardkit.torch.ShardkitIterableDataset(url, **kw)
        dl = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        result = _drain(dl, started, cpu0)
        children = descendants_peak_rss()  # workers still alive (persistent): their peak RSS
        del dl
    elif kind == "tf-dataset":
        result = _drain(shardkit.tf.make_dataset(url, **kw), started, cpu0)
    elif kind == "jax-loader":
        with shardkit.jax.make_loader(url, **kw) as jax_loader:
            result = _drain(jax_loader, started, cpu0)
    else:
        raise ValueError(f"unknown case {kind!r}")
    return {**result, "rss": phase_peak_rss() + children, "workers_rss": children}


def _petastorm(kind: str, url: str, epochs: int) -> dict[str, Any]:
    script, args = {"pst-batched": ("torch_loader.py", ["--loader", "batched"]),
                    "pst-loader": ("torch_loader.py", ["--loader", "rows"]),
                    "pst-tf": ("tf_dataset.py", [])}[kind]
    args += ["--batch", str(BATCH), "--workers", "2", "--epochs", str(epochs)]
    r = run_in_petastorm(SIDE / script, [url, *args], timeout=1800)
    r["rss"] = r["rss"] + r.pop("children_rss", 0)
    return r


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(rows: int, repeat: int, petastorm: bool, epochs: int) -> dict[str, dict[str, Any]]:
    url = str(data.materialize_shardkit(rows, "tensor"))
    cases = list(SHARDKIT)
    listed = ""
    if petastorm:
        from benchmarks.read import materialize_list_copy

        ensure_venv(with_tf=True)
        listed = materialize_list_copy(rows).as_uri()
        cases += PETASTORM

    def one(name: str) -> dict[str, Any]:
        if name in PETASTORM:
            return _petastorm(name, listed, epochs)
        params = {"kind": name, "url": url, "epochs": epochs,
                  **({"columns": FOUR} if name in FOUR_COLUMN_CASES else {})}
        return run_case("benchmarks.adapters:case", params)

    return round_robin(cases, one, repeat, _log)


def _rate(res: dict[str, Any] | None) -> float | None:
    if not res or "error" in res or not res.get("seconds"):
        return None
    return float(res["rows"] / res["seconds"])


def _per_cpu(res: dict[str, Any] | None) -> float:
    """Rows per CPU second (all threads and worker processes): steadier than wall time on a busy machine."""
    if not res or "error" in res or not res.get("cpu_seconds"):
        return 0.0
    return float(res["rows"] / res["cpu_seconds"])


def report(results: dict[str, dict[str, Any]], rows: int,
           epochs: int = 1) -> tuple[str, list[dict[str, Any]]]:
    """The table and the targets' verdicts; ``rows`` per epoch, ``epochs`` read by each case."""
    labels = {
        "reader": "shardkit make_reader, 5 columns (reference)",
        "reader-4": "shardkit make_reader, 4 columns (reference)",
        "torch-loader": "shardkit.torch.make_loader, 5 columns",
        "torch-loader-4": "shardkit.torch.make_loader, 4 columns (no text)",
        "torch-dataloader": "ShardkitIterableDataset + DataLoader(workers=2)",
        "tf-dataset": "shardkit.tf.make_dataset, 5 columns",
        "jax-loader": "shardkit.jax.make_loader, 5 columns",
        "pst-batched": "Petastorm BatchedDataLoader, 4 columns",
        "pst-loader": "Petastorm DataLoader, 4 columns",
        "pst-tf": "Petastorm make_petastorm_dataset, 5 columns",
    }
    verdicts: list[dict[str, Any]] = []
    lines = []
    for name, label in labels.items():
        res = results.get(name)
        if res is None:
            continue
        if "error" in res:
            lines.append([label, "failed", *["-"] * 9])
            continue
        rate = _rate(res)
        own = reference(name)
        reader, reader_res = _rate(results.get(own)), results.get(own)
        ref = _rate(results.get(PETASTORM_REF[name])) if name in PETASTORM_REF else None
        targets = []
        adapter = name in SHARDKIT and name not in READERS
        if adapter and rate and reader:
            ok = rate >= READER_RATIO * reader
            verdicts.append({"target": f"{label}: >= {READER_RATIO}x {labels[own]}",
                             "result": "PASS" if ok else "MISS", "detail": f"{rate / reader:.2f}x"})
            targets.append("PASS" if ok else "MISS")
        if adapter and rate and ref:
            ok = rate >= PETASTORM_RATIO * ref
            verdicts.append({"target": f"{label}: >= {PETASTORM_RATIO}x {labels[PETASTORM_REF[name]]}",
                             "result": "PASS" if ok else "MISS", "detail": f"{rate / ref:.2f}x"})
            targets.append("PASS" if ok else "MISS")
        ref_cpu = _per_cpu(reader_res)
        cpu_ratio = _per_cpu(res) / ref_cpu if ref_cpu and _per_cpu(res) else None  # steadier under load
        whole = res["rows"] == epochs * rows and res["id_sum"] == epochs * rows * (rows - 1) // 2
        complete = "yes" if whole else f"NO ({res['rows']:,})"
        first = res.get("first_batch_seconds")
        lines.append([
            label, f"{rate:,.0f}" if rate else "-",
            f"{rate / reader:.2f}x" if rate and reader else "-",
            f"{cpu_ratio:.2f}x" if cpu_ratio else "-",
            f"{rate / ref:.2f}x" if rate and ref else "-",
            f"{res['rows'] / res['cpu_seconds']:,.0f}" if res.get("cpu_seconds") else "-",
            f"{first:.2f} s" if first is not None else "-", fmt_bytes(res["rss"]), complete,
            f"{res.get('load_1m', 0):.1f}", " ".join(targets),
        ])
    headers = ["case", "rows/s", "vs reader", "vs reader (CPU)", "vs Petastorm", "rows/CPU-s", "first batch",
               "peak RSS", "complete", "load", "targets"]
    return table(headers, lines), verdicts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4,000 rows, once, no Petastorm, not saved")
    parser.add_argument("--rows", type=int, default=data.REFERENCE_ROWS)
    parser.add_argument("--repeat", type=int, default=5, help="fresh-process runs per case (median)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs each process reads")
    parser.add_argument("--no-petastorm", action="store_true")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--report-only", metavar="RESULTS_JSON", help="print a saved run's table again")
    args = parser.parse_args(argv)
    if args.report_only:
        doc = json.loads(Path(args.report_only).read_text())
        text, verdicts = report(doc["results"], doc["rows"], doc.get("epochs", 1))
        doc.update(table=text + doc["table"][doc["table"].rfind("\n\n"):], targets=verdicts)
        write_json(Path(args.report_only), doc)
        print(doc["table"])
        return
    rows = 4000 if args.quick else args.rows
    repeat = 1 if args.quick else args.repeat
    petastorm = not (args.quick or args.no_petastorm)
    info = machine_info()
    load_before = os.getloadavg()
    _log(f"adapters benchmark on {machine_id(info)}, {rows:,} rows, repeat {repeat}, "
         f"load {load_before[0]:.1f}")
    started = time.perf_counter()
    results = run(rows, repeat, petastorm, args.epochs)
    seconds = time.perf_counter() - started
    text, verdicts = report(results, rows, args.epochs)
    after = os.getloadavg()
    text += (f"\n\n{rows:,} rows, batch {BATCH}, {args.epochs} epoch(s) per process; medians of {repeat} "
             "fresh-process runs, round-robin; "
             f"{seconds / 60:.1f} min; load (1/5/15 min) before {'/'.join(f'{v:.1f}' for v in load_before)}, "
             f"after {'/'.join(f'{v:.1f}' for v in after)} on {info['cpus']} CPUs")
    print(text)
    if not (args.quick or args.no_save):
        path = save_results("adapters", {"rows": rows, "repeat": repeat, "batch": BATCH,
                                         "epochs": args.epochs, "seconds": seconds,
                                         "load_before": load_before, "load_after": after, "table": text,
                                         "targets": verdicts, "results": results})
        _log(f"saved {path}")
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
