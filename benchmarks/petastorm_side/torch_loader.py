"""Runs in the Petastorm venv: one epoch of ``petastorm.pytorch.DataLoader`` or ``BatchedDataLoader``, timed.

Usage: python benchmarks/petastorm_side/torch_loader.py URL --loader batched|rows [--batch 256]
[--workers 2] [--fields id,label,features,image]. Both read with ``make_batch_reader`` (thread pool,
``--workers`` threads: Petastorm's best reader mode on this data). ``BatchedDataLoader`` refuses string
columns ("Pytorch does not support arrays of string or object classes"), so ``--fields`` leaves ``text``
out by default. Prints one JSON line like read_batch.py: rows, id_sum, seconds, first batch, peak RSS.
"""

import argparse
import json
import os
import time

import _proc
from _consume import Consumer
from petastorm import make_batch_reader
from petastorm.pytorch import BatchedDataLoader, DataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--loader", choices=["batched", "rows"], required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--fields", default="id,label,features,image")
    args = parser.parse_args()
    fields = args.fields.split(",")
    load = os.getloadavg()[0]
    rows = batches = id_sum = 0
    first = None
    start = time.perf_counter()
    cpu0 = _proc.tree_cpu_seconds()
    consumer = Consumer()
    with make_batch_reader(args.url, reader_pool_type="thread", workers_count=args.workers, num_epochs=1,
                           schema_fields=fields) as reader:
        cls = BatchedDataLoader if args.loader == "batched" else DataLoader
        for batch in cls(reader, batch_size=args.batch):
            consumer.consume({k: batch[k].numpy() for k in ("image", "features")})
            if first is None:
                first = time.perf_counter() - start
            ids = batch["id"]
            rows += len(ids)
            id_sum += int(ids.sum())
            batches += 1
        seconds = time.perf_counter() - start
        children = _proc.descendants_peak_rss()
        cpu = _proc.tree_cpu_seconds() - cpu0
    print(json.dumps({"rows": rows, "id_sum": id_sum, "batches": batches, "fields": fields,
                      "seconds": seconds, "first_batch_seconds": first, "rss": _proc.phase_peak_rss(),
                      "children_rss": children, "cpu_seconds": cpu, "load_1m": max(load, os.getloadavg()[0]),
                      "options": {"loader": args.loader, "batch": args.batch, "workers": args.workers}}))


if __name__ == "__main__":
    main()
