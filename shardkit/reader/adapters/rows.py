"""`MapSource`: a shardkit dataset's rows by index, as numpy samples, for any sampler and any process:
the random-access source under `shardkit.torch.MapDataset` and, as ``shardkit.jax.MapSource``, a data
source for Grain (``grain.MapDataset.source(...)``, ``grain.DataLoader(data_source=...)``).

Index ``i`` is the dataset's row ``i`` in its own order (`shardkit.dataset.take`: row groups in order, a
table's deleted rows not counted); negative indices count from the end; with ``filter=``, the ``i``-th
matching row. A sample is a dict of field -> numpy value (an image as its HxWxC uint8 array, or its
JPEG/PNG bytes with ``decode=False``; None for a null), what a reader's ``transform=`` gets.

Batched lookups. ``__getitems__(indices)`` (what torch's DataLoader calls with a whole batch, and Grain's
batched reads) groups the rows by row group and reads each row group once (`shardkit.dataset.RowAccess`):
an image column stored as it is is read in place, only the asked rows' bytes; each process keeps the row
groups it read last (``cache_bytes``).

Processes. Nothing open is held across processes: the dataset's index (its row groups, schema, snapshot)
travels to each worker (pickled), which opens its files on its first lookup, with the ``fork``,
``spawn`` and ``forkserver`` start methods alike. The number of rows is fixed when the source is made,
so every worker and the sampler agree on ``len``.

Remote data. Through ``cache=`` (the reader's disk cache, ``"auto"`` by default) a row group's asked
columns are fetched once from the store and memory-mapped from then on, by every process of the machine;
a reader of the same columns shares the entries: a row group's first lookup fetches its asked columns
whole. ``shardkit.dataset.take`` fetches only the pages that hold its rows instead, for sparse lookups
in a large remote dataset.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from shardkit.dataset import Dataset, RowAccess
from shardkit.dataset.open import open_dataset
from shardkit.dataset.take import CACHE_BYTES, check_columns, raw_fields, row_positions, sample_of
from shardkit.errors import CacheWarning, ReaderError, RowIndexError, RowIndexTypeError
from shardkit.reader._cache import CacheConfig, RowGroupCache
from shardkit.reader._filter import Filter, Partitions, select_rows, to_expression
from shardkit.reader._pipeline.source import row_group_key

__all__ = ["MapSource"]

Columns = dict[str, Any]


class MapSource:
    """A shardkit dataset's rows by index: ``len(src)`` rows, ``src[i]`` one sample (field -> numpy value).

    Example:
        >>> src = shardkit.jax.MapSource(url, columns=["image", "label"])
        >>> ds = grain.MapDataset.source(src).shuffle(seed=0).batch(256)

    Args:
        url_or_dataset: a dataset URL (any fsspec URL, a Delta or Iceberg table), or an opened
            `shardkit.Dataset` (its snapshot, schema hints and deleted rows are kept).
        columns: the fields of each sample (None: all).
        transform: ``fn(sample) -> anything``, run on each sample in the process that looks it up. It
            gets the sample as a reader's ``transform=`` does (field -> numpy value, an image as its
            HxWxC uint8 array, None for a null); what it returns is the sample.
        filter: only the rows that match it, as a reader's ``filter=`` keeps them (an Arrow expression or
            DNF tuples, e.g. ``[("label", "<", 5)]``): index ``i`` is then the ``i``-th matching row, and
            ``len`` their number. The matching rows are counted when the source is made (the filter's
            columns of the row groups that its statistics do not rule out are read once).
        storage_options: as for `shardkit.open_dataset` (a URL only).
        version: a table's version, as for `shardkit.open_dataset` (a URL only).
        cache_bytes: Arrow bytes of row groups each process keeps for the next lookups.
        cache: the reader's local-disk row-group cache, as ``make_reader(cache=)`` takes it: ``"auto"``
            (the default; for a remote dataset ``~/.cache/shardkit``, for a local one none), a folder, a
            `shardkit.reader.CacheConfig`, or None. A row group's asked columns are fetched once into it
            and memory-mapped from then on by every process of the machine (a loader's workers share
            it, and a reader of the same columns finds the entries, and the other way round).
        decode: as a reader's ``decode=``: False gives every image field as its JPEG/PNG bytes (for a
            decoder elsewhere, or a ``transform`` that decodes and augments itself), ``{"image": False}``
            the fields named.
    """

    def __init__(self, url_or_dataset: str | os.PathLike[str] | Dataset, columns: Sequence[str] | None = None,
                 transform: Callable[[dict[str, Any]], Any] | None = None, *, filter: Filter | None = None,
                 storage_options: dict[str, Any] | None = None, version: int | None = None,
                 cache_bytes: int = CACHE_BYTES, cache: str | os.PathLike[str] | CacheConfig | None = "auto",
                 decode: bool | Mapping[str, bool] = True) -> None:
        kind = type(self).__name__
        if isinstance(url_or_dataset, Dataset):
            if storage_options is not None or version is not None:
                raise ReaderError(f"{kind}(dataset, storage_options=/version=): those open a URL; the "
                                  f"dataset {url_or_dataset.url!r} is open already (open_dataset(url, "
                                  "version=...) chooses them)")
            dataset = url_or_dataset
        else:
            dataset = open_dataset(url_or_dataset, storage_options=storage_options, version=version)
        if transform is not None and not callable(transform):
            raise ReaderError(f"transform={transform!r} is not callable; pass a function "
                              "fn(sample) -> sample")
        self.columns = check_columns(dataset, columns)
        self.transform = transform
        self.cache_bytes = cache_bytes
        #: image fields given as their JPEG/PNG bytes (``decode=``)
        self.raw = raw_fields(decode, dataset.schema, self.columns)
        self.url = dataset.url
        self.filter_text = ""
        #: the dataset's rows that match the filter, in order (None: every row)
        self._positions: np.ndarray | None = None
        if filter is not None:
            self._positions, self.filter_text = _matching_rows(dataset, filter)
        self._num_rows = dataset.num_rows if self._positions is None else len(self._positions)
        # what the dataset is made of (picklable: no lock, no open file), for each process to rebuild it
        self._parts = {f.name: getattr(dataset, f.name) for f in dataclasses.fields(dataset) if f.init}
        self._cache_config = CacheConfig.resolve(cache, remote=not dataset.location.is_local)
        self._cache_named = cache != "auto"
        self._row_cache: RowGroupCache | None = None
        self._rows: RowAccess | None = None
        self._pid = -1
        self.rows()  # the files open in this process; a worker opens its own

    def __len__(self) -> int:
        return self._num_rows

    @property
    def positions(self) -> np.ndarray:
        """The dataset's global row indices of this source's rows, in order: ``src[i]`` is the dataset's
        row ``positions[i]`` (with ``filter=``, the matching rows; else ``0 .. len - 1``). For a sampler's
        weights from a column: ``take(src.rows().dataset, src.positions, columns=["label"])``."""
        if self._positions is None:
            return np.arange(self._num_rows, dtype=np.int64)
        return self._positions.copy()

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, bool) or (not isinstance(index, int) and not self._integer(index)):
            raise RowIndexTypeError(
                f"{type(self).__name__}[{index!r}] ({type(index).__name__}) of dataset {self.url!r} is not "
                "an integer row index; pass an int (negative: from the end), or a list of them to "
                "__getitems__")
        return self.__getitems__([int(index)])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices`` (a loader's batch of them), each row group read once."""
        batch = self.lookup(indices)
        n = len(next(iter(batch.values())))
        if self.transform is not None:
            return [self.transform(sample_of(batch, j)) for j in range(n)]
        return [sample_of(batch, j) for j in range(n)]

    def lookup(self, indices: Sequence[int]) -> Columns:
        """The rows at ``indices`` as one batch (field -> numpy column), each row group read once."""
        rows = self.rows()
        try:
            positions = row_positions(indices, self._num_rows, self.url)
        except RowIndexError as e:
            if self._positions is None or isinstance(e, RowIndexTypeError):
                raise
            raise RowIndexError(f"{e}: the rows of the dataset that match filter {self.filter_text} "
                                f"(of its {rows.dataset.num_rows} rows)") from e
        return rows.take(positions if self._positions is None else self._positions[positions])

    def rows(self) -> RowAccess:
        """This process's `RowAccess` of the dataset (made on first use in a process: a worker opens its
        own files)."""
        if self._rows is None or self._pid != os.getpid():
            dataset = Dataset(**self._parts)
            self._row_cache = self._open_cache(dataset)
            read = None if self._row_cache is None else _CachedRead(dataset, self._row_cache)
            self._rows = RowAccess(dataset, self.columns, cache_bytes=self.cache_bytes, read=read,
                                   decode=dict.fromkeys(self.raw, False))
            self._pid = os.getpid()
        return self._rows

    @property
    def cache_stats(self) -> dict[str, int]:
        """This process's use of the disk cache: hits, misses (row groups fetched), evictions, corrupt
        entries found (all zero without a cache)."""
        cache = self._row_cache if self._pid == os.getpid() else None
        return dict(cache.stats) if cache is not None else {"hits": 0, "misses": 0, "evictions": 0,
                                                             "corrupt": 0}

    def _open_cache(self, dataset: Dataset) -> RowGroupCache | None:
        if self._cache_config is None:
            return None
        try:
            return RowGroupCache(self._cache_config)
        except ReaderError as e:
            if self._cache_named:  # a cache asked for by name: its folder must work
                raise
            warnings.warn(CacheWarning(f"{e}; looking up rows of {dataset.url!r} without the default "
                                       "row-group cache"), stacklevel=3)
            return None

    @staticmethod
    def _integer(value: Any) -> bool:
        """Whether ``value`` is an integer index other than a Python int (a numpy integer)."""
        return isinstance(value, np.integer)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_rows"] = state["_row_cache"] = None  # locks, row groups kept: each process makes its own
        return state

    def __repr__(self) -> str:
        matching = f", filter={self.filter_text}" if self.filter_text else ""
        return (f"{type(self).__name__}({self.url!r}, columns={self.columns!r}{matching}, "
                f"rows={self._num_rows})")


class _CachedRead:
    """``read(g, columns)`` for `RowAccess`: a row group's columns through the disk cache, keyed as a
    reader keys them (the file's version of this process's first look at it: one listing)."""

    def __init__(self, dataset: Dataset, cache: RowGroupCache) -> None:
        self.dataset = dataset
        self.cache = cache
        self._versions: dict[str, str | None] | None = None
        self._lock = threading.Lock()

    def __call__(self, g: int, columns: Sequence[str]) -> pa.Table:
        file = self.dataset.row_groups[g].file
        location = self.dataset.location
        with self._lock:
            if self._versions is None:
                self._versions = dict(location.versions())
            if file not in self._versions:
                self._versions[file] = location.version(file)
            version = self._versions[file]
        self.dataset.saw_version(file, version)
        if version is None:  # nothing tells a rewritten file from this one: never cached
            return self.dataset.read_row_group(g, columns)
        key = row_group_key(self.dataset, g, columns, version)
        return self.cache.get_or_fetch(key, lambda: self.dataset.read_row_group(g, columns).combine_chunks())


def _matching_rows(dataset: Dataset, filter: Filter) -> tuple[np.ndarray, str]:
    """The global indices of ``dataset``'s rows that match ``filter`` (in order), and the filter as text."""
    partitions = Partitions.of(dataset)
    expr = to_expression(filter, dataset.arrow_schema, partitions)
    counts, selection, _, _ = select_rows(dataset, expr, "raise", partitions)
    ends = np.cumsum(dataset.rows_per_group)
    parts = [selection[g] + (ends[g] - rows) if g in selection else np.arange(ends[g] - rows, ends[g])
             for g, rows in enumerate(dataset.rows_per_group) if counts[g]]
    return (np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)), str(expr)


