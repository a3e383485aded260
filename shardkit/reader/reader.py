"""`make_reader` and `Reader`: one shard of a dataset as batches of numpy columns, resumable.

The plan (`shardkit.reader.plan`) says which rows this shard reads in which order; the reader fetches
and decodes the plan's tasks ahead of time in a bounded thread pool (in order), assembles each
shuffle window, and cuts it into batches. Memory is bounded by ``prefetch`` tasks plus one window.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from shardkit.dataset.index import Dataset, open_dataset
from shardkit.dataset.schema import Schema
from shardkit.errors import ReaderError
from shardkit.reader import batching
from shardkit.reader.filter import Filter, select_rows, to_expression
from shardkit.reader.plan import EpochOrder, Remainder, Task, Window, shard_ranges, shard_windows, total
from shardkit.reader.source import Columns, RowGroupSource

STATE_VERSION = 1
WINDOW_BYTES = 64 << 20  # default shuffle window: about this many decoded bytes of rows


class Reader:
    """Batches of one shard of a dataset. Create with `make_reader`; see its docstring."""

    def __init__(self, dataset: Dataset, *, columns: Sequence[str], shard: int, num_shards: int,
                 batch_size: int, shuffle: bool, seed: int, num_epochs: int | None, remainder: Remainder,
                 drop_last: bool, shuffle_buffer: int, filter: Filter | None, cache: Any, prefetch: int,
                 workers: int, on_error: Literal["raise", "skip"]) -> None:
        self.dataset = dataset
        self.schema: Schema = dataset.schema.select(columns)
        self.shard, self.num_shards = shard, num_shards
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.num_epochs, self.remainder, self.drop_last = num_epochs, remainder, drop_last
        self.shuffle_buffer, self.prefetch, self.workers = shuffle_buffer, prefetch, workers
        self.filter_text = ""
        selection: dict[int, np.ndarray] = {}
        self.rows_per_group = dataset.rows_per_group
        self.stats: dict[str, int] = {"pruned_row_groups": 0, "skipped_row_groups": 0}
        if filter is not None:
            expr = to_expression(filter, dataset.arrow_schema)
            self.filter_text = str(expr)
            self.rows_per_group, selection, self.stats["pruned_row_groups"] = select_rows(dataset, expr)
        self.num_samples = int(self.rows_per_group.sum())
        if self.num_samples < num_shards:
            raise ReaderError(
                f"num_shards={num_shards} is more than the {self.num_samples} samples of {dataset.url!r}"
                f"{' matching the filter' if filter is not None else ''}; use fewer shards or more data"
            )
        self._source = RowGroupSource(dataset, columns, selection=selection, cache=cache, on_error=on_error)
        self._pool: ThreadPoolExecutor | None = None
        self.epoch = 0
        self._history: list[tuple[int, int]] = []
        self._consumed = 0
        self._generation = 0

    # ---- sizes -------------------------------------------------------------------------------
    def _ranges(self, history: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return shard_ranges(self.num_samples, shard=self.shard, num_shards=self.num_shards, history=history,
                            remainder=self.remainder, batch_size=self.batch_size, drop_last=self.drop_last)

    def __len__(self) -> int:
        """Batches this shard yields in a whole epoch."""
        return -(-total(self._ranges(())) // self.batch_size)

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
        """Batches of every remaining epoch (``num_epochs=None``: forever)."""
        generation = self._generation
        while self.num_epochs is None or self.epoch < self.num_epochs:
            yield from self.iter_epoch()
            if generation != self._generation:
                return

    def iter_epoch(self) -> Iterator[Columns]:
        """Batches of the rest of the current epoch; the reader then moves to the next epoch."""
        generation = self._generation
        order = EpochOrder(self.rows_per_group, self.seed, self.epoch, self.shuffle, self.shuffle_buffer)
        windows = shard_windows(order, self._ranges(self._history))
        batcher = batching.Batcher(self.batch_size)
        results = self._prefetched(t for w in windows for t in w.tasks)
        try:
            for window in windows:
                parts = [next(results) for _ in window.tasks]
                chunk = _assemble(window, parts, order)
                if chunk is None:
                    continue
                for batch in batcher.add(chunk):
                    self._consumed += batching.num_rows(batch)
                    yield batch
                    if generation != self._generation:
                        return
            for batch in batcher.flush():
                self._consumed += batching.num_rows(batch)
                yield batch
        finally:
            results.close()
        if generation == self._generation:
            self._finish_epoch()

    def _finish_epoch(self) -> None:
        skipped = self._source.skipped
        if skipped:
            self.stats["skipped_row_groups"] += len(skipped)
            warnings.warn(f"epoch {self.epoch}: skipped {len(skipped)} corrupt row group(s) "
                          f"(on_error='skip'); first: {skipped[0]}", stacklevel=3)
            skipped.clear()
        self.epoch += 1
        self._history, self._consumed = [], 0

    def rows(self) -> Iterator[dict[str, Any]]:
        """Row-at-a-time iteration (slower than batches): each row a dict of field -> value."""
        for batch in self:
            names = list(batch)
            for i in range(batching.num_rows(batch)):
                yield {name: batch[name][i] for name in names}

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="shardkit-read")
        return self._pool

    def _prefetched(self, tasks: Iterator[Task]) -> Iterator[Columns | None]:
        """Results of ``tasks`` in order, with up to ``prefetch`` tasks running ahead."""
        pool, inflight = self._executor(), deque[Future[Columns | None]]()
        try:
            for task in tasks:
                inflight.append(pool.submit(self._source.read, task))
                if len(inflight) > self.prefetch:
                    yield inflight.popleft().result()
            while inflight:
                yield inflight.popleft().result()
        finally:
            for f in inflight:
                f.cancel()

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch (JSON-able). Any rank's state describes a data-parallel job."""
        history = [*self._history, (self.num_shards, self._consumed)]
        return {
            "version": STATE_VERSION, "fingerprint": self.fingerprint, "seed": self.seed,
            "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer, "remainder": self.remainder,
            "drop_last": self.drop_last, "batch_size": self.batch_size, "epoch": self.epoch,
            "history": [[w, c] for w, c in history if c > 0],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from a reader with the same or a different ``num_shards``)."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ReaderError(f"not a shardkit reader state (version {STATE_VERSION}): {state!r:.200}")
        mine = self.state_dict()
        for key in ("fingerprint", "seed", "shuffle", "shuffle_buffer", "remainder", "drop_last"):
            if state.get(key) != mine[key]:
                what = "another dataset or filter" if key == "fingerprint" else f"{key}={state.get(key)!r}"
                raise ReaderError(
                    f"the reader state was saved with {what}, this reader has {key}={mine[key]!r}; resume "
                    f"with the same dataset and {key}, or start a fresh reader"
                )
        if state.get("drop_last") and state.get("batch_size") != self.batch_size:
            raise ReaderError("drop_last=True needs the same batch_size to resume; "
                              f"the state has {state.get('batch_size')}, this reader {self.batch_size}")
        history = [(int(w), int(c)) for w, c in state.get("history", [])]
        self._ranges(history)  # validates the history against this sample space
        self.epoch, self._history, self._consumed = int(state["epoch"]), history, 0
        self._generation += 1

    # ---- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker threads (pending reads are cancelled)."""
        self._generation += 1
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Reader({self.dataset.url!r}, shard={self.shard}/{self.num_shards}, epoch={self.epoch}, "
                f"batch_size={self.batch_size}, samples={self.num_samples})")


def _assemble(window: Window, parts: list[Columns | None], order: EpochOrder) -> Columns | None:
    """Concatenate a window's task results and pick its rows in emission order (skipped parts out)."""
    emit = window.emit(order)
    ok = [p is not None for p in parts]
    if not all(ok) and emit is not None:
        sizes = np.array([t.stop - t.start for t in window.tasks])
        owner = np.searchsorted(np.cumsum(sizes), emit, side="right")
        keep = np.asarray(ok)[owner]
        shift = np.cumsum(np.where(ok, 0, sizes)) - np.where(ok, 0, sizes)
        emit = emit[keep] - shift[owner[keep]]
    present = [p for p in parts if p is not None]
    if not present:
        return None
    columns = batching.concat(present)
    return columns if emit is None else batching.take(columns, emit)


def _job_world(shard: int | None, num_shards: int | None) -> tuple[int, int]:
    """Fill in shard/num_shards from the job this process runs in (WORLD_SIZE/RANK or torch.distributed)."""
    if num_shards is not None:
        if shard is None:
            raise ReaderError(f"num_shards={num_shards} was given without shard=; pass this worker's rank")
        return shard, num_shards
    world, rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    dist = _torch_dist()
    if dist is not None:
        world, rank = str(dist.get_world_size()), str(dist.get_rank())
    if world is None:
        if shard is None or shard == 0:
            return 0, 1
        raise ReaderError(
            f"shard={shard} was given without num_shards, and this process is not in a job (no WORLD_SIZE, "
            "no initialized torch.distributed); pass num_shards=<number of workers>"
        )
    return (int(rank or 0) if shard is None else shard), int(world)


def _torch_dist() -> Any:
    import sys

    if "torch.distributed" not in sys.modules:
        return None
    dist = sys.modules["torch.distributed"]
    return dist if dist.is_available() and dist.is_initialized() else None


def _positive(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ReaderError(f"{name}={value!r} must be an int >= {minimum}")
    return value
