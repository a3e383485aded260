"""ENGINE benchmark, all engines in one run: the README's digits job through ``shardkit train`` on the
local engine, torchrun's elastic agents (2 simulated nodes on 127.0.0.1), a local Ray instance and Spark
barrier mode on ``local[2]``, one after the other on the same machine and data; then across hosts
(root: each host a network namespace of `tests.multihost.netns` with its own address): torchrun on 2
hosts, a 2-node Ray cluster and a Spark standalone cluster. Per engine (see `benchmarks.engine_ray` for
the definitions):

    first step s     from launching ``shardkit train`` to the first training step
    samples/s        the training loop's throughput (clean run)
    recovery s       from SIGKILLing worker-1's unit (its process, Ray actor, Spark Python worker, or
                     torchrun worker) right after the first checkpoint to the first step of the restart;
                     across hosts, from losing a whole host (every process on it SIGKILLed)
    partition s      (torchrun across hosts) from cutting host 1's link to node 1 having stopped its
                     worker and exited (``fault_tolerance.lost_job_timeout``), and to node 0's first
                     step alone

Usage (from the repository root):
    python -m benchmarks.engines                 # every engine; saves results/engines-<machine>.json
    python -m benchmarks.engines --quick         # 3 epochs, not saved (smoke test)
    python -m benchmarks.engines --only local torchrun
    python -m benchmarks.engines --only torchrun-multihost ray-multihost spark-multihost   # root
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from benchmarks import engine_ray, engine_spark
from benchmarks.common import ROOT, save_results, table
from benchmarks.engine_ray import measure_engine, measure_ray
from benchmarks.engine_spark import measure_spark
from benchmarks.engine_torchrun import measure_torchrun, measure_torchrun_multihost


def measure_local(epochs: int | None = None) -> dict[str, Any]:
    """The embedded default: every role a process of this machine; the kill takes worker-1's process."""
    return measure_engine("local", epochs=epochs, kill="role")


MEASURES: dict[str, Callable[..., dict[str, Any]]] = {
    "local": measure_local,
    "torchrun": measure_torchrun,
    "ray": measure_ray,
    "spark": measure_spark,
    "torchrun-multihost": measure_torchrun_multihost,
    "ray-multihost": engine_ray.multihost,
    "spark-multihost": engine_spark.multihost,
}


def report(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        extra = (f"; node removed (world 2 -> 1): {row['node_removed_recovery_s']:.1f} s"
                 if "node_removed_recovery_s" in row else "")
        if "partition_noticed_s" in row:
            extra += (f"; partition: node 1 left after {row['partition_noticed_s']:.1f} s "
                      f"(lost_job_timeout {row['lost_job_timeout_s']:.0f} s), node 0 alone after "
                      f"{row['partition_recovery_s']:.1f} s")
        lines.append([row["engine"], f"{row['first_step_s']:.1f}", f"{row['samples_per_s']:,.0f}",
                      f"{row['recovery_s']:.1f}{extra}", str(row["killed"]),
                      f"{row['clean'].get('test_accuracy', float('nan')):.3f}"])
    return table(["engine", "command -> first step s", "samples/s", "recovery after kill s", "killed",
                  "test accuracy"], lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 epochs, results not saved")
    parser.add_argument("--only", nargs="+", choices=list(MEASURES), default=list(MEASURES))
    args = parser.parse_args()
    epochs = 3 if args.quick else None
    load_before = os.getloadavg()
    rows = []
    for name in args.only:
        print(f"--- {name}", flush=True)
        rows.append(MEASURES[name](epochs=epochs))
        print(report(rows[-1:]), flush=True)
    print(report(rows))
    if not args.quick:
        payload = {"rows": rows, "load_before": load_before, "load_after": os.getloadavg(),
                   "table": report(rows)}
        print(f"saved {save_results('engines', payload).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
