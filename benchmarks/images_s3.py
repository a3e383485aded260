"""The image benchmark's remote case: the first batch from a loopback S3 store, cold cache (issue 37).

A moto S3 server on 127.0.0.1 (`benchmarks.read.MotoServer`, its own process, stopped at the end and on
failure) holds the three systems' converted datasets (the same JPEG bytes) in one bucket under three
prefixes. Each system then reads in a fresh process (round-robin, ``rounds`` times, medians), in mode
``augment``, with an EMPTY local cache folder each time: the seconds from making the dataset to the first
batch, through the DataLoader-type loader of the local cases (``num_workers=2``, batch 256, shuffle on,
seed 0), then it stops:

    shardkit   ShardkitIterableDataset("s3://...", storage_options={endpoint}, cache=<empty folder>, ...)
    litdata    StreamingDataset("s3://...", storage_options={"endpoint_url": ...}, cache_dir=<empty>, ...)
    mosaic     StreamingDataset(remote="s3://...", local=<empty>, ...), the endpoint in ``S3_ENDPOINT_URL``

The credentials are moto's dummies, in ``AWS_*`` variables for all three (obstore, LitData's async
downloader, needs ``AWS_ALLOW_HTTP`` for an ``http://`` endpoint). Per run: the bytes in the cache folder
at the first batch (what the system had stored by then, downloads in flight not counted). After the
timed rounds, one more run per system goes through a counting relay (`benchmarks.relay`, in this
process, no delay): the bytes and requests that had crossed it when the first batch arrived, and by the
end of the run; those runs are not in the medians (the relay adds a hop).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.relay import Relay

MODE = "augment"


def s3_env(endpoint: str) -> None:
    """The environment every system's S3 client reads here: moto's dummy credentials, its endpoint."""
    os.environ.update({
        "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "AWS_ALLOW_HTTP": "true",
        "S3_ENDPOINT_URL": endpoint,
    })


def folder_bytes(path: str) -> int:
    """The bytes of the files under ``path`` now (a file that goes while it is walked counts nothing)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def case_s3_first(system: str, mode: str, url: str, endpoint: str, cache_dir: str) -> dict[str, Any]:
    """shardkit's first batch from ``url`` on the S3 server at ``endpoint`` with an empty ``cache_dir``
    (`images_peers.case_s3_first` is the peers'; same arguments, same result)."""
    s3_env(endpoint)
    import fsspec
    from torch.utils.data import DataLoader

    from benchmarks.common import _cpu_ticks
    from benchmarks.images import BATCH, WORKERS, _shardkit_options
    from benchmarks.images_epoch import drain
    from shardkit.torch import ShardkitIterableDataset

    fsspec.get_filesystem_class("s3")  # imports s3fs before the clock, as the peers import boto3
    options, how = _shardkit_options(mode)
    so = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    tick = os.sysconf("SC_CLK_TCK")
    at_first: dict[str, int] = {}
    cpu0, started, clock = _cpu_ticks("self"), time.perf_counter(), time.monotonic()
    ds = ShardkitIterableDataset(url, batch_size=BATCH, seed=0, storage_options=so, cache=cache_dir,
                                 **options)
    loader = DataLoader(ds, batch_size=None, num_workers=WORKERS)
    read = drain(loader, started, 1, save=lambda: at_first.update(cached=folder_bytes(cache_dir)))
    cpu = (_cpu_ticks("self") - cpu0) / tick
    read.pop("seconds")
    return {"system": system, "mode": mode, **read, "cpu_seconds": cpu, "how": how, "clock": clock,
            "cached_bytes": at_first.get("cached", 0)}


class CountingRelay(Relay):
    """A `Relay` with no delay that also notes, at each forward, (time.monotonic(), bytes, requests)."""

    def __init__(self, target: str) -> None:
        self.marks: list[tuple[float, int, int]] = []
        super().__init__(target, 0.0)

    async def _forward(self, writer: Any, data: bytes) -> None:
        await super()._forward(writer, data)
        self.marks.append((time.monotonic(), self.stats.bytes_out, len(self.stats.requests)))

    def at(self, t: float) -> tuple[int, int]:
        """(bytes forwarded, requests seen) by the time ``t`` (``time.monotonic()``)."""
        i = bisect.bisect_right([m[0] for m in self.marks], t)
        return (self.marks[i - 1][1], self.marks[i - 1][2]) if i else (0, 0)


def s3_first_batch(systems: Sequence[str], n: int, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The S3 case (see the module docstring): its runs per system, round-robin, and the counted runs."""
    from benchmarks.common import CaseFailed, fmt_bytes
    from benchmarks.images import DATA, _dataset_path, _target, run_fresh
    from benchmarks.read import MotoServer

    out: dict[str, Any] = {"mode": MODE, "runs": {s: [] for s in systems}, "counted": {}}
    cache_root = DATA / "s3-cache"

    def one(system: str, url: str, endpoint: str) -> dict[str, Any]:
        shutil.rmtree(cache_root, ignore_errors=True)
        cache = cache_root / system
        cache.mkdir(parents=True)
        target, peers = _target(system, "case_s3_first")
        if not peers:
            target = "benchmarks.images_s3:case_s3_first"
        try:
            res = run_fresh(target, {"system": system, "mode": MODE, "url": url, "endpoint": endpoint,
                                     "cache_dir": str(cache)}, peers=peers, timeout=600)
        finally:
            res_total = folder_bytes(str(cache))
            shutil.rmtree(cache_root, ignore_errors=True)
        res["cache_bytes_at_end"] = res_total
        res.pop("ids", None)
        return res

    with MotoServer() as moto:
        started = time.perf_counter()
        urls = {s: moto.put(_dataset_path(s, n), f"images-{s}-{n}") for s in systems}
        out["upload_seconds"] = time.perf_counter() - started
        log(f"  s3: {len(urls)} datasets put on {moto.endpoint} in {out['upload_seconds']:.0f} s")
        for r in range(rounds):
            for system in systems:
                try:
                    res = one(system, urls[system], moto.endpoint)
                except (CaseFailed, OSError) as e:
                    log(f"  [{r + 1}/{rounds}] s3 first batch {system:<9} FAILED\n{str(e)[-3000:]}")
                    out["runs"][system].append({"error": str(e)[-3000:]})
                    continue
                out["runs"][system].append(res)
                log(f"  [{r + 1}/{rounds}] s3 first batch {system:<9} {res['first_batch_seconds']:.2f} s  "
                    f"cached at first {fmt_bytes(res['cached_bytes'])}  PSS {fmt_bytes(res['peak_pss'])}  "
                    f"load {res.get('load_1m', 0):.1f}")
        with CountingRelay(moto.endpoint) as relay:
            for system in systems:
                relay.reset()
                relay.marks.clear()
                try:
                    res = one(system, urls[system], relay.url)
                except (CaseFailed, OSError) as e:
                    out["counted"][system] = {"error": str(e)[-3000:]}
                    log(f"  s3 counted {system} FAILED\n{str(e)[-3000:]}")
                    continue
                fetched, requests = relay.at(res["clock"] + res["first_batch_seconds"])
                out["counted"][system] = {
                    "first_batch_seconds": res["first_batch_seconds"], "bytes_by_first": fetched,
                    "requests_by_first": requests, "bytes_total": relay.stats.bytes_out,
                    "requests_total": len(relay.stats.requests),
                    "gets_by_path": _gets(relay.stats.requests)}
                total = relay.stats.bytes_out
                log(f"  s3 counted {system:<9} by the first batch {fmt_bytes(fetched)} in {requests} "
                    f"requests ({res['first_batch_seconds']:.2f} s); in all {fmt_bytes(total)}, "
                    f"{len(relay.stats.requests)} requests")
    return out


def _gets(requests: Sequence[tuple[str, str, Any]]) -> dict[str, int]:
    """GETs per object name (the path's last part, query dropped), for the results."""
    count: dict[str, int] = {}
    for method, path, _ in requests:
        if method == "GET":
            name = path.split("?")[0].rstrip("/").rsplit("/", 1)[-1] or "/"
            count[name] = count.get(name, 0) + 1
    return count


def _median(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def report(s3: dict[str, Any], peers: Sequence[str], fmt_bytes: Callable[[float], str],
           table: Callable[[list[str], list[list[str]]], str]) -> tuple[str, list[tuple[str, bool, str]]]:
    """The S3 case's table, and its verdict (target, ok, measured) when shardkit and a peer ran."""
    if "error" in s3:
        return f"\nfirst batch from a loopback S3 store: FAILED ({s3['error'][-300:]})", []
    runs: dict[str, list[dict[str, Any]]] = s3.get("runs", {})
    counted: dict[str, dict[str, Any]] = s3.get("counted", {})
    rows = []
    firsts: dict[str, float] = {}
    for system, rs in runs.items():
        good = [r for r in rs if "error" not in r]
        c = counted.get(system, {})
        seen = (f"{fmt_bytes(c['bytes_by_first'])} ({c['requests_by_first']}) / "
                f"{fmt_bytes(c['bytes_total'])} ({c['requests_total']})" if "bytes_by_first" in c else "-")
        if not good:
            rows.append([system, "failed", "-", "-", "-", seen, "-", "-"])
            continue
        firsts[system] = _median(good, "first_batch_seconds") or 0.0
        ratios = []
        if system == "shardkit":
            for peer in peers:
                same = [a["first_batch_seconds"] / b["first_batch_seconds"]
                        for a, b in zip(rs, runs.get(peer, []), strict=False)
                        if "error" not in a and "error" not in b]
                if same:
                    ratios.append(f"{statistics.median(same):.2f}x {peer}")
        each = " ".join(f"{r['first_batch_seconds']:.2f}" for r in good)
        rows.append([system, f"{firsts[system]:.2f} s", each,
                     ", ".join(ratios) or "-", fmt_bytes(_median(good, "cached_bytes") or 0), seen,
                     fmt_bytes(_median(good, "peak_pss") or 0), f"{_median(good, 'load_1m') or 0:.1f}"])
    text = (f"\nfirst batch from a loopback S3 store (moto), cold cache, {s3.get('mode', MODE)}\n"
            + table(["system", "first batch", "runs", "shardkit / peer, same round", "in cache at first",
                     "fetched by first (requests) / in all", "peak PSS (tree)", "load"], rows))
    verdicts = []
    best = [(firsts[p], p) for p in peers if p in firsts]
    if "shardkit" in firsts and best:
        value, peer = min(best)
        verdicts.append(("s3, cold cache: first batch <= the best peer's", firsts["shardkit"] <= value,
                         f"{firsts['shardkit']:.2f} vs {value:.2f} s ({peer})"))
    return text, verdicts
