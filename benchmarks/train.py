"""TRAIN benchmark: the cost of `shardkit train`'s coordination, against the same script under torchrun.

The job is the README's (``examples/digits.yaml``: 2 DDP workers on CPU, checkpoints every 100 steps).
The same script runs two ways, alternating, each run in fresh processes with a fresh checkpoint folder:

    shardkit    shardkit train <digits.yaml copy>     (local engine: heartbeats, logs, supervision)
    torchrun    SHARDKIT_CONFIG=<copy> torchrun --standalone --nproc_per_node 2 examples/train_digits.py

Both read the same dataset through the same reader and write the same checkpoints; the difference is
what `shardkit train` adds: the supervisor, UDP heartbeats from ``ctx.step``, per-role log files. The
script measures its own training throughput (rank 0: samples of both ranks from the first step to the
end of the loop, checkpoint saves included) and prints the wall clock of its first step, so:

    samples/s            throughput of the training loop (the target: shardkit >= 0.95x torchrun)
    first step s         from launching the command to the first training step (process start, imports,
                         rendezvous, data planning)
    wall s               the whole command, to its exit

Usage (from the repository root):
    python -m benchmarks.train               # 5 runs of each, alternating; saves results/train-<machine>.json
    python -m benchmarks.train --quick       # 1 run of each, 2 epochs, not saved (smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import ROOT, SCRATCH, machine_id, machine_info, save_results, table

EXAMPLE = ROOT / "examples" / "digits.yaml"
SCRIPT = ROOT / "examples" / "train_digits.py"
_STATS = re.compile(r"TRAIN_STATS (\{.*\})")


def _dataset() -> Path:
    url = SCRATCH / "train" / "digits"
    if not (url / "_metadata").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_digits.py"), str(url)], check=True,
                       capture_output=True, cwd=ROOT, timeout=300)
    return url


def _config(run_dir: Path, data: Path, epochs: int | None) -> Path:
    config = yaml.safe_load(EXAMPLE.read_text())
    config["entrypoint"] = str(SCRIPT)
    config["data"]["url"] = str(data)
    if epochs is not None:
        config["data"]["num_epochs"] = epochs
    config["logdir"] = str(run_dir / "job")
    path = run_dir / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_once(kind: str, data: Path, epochs: int | None, index: int) -> dict[str, Any]:
    """One run of the digits job, ``kind`` = ``shardkit`` or ``torchrun``; the script's TRAIN_STATS."""
    run_dir = SCRATCH / "train" / f"{kind}-{index}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = _config(run_dir, data, epochs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    if kind == "shardkit":
        cmd = [sys.executable, "-m", "shardkit.cli", "train", str(config)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(SCRIPT)]
        env.update({"SHARDKIT_CONFIG": str(config), "OMP_NUM_THREADS": "1"})  # the config's env, by hand
    start_unix, start = time.time(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
                          start_new_session=True)
    wall = time.perf_counter() - start
    found = _STATS.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{kind} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    stats = json.loads(found.group(1))
    return {"kind": kind, "samples_per_s": stats["samples_per_s"], "train_s": stats["seconds"],
            "first_step_s": stats["first_step_unix"] - start_unix, "wall_s": wall, "steps": stats["steps"],
            "test_accuracy": stats["test_accuracy"], "load_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=6, help="runs of each kind (alternating)")
    parser.add_argument("--epochs", type=int, default=60,
                        help="epochs per run (the example's 20 train ~3 s: too short to compare launchers)")
    parser.add_argument("--quick", action="store_true", help="1 run of each, 2 epochs, results not saved")
    args = parser.parse_args()
    repeat, epochs = (1, 2) if args.quick else (args.repeat, args.epochs)
    data = _dataset()
    runs: list[dict[str, Any]] = []
    for i in range(repeat):
        # alternate which launcher goes first, so neither always runs right after the other's teardown
        for kind in ("shardkit", "torchrun") if i % 2 == 0 else ("torchrun", "shardkit"):
            runs.append(run_once(kind, data, epochs, i))
            r = runs[-1]
            print(f"  {kind:8s} run {i}: {r['samples_per_s']:8,.0f} samples/s, "
                  f"first step {r['first_step_s']:.1f} s, wall {r['wall_s']:.1f} s, "
                  f"accuracy {r['test_accuracy']:.3f}, load {r['load_1m']:.1f}",
                  flush=True)
    med = {kind: {key: statistics.median(r[key] for r in runs if r["kind"] == kind)
                  for key in ("samples_per_s", "first_step_s", "wall_s", "train_s", "test_accuracy")}
           for kind in ("shardkit", "torchrun")}
    ratio = med["shardkit"]["samples_per_s"] / med["torchrun"]["samples_per_s"]
    rows = [[kind, f"{m['samples_per_s']:,.0f}", f"{m['first_step_s']:.1f}", f"{m['train_s']:.1f}",
             f"{m['wall_s']:.1f}", f"{m['test_accuracy']:.3f}"] for kind, m in med.items()]
    text = table(["launcher", "samples/s", "first step s", "train s", "wall s", "test accuracy"], rows)
    text += (f"\n\nshardkit / torchrun samples/s: {ratio:.3f}x (target >= 0.95x), "
             f"medians of {repeat} runs each")
    print(text)
    if not args.quick:
        path = save_results("train", {"repeat": repeat, "ratio_samples_per_s": ratio, "medians": med,
                                      "table": text, "runs": runs})
        print(f"saved {path.relative_to(ROOT)} (machine {machine_id(machine_info())})")


if __name__ == "__main__":
    main()
