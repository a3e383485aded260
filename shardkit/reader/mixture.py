"""Mixtures: several datasets read as one weighted stream, sharded, shuffled and resumable like one.

``make_reader({"web": url_a, "books": url_b}, weights={"web": 3, "books": 1}, samples_per_epoch=N)``
returns a `MixedReader`; a weight may also change with the samples read (``{"web": [(0, 3), (1_000_000,
1)], "books": 1}``, see "Scheduled weights"). What it reads is a pure function of the seed, the sources
and the weights:

The mixed stream. Global positions ``0, 1, 2, ...`` run on without end; position ``p`` belongs to the
source `Schedule.sources` says, and is that source's ``k``-th sample, ``k`` the number of positions of
the source before ``p``. A source's samples run through passes: sample ``k`` is row ``k % rows`` of pass
``k // rows`` in the pass's order, which is the order a one-shard `Reader` of that source gives its epoch
``k // rows`` (row groups in a spread random order, rows shuffled within a window), seeded by the
mixture's seed and the source's name. So within a pass every row of the source comes exactly once,
before any row repeats, and a source that runs out starts its next pass. Nothing here depends on the
number of shards.

The schedule. Tijdeman's solution of the chairman assignment problem (R. Tijdeman, "The chairman
assignment problem", Discrete Mathematics 32, 1980): at each position, among the sources that are owed
at least ``1/(2n-2)`` of a sample, the one whose next sample is due first. With shares ``s_i`` (the
weights normalized; see `Mixture.of` for how they are made exact) and ``n`` sources of positive weight,
every prefix of ``p`` positions holds ``c_i`` samples of source ``i`` with ``|c_i - s_i * p| <= 1 -
1/(2n-2)``, so any ``m`` consecutive positions hold it ``s_i * m`` times to within ``2 - 1/(n-1)``
(two sources: within 1 in every window). It repeats with the period ``W`` of the shares' common
denominator, so a position's source and a source's count are looked up, never replayed. (A smooth
weighted round robin, the largest deficit first, passes 1 for some weights; a random draw per sample, as
torchdata's ``MultiNodeWeightedSampler`` makes, is off by about the square root of the window.)

Scheduled weights. A weight may be a schedule (`WeightSchedule`): ``(samples, weight)`` points, linear
between them or in steps, as a function of the samples the mixture has read: its stream position, the
same for every shard, so every shard agrees on the weights at each position and the stream stays a
pure function of the seed, the sources and the weights. The stream is cut into pieces of constant
shares (`Weights.realize`): a stretch where no weight changes is one piece at its exact shares, which
ends at the whole number of its periods nearest the next breakpoint (so a breakpoint moves by less
than half a period: 2 positions at 3:1); a linear ramp goes in steps of at least `RAMP_STEP` positions,
each at the shares of its middle in multiples of ``1 / RAMP_STEP``. Every piece is whole periods long,
so at its end each source has exactly its share of it: the prefix bound above holds along the whole
stream against the shares it is read at (`Mixture.shares_at`), and any ``m`` consecutive positions hold
each source the sum of its shares over them, to within ``2 - 1/(n-1)``. Positions still map to a
source's count by lookup (`Piecewise`: the piece, then its period), never by replay.

Reweighting. A state holds the weights it was read at; a reader at other weights refuses it, unless
``load_state_dict(state, reweight=True)``: the stream then goes on in a new `Era` at the new weights
(`MixedReader._reweighted`). The positions the epoch's stages read keep their sources and samples; the
rest of the epoch moves, in its order, to the first positions of the new era, and the samples the old
weights had put there are the era's holes: each source reads its holes first, then goes on past every
sample the old eras reached. So every sample of every source is read once, as without the reweight,
and each pass still holds each row once. The new era reads its schedule from the samples read so far
(``epoch * samples_per_epoch`` plus the epoch's read positions). The eras are part of the state, so a
later resume, on any number of shards, continues the same stream without ``reweight``; the sources'
shuffle windows stay those of the first weights (a source's pass order follows its window).

Epochs and shards. An epoch is ``samples_per_epoch`` positions of the stream, split among the shards
exactly as a `Reader` splits its epoch (`shardkit.reader._plan.shard_ranges`: contiguous, equal
pieces; resume stages; the remainder policy), so a shard's stream is a contiguous run of the global
stream, and each source's rows for it are a contiguous run of that source's passes, read in whole
windows by the source's own `Reader`. A mixture never skips a position: those an epoch leaves out
(``remainder="drop"``, ``drop_last``) are the first ones of the next epoch, so the next epoch starts
where the last one stopped (`_Boundary`). ``remainder="pad"`` repeats a few positions of the epoch
(their rows come twice in their pass).

Masked remainder (``remainder="mask"``). The epoch splits as with ``"uneven"`` (pieces one position apart
at most, none left out, so nothing is carried to the next epoch), and every shard steps the batches of
the stage's longest piece, as a `Reader` does: each batch has ``batch_size`` rows and the bool column
``__valid__``. A piece's last partial batch is filled with copies of its first row (its ``__source__``
too), masked; a shard one batch short (its piece a whole number of batches, or empty) steps a batch of
masked rows, ``batch_size`` copies of one row: the first row of the first source with rows, read once
per reader (`MixedReader._masked_row`; its ``__source__`` that source's index), never a position of the
stream. Masked rows are never counted as consumed, so a resume on any number of shards, or DataLoader
workers resumed on another layout, read every position of the epoch once.

Resume. `MixedReader.state_dict` holds the epoch, its stages (as a `Reader`'s, so every adapter reads
it the same way), where the epoch starts in the stream, the weights' eras, and each source's own reader
state (its table snapshot, its fingerprint); a reader with the same or another number of shards
continues from it, and what the two runs read together is a prefix of the stream, each position once.
A state saved before schedules (no ``schedule`` key) is read as one era of its constant shares.

Reading. Each source is read by a one-shard `Reader` (its filter, cache, lost rows and table snapshot as
for one dataset), positioned with its own state at the first sample the shard needs of it, with the
source's share of the threads, the read-ahead and the shuffle window. Its workers copy each decoded row
straight to its position in the mixed batches' memory (`_Placing`, `_pipeline.placing.Blocks`), so a
row is copied once, in parallel, as in one reader's shuffled window; the batches are views of it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import heapq
import itertools
import json
import math
import numbers
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from functools import cached_property, lru_cache
from typing import Any, Literal

import numpy as np

from shardkit.dataset import Field, Schema
from shardkit.errors import ReaderError, SchemaMismatchError, ShardkitError
from shardkit.reader._clock import WaitClock, timed
from shardkit.reader._pipeline import batching
from shardkit.reader._pipeline.assemble import VALID, masked
from shardkit.reader._pipeline.placing import Blocks, WindowPlacement, destinations
from shardkit.reader._plan import (
    Ranges,
    Remainder,
    Stage,
    Task,
    merge,
    shard_ranges,
    stage_counts,
    take,
    total,
)
from shardkit.reader._profile import StageTimes, breakdown, render
from shardkit.reader.reader import Reader, closed_error

Columns = dict[str, np.ndarray]

#: The column of every mixed batch that says which source each row came from: the source's index in
#: ``reader.sources`` (int32).
SOURCE = "__source__"
#: The longest schedule period: shares whose common denominator is larger are rounded to multiples of
#: ``1 / MAX_PERIOD`` (see `Mixture.of`).
MAX_PERIOD = 1 << 16
#: The `make_reader` arguments a mixture takes per source, as a dict of source name -> value.
PER_SOURCE = frozenset({"filter", "storage_options", "version", "schema"})
STATE_KIND = "shardkit.mixture"
#: About the most bytes of rows one block of a mixture's batches' memory holds (`_pipeline.placing.Blocks`).
BLOCK_BYTES = 64 << 20
STATE_VERSION = 1


# ---- the schedule ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which source each position of the mixed stream belongs to, for integer ``quotas`` per period.

    Example:
        >>> s = Schedule((3, 1))
        >>> s.sources(0, 8).tolist()
        [0, 0, 1, 0, 0, 0, 1, 0]
        >>> s.counts(6).tolist()       # positions 0..5: five of source 0, one of source 1
        [5, 1]

    See the module docstring for the bound it keeps; `bound` is its value for these quotas.
    """

    quotas: tuple[int, ...]

    @property
    def period(self) -> int:
        return sum(self.quotas)

    @property
    def n(self) -> int:
        """The number of sources."""
        return len(self.quotas)

    @property
    def bound(self) -> float:
        """The most ``|count - share * p|`` reaches over every prefix ``p`` of the stream, for any source."""
        n = sum(1 for q in self.quotas if q)
        return 0.0 if n <= 1 else 1 - 1 / (2 * n - 2)

    @cached_property
    def sequence(self) -> np.ndarray:
        """One period: the source of positions ``0 .. period - 1`` (int32)."""
        return _tijdeman(self.quotas)

    @cached_property
    def _occurrences(self) -> list[np.ndarray]:
        """Per source, its positions within one period, ascending."""
        order = np.argsort(self.sequence, kind="stable")
        cuts = np.searchsorted(self.sequence[order], np.arange(len(self.quotas) + 1))
        return [order[cuts[i] : cuts[i + 1]] for i in range(len(self.quotas))]

    def sources(self, start: int, stop: int) -> np.ndarray:
        """The source of each position in ``[start, stop)`` (int32)."""
        w, n = self.period, stop - start
        if start % w + n <= len(self._repeated):  # a slice of periods laid end to end (a batch's worth)
            return self._repeated[start % w : start % w + n]
        return self.sequence[np.arange(start % w, start % w + n) % w]  # (np.take's mode="wrap" is slow)

    @cached_property
    def _repeated(self) -> np.ndarray:
        """The period repeated to at least 4,096 positions and two periods (read-only)."""
        out = np.tile(self.sequence, max(2, -(-4096 // self.period) + 1))
        out.flags.writeable = False
        return out

    def counts(self, position: int) -> np.ndarray:
        """How many positions before ``position`` each source has (int64, one per source)."""
        full, rest = divmod(position, self.period)
        return np.array([full * q + int(np.searchsorted(occ, rest)) for q, occ in
                         zip(self.quotas, self._occurrences, strict=True)], dtype=np.int64)

    def counts_at(self, positions: np.ndarray) -> np.ndarray:
        """`counts` of each of ``positions`` (int64 ``(len(positions), sources)``)."""
        full, rest = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        return np.stack([full * q + np.searchsorted(occ, rest) for q, occ in
                         zip(self.quotas, self._occurrences, strict=True)], axis=1)


@lru_cache(maxsize=32)
def _tijdeman(quotas: tuple[int, ...]) -> np.ndarray:
    """One period of Tijdeman's schedule for ``quotas`` (see the module docstring), in exact integers.

    Slot ``t`` (1-based) goes, among the sources eligible for their next sample (``s_i t - c_i >= d``,
    ``d = 1/(2n-2)``, ``c_i`` their count so far), to the one with the earliest deadline ``(c_i + 1 - d)
    / s_i``, ties to the lower index. Sources become eligible at known slots, so it runs on two heaps:
    O(W log n) for a period of W slots. After W slots every source has exactly its quota (the bound is
    below 1), so the next period repeats this one.
    """
    period = sum(quotas)
    active = [i for i, q in enumerate(quotas) if q]
    out = np.empty(period, dtype=np.int32)
    if len(active) == 1:
        out.fill(active[0])
        return out
    if len(active) == 2:
        # the same slots as the heaps below give, in closed form (tests hold them equal): the first source
        # has floor(s t + 1/2) of the first t slots. A schedule's ramp reads hundreds of periods.
        first, second = active
        t = np.arange(period + 1, dtype=np.int64)
        counts = (2 * quotas[first] * t + period) // (2 * period)
        out[:] = np.where(np.diff(counts) == 1, first, second)
        return out
    return _tijdeman_heaps(quotas)


def _tijdeman_heaps(quotas: tuple[int, ...]) -> np.ndarray:
    """`_tijdeman` for any number of sources, on two heaps."""
    period = sum(quotas)
    active = [i for i, q in enumerate(quotas) if q]
    out = np.empty(period, dtype=np.int32)
    d = 2 * len(active) - 2  # d = 1/D below: scaled by D to stay in integers
    scale = math.lcm(*(quotas[i] for i in active))  # deadlines as integers: W (jD - 1) / (q D) * (L D / W)
    counts = [0] * len(quotas)

    def release(i: int) -> int:  # the first slot where source i is owed 1/D of its next sample
        return -(-(counts[i] * d + 1) * period // (quotas[i] * d))

    def deadline(i: int) -> int:
        return ((counts[i] + 1) * d - 1) * (scale // quotas[i])

    waiting = [(release(i), i) for i in active]
    heapq.heapify(waiting)
    ready: list[tuple[int, int]] = []
    for t in range(1, period + 1):
        while waiting and waiting[0][0] <= t:
            i = heapq.heappop(waiting)[1]
            heapq.heappush(ready, (deadline(i), i))
        if not ready:  # cannot happen (Tijdeman's theorem); a wrong schedule must not pass silently
            raise AssertionError(f"no source is eligible at slot {t} of the schedule for {quotas}")
        i = heapq.heappop(ready)[1]
        out[t - 1] = i
        counts[i] += 1
        if counts[i] < quotas[i]:
            heapq.heappush(waiting, (release(i), i))
    return out


# ---- weights that change: schedules ------------------------------------------------------------------

#: A linear ramp of weights is read in steps of constant shares, each at least ``RAMP_STEP`` positions long
#: and with shares that are multiples of ``1 / RAMP_STEP``; a ramp has at most ``MAX_RAMP_STEPS`` steps.
RAMP_STEP = 1024
MAX_RAMP_STEPS = 256
Kind = Literal["linear", "steps"]


@dataclasses.dataclass(frozen=True)
class WeightSchedule:
    """A source's weight as a function of the samples the mixture has read (its position in the mixed
    stream, all shards together): ``points`` are ``(samples, weight)`` pairs, ``samples`` ints >= 0 that
    strictly increase, ``weight`` numbers >= 0.

    ``kind="linear"`` (what a plain list of pairs means): the weight runs linearly from one point to the
    next. ``kind="steps"``: each point's weight holds until the next point. Before the first point the
    weight is the first one's, after the last one the last one's.

    Example:
        >>> anneal = WeightSchedule([(0, 3), (1_000_000, 1)])   # 3 -> 1 over the first 1M samples
        >>> anneal.at(500_000), anneal.at(5_000_000)
        (Fraction(2, 1), Fraction(1, 1))
        >>> WeightSchedule([(0, 1), (1000, 0)], kind="steps").at(999)
        Fraction(1, 1)

    `WeightSchedule.sampled` makes one from a function of the samples read.
    """

    points: tuple[tuple[int, Fraction], ...]
    kind: Kind = "linear"

    def __init__(self, points: Sequence[Sequence[Any]], kind: Kind = "linear") -> None:
        object.__setattr__(self, "points", _points(points, kind, "WeightSchedule"))
        object.__setattr__(self, "kind", kind)

    @classmethod
    def sampled(cls, weight: Callable[[int], float], *, stop: int, count: int = 64,
                kind: Kind = "linear") -> WeightSchedule:
        """``weight(samples)`` at ``count + 1`` points evenly spaced from 0 to ``stop`` (the last value
        holds after it), as breakpoints: what a state saves and a resume reads, so the function itself is
        never saved, and needs to be neither picklable nor around at the resume.

        ``weight`` must be deterministic: it is called twice at each point, and two values at one point
        are a `ReaderError`.

        Example:
            >>> WeightSchedule.sampled(lambda n: 1 + n / 1000, stop=2000, count=2).points
            ((0, Fraction(1, 1)), (1000, Fraction(2, 1)), (2000, Fraction(3, 1)))
        """
        if isinstance(stop, bool) or not isinstance(stop, int) or isinstance(count, bool) \
                or not isinstance(count, int) or count < 1 or stop < count:
            raise ReaderError(f"WeightSchedule.sampled(stop={stop!r}, count={count!r}): stop and count are "
                              "ints with stop >= count >= 1 (count + 1 points from 0 to stop)")
        xs = sorted({stop * j // count for j in range(count + 1)})
        out = []
        for x in xs:
            first, again = weight(x), weight(x)
            if first != again:
                raise ReaderError(f"the weight function {weight!r} gave {first!r} and then {again!r} at "
                                  f"{x} samples: a schedule must give one value per point (no random draws, "
                                  "no clock, no state); make it a function of the samples alone")
            out.append((x, first))
        return cls(out, kind)

    def at(self, samples: int | Fraction) -> Fraction:
        """The weight at ``samples`` samples read."""
        xs = [x for x, _ in self.points]
        j = bisect.bisect_right(xs, samples) - 1
        if j < 0:
            return self.points[0][1]
        if self.kind == "steps" or j == len(xs) - 1:
            return self.points[j][1]
        (x0, w0), (x1, w1) = self.points[j], self.points[j + 1]
        return w0 + (w1 - w0) * Fraction(samples - x0) / (x1 - x0)

    def to_json(self) -> Any:
        """``"3"`` for a constant weight, else ``{kind: [[samples, "weight"], ...]}`` (weights exact)."""
        if len(self.points) == 1 and self.points[0][0] == 0:
            return str(self.points[0][1])
        return {self.kind: [[x, str(w)] for x, w in self.points]}

    def plain(self) -> Any:
        """The weight as a number (a constant) or ``[[samples, weight], ...]`` pairs (``{"steps": ...}``)."""
        if len(self.points) == 1 and self.points[0][0] == 0:
            w = self.points[0][1]
            return int(w) if w.denominator == 1 else float(w)
        pairs = [[x, int(w) if w.denominator == 1 else float(w)] for x, w in self.points]
        return pairs if self.kind == "linear" else {"steps": pairs}


def _weight_number(value: Any, where: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ReaderError(f"{where}={value!r} is not a number; a weight is an int or float >= 0 (its share "
                          "of the stream is weight / sum of weights), or a schedule: [(samples, weight), "
                          "...] pairs")
    if value < 0:
        raise ReaderError(f"{where}={value!r} is negative; a weight is >= 0 (0 leaves the source out of the "
                          "stream, or out of that part of a schedule)")
    if isinstance(value, float | np.floating):
        return Fraction(str(value))
    return Fraction(value)  # type: ignore[call-overload,no-any-return]


def _points(points: Any, kind: Any, where: str) -> tuple[tuple[int, Fraction], ...]:
    """A schedule's breakpoints checked and exact (see `WeightSchedule`), or a `ReaderError` naming
    ``where`` they came from."""
    example = "[(0, 3), (1_000_000, 1)]"
    if kind not in ("linear", "steps"):
        raise ReaderError(f"{where}: kind={kind!r} is not a kind of schedule; use 'linear' (the weight runs "
                          "linearly between points) or 'steps' (each point's weight holds until the next)")
    if isinstance(points, str | bytes | Mapping) or not isinstance(points, Sequence) or not points:
        raise ReaderError(f"{where}={points!r} is not a schedule; give (samples, weight) pairs with the "
                          f"samples increasing, e.g. {example}")
    out: list[tuple[int, Fraction]] = []
    for j, pair in enumerate(points):
        if isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ReaderError(f"{where}[{j}]={pair!r} is not a (samples, weight) pair; give pairs, e.g. "
                              f"{example}")
        x, w = pair
        x = int(x) if isinstance(x, np.integer) else x
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ReaderError(f"{where}[{j}] has samples={x!r}; a point's samples are an int >= 0 (the "
                              "samples the mixture has read, all shards together)")
        if out and x <= out[-1][0]:
            raise ReaderError(f"{where}[{j}] is at {x} samples, after a point at {out[-1][0]}: the points' "
                              f"samples must increase strictly; sort them and give each place once, e.g. "
                              f"{example}")
        out.append((x, _weight_number(w, f"{where}[{j}] weight")))
    return tuple(out)


def _schedule_of(value: Any, where: str) -> WeightSchedule:
    """A source's weight as given (a number, pairs, ``{"linear"|"steps": pairs}``, a `WeightSchedule`) as a
    `WeightSchedule`."""
    if isinstance(value, WeightSchedule):
        return value
    if callable(value):
        raise ReaderError(f"{where} is the function {value!r}: a state must be able to say which weights it "
                          "was read with, so a function is taken as breakpoints: "
                          "WeightSchedule.sampled(function, stop=N) (it checks that the function gives one "
                          "value per point)")
    if isinstance(value, Mapping):
        if len(value) != 1 or next(iter(value)) not in ("linear", "steps"):
            raise ReaderError(f"{where}={value!r}: a schedule as a dict has one key, 'linear' or 'steps', "
                              "holding its (samples, weight) pairs, e.g. {'steps': [[0, 1], [1000000, 0]]}")
        kind, points = next(iter(value.items()))
        return WeightSchedule(_points_json(points, where) if _is_json(points) else
                              _points(points, kind, where), kind)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return WeightSchedule(_points(value, "linear", where))
    return WeightSchedule([(0, _weight_number(value, where))], "steps")


def _is_json(points: Any) -> bool:
    return isinstance(points, list) and any(isinstance(p, list) and len(p) == 2 and isinstance(p[1], str)
                                            for p in points)


def _points_json(points: Any, where: str) -> list[tuple[Any, Fraction]]:
    try:
        return [(x, Fraction(w)) for x, w in points]
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ReaderError(f"{where}={points!r} is not a saved schedule ({e})") from e


@dataclasses.dataclass(frozen=True)
class Weights:
    """Every source's weight, as a schedule (a constant weight is a schedule of one point), checked: what
    ``weights=`` says. Make one with `check_weights`."""

    names: tuple[str, ...]
    schedules: tuple[WeightSchedule, ...]

    @classmethod
    def constant(cls, names: Sequence[str], weights: Sequence[Fraction]) -> Weights:
        return cls(tuple(names), tuple(WeightSchedule([(0, w)], "steps") for w in weights))

    @property
    def is_constant(self) -> bool:
        return all(len(s.points) == 1 for s in self.schedules)

    @cached_property
    def breakpoints(self) -> tuple[int, ...]:
        """Where any source's weight changes its course, from 0 on."""
        return tuple(sorted({0, *(x for s in self.schedules for x, _ in s.points)}))

    def at(self, samples: int | Fraction) -> tuple[Fraction, ...]:
        return tuple(s.at(samples) for s in self.schedules)

    @cached_property
    def ever_positive(self) -> tuple[bool, ...]:
        return tuple(any(w for _, w in s.points) for s in self.schedules)

    def key(self) -> Any:
        """What two mixtures must share to read one stream: the shares of constant weights (3:1 and 6:2 are
        one), else the schedules."""
        if self.is_constant:
            return ["shares", [str(s) for s in _shares(self.at(0))]]
        return ["schedule", self.to_json()]

    def to_json(self) -> dict[str, Any]:
        return {name: s.to_json() for name, s in zip(self.names, self.schedules, strict=True)}

    @classmethod
    def from_json(cls, names: Sequence[str], data: Any) -> Weights:
        """The weights `to_json` saved (a `ReaderError` where they are not)."""
        if not isinstance(data, Mapping) or list(data) != list(names):
            raise ReaderError(f"the mixture state's weights {data!r} are not saved weights of the sources "
                              f"{list(names)}")
        out = []
        for name in names:
            value = data[name]
            if isinstance(value, str):
                try:
                    value = Fraction(value)
                except (ValueError, ZeroDivisionError) as e:
                    raise ReaderError(f"the mixture state's weight of {name!r} is {value!r}, not a "
                                      "number") from e
            out.append(_schedule_of(value, f"the saved weight of {name!r}"))
        return cls(tuple(names), tuple(out))

    def _flat(self, a: int, b: int) -> bool:
        """Whether every weight is constant on ``[a, b)`` (no breakpoint inside it)."""
        return all(s.kind == "steps" or s.at(a) == s.at(b) for s in self.schedules)

    def realize(self, start: int, time: int = 0) -> Piecewise:
        """The pieces of constant shares the stream reads these weights in (see `_realize`); one object for
        the same arguments (its periods are worked out once)."""
        return _realize(self, start, time)


@lru_cache(maxsize=16)
def _realize(weights: Weights, start: int, time: int) -> Piecewise:
    """The pieces of constant shares the stream reads these weights in, from stream position ``start``,
    which has read ``time`` samples (see the module docstring, "Scheduled weights").

    Where the weights are constant, one piece at their shares (`_shares`), which ends at the whole
    number of its periods nearest the next breakpoint; a linear ramp, in steps of `RAMP_STEP` or
    more positions (at most `MAX_RAMP_STEPS`), each at the shares of its middle in multiples of
    ``1 / RAMP_STEP``. Every piece is whole periods long, so at its end each source has exactly its
    share of it, and the bound of the constant schedule holds along the whole stream."""
    pieces: list[tuple[int, tuple[int, ...]]] = []  # (offset from start, reduced quotas)

    def add(t: int, quotas: tuple[int, ...]) -> None:
        if pieces and pieces[-1][0] == t - time:  # the piece before came to no position
            pieces.pop()
        if not pieces or pieces[-1][1] != quotas:
            pieces.append((t - time, quotas))

    t, x0 = time, time  # x0: where the weights' stretch starts (t may lie before it, or after)
    for x1 in [*(x for x in weights.breakpoints if x > time), None]:
        if x1 is not None and x1 <= t:
            x0 = x1
            continue
        if x1 is None or weights._flat(max(t, x0), x1):
            quotas = _reduced(_exact_quotas(weights.at(max(t, x0))))
            add(t, quotas)
            if x1 is None:
                break
            period = sum(quotas)
            t += (x1 - t + period // 2) // period * period
            x0 = x1
            continue
        span = x1 - t
        step = max(RAMP_STEP, -(-span // (MAX_RAMP_STEPS * RAMP_STEP)) * RAMP_STEP)
        for _ in range((span + step // 2) // step):
            add(t, _reduced(tuple(_round_quotas(weights.at(Fraction(2 * t + step, 2)), RAMP_STEP))))
            t += step
        x0 = x1
    return Piecewise(start, pieces)


def check_weights(weights: Mapping[str, Any] | None, names: Sequence[str]) -> Weights | None:
    """``weights`` checked, as `Weights` in the order of ``names`` (None: none given), or a `ReaderError`:
    not a dict, a weight for a source not given or a source without one, a weight that is neither a
    finite number >= 0 nor a schedule (`WeightSchedule`: pairs whose samples increase, weights >= 0), or
    all the weights zero at some point."""
    if weights is None:
        return None
    if not isinstance(weights, Mapping):
        example = ", ".join(f"{n!r}: 1" for n in names[:3])
        raise ReaderError(f"weights={weights!r} must be a dict of source name -> weight, e.g. {{{example}}}")
    unknown = [k for k in weights if k not in names]
    if unknown:
        raise ReaderError(f"weights= names {unknown!r}, which are not sources of the mixture (its sources: "
                          f"{list(names)}); weigh only the sources given, by their names")
    missing = [n for n in names if n not in weights]
    if missing:
        raise ReaderError(f"weights= gives no weight for the source(s) {missing!r} (weights given: "
                          f"{dict(weights)!r}); give every source a weight or a schedule (0 leaves one "
                          "out), or leave weights= out to weigh the sources by their rows")
    out = Weights(tuple(names), tuple(_schedule_of(weights[n], f"weights[{n!r}]") for n in names))
    for x in out.breakpoints:  # between breakpoints the sum is linear: positive where both ends are
        if not any(out.at(x)):
            if out.is_constant:
                raise ReaderError(f"weights={dict(weights)!r} are all zero, so no source would be read; "
                                  "give at least one source a positive weight")
            at = dict(zip(names, map(float, out.at(x)), strict=True))
            raise ReaderError(f"weights= are all zero at {x:,} samples ({at}), so no source would be read "
                              "there; give at least one source a positive weight at every point of the "
                              "schedules")
    return out


def _exact_quotas(weights: Sequence[Fraction]) -> tuple[int, ...]:
    """Integer quotas of one period of ``weights``' shares (`_shares`)."""
    shares = _shares(weights)
    period = math.lcm(*(s.denominator for s in shares))
    return tuple(int(s * period) for s in shares)


def _reduced(quotas: Sequence[int]) -> tuple[int, ...]:
    g = math.gcd(*quotas)
    return tuple(q // g for q in quotas)


class Piecewise:
    """Which source each position of the stream holds from ``start`` on, for weights that change: pieces
    of constant shares, piece ``j`` from offset ``offsets[j]`` at the `Schedule` ``schedules[j]``, the last
    one without end. Each piece but the last is a whole number of its schedule's periods (`Weights.realize`),
    so at its start each source's count is exactly its share of the positions before."""

    def __init__(self, start: int, pieces: Sequence[tuple[int, tuple[int, ...]]]) -> None:
        self.start = start
        self.offsets = np.array([o for o, _ in pieces], dtype=np.int64)
        self.schedules = [Schedule(q) for _, q in pieces]
        self.bases = np.zeros((len(pieces), len(pieces[0][1])), dtype=np.int64)
        for j in range(1, len(pieces)):
            length = int(self.offsets[j] - self.offsets[j - 1])
            quotas = np.array(pieces[j - 1][1], dtype=np.int64)
            self.bases[j] = self.bases[j - 1] + quotas * (length // int(quotas.sum()))

    @property
    def bound(self) -> float:
        return max(s.bound for s in self.schedules)

    def shares(self, position: int) -> tuple[Fraction, ...]:
        """The shares at ``position`` of the stream (>= ``start``)."""
        s = self.schedules[self._piece(position)]
        return tuple(Fraction(q, s.period) for q in s.quotas)

    def _piece(self, position: int) -> int:
        return max(0, int(np.searchsorted(self.offsets, position - self.start, side="right")) - 1)

    def counts(self, position: int) -> np.ndarray:
        """How many positions of ``[start, position)`` each source has (int64)."""
        j = self._piece(position)
        offset = position - self.start - int(self.offsets[j])
        out: np.ndarray = self.bases[j] + self.schedules[j].counts(offset)
        return out

    def counts_at(self, positions: np.ndarray) -> np.ndarray:
        rel = np.asarray(positions, dtype=np.int64) - self.start
        if len(self.schedules) == 1:
            return self.schedules[0].counts_at(rel)
        pieces = np.maximum(np.searchsorted(self.offsets, rel, side="right") - 1, 0)
        out = self.bases[pieces].copy()
        # grouped by piece with one sort (a mask per piece is pieces x positions: a ramp has hundreds)
        order = np.argsort(pieces, kind="stable")
        js, starts = np.unique(pieces[order], return_index=True)
        for j, a, b in zip(js.tolist(), starts.tolist(), [*starts[1:].tolist(), len(order)], strict=True):
            at = order[a:b]
            out[at] += self.schedules[j].counts_at(rel[at] - self.offsets[j])
        return out

    def sources(self, a: int, b: int) -> np.ndarray:
        """The source of each position in ``[a, b)`` (int32)."""
        if len(self.schedules) == 1:
            whole: np.ndarray = self.schedules[0].sources(a - self.start, b - self.start)
            return whole
        a, b = a - self.start, b - self.start
        j = self._piece(a + self.start)
        if j == len(self.schedules) - 1 or b <= self.offsets[j + 1]:
            out: np.ndarray = self.schedules[j].sources(a - int(self.offsets[j]), b - int(self.offsets[j]))
            return out
        parts = []
        while a < b:
            stop = b if j == len(self.schedules) - 1 else min(b, int(self.offsets[j + 1]))
            parts.append(self.schedules[j].sources(a - int(self.offsets[j]), stop - int(self.offsets[j])))
            a, j = stop, j + 1
        return np.concatenate(parts)


@dataclasses.dataclass(frozen=True)
class Era:
    """A part of the stream read at one set of weights: from position ``start`` (which had read ``time``
    samples) on, at ``weights``; source ``i``'s ``k``-th position in it holds its sample ``holes[i]``
    (index ranges an earlier era left unread), then ``next[i]``, ``next[i] + 1``, ... A stream that was
    never reweighted is one era from 0, without holes."""

    start: int
    time: int
    weights: Weights
    holes: tuple[Ranges, ...]
    next: tuple[int, ...]

    @classmethod
    def first(cls, weights: Weights) -> Era:
        n = len(weights.names)
        return cls(0, 0, weights, tuple([] for _ in range(n)), (0,) * n)

    @cached_property
    def plan(self) -> Piecewise:
        return self.weights.realize(self.start, self.time)

    def samples(self, i: int, k0: int, k1: int) -> Ranges:
        """Source ``i``'s samples at its positions ``k0 .. k1 - 1`` of the era."""
        if k1 <= k0:
            return []
        holes, base = self.holes[i], self.next[i]
        if not holes:
            return [(base + k0, base + k1)]
        return take([*holes, (base, base + max(0, k1 - total(holes)))], k0, k1)

    def to_json(self) -> dict[str, Any]:
        names = self.weights.names
        return {"start": self.start, "time": self.time, "weights": self.weights.to_json(),
                "holes": {n: [list(r) for r in h] for n, h in zip(names, self.holes, strict=True)},
                "next": dict(zip(names, self.next, strict=True))}

    @classmethod
    def from_json(cls, names: Sequence[str], data: Mapping[str, Any]) -> Era:
        weights = Weights.from_json(names, data["weights"])
        holes = tuple([(int(a), int(b)) for a, b in data["holes"][n]] for n in names)
        nexts = tuple(int(data["next"][n]) for n in names)
        era = cls(int(data["start"]), int(data["time"]), weights, holes, nexts)
        if min(era.start, era.time, *era.next, *(v for h in holes for r in h for v in r)) < 0:
            raise ValueError("positions and samples must be >= 0")
        return era


class Stream:
    """The mixed stream over its eras: which source each position holds (`sources`), how many positions
    of each source lie before one (`counts`, `counts_at`), and which of a source's samples a run of
    positions holds (`samples`). Position ``p`` belongs to the last era starting at or before it."""

    def __init__(self, eras: Sequence[Era]) -> None:
        self.eras = tuple(eras)
        self.n = len(self.eras[0].holes)
        self.starts = np.array([e.start for e in self.eras], dtype=np.int64)
        self._before = np.zeros((len(self.eras), self.n), dtype=np.int64)
        for e in range(1, len(self.eras)):
            self._before[e] = self._before[e - 1] + self.eras[e - 1].plan.counts(self.eras[e].start)
        self._plain = len(self.eras) == 1 and not self.eras[0].start
        self.bound = max(e.plan.bound for e in self.eras)

    def _era(self, position: int) -> int:
        return max(0, int(np.searchsorted(self.starts, position, side="right")) - 1)

    def _split(self, a: int, b: int) -> Iterator[tuple[int, int, int]]:
        """``[a, b)`` cut at the eras' starts: (era, start, stop) of each part."""
        e = self._era(a)
        while a < b:
            stop = b if e == len(self.eras) - 1 else min(b, int(self.starts[e + 1]))
            yield e, a, stop
            a, e = stop, e + 1

    def sources(self, a: int, b: int) -> np.ndarray:
        if self._plain:
            return self.eras[0].plan.sources(a, b)
        parts = [self.eras[e].plan.sources(x, y) for e, x, y in self._split(a, b)]
        out: np.ndarray = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out

    def counts(self, position: int) -> np.ndarray:
        e = self._era(position)
        out: np.ndarray = self._before[e] + self.eras[e].plan.counts(position)
        return out

    def counts_at(self, positions: np.ndarray) -> np.ndarray:
        if self._plain:
            return self.eras[0].plan.counts_at(positions)
        positions = np.asarray(positions, dtype=np.int64)
        eras = np.maximum(np.searchsorted(self.starts, positions, side="right") - 1, 0)
        out = self._before[eras].copy()
        for e in np.unique(eras).tolist():
            mask = eras == e
            out[mask] += self.eras[e].plan.counts_at(positions[mask])
        return out

    def samples(self, segments: Sequence[tuple[int, int]]) -> list[Ranges]:
        """Per source, the runs of its samples that the positions ``segments`` hold, in their order."""
        out: list[Ranges] = [[] for _ in range(self.n)]
        for a, b in segments:
            for e, x, y in self._split(a, b):
                era = self.eras[e]
                k0, k1 = era.plan.counts(x).tolist(), era.plan.counts(y).tolist()
                for i in range(self.n):
                    out[i].extend(era.samples(i, k0[i], k1[i]))
        return out


# ---- what a mixture reads ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Mixture:
    """The sources of a mixture, their rows and shares, and its epoch: what `MixedReader` reads and
    ``shardkit inspect`` shows. Make one with `Mixture.of`.

    ``weights`` are as given (the rows, when none were; a schedule as `WeightSchedule.plain` shows it),
    ``plan`` the same checked (`Weights`); ``shares`` the fractions of the stream used at its start: the
    weights normalized, exactly when their common denominator is at most `MAX_PERIOD`, else rounded to
    multiples of ``1 / MAX_PERIOD`` (largest remainders; a positive weight keeps a positive share).
    `shares_at` gives them at any point of a schedule. The schedule's bound holds against them.
    """

    names: tuple[str, ...]
    rows: tuple[int, ...]
    weights: tuple[Any, ...]
    shares: tuple[Fraction, ...]
    samples_per_epoch: int
    plan: Weights

    @classmethod
    def of(cls, names: Sequence[str], rows: Sequence[int], weights: Mapping[str, Any] | None,
           samples_per_epoch: Any) -> Mixture:
        """Check ``weights`` (see `check_weights`) and ``samples_per_epoch`` (default: the rows of the
        sources of positive weight at some point together), and make the shares."""
        names = tuple(names)
        plan = check_weights(weights, names)
        if plan is None:  # weighted by their rows: an epoch reads each source about once
            given: tuple[Any, ...] = tuple(int(r) for r in rows)
            plan = Weights.constant(names, [Fraction(int(r)) for r in rows])
        else:
            given = tuple(weights[n] if s.kind == "steps" and len(s.points) == 1 else s.plain()  # type: ignore[index]
                          for n, s in zip(names, plan.schedules, strict=True))
        if samples_per_epoch is None:
            samples_per_epoch = sum(int(r) for r, w in zip(rows, plan.ever_positive, strict=True) if w)
        samples_per_epoch = int(samples_per_epoch) if isinstance(samples_per_epoch, np.integer) \
            else samples_per_epoch
        if not isinstance(samples_per_epoch, int) or isinstance(samples_per_epoch, bool) \
                or samples_per_epoch < 1:
            raise ReaderError(f"samples_per_epoch={samples_per_epoch!r} must be an int >= 1 (positions of "
                              "the mixed stream per epoch); leave it out for the sources' rows together")
        return cls(names, tuple(int(r) for r in rows), given, plan.realize(0).shares(0), samples_per_epoch,
                   plan)

    @cached_property
    def pieces(self) -> Piecewise:
        """The pieces of constant shares the stream is read in (one, for constant weights)."""
        return self.plan.realize(0)

    @property
    def schedule(self) -> Schedule:
        """The schedule of the stream's first piece (of the whole stream, for constant weights)."""
        return self.pieces.schedules[0]

    @property
    def bound(self) -> float:
        """The most any source's count strays from its shares' sum over any prefix of the stream."""
        return self.pieces.bound

    def shares_at(self, samples: int) -> tuple[Fraction, ...]:
        """The shares the stream reads at position ``samples`` (samples read, all shards together)."""
        return self.pieces.shares(samples)

    def to_json(self) -> list[dict[str, Any]]:
        """Per source: name, rows, weight, share, samples per epoch and passes per epoch (expected; at the
        shares of the stream's start, for a schedule)."""
        out = []
        for name, rows, weight, share in zip(self.names, self.rows, self.weights, self.shares, strict=True):
            samples = float(share * self.samples_per_epoch)
            out.append({"name": name, "rows": rows, "weight": _plain_number(weight), "share": float(share),
                        "samples_per_epoch": samples, "passes_per_epoch": samples / rows if rows else 0.0})
        return out

    def schedule_json(self, points: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """The shares at ``points`` (default: the schedule's breakpoints; none for constant weights): per
        point, its samples and each source's share (what ``shardkit inspect --at`` prints)."""
        if points is None:
            points = [] if self.plan.is_constant else list(self.plan.breakpoints)
        return [{"samples": int(p), "shares": {n: float(s) for n, s in zip(self.names, self.shares_at(p),
                                                                            strict=True)}}
                for p in points]


def _shares(weights: Sequence[Fraction]) -> tuple[Fraction, ...]:
    """``weights`` normalized; rounded to multiples of 1/MAX_PERIOD if their denominator is larger."""
    exact = [w / sum(weights) for w in weights]
    if math.lcm(*(s.denominator for s in exact)) <= MAX_PERIOD:
        return tuple(exact)
    return tuple(Fraction(q, MAX_PERIOD) for q in _round_quotas(weights, MAX_PERIOD))


def _round_quotas(weights: Sequence[Fraction], period: int) -> list[int]:
    """``weights``' shares of ``period`` positions in whole numbers (largest remainders; a positive weight
    keeps at least one, taken from the largest)."""
    exact = [w / sum(weights) for w in weights]
    raw = [s * period for s in exact]
    quotas = [math.floor(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: (quotas[i] - raw[i], i))[: period - sum(quotas)]:
        quotas[i] += 1
    for i, s in enumerate(exact):
        if s and not quotas[i]:
            quotas[max(range(len(quotas)), key=lambda j: quotas[j])] -= 1
            quotas[i] = 1
    return quotas


def _plain_number(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return float(value) if isinstance(value, Fraction) else value


def shared_schema(schemas: Mapping[str, Schema]) -> Schema:
    """The fields every source's reader reads, the same in each (dtype and shape), as one schema; a
    `SchemaMismatchError` names the source, the field and both types where they differ.

    A field nullable in one source is nullable in the mixture; its codec is the first source's (the
    batches hold decoded values: a PNG image and a JPEG one of one shape mix)."""
    names = list(schemas)
    first, fields = names[0], list(schemas[names[0]])
    if SOURCE in schemas[first].names:
        raise ReaderError(f"source {first!r} has a field named {SOURCE!r}, the column a mixture adds to tell "
                          "the sources apart; leave it out with columns=")
    for name in names[1:]:
        schema = schemas[name]
        missing = [f.name for f in fields if f.name not in schema.names]
        extra = [f for f in schema.names if f not in schemas[first].names]
        if missing or extra:
            shared = [f.name for f in fields if f.name in schema.names]
            what = (f"has no field(s) {missing!r} of source {first!r}" if missing
                    else f"has the field(s) {extra!r}, which source {first!r} has not")
            raise SchemaMismatchError(
                f"source {name!r} {what}: the sources of a mixture give the same columns; read the fields "
                f"they share with columns={shared!r}")
        for i, f in enumerate(fields):
            other = schema[f.name]
            if other.dtype != f.dtype or other.shape != f.shape:
                raise SchemaMismatchError(
                    f"field {f.name!r} is {_type(other)} in source {name!r} and {_type(f)} in source "
                    f"{first!r}: the sources of a mixture must agree on each field's dtype and shape; "
                    f"rewrite one of them, pass schema= hints for its columns, or leave {f.name!r} out "
                    "with columns=")
            if other.nullable and not f.nullable:
                fields[i] = Field(f.name, f.dtype, f.shape, codec=f.codec, nullable=True)
    return Schema([*fields, Field(SOURCE, "int32")])


def _type(field: Field) -> str:
    return f"{field.dtype_name}{list(field.shape) if field.shape else ''}"


# ---- the reader --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Boundary:
    """Where epoch ``epoch`` lies in the stream: ``carry``, the positions the epoch before left out
    (ascending ranges), then positions from ``fresh`` on, ``samples_per_epoch`` in all."""

    epoch: int
    fresh: int
    carry: tuple[tuple[int, int], ...] = ()

    def positions(self, samples: int) -> Ranges:
        """The epoch's positions, as ranges in their order (index ``i`` of the epoch is its ``i``-th)."""
        carried = total(self.carry)  # (after a reweight, the carry is the whole epoch: see `_reweighted`)
        return [*self.carry, (self.fresh, self.fresh + samples - carried)] if samples > carried \
            else list(self.carry)

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "fresh": self.fresh, "carry": [list(r) for r in self.carry]}


def _seek(reader: Reader, sample: int) -> None:
    """Put a source's reader at sample ``sample`` of its stream: pass ``sample // rows``, that many rows
    into it (a one-shard reader's state: the epoch is the pass)."""
    state = reader.state_dict()
    state["epoch"], offset = divmod(sample, reader.num_samples)
    state["history"] = [[1, offset]] if offset else []
    reader.load_state_dict(state)


class _Claims:
    """Where source ``index``'s samples go in a shard's piece, in their order: its `batching.Placer`.

    The piece is the run of stream positions ``segments`` (in order); its positions are numbered from 0.
    ``left`` is how many samples the source's reader is still to read from where it stands."""

    SCAN = 1 << 16  # piece positions looked up at a time

    def __init__(self, index: int, segments: Sequence[tuple[int, int]], schedule: Stream,
                 blocks: Blocks) -> None:
        self.index, self.schedule, self.blocks = index, schedule, blocks
        self.left = 0
        self._segments = deque(segments)
        self._scanned = 0  # piece positions looked up so far
        self._found: deque[np.ndarray] = deque()  # this source's positions among them, not yet claimed

    def remaining(self) -> int:
        return self.left

    def plan(self, emit: np.ndarray | None, sizes: list[int]
             ) -> tuple[WindowPlacement, list[np.ndarray] | None]:
        positions = self._claim(sum(sizes) if emit is None else len(emit))
        self.left -= len(positions)
        return WindowPlacement(self.blocks, positions), destinations(emit, sizes, positions)

    def _claim(self, count: int) -> np.ndarray:
        """The next ``count`` positions of the source in the piece."""
        out: list[np.ndarray] = []
        while count:
            while not self._found and self._scan():
                pass
            if not self._found:
                raise ReaderError(f"a mixture's source {self.index} read more rows than the shard's piece "
                                  "holds of it; report this as a shardkit bug")
            found = self._found[0]
            out.append(found[:count])
            if len(found) > count:
                self._found[0] = found[count:]
            else:
                self._found.popleft()
            count -= len(out[-1])
        return np.concatenate(out) if len(out) != 1 else out[0]

    def _scan(self) -> bool:
        if not self._segments:
            return False
        a, b = self._segments[0]
        stop = min(b, a + self.SCAN)
        found = np.flatnonzero(self.schedule.sources(a, stop) == self.index) + self._scanned
        if len(found):
            self._found.append(found)
        self._scanned += stop - a
        if stop == b:
            self._segments.popleft()
        else:
            self._segments[0] = (stop, b)
        return True


class _Placing:
    """One source's rows for a shard's epoch placed straight in the mixed batches' `Blocks`: runs of the
    source's sample stream (``ranges``, in the order they are needed) read by its `Reader` (its
    `Reader._placing`), positioned with its state at the start of each run; ``placed`` counts the samples
    whose rows are all in place, in order."""

    def __init__(self, reader: Reader, ranges: Sequence[tuple[int, int]], claims: _Claims) -> None:
        self.reader, self.claims = reader, claims
        self.ranges: deque[tuple[int, int]] = deque()
        for a, b in ranges:
            if b <= a:
                continue
            if self.ranges and self.ranges[-1][1] == a:  # one run: no seek between them
                self.ranges[-1] = (self.ranges[-1][0], b)
            else:
                self.ranges.append((a, b))
        self.placed = 0
        self._it: Iterator[int] | None = None

    def until(self, count: int) -> None:
        """Read on until the first ``count`` samples are in place."""
        while self.placed < count:
            if self._it is None:
                if not self.ranges:
                    raise ReaderError(f"a mixture took more rows of {self.reader.dataset.url!r} than its "
                                      "plan holds; report this as a shardkit bug")
                a, b = self.ranges.popleft()
                _seek(self.reader, a)
                self.claims.left = b - a
                self._it = self.reader._placing(self.claims)
            n = next(self._it, None)
            if n is None:  # the run is read
                self._it = None
            else:
                self.placed += n

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None:
            it.close()  # type: ignore[attr-defined]  # a generator: its pending reads are cancelled


class MixedReader(Reader):
    """Batches of one shard of a weighted mixture of datasets. Create with ``make_reader({name: url, ...},
    weights=...)``; see `make_reader` and the module docstring.

    A `Reader` to everything that takes one (the torch, tf.data and JAX adapters, DataLoader workers,
    checkpoints, ``shardkit bench``): the same iteration, ``len``, ``state_dict``/``load_state_dict``
    and ``epoch``. It is not built like one: each source is read by a one-shard `Reader` of its own
    (``readers[name]``, with the source's share of ``workers``, ``prefetch`` and ``shuffle_buffer``), and
    their workers place each row where the schedule puts it in the batches, one copy per row. Every
    batch has the column `SOURCE` (``"__source__"``): the index in ``sources`` of the source each row
    came from; with ``remainder="mask"``, also ``"__valid__"`` (see "Masked remainder" in the module
    docstring: a masked row's ``__source__`` is that of the row it copies).

    Attributes: ``sources`` (names, in the order given), ``readers`` (name -> its `Reader`), ``datasets``
    (name -> `Dataset`), ``mixture`` (`Mixture`: rows, weights, shares, ``samples_per_epoch``),
    ``shares`` (name -> the share of the stream), ``num_samples`` (``samples_per_epoch``).
    """

    def __init__(self, readers: Mapping[str, Reader], *, weights: Mapping[str, Any] | None,
                 samples_per_epoch: Any, shard: int, num_shards: int, batch_size: int, shuffle: bool,
                 seed: int, num_epochs: int | None, remainder: Remainder, drop_last: bool, prefetch: int,
                 workers: int) -> None:
        # Reader's own __init__ opens one dataset: a mixture sets what a Reader's users read instead
        self.sources: tuple[str, ...] = tuple(readers)
        self.readers: dict[str, Reader] = dict(readers)
        self.shard, self.num_shards = shard, num_shards
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.num_epochs, self.remainder, self.drop_last = num_epochs, remainder, drop_last
        self.prefetch, self.workers = prefetch, workers
        self.stats: dict[str, int] = {}
        self._given = (weights, samples_per_epoch)  # as make_reader got them (None: the default)
        # each source's own shuffle window, before the mixture gives it its share of it
        # (a source that decodes images late has a longer window of its own than a mixture's, which
        # decodes the rows before it shuffles them: `Reader._eager_window`)
        self._windows = {name: r._eager_window for name, r in self.readers.items()}
        self.epoch = 0
        self._boundary = _Boundary(0, 0)
        self._history: list[Stage] = []
        self._consumed = 0  # piece positions of the current stage covered by yielded batches
        self._steps = 0  # batches yielded in the current stage
        self._generation = 0  # bumped to end the live iteration (new iteration, load_state_dict, close)
        self.waited = WaitClock()  # the seconds the consumer spent waiting for batches (_clock)
        self._closed = False
        #: Whether `load_state_dict` continues a state saved at other weights at this reader's (its
        #: ``reweight=`` when not given): set it where the state is loaded for you (``ctx.checkpoint.
        #: restore(reader=reader)``, the adapters' resumes).
        self.reweight = False
        self._configure()

    def _configure(self, resources: Weights | None = None) -> None:
        """The mixture of the sources' readers as they are (their rows: opened, or pinned to a saved table
        snapshot), each source's share of the threads, the read-ahead and the shuffle window (by
        ``resources``, default the mixture's weights: a stream continued at other weights keeps the
        windows its first weights gave, since a source's pass order follows its window), and the memory
        of the batches."""
        rows = [r.num_samples for r in self.readers.values()]
        self.mixture = mixture = Mixture.of(self.sources, rows, *self._given)
        self.shares = dict(zip(mixture.names, mixture.shares, strict=True))
        self._set_eras((Era.first(mixture.plan),))
        self.datasets = {name: r.dataset for name, r in self.readers.items()}
        self.schema: Schema = shared_schema({name: r.schema for name, r in self.readers.items()})
        self.num_samples = self.samples_per_epoch = mixture.samples_per_epoch
        mixture_shares = _resource_shares(mixture.plan if resources is None else resources)
        for (name, reader), share in zip(self.readers.items(), mixture_shares, strict=True):
            # sources that each had all the threads crowded the cores (more CPU per row) and held a
            # window each (the memory of one dataset, per source)
            reader._share(workers=max(1, round(self.workers * share)),
                          prefetch=max(1 if self.prefetch else 0, math.ceil(self.prefetch * share)),
                          shuffle_buffer=max(1, round(self._windows[name] * share)))
        self._refresh_stats()
        row_bytes = max(r.dataset.decoded_row_bytes(r.schema.names) for r in self.readers.values())
        # the sources' workers place their rows straight in the mixed batches (`_Placing`), in blocks of
        # about the stream positions one of a source's windows spans (a window that crosses two blocks
        # has its rows copied through memory its worker reuses); larger blocks measured no faster, and
        # every fresh MiB costs the kernel its zeroed pages
        span = max((r.shuffle_buffer if self.shuffle else r.task_rows or 1) / share
                   for r, share in zip(self.readers.values(), mixture_shares, strict=True) if share)
        most = max(self.batch_size, BLOCK_BYTES // row_bytes)
        self._block_rows = -(-min(math.ceil(span), most) // self.batch_size) * self.batch_size
        self._recycler = batching.Recycler(4 * self._block_rows * row_bytes)
        self._filler: Columns | None = None  # remainder="mask": the row of a batch of masked rows
        if self.remainder == "mask":
            if VALID in self.schema.names:
                name = next(n for n, r in self.readers.items() if VALID in r.schema.names)
                keep = [f for f in self.readers[name].schema.names if f != VALID]
                raise ReaderError(
                    f"remainder='mask': source {name!r} of the mixture ({self.readers[name].dataset.url!r}) "
                    f"has a field named {VALID!r}, the column mask adds to every batch (True for a sample, "
                    f"False for a masked row); leave it out of the columns read (columns={keep!r}), rename "
                    "it in the data, or read with remainder='drop' or 'pad'")
            self.schema = Schema([*self.schema, Field(VALID, "bool")])
        if self.num_shards > self.num_samples:
            raise ReaderError(f"num_shards={self.num_shards} is more than samples_per_epoch="
                              f"{self.num_samples} of the mixture, and every shard needs one; use fewer "
                              "shards or more samples")
        if len(self) == 0:
            samples = total(self._ranges(()))
            raise ReaderError(
                f"shard {self.shard} of {self.num_shards} gets no batch: its {samples} samples per epoch are "
                f"fewer than batch_size={self.batch_size} with drop_last=True; use a smaller batch_size, "
                "fewer shards, more samples_per_epoch, or drop_last=False")

    # ---- sizes -------------------------------------------------------------------------------
    def _ranges(self, history: Sequence[Stage], shard: int | None = None,
                num_shards: int | None = None) -> Ranges:
        return shard_ranges(self.num_samples, shard=self.shard if shard is None else shard,
                            num_shards=self.num_shards if num_shards is None else num_shards,
                            history=history, remainder=self.remainder, batch_size=self.batch_size,
                            drop_last=self.drop_last)

    def __len__(self) -> int:
        """Batches this shard yields in a whole epoch (not counting resumes; with ``remainder="mask"``,
        those of the longest piece: every shard steps them)."""
        piece = self._ranges((), 0) if self.remainder == "mask" else self._ranges(())
        return (total(piece) + self.batch_size - 1) // self.batch_size

    def _stage_steps(self) -> int:
        return -(-total(self._ranges(self._history, 0)) // self.batch_size)

    @property
    def fingerprint(self) -> str:
        """Identifies what resume states refer to: the sources (each reader's fingerprint) and the samples
        per epoch (the weights are checked on their own: a state may be continued at other weights, see
        `load_state_dict`)."""
        return self._fingerprint(None)

    def _fingerprint(self, shares: Mapping[str, Any] | None) -> str:
        """The fingerprint; with ``shares``, as a state saved before schedules has it."""
        h = hashlib.sha256()
        for name, reader in self.readers.items():
            extra = f"{shares[name]}\0" if shares is not None else ""
            h.update(f"{name}\0{reader.fingerprint}\0{extra}".encode())
        h.update(str(self.samples_per_epoch).encode())
        return h.hexdigest()[:24]

    def _set_eras(self, eras: Sequence[Era]) -> None:
        self._eras = tuple(eras)
        self.stream = Stream(self._eras)

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Columns]:
        """Batches of every remaining epoch (``num_epochs=None``: forever); the seconds each took to come
        are added to ``waited`` (`shardkit.reader._clock`)."""
        yield from timed(self._epochs(), self.waited)

    def _epochs(self) -> Iterator[Columns]:
        generation = self._claim()
        while (self.num_epochs is None or self.epoch < self.num_epochs) and generation == self._generation:
            yield from self._epoch(generation)

    def iter_epoch(self) -> Iterator[Columns]:
        """Batches of the rest of the current epoch; the reader then moves to the next epoch."""
        yield from timed(self._one_epoch(), self.waited)

    def _one_epoch(self) -> Iterator[Columns]:
        yield from self._epoch(self._claim())

    def _claim(self) -> int:
        """Start a new iteration; the previous one, if still suspended somewhere, ends at its next batch."""
        if self._closed:
            raise closed_error(self)
        self._generation += 1
        return self._generation

    def _epoch(self, generation: int) -> Iterator[Columns]:
        ranges = self._ranges(self._history)
        position = self._consumed
        epoch_positions = self._boundary.positions(self.num_samples)
        segments = [g for a, b in take(ranges, position, total(ranges)) for g in take(epoch_positions, a, b)]
        yield from self._placed_epoch(generation, segments, self.stream.samples(segments), position)

    def _placed_epoch(self, generation: int, segments: Sequence[tuple[int, int]],
                      runs: Sequence[Sequence[tuple[int, int]]], position: int) -> Iterator[Columns]:
        """The rest of the epoch (the stream positions ``segments``; per source, the ``runs`` of its
        samples they hold), the sources' rows placed in the batches' memory by their own workers."""
        blocks = Blocks(self._block_rows, self._recycler)
        mask = self.remainder == "mask"
        names = self.schema.names[:-2] if mask else self.schema.names[:-1]  # (SOURCE, and VALID)
        steps = self._stage_steps() if mask else 0  # mask: every shard steps the stage's batches
        feeds = [_Placing(reader, run, _Claims(i, segments, self.stream, blocks))
                 for i, (reader, run) in enumerate(zip(self.readers.values(), runs, strict=True))]
        at = 0  # the piece position of the next batch, from where this iteration started
        try:
            _prime([functools.partial(f.until, 1) for f, run in zip(feeds, runs, strict=True) if total(run)])
            for spans, consumed, needed in _needs(_batches(segments, self.batch_size, position),
                                                  self.stream):
                which = self.stream.sources(*spans[0]) if len(spans) == 1 else \
                    np.concatenate([self.stream.sources(a, b) for a, b in spans])
                read = False
                for feed, count in zip(feeds, needed, strict=True):
                    if feed.placed < count:
                        feed.until(count)
                        read = True
                if read:  # (a source's reader counts the rows it lost as it reads)
                    self._refresh_stats()
                if at % blocks.rows == 0:  # the batch starts a block (batches never cross one)
                    blocks.release(at)
                batch = blocks.batch(at, at + len(which), names)
                batch[SOURCE] = which
                if mask:  # a piece's last partial batch: filled with copies of its first row, masked
                    batch = masked(batch, len(which), self.batch_size)
                at += len(which)
                self._consumed = consumed  # from now on `state_dict` counts the batch as consumed
                self._steps += 1
                yield batch
                if generation != self._generation:
                    return
            while self._steps < steps:  # mask: a shard one batch short steps one of masked rows
                self._steps += 1  # masked rows are no positions: nothing more is consumed
                yield masked(self._masked_row(), 0, self.batch_size)
                if generation != self._generation:
                    return
        finally:
            for feed in feeds:
                feed.close()
        if generation == self._generation:
            self._finish_epoch()

    def _masked_row(self) -> Columns:
        """``remainder="mask"``: the row a batch of masked rows copies, as a one-row batch (``__source__``
        included): the first row of the first source with rows, read once (a row of the data, so every
        value is in its field's domain; never a position of the stream, so nothing is consumed)."""
        if self._filler is None:
            names = self.schema.names[:-2]  # (SOURCE, VALID)
            for i, reader in enumerate(self.readers.values()):
                groups = np.flatnonzero(reader.rows_per_group)
                part = reader._source.read(Task(int(groups[0]), 0, 1)) if len(groups) else None
                if part is not None and part.chunks:  # (None: a corrupt row group, on_error="skip")
                    row = batching.take(part.chunks[0], slice(0, 1))
                    self._filler = {**{name: row[name] for name in names},
                                    SOURCE: np.full(1, i, dtype=np.int32)}
                    break
            else:
                raise ReaderError("remainder='mask': no source of the mixture has a readable first row to "
                                  "fill a batch of masked rows with; read with remainder='pad' or 'drop'")
        return {name: values.copy() for name, values in self._filler.items()}

    def _read_indices(self, stages: Sequence[Stage]) -> Ranges:
        """The epoch indices the shards of ``stages`` (each as far as its ``consumed``) read, merged."""
        done: Ranges = []
        for i, (shards, consumed) in enumerate(stages):
            for k, count in enumerate(stage_counts(shards, consumed)):
                done.extend(take(self._ranges(stages[:i], k, shards), 0, count))
        return merge(done)

    def _finish_epoch(self) -> None:
        self._boundary = self._next_boundary([*self._history, (self.num_shards, self._longest())])
        self.epoch += 1
        self._history, self._consumed, self._steps = [], 0, 0

    def _longest(self) -> int:
        return total(self._ranges(self._history, 0))

    def _next_boundary(self, stages: Sequence[Stage], boundary: _Boundary | None = None
                       ) -> _Boundary:
        """Where the epoch after ``boundary``'s (default: the current one) starts, its stages ``stages``
        read to the end: the positions none of them read are carried over (see the module docstring)."""
        boundary = self._boundary if boundary is None else boundary
        n = self.num_samples
        positions = boundary.positions(n)
        carry = [g for a, b in self._unread(stages) for g in take(positions, a, b)]
        return _Boundary(boundary.epoch + 1, boundary.fresh + n - total(boundary.carry), tuple(merge(carry)))

    def _unread(self, stages: Sequence[Stage]) -> Ranges:
        """The epoch indices that no shard reads when the epoch's stages are ``stages`` (the last one read
        whole): none unless ``remainder="drop"`` or ``drop_last`` leave some out."""
        n = self.num_samples
        if self.remainder != "drop" and not self.drop_last:
            return []
        if len(stages) == 1:  # one stage: the pieces lie one after another from index 0
            shards = stages[0][0]
            pieces = [total(self._ranges((), k, shards)) for k in (0, shards - 1)]
            extra = n % shards if self.remainder == "uneven" else 0
            read = extra * pieces[0] + (shards - extra) * pieces[1]
            return [(read, n)] if read < n else []
        out, at = [], 0
        for a, b in self._read_indices(stages):
            if a > at:
                out.append((at, a))
            at = max(at, b)
        return out + ([(at, n)] if at < n else [])

    def _refresh_stats(self) -> None:
        stats: dict[str, int] = {}
        for reader in self.readers.values():
            for key, value in reader.stats.items():
                stats[key] = stats.get(key, 0) + value
        self.stats.clear()
        self.stats.update(stats)

    # ---- state -------------------------------------------------------------------------------
    def set_batch_memory(self, allocate: Callable[[int], np.ndarray]) -> None:
        """Where the memory of the mixed batches comes from (see `Reader.set_batch_memory`)."""
        self._recycler.clear()
        self._recycler.allocate = allocate

    def profile(self, *, as_dict: bool = False) -> Any:
        """`Reader.profile` of the mixture: the consumer's time from its own clock, the reading stages'
        busy time and waits summed over its sources (a mixture has no transform stage)."""
        times = StageTimes()
        for reader in self.readers.values():
            for name, seconds in reader._times().seconds.items():
                times.seconds[name] += seconds
            times.read_tasks += reader.times.read_tasks
        b = breakdown(elapsed=self.waited.elapsed, waited=self.waited.seconds, batches=self.waited.batches,
                      times=times, stage=None, workers=self.workers, processes=0, has_transform=False)
        if as_dict:
            return b
        sources = ", ".join(self.readers)
        return render(b, f"shardkit mixture of {sources}, shard {self.shard} of {self.num_shards}")

    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch (JSON-able), as a `Reader`'s (``epoch``, ``history``), with where the epoch
        starts in the stream (``start``), the weights it was read at (``schedule``: its eras, see `Era`;
        ``shares``: the shares at its start) and each source's reader state (``sources``: its snapshot and
        fingerprint; its position is the mixture's)."""
        epoch, history, boundary = self.epoch, list(self._history), self._boundary
        if self._steps and self._steps >= self._stage_steps():
            boundary = self._next_boundary([*history, (self.num_shards, self._longest())])
            epoch, history = epoch + 1, []
        elif self._consumed:
            history.append((self.num_shards, self._consumed))
        return {
            "version": STATE_VERSION, "kind": STATE_KIND, "fingerprint": self.fingerprint, "seed": self.seed,
            "shuffle": self.shuffle, "remainder": self.remainder, "drop_last": self.drop_last,
            "batch_size": self.batch_size, "samples_per_epoch": self.samples_per_epoch,
            "shares": {name: str(share) for name, share in self.shares.items()},
            "schedule": [era.to_json() for era in self._eras],
            "epoch": epoch, "history": [[w, c] for w, c in history], "start": boundary.to_json(),
            "sources": {name: _own(reader.state_dict()) for name, reader in self.readers.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any], *, reweight: bool | None = None) -> None:
        """Continue from ``state`` (from a mixture with the same sources, weights and ``samples_per_epoch``,
        and the same or a different ``num_shards``). A state whose ``epoch`` was moved (``jump_to_epoch``)
        starts that epoch where this reader's shards, read from the start, would.

        A state saved at other weights (or another schedule) is refused, unless ``reweight=True`` (default:
        the reader's ``reweight`` attribute): the stream then goes on from where the state stopped at this
        reader's weights (`_reweighted`), each source's passes still each row once. Every shard of the
        job must load the state the same way; the state this reader saves next holds both weights, so a
        later resume needs no ``reweight``.
        A state saved by shardkit before schedules (no ``schedule``) is read as one of constant weights."""
        if not isinstance(state, Mapping) or state.get("kind") != STATE_KIND \
                or state.get("version") != STATE_VERSION:
            raise ReaderError(f"not the state of a shardkit mixture (kind {STATE_KIND!r}, version "
                              f"{STATE_VERSION}): {json.dumps(state, default=str)[:200]}; a mixture "
                              "resumes from a mixture's state")
        legacy = "schedule" not in state  # saved before schedules: its fingerprint holds the shares
        saved = state.get("sources")
        if not isinstance(saved, Mapping) or list(saved) != list(self.sources):
            got = list(saved) if isinstance(saved, Mapping) else saved
            raise ReaderError(f"the mixture state was saved with the sources {got!r}, this reader has "
                              f"{list(self.sources)}; resume with the same sources, in the same order")
        pinned = False
        for name, reader in self.readers.items():  # first the snapshots the sources were read on
            own = saved[name]
            before = reader.dataset
            try:
                reader._pin(own.get("snapshot") if isinstance(own, Mapping) else None)
            except ReaderError as e:
                raise ReaderError(f"source {name!r} of the mixture: {e}") from e
            pinned |= reader.dataset is not before
        if pinned:  # their rows, and so the mixture's shares and epoch, may be other than when opened
            self._configure()
        if state.get("samples_per_epoch") != self.samples_per_epoch:
            raise ReaderError(f"the mixture state was saved with samples_per_epoch="
                              f"{state.get('samples_per_epoch')!r}, this reader has "
                              f"{self.samples_per_epoch!r}; resume with the same samples_per_epoch, or start "
                              "a fresh reader")
        for key in ("seed", "shuffle", "remainder", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise ReaderError(f"the mixture state was saved with {key}={state.get(key)!r}, this reader "
                                  f"has {key}={getattr(self, key)!r}; resume with the same {key}, or start "
                                  "a fresh reader")
        if state.get("drop_last") and state.get("batch_size") != self.batch_size:
            raise ReaderError("drop_last=True needs the same batch_size to resume; "
                              f"the state has {state.get('batch_size')}, this reader {self.batch_size}")
        try:
            epoch = state["epoch"]
            history: list[Stage] = [(w, c if isinstance(c, int) else list(c)) for w, c in state["history"]]
            for w, c in history:
                stage_counts(w, c)
            start = state["start"]
            boundary = _Boundary(start["epoch"], start["fresh"], tuple((a, b) for a, b in start["carry"]))
            numbers_ = [epoch, boundary.epoch, boundary.fresh, *(v for r in boundary.carry for v in r)]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers_):
                raise TypeError("epochs, positions and history entries must be ints >= 0")
            if legacy:  # constant weights, saved as their shares
                shares = [Fraction(state["shares"][name]) for name in self.sources]
                eras = [Era.first(Weights.constant(self.sources, shares))]
            else:
                eras = [Era.from_json(self.sources, era) for era in state["schedule"]]
                if not eras or eras[0].start or any(b.start < a.start for a, b in itertools.pairwise(eras)):
                    raise ValueError("the eras must start at 0 and follow one another")
        except (KeyError, TypeError, ValueError, ZeroDivisionError, ReaderError) as e:
            raise ReaderError(f"the mixture state is malformed ({e!r}): "
                              f"{json.dumps(state, default=str)[:200]}") from e
        reweighted = eras[-1].weights.key() != self.mixture.plan.key()
        if reweighted and not (self.reweight if reweight is None else reweight):
            raise ReaderError(
                f"the mixture state was saved with the weights {eras[-1].weights.to_json()} (shares="
                f"{dict(state.get('shares') or {})} at its start), this reader has "
                f"{self.mixture.plan.to_json()}; resume with the same weights, or continue the state at "
                "these weights on purpose: reader.load_state_dict(state, reweight=True) on every shard "
                "(each source still reads each row once per pass)")
        if eras[0].weights.key() != self.mixture.plan.key():  # the sources' windows of the first weights
            self._configure(eras[0].weights)
        for name, reader in self.readers.items():
            try:
                reader.load_state_dict(saved[name])  # its snapshot, its fingerprint; its place is ours
            except ReaderError as e:
                raise ReaderError(f"source {name!r} of the mixture: {e}") from e
        fingerprint = self._fingerprint(state.get("shares") if legacy else None)
        if state.get("fingerprint") != fingerprint:  # after the sources' snapshots are pinned
            raise ReaderError("the mixture state was saved with other sources (its fingerprint "
                              f"{state.get('fingerprint')!r}, this reader's {fingerprint!r}); resume "
                              "with the same sources, or start a fresh reader")
        self._ranges(history)  # validates the history against this epoch's samples
        if boundary.epoch != epoch:  # moved to another epoch: start it where these shards would have
            boundary = self._moved(boundary if boundary.epoch < epoch else _Boundary(0, 0), epoch)
        if reweighted:
            eras, boundary = self._reweighted(eras, boundary, epoch, history)
        self._set_eras(eras)
        self.epoch, self._history, self._boundary = epoch, history, boundary
        self._consumed, self._steps = 0, 0
        self._generation += 1

    def _reweighted(self, eras: Sequence[Era], boundary: _Boundary, epoch: int,
                    history: Sequence[Stage]) -> tuple[list[Era], _Boundary]:
        """The stream of ``eras`` continued at this reader's weights from the state ``boundary``,
        ``epoch``, ``history``: a new `Era` from the first position past the epoch, which the rest of the
        epoch moves to.

        The epoch's indices that its stages read keep their positions; the others, in their order, take
        the new era's first positions (so the stages' shards read them where they would have), and the
        samples the old eras held there become the new era's holes, each source's read first in the new
        era, before it goes on past every sample the old eras reached: each sample of each source comes
        once, as before. The new era reads its weights from the samples read so far (the epochs before,
        ``samples_per_epoch`` each, and what this one read)."""
        n = self.num_samples
        positions = boundary.positions(n)
        read = self._read_indices(history)
        unread, at = [], 0
        for a, b in [*read, (n, n)]:
            if a > at:
                unread.append((at, a))
            at = max(at, b)
        old = Stream(eras)
        start = max(eras[-1].start, *(b for _, b in positions))
        last = eras[-1]
        reached = last.plan.counts(start).tolist()
        holes: list[Ranges] = [[] for _ in self.sources]
        for a, b in unread:
            for i, runs in enumerate(old.samples(take(positions, a, b))):
                holes[i].extend(runs)
        nexts = []
        for i in range(len(self.sources)):
            own = total(last.holes[i])
            holes[i].extend(take(last.holes[i], reached[i], own))  # holes its era did not reach
            nexts.append(last.next[i] + max(0, reached[i] - own))
        time = epoch * n + total(read)
        era = Era(start, time, self.mixture.plan, tuple(merge(h) for h in holes), tuple(nexts))
        explicit: list[tuple[int, int]] = []
        fresh, at = start, 0
        for a, b in [*read, (n, n)]:
            if a > at:  # unread: to the new era
                explicit.append((fresh, fresh + a - at))
                fresh += a - at
            explicit.extend(take(positions, a, b))
            at = max(at, b)
        return [*eras, era], _Boundary(boundary.epoch, fresh, tuple(explicit))

    def _moved(self, boundary: _Boundary, epoch: int) -> _Boundary:
        """Where ``epoch`` starts when the epochs from ``boundary``'s on are read whole by these shards."""
        whole = [(self.num_shards, total(self._ranges((), 0)))]
        unread = total(self._unread(whole))
        while boundary.epoch < epoch:
            if boundary.carry and (len(boundary.carry) > 1 or boundary.carry[0][1] != boundary.fresh):
                boundary = self._next_boundary(whole, boundary)
                continue
            # the epoch's positions are one run: each epoch after it starts as many positions further
            start = boundary.fresh - total(boundary.carry)
            start += (epoch - boundary.epoch) * (self.num_samples - unread)
            boundary = _Boundary(epoch, start + unread, ((start, start + unread),) if unread else ())
        return boundary

    # ---- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close every source's reader (their threads stop, their files are let go of)."""
        self._generation += 1
        self._closed = True
        for reader in self.readers.values():
            reader.close()
        self._recycler.clear()

    def __repr__(self) -> str:
        shares = ", ".join(f"{name!r}: {float(share):.3g}" for name, share in self.shares.items())
        return (f"MixedReader({{{shares}}}, shard={self.shard}/{self.num_shards}, epoch={self.epoch}, "
                f"batch_size={self.batch_size}, samples_per_epoch={self.samples_per_epoch})")


def _resource_shares(plan: Weights) -> list[float]:
    """Each source's part of the threads, the read-ahead and the shuffle window: its share (for a schedule,
    the largest it reaches, the parts then scaled to add up to 1)."""
    pieces = plan.realize(0).schedules
    most = [max(s.quotas[i] / s.period for s in pieces) for i in range(len(plan.names))]
    return [m / sum(most) for m in most]


def _own(state: dict[str, Any]) -> dict[str, Any]:
    """A source reader's state as a mixture keeps it: its snapshot and fingerprint, at the start (its
    place in the stream is the mixture's to say)."""
    state["epoch"], state["history"] = 0, []
    return state


def _batches(segments: Sequence[tuple[int, int]], batch_size: int, position: int
             ) -> Iterator[tuple[list[tuple[int, int]], int]]:
    """The stream positions of each batch (the runs of ``segments`` it takes), and the piece position
    after it (``position``: where the segments start)."""
    spans: list[tuple[int, int]] = []
    rows = 0
    for first, stop in segments:
        a = first
        while a < stop:
            step = min(stop - a, batch_size - rows)
            spans.append((a, a + step))
            rows += step
            a += step
            if rows == batch_size:
                position += rows
                yield spans, position
                spans, rows = [], 0
    if spans:
        yield spans, position + rows


def _needs(batches: Iterator[tuple[list[tuple[int, int]], int]], schedule: Stream | Schedule,
           group: int = 1024
           ) -> Iterator[tuple[list[tuple[int, int]], int, list[int]]]:
    """``batches`` (`_batches`) with, for each, how many samples of each source the batches up to it
    hold together (``group`` batches looked up at a time, with `Schedule.counts_at`)."""
    so_far = np.zeros(schedule.n, dtype=np.int64)
    while chunk := list(itertools.islice(batches, group)):
        spans = [span for batch, _ in chunk for span in batch]
        ends = np.cumsum([len(batch) for batch, _ in chunk]) - 1
        edges = np.array(spans, dtype=np.int64)
        held = np.cumsum(schedule.counts_at(edges[:, 1]) - schedule.counts_at(edges[:, 0]), axis=0)
        held += so_far
        so_far = held[-1].copy()
        for (batch, consumed), needed in zip(chunk, held[ends].tolist(), strict=True):
            yield batch, consumed, needed


def _prime(starts: Sequence[Callable[[], None]]) -> None:
    """Start every source's reading at once (each reader's first read, on threads of its own), so that the
    first batch waits for the slowest source, not for them all in turn."""
    if len(starts) > 1:
        with ThreadPoolExecutor(len(starts), thread_name_prefix="shardkit-mix") as pool:
            for f in [pool.submit(start) for start in starts]:
                f.result()


# ---- opening -----------------------------------------------------------------------------------------

def open_mixture(sources: Mapping[str, Any], open_source: Callable[..., Reader], *,
                 weights: Mapping[str, Any] | None, samples_per_epoch: Any, shard: int, num_shards: int,
                 batch_size: int, shuffle: bool, seed: int, num_epochs: int | None, remainder: Remainder,
                 drop_last: bool, prefetch: int, workers: int, options: Mapping[str, Any],
                 reweight: bool = False) -> MixedReader:
    """A `MixedReader` of ``sources`` (name -> URL, `Dataset` or table), each opened with ``open_source``
    (`make_reader`) as a one-shard reader with ``options``, the other arguments of `make_reader`; of
    those, ``filter``, ``storage_options``, ``version`` and ``schema`` may be per source (`PER_SOURCE`).
    ``reweight``: the reader's `MixedReader.reweight` (its loads continue states of other weights)."""
    if not sources:
        raise ReaderError("make_reader got an empty dict of sources; give at least one, "
                          "e.g. {'web': 's3://bucket/web'}")
    names = list(sources)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ReaderError(f"source names must be non-empty strings, got {bad!r}; name each source, e.g. "
                          "{'web': url_a, 'books': url_b}")
    for name, value in sources.items():
        if isinstance(value, Mapping):
            raise ReaderError(f"source {name!r} is {value!r}: give its URL, an opened Dataset or a table; "
                              "weights go in weights={...}, per-source options in filter=, storage_options=, "
                              "version= or schema= as {source name: value}")
    check_weights(weights, names)  # before anything is opened
    each = {key: _per_source(key, value, names) if key in PER_SOURCE else dict.fromkeys(names, value)
            for key, value in options.items()}
    readers: dict[str, Reader] = {}
    try:
        for name in names:
            try:
                readers[name] = open_source(
                    sources[name], shard=0, num_shards=1, batch_size=batch_size, shuffle=shuffle,
                    seed=source_seed(seed, name), num_epochs=None, remainder="drop", drop_last=False,
                    prefetch=prefetch, workers=workers, **{key: value[name] for key, value in each.items()})
            except ShardkitError as e:
                about = _about(name, e)
                if about is None:
                    raise
                raise about from e
        mixed = MixedReader(readers, weights=weights, samples_per_epoch=samples_per_epoch, shard=shard,
                            num_shards=num_shards, batch_size=batch_size, shuffle=shuffle, seed=seed,
                            num_epochs=num_epochs, remainder=remainder, drop_last=drop_last,
                            prefetch=prefetch, workers=workers)
        mixed.reweight = reweight
        return mixed
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise


def source_seed(seed: int, name: str) -> int:
    """The seed of source ``name``'s passes: a hash of the mixture's seed and the name (so two sources
    never share an order, and a source keeps its order whatever the others are)."""
    digest = hashlib.sha256(f"shardkit.mixture\0{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _per_source(key: str, value: Any, names: Sequence[str]) -> dict[str, Any]:
    """``value`` for each source: a dict of source name -> value gives each its own (those it leaves out
    get None), anything else is every source's. ``storage_options`` is itself a dict: it is per source
    when its keys are all source names and its values dicts (or None)."""
    if not isinstance(value, Mapping) or not value:
        return dict.fromkeys(names, value)
    keys = list(value)
    if key == "storage_options":
        per = all(k in names for k in keys) and all(v is None or isinstance(v, Mapping)
                                                    for v in value.values())
        return {n: value.get(n) for n in names} if per else dict.fromkeys(names, value)
    unknown = [k for k in keys if k not in names]
    if unknown:
        raise ReaderError(f"{key}= is a dict, so it gives each source its own {key}, but it names "
                          f"{unknown!r}, which are not sources (the sources: {list(names)}); key it by "
                          f"source names, or give one {key} for every source")
    return {n: value.get(n) for n in names}


def _about(name: str, error: ShardkitError) -> ShardkitError | None:
    """``error`` of opening source ``name`` with a message that says which source, of its class (None
    where the class takes other arguments: the source is then a note on the error, shown with it)."""
    try:
        return type(error)(f"source {name!r} of the mixture: {error}")
    except TypeError:
        error.add_note(f"(reading source {name!r} of the mixture)")
        return None


__all__ = ["MAX_PERIOD", "MAX_RAMP_STEPS", "PER_SOURCE", "RAMP_STEP", "SOURCE", "Era", "MixedReader",
           "Mixture", "Piecewise", "Schedule", "Stream", "WeightSchedule", "Weights", "check_weights",
           "open_mixture", "shared_schema", "source_seed"]
