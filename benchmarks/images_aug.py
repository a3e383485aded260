"""The image benchmark's workload: its synthetic photos, and the one augmentation every system runs.

Imported in shardkit's venv and in the peers' (``.bench/images-venv``), so it needs only numpy, Pillow
and torch, and no torchvision: shardkit's venv has none, and the registry's torchvision is a CUDA build.
`augment` has torchvision's semantics (``RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3),
antialias=True)`` on a PIL image: crop, then Pillow's bilinear resize; ``RandomHorizontalFlip()``; a
uint8 CHW tensor), and the same function runs for shardkit, LitData and Mosaic, so the comparison is
between the loaders, not between two implementations of the augmentation.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np

SIZE = 256  # the stored images are SIZE x SIZE RGB JPEGs
CROP = 224
QUALITY = 90
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
PASSES = 5  # timed passes over the images of `case_work`


def crop_box(height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``: (top, left, height, width) of the crop."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height  # fallback: the central crop of the nearest allowed ratio
    if in_ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif in_ratio > RATIO[1]:
        h, w = height, round(height * RATIO[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def augment_pil(img: Any, rng: np.random.Generator) -> Any:
    """RandomResizedCrop(224) + RandomHorizontalFlip of a PIL image, as a uint8 CHW torch tensor."""
    import torch
    from PIL import Image

    top, left, h, w = crop_box(img.height, img.width, rng)
    out = img.resize((CROP, CROP), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(out)).permute(2, 0, 1).contiguous()


def augment_array(image: np.ndarray, rng: np.random.Generator) -> Any:
    """`augment_pil` of an HxWxC uint8 array (what shardkit's reader decodes an image field to)."""
    from PIL import Image

    return augment_pil(Image.fromarray(image), rng)


def augment(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """The per-sample transform (``fn(sample, rng)``): the sample with its image augmented."""
    return {**sample, "image": augment_array(sample["image"], rng)}


def decode(data: bytes) -> Any:
    """Pillow's decode of JPEG bytes, as a PIL RGB image."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def decode_array(data: bytes) -> np.ndarray:
    """Pillow's decode of JPEG bytes, as an HxWxC uint8 array."""
    return np.array(decode(data))


_BANK: dict[int, np.ndarray] = {}


def photo(i: int, size: int = SIZE, quality: int = QUALITY) -> bytes:
    """JPEG bytes of a synthetic photo ``i`` (deterministic): smooth gradients, blurred shapes, noise.

    At 256x256 and quality 90 they are ~18-29 KB each, as photos of that size are; flat synthetic
    images would compress to a few KB and make decoding unrealistically cheap.
    """
    from PIL import Image, ImageDraw, ImageFilter

    if size not in _BANK:  # a noise field to cut windows from: a normal draw per image costs 4x more
        _BANK[size] = np.random.default_rng(12345).normal(0, 1, (2 * size, 2 * size, 3)).astype(np.float32)
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    c0, c1, c2 = rng.uniform(0, 255, (3, 3)).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = np.cos(angle) * x + np.sin(angle) * y
    base = c0 + (c1 - c0) * t[..., None] + (c2 - c0) * (x * y)[..., None]
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 10))):
        x0, y0 = (int(v) for v in rng.integers(0, size, 2))
        w, h = (int(v) for v in rng.integers(max(2, size // 16), max(3, size // 2), 2))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x0 + w, y0 + h], fill=fill)
    img = img.filter(ImageFilter.BoxBlur(1))
    oy, ox = (int(v) for v in rng.integers(0, size, 2))
    noisy = np.asarray(img, dtype=np.float32) + _BANK[size][oy:oy + size, ox:ox + size] * rng.uniform(9, 15)
    out = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=quality)
    return out.getvalue()


def case_work(system: str, store: str, n: int = 2000) -> dict[str, Any]:
    """The per-image work of ``mode`` augment alone, without a loader: each of ``n`` JPEGs of ``store``
    decoded and augmented in turn on one thread (torch at one thread, as in a DataLoader worker); the
    least CPU of `PASSES` passes after a first one (on a shared machine a pass can only lose time).
    shardkit: its reader's decoder (`decode_jpeg_one`) then `augment_array`, what its transform stage runs
    per sample; LitData and Mosaic: Pillow's decode then `augment_pil`. CPU seconds per image: what a
    loader cannot go below, so the ratio of two systems' per-image CPU in the epoch is bounded by these
    (on cores both loaders keep busy, images/s follows CPU per image).

    shardkit's also gives ``stage_cpu_seconds``: the same images through its transform stage itself
    (`_Runner`, what a DataLoader worker runs per batch of 256, on one thread): each image decoded when its
    sample is taken, the sample's generators seeded from (seed, epoch, position) as the reader promises,
    the augmentation, the output's checks and its copy into the batch; no reading, shuffling or loader.
    """
    import time

    import torch

    torch.set_num_threads(1)
    root = Path(store)
    data = np.memmap(root / "images.bin", dtype=np.uint8, mode="r")
    offsets = np.load(root / "offsets.npy")
    count = min(n, len(offsets) - 1)
    blobs = [bytes(data[offsets[i]:offsets[i + 1]]) for i in range(count)]
    rng = np.random.default_rng(0)
    if system == "shardkit":
        from shardkit.dataset.codecs._jpeg import decode_jpeg_one

        def one(blob: bytes) -> Any:
            return augment_array(decode_jpeg_one(blob, 3), rng)
    else:
        def one(blob: bytes) -> Any:
            return augment_pil(decode(blob), rng)

    runs = {"cpu_seconds": lambda: [one(blob) for blob in blobs]}
    if system == "shardkit":
        runs["stage_cpu_seconds"] = _stage(data[:offsets[count]], offsets[:count + 1])
    best = dict.fromkeys(runs, float("inf"))
    for i in range(PASSES + 1):  # in turn, the first pass not timed; the least of each (the others lost time)
        for key, run in runs.items():
            cpu0 = time.process_time()
            run()
            if i:
                best[key] = min(best[key], time.process_time() - cpu0)
    return {"system": system, "images": count, **best}


def _stage(data: np.ndarray, offsets: np.ndarray, batch: int = 256) -> Any:
    """A run of shardkit's transform stage with `augment` over the JPEGs ``data[offsets[i]:offsets[i+1]]``,
    in batches of ``batch`` (see `case_work`)."""
    from shardkit.dataset import Field
    from shardkit.reader._pipeline.decode import LazyImages
    from shardkit.reader._pipeline.transform import _Runner

    field = Field("image", "uint8", (SIZE, SIZE, 3), codec="image")
    runner = _Runner(augment, None, "raise", False)
    kept: dict[tuple[Any, int], dict[str, np.ndarray]] = {}

    def allocate(spec: Any, rows: int) -> dict[str, np.ndarray]:  # reused, as a worker's segments are
        key = (tuple(sorted(spec.items())), rows)
        if key not in kept:
            kept[key] = {name: np.empty((rows, *k[1]), np.dtype(k[2])) for name, k in spec.items()}
        return kept[key]

    runner.allocate = allocate
    count = len(offsets) - 1
    ids = np.arange(count, dtype=np.int64)

    def run() -> None:
        spec = None
        for a in range(0, count, batch):
            b = min(a + batch, count)
            columns = {"image": LazyImages(field, data, offsets[a:b], offsets[a + 1:b + 1]), "id": ids[a:b]}
            spec = runner.run(columns, epoch=0, seed=0, keys=ids[a:b], spec=spec).spec  # type: ignore[arg-type]
    return run
