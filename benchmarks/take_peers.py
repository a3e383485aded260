"""The peers' side of `benchmarks.take`: Hugging Face datasets, Mosaic Streaming, LitData and Lance, each
looking rows up by index on its own copy of the same rows. Each runs in its own pinned venv (HF's
``.bench/hf-venv``, the images venv for LitData and Mosaic, ``.bench/lance-venv`` for Lance), so this
module imports nothing outside the standard library at import time: ``benchmarks.common``'s child runner
calls it there (``run_case("benchmarks.take_peers:case_lookup", {...}, python=...)``).

What a lookup returns, as each system's users get it:
    hf       ``Dataset.load_from_disk(path).with_format("numpy", dtype=None)``; ``ds[i]``, ``ds[indices]``
             (columns; ``dtype=None`` keeps uint8 pixels, HF's fastest numpy path)
    mosaic   ``streaming.StreamingDataset(local=path)`` (or ``remote=s3://..., local=<empty folder>``);
             ``ds[i]``, a batch as ``[ds[i] for i in indices]`` (it has no batched lookup)
    litdata  ``litdata.StreamingDataset(path)`` (or ``"s3://...", cache_dir=<empty folder>``); the same
    lance    ``lance.dataset(path).take(indices)`` (an Arrow table), its columns to numpy
The images workload stores the JPEG bytes; every peer decodes them with Pillow (HxWxC uint8), as shardkit's
lookups return decoded images.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

ROWS_COLUMNS = ["id", "label", "features", "image", "text"]


def _decode(data: Any) -> Any:
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(bytes(data))).convert("RGB"))


def _cpu() -> float:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- building each system's copy ---------------------------------------------------------------------------

def case_build(system: str, workload: str, source: str, out: str, unit: int) -> dict[str, Any]:
    """Write ``system``'s copy of the rows at ``out``, ``unit`` rows per storage unit.

    ``source``: for mosaic/litdata, a folder of ``.npy`` columns (rows) or the images benchmark's JPEG
    store (images); for lance, a Parquet file of the same rows (the read benchmark's plain copy, or the
    JPEG bytes as a binary column).
    """
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    if system == "lance":
        import lance
        import pyarrow.parquet as pq

        f = pq.ParquetFile(source)
        lance.write_dataset(f.iter_batches(batch_size=unit), out, schema=f.schema_arrow,
                            max_rows_per_group=min(unit, 1024 * 1024), max_rows_per_file=1 << 30)
        rows = f.metadata.num_rows
    else:
        columns, n = _source(workload, source)
        if system == "mosaic":
            from benchmarks.images_peers import import_streaming

            streaming = import_streaming()
            spec = ({"id": "int64", "label": "int32", "features": "ndarray:float32:128",
                     "image": "ndarray:uint8:32,32,3", "text": "str"} if workload == "rows"
                    else {"id": "int64", "label": "int64", "image": "bytes"})
            per_row = (3636 if workload == "rows" else int(columns["offsets"][-1]) // n) + 64
            with streaming.MDSWriter(out=out, columns=spec, size_limit=int(unit * per_row),
                                     progress_bar=False) as writer:
                for i in range(n):
                    writer.write(_item(columns, workload, i))
        else:
            import functools

            from litdata import optimize

            optimize(fn=functools.partial(_lit_item, workload, source), inputs=list(range(n)), output_dir=out,
                     chunk_size=unit, num_workers=2, mode="overwrite", verbose=False)
        rows = n
    return {"system": system, "rows": rows, "seconds": time.perf_counter() - started}


_SOURCES: dict[str, Any] = {}


def _source(workload: str, source: str) -> tuple[dict[str, Any], int]:
    import numpy as np

    if source not in _SOURCES:
        root = Path(source)
        if workload == "rows":
            cols = {c: np.load(root / f"{c}.npy", mmap_mode="r") for c in ROWS_COLUMNS}
            _SOURCES[source] = (cols, len(cols["id"]))
        else:
            offsets = np.load(root / "offsets.npy")
            cols = {"data": np.memmap(root / "images.bin", dtype=np.uint8, mode="r"), "offsets": offsets,
                    "labels": np.load(root / "labels.npy")}
            _SOURCES[source] = (cols, len(offsets) - 1)
    return _SOURCES[source]  # type: ignore[no-any-return]


def _item(columns: dict[str, Any], workload: str, i: int) -> dict[str, Any]:
    import numpy as np

    if workload == "rows":
        return {"id": int(columns["id"][i]), "label": int(columns["label"][i]),
                "features": np.ascontiguousarray(columns["features"][i]),
                "image": np.ascontiguousarray(columns["image"][i]), "text": str(columns["text"][i])}
    o = columns["offsets"]
    return {"id": i, "label": int(columns["labels"][i]), "image": bytes(columns["data"][o[i]:o[i + 1]])}


def _lit_item(workload: str, source: str, i: int) -> dict[str, Any]:
    columns, _ = _source(workload, source)
    return _item(columns, workload, i)


# -- lookups ------------------------------------------------------------------------------------------------

def _s3(endpoint: str) -> None:
    os.environ.update({
        "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "AWS_ALLOW_HTTP": "true",
        "S3_ENDPOINT_URL": endpoint,
    })


def case_lookup(system: str, workload: str, path: str, kind: str, indices: str, seconds: float,
                endpoint: str | None = None, cache_dir: str | None = None) -> dict[str, Any]:
    """Look rows up in ``system``'s copy at ``path`` (a folder, or an s3:// URL served at ``endpoint``)
    for ``seconds`` (at least one lookup), in the order of the ``.npy`` file ``indices`` (one row per
    lookup for ``kind="single"``, rows of 256 for ``"batch"``); the shape of `benchmarks.take`'s result."""
    import numpy as np

    order = np.load(indices)
    if endpoint:
        _s3(endpoint)
    images = workload == "images"
    if system == "hf":
        import datasets

        def opened() -> Any:
            return datasets.load_from_disk(path).with_format("numpy", dtype=None)

        def single(ds: Any, i: int) -> Any:
            row = ds[i]
            if images:
                row["image"] = _decode(row["image"])
            return row["id"]

        def batch(ds: Any, idx: Any) -> Any:
            cols = ds[idx.tolist()]
            if images:
                cols["image"] = [_decode(b) for b in cols["image"]]
            return cols["id"]
    elif system == "lance":
        import lance

        opts = ({"access_key_id": "x", "secret_access_key": "x", "region": "us-east-1", "endpoint": endpoint,
                 "allow_http": "true", "virtual_hosted_style_request": "false"} if endpoint else None)

        def opened() -> Any:
            return lance.dataset(path, storage_options=opts)

        def columns_of(t: Any) -> dict[str, Any]:
            out = {}
            for name in t.column_names:
                col = t.column(name).combine_chunks()
                if name in ("features", "image") and not images:
                    out[name] = col.flatten().to_numpy().reshape(len(col), -1)
                elif name == "image":
                    out[name] = [_decode(b) for b in col.to_pylist()]
                else:
                    out[name] = col.to_numpy(zero_copy_only=False)
            if not images:
                out["image"] = out["image"].reshape(-1, 32, 32, 3)
            return out

        def single(ds: Any, i: int) -> Any:
            return columns_of(ds.take([i]))["id"]

        def batch(ds: Any, idx: Any) -> Any:
            return columns_of(ds.take(idx))["id"]
    else:
        if system == "mosaic":
            from benchmarks.images_peers import import_streaming

            streaming = import_streaming()

            def opened() -> Any:
                streaming.base.util.clean_stale_shared_memory()
                where = {"remote": path, "local": cache_dir} if endpoint else {"local": path}
                return streaming.StreamingDataset(**where, shuffle=False, batch_size=256)
        else:
            from litdata import StreamingDataset
            from litdata.streaming import downloader

            downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]

            def opened() -> Any:
                if endpoint:
                    return StreamingDataset(path, cache_dir=cache_dir,
                                            storage_options={"endpoint_url": endpoint})
                return StreamingDataset(path)

        def sample(ds: Any, i: int) -> Any:
            row = dict(ds[int(i)])  # a copy: LitData gives the same dict again for the same index
            if images:
                row["image"] = _decode(row["image"])
            return row

        def single(ds: Any, i: int) -> Any:
            return sample(ds, i)["id"]

        def batch(ds: Any, idx: Any) -> Any:
            return [sample(ds, i)["id"] for i in idx]
    if endpoint and system == "mosaic":
        import boto3  # noqa: F401  (Mosaic's S3 client, imported before the clock)
    return _timed(opened, single if kind == "single" else batch, order, seconds)


def _timed(opened: Any, lookup: Any, order: Any, seconds: float) -> dict[str, Any]:
    """Open, then look up ``order``'s rows (one lookup per entry) until ``seconds`` pass; the figures."""
    import numpy as np

    cpu0, t0, clock0 = _cpu(), time.perf_counter(), time.monotonic()
    ds = opened()
    open_s = time.perf_counter() - t0
    clock1, t1 = time.monotonic(), time.perf_counter()
    lookups = rows = id_sum = 0
    for entry in order:
        ids = lookup(ds, int(entry)) if np.ndim(entry) == 0 else lookup(ds, entry)
        id_sum += int(np.sum(np.asarray(ids, dtype=np.int64)))
        rows += int(np.size(entry))
        lookups += 1
        if time.perf_counter() - t1 >= seconds:
            break
    t2 = time.perf_counter()
    return {"lookups": lookups, "rows": rows, "seconds": t2 - t1, "open_seconds": open_s,
            "cpu_seconds": _cpu() - cpu0, "id_sum": id_sum, "clock_open": clock0, "clock_start": clock1,
            "clock_end": time.monotonic(), "load": os.getloadavg()[0]}

