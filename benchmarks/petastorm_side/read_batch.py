"""Runs in the Petastorm venv: one epoch of ``make_batch_reader`` over a plain Parquet folder, timed.

Usage: python benchmarks/petastorm_side/read_batch.py URL [--pool thread|process|dummy] [--workers N]
[--storage-options JSON] (``--workers 0``: Petastorm's default, 10; ``--storage-options``: for an s3://
URL, passed to s3fs). Prints one JSON line: rows, id_sum (to check that the epoch
was complete), seconds, first_batch_seconds (make_batch_reader called -> first batch in hand), peak RSS of
this process and the summed peak RSS of its live children (process pool workers).
"""

import argparse
import json
import os
import time

import _proc
from _consume import Consumer
from petastorm import make_batch_reader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--pool", default="thread")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--storage-options", type=json.loads, default=None)
    args = parser.parse_args()
    kwargs = {"reader_pool_type": args.pool, "num_epochs": 1}
    if args.storage_options:
        kwargs["storage_options"] = args.storage_options
    if args.workers:
        kwargs["workers_count"] = args.workers
    load = os.getloadavg()[0]
    rows = batches = id_sum = 0
    fields = []
    first = None
    start = time.perf_counter()
    cpu0 = _proc.tree_cpu_seconds()
    consumer = Consumer()
    with make_batch_reader(args.url, **kwargs) as reader:
        for batch in reader:
            consumer.consume(batch._asdict())
            if first is None:
                first = time.perf_counter() - start
            rows += len(batch.id)
            id_sum += int(batch.id.sum())
            batches += 1
            fields = list(batch._fields)
        seconds = time.perf_counter() - start
        children = _proc.descendants_peak_rss()
        cpu = _proc.tree_cpu_seconds() - cpu0  # with the pool's worker processes
    print(json.dumps({"rows": rows, "id_sum": id_sum, "batches": batches, "fields": fields,
                      "seconds": seconds, "first_batch_seconds": first, "rss": _proc.phase_peak_rss(),
                      "children_rss": children, "cpu_seconds": cpu,
                      "load_1m": max(load, os.getloadavg()[0]),
                      "options": {k: v for k, v in kwargs.items() if k != "storage_options"}}))


if __name__ == "__main__":
    main()
