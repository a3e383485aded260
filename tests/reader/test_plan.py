"""Property tests of the pure plan (`shardkit.reader._plan`): sharding, shuffling, windows, resume."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from shardkit.errors import ReaderError
from shardkit.reader._plan import (
    ORDER,
    EpochOrder,
    Remainder,
    Window,
    first_readable,
    lead_window,
    piece_starts,
    shard_ranges,
    shard_windows,
    spread_order,
    take,
    total,
)

REMAINDERS = ("drop", "pad", "uneven")
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Row-group sizes: many empty and one-row groups, some bigger ones.
group_size = st.one_of(st.integers(0, 1), st.integers(0, 40))
layouts = st.lists(group_size, min_size=1, max_size=200).filter(lambda rows: sum(rows) > 0)


def as_layout(rows: list[int]) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64)


def indices(ranges: list[tuple[int, int]]) -> np.ndarray:
    """The ``pi`` indices of ``ranges``, in order."""
    if not ranges:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b) for a, b in ranges])


def sample_ids_of_pi(order: EpochOrder, pis: np.ndarray) -> np.ndarray:
    """Sample ids (row offsets in file order) of ``pi`` indices, straight from the definition of ``pi``."""
    rows = order.rows_per_group
    file_offsets = np.concatenate([[0], np.cumsum(rows)])
    if order.shuffle:
        size = order.window_size()
        windows = pis // size
        stream = np.empty(len(pis), dtype=np.int64)
        for w in np.unique(windows):
            at = windows == w
            stream[at] = w * size + order.window_permutation(int(w))[pis[at] - w * size]
    else:
        stream = pis
    offsets = order.stream_offsets
    slot = np.searchsorted(offsets, stream, side="right") - 1
    groups = order.group_order[slot]
    return file_offsets[groups] + (stream - offsets[slot])


def emitted_ids(order: EpochOrder, windows: list[Window]) -> np.ndarray:
    """Sample ids a shard yields: each window's task rows, concatenated, then picked by ``emit``."""
    rows = order.rows_per_group
    file_offsets = np.concatenate([[0], np.cumsum(rows)])
    out = []
    for w in windows:
        for t in w.tasks:
            assert 0 <= t.start < t.stop <= rows[t.row_group], t
        read = np.concatenate([file_offsets[t.row_group] + np.arange(t.start, t.stop) for t in w.tasks])
        pick = w.emit(order)
        if pick is None:
            got = read
        else:
            assert len(np.unique(pick)) == len(pick), "a window emits one of its rows twice"
            assert pick.min() >= 0
            assert pick.max() < len(read)
            got = read[pick]
        assert len(got) == w.num_rows
        out.append(got)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def all_pieces(n: int, k: int, **kw: object) -> list[list[tuple[int, int]]]:
    return [shard_ranges(n, shard=s, num_shards=k, **kw) for s in range(k)]  # type: ignore[arg-type]


@st.composite
def splits(draw: st.DrawFn) -> dict[str, object]:
    rows = draw(layouts)
    n = sum(rows)
    return {
        "rows": rows,
        "num_shards": draw(st.integers(1, min(n, 300))),
        "remainder": draw(st.sampled_from(REMAINDERS)),
        "batch_size": draw(st.integers(1, 32)),
        "drop_last": draw(st.booleans()),
    }


# ---- the split ------------------------------------------------------------------------------------
@SETTINGS
@given(case=splits())
def test_split_is_orthogonal_complete_and_equal(case: dict[str, object]) -> None:
    rows, k = case["rows"], case["num_shards"]
    remainder, b, drop_last = case["remainder"], case["batch_size"], case["drop_last"]
    assert isinstance(rows, list)
    assert isinstance(k, int)
    assert isinstance(b, int)
    n = sum(rows)
    pieces = all_pieces(n, k, remainder=remainder, batch_size=b, drop_last=drop_last)
    sizes = [total(p) for p in pieces]
    counts = Counter(int(i) for p in pieces for i in indices(p))
    assert all(0 <= i < n for i in counts)
    covered = len(counts)
    batches = [-(-s // b) for s in sizes]
    if drop_last:
        assert all(s % b == 0 for s in sizes), sizes
    if remainder == "uneven":
        assert max(counts.values(), default=1) == 1, "a sample in two shards"
        if drop_last:
            assert n - covered < k * b
        else:
            assert covered == n
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)  # the first shards get the extra samples
    else:
        assert len(set(sizes)) == 1, f"unequal shards {sizes}"
        assert len(set(batches)) == 1, f"unequal batch counts {batches}"
        if remainder == "drop":
            assert max(counts.values(), default=1) == 1, "a sample in two shards"
            dropped = n - covered
            assert dropped < (k * b if drop_last else k)
            if not drop_last:
                assert sizes[0] == n // k
        else:  # pad
            if drop_last:
                assert max(counts.values(), default=1) <= 2
            else:
                assert covered == n, "pad must cover every sample"
                repeats = sum(sizes) - n
                assert 0 <= repeats < k
                # the repeats are the first samples of the order (read again by the last shards)
                assert sorted(i for i, c in counts.items() if c > 1) == list(range(repeats))
                assert sizes[0] == -(-n // k)


@SETTINGS
@given(case=splits(), seed=st.integers(0, 2**32 - 1), epoch=st.integers(0, 1000), shuffle=st.booleans(),
       window=st.one_of(st.integers(1, 8), st.integers(1, 10_000)))
def test_windows_emit_exactly_the_planned_samples(case: dict[str, object], seed: int, epoch: int,
                                                  shuffle: bool, window: int) -> None:
    rows, k = case["rows"], case["num_shards"]
    assert isinstance(rows, list)
    assert isinstance(k, int)
    order = EpochOrder(as_layout(rows), seed, epoch, shuffle, window)
    n = order.num_samples
    assert sorted(order.group_order.tolist()) == list(range(len(rows)))
    pieces = all_pieces(n, k, remainder=case["remainder"], batch_size=case["batch_size"],
                        drop_last=case["drop_last"])
    every = []
    for ranges in pieces:
        windows = shard_windows(order, ranges)
        got = emitted_ids(order, windows)
        assert np.array_equal(got, sample_ids_of_pi(order, indices(ranges)))
        if case["remainder"] != "pad":
            assert len(np.unique(got)) == len(got)
        if not shuffle:  # unshuffled windows read exactly the shard's rows
            assert sum(t.stop - t.start for w in windows for t in w.tasks) == len(got)
        every.append(got)
    if case["remainder"] == "uneven" and not case["drop_last"]:
        assert np.array_equal(np.sort(np.concatenate(every)), np.arange(n))


@SETTINGS
@given(rows=layouts, seed=st.integers(0, 2**32 - 1), epoch=st.integers(0, 100),
       window=st.integers(1, 5000), shuffle=st.booleans())
def test_order_is_a_deterministic_permutation(rows: list[int], seed: int, epoch: int, window: int,
                                              shuffle: bool) -> None:
    a = EpochOrder(as_layout(rows), seed, epoch, shuffle, window)
    b = EpochOrder(as_layout(list(rows)), seed, epoch, shuffle, window)
    n = a.num_samples
    ids_a = sample_ids_of_pi(a, np.arange(n))
    assert np.array_equal(np.sort(ids_a), np.arange(n)), "pi is not a permutation"
    assert np.array_equal(ids_a, sample_ids_of_pi(b, np.arange(n)))
    full = [(0, n)]
    assert np.array_equal(emitted_ids(a, shard_windows(a, full)), emitted_ids(b, shard_windows(b, full)))
    if not shuffle:
        assert np.array_equal(ids_a, np.arange(n))


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.integers(5, 40), min_size=20, max_size=60), seed=st.integers(0, 2**31),
       window=st.integers(16, 400))
def test_other_seed_or_epoch_gives_another_order(rows: list[int], seed: int, window: int) -> None:
    layout = as_layout(rows)
    n = int(layout.sum())
    base = sample_ids_of_pi(EpochOrder(layout, seed, 0, True, window), np.arange(n))
    other_epoch = sample_ids_of_pi(EpochOrder(layout, seed, 1, True, window), np.arange(n))
    other_seed = sample_ids_of_pi(EpochOrder(layout, seed + 1, 0, True, window), np.arange(n))
    assert not np.array_equal(base, other_epoch)
    assert not np.array_equal(base, other_seed)
    # not merely a different row-group order: rows of a window are mixed too
    assert (base != np.arange(n)).mean() > 0.5


# ---- lost rows: where a sample is, and the first readable one from a place on -----------------------
@SETTINGS
@given(rows=layouts, seed=st.integers(0, 2**32 - 1), shuffle=st.booleans(), window=st.integers(1, 300),
       data=st.data())
def test_first_readable_is_the_first_known_readable_sample_on(rows: list[int], seed: int, shuffle: bool,
                                                              window: int, data: st.DataObject) -> None:
    order = EpochOrder(as_layout(rows), seed, 3, shuffle, window)
    n = order.num_samples
    groups, at = order.locate(np.arange(n))
    offsets = np.concatenate([[0], np.cumsum(rows)])
    assert np.array_equal(offsets[groups] + at, sample_ids_of_pi(order, np.arange(n)))
    bad_groups = set(data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=len(rows))))
    bad_rows: dict[int, set[int]] = {}
    for g in data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=4)):
        if rows[g]:
            bad_rows.setdefault(g, set()).update(data.draw(st.lists(st.integers(0, rows[g] - 1), max_size=5)))
    bad = np.array([g in bad_groups or r in bad_rows.get(g, ()) for g, r in zip(groups, at, strict=True)])
    start = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=20)), dtype=np.int64)
    got = first_readable(order, start, bad_groups, bad_rows)
    if bad.all() and len(start) and (bad_groups or bad_rows):
        assert got is None
        return
    assert got is not None
    for x, y in zip(start.tolist(), got.tolist(), strict=True):
        want = next(j % n for j in range(x, x + n) if not bad[j % n])
        assert y == want, (x, y, want)


def test_first_readable_over_a_long_unshuffled_run_is_quick() -> None:
    """10M samples, the first 9M of them in bad row groups: a few block steps, not a step per row."""
    order = EpochOrder(np.full(1000, 10_000, dtype=np.int64), 0, 0, False, 1)
    start = np.array([0, 5_000_000, 8_999_999, 9_500_000], dtype=np.int64)
    got = first_readable(order, start, set(range(900)), {})
    assert got is not None
    assert got.tolist() == [9_000_000, 9_000_000, 9_000_000, 9_500_000]
    assert first_readable(order, start, set(range(1000)), {}) is None


# ---- resume ---------------------------------------------------------------------------------------
@st.composite
def resumes(draw: st.DrawFn) -> dict[str, object]:
    """A layout, a policy, and 1-3 interrupted stages, each with its own shard count and progress."""
    rows = draw(layouts)
    n = sum(rows)
    remainder = draw(st.sampled_from(REMAINDERS))
    b = draw(st.integers(1, 16))
    drop_last = draw(st.booleans())
    history: list[tuple[int, int]] = []
    consumed: list[list[tuple[int, int]]] = []  # the pi ranges each shard of each stage read
    for _ in range(draw(st.integers(1, 3))):
        k = draw(st.integers(1, min(n, 40)))
        pieces = all_pieces(n, k, history=history, remainder=remainder, batch_size=b, drop_last=drop_last)
        longest = max(total(p) for p in pieces)
        steps = draw(st.integers(0, -(-longest // b)))
        c = min(steps * b, longest)  # every shard stepped `steps` batches; shorter pieces ran out
        consumed.extend(take(p, 0, c) for p in pieces)
        history.append((k, c))
    final = draw(st.integers(1, min(n, 40)))
    return {"n": n, "rows": rows, "remainder": remainder, "batch_size": b, "drop_last": drop_last,
            "history": history, "consumed": consumed, "final": final}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=resumes())
def test_exactly_once_across_resumes_with_other_shard_counts(case: dict[str, object]) -> None:
    n, k, history = case["n"], case["final"], case["history"]
    remainder, b, drop_last = case["remainder"], case["batch_size"], case["drop_last"]
    consumed = case["consumed"]
    assert isinstance(n, int)
    assert isinstance(k, int)
    assert isinstance(history, list)
    assert isinstance(consumed, list)
    last = all_pieces(n, k, history=history, remainder=remainder, batch_size=b, drop_last=drop_last)
    sizes = [total(p) for p in last]
    counts = Counter(int(i) for p in [*consumed, *last] for i in indices(p))
    missing = n - len(counts)
    if remainder != "uneven":
        assert len(set(sizes)) == 1, f"unequal shards after resume: {sizes}"
    if remainder == "uneven" and not drop_last:
        assert missing == 0, "a sample lost across the resumes"
        assert max(counts.values()) == 1, "a sample read twice across the resumes"
    elif remainder == "pad":
        if not drop_last:
            assert missing == 0
            # each stage pads fewer than its shard count
            assert sum(counts.values()) - n < k + sum(s for s, _ in history)
    else:
        assert max(counts.values(), default=1) == 1, "a sample read twice across the resumes"
        if not drop_last:
            assert missing < k, f"{missing} samples lost (only < {k} may be dropped)"
        else:
            assert missing < k * b + sum(s * b for s, _ in history)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 300), k=st.integers(1, 12), remainder=st.sampled_from(REMAINDERS),
       b=st.integers(1, 16), drop_last=st.booleans(),
       steps=st.lists(st.integers(0, 30), min_size=1, max_size=3))
@example(n=3, k=2, remainder="pad", b=1, drop_last=False, steps=[1])
@example(n=31, k=4, remainder="pad", b=3, drop_last=False, steps=[1, 1])
def test_a_resume_in_the_same_shard_count_continues_every_piece(n: int, k: int, remainder: Remainder, b: int,
                                                                drop_last: bool, steps: list[int]) -> None:
    """Stopped after some steps (once or more) and resumed with as many shards: each shard reads the
    rest of the piece it read uninterrupted, and nothing else. With ``pad`` this failed: the resumed
    stage padded anew from its own first samples, so the last shard repeated other samples than the
    uninterrupted job (3 samples, 2 shards, 1 step: it read [1] where the job reads [0])."""
    if k > n:
        k = n
    kw: dict[str, Any] = {"num_shards": k, "remainder": remainder, "batch_size": b, "drop_last": drop_last}
    fresh = [indices(shard_ranges(n, shard=s, **kw)) for s in range(k)]
    longest = max(len(f) for f in fresh)
    history: list[tuple[int, int]] = []
    done = 0
    for step in steps:
        left = longest - done
        c = min(step * b, left)
        history.append((k, c))
        done += c
        for s in range(k):
            rest = indices(shard_ranges(n, shard=s, history=history, **kw))
            assert rest.tolist() == fresh[s][done:].tolist()


def test_resume_example_from_the_docstring() -> None:
    assert shard_ranges(10, shard=1, num_shards=3) == [(3, 6)]
    assert shard_ranges(10, shard=0, num_shards=2, history=[(3, 2)]) == [(2, 3), (5, 6)]
    # the 3 -> 2 resume reads the 4 samples nobody read, once
    rest = all_pieces(10, 2, history=[(3, 2)])
    assert sorted(indices([r for p in rest for r in p]).tolist()) == [2, 5, 8, 9]


def test_a_history_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ReaderError, match="more than the stage holds"):
        shard_ranges(10, shard=0, num_shards=2, history=[(2, 6)])
    with pytest.raises(ReaderError, match="more than the stage holds"):
        shard_ranges(10, shard=0, num_shards=2, history=[(3, 5)], remainder="uneven")
    with pytest.raises(ReaderError, match="invalid"):
        shard_ranges(10, shard=0, num_shards=2, history=[(0, 1)])
    with pytest.raises(ReaderError, match="num_shards"):
        shard_ranges(10, shard=0, num_shards=0)
    with pytest.raises(ReaderError, match="shard=2"):
        shard_ranges(10, shard=2, num_shards=2)


# ---- scale ----------------------------------------------------------------------------------------
def test_planning_100k_row_groups() -> None:
    rng = np.random.default_rng(0)
    rows = rng.integers(500, 1500, size=100_000).astype(np.int64)
    n = int(rows.sum())
    start = time.perf_counter()
    order = EpochOrder(rows, seed=1, epoch=3, shuffle=True, window=64_000)
    ranges = shard_ranges(n, shard=5, num_shards=8, history=[(16, 640_000), (4, 2_560_000)])
    windows = shard_windows(order, ranges)
    elapsed = time.perf_counter() - start
    one_shard = time.perf_counter()
    full = shard_windows(order, shard_ranges(n, shard=0, num_shards=1))
    whole = time.perf_counter() - one_shard
    print(f"\nplanning 100,000 row groups ({n:,} rows): shard 5/8 after two resumes {elapsed * 1e3:.0f} ms "
          f"({len(windows)} windows); a single shard of everything {whole * 1e3:.0f} ms "
          f"({len(full)} windows)")
    assert sum(w.num_rows for w in windows) == total(ranges)
    assert sum(w.num_rows for w in full) == n


# ---- shuffle quality ------------------------------------------------------------------------------
def test_shuffle_quality_matches_a_uniform_permutation_within_windows() -> None:
    """Numbers for the default algorithm, compared with a uniform permutation of each window.

    For stream-adjacent rows ``j, j+1`` of one window of ``W`` rows, a uniform permutation puts them at
    two uniformly random distinct positions: ``E|pos(j+1) - pos(j)| = (W + 1) / 3`` and
    ``P(|pos(j+1) - pos(j)| == 1) = 2 / W``. Unshuffled, the distance is always 1.
    """
    rng = np.random.default_rng(7)
    rows = rng.integers(50, 150, size=1000).astype(np.int64)
    window = 1000
    order = EpochOrder(rows, seed=3, epoch=0, shuffle=True, window=window)
    n = order.num_samples
    full_windows = n // window
    pos = np.empty(full_windows * window, dtype=np.int64)  # pi position of each stream position
    for w in range(full_windows):
        pos[w * window + order.window_permutation(w)] = np.arange(w * window, (w + 1) * window)
    pairs = np.arange(len(pos) - 1)
    pairs = pairs[(pairs + 1) % window != 0]  # both rows in one window
    distance = np.abs(pos[pairs + 1] - pos[pairs])
    mean_rel = distance.mean() / window
    adjacent = (distance == 1).mean()
    expected_rel, expected_adj = (window + 1) / 3 / window, 2 / window
    # row groups: how many distinct row groups a batch of 256 consecutive pi rows draws from
    ids = sample_ids_of_pi(order, np.arange(full_windows * window))
    group_of = np.searchsorted(np.cumsum(rows), ids, side="right")
    per_batch = [len(np.unique(group_of[i : i + 256])) for i in range(0, len(ids) - 256, 256)]
    groups_per_window = window / rows.mean()
    print(f"\nshuffle quality (W={window}, {len(pairs):,} adjacent pairs): mean |dpos|/W = {mean_rel:.4f} "
          f"(uniform: {expected_rel:.4f}); still adjacent = {adjacent:.4%} (uniform: {expected_adj:.4%}); "
          f"row groups per 256-row batch = {np.mean(per_batch):.1f} "
          f"(a window spans ~{groups_per_window:.1f})")
    assert abs(mean_rel - expected_rel) < 0.01
    assert 0.5 * expected_adj < adjacent < 1.5 * expected_adj
    assert np.mean(per_batch) > 0.8 * groups_per_window
    # the row-group order is itself shuffled: no correlation with file order
    corr = np.corrcoef(order.group_order, np.arange(len(rows)))[0, 1]
    assert abs(corr) < 0.1


def _storage_gap(order: EpochOrder) -> float:
    """Mean distance in the dataset's order between samples adjacent in ``pi``, over a uniform
    permutation's (N / 3): what `benchmarks.images` prints as the position gap."""
    n = order.num_samples
    ids = sample_ids_of_pi(order, np.arange(n))
    return float(np.abs(np.diff(ids)).mean() / (n / 3))


@pytest.mark.parametrize(("rows", "least"), [([2000] * 50, 0.9), ([400, 3000, 1500, 2500, 800] * 10, 0.75)],
                         ids=["equal row groups", "row groups of five sizes"])
def test_a_window_of_a_tenth_of_the_data_reaches_as_far_as_a_uniform_shuffle(rows: list[int],
                                                                              least: float) -> None:
    """A window of N/10 rows spans about 5 row groups. Drawn as a plain permutation, those may lie
    side by side in the dataset, and samples adjacent in ``pi`` lie ~0.8 of a uniform shuffle's distance
    apart, from 0.75 to 0.9 with the seed (`benchmarks.images`' reach case: 0.80 and 0.85 on two
    machines, against Mosaic py1e's 0.82 with a block of the same rows). Spread (`spread_order`: one row
    group from each fifth of the dataset), at least 0.9 for every seed. Where a few large row groups
    hold most of a window's rows, more adjacent samples share one: both orders reach less, the spread
    one still further."""
    layout = as_layout(rows)
    window = int(layout.sum()) // 10
    spread = [_storage_gap(EpochOrder(layout, seed, 0, True, window)) for seed in range(8)]
    plain = [_storage_gap(EpochOrder(layout, seed, 0, True, window, order=1)) for seed in range(8)]
    assert min(spread) >= least, spread
    assert np.mean(spread) > np.mean(plain) + 0.05, (spread, plain)
    # and as many row groups per batch as before: the reach is the same, only spread
    for seed in range(2):
        groups = [EpochOrder(layout, seed, 0, True, window, order=o).locate(np.arange(int(layout.sum())))[0]
                  for o in (1, ORDER)]
        per_batch = [np.mean([len(np.unique(g[i:i + 256])) for i in range(0, len(g) - 256, 256)])
                     for g in groups]
        assert per_batch[1] >= 0.95 * per_batch[0], per_batch


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.integers(1, 60), min_size=1, max_size=80), window=st.integers(1, 3000),
       seed=st.integers(0, 2**32 - 1))
def test_a_spread_order_takes_the_parts_of_the_dataset_in_turn(rows: list[int], window: int,
                                                               seed: int) -> None:
    """`spread_order` is a permutation; cut into ``k`` parts of about equal rows (``k``: the row groups a
    window spans), the dataset gives the stream its row groups in rounds, one of each part that has
    any left per round: every prefix of the stream holds as many of each part as rounds begun, give
    or take one."""
    layout = as_layout(rows)
    n, total = len(rows), int(layout.sum())
    got = spread_order(layout, window, np.random.default_rng(seed))
    assert sorted(got.tolist()) == list(range(n))
    k = round(window * n / total)
    if k < 2 or k >= n:
        return
    middle = np.cumsum(layout) - layout / 2  # each row group's middle row: its part
    part = np.minimum(middle * k // total, k - 1).astype(int)
    sizes = np.bincount(part, minlength=k)
    taken = np.zeros(k, dtype=int)
    for g in got:
        taken[part[g]] += 1
        left = taken < sizes
        if left.any():  # the parts with row groups left are at most one round apart
            assert taken[left].max() - taken[left].min() <= 1, (taken, sizes)
        assert (taken[~left] == sizes[~left]).all()


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 400), before=st.integers(1, 24), after=st.integers(1, 24), batch=st.integers(1, 9),
       remainder=st.sampled_from(["drop", "uneven", "mask"]), data=st.data())
def test_a_stage_with_one_count_per_shard_leaves_exactly_the_rest(n: int, before: int, after: int, batch: int,
                                                                  remainder: Any, data: Any) -> None:
    """DataLoader workers a batch apart: shard k of a stage consumed counts[k] samples; the next stage
    splits exactly what none of them consumed (all of it but the last stage's remainder)."""
    if n < before:
        return
    kw = {"remainder": remainder, "batch_size": batch}
    pieces = [shard_ranges(n, shard=k, num_shards=before, **kw) for k in range(before)]
    counts = [data.draw(st.integers(0, sum(b - a for a, b in p))) for p in pieces]
    consumed: list[int] = []
    for p, c in zip(pieces, counts, strict=True):
        consumed += [i for a, b in p for i in range(a, b)][:c]
    rest = [i for k in range(after)
            for a, b in shard_ranges(n, shard=k, num_shards=after, history=[(before, counts)], **kw)
            for i in range(a, b)]
    seen = Counter(consumed + rest)
    assert max(seen.values(), default=1) == 1
    assert n - len(seen) < (after if remainder == "drop" else 1)


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.integers(1, 60), min_size=1, max_size=40), window=st.integers(1, 3000),
       shards=st.integers(1, 8), batch=st.integers(1, 64), remainder=st.sampled_from(REMAINDERS),
       seed=st.integers(0, 2**32 - 1))
def test_each_shards_first_batch_is_drawn_from_one_row_group_and_pi_stays_a_permutation(
        rows: list[int], window: int, shards: int, batch: int, remainder: Remainder, seed: int) -> None:
    """Order 3 (the quick start): every sample once; the row groups' order and every position of ``pi``
    but those a lead swapped are the spread order's; each lead (a piece's first batch) holds rows of one
    row group wherever the window's row groups have the rows for all its leads, else of as few
    neighbours in the stream as hold them; the reader's lead window reads only those."""
    layout = as_layout(rows)
    n = int(layout.sum())
    assume(shards <= n)
    starts = piece_starts(n, shards, remainder, batch)
    order = EpochOrder(layout, seed, 0, True, window, 3, starts, batch)
    plain = EpochOrder(layout, seed, 0, True, window, 2)
    ids = order.row_index(np.arange(n))
    assert sorted(ids.tolist()) == list(range(n))
    np.testing.assert_array_equal(order.group_order, plain.group_order)
    size = order.window_size()
    lead_rows = np.zeros(n, dtype=bool)
    for w in range(-(-n // size)):
        zones = order.lead_zones(w)
        segs = order.segments(w * size, min(n, (w + 1) * size))
        groups_at = np.repeat(np.arange(len(segs)), [hi - lo for _, lo, hi in segs])  # stream offset -> seg
        perm = order.window_permutation(w)
        for at, length in zones:
            lead_rows[w * size + at:w * size + at + length] = True
            used = np.unique(groups_at[perm[at:at + length]])
            if len(segs) > 1 and min(hi - lo for _, lo, hi in segs) >= sum(r for _, r in zones):
                assert len(used) == 1, (zones, segs, used)
            assert len(used) <= len(segs)
    changed = ids != plain.row_index(np.arange(n))
    assert not changed[~lead_rows].sum() > lead_rows.sum()  # a displaced sample per lead row, at most
    for a in starts:  # the reader reads a piece's lead alone: the row groups of its rows only
        piece_windows = shard_windows(order, [(a, min(n, a + 4 * batch))])
        cut = lead_window(order, piece_windows, a)
        if len(cut) > len(piece_windows) or cut[0].spans is not None:
            lead = cut[0]
            emitted = lead.emit(order)
            got = np.concatenate([np.arange(t.start, t.stop) + int(order.stream_offsets[
                int(np.flatnonzero(order.group_order == t.row_group)[0])]) for t in lead.tasks])[emitted]
            want = order.stream_positions(np.arange(a, a + lead.num_rows))
            np.testing.assert_array_equal(got, want)
