"""Reading one task: a row range of a row group -> decoded numpy columns (through the cache if any).

Runs in the reader's worker threads: Parquet decoding, Arrow->numpy and image decoding all release
the GIL, so row groups are fetched and decoded in parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa

from shardkit.dataset.index import Dataset
from shardkit.errors import CorruptDatasetError
from shardkit.reader.plan import Task

if TYPE_CHECKING:
    from shardkit.reader.cache import RowGroupCache

Columns = dict[str, np.ndarray]


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
        self.skipped: list[str] = []
        self.remote_reads = 0
        self._lock = threading.Lock()

    def _fetch(self, row_group: int) -> pa.Table:
        with self._lock:
            self.remote_reads += 1
        return self.dataset.read_row_group(row_group, self.columns)

    def _arrow(self, row_group: int) -> pa.Table:
        if self.cache is None:
            return self._fetch(row_group)
        rg = self.dataset.row_groups[row_group]
        key = "|".join([self.dataset.url, rg.file, str(rg.index), str(rg.num_rows), str(rg.num_bytes),
                        ",".join(self.columns)])
        return self.cache.get_or_fetch(key, lambda: self._fetch(row_group))

    def read(self, task: Task) -> Columns | None:
        """Decoded columns of ``task``'s rows; None when the row group is corrupt and skipped."""
        try:
            table = self._arrow(task.row_group)
            rows = self.selection.get(task.row_group)
            if rows is None:
                table = table.slice(task.start, task.stop - task.start)
            else:
                table = table.take(pa.array(rows[task.start : task.stop]))
            return self.dataset.decode(table)
        except CorruptDatasetError as e:
            if self.on_error == "raise":
                raise
            with self._lock:
                self.skipped.append(str(e))
            return None
