"""Runs in the Petastorm venv: ``--epochs`` of ``make_petastorm_dataset(make_batch_reader(...))``, timed.

Usage: python benchmarks/petastorm_side/tf_dataset.py URL [--batch 256] [--workers 2] [--epochs 1]
[--fields id,label,features,image,text]. make_batch_reader yields row groups (thread pool, ``--workers``
threads); the tf.data pipeline is unbatched and rebatched to ``--batch`` rows, as Petastorm's docs show
for a fixed batch size. Prints one JSON line like read_batch.py.
"""

import argparse
import json
import os
import time

import _proc
import numpy as np
import tensorflow as tf
from _consume import drain
from petastorm import make_batch_reader
from petastorm.tf_utils import make_petastorm_dataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1, help="epochs read in this process (num_epochs)")
    parser.add_argument("--fields", default="id,label,features,image,text")
    args = parser.parse_args()
    fields = args.fields.split(",")
    load = os.getloadavg()[0]
    start = time.perf_counter()
    cpu0 = _proc.tree_cpu_seconds()
    with make_batch_reader(args.url, reader_pool_type="thread", workers_count=args.workers,
                           num_epochs=args.epochs, schema_fields=fields) as reader:
        ds = make_petastorm_dataset(reader).unbatch().batch(args.batch)
        result = drain(ds, start, cpu0, _proc.tree_cpu_seconds,
                       get=lambda b, name: np.asarray(getattr(b, name)))
    print(json.dumps({**result, "fields": fields, "rss": _proc.phase_peak_rss(),
                      "children_rss": 0, "load_1m": max(load, os.getloadavg()[0]),
                      "options": {"batch": args.batch, "workers": args.workers, "epochs": args.epochs,
                                  "tf": tf.__version__}}))


if __name__ == "__main__":
    main()
