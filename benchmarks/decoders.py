"""JPEG DECODERS benchmark: the decoders of `shardkit.dataset.codecs._jpeg` side by side, same JPEGs, one run.

The images: 256x256 RGB photo-like JPEGs (a smooth colour field, mid-frequency texture and sensor
noise), quality 90, 4:2:0 (Pillow's default), about 24 KB each (the images workload's kind), generated
deterministically; ``--size 1024`` for larger ones, where DCT scaling saves more. Each case decodes all
of them into one preallocated ``(n, size, size, 3)`` array, in slices of 256 as
`shardkit.dataset.codecs.image.decode_images` does:

    shardkit-general   the general path as it was: `image.decode_image` per image (Pillow)
    pillow             decode_jpegs(decoder="pillow")
    simplejpeg         decode_jpegs(decoder="simplejpeg")      (decodes into the output row)
    opencv             decode_jpegs(decoder="opencv")
    simplejpeg-fast    decode_jpegs(decoder="simplejpeg", fast=True)   (opt-in: other pixels)
    pillow-1/2, simplejpeg-1/2, opencv-1/2   scale=0.5: DCT scaling, 128x128 out (opt-in)
    torchvision        torchvision.io.decode_jpeg per image, where torchvision imports

Printed per case, medians of ``--rounds`` rounds that run every case in turn (drift on a shared machine
hits every case alike): ms per image on one thread (wall, and the thread's CPU time: on a busy machine
the steadier figure, and the ratio to the general path's is of CPU time), images/s on two
threads (two halves in a thread pool: near 2x one thread's where the GIL is released and two cores are
free), the two threads' CPU-seconds per wall second, and how many images have exactly Pillow's pixels
(at 1/2: Pillow's ``draft`` pixels), and the GIL wait (`releases_gil`: near 0, the GIL is released
while decoding; near 1, held).

Usage (from the repository root):
    python -m benchmarks.decoders              # 512 images, 5 rounds; saves results/decoders-<machine>.json
    python -m benchmarks.decoders --quick      # 64 images, 1 round, not saved
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from benchmarks.common import machine_id, machine_info, save_results, table
from shardkit import Field, ImageCodec
from shardkit.dataset.codecs import _jpeg, image

SIZE = 256
SLICE = 256  # images per call, as decode_images' thread-pool tasks


def photo(rng: np.random.Generator, size: int = SIZE) -> np.ndarray:
    """A photo-like RGB image: a smooth colour field, mid-frequency texture and sensor noise."""
    small = rng.uniform(0, 255, (size // 32 + 1, size // 32 + 1, 3)).astype(np.uint8)
    base = np.asarray(Image.fromarray(small).resize((size, size), Image.Resampling.BICUBIC), np.float32)
    mid = np.clip(rng.normal(128, 40, (size // 4, size // 4)), 0, 255).astype(np.uint8)
    texture = np.asarray(Image.fromarray(mid).resize((size, size), Image.Resampling.BILINEAR), np.float32)
    pixels = base + texture[:, :, None] - 128 + rng.normal(0, 6, (size, size, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def jpegs(n: int, quality: int = 90, size: int = SIZE) -> list[bytes]:
    rng = np.random.default_rng(37)
    blobs = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(photo(rng, size)).save(buf, "JPEG", quality=quality)
        blobs.append(buf.getvalue())
    return blobs


Case = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]  # (data, starts, ends, out)


def cases(size: int = SIZE) -> dict[str, tuple[Case, float | None]]:
    """name -> (decode a slice into out, its scale)."""
    field = Field("image", "uint8", (size, size, 3), codec=ImageCodec("jpeg"))

    def general(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, out: np.ndarray) -> None:
        for k, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            out[k] = image.decode_image(data[a:b], field, k, 0)

    def fast_path(decoder: str, scale: float | None = None, fast: bool = False) -> Case:
        def run(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, out: np.ndarray) -> None:
            done = _jpeg.decode_jpegs(data, starts, ends, out, channels=3, decoder=decoder,  # type: ignore[arg-type]
                                      scale=scale, fast=fast, size=(size, size))
            if not done.all():
                raise RuntimeError(f"{decoder}: {int((~done).sum())} images left to the general path")
        return run

    table_: dict[str, tuple[Case, float | None]] = {"shardkit-general": (general, None)}
    for name in ("pillow", "simplejpeg", "opencv"):
        if _jpeg._installed(name):
            table_[name] = (fast_path(name), None)
    if _jpeg._installed("simplejpeg"):
        table_["simplejpeg-fast"] = (fast_path("simplejpeg", fast=True), None)
    for name in ("pillow", "simplejpeg", "opencv"):
        if _jpeg._installed(name):
            table_[f"{name}-1/2"] = (fast_path(name, 0.5), 0.5)
    try:
        import torch
        from torchvision.io import decode_jpeg

        def tv(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, out: np.ndarray) -> None:
            for k, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
                out[k] = decode_jpeg(torch.from_numpy(data[a:b].copy())).permute(1, 2, 0).numpy()

        table_["torchvision"] = (tv, None)
    except Exception as e:  # not installed, or a build that does not load with this torch
        print(f"torchvision: not measured ({type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
    return table_


def measure(case: Case, data: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> dict[str, float]:
    n = len(offsets) - 1
    cuts = list(range(0, n, SLICE))

    def run(lo: int, hi: int) -> None:
        for a in range(lo, hi, SLICE):
            b = min(hi, a + SLICE)
            case(data, offsets[a:b], offsets[a + 1 : b + 1], out[a:b])

    wall, cpu = time.perf_counter(), time.thread_time()
    for a in cuts:
        run(a, min(n, a + SLICE))
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    half = (n // 2) // SLICE * SLICE or n // 2
    with ThreadPoolExecutor(2) as pool:
        wall2, cpu2 = time.perf_counter(), time.process_time()
        list(pool.map(lambda span: run(*span), [(0, half), (half, n)]))
        wall2, cpu2 = time.perf_counter() - wall2, time.process_time() - cpu2
    return {"ms_per_image": wall / n * 1e3, "cpu_ms_per_image": cpu / n * 1e3,
            "images_per_s_2_threads": n / wall2, "cpu_per_wall_2_threads": cpu2 / wall2}


def releases_gil(case: Case, data: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> float:
    """How long this thread waits for the GIL while another decodes, as a fraction of that decoding's
    time, with Python's forced switch put off (switch interval 10 s): a decoder that releases the GIL
    lets this thread in at its first decode (a fraction near 0), one that holds it only when its whole
    loop ends (near 1). Independent of the machine's load, unlike a 2-thread speed-up."""
    n = len(offsets) - 1
    started, finished = threading.Event(), threading.Event()
    spans: dict[str, float] = {}

    def work() -> None:
        spans["start"] = time.perf_counter()
        started.set()
        for a in range(0, n, SLICE):
            b = min(n, a + SLICE)
            case(data, offsets[a:b], offsets[a + 1 : b + 1], out[a:b])
        spans["end"] = time.perf_counter()
        finished.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        entered = time.perf_counter()  # this thread runs again: it got the GIL
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    return (entered - spans["start"]) / (spans["end"] - spans["start"])


def reference(blobs: list[bytes], scale: float | None) -> list[np.ndarray]:
    pixels = []
    for blob in blobs:
        with Image.open(io.BytesIO(blob)) as im:
            if scale is not None:
                im.draft("RGB", (int(im.width * scale), int(im.height * scale)))
            pixels.append(np.asarray(im))
    return pixels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 images, 1 round, not saved")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=SIZE, help="the images' side in pixels")
    parser.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/")
    args = parser.parse_args(argv)
    n, rounds = (64, 1) if args.quick else (args.images, args.rounds)
    size = args.size
    blobs = jpegs(n, size=size)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
    data = np.frombuffer(b"".join(blobs), np.uint8)
    table_ = cases(size)
    info = machine_info()
    kb = np.percentile([len(b) / 1024 for b in blobs], [0, 50, 100])
    load = os.getloadavg()
    print(f"decoders benchmark on {machine_id(info)} ({info['cpu_model']}): {n} JPEGs {size}x{size} RGB "
          f"q90 4:2:0, {kb[0]:.1f}/{kb[1]:.1f}/{kb[2]:.1f} KB min/median/max, {rounds} rounds, "
          f"load {load[0]:.2f}", file=sys.stderr)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in table_}
    outs = {name: np.zeros((n, *_jpeg.scaled_shape((size, size, 3), s)), np.uint8)
            for name, (_, s) in table_.items()}
    for _ in range(rounds):
        for name, (case, _scale) in table_.items():
            runs[name].append(measure(case, data, offsets, outs[name]))
    gil = {name: releases_gil(case, data, offsets, outs[name]) for name, (case, _) in table_.items()}
    refs = {s: reference(blobs, s) for s in {s for _, s in table_.values()}}
    results: list[dict[str, Any]] = []
    for name, (_, scale) in table_.items():
        same = sum(int(np.array_equal(a, b)) for a, b in zip(outs[name], refs[scale], strict=True))
        med = {k: statistics.median(r[k] for r in runs[name]) for k in runs[name][0]}
        results.append({"case": name, **med, "gil_wait": gil[name], "identical_to_pillow": same, "images": n,
                        "runs": runs[name]})
    base = next(r for r in results if r["case"] == "shardkit-general")["cpu_ms_per_image"]
    text = table(
        ["decoder", "ms/image (1 thread)", "CPU ms/image", "CPU: general / this", "images/s (2 threads)",
         "CPU/wall (2 threads)", "GIL wait", "pixels = Pillow's"],
        [[r["case"], f"{r['ms_per_image']:.3f}", f"{r['cpu_ms_per_image']:.3f}",
          f"{base / r['cpu_ms_per_image']:.2f}x", f"{r['images_per_s_2_threads']:,.0f}",
          f"{r['cpu_per_wall_2_threads']:.2f}", f"{r['gil_wait']:.3f}", f"{r['identical_to_pillow']}/{n}"]
         for r in results])
    print(text)
    print(f"load average after: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if not (args.quick or args.no_save):
        name = "decoders" if size == SIZE else f"decoders{size}"
        path = save_results(name, {"images": n, "size": size, "rounds": rounds, "kb": list(kb),
                                   "load": load[0], "table": text, "results": results})
        print(f"saved {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
