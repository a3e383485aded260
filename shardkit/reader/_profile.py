"""Where a reader's time goes: the busy time of each stage, what the consumer waited on, and a one-screen
breakdown (`Reader.profile`) that names the stage that limits throughput and what to change.

The consumer's side adds up by construction: from its first ``next()`` to its last batch, it either
worked on its own (the training step: the time between batches) or waited inside ``next()``; the wait
splits into waiting for rows being read (fetched and decoded from Parquet, in the reading threads),
waiting for the decode/transform stage, and the reader's own work in the consumer's thread (cutting
windows into batches, the shuffle's gather). The stages' busy times are summed over their threads or
processes, so a stage that is busy all the time in 2 threads shows twice the wall time. All clocks are
``time.perf_counter`` (monotonic): a wall clock that jumps moves none of them. Always on: a few clock
reads per task and per batch.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["TIMING", "StageTimes", "bottleneck", "breakdown", "render"]

#: The stage clocks (and the wait clock of `shardkit.reader._clock`) are on. Off only to measure what
#: they cost (`benchmarks.read`'s ``shardkit-notelemetry``): set before a reader is made.
TIMING = True


class StageTimes:
    """Seconds per stage, added from any thread: ``read`` (a reading task: fetch and Parquet, then to
    numpy), ``read_arrow`` (its fetch and Parquet part), ``read_checksums`` (of that, checking the page
    checksums: set from the dataset's count, `Dataset.checksum_seconds`), ``read_numpy`` (its codecs'
    part), and in the consumer's thread ``read_blocked`` (waiting for a reading task's rows) and
    ``stage_blocked`` (waiting for a batch's decode/transform); ``read_tasks`` counted."""

    NAMES = ("read", "read_arrow", "read_checksums", "read_numpy", "read_blocked", "stage_blocked")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = dict.fromkeys(self.NAMES, 0.0)
        self.read_tasks = 0
        #: what the consumer's thread is blocked on now: ``"read_blocked"``, ``"stage_blocked"`` or None
        self.waiting_on: str | None = None

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] += seconds

    def task(self, seconds: float) -> None:
        with self._lock:
            self.seconds["read"] += seconds
            self.read_tasks += 1

    def blocked(self, name: str, since: float) -> None:
        """Consumer-thread time blocked since ``since``, and no longer blocked (only the consumer's thread
        adds to these two names: no lock)."""
        self.seconds[name] += time.perf_counter() - since
        self.waiting_on = None

    def stage_now(self) -> str | None:
        """The stage the consumer waits for at this moment, in words (None: not blocked on one)."""
        return {"read_blocked": "rows being read (fetch and Parquet)",
                "stage_blocked": "the decode/transform stage"}.get(self.waiting_on or "")


def breakdown(*, elapsed: float, waited: float, batches: int, times: StageTimes,
              stage: dict[str, float] | None, workers: int, processes: int,
              has_transform: bool) -> dict[str, Any]:
    """The numbers `render` prints (and `Reader.profile(as_dict=True)` returns)."""
    read_blocked = times.seconds["read_blocked"]
    stage_blocked = times.seconds["stage_blocked"]
    stage = stage or {}
    transform = max(0.0, stage.get("seconds_busy", 0.0) - stage.get("seconds_prepare", 0.0))
    out: dict[str, Any] = {
        "batches": batches, "elapsed_seconds": elapsed, "waited_seconds": waited,
        "consumer_seconds": max(0.0, elapsed - waited),
        "wait_read_seconds": min(read_blocked, waited), "wait_stage_seconds": min(stage_blocked, waited),
        "wait_assemble_seconds": max(0.0, waited - read_blocked - stage_blocked),
        "read_busy_seconds": times.seconds["read"], "read_arrow_seconds": times.seconds["read_arrow"],
        "read_checksum_seconds": times.seconds["read_checksums"],
        "read_numpy_seconds": times.seconds["read_numpy"], "read_tasks": times.read_tasks,
        "read_threads": workers, "decode_busy_seconds": stage.get("seconds_prepare", 0.0),
        "transform_busy_seconds": transform, "transform_processes": processes,
        "has_transform": has_transform,
    }
    out["limited_by"], out["advice"] = bottleneck(out)
    return out


def bottleneck(b: dict[str, Any]) -> tuple[str, str]:
    """The stage that limits throughput, and what to change (from a `breakdown`)."""
    elapsed = b["elapsed_seconds"]
    if not b["batches"] or elapsed <= 0:
        return "nothing yet", "no batch read yet"
    if b["waited_seconds"] < 0.1 * elapsed:
        return "the consumer", ("the reader keeps up: the time goes to the work between batches (the "
                                "training step); a faster reader will not make it faster")
    waits = {"read": b["wait_read_seconds"], "stage": b["wait_stage_seconds"],
             "assemble": b["wait_assemble_seconds"]}
    worst = max(waits, key=lambda k: waits[k])
    if worst == "read":
        if b["read_arrow_seconds"] >= b["read_numpy_seconds"]:
            checks = b["read_checksum_seconds"]
            of_which = (f"; checking page checksums took {checks:.1f} s of it (every page is checked before "
                        "it is decoded)") if checks >= 0.25 * b["read_arrow_seconds"] > 0 else ""
            return "reading (fetch and Parquet)", (
                f"reading threads busy {b['read_busy_seconds']:.1f} s over {b['read_threads']} thread(s): "
                "raise workers= and prefetch= (a remote store: more requests in flight, "
                f"max_inflight_bytes=), read fewer columns=, keep a cache= for the next epochs{of_which}")
        return "decoding columns to numpy", (
            f"codecs took {b['read_numpy_seconds']:.1f} s in the reading threads: raise workers=, read "
            "fewer columns=")
    if worst == "stage":
        if b["has_transform"] and b["transform_busy_seconds"] >= b["decode_busy_seconds"]:
            where = (f"{b['transform_processes']} worker process(es)" if b["transform_processes"]
                     else "one thread of this process")
            return "the transform", (f"transform= ran {b['transform_busy_seconds']:.1f} s in {where}: raise "
                                     "transform_workers= (or read through DataLoader workers), or make it "
                                     "cheaper")
        return "image decoding", (f"decoding images (or gathering encoded bytes) took "
                                  f"{b['decode_busy_seconds']:.1f} s: raise workers= (the decode threads) or "
                                  "transform_workers=, or decode elsewhere (decode=False)")
    return "batch assembly", ("the shuffle window's gather into batches, in the consumer's thread: a smaller "
                              "shuffle_buffer= or fewer columns=")


def render(b: dict[str, Any], title: str) -> str:
    """One screen: the consumer's time, the stages' busy time, the limit and the advice."""
    elapsed = b["elapsed_seconds"]

    def share(seconds: float, of: float) -> str:
        return f"{seconds / of:4.0%}" if of > 0 else "   -"

    lines = [f"{title}: {b['batches']:,} batches in {elapsed:.2f} s of iteration",
             "  the consumer's time (adds up to the iteration):",
             f"    its own work between batches  {b['consumer_seconds']:8.2f} s  "
             f"{share(b['consumer_seconds'], elapsed)}",
             f"    waiting for batches           {b['waited_seconds']:8.2f} s  "
             f"{share(b['waited_seconds'], elapsed)}",
             f"      for rows being read         {b['wait_read_seconds']:8.2f} s",
             f"      for decode/transform        {b['wait_stage_seconds']:8.2f} s",
             f"      assembling batches          {b['wait_assemble_seconds']:8.2f} s",
             "  the stages' busy time (summed over threads and processes):",
             f"    read: fetch + Parquet         {b['read_arrow_seconds']:8.2f} s  "
             f"({b['read_tasks']:,} tasks, {b['read_threads']} thread(s))",
             f"      of which page checksums     {b['read_checksum_seconds']:8.2f} s",
             f"    read: to numpy                {b['read_numpy_seconds']:8.2f} s",
             f"    image decode                  {b['decode_busy_seconds']:8.2f} s",
             f"    transform                     {b['transform_busy_seconds']:8.2f} s  "
             f"({b['transform_processes']} process(es))",
             f"  limited by: {b['limited_by']}",
             f"  what to change: {b['advice']}"]
    return "\n".join(lines)
