"""Reading one task: a row range of a row group -> decoded numpy columns (through the cache if any).

Runs in the reader's worker threads: Parquet decoding, Arrow->numpy and image decoding all release
the GIL, so row groups are fetched and decoded in parallel. A task decodes to a list of chunks (the
row group's `SLICE_ROWS`-row record batches, cut to the task's rows): read in order, fixed-shape
tensors stay zero-copy views of the Arrow buffers up to the batches; a shuffled reader's task is
concatenated once, in the worker, into the chunk its window gathers batches from.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa

from shardkit.dataset.index import Dataset
from shardkit.errors import CorruptDatasetError
from shardkit.reader import batching
from shardkit.reader.plan import Task

if TYPE_CHECKING:
    from shardkit.reader.cache import RowGroupCache

Columns = dict[str, np.ndarray]
Part = list[Columns]  # one task's decoded rows, as chunks in row order
RECENT_READS = 2  # row-group tables kept for the next task (bounded memory: two row groups)


class RowGroupSource:
    """Fetches and decodes tasks of one dataset for a fixed column selection."""

    def __init__(
        self,
        dataset: Dataset,
        columns: Sequence[str],
        *,
        selection: dict[int, np.ndarray] | None = None,
        cache: RowGroupCache | None = None,
        on_error: Literal["raise", "skip"] = "raise",
    ) -> None:
        self.dataset = dataset
        self.columns = list(columns)
        self.selection = selection or {}
        self.cache = cache
        self.on_error = on_error
        self.skipped: dict[int, str] = {}  # corrupt row groups skipped (index -> error), until cleared
        self.remote_reads = 0
        self._lock = threading.Lock()
        self._recent: OrderedDict[int, Future[pa.Table]] = OrderedDict()

    def _fetch(self, row_group: int) -> pa.Table:
        with self._lock:
            self.remote_reads += 1
        return self.dataset.read_row_group(row_group, self.columns)

    def _arrow(self, row_group: int) -> pa.Table:
        """The row group's Arrow table; neighbouring tasks of one row group (a row group that spans two
        shuffle windows) share one read through a small table of in-flight and recent reads."""
        with self._lock:
            future = self._recent.get(row_group)
            owner = future is None
            if future is None:
                future = self._recent[row_group] = Future()
                while len(self._recent) > RECENT_READS:
                    self._recent.popitem(last=False)
            else:
                self._recent.move_to_end(row_group)
        if owner:
            try:
                future.set_result(self._load(row_group))
            except BaseException as e:
                future.set_exception(e)
                with self._lock:
                    self._recent.pop(row_group, None)
        return future.result()

    def _load(self, row_group: int) -> pa.Table:
        if self.cache is None:
            return self._fetch(row_group)
        rg = self.dataset.row_groups[row_group]
        key = "|".join([self.dataset.url, rg.file, str(rg.index), str(rg.num_rows), str(rg.num_bytes),
                        ",".join(self.columns)])
        return self.cache.get_or_fetch(key, lambda: self._fetch(row_group))

    def read(self, task: Task, rows: np.ndarray | None = None, *, whole: bool = False) -> Part | None:
        """Decoded chunks of ``task``'s rows (only ``rows`` of them, relative to ``task.start``, when
        given), in order; None when the row group is corrupt and skipped.

        ``whole=True`` concatenates the chunks into one (here, in the worker thread): what a shuffle
        window gathers from, at a fraction of the cost of gathering from many small chunks.
        """
        try:
            table = self._arrow(task.row_group)
            selected = self.selection.get(task.row_group)
            if selected is None and rows is None:
                table = table.slice(task.start, task.stop - task.start)
            else:
                span = slice(task.start, task.stop)
                index = np.arange(task.start, task.stop) if selected is None else selected[span]
                table = table.take(pa.array(index if rows is None else index[rows]))
            chunks = [self.dataset.decode(batch) for batch in table.to_batches() if batch.num_rows]
            return [batching.concat(chunks)] if whole and len(chunks) > 1 else chunks
        except CorruptDatasetError as e:
            rg = self.dataset.row_groups[task.row_group]
            where = f"row group {rg.index} of {self.dataset.location.join(rg.file)!r}"
            error = e if where in str(e) else CorruptDatasetError(f"{where}: {e}")
            if self.on_error == "raise":
                if error is e:
                    raise
                raise error from e
            with self._lock:
                self.skipped.setdefault(task.row_group, str(error))
            return None
