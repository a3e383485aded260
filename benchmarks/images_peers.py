"""LitData and Mosaic Streaming cases of `benchmarks.images`; they run in the peers' venv (`images_env`).

This module imports nothing outside the standard library at import time, so ``benchmarks.common``'s
child runner calls it there: ``run_case("benchmarks.images_peers:case_read", {...}, python=PEERS)``.
Each system is used as its docs show: LitData ``optimize()`` + ``StreamingDataset(transform=)`` +
``StreamingDataLoader``; Mosaic ``MDSWriter`` + a ``StreamingDataset`` whose ``__getitem__`` transforms
+ ``StreamingDataLoader``; both with ``num_workers=2``, batch 256, shuffle on, seed 0.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

BATCH = 256
WORKERS = 2
UNIT = 2000  # images per LitData chunk and (about) per MDS shard


def import_streaming() -> Any:
    """``import streaming``, which imports torchvision: the registry's torchvision 0.28 is a CUDA build
    whose ops do not load on the CPU torch (``operator torchvision::nms does not exist``); declaring the
    ops it registers at import first lets it import (nothing here calls them)."""
    import sys

    import torch

    try:
        import streaming
    except RuntimeError:
        for name in [m for m in sys.modules if m.split(".")[0] in ("torchvision", "streaming")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):  # the two it registers fake kernels for whether its ops loaded or not
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        globals()["_TV_LIB"] = lib  # the ops live as long as the library object
        import streaming
    return streaming


# -- the source JPEGs (written by benchmarks.images: one file of bytes, offsets, labels) -------------------

@functools.cache
def _store(path: str) -> tuple[Any, Any, Any]:
    import numpy as np

    root = Path(path)
    return (np.memmap(root / "images.bin", dtype=np.uint8, mode="r"), np.load(root / "offsets.npy"),
            np.load(root / "labels.npy"))


def _jpeg(path: str, i: int) -> bytes:
    data, offsets, _ = _store(path)
    return bytes(data[offsets[i]:offsets[i + 1]])


def _lit_item(path: str, i: int) -> dict[str, Any]:
    _, _, labels = _store(path)
    return {"image": _jpeg(path, i), "label": int(labels[i]), "id": int(i)}


# -- per-sample work, the same function for every system -----------------------------------------------

_RNG: dict[int, Any] = {}


def _rng() -> Any:
    import numpy as np

    pid = os.getpid()  # a generator per DataLoader worker, made there (a forked copy would repeat crops)
    if pid not in _RNG:
        _RNG[pid] = np.random.default_rng()
    return _RNG[pid]


def transform(mode: str, item: dict[str, Any]) -> dict[str, Any]:
    """What a worker does with one stored sample in ``mode``: augment, decode or raw (nothing)."""
    import torch

    from benchmarks.images_aug import augment_pil, decode, decode_array

    if mode == "augment":
        return {**item, "image": augment_pil(decode(item["image"]), _rng())}
    if mode == "decode":
        return {**item, "image": torch.from_numpy(decode_array(item["image"]))}
    # LitData gives a memoryview, which cannot go through a DataLoader's pipe; Mosaic gives bytes (kept)
    return {**item, "image": bytes(item["image"])}


# -- writing --------------------------------------------------------------------------------------------

def case_convert(system: str, store: str, out: str, n: int) -> dict[str, Any]:
    """Write the ``n`` JPEGs of ``store`` in ``system``'s format at ``out``; time it, then check the bytes.

    Also writes ``out/layout.json``: each id's storage position and unit (chunk or shard), for the
    shuffle-quality figures.
    """
    import shutil

    from benchmarks.common import _cpu_ticks

    shutil.rmtree(out, ignore_errors=True)
    tick = os.sysconf("SC_CLK_TCK")
    cpu0, started = _cpu_ticks("self"), time.perf_counter()
    if system == "litdata":
        from litdata import optimize

        optimize(fn=functools.partial(_lit_item, store), inputs=list(range(n)), output_dir=out,
                 chunk_size=UNIT, num_workers=WORKERS, mode="overwrite", verbose=False)
    else:
        streaming = import_streaming()
        data, offsets, labels = _store(store)
        mean = int(offsets[-1]) / n
        with streaming.MDSWriter(out=out, columns={"image": "bytes", "label": "int", "id": "int"},
                                 size_limit=int(UNIT * (mean + 32)), progress_bar=False) as writer:
            for i in range(n):
                writer.write({"image": bytes(data[offsets[i]:offsets[i + 1]]), "label": int(labels[i]),
                              "id": i})
    seconds = time.perf_counter() - started
    cpu = (_cpu_ticks("self") - cpu0) / tick
    identical, position, unit = _check(system, store, out, n)
    Path(out, "layout.json").write_text(json.dumps({"position": position, "unit": unit}))
    return {"system": system, "images": n, "seconds": seconds, "cpu_seconds": cpu, "identical": identical,
            "units": len(set(unit))}


def _check(system: str, store: str, out: str, n: int) -> tuple[int, list[int], list[int]]:
    """How many stored images are byte-identical to the input; each id's position and unit."""
    import numpy as np

    index = json.loads(Path(out, "index.json").read_text())
    if system == "litdata":
        from litdata import StreamingDataset

        ds = StreamingDataset(out)
        sizes = [c["chunk_size"] for c in index["chunks"]]
    else:
        streaming = import_streaming()
        streaming.base.util.clean_stale_shared_memory()
        ds = streaming.StreamingDataset(local=out, shuffle=False, batch_size=BATCH)
        sizes = [s["samples"] for s in index["shards"]]
    bounds = np.cumsum(sizes)
    position, unit = [0] * n, [0] * n
    identical = 0
    for pos in range(len(ds)):
        item = ds[pos]
        i = int(item["id"])
        position[i], unit[i] = pos, int(np.searchsorted(bounds, pos, side="right"))
        identical += bytes(item["image"]) == _jpeg(store, i)
    return identical, position, unit


# -- reading --------------------------------------------------------------------------------------------

class _Transformed:  # built lazily: the class needs streaming imported
    cls: Any = None


def _mosaic_dataset(path: str, mode: str, shuffle_block: int | None, local: str | None = None) -> Any:
    """Mosaic's dataset of the MDS folder ``path``, or of the remote ``path`` cached in ``local``."""
    streaming = import_streaming()
    if _Transformed.cls is None:
        class MosaicImages(streaming.StreamingDataset):  # type: ignore[misc,name-defined]
            """Mosaic's documented way to transform: a subclass whose ``__getitem__`` does it."""

            def __init__(self, mode: str, **kwargs: Any) -> None:
                super().__init__(**kwargs)
                self.mode = mode

            def __getitem__(self, idx: int) -> Any:
                return transform(self.mode, super().__getitem__(idx))

        _Transformed.cls = MosaicImages
    streaming.base.util.clean_stale_shared_memory()
    extra = {"shuffle_block_size": shuffle_block} if shuffle_block else {}
    where = {"local": path} if local is None else {"remote": path, "local": local}
    return _Transformed.cls(mode, **where, shuffle=True, shuffle_seed=0, shuffle_algo="py1e",
                            batch_size=BATCH, **extra)


def case_read(system: str, mode: str, path: str, stop_after: int | None = None,
              state_out: str | None = None, state_in: str | None = None,
              shuffle_block: int | None = None) -> dict[str, Any]:
    """One epoch (or its first ``stop_after`` batches, or its rest from ``state_in``) in ``mode``.

    Returns images/s inputs (images, seconds), the first batch's seconds from making the dataset, the
    epoch's CPU seconds (this process and its DataLoader workers, reaped at the epoch's end) and the id
    of every sample in every batch, in the order delivered.
    """
    import torch

    from benchmarks.common import _cpu_ticks
    from benchmarks.images_epoch import drain

    if system == "litdata":  # imports before the clock starts, as for shardkit
        from litdata import StreamingDataLoader, StreamingDataset
    else:
        streaming = import_streaming()
    tick = os.sysconf("SC_CLK_TCK")
    cpu0, started = _cpu_ticks("self"), time.perf_counter()
    if system == "litdata":
        ds = StreamingDataset(path, shuffle=True, seed=0, transform=functools.partial(transform, mode))
        loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    else:
        ds = _mosaic_dataset(path, mode, shuffle_block)
        loader = streaming.StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    if state_in:
        loader.load_state_dict(torch.load(state_in, weights_only=False))
    read = drain(loader, started, stop_after,
                 save=(lambda: torch.save(loader.state_dict(), state_out)) if state_out else None)
    cpu = (_cpu_ticks("self") - cpu0) / tick
    return {"system": system, "mode": mode, **read, "cpu_seconds": cpu}


def case_s3_first(system: str, mode: str, url: str, endpoint: str, cache_dir: str) -> dict[str, Any]:
    """The first batch from ``url`` on the S3 server at ``endpoint``, with an empty ``cache_dir``
    (`benchmarks.images_s3`): LitData ``StreamingDataset(url, cache_dir=, storage_options={"endpoint_url":
    ...})``, Mosaic ``StreamingDataset(remote=url, local=cache_dir)`` (its endpoint from ``S3_ENDPOINT_URL``);
    the loader as in `case_read`, stopped after one batch. Returns what `case_read` does, less the seconds,
    plus the bytes in ``cache_dir`` at the first batch and the ``time.monotonic()`` its clock started at."""
    from benchmarks.images_s3 import folder_bytes, s3_env

    s3_env(endpoint)
    import boto3  # noqa: F401  (both systems' S3 client: imported before the clock, as s3fs for shardkit)

    from benchmarks.common import _cpu_ticks
    from benchmarks.images_epoch import drain

    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming import downloader

        # its default remote path (obstore's async prefetch) refuses an http:// endpoint unless the client
        # allows it, and LitData passes no way to: allowed here, so it reads as it would from https S3
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]
    else:
        streaming = import_streaming()
    tick = os.sysconf("SC_CLK_TCK")
    at_first: dict[str, int] = {}
    cpu0, started, clock = _cpu_ticks("self"), time.perf_counter(), time.monotonic()
    if system == "litdata":
        ds = StreamingDataset(url, cache_dir=cache_dir, storage_options={"endpoint_url": endpoint},
                              shuffle=True, seed=0, transform=functools.partial(transform, mode))
        loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    else:
        ds = _mosaic_dataset(url, mode, None, local=cache_dir)
        loader = streaming.StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    read = drain(loader, started, 1, save=lambda: at_first.update(cached=folder_bytes(cache_dir)))
    cpu = (_cpu_ticks("self") - cpu0) / tick
    read.pop("seconds")
    return {"system": system, "mode": mode, **read, "cpu_seconds": cpu, "clock": clock,
            "cached_bytes": at_first.get("cached", 0)}
