"""Runs in the Petastorm venv: import petastorm, torch and pyspark, and read a dataset with make_reader.

Usage: python benchmarks/petastorm_side/check.py DATASET_DIR   (prints one JSON line)
"""

import json
import sys
from pathlib import Path

import numpy as np
import petastorm
import pyarrow
import pyspark
import torch
from petastorm import make_reader


def main() -> None:
    url = Path(sys.argv[1]).resolve().as_uri()
    rows = 0
    fields: list[str] = []
    with make_reader(url, num_epochs=1, reader_pool_type="dummy", shuffle_row_groups=False) as reader:
        for row in reader:
            fields = list(row._fields)
            rows += 1
    print(json.dumps({
        "ok": True, "url": url, "rows": rows, "fields": fields,
        "versions": {"petastorm": petastorm.__version__, "pyarrow": pyarrow.__version__,
                     "numpy": np.__version__, "pyspark": pyspark.__version__, "torch": torch.__version__},
    }))


if __name__ == "__main__":
    main()
