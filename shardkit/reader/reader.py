"""`make_reader` and `Reader`: one shard of a dataset as batches of numpy columns, resumable.

The plan (`shardkit.reader._plan`) says which rows this shard reads in which order; the reader fetches
and decodes the plan's tasks ahead of time in a bounded thread pool (in order), assembles each
shuffle window, and cuts it into batches. Memory is bounded by ``prefetch`` tasks plus one window.

A shuffled window is assembled by the worker threads: each places its task's decoded rows straight at
their positions in the window's emission order (`batching.Scatter`, one copy per row, in parallel),
in arrays used again once no batch refers to them (`batching.Recycler`); its batches are views of
those arrays. A window that cannot be placed (columns holding nulls, padding that repeats rows) is
gathered from its tasks' rows instead.

Position. The reader counts, for the current stage of the epoch (see the plan's docstring), the
samples of its piece that its yielded batches cover (``consumed``) and the batches it yielded
(``steps``). Iterating again after a ``break`` continues from that position (a reader has one live
iteration: starting a new one, `load_state_dict` or `close` ends the previous one).

Masked remainder (``remainder="mask"``). Every shard steps the batches of the stage's longest piece
(`shardkit.reader._plan.stage_steps`); each batch has ``batch_size`` rows and a bool column ``__valid__``
(`assemble.VALID`). A piece's last partial batch is filled with copies of its first row, masked; a piece
one batch short (or empty) reads one row more, masked (`shardkit.reader._plan.mask_ranges`), for a batch
of masked rows. Masked rows are never counted as consumed, so a resume on any number of shards reads
every sample once.

Lost rows (``on_error="skip"``). A row of a corrupt row group (or a row that cannot be decoded) is lost;
its place in the batch is taken by a readable sample: the one half an epoch further in the epoch's order
``pi``, or one at places hashed from its own (see `shardkit.reader._lost.substitutes`). So every batch
holds the positions it holds on intact data, a shard yields ``len(reader)`` batches (ranks keep stepping
together: one rank with fewer steps would hang an allreduce), every rank's `state_dict` is the same
position, and a reader resumed anywhere yields what the uninterrupted one yields from there: which row
takes a lost row's place depends on the data and the epoch's order only, never on what a reader read
before. The repeats are counted in ``stats["repeated_rows"]``."""

from __future__ import annotations

import functools
import hashlib
import logging
import multiprocessing
import time
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from shardkit.dataset import SLICE_ROWS, Dataset, Field, Schema
from shardkit.errors import CorruptDatasetError, ImageShapeError, ReaderError
from shardkit.reader import _profile
from shardkit.reader._clock import WaitClock, timed
from shardkit.reader._filter import Filter, Partitions, select_rows, to_expression
from shardkit.reader._lost import substitutes
from shardkit.reader._pipeline import batching
from shardkit.reader._pipeline.assemble import POSITION, VALID, masked, needed_rows, pi_at, scatter_plan
from shardkit.reader._pipeline.assemble import chunks as assemble_chunks
from shardkit.reader._pipeline.decode import DecodeStage, LateDecode
from shardkit.reader._pipeline.source import DEFAULT_INFLIGHT, Columns, Late, Part, RowGroupSource
from shardkit.reader._pipeline.spill import Spill
from shardkit.reader._plan import (
    LEADS,
    ORDER,
    SPREAD,
    EpochOrder,
    Remainder,
    Stage,
    Task,
    lead_window,
    mask_ranges,
    piece_starts,
    shard_ranges,
    shard_windows,
    split_tasks,
    stage_counts,
    stage_steps,
    take,
    total,
)
from shardkit.reader._profile import StageTimes, breakdown, render

STATE_VERSION = 1
logger = logging.getLogger(__name__)
KEYS = "\x00shardkit.keys"  # rides along in a batch to the transform stage: each row's number in the dataset
WINDOW_BYTES = 32 << 20  # default shuffle window: about this many decoded bytes of rows
#: Most decoded bytes of rows one task reads: a row group is read and decoded in tasks of about this
#: size, so its first rows are decoded (and can be emitted) while its later slices are still read.
TASK_BYTES = 8 << 20
#: Where a worker places a task's decoded rows: its window's `batching.Scatter` and the rows there.
_Slot = tuple[batching.Scatter | batching.Placement, np.ndarray] | None
#: a batch in the decode/transform stage: its result, piece positions, oldest spill segment, the batch as
#: given (to name a sample that fails) and its rows' ``pi`` indices
_Pending = tuple[Future[Columns], np.ndarray, int, Columns, np.ndarray]


class Reader:
    """Batches of one shard of a dataset. Create with `make_reader`; see its docstring.

    Nothing to read is a `ReaderError` when the reader is made, never an epoch without batches: a
    dataset of 0 rows (written from empty data: almost surely a bug upstream, and Petastorm fails on it
    too), a filter that matches none of the rows, and more shards than samples each have their message.
    """

    def __init__(self, dataset: Dataset, *, columns: Sequence[str], shard: int, num_shards: int,
                 batch_size: int, shuffle: bool, seed: int, num_epochs: int | None, remainder: Remainder,
                 drop_last: bool, shuffle_buffer: int, filter: Filter | None, cache: Any, prefetch: int,
                 workers: int, on_error: Literal["raise", "skip"], row_bytes: int,
                 max_inflight_bytes: int = DEFAULT_INFLIGHT, late: Mapping[str, Field] | None = None,
                 raw: frozenset[str] = frozenset(), eager_window: int | None = None,
                 transform: Callable[..., Any] | None = None, transform_workers: int = 0,
                 transform_timeout: float | None = None, variable: bool | frozenset[str] = False,
                 quick_start: bool = True) -> None:
        # kept to open the reader again on another snapshot of a table (`load_state_dict`)
        self._arguments: dict[str, Any] = {
            "columns": columns, "shard": shard, "num_shards": num_shards, "batch_size": batch_size,
            "shuffle": shuffle, "seed": seed, "num_epochs": num_epochs, "remainder": remainder,
            "drop_last": drop_last, "shuffle_buffer": shuffle_buffer, "filter": filter, "cache": cache,
            "prefetch": prefetch, "workers": workers, "on_error": on_error, "row_bytes": row_bytes,
            "max_inflight_bytes": max_inflight_bytes, "late": late, "raw": raw, "eager_window": eager_window,
            "transform": transform, "transform_workers": transform_workers,
            "transform_timeout": transform_timeout, "variable": variable, "quick_start": quick_start}
        self.dataset = dataset
        self._read_schema: Schema = dataset.schema.select(columns)
        self._out_schema: Schema | None = None
        self.shard, self.num_shards = shard, num_shards
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        # the epoch order's kind (`EpochOrder.order`): a resumed state's, else ours
        self._order = ORDER if quick_start else SPREAD
        #: the current epoch's leads (`EpochOrder.starts`, `EpochOrder.lead`) as (shards, batch size) of its
        #: first stage, when a state said (a resumed epoch); else this reader's
        self._epoch_lead: tuple[int, int] | None = None
        self._quick = False  # the pass's first batch is a lead's (`_epoch_of`), not handed out yet
        self.num_epochs, self.remainder, self.drop_last = num_epochs, remainder, drop_last
        self.shuffle_buffer, self.prefetch, self.workers = shuffle_buffer, prefetch, workers
        # fields decoded late, per batch (images: `_pipeline.decode`), and the window a mixture gives its
        # share of (it decodes its sources' rows before it shuffles them)
        self._late: dict[str, Field] = dict(late or {})
        self._raw = raw
        self._eager_window = eager_window or shuffle_buffer
        self._spill: Spill | None = None
        self.transform = transform
        self._processes, self._timeout, self._variable = transform_workers, transform_timeout, variable
        self._stage: Any = None  # the decode/transform stage, made at the first batch that needs it
        self._output_memory: Callable[[int], np.ndarray | None] | None = None  # see _set_output_memory
        # the first window of a pass is cut into tasks of about TASK_BYTES, of whole Parquet slices (a late
        # field's task holds its handles, not its images)
        if self._late:
            kept = [c for c in columns if c not in self._late]
            row_bytes = (dataset.decoded_row_bytes(kept) if kept else 0) + 16 * len(self._late)
        self._window_row_bytes = row_bytes  # what a shuffle window holds per row
        self.task_rows: int | None = max(SLICE_ROWS, TASK_BYTES // row_bytes // SLICE_ROWS * SLICE_ROWS)
        self.filter_text = ""
        selection: dict[int, np.ndarray] = {}
        self.rows_per_group = dataset.rows_per_group
        self.stats: dict[str, int] = {"pruned_row_groups": 0, "skipped_row_groups": 0, "repeated_rows": 0,
                                      "skipped_samples": 0}
        if filter is not None:
            partitions = Partitions.of(dataset)
            expr = to_expression(filter, dataset.arrow_schema, partitions)
            self.filter_text = str(expr)
            self.rows_per_group, selection, self.stats["pruned_row_groups"], unreadable = select_rows(
                dataset, expr, on_error, partitions)
            if unreadable:  # on_error="skip": they hold no sample of this reader
                self.stats["skipped_row_groups"] += len(unreadable)
                warnings.warn(f"skipped {len(unreadable)} corrupt row group(s) while counting the rows that "
                              f"match the filter (on_error='skip'); first: {next(iter(unreadable.values()))}",
                              stacklevel=3)
        self.num_samples = int(self.rows_per_group.sum())
        if dataset.num_rows == 0:  # a bug upstream, not a dataset to train on (Petastorm fails on it too)
            raise ReaderError(
                f"{dataset.url!r} has 0 rows: the dataset itself is empty (whatever the filter), so there is "
                "nothing to read; check what produced the data it was written from and write it again with "
                "rows (write_dataset(..., mode='overwrite')), or read another URL"
            )
        if self.num_samples == 0:  # only a filter (or rows lost to on_error='skip') leaves none
            skipped = self.stats["skipped_row_groups"]
            checked = (f"the rows of its readable row groups ({skipped} corrupt one(s) were skipped, "
                       "on_error='skip')" if skipped else f"its {dataset.num_rows} rows")
            raise ReaderError(
                f"{dataset.url!r} has no samples matching the filter {self.filter_text}: none of {checked} "
                "match; check the filter's columns, values and types against the data, or read without it"
            )
        if self.num_samples < num_shards:
            raise ReaderError(
                f"num_shards={num_shards} is more than the {self.num_samples} samples of {dataset.url!r}"
                f"{f' matching the filter {self.filter_text}' if filter is not None else ''}, and every "
                "shard needs one; use fewer shards or more data"
            )
        self._source = RowGroupSource(dataset, columns, selection=selection, cache=cache, on_error=on_error,
                                      max_inflight_bytes=max_inflight_bytes)
        self._source.read_in_place(list(self._late))
        # arrays for about four windows: one being assembled, one consumed, those the consumer still holds
        self._recycler = batching.Recycler(4 * shuffle_buffer * row_bytes)
        self._pool: ThreadPoolExecutor | None = None
        self.epoch = 0
        self._history: list[Stage] = []
        self._consumed = 0  # piece positions of the current stage covered by yielded batches
        self._steps = 0  # batches yielded in the current stage
        self._generation = 0  # bumped to end the live iteration (new iteration, load_state_dict, close)
        self.waited = WaitClock()  # the seconds the consumer spent waiting for batches (_clock)
        self.times = StageTimes()  # the stages' busy time and what the consumer waited on (_profile)
        self._checked_before = self.dataset.checksum_seconds  # (`_times`)
        self.waited.waiting_on = self.times.stage_now
        self._closed = False
        self._repeated_before = 0  # stats["repeated_rows"] when the epoch (or its resume) began
        self._piece_rows = 0  # remainder="mask": samples of the current stage's piece (rows past: masked)
        self._filler: Columns | None = None  # remainder="mask": a row for a batch whose samples all failed
        if len(self) == 0:  # an epoch without a batch: num_epochs=None would spin without yielding
            samples = total(shard_ranges(self.num_samples, shard=shard, num_shards=num_shards,
                                         remainder=remainder))
            raise ReaderError(
                f"shard {shard} of {num_shards} gets no batch: its {samples} samples per epoch are fewer "
                f"than batch_size={batch_size} with drop_last=True; use a smaller batch_size, fewer "
                "shards, or drop_last=False"
            )

    @property
    def schema(self) -> Schema:
        """The fields of the batches: those read, an image field read with ``decode=False`` as a bytes
        field, and with a ``transform``, the fields of what it returns (learned from the first sample of
        the dataset, transformed once when this is first asked: the adapters ask as they are made)."""
        if self._out_schema is None:
            self._out_schema = self._output_schema()
        return self._out_schema

    @schema.setter
    def schema(self, value: Schema) -> None:
        self._out_schema = value

    def _output_schema(self) -> Schema:
        schema = self._sample_schema()
        if self.remainder != "mask":
            return schema
        if VALID in schema.names:  # a transform's field: the dataset's is refused by make_reader
            raise ReaderError(_valid_collision(f"the transform {self.transform!r} returns a field"))
        return Schema([*schema, Field(VALID, "bool")])

    def _sample_schema(self) -> Schema:
        fields = [Field(f.name, "bytes", nullable=f.nullable) if f.name in self._raw else f
                  for f in self._read_schema]
        if self.transform is None:
            return Schema(fields)
        group = int(np.flatnonzero(self.rows_per_group)[0])
        late = self._late_fields(None)
        part = self._source.read(Task(group, 0, 1), late=late, head=True)  # its pages, not its row group
        if part is None or not part.chunks:
            raise ReaderError(f"the first row of {self.dataset.url!r} cannot be read (on_error='skip'), and "
                              "the fields a transform returns are learned from it")
        sample = batching.take(part.chunks[0], slice(0, 1))
        stage = self._sample_stage()
        out = stage.submit(sample, self.epoch, np.zeros(1, np.int64)).result()
        variable = self._variable if not isinstance(self._variable, bool) else (
            set(out) if self._variable else set())
        return Schema([_field_of(name, values, name in variable) for name, values in out.items()])

    # ---- sizes -------------------------------------------------------------------------------
    def profile(self, *, as_dict: bool = False) -> Any:
        """Where this reader's time went so far, on one screen (or its numbers, ``as_dict=True``): the
        consumer's time from its first ``next()`` to its last batch, split into its own work between
        batches and waiting (for rows being read, for the decode/transform stage, for batch assembly);
        each stage's busy time (reading: fetch and Parquet, then to numpy; image decode; transform);
        the stage that limits throughput and what to change. Always on (a few clock reads per task and
        per batch); zeros for a reader that never ran.

        Example:
            >>> for batch in reader:
            ...     train_step(batch)
            >>> print(reader.profile())
        """
        stage = getattr(self._stage, "stats", None)
        b = breakdown(elapsed=self.waited.elapsed, waited=self.waited.seconds, batches=self.waited.batches,
                      times=self._times(), stage=dict(stage) if stage is not None else None,
                      workers=self.workers, processes=self._processes,
                      has_transform=self.transform is not None)
        if as_dict:
            return b
        return render(b, f"shardkit reader of {self.dataset.url!r}, shard {self.shard} of {self.num_shards}")

    def _times(self) -> StageTimes:
        """The stages' times so far, with the page checksums' share of reading: what this reader's dataset
        counted since the reader was made (`Dataset.checksum_seconds`; in this process)."""
        self.times.seconds["read_checksums"] = max(0.0, self.dataset.checksum_seconds - self._checked_before)
        return self.times

    @property
    def shuffle_reach(self) -> dict[str, Any]:
        """How far the shuffle reaches, and what that costs: ``window_rows`` (rows shuffled together: a
        batch's rows come from anywhere among them), ``window_row_groups`` (row groups a window spans, on
        average), ``window_memory_bytes`` (what a window holds in memory: decoded rows, or 16 bytes per
        late-decoded image), ``spilled_bytes`` (encoded images set aside on local disk so far) and
        ``late_fields`` (fields decoded per batch, after the shuffle). Unshuffled: a window of 0 rows."""
        rows = min(self.shuffle_buffer, self.num_samples) if self.shuffle else 0
        groups = 0.0
        if rows:
            order = self._epoch_order()
            offsets = order.stream_offsets
            starts = np.arange(0, self.num_samples, rows)
            first = np.searchsorted(offsets, starts, side="right") - 1
            last = np.searchsorted(offsets, np.minimum(starts + rows, self.num_samples) - 1, side="right") - 1
            groups = float(np.mean(last - first + 1))
        return {"window_rows": rows, "window_row_groups": groups,
                "window_memory_bytes": rows * self._window_row_bytes,
                "spilled_bytes": 0 if self._spill is None else self._spill.bytes_written,
                "late_fields": list(self._late)}

    def _ranges(self, history: Sequence[Stage]) -> list[tuple[int, int]]:
        return shard_ranges(self.num_samples, shard=self.shard, num_shards=self.num_shards, history=history,
                            remainder=self.remainder, batch_size=self.batch_size, drop_last=self.drop_last)

    def __len__(self) -> int:
        """Batches this shard yields in a whole epoch (not counting resumes; per epoch, not in total)."""
        if self.remainder == "mask":  # every shard steps its longest piece's batches
            return stage_steps(self.num_samples, num_shards=self.num_shards, remainder=self.remainder,
                               batch_size=self.batch_size)
        return (total(self._ranges(())) + self.batch_size - 1) // self.batch_size

    def _stage_steps(self) -> int:
        """Batches the job steps in the current stage: those of its longest piece (shard 0's)."""
        return stage_steps(self.num_samples, num_shards=self.num_shards, history=self._history,
                           remainder=self.remainder, batch_size=self.batch_size, drop_last=self.drop_last)

    @property
    def fingerprint(self) -> str:
        """Identifies the sample space (files, rows per row group, filter) that resume states refer to."""
        h = hashlib.sha256()
        h.update("\n".join(self.dataset.files).encode())
        h.update(np.ascontiguousarray(self.rows_per_group, dtype=np.int64).tobytes())
        h.update(self.filter_text.encode())
        return h.hexdigest()[:24]

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

    def _placing(self, placer: batching.Placer) -> Iterator[int]:
        """Read the samples ``placer`` asks for, from the reader's position on (into the next epochs as
        needed), placing each window's rows where ``placer`` says instead of cutting them into batches:
        yields the rows of each window once they are all in place (`batching.Placer`: a mixture's rows
        go straight to the mixed batches' memory)."""
        generation = self._claim()
        while generation == self._generation and placer.remaining():
            yield from self._epoch_of(generation, placer)

    def _claim(self) -> int:
        """Start a new iteration; the previous one, if still suspended somewhere, ends at its next batch."""
        if self._closed:
            raise closed_error(self)
        self._generation += 1
        return self._generation

    def _epoch(self, generation: int) -> Iterator[Columns]:
        """The rest of the current epoch's batches, through the decode/transform stage if any (made
        first: its worker processes fork before the reading threads start, at the first epoch)."""
        if self._late or self.transform is not None:
            self._sample_stage()
        batches = self._epoch_of(generation, None)
        if not self._late and self.transform is None:
            for batch in batches:
                yield self._step(batch)
                if generation != self._generation:
                    return
        else:
            yield from self._staged(batches, generation)
        if generation == self._generation:
            self._finish_epoch()

    def _staged(self, batches: Iterator[Columns], generation: int) -> Iterator[Columns]:
        """``batches`` decoded (late fields) and transformed, `_stage_ahead` batches ahead of the consumer,
        in order; a batch counts as consumed (`_step`) when it is yielded. The spill segments no later
        batch refers to are let go of as batches go out (`_deliver`)."""
        stage = self._sample_stage()
        pending: deque[_Pending] = deque()
        names = list(self._late)
        try:
            for batch in batches:
                positions = batch.pop(POSITION)
                keys = batch.pop(KEYS, positions)
                oldest = min((self._spill.oldest_window(batch[n]) for n in names if self._spill is not None),
                             default=1 << 62)
                pending.append((stage.submit(batch, self.epoch, keys), positions, oldest, batch, keys))
                if len(pending) > self._stage_ahead() or self._quick:  # a lead's: out first, then the rest
                    self._quick = False
                    yield self._deliver(pending)
                    if generation != self._generation:
                        return
            while pending:
                yield self._deliver(pending)
                if generation != self._generation:
                    return
            if self._spill is not None:  # the pass is over: none of its encoded images is needed
                self._spill.release_before(self._spill.segment + 1)
        finally:
            for future, *_ in pending:
                future.cancel()

    def _deliver(self, pending: deque[_Pending]) -> Columns:
        """The next batch out of the stage; the spill segments of the windows before its oldest go
        (windows come in order, so no later batch refers to them)."""
        future, positions, oldest, given, keys = pending.popleft()
        try:
            batch = self._waited_for(future, "stage_blocked")
        except CorruptDatasetError as e:  # an image that does not decode: named by its row
            raise self._located_error(e, given, keys) from e
        self.stats["skipped_samples"] += len(keys) - batching.num_rows(batch)  # left out: on_error="skip"
        if self._spill is not None:
            self._spill.release_before(oldest)
        batch[POSITION] = positions
        return self._step(batch)

    def _located_error(self, error: CorruptDatasetError, batch: Columns, keys: np.ndarray
                       ) -> CorruptDatasetError:
        """``error`` of decoding ``batch``, naming the file, row group and row of the sample that fails."""
        prepare = LateDecode(self._late, self._spill.reader, self._raw) if self._spill is not None else None
        if prepare is not None:
            for i in range(batching.num_rows(batch)):
                try:
                    prepare(batching.take(batch, slice(i, i + 1)))
                except CorruptDatasetError:
                    kind = ImageShapeError if isinstance(error, ImageShapeError) else CorruptDatasetError
                    return kind(f"{self._describe(int(keys[i]))}: {error}")
        return error

    def _stage_ahead(self) -> int:
        """Batches in the stage beyond the one being delivered: two per transform worker process (each
        busy, each with one waiting); one in the reading process, none in a DataLoader worker (a daemonic
        process: the DataLoader keeps batches of each worker ahead already, and each batch held costs a
        batch of decoded images)."""
        if self._processes:
            return 2 * self._processes
        return 0 if multiprocessing.current_process().daemon else 1

    def _sample_stage(self) -> Any:
        """The stage that decodes the late fields of a batch and runs ``transform`` on its samples."""
        if self._stage is None:
            prepare = None
            if self._late:
                if self._spill is None:
                    self._spill = Spill(shared=bool(self._processes))
                prepare = LateDecode(self._late, self._spill.reader, self._raw,
                                     lazy=self.transform is not None)
            if self.transform is None and not self._processes and prepare is not None:
                self._stage = DecodeStage(prepare, self.workers)
                return self._stage
            from shardkit.reader._pipeline.transform import SampleStage

            self._stage = SampleStage(self.transform, prepare=prepare, seed=self.seed,
                                      on_error=self._source.on_error, describe=self._describe,
                                      processes=self._processes, timeout=self._timeout,
                                      variable=self._variable)
            if self._output_memory is not None:
                self._stage.set_output_memory(self._output_memory)
        return self._stage

    def _epoch_order(self) -> EpochOrder:
        """The current epoch's order ``pi`` (`shardkit.reader._plan`): with order 3, each piece of the
        epoch's first stage (its shards, its batch size: a resumed epoch's, from its state) begins with a
        lead from one row group."""
        if self._order < LEADS or not self.shuffle:
            return EpochOrder(self.rows_per_group, self.seed, self.epoch, self.shuffle, self.shuffle_buffer,
                              self._order)
        shards, lead = self._epoch_lead or (self.num_shards, self.batch_size)
        starts = piece_starts(self.num_samples, shards, self.remainder, lead, self.drop_last)
        return EpochOrder(self.rows_per_group, self.seed, self.epoch, self.shuffle, self.shuffle_buffer,
                          self._order, starts, lead)

    def _describe(self, key: int) -> str:
        """Where the sample ``key`` (`EpochOrder.row_index`: its number in the dataset's order) lies:
        dataset, row group and row."""
        ends = np.cumsum(self.rows_per_group)
        group = int(np.searchsorted(ends, key, side="right"))
        rg = self.dataset.row_groups[group]
        row = key - int(ends[group] - self.rows_per_group[group])
        selected = self._source.selection.get(group)
        if selected is not None:
            row = int(selected[row])
        return f"row group {rg.index} of {self.dataset.location.join(rg.file)!r}, row {row}"

    def _epoch_of(self, generation: int, placer: batching.Placer | None) -> Iterator[Any]:
        """The rest of the current epoch: its batches, or with a ``placer``, the rows of each window
        once they are in place (see `_placing`)."""
        order = self._epoch_order()
        ranges = self._ranges(self._history)
        start = self._consumed  # > 0 when an earlier iteration of this stage stopped early
        if self.remainder == "mask" and placer is None:  # rows past the piece's samples are masked
            self._piece_rows = total(ranges)
            longest = ranges if self.shard == 0 else shard_ranges(
                self.num_samples, shard=0, num_shards=self.num_shards, history=self._history,
                remainder=self.remainder, batch_size=self.batch_size)
            ranges = mask_ranges(ranges, start=start, steps_left=self._stage_steps() - self._steps,
                                 batch_size=self.batch_size, first=longest)
        stop = total(ranges) if placer is None else min(total(ranges), start + placer.remaining())
        windows = shard_windows(order, take(ranges, start, stop))
        if not start and not self._history and ranges:  # the piece's first batch: its lead read alone
            windows = lead_window(order, windows, ranges[0][0])
        led = bool(windows) and windows[0].spans is not None  # a lead: read before anything else
        # the first batch comes sooner: its rows are read first, the rest of the window in tasks
        first = split_tasks(windows[:1], self.task_rows, -(-self.batch_size // SLICE_ROWS) * SLICE_ROWS)
        windows[:1] = first
        everything = [t.row_group for w in windows for t in w.tasks]
        # remote: fetched ahead; a lead's row groups alone first, at the store's whole speed and with the
        # machine's cores, the rest once the lead's batch is out
        self._source.plan([t.row_group for t in windows[0].tasks] if led else everything)
        # the cut tasks read their row group only as far as they need, but the last one of each row
        # group reads it to its end (so that a cache holds the whole row group)
        cut = [t for w in first for t in w.tasks]
        last_of = {t.row_group: i for i, t in enumerate(cut)}
        short = {t for i, t in enumerate(cut) if last_of[t.row_group] != i}
        batcher = batching.Batcher(self.batch_size)
        late = self._late_fields(placer)

        def keyed(batch: Columns) -> Columns:
            """A batch, with each row's number in the dataset (`EpochOrder.row_index`) for the transform's
            seeds when there is one."""
            if self.transform is not None or self._late:
                batch[KEYS] = order.row_index(pi_at(ranges, batch[POSITION]))
            return batch

        prepared: deque[tuple[np.ndarray | None, list[int], batching.Scatter | batching.Placement | None]] = \
            deque()
        late_now: list[Late | None] = [late]

        def reads() -> Iterator[tuple[Task, np.ndarray | None, bool, _Slot, Late | None]]:
            for w in windows:  # prepared just ahead of the reads, popped when the window is assembled
                if late is not None:  # a spill segment per window
                    late_now[0] = (late[0], late[0].next_segment(), late[2])
                emit, rows, sizes = needed_rows(w, order)
                plan = (scatter_plan(emit, sizes, self._recycler) if placer is None
                        else placer.plan(emit, sizes))
                prepared.append((emit, sizes, None if plan is None else plan[0]))
                for i, (t, r) in enumerate(zip(w.tasks, rows, strict=True)):
                    slot = None if plan is None or plan[1] is None else (plan[0], plan[1][i])
                    yield t, r, t not in short, slot, late_now[0]

        results = self._prefetched(reads(), alone=len(windows[0].tasks) if led else 0)
        self._quick = led  # `_staged` hands the lead's batch out before it asks for the next
        position = start
        try:
            for window in windows:
                if led and window is not windows[0]:  # the lead's batch is out: fetch the rest ahead now
                    self._source.plan(everything, new_pass=False)
                    led = False
                parts = [next(results) for _ in window.tasks]
                emit, sizes, scatter = prepared.popleft()
                placed = None if scatter is None else scatter.placed(
                    [p.chunks if p is not None and p.whole else None for p in parts])
                need = batcher.need if placer is None else (lambda: window.num_rows)  # noqa: B023
                if placed is None:
                    lost_at = functools.partial(self._in_place_of, order, ranges, position, late_now[0])
                    chunks = assemble_chunks(parts, emit, sizes, position, need, lost_at=lost_at)
                elif placer is None:  # the workers put the rows in emission order
                    chunks = assemble_chunks([Part([placed])], None, [window.num_rows], position, need)
                else:  # the workers put the rows where the placer said
                    chunks = iter(())
                if placer is not None:  # rows that the workers did not place go now
                    for chunk in chunks:
                        scatter.gathered(chunk, chunk.pop(POSITION) - position)  # type: ignore[union-attr]
                    position += window.num_rows
                    self._consumed = position
                    yield window.num_rows
                    if generation != self._generation:
                        return
                    continue
                for chunk in chunks:
                    for batch in batcher.add(chunk):
                        yield keyed(batch)
                        if generation != self._generation:
                            return
                position += window.num_rows
            for batch in batcher.flush():
                yield keyed(batch)
                if generation != self._generation:
                    return
        finally:
            results.close()
        if generation == self._generation and placer is not None:
            self._finish_epoch()

    def _in_place_of(self, order: EpochOrder, ranges: Sequence[tuple[int, int]], position: int,
                     late: Late | None, emitted: np.ndarray) -> Columns:
        """Rows in place of the lost rows ``emitted`` (indices in a window's emission order, which starts
        at piece position ``position`` of ``ranges``): see `shardkit.reader._lost`."""
        where = (f"shard {self.shard} of {self.num_shards}, epoch {self.epoch}: no sample of "
                 f"{self.dataset.url!r}{' matching the filter' if self.filter_text else ''}")
        pool = self._executor()

        def submit(fn: Callable[..., Part | None], *args: Any) -> Future[Part | None]:
            return pool.submit(fn, *args, late=late)

        rows = substitutes(order, pi_at(ranges, position + emitted), self._source, submit, where)
        self.stats["repeated_rows"] += len(emitted)
        return rows


    def _step(self, batch: Columns) -> Columns:
        """Account for a batch about to be yielded: from now on `state_dict` counts it as consumed."""
        positions = batch.pop(POSITION)
        self._steps += 1
        if self.remainder != "mask":
            self._consumed = int(positions[-1]) + 1
            return batch
        # a batch holds samples of the piece, or the one masked row read to fill a batch (`mask_ranges`)
        samples = len(positions) > 0 and int(positions[0]) < self._piece_rows
        if samples:
            self._consumed = int(positions[-1]) + 1
        if VALID in batch:
            raise ReaderError(_valid_collision(f"the transform {self.transform!r} returns a field"))
        n = batching.num_rows(batch)
        if n and self._source.on_error == "skip":  # a later batch may lose all its samples to a transform
            self._filler = {name: values[:1].copy() for name, values in batch.items()}
        elif not n and self._filler is not None:
            batch, samples = dict(self._filler), False
        return masked(batch, batching.num_rows(batch) if samples else 0, self.batch_size)

    def _late_fields(self, placer: batching.Placer | None) -> Late | None:
        """What the tasks of a pass leave encoded, spilled (None: every field decoded as it is read; a
        mixture's sources, whose rows its workers place straight in the mixed batches)."""
        if not self._late or placer is not None:
            return None
        if self._spill is None:
            self._spill = Spill(shared=bool(self._processes))
        return (self._spill, self._spill.segment, tuple(self._late))

    def _finish_epoch(self) -> None:
        skipped = self._source.skipped
        if skipped:
            self.stats["skipped_row_groups"] += len(skipped)
            warnings.warn(f"epoch {self.epoch}: skipped {len(skipped)} corrupt row group(s) "
                          f"(on_error='skip'; readable rows took the places of the "
                          f"{self.stats['repeated_rows'] - self._repeated_before} rows lost, so the shard "
                          f"still yields len(reader) batches); first: {next(iter(skipped.values()))}",
                          stacklevel=3)
            skipped.clear()
        self._repeated_before = self.stats["repeated_rows"]
        self.epoch += 1
        self._history, self._consumed, self._steps = [], 0, 0
        self._epoch_lead = None  # the next epoch's leads are this reader's

    def rows(self) -> Iterator[dict[str, Any]]:
        """Row-at-a-time iteration (slower than batches): each row a dict of field -> value (with
        ``remainder="mask"``, the samples only: masked rows and the ``__valid__`` column are left out)."""
        for batch in self:
            valid = batch.pop(VALID, None)
            names = list(batch)
            for i in range(batching.num_rows(batch)):
                if valid is None or valid[i]:
                    yield {name: batch[name][i] for name in names}

    def _share(self, *, workers: int, prefetch: int, shuffle_buffer: int) -> None:
        """Read with ``workers`` threads, ``prefetch`` tasks ahead and a window of ``shuffle_buffer`` rows
        (a mixture's source: its share of the mixture's), also when opened again on another snapshot."""
        self._arguments.update(workers=workers, prefetch=prefetch, shuffle_buffer=shuffle_buffer, late={},
                               raw=frozenset())
        self._late, self._raw = {}, frozenset()  # a mixture decodes its sources' rows as they are read
        self._order = SPREAD  # a mixture's batches are not a source's: no leads (`EpochOrder.leads`)
        self._source.read_in_place(())
        self.workers, self.prefetch, self.shuffle_buffer = workers, prefetch, shuffle_buffer

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="shardkit-read")
        return self._pool

    def _prefetched(self, tasks: Iterator[tuple[Task, np.ndarray | None, bool, _Slot, Late | None]],
                    alone: int = 0) -> Generator[Part | None, None, None]:
        """Results of ``tasks`` (with their row selections) in order, ``prefetch`` tasks running ahead;
        the first ``alone`` of them (a lead's) run before any other starts."""
        pool, inflight = self._executor(), deque[Future[Part | None]]()
        try:
            for i, (task, rows, to_end, slot, late) in enumerate(tasks):
                if i == alone > 0:  # the lead's tasks all started: their results before the next starts
                    while inflight:
                        yield self._waited_for(inflight.popleft(), "read_blocked")
                inflight.append(pool.submit(self._read, task, rows, to_end, slot, late))
                if len(inflight) > self.prefetch:
                    yield self._waited_for(inflight.popleft(), "read_blocked")
            while inflight:
                yield self._waited_for(inflight.popleft(), "read_blocked")
        finally:
            for f in inflight:
                f.cancel()

    def _waited_for(self, future: Future[Any], what: str) -> Any:
        """``future``'s result, the consumer's time blocked on it counted as ``what`` (`StageTimes`)."""
        if not _profile.TIMING:
            return future.result()
        since, self.times.waiting_on = time.perf_counter(), what
        try:
            return future.result()
        finally:
            self.times.blocked(what, since)

    def _read(self, task: Task, rows: np.ndarray | None, to_end: bool, slot: _Slot, late: Late | None
              ) -> Part | None:
        """One task, in a worker thread: decoded, and placed in its window when the window scatters."""
        timing = _profile.TIMING
        start = time.perf_counter() if timing else 0.0
        part = self._source.read(task, rows, whole=self.shuffle and slot is None, to_end=to_end, late=late,
                                 times=self.times if timing else None)
        if timing:
            self.times.task(time.perf_counter() - start)
        if slot is not None:
            if part is not None and part.whole:
                slot[0].place(part.chunks, slot[1])
            else:  # rows lost: the window is gathered, with rows in their place
                slot[0].ok = False
        return part

    # ---- state -------------------------------------------------------------------------------
    def set_batch_memory(self, allocate: Callable[[int], np.ndarray]) -> None:
        """Where the memory of shuffled batches comes from: ``allocate(nbytes)`` returns a new flat uint8
        numpy array of ``nbytes`` bytes. `shardkit.torch` passes page-locked (pinned) memory for a CUDA
        device, so that a shuffled batch goes to the GPU straight from where the shuffle put it, without
        a copy into a staging buffer. The arrays are reused as before (`batching.Recycler`); those made
        already are let go (batches that use them keep them alive). Unshuffled batches are views of the
        decoded row groups and are not affected.
        """
        self._recycler.clear()
        self._recycler.allocate = allocate

    def _set_output_memory(self, allocate: Callable[[int], np.ndarray | None] | None) -> None:
        """Where a transform's batches are made in this process (`SampleStage.set_output_memory`): a
        DataLoader worker of `shardkit.torch` gives its shared-memory segments, so that the batches cross
        to the main process without a copy. A hook for the adapters, not for users."""
        self._output_memory = allocate
        if self._stage is not None and hasattr(self._stage, "set_output_memory"):
            self._stage.set_output_memory(allocate)

    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch (JSON-able). Any rank's state describes a data-parallel job.

        Ranks step together, so after ``k`` batches every shard has consumed ``min(k * batch_size,
        its piece)``. A shard that yielded the stage's last step has finished the epoch: its state
        points at the start of the next one (with ``remainder="uneven"`` a shorter piece finishes one
        step early only when its last batch was full, and then the job has a step to go; with ``"mask"``
        every shard steps the stage's batches, masked rows counting for nothing).
        """
        epoch, history = self.epoch, list(self._history)
        if self._steps and self._steps >= self._stage_steps():
            epoch, history = epoch + 1, []
        elif self._consumed:
            history.append((self.num_shards, self._consumed))
        state = {
            "version": STATE_VERSION, "fingerprint": self.fingerprint, "seed": self.seed,
            "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer, "remainder": self.remainder,
            "drop_last": self.drop_last, "batch_size": self.batch_size, "epoch": epoch,
            "history": [[w, c] for w, c in history], "order": self._order,
        }
        if self._order >= 3:  # the epoch's leads: its first stage's shards and batch size
            rolled = epoch != self.epoch
            state["lead"] = list((None if rolled else self._epoch_lead) or (self.num_shards, self.batch_size))
        if self.dataset.snapshot is not None:  # a table: the snapshot a resume reads (see load_state_dict)
            state["snapshot"] = self.dataset.snapshot.state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from a reader with the same or a different ``num_shards``)."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ReaderError(f"not a shardkit reader state (version {STATE_VERSION}): {state!r:.200}")
        self._pin(state.get("snapshot"))
        # a state saved before shardkit spread a window's row groups (`spread_order`) has no "order":
        # its epochs go on in the order they started in
        order = state.get("order", 1)
        if type(order) is not int or not 1 <= order <= ORDER:
            raise ReaderError(f"the reader state has order={order!r}, which this shardkit does not know "
                              f"(it makes order {ORDER}, and resumes 1 and 2): upgrade shardkit to resume it")
        lead = state.get("lead")  # none: the epoch starts here, with this reader's leads
        well_formed = isinstance(lead, list | tuple) and len(lead) == 2 and all(type(v) is int and v > 0
                                                                               for v in lead)
        if order >= LEADS and lead is not None and not well_formed:
            raise ReaderError(f"the reader state is malformed (lead={lead!r} must be its epoch's first stage "
                              f"as [shards, batch size]): {state!r:.200}")
        mine = self.state_dict()
        for key in ("fingerprint", "seed", "shuffle", "shuffle_buffer", "remainder", "drop_last"):
            if state.get(key) != mine[key]:
                what = "another dataset or filter" if key == "fingerprint" else f"{key}={state.get(key)!r}"
                hint = (f" (the default follows the columns read: pass shuffle_buffer={state.get(key)!r})"
                        if key == "shuffle_buffer" else "")
                raise ReaderError(
                    f"the reader state was saved with {what}, this reader has {key}={mine[key]!r}; resume "
                    f"with the same dataset and {key}{hint}, or start a fresh reader"
                )
        if state.get("drop_last") and state.get("batch_size") != self.batch_size:
            raise ReaderError("drop_last=True needs the same batch_size to resume; "
                              f"the state has {state.get('batch_size')}, this reader {self.batch_size}")
        try:
            epoch = state["epoch"]
            history: list[Stage] = [(w, c if isinstance(c, int) else list(c)) for w, c in state["history"]]
            if not isinstance(epoch, int) or epoch < 0:
                raise TypeError("epoch must be a non-negative int")
            for w, c in history:
                stage_counts(w, c)
        except (KeyError, TypeError, ValueError, ReaderError) as e:
            raise ReaderError(f"the reader state is malformed ({e!r}): {state!r:.200}") from e
        self._ranges(history)  # validates the history against this sample space
        self.epoch, self._history, self._consumed, self._steps = epoch, history, 0, 0
        self._order = order
        self._epoch_lead = (int(lead[0]), int(lead[1])) if order >= 3 and lead is not None else None
        self._repeated_before = self.stats["repeated_rows"]
        self._generation += 1

    def _pin(self, saved: Any) -> None:
        """Read the table snapshot a state was saved on, whatever this reader opened.

        A job restarted from a checkpoint must go on with the rows it started with: a table that moved
        on since (appends, overwrites, deletes) has other rows, and mixing the two would repeat some and
        skip others. So a state naming another snapshot of the same table reopens the reader on it (its
        files' footers are cached across openings), and says so once in the log.
        """
        mine = self.dataset.snapshot
        if saved is None or mine is None:
            return  # a folder, or a state from one: the fingerprint check tells a mismatch
        if not isinstance(saved, Mapping) or saved.get("format") != mine.format or not isinstance(
                saved.get("version"), int):
            raise ReaderError(f"the reader state was saved on {saved!r:.200}, this reader reads the "
                              f"{mine.format} table {mine.table_url!r}; resume with the same table")
        version = int(saved["version"])
        if version == mine.version:
            return
        dataset = mine.reopen(version)
        if self.dataset.hints:
            from shardkit.dataset.hints import apply_hints

            dataset = apply_hints(dataset, self.dataset.hints)
        logger.warning("resuming on %s version %d of %r, as the reader state was saved on it (the table is "
                       "at %d now); the rest of the epoch reads that version's rows", mine.format, version,
                       mine.table_url, mine.version)
        generation = self._generation
        self.close()
        Reader.__init__(self, dataset, **self._arguments)
        self._generation = generation + 1  # ends a live iteration of the previous snapshot

    # ---- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker threads (pending reads are cancelled), let go of the files being read (also
        while something keeps the reader or its iterator alive: tf.data keeps every generator it ran),
        and free the kept window arrays."""
        self._generation += 1
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._source.close()
        self._recycler.clear()
        if self._stage is not None:
            self._stage.close()
            self._stage = None
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Reader({self.dataset.url!r}, shard={self.shard}/{self.num_shards}, epoch={self.epoch}, "
                f"batch_size={self.batch_size}, samples={self.num_samples})")


def _field_of(name: str, values: np.ndarray, variable: bool) -> Field:
    """The field of a transform's output column ``values`` (one sample's worth, or more)."""
    if values.dtype == object:
        first = next((v for v in values if v is not None), None)
        if isinstance(first, str):
            return Field(name, "str")
        if isinstance(first, bytes):
            return Field(name, "bytes")
        array = np.asarray(first)
        return Field(name, array.dtype, (None,) * array.ndim)
    shape = values.shape[1:]
    return Field(name, values.dtype, tuple(None for _ in shape) if variable else shape)


def _valid_collision(what: str) -> str:
    """The message for a field named like the mask column of ``remainder="mask"``."""
    return (f"{what} named {VALID!r}, the column remainder='mask' adds to every batch (True for a sample, "
            f"False for a masked row); rename that field, or read with remainder='drop' or 'pad'")


def closed_error(reader: object) -> ReaderError:
    """What iterating a closed reader raises: a closed reader reads nothing, rather than its rows again."""
    return ReaderError(f"{reader!r} was closed (close(), or the end of its `with` block) and reads no more "
                       "batches; make a new reader (shardkit.make_reader) to read again, or close it only "
                       "when you are done with it")
