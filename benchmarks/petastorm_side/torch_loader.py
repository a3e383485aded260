"""Runs in the Petastorm venv: ``--epochs`` of Petastorm's ``DataLoader`` or ``BatchedDataLoader``, timed.

Usage: python benchmarks/petastorm_side/torch_loader.py URL --loader batched|rows [--batch 256]
[--workers 2] [--epochs 1] [--fields id,label,features,image]. Both read with ``make_batch_reader``
(thread pool, ``--workers`` threads: Petastorm's best reader mode on this data). ``BatchedDataLoader``
refuses string columns ("Pytorch does not support arrays of string or object classes"), so ``--fields``
leaves ``text`` out by default. Prints one JSON line like read_batch.py: rows, id_sum, seconds, first
batch, peak RSS.
"""

import argparse
import json
import os
import time

import _proc
from _consume import drain
from petastorm import make_batch_reader
from petastorm.pytorch import BatchedDataLoader, DataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--loader", choices=["batched", "rows"], required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1, help="epochs read in this process (num_epochs)")
    parser.add_argument("--fields", default="id,label,features,image")
    args = parser.parse_args()
    fields = args.fields.split(",")
    load = os.getloadavg()[0]
    start = time.perf_counter()
    cpu0 = _proc.tree_cpu_seconds()
    with make_batch_reader(args.url, reader_pool_type="thread", workers_count=args.workers,
                           num_epochs=args.epochs, schema_fields=fields) as reader:
        cls = BatchedDataLoader if args.loader == "batched" else DataLoader
        result = drain(cls(reader, batch_size=args.batch), start, cpu0, _proc.tree_cpu_seconds,
                       get=lambda b, name: b[name].numpy())
        children = _proc.descendants_peak_rss()
    print(json.dumps({**result, "fields": fields, "rss": _proc.phase_peak_rss(),
                      "children_rss": children, "load_1m": max(load, os.getloadavg()[0]),
                      "options": {"loader": args.loader, "batch": args.batch, "workers": args.workers,
                                  "epochs": args.epochs}}))


if __name__ == "__main__":
    main()
