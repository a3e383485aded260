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
    attempt start s      shardkit only: from launching the command to the start of the job's first
                         attempt (the supervisor's line saying so): Python, shardkit's imports and what
                         the supervisor does before any process starts (config, the dataset's index,
                         locks, TensorBoard's event file). The target: <= 1.5 s. Each run also keeps
                         ``attempt_start_in_job_s``, the same from the supervisor's own start
                         (summary.json)
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
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import ROOT, SCRATCH, machine_id, machine_info, save_results, table

EXAMPLE = ROOT / "examples" / "digits.yaml"
SCRIPT = ROOT / "examples" / "train_digits.py"
_STATS = re.compile(r"TRAIN_STATS (\{.*\})")
_ATTEMPT_0 = "[shardkit] attempt 0 ("  # the supervisor's line as it starts the first attempt's processes


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
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    timer = threading.Timer(600, proc.kill)  # as a timeout: the loop below ends when the output does
    timer.start()
    lines, attempt_start = [], None
    try:
        for line in proc.stdout or ():
            if attempt_start is None and line.startswith(_ATTEMPT_0):
                attempt_start = time.perf_counter() - start
            lines.append(line)
        returncode = proc.wait()
    finally:
        timer.cancel()
    wall = time.perf_counter() - start
    output = "".join(lines)
    found = _STATS.search(output)
    if returncode != 0 or found is None:
        raise RuntimeError(f"{kind} run failed ({returncode}):\n{output[-6000:]}")
    stats = json.loads(found.group(1))
    in_job = None
    if kind == "shardkit":
        summary = json.loads((run_dir / "job" / "summary.json").read_text())
        in_job = summary["attempts"][0]["started_s"]
    return {"kind": kind, "samples_per_s": stats["samples_per_s"], "train_s": stats["seconds"],
            "first_step_s": stats["first_step_unix"] - start_unix, "wall_s": wall, "steps": stats["steps"],
            "attempt_start_s": attempt_start, "attempt_start_in_job_s": in_job,
            "test_accuracy": stats["test_accuracy"], "load_1m": os.getloadavg()[0]}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


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
            started = r["attempt_start_s"]
            attempt = f", attempt start {started:.2f} s" if started is not None else ""
            print(f"  {kind:8s} run {i}: {r['samples_per_s']:8,.0f} samples/s, "
                  f"first step {r['first_step_s']:.1f} s{attempt}, wall {r['wall_s']:.1f} s, "
                  f"accuracy {r['test_accuracy']:.3f}, load {r['load_1m']:.1f}",
                  flush=True)
    med = {kind: {key: _median([r[key] for r in runs if r["kind"] == kind])
                  for key in ("samples_per_s", "first_step_s", "attempt_start_s", "wall_s", "train_s",
                              "test_accuracy")}
           for kind in ("shardkit", "torchrun")}
    ratio = med["shardkit"]["samples_per_s"] / med["torchrun"]["samples_per_s"]
    rows = [[kind, f"{m['samples_per_s']:,.0f}", f"{m['first_step_s']:.1f}",
             "-" if m["attempt_start_s"] is None else f"{m['attempt_start_s']:.2f}", f"{m['train_s']:.1f}",
             f"{m['wall_s']:.1f}", f"{m['test_accuracy']:.3f}"] for kind, m in med.items()]
    text = table(["launcher", "samples/s", "first step s", "attempt start s", "train s", "wall s",
                  "test accuracy"], rows)
    text += (f"\n\nshardkit / torchrun samples/s: {ratio:.3f}x (target >= 0.95x); shardkit's attempt start "
             f"{med['shardkit']['attempt_start_s']:.2f} s after the job's start (target <= 1.5 s); "
             f"medians of {repeat} runs each")
    print(text)
    if not args.quick:
        path = save_results("train", {"repeat": repeat, "ratio_samples_per_s": ratio, "medians": med,
                                      "table": text, "runs": runs})
        print(f"saved {path.relative_to(ROOT)} (machine {machine_id(machine_info())})")


if __name__ == "__main__":
    main()
