"""Resume on a table that moved on: the state names its snapshot, and readers of any number of shards
resumed from it read the rest of that snapshot, every row once."""

from __future__ import annotations

import json
import logging
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import deltalake  # noqa: F401  (installed by [dev]: a missing one is a broken install, not a skip)
import pyiceberg  # noqa: F401
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.errors import TableVersionError
from tests.dataset.tables import make_history
from tests.reader.datasets import assert_exactly_once

ops = st.tuples(st.sampled_from(["append", "overwrite", "delete"]), st.integers(5, 150))
first_ops = st.lists(ops, min_size=0, max_size=2)


def readers_of(url: str, world: int, state: dict[str, Any] | None, **kw: Any) -> list[shardkit.Reader]:
    readers = [shardkit.make_reader(url, shard=s, num_shards=world, workers=1, prefetch=2, remainder="uneven",
                                    **kw) for s in range(world)]
    if state is not None:
        for r in readers:
            r.load_state_dict(json.loads(json.dumps(state)))
    return readers


def step(readers: list[shardkit.Reader], steps: int | None, seen: Counter[int]) -> None:
    iters = [iter(r) for r in readers]
    done = 0
    while steps is None or done < steps:
        batches = [next(it, None) for it in iters]
        if all(b is None for b in batches):
            break
        for b in batches:
            if b is not None:
                seen.update(int(i) for i in b["id"])
        done += 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(["delta", "iceberg"]), before=first_ops,
       after=st.lists(ops, min_size=1, max_size=2),
       world=st.integers(1, 3), other=st.sampled_from([1, 2, 3, 7]), steps=st.integers(0, 6),
       batch_size=st.integers(3, 40), shuffle=st.booleans(), seed=st.integers(0, 2**31))
def test_resume_after_the_table_moved_on_reads_the_snapshot_once(
        fmt: str, before: list[tuple[str, int]], after: list[tuple[str, int]], world: int, other: int,
        steps: int, batch_size: int, shuffle: bool, seed: int) -> None:
    kw = {"batch_size": batch_size, "shuffle": shuffle, "seed": seed, "shuffle_buffer": 50}
    with tempfile.TemporaryDirectory() as tmp:
        history = make_history(fmt, Path(tmp) / "t", [("append", 100), *before])
        pinned, expected = history.current, history.ids()
        assume(len(expected) >= max(world, other))
        seen: Counter[int] = Counter()
        readers = readers_of(history.url, world, None, **kw)
        step(readers, steps, seen)
        states = {json.dumps(r.state_dict(), sort_keys=True) for r in readers}
        assume(len(states) == 1)  # remainder="uneven": a shard a batch ahead has no common position
        state = readers[0].state_dict()
        for r in readers:
            r.close()
        assert state["snapshot"]["version"] == pinned
        for op in after:  # the table moves on
            history.apply(op)
        assert history.current != pinned
        # readers open on the current snapshot first, which must have a row for each of them too
        assume(len(history.ids()) >= other)
        readers = readers_of(history.url, other, state, **kw)
        assert all(r.dataset.snapshot is not None and r.dataset.snapshot.version == pinned for r in readers)
        step(readers, None, seen)
        for r in readers:
            r.close()
    by_index = {v: k for k, v in enumerate(sorted(expected))}
    assert_exactly_once((by_index[i] for i in seen.elements()), len(expected))


def test_resuming_on_an_older_snapshot_logs_it_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    history = make_history("delta", tmp_path / "t", [("append", 100)])
    with shardkit.make_reader(history.url, batch_size=10, seed=1) as reader:
        it = iter(reader)
        first = [int(i) for _ in range(3) for i in next(it)["id"]]
        state = reader.state_dict()
    history.apply(("overwrite", 40))
    caplog.set_level(logging.WARNING, logger="shardkit.reader.reader")
    with shardkit.make_reader(history.url, batch_size=10, seed=1) as reader:
        assert reader.dataset.snapshot is not None
        assert reader.dataset.snapshot.version == 1
        reader.load_state_dict(state)
        rest = [int(i) for batch in reader for i in batch["id"]]
        reader.load_state_dict(state)  # the same snapshot again: nothing more to say
    assert sorted(first + rest) == list(range(100))
    messages = [r.getMessage() for r in caplog.records if "resuming on delta version 0" in r.getMessage()]
    assert len(messages) == 1, messages


def test_resuming_on_a_snapshot_that_is_gone_lists_the_versions(tmp_path: Path) -> None:
    history = make_history("iceberg", tmp_path / "t", [("append", 100), ("append", 10)])
    with shardkit.make_reader(history.url, batch_size=10) as reader:
        state = reader.state_dict()
    state["snapshot"]["version"] = 42
    with shardkit.make_reader(history.url, batch_size=10) as reader, \
            pytest.raises(TableVersionError, match="42"):
        reader.load_state_dict(state)
