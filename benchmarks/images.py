"""IMAGES benchmark: JPEG pipelines in shardkit beside LitData and Mosaic Streaming (issue 37's workload).

The workload: ``--images`` synthetic 256x256 RGB photos (`images_aug.photo`: gradients, blurred shapes,
noise; JPEG quality 90, ~18-29 KB each), with a label and an id; THE SAME JPEG bytes written in each
format, ~2,000 images per storage unit (shardkit row group, LitData chunk, MDS shard). Loaders as their
users write them: torch DataLoader-type with ``num_workers=2``, batch 256, shuffle on, seed 0:

    shardkit   ShardkitIterableDataset(url, batch_size=256, seed=0) + DataLoader(ds, batch_size=None,
               num_workers=2); the augmentation per sample (``transform=`` where the reader has it, else
               in ``collate=``)
    litdata    litdata.StreamingDataset(dir, shuffle=True, seed=0, transform=fn) + StreamingDataLoader
    mosaic     streaming.StreamingDataset(local=dir, shuffle=True, shuffle_seed=0) (py1e), its
               ``__getitem__`` transforming, + streaming.StreamingDataLoader

Modes: ``augment`` (Pillow decode, then RandomResizedCrop(224) + RandomHorizontalFlip + uint8 CHW
tensor: `images_aug.augment_pil`, one function for all three, since shardkit's venv has no
torchvision), ``decode`` (decode only: an HxWxC uint8 tensor per image) and ``raw`` (the JPEG bytes).

Every case runs in a fresh process, round-robin over the systems, ``--rounds`` times; medians, and
shardkit's ratio to each peer IN THE SAME ROUND (then their median). Per case: images/s; first batch
(seconds from making the dataset to the first batch); peak PSS of the process tree (``smaps_rollup`` of
the process and every descendant, summed, sampled every 50 ms by this driver); CPU seconds of the epoch
(the process and its reaped DataLoader workers); shuffle quality from the ids delivered (distinct
storage units per 256-batch, uniform ~10 here; mean gap of storage positions of adjacent samples over
a uniform shuffle's N/3). Also: mid-epoch resume (a process reads k batches and saves the loader's state,
a new one resumes; the union must be the uninterrupted epoch of the same seed); the conversion of the
JPEGs (shardkit `write_dataset` with the bytes as the image field's values vs LitData ``optimize()`` vs
``MDSWriter``, and how many stored images are byte-identical to the input); and "reach": the shuffle
on a dataset 10x larger than the shuffle's memory (``--reach-images`` tiny JPEGs, raw bytes, only
the order of ids is used), shardkit with ``shuffle_buffer`` = N/10 rows beside Mosaic's py1e with
``shuffle_block_size`` = N/10, and shardkit with its defaults. And the first batch from a loopback S3
store, cold cache (`images_s3`): the three datasets on a moto server on 127.0.0.1, each system in a
fresh process (round-robin, ``--rounds``, medians) in mode augment with an EMPTY cache folder each time,
the seconds from making the dataset to the first batch, the bytes in its cache by then, and (one more
run each, through a counting relay) the bytes and requests it fetched by then.

LitData and Mosaic run in their own pinned venv (`images_env`); the data and datasets are cached in
``.bench/images/`` (the conversion writes them anew in each run).

Usage (from the repository root):
    python -m benchmarks.images              # 20,000 images, 3 rounds, saves results/images-<machine>.json
    python -m benchmarks.images --images 4000 --rounds 1 --no-save   # a quick look
    python -m benchmarks.images --quick      # smoke: 600 images, shardkit only, no S3, not saved
    python -m benchmarks.images --only-s3 --no-save   # only the S3 first batch (datasets as cached)
    python -m benchmarks.images --report-only results/images-<machine>.json   # the tables again
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_DIR,
    MARKER,
    ROOT,
    CaseFailed,
    _cpu_ticks,
    descendants,
    fmt_bytes,
    machine_id,
    machine_info,
    save_results,
    table,
    write_json,
)

BATCH = 256
WORKERS = 2
UNIT = 2000  # images per storage unit in every format
SYSTEMS = ["shardkit", "litdata", "mosaic"]
PEERS = ["litdata", "mosaic"]
MODES = ["augment", "decode", "raw"]
DATA_VERSION = 1  # bump when images_aug.photo changes: the cached JPEGs are made again
DATA = BENCH_DIR / "images"
#: issue 37's acceptance: shardkit's images/s over each peer's, per mode, in the same round
RATIO_TARGETS = {"augment": 1.3, "decode": 1.3, "raw": 1.5}
FIRST_BATCH_TARGET = 1.0
SHUFFLE_TARGET = 0.9  # of a uniform shuffle's distinct units per batch and position gap


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the JPEGs -------------------------------------------------------------------------------------------

def _photos(args: tuple[int, int, int]) -> list[bytes]:
    from benchmarks.images_aug import photo

    start, stop, size = args
    return [photo(i, size) for i in range(start, stop)]


def ensure_store(n: int, size: int = 256, distinct: int | None = None) -> Path:
    """``n`` JPEGs as one file of bytes (``images.bin``), their ``offsets.npy`` and ``labels.npy``, cached.

    ``distinct``: make only that many photos and repeat them (for the reach case, where only the order
    of ids matters and tiny images are enough).
    """
    import numpy as np

    made = min(n, distinct or n)
    root = DATA / f"jpegs-{n}-{size}px-{made}-v{DATA_VERSION}"
    if (root / "labels.npy").exists():
        return root
    _log(f"making {made:,} synthetic {size}x{size} JPEGs for {n:,} images ...")
    started = time.perf_counter()
    step = 500
    chunks = [(a, min(a + step, made), size) for a in range(0, made, step)]
    with multiprocessing.get_context("fork").Pool(WORKERS) as pool:
        photos = [b for part in pool.imap(_photos, chunks) for b in part]
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sizes = np.array([len(photos[i % made]) for i in range(n)], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    with open(tmp / "images.bin", "wb") as f:
        for i in range(n):
            f.write(photos[i % made])
    np.save(tmp / "offsets.npy", offsets)
    np.save(tmp / "labels.npy", (np.arange(n, dtype=np.int64) * 7919) % 1000)
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    _log(f"  {n:,} JPEGs, {offsets[-1] / 2**20:,.0f} MiB (mean {offsets[-1] / n / 1000:.1f} KB) "
         f"in {time.perf_counter() - started:.0f} s")
    return root


def _store_arrays(store: str) -> tuple[Any, Any, Any]:
    import numpy as np

    root = Path(store)
    return (np.memmap(root / "images.bin", dtype=np.uint8, mode="r"), np.load(root / "offsets.npy"),
            np.load(root / "labels.npy"))


# -- shardkit's cases (run in a fresh process through benchmarks.common's child runner) ------------------

def _reader_has(name: str) -> bool:
    from shardkit.reader.api import make_reader

    return name in inspect.signature(make_reader).parameters


def case_convert(system: str, store: str, out: str, n: int, size: int = 256) -> dict[str, Any]:
    """Write the JPEGs of ``store`` with `shardkit.write_dataset` (the bytes are the image field's values,
    stored as they are), ``UNIT`` rows per row group and a row group per file; time it, then count the
    byte-identical images and write ``out/layout.json`` (each id's storage position and row group)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import shardkit

    data, offsets, labels = _store_arrays(store)
    schema = shardkit.Schema([
        shardkit.Field("id", "int64"), shardkit.Field("label", "int64"),
        shardkit.Field("image", "uint8", (size, size, 3), codec=shardkit.ImageCodec("jpeg", quality=90)),
    ])

    def batches(image_type: Any = None) -> Any:
        for a in range(0, n, UNIT):
            b = min(a + UNIT, n)
            yield {"id": pa.array(np.arange(a, b)), "label": pa.array(labels[a:b]),
                   "image": pa.array([bytes(data[offsets[i]:offsets[i + 1]]) for i in range(a, b)],
                                     pa.binary())}

    tick = os.sysconf("SC_CLK_TCK")
    cpu0, started = _cpu_ticks("self"), time.perf_counter()
    # a file per row group, as each LitData chunk and MDS shard is a file of its own: the same objects in
    # the store (moto reads a whole object for each range request it answers)
    shardkit.write_dataset(batches(), out, schema=schema, mode="overwrite", row_group_size=UNIT,
                           file_size="32MiB")
    seconds = time.perf_counter() - started
    cpu = (_cpu_ticks("self") - cpu0) / tick
    position, unit = [0] * n, [0] * n
    identical = pos = units = 0
    for part in sorted(Path(out).glob("**/*.parquet")):
        f = pq.ParquetFile(part)
        for g in range(f.num_row_groups):
            t = f.read_row_group(g, columns=["id", "image"])
            for i, img in zip(t.column("id").to_pylist(), t.column("image").to_pylist(), strict=True):
                position[i], unit[i] = pos, units
                identical += img == bytes(data[offsets[i]:offsets[i + 1]])
                pos += 1
            units += 1
    Path(out, "layout.json").write_text(json.dumps({"position": position, "unit": unit}))
    if not _reader_has("decode"):  # raw bytes until the reader has decode=False: the same bytes as a blob
        bytes_schema = shardkit.Schema([*schema.fields[:2], shardkit.Field("image", "bytes")])
        shardkit.write_dataset(batches(), out + "-bytes", schema=bytes_schema, mode="overwrite",
                               row_group_size=UNIT)
    return {"system": "shardkit", "images": n, "seconds": seconds, "cpu_seconds": cpu,
            "identical": identical, "units": units}


_RNG: dict[int, Any] = {}


def _rng() -> Any:
    import numpy as np

    pid = os.getpid()  # one generator per DataLoader worker, made there
    if pid not in _RNG:
        _RNG[pid] = np.random.default_rng()
    return _RNG[pid]


def _per_sample_collate(batch: dict[str, Any]) -> dict[str, Any]:
    """The augmentation per sample in ``collate=``, for a reader without ``transform=``."""
    import torch

    from benchmarks.images_aug import augment_array

    rng = _rng()
    return {"image": torch.stack([augment_array(img, rng) for img in batch["image"]]),
            "label": torch.from_numpy(batch["label"]), "id": torch.from_numpy(batch["id"])}


def _raw_collate(batch: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {"image": list(batch["image"]), "label": torch.from_numpy(batch["label"]),
            "id": torch.from_numpy(batch["id"])}


def _shardkit_options(mode: str) -> tuple[dict[str, Any], str]:
    """The dataset's keyword arguments for ``mode``, and how the augmentation runs (for the results)."""
    from benchmarks.images_aug import augment

    if mode == "augment":
        if _reader_has("transform"):
            return {"transform": augment}, "transform="
        return {"collate": _per_sample_collate}, "collate="
    if mode == "raw":  # the bytes as a list (the default collate's, and torch's for the peers' bytes)
        if _reader_has("decode"):
            return {"decode": False}, "decode=False"
        return {"collate": _raw_collate}, "bytes field"
    return {}, "default"


def case_read(system: str, mode: str, path: str, stop_after: int | None = None,
              state_out: str | None = None, state_in: str | None = None,
              shuffle_block: int | None = None) -> dict[str, Any]:
    """shardkit's side of `images_peers.case_read` (same arguments, same result; ``shuffle_block`` is the
    shuffle buffer in rows, default: the reader's)."""
    import torch
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from benchmarks.images_epoch import drain
    from shardkit.torch import ShardkitIterableDataset

    options, how = _shardkit_options(mode)
    if how == "bytes field":
        path += "-bytes"  # the same JPEG bytes as a blob field (see case_convert)
    if shuffle_block:
        options["shuffle_buffer"] = shuffle_block
    tick = os.sysconf("SC_CLK_TCK")
    cpu0, started = _cpu_ticks("self"), time.perf_counter()
    ds = ShardkitIterableDataset(path, batch_size=BATCH, seed=0, **options)
    resumable = stop_after is not None or state_in is not None
    loader = (StatefulDataLoader if resumable else DataLoader)(ds, batch_size=None, num_workers=WORKERS)
    if state_in:
        loader.load_state_dict(torch.load(state_in, weights_only=False))
    read = drain(loader, started, stop_after,
                 save=(lambda: torch.save(loader.state_dict(), state_out)) if state_out else None)
    cpu = (_cpu_ticks("self") - cpu0) / tick
    return {"system": system, "mode": mode, **read, "cpu_seconds": cpu, "how": how}


# -- fresh processes, with the process tree's PSS sampled ------------------------------------------------

def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _TreePss(threading.Thread):
    """The peak, over time, of the summed PSS of a process and all its descendants (every ~50 ms)."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.peak = pid, every, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            total = sum(_pss(p) for p in {self.pid, *descendants(self.pid)})
            self.peak = max(self.peak, total)
            self._done.wait(self.every)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def run_fresh(target: str, params: dict[str, Any], *, peers: bool, timeout: float = 1800) -> dict[str, Any]:
    """Run the case ``"module:function"`` in a fresh process (the peers' venv for LitData and Mosaic);
    its result plus ``peak_pss`` (of its process tree) and ``process_cpu_seconds`` (the whole process and
    the children it reaped, startup and imports included, from this process's ``RUSAGE_CHILDREN``)."""
    if peers:
        from benchmarks.images_env import ensure_venv, peer_env

        python, env = str(ensure_venv()), peer_env()
    else:
        python, env = sys.executable, None
    cmd = [python, "-m", "benchmarks.common", "--child", target, json.dumps(params)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = _TreePss(proc.pid)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        proc.kill()
        out, err = proc.communicate()
    peak = sampler.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [ln for ln in out.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise CaseFailed(f"{target} {params} exited {proc.returncode}:\n{err[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(MARKER):])
    result["peak_pss"] = peak
    result["process_cpu_seconds"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    result["process_seconds"] = time.perf_counter() - started
    return result


def _target(system: str, case: str) -> tuple[str, bool]:
    peers = system in PEERS
    return (f"benchmarks.images_peers:{case}" if peers else f"benchmarks.images:{case}"), peers


def convert(system: str, store: Path, out: Path, n: int, size: int = 256) -> dict[str, Any]:
    target, peers = _target(system, "case_convert")
    params: dict[str, Any] = {"system": system, "store": str(store), "out": str(out), "n": n}
    if not peers:
        params["size"] = size
    return run_fresh(target, params, peers=peers)


def read(system: str, mode: str, path: Path, **kwargs: Any) -> dict[str, Any]:
    target, peers = _target(system, "case_read")
    return run_fresh(target, {"system": system, "mode": mode, "path": str(path), **kwargs}, peers=peers)


# -- shuffle quality --------------------------------------------------------------------------------------

def shuffle_quality(batches: Sequence[Sequence[int]], layout: dict[str, list[int]]) -> dict[str, float]:
    """Distinct storage units per batch (mean over full batches) and the mean gap of storage positions of
    adjacent samples over a uniform shuffle's N/3 (1.0: as far as uniform reaches; 0: storage order)."""
    import numpy as np

    position, unit = np.asarray(layout["position"]), np.asarray(layout["unit"])
    full = [b for b in batches if len(b) == BATCH] or list(batches)
    distinct = float(np.mean([len(set(unit[np.asarray(b)].tolist())) for b in full])) if full else 0.0
    order = position[np.asarray([i for b in batches for i in b], dtype=np.int64)]
    gap = float(np.abs(np.diff(order)).mean()) if len(order) > 1 else 0.0
    return {"units_per_batch": distinct, "gap_vs_uniform": gap / (len(position) / 3)}


def uniform_quality(layout: dict[str, list[int]], seed: int = 0) -> dict[str, float]:
    """`shuffle_quality` of a uniform permutation of the same samples: the reference."""
    import numpy as np

    perm = np.random.default_rng(seed).permutation(len(layout["position"]))
    return shuffle_quality([perm[a:a + BATCH].tolist() for a in range(0, len(perm), BATCH)], layout)


# -- the run ----------------------------------------------------------------------------------------------

def _dataset_path(system: str, n: int, size: int = 256) -> Path:
    return DATA / f"{system}-{n}-{size}px"


def _layout(path: Path) -> dict[str, list[int]]:
    layout: dict[str, list[int]] = json.loads((path / "layout.json").read_text())
    return layout


def _summary(res: dict[str, Any], layout: dict[str, list[int]]) -> dict[str, Any]:
    """A read case's figures, its ids folded into the shuffle figures and counts."""
    ids = res.pop("ids")
    flat = [i for b in ids for i in b]
    out = {k: v for k, v in res.items() if k not in ("system", "mode")}
    out.update(images_per_s=res["images"] / res["seconds"], distinct_ids=len(set(flat)),
               **shuffle_quality(ids, layout))
    return out


def run_reads(systems: Sequence[str], modes: Sequence[str], n: int, rounds: int,
              layouts: dict[str, dict[str, list[int]]], log: Callable[[str], None]
              ) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], dict[str, list[list[int]]]]:
    """Every (mode, system) once per round, systems round-robin; the runs, and round 1's raw-mode ids
    per system (the uninterrupted epoch that the resume check compares with)."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {s: [] for s in systems} for m in modes}
    epochs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for mode in modes:
            for system in systems:
                try:
                    res = read(system, mode, _dataset_path(system, n))
                except (CaseFailed, OSError) as e:
                    log(f"  [{r + 1}/{rounds}] {mode:<8} {system:<9} FAILED\n{str(e)[-3000:]}")
                    runs[mode][system].append({"error": str(e)[-3000:]})
                    continue
                if mode == "raw" and system not in epochs:
                    epochs[system] = res["ids"]
                s = _summary(res, layouts[system])
                runs[mode][system].append(s)
                log(f"  [{r + 1}/{rounds}] {mode:<8} {system:<9} {s['images_per_s']:>8,.0f} images/s  "
                    f"first {s['first_batch_seconds']:.2f} s  PSS {fmt_bytes(s['peak_pss'])}  "
                    f"CPU {s['cpu_seconds']:.1f} s  units/batch {s['units_per_batch']:.1f}  "
                    f"gap {s['gap_vs_uniform']:.2f}  load {s.get('load_1m', 0):.1f}")
    return runs, epochs


def per_image_work(systems: Sequence[str], store: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Each system's per-image work of mode augment alone (`images_aug.case_work`, a fresh process, in
    the system's venv): the floor of its CPU per image in the epoch."""
    out: dict[str, Any] = {}
    for system in systems:
        params = {"system": system, "store": str(store)}
        try:
            out[system] = run_fresh("benchmarks.images_aug:case_work", params, peers=system in PEERS)
        except (CaseFailed, OSError) as e:
            out[system] = {"error": str(e)[-3000:]}
        r = out[system]
        said = f"FAILED\n{r['error']}" if "error" in r else \
            f"{r['cpu_seconds'] / r['images'] * 1000:.3f} CPU-ms/image"
        log(f"  work {system:<9} {said}")
    return out


def work_text(doc: dict[str, Any]) -> str:
    """The per-image work floors beside the epochs' CPU per image, and the augment ratio they allow."""
    work = {s: w["cpu_seconds"] / w["images"] for s, w in doc.get("work", {}).items() if "error" not in w}
    runs = doc.get("reads", {}).get("augment", {})
    epoch = {s: (_median(rs, "cpu_seconds") or 0) / max(_median(rs, "images") or 1, 1)
             for s, rs in runs.items() if any("error" not in r for r in rs)}
    if "shardkit" not in work:
        return ""
    each = [f"{s} {v * 1000:.2f}" + (f" (in the epoch {epoch[s] * 1000:.2f})" if s in epoch else "")
            for s, v in work.items()]
    text = ("\nper-image work alone (decode + the augmentation, one thread, no loader: "
            f"`images_aug.case_work`), CPU-ms/image: {', '.join(each)}")
    own = doc["work"]["shardkit"]
    stage = own["stage_cpu_seconds"] / own["images"] if "stage_cpu_seconds" in own else None
    if stage is not None:
        text += (f"\nshardkit's transform stage alone (the same images and augmentation in batches of "
                 f"{BATCH}, one thread: decoded as each sample is taken, its generators seeded from (seed, "
                 "epoch, position), its output checked and copied into the batch; no reading, no loader): "
                 f"{stage * 1000:.2f} CPU-ms/image, {(stage - work['shardkit']) * 1e6:.0f} us over the work")
    for peer in PEERS:
        if peer in epoch:
            text += (f"\naugment ceiling vs {peer}: its epoch's CPU per image / shardkit's work alone = "
                     f"{epoch[peer] / work['shardkit']:.2f}x, what shardkit's images/s can reach on cores "
                     "both loaders keep busy if its loader cost nothing at all "
                     f"(target {RATIO_TARGETS['augment']}x)")
            if stage is not None:
                text += (f"; / the stage alone = {epoch[peer] / stage:.2f}x, if nothing but the stage "
                         "cost anything")
    return text


def resume_check(system: str, n: int, epoch: list[list[int]] | None) -> dict[str, Any]:
    """Read k batches (half the epoch) in one process, save the loader's state; resume in a new one."""
    path = _dataset_path(system, n)
    k = max(1, n // BATCH // 2)
    state = DATA / f"state-{system}-{n}.pt"
    state.unlink(missing_ok=True)
    first = read(system, "raw", path, stop_after=k, state_out=str(state))
    rest = read(system, "raw", path, state_in=str(state))
    state.unlink(missing_ok=True)
    got = [i for b in first["ids"] + rest["ids"] for i in b]
    out: dict[str, Any] = {"cut_after_batches": k, "before": first["images"], "after": rest["images"],
                           "duplicates": len(got) - len(set(got))}
    if epoch is not None:
        whole = [i for b in epoch for i in b]
        out["missing"] = len(set(whole) - set(got))
        out["extra"] = len(set(got) - set(whole))
        out["exact"] = sorted(got) == sorted(whole)
        out["same_order"] = got == whole
    return out


def reach_check(systems: Sequence[str], n: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The shuffle on ``n`` tiny JPEGs with a shuffle memory of n/10 samples (shardkit ``shuffle_buffer``,
    Mosaic py1e ``shuffle_block_size``), raw bytes: only the order of ids is used."""
    size = 16
    store = ensure_store(n, size=size, distinct=1000)
    budget = n // 10
    out: dict[str, Any] = {"images": n, "image_px": size, "budget": budget}
    for system in [s for s in systems if s in ("shardkit", "mosaic")]:
        path = _dataset_path(system, n, size)
        convert(system, store, path, n, size)
        layout = _layout(path)
        out.setdefault("uniform", uniform_quality(layout))
        cases = [(f"{system} (memory n/10)", budget)] + ([("shardkit (defaults)", None)]
                                                        if system == "shardkit" else [])
        for name, block in cases:
            res = read(system, "raw", path, **({"shuffle_block": block} if block else {}))
            s = _summary(res, layout)
            out[name] = {k: s[k] for k in ("units_per_batch", "gap_vs_uniform", "images", "distinct_ids",
                                           "peak_pss", "seconds")}
            log(f"  reach {name:<22} units/batch {s['units_per_batch']:.1f}  gap {s['gap_vs_uniform']:.2f}  "
                f"PSS {fmt_bytes(s['peak_pss'])}")
    return out


def _median(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def report(doc: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
    """The printed tables and the acceptance verdicts (issue 37) of a run's results."""
    runs, n = doc.get("reads", {}), doc["images"]
    uniform = doc.get("uniform")
    lines: list[str] = []
    verdicts: list[dict[str, str]] = []

    def verdict(target: str, ok: bool | None, detail: str) -> None:
        verdicts.append({"target": target, "result": "-" if ok is None else ("PASS" if ok else "MISS"),
                         "detail": detail})

    rows = []
    for mode, by_system in runs.items():
        for system, rs in by_system.items():
            good = [r for r in rs if "error" not in r]
            if not good:
                rows.append([mode, system, "failed", *["-"] * 9])
                continue
            ratios = []
            for peer in PEERS:
                peer_runs = by_system.get(peer, [])
                pairs = [(a, b) for a, b in zip(by_system.get("shardkit", []), peer_runs, strict=False)
                         if "error" not in a and "error" not in b]
                if system == "shardkit" and pairs:
                    wall = statistics.median(a["images_per_s"] / b["images_per_s"] for a, b in pairs)
                    cpu = statistics.median(b["cpu_seconds"] / b["images"] / (a["cpu_seconds"] / a["images"])
                                            for a, b in pairs)
                    ratios.append(f"{wall:.2f}x {peer} (per CPU-s {cpu:.2f}x)")
            ips = _median(good, "images_per_s") or 0.0
            cpu = _median(good, "cpu_seconds") or 0.0
            images = _median(good, "images") or 0
            rows.append([mode, system, f"{ips:,.0f}", ", ".join(ratios) or "-",
                         f"{_median(good, 'first_batch_seconds'):.2f} s",
                         fmt_bytes(_median(good, "peak_pss")),
                         f"{cpu:.1f}", f"{cpu / max(images, 1) * 1000:.2f}",
                         f"{_median(good, 'units_per_batch'):.1f}", f"{_median(good, 'gap_vs_uniform'):.2f}",
                         f"{images:,.0f} ({_median(good, 'distinct_ids'):,.0f})",
                         f"{_median(good, 'load_1m'):.1f}"])
    if rows:  # none in an --only-s3 run
        lines.append(table(["mode", "system", "images/s", "shardkit / peer, same round", "first batch",
                            "peak PSS (tree)", "CPU-s", "CPU-ms/image", "units/batch", "gap/uniform",
                            "images (distinct)", "load"], rows))
    if uniform:
        lines.append(f"\nuniform shuffle of the same {n:,} images: {uniform['units_per_batch']:.1f} units "
                     f"per {BATCH}-batch, gap {uniform['gap_vs_uniform']:.2f}")
    if doc.get("work"):
        lines.append(work_text(doc))
    how = sorted({r.get("how", "") for rs in runs.get("augment", {}).values() for r in rs if r.get("how")})
    if how:
        lines.append(f"shardkit's augmentation ran through {', '.join(how)}"
                     + (f", at commit {doc['shardkit_commit']}" if doc.get("shardkit_commit") else ""))
    conv = doc.get("convert", {})
    if conv:
        lines.append("\n" + table(["conversion", "seconds", "images/s", "CPU-s", "units", "byte-identical"], [
            [s, f"{c['seconds']:.1f}", f"{c['images'] / c['seconds']:,.0f}", f"{c['cpu_seconds']:.1f}",
             str(c["units"]), f"{c['identical']:,} / {c['images']:,}"] if "error" not in c
            else [s, "failed", "-", "-", "-", "-"] for s, c in conv.items()]))
    res = doc.get("resume", {})
    if res:
        lines.append("\n" + table(["resume (raw)", "cut after", "read before/after", "exact", "same order",
                                   "missing/extra/duplicated"], [
            [s, f"{r['cut_after_batches']} batches", f"{r['before']:,} / {r['after']:,}",
             "yes" if r.get("exact") else "NO", "yes" if r.get("same_order") else "no",
             f"{r.get('missing', '-')}/{r.get('extra', '-')}/{r['duplicates']}"] if "error" not in r
            else [s, "failed", "-", "-", "-", "-"] for s, r in res.items()]))
    reach = doc.get("reach")
    if reach:
        u = reach["uniform"]
        body = [[name, f"{r['units_per_batch']:.1f}", f"{r['gap_vs_uniform']:.2f}", fmt_bytes(r["peak_pss"])]
                for name, r in reach.items()
                if isinstance(r, dict) and "units_per_batch" in r and name != "uniform"]
        body.append(["uniform", f"{u['units_per_batch']:.1f}", f"{u['gap_vs_uniform']:.2f}", "-"])
        lines.append(f"\nreach: {reach['images']:,} {reach['image_px']}x{reach['image_px']} JPEGs, "
                     f"shuffle memory {reach['budget']:,} samples (1/10 of the data), raw bytes\n"
                     + table(["shuffle", "units/batch", "gap/uniform", "peak PSS (tree)"], body))

    # acceptance (issue 37)
    for mode, target in RATIO_TARGETS.items():
        by_system = runs.get(mode, {})
        for peer in PEERS:
            same = [a["images_per_s"] / b["images_per_s"] for a, b in
                    zip(by_system.get("shardkit", []), by_system.get(peer, []), strict=False)
                    if "error" not in a and "error" not in b]
            if same:
                med = statistics.median(same)
                verdict(f"{mode}: shardkit >= {target}x {peer} images/s", med >= target, f"{med:.3f}x")
    sk = [r for r in runs.get("augment", {}).get("shardkit", []) if "error" not in r]
    lit = [r for r in runs.get("augment", {}).get("litdata", []) if "error" not in r]
    if sk and uniform:
        fb = _median(sk, "first_batch_seconds") or 0.0
        verdict(f"augment: first batch <= {FIRST_BATCH_TARGET} s", fb <= FIRST_BATCH_TARGET, f"{fb:.2f} s")
        for key, ref in (("units_per_batch", "units per batch"), ("gap_vs_uniform", "position gap")):
            got, want = _median(sk, key) or 0.0, uniform[key]
            verdict(f"augment: shardkit {ref} >= {SHUFFLE_TARGET}x uniform", got >= SHUFFLE_TARGET * want,
                    f"{got / want:.2f}x")
    if sk and lit:
        a, b = _median(sk, "peak_pss") or 0, _median(lit, "peak_pss") or 0
        verdict("augment: peak PSS <= LitData's", a <= b, f"{fmt_bytes(a)} vs {fmt_bytes(b)}")
    if sk:
        per = {s: (_median(rs, "cpu_seconds") or 0) / max(_median(rs, "images") or 1, 1)
               for s, rs in runs.get("augment", {}).items() if any("error" not in r for r in rs)}
        peers = [v for s, v in per.items() if s in PEERS]
        if peers:
            verdict("augment: CPU-seconds per image <= the best peer's", per["shardkit"] <= min(peers),
                    f"{per['shardkit'] * 1000:.2f} vs {min(peers) * 1000:.2f} ms")
    if "shardkit" in conv and "error" not in conv["shardkit"]:
        c = conv["shardkit"]
        verdict("conversion: every image byte-identical", c["identical"] == c["images"],
                f"{c['identical']:,} / {c['images']:,}")
        if "litdata" in conv and "error" not in conv["litdata"]:
            verdict("conversion: write_dataset at least as fast as LitData optimize()",
                    c["seconds"] <= conv["litdata"]["seconds"],
                    f"{c['seconds']:.1f} vs {conv['litdata']['seconds']:.1f} s")
    if reach and "shardkit (memory n/10)" in reach and "mosaic (memory n/10)" in reach:
        a, b = reach["shardkit (memory n/10)"], reach["mosaic (memory n/10)"]
        ok = a["units_per_batch"] >= b["units_per_batch"] and a["gap_vs_uniform"] >= b["gap_vs_uniform"]
        verdict("reach (data 10x the shuffle memory): shardkit >= Mosaic py1e", ok,
                f"units {a['units_per_batch']:.1f} vs {b['units_per_batch']:.1f}, "
                f"gap {a['gap_vs_uniform']:.2f} vs {b['gap_vs_uniform']:.2f}")
    if "shardkit" in res and "error" not in res["shardkit"]:
        verdict("resume mid-epoch in a new process: exact", bool(res["shardkit"].get("exact")),
                "exact" if res["shardkit"].get("exact") else "not exact")
    if doc.get("s3_first_batch"):
        from benchmarks import images_s3

        s3_text, s3_verdicts = images_s3.report(doc["s3_first_batch"], PEERS, fmt_bytes, table)
        lines.append(s3_text)
        for target, ok, detail in s3_verdicts:
            verdict(target, ok, detail)
    lines.append("\n" + table(["target (issue 37)", "result", "measured"],
                              [[v["target"], v["result"], v["detail"]] for v in verdicts]))
    return "\n".join(lines), verdicts


def _commit() -> str:
    """The commit shardkit's cases ran at, ``+changes`` when the reader's files differed from it."""
    def git(*a: str) -> str:
        proc = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False)
        return proc.stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return head + ("+changes" if git("status", "--porcelain", "--", "shardkit") else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3,
                        help="round-robin rounds (medians; ratios per round)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--reach-images", type=int, default=100_000,
                        help="images of the reach case (0: skip it)")
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--no-s3", action="store_true",
                        help="skip the first batch from a loopback S3 store (moto), cold cache")
    parser.add_argument("--only-s3", action="store_true",
                        help="only the S3 first batch (the datasets converted once if not cached)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke: 600 images, 1 round, shardkit only, no reach, not saved")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--report-only", metavar="RESULTS_JSON", help="print a saved run's tables again")
    args = parser.parse_args(argv)
    if args.report_only:  # the tables again from the saved figures (the saved table is rewritten)
        doc = json.loads(Path(args.report_only).read_text())
        text, verdicts = report(doc)
        doc.update(table=text + doc["table"][doc["table"].rfind("\n\n"):], targets=verdicts)
        write_json(Path(args.report_only), doc)
        print(doc["table"])
        return
    if args.quick:
        args.images, args.rounds, args.systems, args.reach_images, args.no_save = 600, 1, "shardkit", 0, True
        args.no_s3 = True
    if args.only_s3 and args.no_s3:
        parser.error("--only-s3 and --no-s3 (or --quick) exclude each other")
    systems = [s for s in args.systems.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    bad = sorted(set(systems) - set(SYSTEMS)) + sorted(set(modes) - set(MODES))
    if bad:
        parser.error(f"unknown system or mode {bad}: systems are {SYSTEMS}, modes {MODES}")
    n = args.images
    info = machine_info()
    load_before = os.getloadavg()
    _log(f"images benchmark on {machine_id(info)}: {n:,} images, {args.rounds} round(s), systems {systems}, "
         f"load {load_before[0]:.1f}")
    started = time.perf_counter()
    store = ensure_store(n)
    doc: dict[str, Any] = {"images": n, "rounds": args.rounds, "batch": BATCH, "workers": WORKERS,
                           "unit": UNIT, "store_mib": Path(store, "images.bin").stat().st_size / 2**20,
                           "shardkit_commit": _commit()}
    conv: dict[str, Any] = {}
    layouts: dict[str, dict[str, list[int]]] = {}
    for system in systems:
        if args.only_s3 and (_dataset_path(system, n) / "layout.json").exists():
            layouts[system] = _layout(_dataset_path(system, n))  # converted by an earlier run: as it is
            continue
        try:
            conv[system] = convert(system, store, _dataset_path(system, n), n)
        except (CaseFailed, OSError) as e:
            conv[system] = {"error": str(e)[-3000:]}
            _log(f"  convert {system} FAILED\n{conv[system]['error']}")
            continue
        layouts[system] = _layout(_dataset_path(system, n))
        c = conv[system]
        _log(f"  convert {system:<9} {c['seconds']:.1f} s, {c['units']} units, "
             f"{c['identical']:,}/{n:,} byte-identical")
    doc["convert"] = conv
    ok = [s for s in systems if s in layouts]
    if not args.only_s3:
        doc["uniform"] = (uniform_quality(layouts[ok[0]]) if ok
                          else {"units_per_batch": 0.0, "gap_vs_uniform": 0.0})
    runs, epochs = run_reads(ok, [] if args.only_s3 else modes, n, args.rounds, layouts, _log)
    doc["reads"] = runs
    if "augment" in modes and not args.only_s3:
        doc["work"] = per_image_work(ok, store, _log)
    if not args.no_s3:
        from benchmarks.images_s3 import s3_first_batch

        try:
            doc["s3_first_batch"] = s3_first_batch(ok, n, args.rounds, _log)
        except (CaseFailed, OSError, RuntimeError) as e:  # the server did not start, an upload failed
            doc["s3_first_batch"] = {"error": str(e)[-3000:]}
            _log(f"  s3 first batch FAILED\n{doc['s3_first_batch']['error']}")
    if not args.no_resume and not args.only_s3:
        doc["resume"] = {}
        for system in ok:
            try:
                doc["resume"][system] = resume_check(system, n, epochs.get(system))
            except (CaseFailed, OSError) as e:
                doc["resume"][system] = {"error": str(e)[-3000:]}
            _log(f"  resume {system}: {doc['resume'][system]}"[:400])
    if args.reach_images and not args.only_s3:
        try:
            doc["reach"] = reach_check(ok, args.reach_images, _log)
        except (CaseFailed, OSError) as e:
            _log(f"  reach FAILED\n{str(e)[-3000:]}")
    seconds = time.perf_counter() - started
    text, verdicts = report(doc)
    after = os.getloadavg()
    text += (f"\n\n{n:,} images ({doc['store_mib']:,.0f} MiB of JPEG), batch {BATCH}, num_workers={WORKERS}, "
             f"~{UNIT:,} images per unit; medians of {args.rounds} round(s), fresh processes, round-robin; "
             f"{seconds / 60:.1f} min; load (1/5/15 min) before {'/'.join(f'{v:.1f}' for v in load_before)}, "
             f"after {'/'.join(f'{v:.1f}' for v in after)} on {info['cpus']} CPUs")
    print(text)
    if not args.no_save:
        doc.update(seconds=seconds, load_before=load_before, load_after=after, table=text, targets=verdicts)
        path = save_results("images", doc)
        _log(f"saved {path}")
    failed = any("error" in r for rs in runs.values() for v in rs.values() for r in v)
    s3 = doc.get("s3_first_batch", {})
    failed = failed or "error" in s3 or any("error" in r for rs in s3.get("runs", {}).values() for r in rs)
    if failed or any("error" in c for c in conv.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
