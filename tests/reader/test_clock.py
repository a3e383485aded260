"""The wait clock: the seconds a consumer spends waiting for batches, not those it spends on them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import shardkit
from shardkit.reader._clock import WaitClock, timed


def _slow(n: int, seconds: float) -> Iterator[int]:
    for i in range(n):
        time.sleep(seconds)
        yield i


def test_the_clock_counts_the_waits_and_not_the_consumers_work() -> None:
    clock = WaitClock()
    start = time.perf_counter()
    got = []
    for i in timed(_slow(3, 0.05), clock):
        got.append(i)
        time.sleep(0.1)  # the consumer's own work
    elapsed = time.perf_counter() - start
    assert got == [0, 1, 2]
    assert clock.batches == 3
    assert clock.seconds >= 0.15  # three waits of at least 0.05 s
    assert clock.seconds <= elapsed - 0.3  # the consumer's 3 x 0.1 s are not in it


def test_a_readers_clock_holds_the_time_its_transform_held_the_consumer_up(tmp_path: Path) -> None:
    url = str(tmp_path / "ids")
    shardkit.write_dataset({"id": np.arange(24)}, url, row_group_size=8)

    def slow(sample: dict[str, object]) -> dict[str, object]:
        time.sleep(0.01)
        return sample

    with shardkit.make_reader(url, batch_size=4, seed=0, transform=slow) as reader:
        assert reader.waited.batches == 0  # a reader that never ran: zeros
        assert reader.waited.seconds == 0.0
        batches = list(reader)
        assert reader.waited.batches == len(batches) == 6
        # the stage runs at most one batch ahead of a consumer that takes nothing: 5 batches of 4 x 0.01 s
        assert reader.waited.seconds >= 5 * 4 * 0.01
