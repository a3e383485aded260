"""GPU benchmark: shardkit.torch's copy path to a CUDA device vs torch alone, and the loader into GPU memory
vs the plain reader, on a machine with a CUDA GPU.

Two parts, in one run:

* **Host to device.** The loader's staging (`shardkit.reader.adapters.torch._CudaStager`: the batch copied
into a
  reused pinned slot, then ``copy_(non_blocking=True)`` on a side stream) against torch copying the same
  already-pinned tensor alone (``pinned.to("cuda", non_blocking=True)``), 16, 64 and 256 MiB, timed with
  CUDA events over ``--h2d-repeat`` copies after a warm-up. The loader's figure includes its host copy
  into the pinned slot (the work a pinned DataLoader's pin thread does), torch's does not. Target
  (ANCHORS): >= 0.9x of torch alone. Beside it, for context, torch's own way from the same pageable
  tensor (``pin_memory()`` then the copy, as ``DataLoader(pin_memory=True)`` and ``.to`` do), wall clock.
* **Epochs.** On the ANCHORS rows of `benchmarks.data` (tensor layout), each case in a fresh process,
  round-robin, medians:

      reader             shardkit.make_reader, batches consumed on the host (as in benchmarks.adapters)
      torch-loader       shardkit.torch.make_loader, host tensors, consumed on the host
      torch-loader-cuda  make_loader(device="cuda"): each batch's image and features are read on the GPU
                         (a sum per batch), the stream synchronized before the clock stops
      torch-dataloader   ShardkitIterableDataset + DataLoader(num_workers=2), host tensors

  Target (ANCHORS): every adapter >= 0.9x of the reader.

Usage (from the repository root, on the GPU machine):
    python -m benchmarks.gpu                  # 100,000 rows x 3 epochs, repeat 3, saves results/
    python -m benchmarks.gpu --quick          # 8,000 rows, once, not saved
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import data
from benchmarks.common import (
    RESULTS,
    descendants_peak_rss,
    fmt_bytes,
    machine_id,
    machine_info,
    phase_peak_rss,
    round_robin,
    run_case,
    save_results,
    tree_cpu_seconds,
)
from benchmarks.petastorm_side._consume import drain

BATCH = 256
TARGET = 0.9
CASES = ["reader", "torch-loader", "torch-loader-cuda", "torch-dataloader"]
SIZES_MIB = (16, 64, 256)


def h2d(size_mib: int, repeat: int) -> dict[str, float]:
    """GB/s of the loader's staging path and of torch's pinned copy alone, for one ``size_mib`` tensor."""
    import numpy as np
    import torch

    from shardkit.reader.adapters.torch import _CudaStager

    n = size_mib << 20
    host = {"x": torch.from_numpy(np.random.default_rng(0).random(n // 4, dtype=np.float32))}
    stager = _CudaStager(torch.device("cuda", torch.cuda.current_device()))
    for _ in range(4):  # warm: slots allocated and pinned, and the caching allocator holds the device blocks
        staged = stager.stage(host)  # the loop reuses (a cold one asks CUDA for a new block per copy)
    stager.hand(staged)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    wall = time.perf_counter()
    with torch.cuda.stream(stager.stream):
        start.record()
    for _ in range(repeat):
        staged = stager.stage(host)
    with torch.cuda.stream(stager.stream):
        end.record()
    end.synchronize()
    loader_wall = time.perf_counter() - wall
    stager.hand(staged)
    loader_ms = start.elapsed_time(end) / repeat
    pinned = host["x"].pin_memory()
    pinned.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    wall = time.perf_counter()
    start.record()
    for _ in range(repeat):
        pinned.to("cuda", non_blocking=True)
    end.record()
    end.synchronize()
    plain_wall = time.perf_counter() - wall
    plain_ms = start.elapsed_time(end) / repeat
    # torch's own way from the same pageable tensor (DataLoader(pin_memory=True)'s pin thread, then .to)
    host["x"].pin_memory().to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    wall = time.perf_counter()
    for _ in range(repeat):
        host["x"].pin_memory().to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    pin_wall = time.perf_counter() - wall
    gbps = lambda ms: n / (ms / 1e3) / 1e9  # noqa: E731
    return {"mib": size_mib, "loader_gbps": gbps(loader_ms), "torch_gbps": gbps(plain_ms),
            "ratio": plain_ms / loader_ms, "loader_wall_gbps": n * repeat / loader_wall / 1e9,
            "torch_wall_gbps": n * repeat / plain_wall / 1e9,
            "torch_pin_then_copy_gbps": n * repeat / pin_wall / 1e9}


def case(kind: str, url: str, epochs: int = 1) -> dict[str, Any]:
    """``epochs`` epochs of ``kind`` over ``url``, in this (fresh) process."""
    import torch

    import shardkit
    import shardkit.torch

    kw: dict[str, Any] = {"batch_size": BATCH, "num_epochs": epochs}
    started, cpu0 = time.perf_counter(), tree_cpu_seconds(children=True)
    cpu = lambda: tree_cpu_seconds(children=True)  # noqa: E731
    children = 0
    if kind == "reader":
        with shardkit.make_reader(url, **kw) as reader:
            result = drain(reader, started, cpu0, cpu)
    elif kind == "torch-loader":
        with shardkit.torch.make_loader(url, **kw) as loader:
            result = drain(loader, started, cpu0, cpu)
    elif kind == "torch-loader-cuda":
        torch.cuda.init()
        started, cpu0 = time.perf_counter(), tree_cpu_seconds(children=True)  # CUDA's start not counted
        rows = batches = 0
        first = None
        total = torch.zeros((), dtype=torch.float64, device="cuda")
        id_sum = torch.zeros((), dtype=torch.int64, device="cuda")
        with shardkit.torch.make_loader(url, device="cuda", **kw) as loader:
            for batch in loader:
                total += batch["features"].sum(dtype=torch.float64)
                total += batch["image"].sum(dtype=torch.float64)
                id_sum += batch["id"].sum()
                rows += batch["id"].shape[0]
                batches += 1
                if first is None:
                    torch.cuda.synchronize()
                    first = time.perf_counter() - started
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        result = {"rows": rows, "id_sum": int(id_sum), "batches": batches, "seconds": seconds,
                  "first_batch_seconds": first or seconds, "cpu_seconds": cpu() - cpu0}
    elif kind == "torch-dataloader":
        from torch.utils.data import DataLoader

        ds = shardkit.torch.ShardkitIterableDataset(url, **kw)
        dl = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        result = drain(dl, started, cpu0, cpu)
        children = descendants_peak_rss()
        del dl
    else:
        raise ValueError(f"unknown case {kind!r}")
    return {**result, "rss": phase_peak_rss() + children}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(rows: int, repeat: int, epochs: int) -> dict[str, dict[str, Any]]:
    url = str(data.materialize_shardkit(rows, "tensor"))
    return round_robin(CASES, lambda name: run_case("benchmarks.gpu:case", {"kind": name, "url": url,
                                                                          "epochs": epochs}), repeat, _log)


def report(copies: list[dict[str, float]], results: dict[str, dict[str, Any]], device: str
           ) -> tuple[str, dict[str, bool]]:
    lines = [f"host to device on {device}", "",
             "| size | loader path GB/s | torch pinned copy alone GB/s | ratio | target "
             "| torch pin_memory() then copy GB/s |",
             "|---:|---:|---:|---:|---|---:|"]
    verdicts: dict[str, bool] = {}
    for c in copies:
        ok = c["ratio"] >= TARGET
        verdicts[f"h2d-{c['mib']}mib"] = ok
        pin = c.get("torch_pin_then_copy_gbps")  # (results saved before it was measured: none)
        lines.append(f"| {c['mib']} MiB | {c['loader_gbps']:.1f} | {c['torch_gbps']:.1f} | "
                     f"{c['ratio']:.2f}x | >= {TARGET}x: {'yes' if ok else 'NO'} | "
                     f"{'-' if pin is None else f'{pin:.1f}'} |")
    ref = results.get("reader", {})
    lines += ["", "| case | rows/s | rows per CPU-s | first batch | peak RSS | vs reader | target |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for name in CASES:
        res = results.get(name)
        if not res:
            continue
        if "error" in res:
            lines.append(f"| {name} | failed | | | | | |")
            verdicts[name] = False
            continue
        rate = res["rows"] / res["seconds"]
        vs = rate / (ref["rows"] / ref["seconds"]) if ref.get("seconds") else float("nan")
        target = "" if name == "reader" else f">= {TARGET}x: {'yes' if vs >= TARGET else 'NO'}"
        if name != "reader":
            verdicts[name] = vs >= TARGET
        lines.append(f"| {name} | {rate:,.0f} | {res['rows'] / max(res['cpu_seconds'], 1e-9):,.0f} | "
                     f"{res['first_batch_seconds']:.2f} s | {fmt_bytes(res['rss'])} | {vs:.2f}x | {target} |")
    return "\n".join(lines), verdicts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8,000 rows, once, not saved")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--h2d-repeat", type=int, default=20)
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where the results file goes")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"benchmarks.gpu needs a CUDA GPU: torch {torch.__version__} sees none")
    device = torch.cuda.get_device_name()
    rows = 8000 if args.quick else args.rows
    repeat = 1 if args.quick else args.repeat
    info = machine_info()
    _log(f"gpu benchmark on {machine_id(info)} with {device}, {rows:,} rows, repeat {repeat}")
    started = time.perf_counter()
    copies = [h2d(mib, args.h2d_repeat) for mib in SIZES_MIB]
    for c in copies:
        _log(f"  H2D {c['mib']} MiB: loader {c['loader_gbps']:.1f} GB/s, "
             f"torch alone {c['torch_gbps']:.1f} GB/s")
    results = run(rows, repeat, args.epochs)
    seconds = time.perf_counter() - started
    text, verdicts = report(copies, results, device)
    text += (f"\n\n{rows:,} rows, batch {BATCH}, {args.epochs} epoch(s) per process; medians of {repeat} "
             f"fresh-process runs; {info['cpus']} CPUs, torch {torch.__version__}, load "
             f"{'/'.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(text)
    if not args.quick:
        path = save_results("gpu", {"command": f"python -m benchmarks.gpu --rows {rows} --repeat {repeat} "
                                               f"--epochs {args.epochs}",  # not --results-dir's path
                                    "device": device, "torch": torch.__version__, "rows": rows,
                                    "repeat": repeat, "epochs": args.epochs, "seconds": seconds,
                                    "h2d": copies, "table": text, "targets": verdicts, "results": results},
                            directory=args.results_dir)
        _log(f"saved {path}")
        print(json.dumps({"saved": str(path)}))


if __name__ == "__main__":
    main()
