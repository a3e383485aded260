"""TAKE benchmark: random access by index (issue 40), shardkit beside HF datasets, Mosaic Streaming, LitData
and Lance, on the same rows, locally and from a loopback S3 store 0 and 50 ms away.

Two workloads: ``rows``, the read benchmark's rows (`benchmarks.data`: id, label, features float32[128], a
32x32x3 uint8 image, 40 characters of text; ``--rows``), and ``images``, the images benchmark's 256x256
JPEGs with a label and an id (`benchmarks.images`: its JPEG store, and its shardkit, LitData and Mosaic
datasets, converted there if not cached; ``--images``). Every system gets its own copy of the same rows,
~one row group of shardkit per storage unit (LitData chunk, MDS shard, Lance row group):

    shardkit       shardkit.open_dataset(url).take(indices): the pages of the rows, and what it read whole
                   kept for the next lookups (``ds.lookups``)
    shardkit-map   shardkit.torch.MapDataset(url): ds[i], ds.__getitems__(indices) (what a DataLoader
                   calls for a batch), each process keeping the row groups it read (up to 256 MB)
    hf             HF datasets 5.2.0 map-style on its own Arrow cache (``load_from_disk``, numpy format,
                   ``dtype=None``), in ``.bench/hf-venv``
    mosaic         Mosaic Streaming ``StreamingDataset[i]`` (images venv)
    litdata        LitData ``StreamingDataset[i]`` (images venv)
    lance          Lance (pylance 14.0.2) ``dataset.take(indices)``, in ``.bench/lance-venv``

(`take_peers` holds the peers' code.) A lookup is one random row (``single``) or 256 distinct random rows
(``batch``), their columns decoded as each system gives them (images decoded to HxWxC uint8: shardkit by
its codec, the peers with Pillow from the JPEG bytes they store). The indices are drawn once from a seed,
the same for every system; each case looks up a prefix of them for ``--seconds`` (at least one lookup),
in a fresh process (opening the dataset is timed apart, imports are not counted), round-robin over the
systems, ``--rounds`` times; medians, and shardkit's ratio to each peer IN THE SAME ROUND.

From a store: a moto S3 server on 127.0.0.1 holds every system's copy, and a relay in this process
(`benchmarks.relay`) holds each response back 0 or 50 ms and counts the bytes it forwards while the
lookups run (not the open). shardkit reads ``s3://`` through it; Mosaic ``remote=`` and LitData
``"s3://..."`` with an EMPTY local cache folder per process; Lance with its object store's endpoint.
HF datasets cannot: its map-style dataset is a local Arrow cache (an ``s3://`` path is copied whole
first). Bytes per row fetched are set beside the bytes of the Parquet pages that hold those rows in
shardkit's files (each column's data pages holding an asked row, their headers and the dictionary pages
counted once per lookup; read from the page headers).

Usage (from the repository root):
    python -m benchmarks.take              # 20,000 rows + 20,000 images, 3 rounds; saves results/
    python -m benchmarks.take --quick      # smoke: tiny sizes, 1 round, shardkit only, not saved
    python -m benchmarks.take --systems shardkit,hf --workloads rows --no-s3 --no-save
    python -m benchmarks.take --report-only benchmarks/results/take-<machine>.json
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from benchmarks.common import (
    BENCH_DIR,
    ROOT,
    CaseFailed,
    machine_id,
    machine_info,
    run_case,
    save_results,
    table,
    write_json,
)
from benchmarks.relay import Relay

SYSTEMS = ["shardkit", "shardkit-map", "hf", "mosaic", "litdata", "lance"]
SHARDKIT = ["shardkit", "shardkit-map"]
PEERS = ["hf", "mosaic", "litdata", "lance"]
#: systems that cannot look rows up in an object store, and why
NO_REMOTE = {"hf": "HF datasets' map-style Dataset is an Arrow cache on a local disk (load_from_disk of an "
                   "s3:// path copies all of it first): no lookups from a store"}
WORKLOADS = ["rows", "images"]
KINDS = ["single", "batch"]
BATCH = 256
DELAYS = (0.0, 0.05)
SEED = 40
MAX_SINGLE = 20_000
MAX_BATCHES = 400
DATA = BENCH_DIR / "take"
LANCE_VENV = ROOT / ".bench" / "lance-venv"
LANCE_PYTHON = LANCE_VENV / "bin" / "python"
#: pylance with shardkit's pyarrow and numpy; Pillow to decode the images workload. No torch.
LANCE_PINS = ["pylance==14.0.2", "pillow==13.0.0"]
PILLOW = "pillow==13.0.0"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- shardkit's case (a fresh process through benchmarks.common's child runner) ------------------------------

def case_lookup(system: str, workload: str, path: str, kind: str, indices: str, seconds: float,
                endpoint: str | None = None, cache_dir: str | None = None) -> dict[str, Any]:
    """shardkit's side of `take_peers.case_lookup` (same arguments, same result)."""
    from benchmarks.take_peers import _timed

    order = np.load(indices)
    so = None
    if endpoint:
        import fsspec

        fsspec.get_filesystem_class("s3")  # s3fs imported before the clock, as the peers import boto3
        so = {"key": "x", "secret": "x",
              "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    if system == "shardkit":
        import shardkit

        def opened() -> Any:
            return shardkit.open_dataset(path, storage_options=so)

        def single(ds: Any, i: int) -> Any:
            return ds.take(i)["id"]

        def batch(ds: Any, idx: Any) -> Any:
            return ds.take(idx)["id"]
    else:
        import inspect

        from shardkit.torch import MapDataset

        # its disk cache (where it has one) in the case's own empty folder, as the peers' local caches
        has_cache = "cache" in inspect.signature(MapDataset).parameters
        extra = {"cache": cache_dir} if endpoint and has_cache else {}

        def opened() -> Any:
            return MapDataset(path, storage_options=so, **extra)

        def single(ds: Any, i: int) -> Any:
            return int(ds[i]["id"])

        def batch(ds: Any, idx: Any) -> Any:
            return [int(s["id"]) for s in ds.__getitems__(idx)]
    return _timed(opened, single if kind == "single" else batch, order, seconds)


# -- venvs ----------------------------------------------------------------------------------------------

def ensure_lance_venv() -> Path:
    """pylance in its own venv (pinned; shardkit's pyarrow and numpy), created once."""
    import pyarrow as pa

    pins = [*LANCE_PINS, f"pyarrow=={pa.__version__}", f"numpy=={np.__version__}"]
    stamp = LANCE_VENV / ".pins.json"
    if LANCE_PYTHON.exists() and stamp.exists() and json.loads(stamp.read_text()) == pins:
        return LANCE_PYTHON
    if not LANCE_PYTHON.exists():
        LANCE_VENV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(LANCE_VENV)], check=True)
    subprocess.run([str(LANCE_PYTHON), "-m", "pip", "install", "-q", *pins], check=True)
    stamp.write_text(json.dumps(pins))
    return LANCE_PYTHON


def ensure_hf() -> Path:
    """The read benchmark's HF venv, with Pillow added (pinned) to decode the images workload."""
    from benchmarks.read import ensure_hf_venv

    python = ensure_hf_venv()
    if subprocess.run([str(python), "-c", "import PIL"], capture_output=True, check=False).returncode:
        subprocess.run([str(python), "-m", "pip", "install", "-q", PILLOW], check=True)
    return python


def _runner(system: str) -> dict[str, Any]:
    """How to run ``system``'s cases: the target and the python (and environment) of its venv."""
    if system in SHARDKIT:
        return {"target": "benchmarks.take:case_lookup"}
    if system == "hf":
        return {"target": "benchmarks.take_peers:case_lookup", "python": ensure_hf()}
    if system == "lance":
        return {"target": "benchmarks.take_peers:case_lookup", "python": ensure_lance_venv()}
    from benchmarks.images_env import ensure_venv, peer_env

    return {"target": "benchmarks.take_peers:case_lookup", "python": ensure_venv(), "env": peer_env()}


def _build(system: str, workload: str, source: Path, out: Path, unit: int) -> Path:
    """``system``'s copy (`take_peers.case_build`), cached: a ``.done`` file marks a complete one."""
    if (out / ".done").exists():
        return out
    r = _runner(system)
    res = run_case("benchmarks.take_peers:case_build",
                   {"system": system, "workload": workload, "source": str(source), "out": str(out),
                    "unit": unit},
                   python=r.get("python", sys.executable), env=r.get("env"), timeout=3600)
    (out / ".done").write_text(json.dumps(res))
    _log(f"  built {system} {workload}: {res['rows']:,} rows in {res['seconds']:.0f} s")
    return out


# -- the datasets --------------------------------------------------------------------------------------------

def rows_datasets(systems: Sequence[str], n: int) -> tuple[dict[str, Path], Path]:
    """Each system's copy of the read benchmark's first ``n`` rows; and shardkit's (for the pages)."""
    import shardkit
    from benchmarks import data

    sk = data.materialize_shardkit(n)
    unit = int(shardkit.open_dataset(sk).rows_per_group[0])
    out: dict[str, Path] = {s: sk for s in systems if s in SHARDKIT}
    if "hf" in systems:
        from benchmarks.read import materialize_hf

        ensure_hf()
        out["hf"] = materialize_hf(n)[0]
    if "lance" in systems:
        out["lance"] = _build("lance", "rows", data.materialize_raw(n),
                              DATA / f"lance-rows-v{data.VERSION}-n{n}", unit)
    if {"mosaic", "litdata"} & set(systems):
        npy = DATA / f"rows-npy-v{data.VERSION}-n{n}"
        if not (npy / "text.npy").exists():
            npy.mkdir(parents=True, exist_ok=True)
            for name, column in data.numpy_columns(n).items():
                np.save(npy / f"{name}.npy", column)
        for s in ("mosaic", "litdata"):
            if s in systems:
                out[s] = _build(s, "rows", npy, DATA / f"{s}-rows-v{data.VERSION}-n{n}", unit)
    return out, sk


def images_datasets(systems: Sequence[str], n: int) -> tuple[dict[str, Path], Path]:
    """Each system's copy of the images benchmark's ``n`` JPEGs; and shardkit's."""
    from benchmarks import images

    store = images.ensure_store(n)
    out: dict[str, Path] = {}
    for s in ["shardkit", *[p for p in ("mosaic", "litdata") if p in systems]]:
        path = images._dataset_path(s, n)
        if not (path / "layout.json").exists() or (s == "shardkit" and not _current(path)):
            images.convert(s, store, path, n)  # (shardkit's, written before its writer wrote page indexes)
        if s == "shardkit":
            out.update({k: path for k in systems if k in SHARDKIT})
            sk = path
        else:
            out[s] = path
    if {"hf", "lance"} & set(systems):
        parquet = DATA / f"images-n{n}-v{images.DATA_VERSION}.parquet"
        if not parquet.exists():
            _images_parquet(store, parquet, n, images.UNIT)
        if "hf" in systems:
            hf = DATA / f"hf-images-n{n}-v{images.DATA_VERSION}"
            if not (hf / "dataset_info.json").exists():
                run_case("benchmarks.read_hf:case_build", {"parquet": str(parquet), "out": str(hf)},
                         python=ensure_hf(), timeout=3600)
            out["hf"] = hf
        if "lance" in systems:
            out["lance"] = _build("lance", "images", parquet,
                                  DATA / f"lance-images-n{n}-v{images.DATA_VERSION}", images.UNIT)
    return out, sk


def _current(path: Path) -> bool:
    """Whether shardkit's images dataset at ``path`` is as `benchmarks.images.case_convert` writes it now:
    Parquet's page index (what lookups read pages by), a row group per file."""
    md = pq.read_metadata(path / "_metadata")
    files = {md.row_group(g).column(0).file_path for g in range(md.num_row_groups)}
    return bool(md.num_row_groups) and bool(md.row_group(0).column(0).has_offset_index) \
        and len(files) == md.num_row_groups


def _images_parquet(store: Path, out: Path, n: int, unit: int) -> None:
    """The JPEG store as a plain Parquet file (id, label, image bytes), ``unit`` rows per row group: what
    HF and Lance are built from."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = np.memmap(store / "images.bin", dtype=np.uint8, mode="r")
    offsets, labels = np.load(store / "offsets.npy"), np.load(store / "labels.npy")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    schema = pa.schema([("id", pa.int64()), ("label", pa.int64()), ("image", pa.binary())])
    with pq.ParquetWriter(tmp, schema) as writer:
        for a in range(0, n, unit):
            b = min(a + unit, n)
            writer.write_table(pa.table({
                "id": pa.array(np.arange(a, b)), "label": pa.array(labels[a:b]),
                "image": pa.array([bytes(data[offsets[i]:offsets[i + 1]]) for i in range(a, b)], pa.binary()),
            }, schema=schema))
    tmp.rename(out)


def draw_indices(workload: str, n: int) -> dict[str, Path]:
    """The seeded lookups of ``workload`` (``n`` rows), the same for every system: ``single`` one row each,
    ``batch`` 256 distinct rows each (``min(256, n)``); saved as ``.npy`` for the cases."""
    rng = np.random.default_rng([SEED, n, WORKLOADS.index(workload)])
    DATA.mkdir(parents=True, exist_ok=True)
    single = rng.integers(0, n, size=MAX_SINGLE, dtype=np.int64)
    batch = np.stack([rng.choice(n, min(BATCH, n), replace=False) for _ in range(MAX_BATCHES)])
    batch = batch.astype(np.int64)
    out = {}
    for kind, values in (("single", single), ("batch", batch)):
        out[kind] = DATA / f"indices-{workload}-n{n}-{kind}.npy"
        np.save(out[kind], values)
    return out


# -- the bytes of the pages that hold a row ---------------------------------------------------------------

class Pages:
    """The pages of every column chunk of a local shardkit dataset, from their headers: per row group and
    column, each data page's first row and bytes (header included), and the dictionary page's bytes."""

    def __init__(self, path: Path) -> None:
        import shardkit

        ds = shardkit.open_dataset(path)
        self.ends = np.cumsum(ds.rows_per_group)
        self.root, self.groups = Path(path), ds.row_groups
        self._cache: dict[int, list[tuple[np.ndarray, np.ndarray, int]]] = {}

    def _group(self, g: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
        if g in self._cache:
            return self._cache[g]
        import pyarrow.parquet as pq

        from shardkit.dataset._pages import _Thrift, chunk_range

        rg = self.groups[g]
        meta = pq.read_metadata(self.root / rg.file).row_group(rg.index)
        raw = (self.root / rg.file).read_bytes()
        out = []
        for j in range(meta.num_columns):
            col = meta.column(j)
            start, length = chunk_range(col)
            view = memoryview(raw)[start:start + length]
            per_row = max(1, col.num_values // max(1, meta.num_rows))
            firsts, sizes, dictionary, rows, at = [], [], 0, 0, 0
            while at < len(view):
                reader = _Thrift(view, at)
                head = reader.struct({1: None, 3: None, 5: {1: None}, 8: {1: None, 3: None}})
                end = reader.at + head[3][0]
                kind = head[1][0]
                if kind == 2:
                    dictionary += end - at
                elif kind in (0, 3):
                    n = head[8][0][3][0] if kind == 3 else head[5][0][1][0] // per_row
                    firsts.append(rows)
                    sizes.append(end - at)
                    rows += n
                at = end
            out.append((np.asarray(firsts, np.int64), np.asarray(sizes, np.int64), dictionary))
        self._cache[g] = out
        return out

    def bytes_of(self, rows: np.ndarray) -> int:
        """The bytes of the pages (and dictionary pages) that hold ``rows`` (global indices), each once."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        groups = np.searchsorted(self.ends, rows, side="right")
        total = 0
        for g in np.unique(groups):
            local = rows[groups == g] - (self.ends[g - 1] if g else 0)
            for firsts, sizes, dictionary in self._group(int(g)):
                pages = np.unique(np.searchsorted(firsts, local, side="right") - 1)
                total += int(sizes[pages].sum()) + dictionary
        return total


def files_summary(path: Path) -> dict[str, int]:
    """shardkit's files of a workload: rows, row groups, column chunks, pages (from their headers), bytes."""
    import pyarrow.parquet as pq

    from benchmarks import data

    files = sorted(p for p in Path(path).rglob("*.parquet") if not p.name.startswith(("_", ".")))
    metas = [pq.read_metadata(f) for f in files]
    _, pages = data.page_checksums(path)
    return {"rows": sum(m.num_rows for m in metas), "row_groups": sum(m.num_row_groups for m in metas),
            "column_chunks": sum(m.num_row_groups * m.num_columns for m in metas), "pages": pages,
            "bytes": sum(f.stat().st_size for f in files)}


# -- the run ----------------------------------------------------------------------------------------------

class MarkingRelay(Relay):
    """A `Relay` holding responses back ``delay`` s that notes (time.monotonic(), bytes, requests) at each
    forward, so the bytes that crossed it between two moments of a case can be read."""

    def __init__(self, target: str, delay: float) -> None:
        self.marks: list[tuple[float, int, int]] = []
        super().__init__(target, delay)

    async def _forward(self, writer: Any, data: bytes) -> None:
        await super()._forward(writer, data)
        self.marks.append((time.monotonic(), self.stats.bytes_out, len(self.stats.requests)))

    def at(self, t: float) -> tuple[int, int]:
        i = bisect.bisect_right([m[0] for m in self.marks], t)
        return (self.marks[i - 1][1], self.marks[i - 1][2]) if i else (0, 0)


def run(args: argparse.Namespace, systems: list[str], log: Callable[[str], None]) -> dict[str, Any]:
    """Every case, round-robin; the results document (without the table)."""
    doc: dict[str, Any] = {"rows": args.rows, "images": args.images, "rounds": args.rounds, "batch": BATCH,
                           "seconds_per_case": args.seconds, "systems": systems, "runs": {},
                           "not_remote": {s: w for s, w in NO_REMOTE.items() if s in systems},
                           "page_bytes": {}, "datasets": {}}
    plans: list[tuple[str, str, str, str]] = []  # (workload, where, system, kind)
    paths: dict[str, dict[str, Path]] = {}
    orders: dict[str, dict[str, Path]] = {}
    pages: dict[str, Pages] = {}
    for workload in args.workloads:
        n = args.rows if workload == "rows" else args.images
        started = time.perf_counter()
        built, sk = (rows_datasets if workload == "rows" else images_datasets)(systems, n)
        paths[workload], pages[workload] = built, Pages(sk)
        doc.setdefault("files", {})[workload] = files_summary(sk)
        doc["datasets"][workload] = {s: str(p) for s, p in built.items()}
        orders[workload] = draw_indices(workload, n)
        log(f"  {workload}: {n:,} rows, datasets ready in {time.perf_counter() - started:.0f} s")
        wheres = ["local"] + ([] if args.no_s3 else [f"s3-{int(d * 1000)}ms" for d in DELAYS])
        for where in wheres:
            for kind in KINDS:
                for s in systems:
                    if where == "local" or s not in NO_REMOTE:
                        plans.append((workload, where, s, kind))
    runs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        relays: dict[str, MarkingRelay] = {}
        urls: dict[tuple[str, str], str] = {}
        if not args.no_s3:
            from benchmarks.read import MotoServer

            moto = stack.enter_context(MotoServer())
            started = time.perf_counter()
            for workload, built in paths.items():
                for s, p in built.items():
                    if s in NO_REMOTE:
                        continue
                    same = next((u for (w, _), u in urls.items() if w == workload and
                                 paths[workload].get(_) == p), None)
                    urls[(workload, s)] = same or moto.put(p, f"{workload}-{s}")
            doc["upload_seconds"] = time.perf_counter() - started
            log(f"  s3: datasets put on {moto.endpoint} in {doc['upload_seconds']:.0f} s")
            for d in DELAYS:
                relays[f"s3-{int(d * 1000)}ms"] = stack.enter_context(MarkingRelay(moto.endpoint, d))
        for r in range(args.rounds):
            for workload, where, s, kind in plans:
                key = f"{workload}|{where}|{s}|{kind}"
                try:
                    res = _one(s, workload, where, kind, paths, orders, urls, relays, args.seconds)
                except (CaseFailed, OSError, subprocess.TimeoutExpired) as e:
                    log(f"  [{r + 1}/{args.rounds}] {key} FAILED\n{str(e)[-2000:]}")
                    runs.setdefault(key, []).append({"error": str(e)[-3000:]})
                    continue
                order = np.load(orders[workload][kind])[:res["lookups"]]
                res["expected_id_sum"] = int(order.sum())
                pk = f"{workload}|{kind}|{res['lookups']}"
                if pk not in doc["page_bytes"]:
                    doc["page_bytes"][pk] = sum(pages[workload].bytes_of(e) for e in order)
                res["page_bytes"] = doc["page_bytes"][pk]
                runs.setdefault(key, []).append(res)
                fetched = (f"  fetched {res['fetched_bytes'] / res['rows']:,.0f} B/row"
                           if "fetched_bytes" in res else "")
                log(f"  [{r + 1}/{args.rounds}] {workload:<6} {where:<8} {kind:<6} {s:<12} "
                    f"{res['lookups'] / res['seconds']:>9,.1f} lookups/s  "
                    f"{res['rows'] / res['seconds']:>9,.0f} rows/s"
                    f"  CPU {res['cpu_seconds']:.1f} s{fetched}  load {res['load']:.1f}")
    doc["runs"] = runs
    return doc


def _one(system: str, workload: str, where: str, kind: str, paths: dict[str, dict[str, Path]],
         orders: dict[str, dict[str, Path]], urls: dict[tuple[str, str], str],
         relays: dict[str, MarkingRelay],
         seconds: float) -> dict[str, Any]:
    r = _runner(system)
    params: dict[str, Any] = {"system": system, "workload": workload, "kind": kind,
                              "indices": str(orders[workload][kind]), "seconds": seconds,
                              "path": str(paths[workload][system])}
    cache = DATA / "s3-cache" / system
    if where != "local":
        relay = relays[where]
        params.update(path=urls[(workload, system)], endpoint=relay.url, cache_dir=str(cache))
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
    try:
        res = run_case(r["target"], params, python=r.get("python", sys.executable), env=r.get("env"),
                       timeout=max(600, seconds * 20))
    finally:
        if where != "local":
            shutil.rmtree(cache, ignore_errors=True)
    if where != "local":
        b0, q0 = relay.at(res["clock_start"])
        b1, q1 = relay.at(res["clock_end"] + 0.5)  # responses forwarded after the case's last read
        res.update(fetched_bytes=b1 - b0, requests=q1 - q0, open_bytes=b0 - relay.at(res["clock_open"])[0])
    return res


# -- the report -------------------------------------------------------------------------------------------

def _median(rs: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rs if key in r]
    return statistics.median(values) if values else None


def _rate(r: dict[str, Any]) -> float:
    return float(r["lookups"] / r["seconds"])


def report(doc: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
    """The printed table and the acceptance verdicts (issue 40) of a run's results."""
    runs: dict[str, list[dict[str, Any]]] = doc["runs"]
    rows = []
    med: dict[str, float] = {}
    for key, rs in runs.items():
        workload, where, system, kind = key.split("|")
        good = [r for r in rs if "error" not in r]
        if not good:
            rows.append([workload, where, kind, system, "failed", *["-"] * 8])
            continue
        rate = statistics.median(_rate(r) for r in good)
        med[key] = rate
        ratios = []
        if system in SHARDKIT:
            for peer in PEERS:
                prs = runs.get(f"{workload}|{where}|{peer}|{kind}", [])
                same = [_rate(a) / _rate(b) for a, b in zip(rs, prs, strict=False)
                        if "error" not in a and "error" not in b]
                if same:
                    ratios.append(f"{statistics.median(same):.2f}x {peer}")
        rps = statistics.median(r["rows"] / r["seconds"] for r in good)
        cpu_row = statistics.median(r["cpu_seconds"] / r["rows"] for r in good) * 1000
        fetched = (f"{statistics.median(r['fetched_bytes'] / r['rows'] for r in good):,.0f}"
                   if all("fetched_bytes" in r for r in good) else "-")
        page = statistics.median(r["page_bytes"] / r["rows"] for r in good)
        same_rows = "yes" if all(r["id_sum"] == r["expected_id_sum"] for r in good) else "no"
        rows.append([workload, where, kind, system, f"{rate:,.1f}", f"{rps:,.0f}", ", ".join(ratios) or "-",
                     f"{_median(good, 'open_seconds'):.2f}", f"{cpu_row:.3f}", fetched, f"{page:,.0f}",
                     same_rows, f"{_median(good, 'load'):.1f}"])
    text = table(["workload", "where", "lookup", "system", "lookups/s", "rows/s",
                  "shardkit / peer, same round",
                  "open s", "CPU-ms/row", "fetched B/row", "page B/row", "rows as asked", "load"], rows)
    for workload, f in doc.get("files", {}).items():
        text += (f"\nshardkit's files ({workload}): {f['rows']:,} rows in {f['row_groups']} row groups, "
                 f"{f['column_chunks']} column chunks, {f['pages']} pages "
                 f"(mean {f['bytes'] / f['pages'] / 1e6:.2f} MB "
                 f"a page, {f['bytes'] / f['row_groups'] / 1e6:.1f} MB a row group)")
    for s, why in doc.get("not_remote", {}).items():
        text += f"\n{s}: not from the store ({why})"
    verdicts: list[dict[str, str]] = []

    def verdict(target: str, ok: bool | None, detail: str) -> None:
        verdicts.append({"target": target, "result": "-" if ok is None else ("PASS" if ok else "MISS"),
                         "detail": detail})

    workloads = sorted({k.split("|")[0] for k in runs}, key=WORKLOADS.index)
    for workload in workloads:
        for sk in SHARDKIT:
            mine = med.get(f"{workload}|local|{sk}|batch")
            for peer in ("hf", "mosaic", "litdata"):
                theirs = med.get(f"{workload}|local|{peer}|batch")
                if mine is not None and theirs is not None:
                    verdict(f"{workload}, local: {sk} 256-row lookups/s >= {peer}", mine >= theirs,
                            f"{mine:,.1f} vs {theirs:,.1f}/s ({mine / theirs:.2f}x)")
            remote = {p: med[k] for p in PEERS if (k := f"{workload}|s3-50ms|{p}|batch") in med}
            mine50 = med.get(f"{workload}|s3-50ms|{sk}|batch")
            if mine50 is not None and remote:
                best, value = max(remote.items(), key=lambda kv: kv[1])
                verdict(f"{workload}, 50 ms store: {sk} 256-row lookups/s >= the best peer", mine50 >= value,
                        f"{mine50:,.2f} vs {value:,.2f}/s ({best})")
            for kind in KINDS if sk == "shardkit" else ():  # (MapDataset's kept row groups: fewer reads)
                rs = [r for r in runs.get(f"{workload}|s3-50ms|{sk}|{kind}", []) if "fetched_bytes" in r]
                if rs:
                    ratio = statistics.median(r["fetched_bytes"] / r["page_bytes"] for r in rs)
                    verdict(f"{workload}, 50 ms store, {kind}: {sk} bytes fetched per row <= 2x its pages'",
                            ratio <= 2.0, f"{ratio:.1f}x")
    text += "\n\n" + table(["target (issue 40)", "result", "measured"],
                           [[v["target"], v["result"], v["detail"]] for v in verdicts])
    return text, verdicts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="rows of the read benchmark's data")
    parser.add_argument("--images", type=int, default=20_000, help="JPEGs of the images benchmark's data")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="lookups per case for this long (at least one)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--no-s3", action="store_true", help="local lookups only")
    parser.add_argument("--quick", action="store_true",
                        help="smoke: 2,000 rows and 300 images, 1 round, shardkit only, not saved")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the results document there (--quick too)")
    parser.add_argument("--report-only", metavar="RESULTS_JSON", help="print a saved run's tables again")
    args = parser.parse_args(argv)
    if args.report_only:
        doc = json.loads(Path(args.report_only).read_text())
        for workload, paths in doc.get("datasets", {}).items():  # (runs saved before the summary was)
            if workload not in doc.setdefault("files", {}) and Path(paths.get("shardkit", "-")).exists():
                doc["files"][workload] = files_summary(Path(paths["shardkit"]))
        text, verdicts = report(doc)
        doc.update(table=text + doc["table"][doc["table"].rfind("\n\n"):], targets=verdicts)
        write_json(Path(args.report_only), doc)
        print(doc["table"])
        return
    if args.quick:
        args.rows, args.images, args.rounds, args.seconds, args.no_save = 2000, 300, 1, 0.3, True
        args.systems = ",".join(SHARDKIT)
    systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    bad = sorted(set(systems) - set(SYSTEMS)) + sorted(set(args.workloads) - set(WORKLOADS))
    if bad:
        parser.error(f"unknown system or workload {bad}: systems are {SYSTEMS}, workloads {WORKLOADS}")
    info = machine_info()
    load_before = os.getloadavg()
    _log(f"take benchmark on {machine_id(info)}: {args.rows:,} rows, {args.images:,} images, "
         f"{args.rounds} round(s), systems {systems}, load {load_before[0]:.1f}")
    started = time.perf_counter()
    doc = run(args, systems, _log)
    from benchmarks.images import _commit

    doc["shardkit_commit"] = _commit()
    seconds = time.perf_counter() - started
    text, verdicts = report(doc)
    after = os.getloadavg()
    text += (f"\n\nrows: {args.rows:,} of the read benchmark's; images: {args.images:,} 256x256 JPEGs; "
             f"single = one random row per lookup, batch = {BATCH} distinct random rows; each case "
             f"{args.seconds:g} s of lookups in a fresh process; medians of {args.rounds} round(s), "
             f"round-robin; {seconds / 60:.1f} min; "
             f"load (1/5/15 min) before {'/'.join(f'{v:.1f}' for v in load_before)}, after "
             f"{'/'.join(f'{v:.1f}' for v in after)} on {info['cpus']} CPUs")
    print(text)
    doc.update(seconds=seconds, load_before=load_before, load_after=after, table=text, targets=verdicts)
    if not args.no_save:
        _log(f"saved {save_results('take', doc)}")
    if args.json:
        write_json(Path(args.json), {"benchmark": "take", "machine": info, **doc})
    failed = [k for k, rs in doc["runs"].items() if any("error" in r for r in rs)]
    if failed:
        _log(f"failed cases: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
