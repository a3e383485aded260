"""How long the consumer of a reader waited for its batches: the time spent inside ``next()``.

A training loop alternates between waiting for the next batch and working on the last one. The reader
runs the waiting side in the consumer's own thread (the reading threads and the transform's worker
processes run ahead of it), so the seconds from asking for a batch to getting it are the seconds the
loop was held up by its data. `timed` wraps a stream of batches and adds those seconds to a `WaitClock`;
`shardkit.trainer`'s context reads the clocks of the readers it made at each heartbeat and reports the
fraction of the step time spent waiting (``data_wait``). Two ``perf_counter`` calls per batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from shardkit.reader import _profile

__all__ = ["WaitClock", "timed"]

_T = TypeVar("_T")


class WaitClock:
    """Seconds spent waiting for batches (``seconds``) and the batches waited for (``batches``); monotonic
    clock only, so a wall clock that jumps does not move it."""

    __slots__ = ("batches", "first", "last", "seconds", "since", "waiting_on")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.batches = 0
        self.since: float | None = None  # perf_counter when the consumer began waiting; None between
        #: what the reader waits on right now, in words (`StageTimes.stage_now`), for a stall report
        self.waiting_on: Callable[[], str | None] | None = None
        self.first: float | None = None  # perf_counter when the first batch was asked for
        self.last = 0.0  # perf_counter when the last batch came

    @property
    def elapsed(self) -> float:
        """Seconds from the first batch asked for to the last one handed out (0 before any)."""
        return 0.0 if self.first is None or not self.batches else max(0.0, self.last - self.first)

    def __repr__(self) -> str:
        return f"WaitClock(seconds={self.seconds:.3f}, batches={self.batches})"


def timed(batches: Iterator[_T], clock: WaitClock) -> Iterator[_T]:
    """``batches``, with the time each one took to come added to ``clock`` (the time the consumer spends
    between batches, on its own work, is not counted)."""
    if not _profile.TIMING:  # off: to measure what the clocks cost
        yield from batches
        return
    start = clock.since = time.perf_counter()
    if clock.first is None:
        clock.first = start
    try:
        for batch in batches:
            clock.last = now = time.perf_counter()
            clock.seconds += now - start
            clock.batches += 1
            clock.since = None
            yield batch
            start = clock.since = time.perf_counter()
    finally:
        clock.since = None
