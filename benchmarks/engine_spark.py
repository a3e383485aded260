"""ENGINE benchmark, Spark: the README's digits job through ``shardkit train`` with ``engine: spark``
(barrier mode on a ``local[2]`` session the engine starts), measured as in `benchmarks.engine_ray`:
first step s (includes the JVM's start), samples/s, and recovery s after SIGKILLing the Python worker
that runs worker-1's task (the stage fails; the supervisor starts a new one from the checkpoint).

Usage (from the repository root):
    python -m benchmarks.engine_spark            # one clean run and one run with a kill; saves the result
    python -m benchmarks.engine_spark --quick    # 3 epochs, not saved (smoke test)
"""

from __future__ import annotations

from typing import Any

from benchmarks.engine_ray import main, measure_engine


def measure_spark(epochs: int | None = None) -> dict[str, Any]:
    """The Spark row: ``engine: {name: spark, master: local[2]}``; the kill takes worker-1's task."""
    return measure_engine({"name": "spark", "master": "local[2]"}, epochs=epochs, kill="parent", name="spark")


if __name__ == "__main__":
    main(measure_spark, "engine-spark", __doc__)
