"""Runs in the Petastorm venv: one epoch of ``make_reader`` over a Petastorm dataset, timed.

Usage: python benchmarks/petastorm_side/read_rows.py URL [--pool thread|process|dummy] [--workers N]
[--batch 256] (``--workers 0``: Petastorm's default, 10). make_reader yields one decoded row at a time;
first_batch_seconds is make_reader called -> the first ``--batch`` rows in hand (one training batch).
Prints one JSON line like read_batch.py.
"""

import argparse
import json
import os
import time

import _proc
from _consume import Consumer
from petastorm import make_reader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--pool", default="thread")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    kwargs = {"reader_pool_type": args.pool, "num_epochs": 1}
    if args.workers:
        kwargs["workers_count"] = args.workers
    load = os.getloadavg()[0]
    rows = id_sum = 0
    first = None
    start = time.perf_counter()
    cpu0 = _proc.tree_cpu_seconds()
    consumer = Consumer()
    with make_reader(args.url, **kwargs) as reader:
        for row in reader:
            consumer.consume({"image": row.image[None], "features": row.features[None]})
            rows += 1
            id_sum += int(row.id)
            if first is None and rows >= args.batch:
                first = time.perf_counter() - start
        seconds = time.perf_counter() - start
        children = _proc.descendants_peak_rss()
        cpu = _proc.tree_cpu_seconds() - cpu0  # with the pool's worker processes
    print(json.dumps({"rows": rows, "id_sum": id_sum, "seconds": seconds,
                      "first_batch_seconds": first if first is not None else seconds,
                      "rss": _proc.phase_peak_rss(), "children_rss": children, "cpu_seconds": cpu,
                      "load_1m": max(load, os.getloadavg()[0]), "options": kwargs}))


if __name__ == "__main__":
    main()
