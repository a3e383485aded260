"""A role for the cluster tests of what a role does to its supervisor (no torch, no TensorFlow import).

params: steps, sleep (seconds per step), exp_metric (also report ``ppl = exp(exp_metric)``, beyond
float32 for 89 and more), ignore_term (SIGTERM ignored: stopping takes the grace period), spawn_child
(start a ``sleep`` child, outside what the parent-death signal reaches), bar (draw a progress bar of
that many ``\\r`` redraws with no newline first, then keep it there), exit0 (indexes that exit 0 at once).
Each process appends ``{"pid", "child", "attempt"}`` to ``<job dir>/record-<role>-<index>.jsonl`` when it
starts.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import shardkit.trainer


def main() -> None:
    ctx = shardkit.trainer.init()
    params = ctx.params
    if params.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "3600"]) if params.get("spawn_child") else None
    record = {"pid": os.getpid(), "child": child.pid if child else None, "attempt": ctx.attempt}
    with open(os.path.join(os.environ["SHARDKIT_JOB_DIR"], f"record-{ctx.role}-{ctx.role_index}.jsonl"),
              "a") as f:
        f.write(json.dumps(record) + "\n")
    if ctx.role_index in params.get("exit0", []):
        sys.exit(0)
    for i in range(params.get("bar", 0)):
        sys.stderr.write(f"\rstep {i:>8} |{'#' * 60}|")
    sys.stderr.flush()
    with ctx:
        for step in range(1, params.get("steps", 10) + 1):
            time.sleep(params.get("sleep", 0.01))
            metrics = {"loss": 1.0 / step}
            if "exp_metric" in params:
                metrics["ppl"] = math.exp(params["exp_metric"] - step)
            ctx.step(metrics, samples=4)
    print("role finished", flush=True)


if __name__ == "__main__":
    main()
