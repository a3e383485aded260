"""WRITE IMAGES benchmark: existing JPEG files into a shardkit dataset, stored as they are or re-encoded.

The images are the image benchmark's synthetic photos (`benchmarks.images_aug.photo`: 256x256 RGB,
quality 90, ~24 KB each), written once as ``.jpg`` files under ``.bench/jpegs-<n>/`` (the "existing
JPEGs"). Each case runs in a fresh process (`benchmarks.common`); the clock runs from listing the folder
to the committed dataset, reading every file on the way, as LitData's ``optimize()`` over the same
files does. After the clock, every stored value is read back from the Parquet files with pyarrow alone
and compared with its file, byte for byte.

Cases:
    bytes    write_dataset(rows of {"id", "label", "image": the file's bytes}): stored as they are, each
             checked by its header (ImageCodec("jpeg"), a fixed (256, 256, 3) field)
    pixels   the same rows with each file decoded by Pillow first: what a user had to do before, the
             codec encodes every image again (0 stored bytes identical)

Usage (from the repository root):
    python -m benchmarks.write_images                    # 20,000 images, 3 rounds, saves results/
    python -m benchmarks.write_images --quick            # 300 images, 1 round, not saved
    python -m benchmarks.write_images --n 20000 --repeat 3 --cases bytes
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_DIR,
    SCRATCH,
    Phase,
    fmt_bytes,
    round_robin,
    run_case,
    save_results,
    table,
)

CASES = ("bytes", "pixels")
SIDE = 256


def jpeg_folder(n: int) -> Path:
    """The folder of ``n`` JPEG files ``000000.jpg`` ... (made once, then reused)."""
    from benchmarks.images_aug import photo

    folder = BENCH_DIR / f"jpegs-{n}"
    done = folder / ".complete"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            path = folder / f"{i:06d}.jpg"
            if not path.exists():
                path.write_bytes(photo(i, SIDE))
        done.touch()
    return folder


def write_case(case: str, folder: str, out: str) -> dict[str, Any]:
    """One write of every file of ``folder`` to ``out`` (see the module docstring); then the check."""
    import numpy as np
    import pyarrow.parquet as pq

    import shardkit
    from shardkit import Field, ImageCodec, Schema

    schema = Schema([Field("id", "int64"), Field("label", "int64"),
                     Field("image", "uint8", (SIDE, SIDE, 3), codec=ImageCodec("jpeg", quality=90))])

    def rows(names: list[str]) -> Iterator[dict[str, Any]]:
        for i, name in enumerate(names):
            with open(os.path.join(folder, name), "rb") as f:
                blob = f.read()
            if case == "pixels":
                from PIL import Image

                with Image.open(io.BytesIO(blob)) as im:
                    yield {"id": i, "label": i % 1000, "image": np.asarray(im)}
            else:
                yield {"id": i, "label": i % 1000, "image": blob}

    shutil.rmtree(out, ignore_errors=True)
    with Phase() as phase:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".jpg"))
        ds = shardkit.write_dataset(rows(names), out, schema=schema, mode="overwrite")
    stored: list[bytes] = []
    for file in ds.files:
        stored += pq.read_table(os.path.join(out, file), columns=["image"]).column("image").to_pylist()
    identical = 0
    for name, blob in zip(names, stored, strict=True):
        with open(os.path.join(folder, name), "rb") as f:
            identical += f.read() == blob
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in names)
    shutil.rmtree(out, ignore_errors=True)
    return {**phase.result(), "rows": len(names), "identical": identical, "input_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="images (default 20,000)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds, each case once a round (default 3)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--quick", action="store_true", help="300 images, one round, results not saved")
    args = parser.parse_args()
    n, repeat = (300, 1) if args.quick else (args.n, args.repeat)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; the cases are {', '.join(CASES)}")
    print(f"making {n:,} JPEG files (once) ...", flush=True)
    folder = jpeg_folder(n)
    out = SCRATCH / "write_images"
    out.parent.mkdir(parents=True, exist_ok=True)

    def run(case: str) -> dict[str, Any]:
        res = run_case("benchmarks.write_images:write_case", {"case": case, "folder": str(folder),
                                                               "out": str(out)})
        res["rss"] = res["write_peak_rss"]
        return res

    results = round_robin(cases, run, repeat, lambda line: print(line, flush=True))
    rows = []
    for case in cases:
        r = results[case]
        if "error" in r:
            rows.append([case, "failed", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append([case, f"{r['seconds']:.1f} s", f"{r['rows'] / r['seconds']:,.0f}",
                     f"{r['input_bytes'] / r['seconds'] / 1e6:,.0f}", f"{r['cpu_seconds']:.1f}",
                     fmt_bytes(r["write_peak_rss"]), f"{r['identical']:,.0f}/{r['rows']:,.0f}",
                     f"{r['load_1m']:.1f}"])
    text = table(["case", "write", "images/s", "MB/s", "CPU-s", "peak RSS", "byte-identical", "load"], rows)
    size = next(iter(results.values())).get("input_bytes", 0) / 2**20
    print(f"\n{n:,} JPEGs of {SIDE}x{SIDE} ({size:,.0f} MiB), medians of {repeat} round(s):\n{text}")
    if not args.quick:
        path = save_results("write_images", {"n": n, "repeat": repeat, "results": results, "table": text})
        print(f"saved {path.relative_to(Path(__file__).resolve().parent.parent)}")


if __name__ == "__main__":
    sys.exit(main())
