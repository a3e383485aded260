"""Materialize scikit-learn's digits (1,797 real 8x8 images, shipped inside scikit-learn) as a dataset.

    python examples/make_digits.py runs/digits        # then: shardkit inspect runs/digits

Each row: id, the 8x8 image as a PNG (uint8, 0..255), the same pixels as a float32 tensor in [0, 1],
the label, and a train/test split column (the last 297 rows are the test split).
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
from sklearn.datasets import load_digits

import shardkit


def digits_frame() -> pd.DataFrame:
    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0
    n = len(images)
    return pd.DataFrame({
        "id": np.arange(n, dtype=np.int64),
        "image": list((images * 255).round().astype(np.uint8)),
        "pixels": list(images),
        "label": digits.target.astype(np.int64),
        "split": np.where(np.arange(n) < n - 297, "train", "test"),
    })


SCHEMA = shardkit.Schema([
    shardkit.Field("id", "int64"),
    shardkit.Field("image", "uint8", (8, 8), codec=shardkit.ImageCodec("png")),
    shardkit.Field("pixels", "float32", (8, 8)),
    shardkit.Field("label", "int64"),
    shardkit.Field("split", "str"),
])


def main(url: str) -> None:
    ds = shardkit.write_dataset(digits_frame(), url, schema=SCHEMA, mode="overwrite", row_group_size=128,
                                progress=True)
    print(f"wrote {ds.num_rows} rows in {len(ds.row_groups)} row groups to {url}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/digits")
