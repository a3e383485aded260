"""The ANCHORS.md benchmark rows, generated deterministically in chunks, and cached copies on disk.

Each row: ``id`` int64, ``label`` int32, ``features`` float32[128], ``image`` uint8 32x32x3 (smooth 8x8
blocks plus a little noise, so it compresses like a real image), ``text`` a 40-character string:
3,636 bytes decoded. 200,000 rows is the reference size (727 MB).

Rows are generated in chunks of `CHUNK_ROWS`, chunk ``k`` from its own seed, so the first N rows are
the same whatever N is and no more than one chunk is ever built at a time.

Cached under ``.bench/data/`` (gitignored; ``$SHARDKIT_BENCH_DIR/data`` when that is set), keyed by N
and `VERSION`, and shardkit's datasets also by the format shardkit's writer produces (`writer_key`:
a change to the writer's encodings, row-group sizing or page checksums writes them again):
    raw-v2-n200000/data.parquet             plain pyarrow Parquet, arrays as fixed_size_list (the reference)
    shardkit-v2-w1a2b3c4-tensor-n200000/    a shardkit dataset (image as a fixed-shape tensor)
    shardkit-v2-w1a2b3c4-png-n200000/       a shardkit dataset (image as PNG)

Usage (from the repository root):
    python -m benchmarks.data 200000          # materialize both caches for 200k rows
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

import shardkit
from benchmarks.common import BENCH_DIR
from shardkit.dataset._pages import check_row_group

CACHE = BENCH_DIR / "data"
VERSION = 2  # bump when the generated values change: old caches are then ignored
SEED = 20261121
CHUNK_ROWS = 8192
REFERENCE_ROWS = 200_000
FEATURES = 128
IMAGE_SHAPE = (32, 32, 3)
TEXT_CHARS = 40
ROW_BYTES = 8 + 4 + 4 * FEATURES + int(np.prod(IMAGE_SHAPE)) + TEXT_CHARS  # 3,636 decoded bytes
COMPRESSION = "snappy"

ImageLayout = Literal["tensor", "png"]
ArrayLayout = Literal["tensor", "list"]


def _chunk(k: int, n: int = CHUNK_ROWS) -> dict[str, np.ndarray]:
    """The first ``n`` rows of chunk ``k`` as numpy columns (text as a ``(n, 40)`` uint8 array).

    The whole chunk is always drawn and then cut, so row ``i`` is the same whatever ``n`` is.
    """
    rng = np.random.default_rng([SEED, VERSION, k])
    size = CHUNK_ROWS
    start = k * CHUNK_ROWS
    ids = np.arange(start, start + size, dtype=np.int64)
    labels = rng.integers(0, 1000, size=size, dtype=np.int32)
    features = rng.standard_normal((size, FEATURES), dtype=np.float32)
    h, w, c = IMAGE_SHAPE
    blocks = rng.integers(0, 256, size=(size, h // 8, w // 8, c), dtype=np.int16)
    image = np.repeat(np.repeat(blocks, 8, axis=1), 8, axis=2)
    image += rng.integers(-8, 8, size=image.shape, dtype=np.int16)
    image = np.clip(image, 0, 255, out=image).astype(np.uint8)
    # "row-0000123456-" then random lowercase letters: unique, realistic-looking text
    text = rng.integers(ord("a"), ord("z") + 1, size=(size, TEXT_CHARS), dtype=np.uint8)
    digits = (ids[:, None] // 10 ** np.arange(9, -1, -1)) % 10
    text[:, :4] = np.frombuffer(b"row-", np.uint8)
    text[:, 4:14] = ord("0") + digits
    text[:, 14] = ord("-")
    columns: dict[str, np.ndarray] = {"id": ids, "label": labels, "features": features, "image": image,
                                      "text": text}
    return {name: np.ascontiguousarray(v[:n]) if n < size else v for name, v in columns.items()}


def _chunks(rows: int) -> Iterator[dict[str, np.ndarray]]:
    for k in range((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        yield _chunk(k, min(CHUNK_ROWS, rows - k * CHUNK_ROWS))


def _text_array(text: np.ndarray) -> pa.Array:
    n = len(text)
    offsets = np.arange(0, TEXT_CHARS * (n + 1), TEXT_CHARS, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(text)))


def iter_numpy(rows: int) -> Iterator[dict[str, np.ndarray]]:
    """Chunks of numpy columns: features ``(n, 128)``, image ``(n, 32, 32, 3)``, text ``<U40``."""
    for c in _chunks(rows):
        c["text"] = c["text"].view(f"S{TEXT_CHARS}")[:, 0].astype(f"U{TEXT_CHARS}")
        yield c


def iter_frames(rows: int) -> Iterator[pd.DataFrame]:
    """Chunks as pandas DataFrames the way a pandas user holds tensors: one numpy array per cell."""
    for c in iter_numpy(rows):
        yield pd.DataFrame({name: list(v) if v.ndim > 1 else v for name, v in c.items()})


def arrow_schema(layout: ArrayLayout = "tensor") -> pa.Schema:
    """``tensor``: arrays as Arrow's ``fixed_shape_tensor``; ``list``: as flat ``fixed_size_list``."""
    if layout == "tensor":
        features: pa.DataType = pa.fixed_shape_tensor(pa.float32(), [FEATURES])
        image: pa.DataType = pa.fixed_shape_tensor(pa.uint8(), list(IMAGE_SHAPE))
    else:
        features = pa.list_(pa.float32(), FEATURES)
        image = pa.list_(pa.uint8(), int(np.prod(IMAGE_SHAPE)))
    return pa.schema([("id", pa.int64()), ("label", pa.int32()), ("features", features),
                      ("image", image), ("text", pa.string())])


def iter_batches(rows: int, layout: ArrayLayout = "tensor") -> Iterator[pa.RecordBatch]:
    """Chunks as Arrow record batches (see `arrow_schema` for the two layouts)."""
    schema = arrow_schema(layout)
    for c in _chunks(rows):
        features = pa.FixedSizeListArray.from_arrays(pa.array(c["features"].reshape(-1)), FEATURES)
        image = pa.FixedSizeListArray.from_arrays(pa.array(c["image"].reshape(-1)), int(np.prod(IMAGE_SHAPE)))
        if layout == "tensor":
            features = pa.ExtensionArray.from_storage(schema.field("features").type, features)
            image = pa.ExtensionArray.from_storage(schema.field("image").type, image)
        arrays = [pa.array(c["id"]), pa.array(c["label"]), features, image, _text_array(c["text"])]
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def numpy_columns(rows: int) -> dict[str, np.ndarray]:
    """All ``rows`` as numpy columns in memory (for benchmarks whose input is one in-memory table)."""
    chunks = list(iter_numpy(rows))
    return {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}


def frame(rows: int) -> pd.DataFrame:
    """All ``rows`` as one pandas DataFrame the way a pandas user holds tensors: a numpy array per cell."""
    return pd.DataFrame({name: list(v) if v.ndim > 1 else v for name, v in numpy_columns(rows).items()})


def table(rows: int, layout: ArrayLayout = "list") -> pa.Table:
    """All ``rows`` as one Arrow table (see `arrow_schema` for the layouts)."""
    return pa.Table.from_batches(list(iter_batches(rows, layout)), schema=arrow_schema(layout))


def shardkit_schema(image: ImageLayout = "tensor") -> shardkit.Schema:
    """The shardkit `Schema` of these rows; ``image="png"`` stores the image with ``ImageCodec("png")``."""
    codec = shardkit.ImageCodec("png") if image == "png" else None
    return shardkit.Schema([
        shardkit.Field("id", "int64"),
        shardkit.Field("label", "int32"),
        shardkit.Field("features", "float32", (FEATURES,)),
        shardkit.Field("image", "uint8", IMAGE_SHAPE, codec=codec),
        shardkit.Field("text", "str"),
    ])


def raw_path(rows: int) -> Path:
    return CACHE / f"raw-v{VERSION}-n{rows}" / "data.parquet"


def page_checksums(path: str | Path) -> tuple[int, int]:
    """``(pages with a CRC, pages)`` over every page of every column chunk of the Parquet files under
    ``path`` (a file or a folder; ``_``/``.`` files skipped), read from the page headers themselves
    (`shardkit.dataset._pages`: pyarrow reports no page checksums in its metadata)."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*.parquet") if not p.name.startswith(("_", ".")))
    with_crc = pages = 0
    for file in files:
        md = pq.read_metadata(file)
        data = memoryview(file.read_bytes())

        def read(n: int, at: int, data: memoryview = data) -> memoryview:
            return data[at:at + n]

        for i in range(md.num_row_groups):
            for _, chunk in check_row_group(read, md.row_group(i)):
                pages += chunk.pages
                with_crc += chunk.pages - chunk.unchecked
    return with_crc, pages


@functools.cache
def writer_key() -> str:
    """A short hash of the format shardkit's writer gives these rows now (one chunk written to a scratch
    folder): per column its physical type, encodings, compression and statistics, plus the rows of each
    row group, the stored schema, the default part-file size, the pages, whether they carry checksums and
    whether the chunks have a page index.
    Cached datasets written by a different writer get another key."""
    parts = [str(inspect.signature(shardkit.write_dataset).parameters["file_size"].default)]
    with tempfile.TemporaryDirectory(prefix="shardkit-writer-key-") as tmp:
        for image in ("tensor", "png"):
            chunks = iter_batches(CHUNK_ROWS, "tensor") if image == "tensor" else iter_frames(CHUNK_ROWS)
            ds = shardkit.write_dataset(chunks, Path(tmp) / image, schema=shardkit_schema(image),
                                        compression=COMPRESSION, progress=False)
            md = pq.read_metadata(Path(tmp) / image / "_metadata")
            parts.append(str(md.schema.to_arrow_schema().metadata))
            for i in range(md.num_row_groups):
                rg = md.row_group(i)
                parts.append(str(rg.num_rows))
                for j in range(rg.num_columns):
                    c = rg.column(j)
                    parts.append(f"{c.path_in_schema}:{c.physical_type}:{sorted(c.encodings)}:"
                                 f"{c.compression}:{c.is_stats_set}:page index {c.has_offset_index}")
            parts.append(str(len(ds.row_groups)))
            with_crc, pages = page_checksums(Path(tmp) / image)
            parts.append(f"page checksums: {'all' if with_crc == pages else 'some' if with_crc else 'none'}")
            parts.append(f"pages: {pages}")  # how the writer cuts pages (`PAGE_BYTES`)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:8]


def shardkit_path(rows: int, image: ImageLayout = "tensor", compression: str = COMPRESSION) -> Path:
    suffix = "" if compression == COMPRESSION else f"-{compression}"
    return CACHE / f"shardkit-v{VERSION}-w{writer_key()}-{image}-n{rows}{suffix}"


def materialize_raw(rows: int) -> Path:
    """The rows as one plain Parquet file (arrays as ``fixed_size_list``, snappy); built once, cached."""
    path = raw_path(rows)
    if path.exists():
        return path
    tmp = path.parent.with_name(path.parent.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with pq.ParquetWriter(tmp / path.name, arrow_schema("list"), compression=COMPRESSION) as writer:
        for batch in iter_batches(rows, "list"):
            writer.write_batch(batch)
    tmp.rename(path.parent)  # the folder appears complete or not at all
    return path


def materialize_shardkit(rows: int, image: ImageLayout = "tensor", compression: str = COMPRESSION) -> Path:
    """The rows as a shardkit dataset, written by `shardkit.write_dataset` chunk by chunk; cached.

    Tensor images go in as Arrow record batches; PNG images as pandas frames, because `ImageCodec`
    does not take ``fixed_shape_tensor`` Arrow input yet. ``compression``: `COMPRESSION` (snappy, as
    every other reader's copy, for like-for-like comparisons) or, e.g., ``"auto"`` (shardkit's default).
    """
    path = shardkit_path(rows, image, compression)
    if (path / "_metadata").exists():
        return path
    chunks = iter_batches(rows, "tensor") if image == "tensor" else iter_frames(rows)
    shardkit.write_dataset(chunks, path, schema=shardkit_schema(image), mode="overwrite",
                           compression=compression, progress=False)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description="materialize the benchmark data under .bench/data/")
    parser.add_argument("rows", type=int, nargs="?", default=REFERENCE_ROWS)
    parser.add_argument("--image", choices=["tensor", "png"], action="append")
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"raw: {materialize_raw(args.rows)} ({time.perf_counter() - started:.1f} s)")
    for image in args.image or ["tensor"]:
        started = time.perf_counter()
        path = materialize_shardkit(args.rows, image)
        print(f"shardkit-{image}: {path} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
