"""`Dataset`, an opened dataset: its schema and row-group index, and the reads of its row groups (data
files opened with the summary's footers or their own, kept; row groups read in `SLICE_ROWS`-row slices;
the decoded size of a row).

How a folder becomes a `Dataset` (its kind, its schema, its index from the summary or the footers, the
warnings of opening) is `shardkit.dataset.open`, which re-exports these names; this module is what
every reader holds once the dataset is open, and it imports nothing of the opening.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardkit._storage.access import is_denied, no_ranges_error, permission_error, request_error
from shardkit._storage.location import Location
from shardkit.dataset import _pages
from shardkit.dataset._field import Field
from shardkit.dataset._footers import RowGroup
from shardkit.dataset._pages import chunk_range
from shardkit.dataset.fetch import Fetched, FetchedFile
from shardkit.dataset.schema import Schema
from shardkit.errors import CorruptDatasetError, DatasetChangedError, SchemaMismatchError, one_line

if TYPE_CHECKING:
    from shardkit.dataset.tables.snapshot import Snapshot
    from shardkit.dataset.take import KeptRows, RowAccess

#: Rows Parquet decodes at a time. A whole row group at once needs several times its decoded size in
#: scratch buffers (uint8 tensors go through int32 values plus repetition and definition levels), and
#: small slices decode faster as their scratch buffers stay in the CPU caches.
SLICE_ROWS = 256
FETCHED_PIECE = 1 << 20  # a fetched column chunk is decoded as its parts come, in pieces of this size
#: a remote row group read for its first rows only (``iter_row_group(head=True)``) is read in requests of
#: this size
HEAD_PIECE = 1 << 20
FOOTERS_KEPT = 256  # data-file footers an opened dataset keeps (LRU), so a file's footer is read once
#: Arrow bytes of row groups' columns an opened dataset's lookups (``ds[i]``, ``ds.take``) keep for the next
#: ones (`Dataset.lookups`): the rows of a few row groups of images, or all of a dataset of numbers this size
ROWS_KEPT = 256 << 20
_PARTITION = re.compile(r"([^=/]+)=[^/]*")  # a Hive partition folder: key=value
#: Every page read is checked against its Parquet page checksum where it has one (shardkit writes one
#: on every page: `shardkit.dataset.write.PAGE_CHECKSUMS`): a damaged page raises, never decodes. Off
#: only to measure what it costs (``benchmarks.read``).
VERIFY_PAGE_CHECKSUMS = True


def _column_chunks(group: pq.RowGroupMetaData, columns: Sequence[str] | None
                   ) -> list[tuple[str, int, int]]:
    """The column chunks of a row group (pyarrow's ``RowGroupMetaData``) that hold the top-level fields
    ``columns`` (None: all), in file order: ``(column path, start, end)`` byte ranges."""
    wanted = None if columns is None else set(columns)
    chunks = []
    for j in range(group.num_columns):
        column = group.column(j)
        if wanted is None or column.path_in_schema.split(".", 1)[0] in wanted:
            start, length = chunk_range(column)
            chunks.append((column.path_in_schema, start, start + length))
    return chunks


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """An opened dataset: schema plus row-group index. Create with `open_dataset`."""

    location: Location
    schema: Schema
    arrow_schema: pa.Schema
    row_groups: tuple[RowGroup, ...]
    kind: Literal["shardkit", "petastorm", "parquet", "delta", "iceberg"]
    metadata: pq.FileMetaData | None = dataclasses.field(default=None, repr=False)
    #: the table version a Delta or Iceberg dataset lists the files of (None for folders)
    snapshot: Snapshot | None = None
    #: rows of a table deleted without rewriting their file (Delta's deletion vectors): row group (its
    #: index in ``row_groups``) -> which of its stored rows are kept. Its ``num_rows`` counts those kept.
    kept: dict[int, np.ndarray] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: columns read as another type than stored (``schema=`` hints: `shardkit.dataset.hints`)
    casts: dict[str, pa.DataType] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: columns a table keeps in its log, not in its files (Delta's partition columns): file -> column ->
    #: the value of every row of that file (None: null)
    constants: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: the ``schema=`` hints applied (a reader reopening another snapshot applies them again)
    hints: tuple[Field, ...] = dataclasses.field(default=(), repr=False, compare=False)
    _footers: OrderedDict[str, pq.FileMetaData] = dataclasses.field(
        default_factory=OrderedDict, init=False, repr=False, compare=False)
    _footer_lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, init=False, repr=False, compare=False)
    #: each data file's version (ETag; locally size and mtime) when this process first learned it
    #: (`saw_version`): a read that fails on a file whose version moved since says so (`changed`)
    _versions_seen: dict[str, str] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                       compare=False)
    #: columns of a plain Parquet dataset left out of the schema: name -> why, and the cast that helps
    left_out: dict[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: footers parsed for page reads (`page_footer`): file ("" for the summary) -> footer, leaf fields
    _page_footers: OrderedDict[str, tuple[Any, list[str]]] = dataclasses.field(
        default_factory=OrderedDict, init=False, repr=False, compare=False)
    #: the notes logged once for this opened dataset (`note_once`)
    _noted: set[str] = dataclasses.field(default_factory=set, init=False, repr=False, compare=False)
    #: [seconds] this process spent checking page checksums (`checksum_seconds`)
    _checking: list[float] = dataclasses.field(default_factory=lambda: [0.0], init=False, repr=False,
                                               compare=False)

    @property
    def url(self) -> str:
        return self.location.url

    @cached_property
    def files(self) -> list[str]:
        return list(dict.fromkeys(rg.file for rg in self.row_groups))

    @cached_property
    def partition_keys(self) -> list[str]:
        """Hive partition keys in the folders of the files (``year`` of ``year=2020/``) that are not
        columns of the dataset: their values are in folder names only, and not read (see
        `shardkit.dataset.open`)."""
        return [key for key in partition_keys(self.files) if key not in self.schema.names]

    @property
    def num_rows(self) -> int:
        return sum(rg.num_rows for rg in self.row_groups)

    def __len__(self) -> int:
        """``len(ds)``: the number of rows (`num_rows`)."""
        return self.num_rows

    def __getitem__(self, index: Any) -> Any:
        """``ds[i]``: row ``i`` in the dataset's order (negative: from the end) as one sample, field ->
        value (None for a null); ``ds[indices]``, ``ds[mask]``, ``ds[a:b]``: those rows as a batch (`take`).

        Raises `RowIndexError` (an ``IndexError``, so ``for row in ds`` ends as a sequence's loop does)
        or `RowIndexTypeError` (a ``TypeError``). Lookups reuse what the ones before kept (`lookups`).
        """
        if isinstance(index, int | np.integer) and not isinstance(index, bool | np.bool_):
            return self._rows.row(index)
        return self._rows.take(index)

    def take(self, indices: Any, columns: Sequence[str] | None = None, *,
             decode: bool | dict[str, bool] = True) -> dict[str, np.ndarray]:
        """The rows ``indices`` (global indices in the dataset's order; negative from the end, a boolean
        mask or a slice) of ``columns`` (None: all), decoded as a reader's batch holds them, in the order
        given (``decode=False``: image fields as their JPEG/PNG bytes): `shardkit.dataset.take`. Reuses
        what the lookups before kept (`lookups`)."""
        from shardkit.dataset.take import take

        return take(self, indices, columns, decode=decode)

    @cached_property
    def lookups(self) -> KeptRows:
        """What this dataset's lookups (``ds[i]``, `take`) keep for the next ones: columns of row groups
        they read whole (Arrow) and, from a store, the pages they fetched, up to ``lookups.budget`` bytes
        (`ROWS_KEPT`; set it to 0 to keep none), and the layouts of the values read in place
        (`shardkit.dataset.KeptRows`)."""
        from shardkit.dataset.take import KeptRows

        return KeptRows(ROWS_KEPT)

    @cached_property
    def _rows(self) -> RowAccess:
        """This dataset's lookups by ``ds[i]`` (`__getitem__`)."""
        from shardkit.dataset.take import RowAccess

        return RowAccess(self, kept=self.lookups)

    @property
    def num_bytes(self) -> int:
        return sum(rg.num_bytes for rg in self.row_groups)

    @cached_property
    def rows_per_group(self) -> np.ndarray:
        """Row counts of the row groups as an int64 array (what planning works on)."""
        counts = (rg.num_rows for rg in self.row_groups)
        return np.fromiter(counts, dtype=np.int64, count=len(self.row_groups))

    def open_file(self, file: str, fetched: Fetched | None = None, *,
                  checked: tuple[int, Sequence[str] | None] | None = None, head: bool = False
                  ) -> pq.ParquetFile:
        """Open one data file, raising `CorruptDatasetError` (naming it) if it is not readable Parquet,
        `DatasetPermissionError` if this user may not read it (never taken for corruption).

        With a ``_metadata`` summary the file is opened with it, not with its own footer (one request
        less per file, on object stores one round trip less before the first batch): the summary holds
        every row group's column chunks, so its row group ``k`` is ``row_groups[k]``, read from this file
        (see `row_group_index`). Without one, the file's footer is read on its first opening and then
        reused (for the last `FOOTERS_KEPT` files).

        ``checked``: ``(i, columns)``, the row group of the index and the columns (None: all) that will be
        read from ``fetched``: their pages' checksums are checked as they are read (`FetchedFile`, ISA-L's
        CRC-32) in place of pyarrow's check, many times slower.

        ``head=True`` (a remote file, not ``fetched``): its column chunks are read a piece of `HEAD_PIECE`
        bytes at a time as they are decoded, not whole: the first rows cost their first pages' bytes.
        """
        path = self.location.join(file)
        with self._footer_lock:
            footer = self.metadata if self.metadata is not None else self._footers.get(file)
            if footer is not None and self.metadata is None:
                self._footers.move_to_end(file)
        try:
            if fetched is not None and footer is not None:  # fetched ahead (`shardkit.dataset.fetch`)
                named = functools.partial(request_error, self.url, path)
                chunks = self._fetched_chunks(footer, checked, fetched) if checked is not None else []
                reads = FetchedFile(fetched, self._fetch_more(file), named, chunks)
                source = pa.PythonFile(reads, mode="r")
            else:
                source, fetched, chunks, reads = self.location.open_ranges(path), None, [], None
            streamed = head and fetched is None and not self.location.is_local
            pf = pq.ParquetFile(source, metadata=footer,
                                pre_buffer=not self.location.is_local and fetched is None and not streamed,
                                # fetched: each column chunk read in pieces, decoded as its parts come
                                buffer_size=FETCHED_PIECE if fetched is not None else
                                HEAD_PIECE if streamed else 0,
                                # a local file's pages: checked by `_verify_local`, fetched ones by the
                                # `FetchedFile` (both faster than pyarrow's CRC)
                                page_checksum_verification=VERIFY_PAGE_CHECKSUMS
                                and not self.location.is_local and not chunks)
        except FileNotFoundError as e:
            if self.snapshot is not None:
                raise CorruptDatasetError(
                    f"data file {path!r} of the {self.snapshot.format} table {self.url!r} at version "
                    f"{self.snapshot.version} is gone from storage (removed by a vacuum or an expiry of old "
                    "snapshots, or by hand). Read a version whose files are kept "
                    f"(version=, of {list(self.snapshot.versions)}), or restore the file"
                ) from e
            raise CorruptDatasetError(
                f"data file {path!r} of dataset {self.url!r} is missing; the dataset was changed outside "
                "shardkit. Rewrite it, or run shardkit.write_summary(url) to index the files that remain"
            ) from e
        except (pa.ArrowInvalid, OSError) as e:
            if is_denied(e):
                raise permission_error(self.location, path, e) from e
            raise CorruptDatasetError(
                f"data file {path!r} of dataset {self.url!r} is not readable Parquet ({e}); "
                "it is truncated or corrupt: rewrite the dataset or remove the file and rerun write_summary"
            ) from e
        if footer is None:
            self.keep_footer(file, pf.metadata)
        pf.shardkit_source = source  # type: ignore[attr-defined]  # (`_verify_local` reads its mapping)
        pf.shardkit_fetched = reads  # type: ignore[attr-defined]  # (its pages' checks, timed)
        return pf

    def _fetched_chunks(self, footer: pq.FileMetaData, checked: tuple[int, Sequence[str] | None],
                        fetched: Fetched) -> list[tuple[str, int, int]]:
        """The column chunks (``(column, start, end)``) of ``checked``'s row group and columns, for the
        `FetchedFile` to check; none (pyarrow then checks) without checksums to verify, or where one lies
        outside what was fetched."""
        if not VERIFY_PAGE_CHECKSUMS:
            return []
        i, columns = checked
        chunks = _column_chunks(footer.row_group(self.row_group_index(i)), columns)
        return chunks if all(fetched.covers(start, end) for _, start, end in chunks) else []

    def chunk_ranges(self, i: int, columns: Sequence[str] | None = None
                     ) -> tuple[str, list[tuple[int, int]]] | None:
        """The path of row group ``i``'s file and the ``(start, end)`` byte ranges of its column chunks of
        ``columns`` (None: all): what reading it takes, to fetch ahead (`shardkit.dataset.fetch`). None
        when its footer is not at hand (no summary, and the file's footer not kept)."""
        rg = self.row_groups[i]
        with self._footer_lock:
            footer = self.metadata if self.metadata is not None else self._footers.get(rg.file)
        if footer is None:
            return None
        chunks = _column_chunks(footer.row_group(self.row_group_index(i)), columns)
        return self.location.join(rg.file), [(start, end) for _, start, end in chunks]

    def _fetch_more(self, file: str) -> Callable[[int, int], bytes]:
        """A request for bytes of data file ``file`` that were not fetched ahead, or whose fetch failed
        (see `FetchedFile`); a failure is named as a direct read's (`read_ranges`)."""

        def get(start: int, end: int) -> bytes:
            return bytes(self.read_ranges(file, [(start, end)])[0])  # (bytes of bytes: the same object)

        return get

    def row_group_index(self, i: int) -> int:
        """The index to read row group ``i`` of the index by, in the `ParquetFile` `open_file` gives."""
        return i if self.metadata is not None else self.row_groups[i].index

    def keep_footer(self, file: str, footer: pq.FileMetaData) -> None:
        """Remember ``file``'s footer (already read elsewhere) for `open_file`."""
        with self._footer_lock:
            self._footers[file] = footer
            while len(self._footers) > FOOTERS_KEPT:
                self._footers.popitem(last=False)

    def iter_row_group(self, i: int, columns: Sequence[str] | None = None, *,
                       batch_size: int = SLICE_ROWS, fetched: Fetched | None = None, head: bool = False
                       ) -> Iterator[pa.RecordBatch]:
        """Row group ``i`` of the index as record batches of ``batch_size`` rows (Arrow, not decoded).

        Decoding slice by slice needs scratch memory for one slice, not for the whole row group, and
        is faster (the slice's buffers stay in the CPU caches). ``fetched``: the row group's column
        chunks, fetched ahead (`chunk_ranges`, `shardkit.dataset.fetch`), read from memory. ``head=True``:
        only the first batches will be read (a remote file is read piece by piece, see `open_file`).
        """
        rg = self.row_groups[i]
        where = f"row group {rg.index} of {self.location.join(rg.file)!r}"
        names = list(columns) if columns is not None else None
        try:
            pf = self.open_file(rg.file, fetched, checked=(i, names), head=head)
        except CorruptDatasetError as e:
            raise CorruptDatasetError(f"{where} cannot be read: {e}") from e
        if VERIFY_PAGE_CHECKSUMS and self.location.is_local:
            started = time.thread_time() if _pages.CHECK_CLOCK else 0.0
            verified = self._verify_local(i, pf, names, where)
            if _pages.CHECK_CLOCK:
                self._checked(time.thread_time() - started)
            if not verified:
                # a page header shardkit's walk cannot read: pyarrow reads (and checks) it, and says why not
                pf = pq.ParquetFile(pf.shardkit_source, metadata=pf.metadata,  # type: ignore[attr-defined]
                                    page_checksum_verification=True)
        fetched_file = getattr(pf, "shardkit_fetched", None)
        try:
            batches = pf.iter_batches(batch_size=batch_size, row_groups=[self.row_group_index(i)],
                                      columns=names if self.snapshot is None else _present(pf, names),
                                      use_threads=False)
            if self.snapshot is None and not self.casts:
                yield from batches
            elif self.snapshot is None:
                yield from (self._cast(b, where) for b in batches)
            else:
                # most files of a table hold its columns as they are: their batches pass untouched
                tables = batches if self._fits(pf, names) else (
                    self._as_table_schema(b, names, where, rg.file) for b in batches)
                yield from tables if i not in self.kept else self._without_deleted(self.kept[i], tables)
        except (pa.ArrowInvalid, OSError) as e:
            if is_denied(e):
                raise permission_error(self.location, self.location.join(rg.file), e) from e
            if (changed := self.changed(rg.file)) is not None:
                raise changed from e
            if "checksum" in str(e).lower():
                raise _pages.checksum_error(where, self._damaged_pages(pf, i) or one_line(e)) from e
            raise _pages.unreadable_error(where, one_line(e)) from e
        finally:
            if fetched_file is not None:
                self._checked(fetched_file.checked_seconds)

    @property
    def checksum_seconds(self) -> float:
        """CPU seconds this process spent checking the page checksums of the row groups it read
        (`iter_row_group`: a local file's before decoding, fetched pages as they were decoded; the
        checking threads' CPU time, not their waits for bytes); `Reader.profile` shows them."""
        return self._checking[0]

    def _checked(self, seconds: float) -> None:
        with self._footer_lock:
            self._checking[0] += seconds

    def _verify_local(self, i: int, pf: pq.ParquetFile, names: list[str] | None, where: str) -> bool:
        """Check the page checksums of row group ``i``'s column chunks of ``names`` (None: all) in a local
        file, before pyarrow decodes them: ISA-L's CRC-32 over the file's memory mapping (no copy) is
        much faster than pyarrow's own check (`shardkit.dataset._pages.crc32`). False when a page
        header does not parse (a truncated or overwritten file): pyarrow's read then checks and names it.
        """
        from shardkit.dataset._pages import MISMATCH, check_row_group, ranges_of

        group = pf.metadata.row_group(self.row_group_index(i))
        # the mapping pyarrow decodes from (at offsets: the position is ours): pages faulted in once
        read = ranges_of(pf.shardkit_source)  # type: ignore[attr-defined]
        try:
            for column, report in check_row_group(read, group, columns=None if names is None else set(names)):
                problems = report.problems
                if problems and MISMATCH in problems[0]:
                    raise _pages.checksum_error(where, f"column {column!r}: {problems[0]}")
                if problems:
                    return False
        except (pa.ArrowInvalid, OSError) as e:
            if isinstance(e, CorruptDatasetError):
                raise
            if is_denied(e):
                raise permission_error(self.location, self.location.join(self.row_groups[i].file), e) from e
            raise _pages.unreadable_error(where, one_line(e)) from e
        return True

    def _damaged_pages(self, pf: pq.ParquetFile, i: int) -> str:
        """Which columns of row group ``i`` (of the index) fail their page checksums, and where: one
        more read of the row group's bytes, made only once a read has failed."""
        from shardkit.dataset._pages import check_row_group

        group = pf.metadata.row_group(self.row_group_index(i))
        try:
            with self.location.open_ranges(self.location.join(self.row_groups[i].file)) as f:
                found = [f"column {column!r}: {report.problems[0]}"
                         for column, report in check_row_group(f.read_at, group) if report.problems]
        except (OSError, pa.ArrowException):
            return ""
        return "; ".join(found)

    def saw_version(self, file: str, version: str | None) -> None:
        """Record ``file``'s version as a reader or a lookup first learned it (its cache key's): the version
        the reads of this process stand for. A later different version is not recorded: `changed`
        tells it."""
        if version is not None:
            with self._footer_lock:
                self._versions_seen.setdefault(file, version)

    def changed(self, file: str) -> DatasetChangedError | None:
        """`DatasetChangedError` when ``file``'s version now (one request, or a ``stat``) is not the one
        first recorded (`saw_version`), else None: asked when a read of the file fails, so that a file
        replaced under a running job is named as such, not as corrupt."""
        with self._footer_lock:
            seen = self._versions_seen.get(file)
        if seen is None:
            return None
        now = self.location.version(file)
        if now is None or now == seen:
            return None
        return DatasetChangedError(
            f"data file {self.location.join(file)!r} of dataset {self.url!r} was replaced after this process "
            f"first read it (its version was {seen}, it is now {now}): the row groups this dataset was "
            "opened with do not describe it any more, and nothing of it is read. Open the dataset again "
            "(a new reader or MapDataset) to read the new file; write a dataset's files anew under new "
            "names (write_dataset mode='overwrite' or 'append') instead of replacing them in place")

    def stored_as_is(self, name: str) -> bool:
        """Whether column ``name`` of this local dataset keeps its values as they are in its files
        (uncompressed, PLAIN, no dictionary, no levels: images written by shardkit), judged by the first
        row group: its values can then be read in place (`value_pages`)."""
        if not self.location.is_local or self.casts or self.snapshot is not None or not self.row_groups:
            return False
        try:
            return self._column_meta(0, name) is not None
        except (CorruptDatasetError, OSError):
            return False

    def _column_meta(self, i: int, name: str) -> pq.ColumnChunkMetaData | None:
        """Row group ``i``'s column chunk of ``name`` when its values are stored as they are, else None."""
        rg = self.row_groups[i]
        with self._footer_lock:
            footer = self.metadata if self.metadata is not None else self._footers.get(rg.file)
        if footer is None:
            footer = self.open_file(rg.file).metadata
        group = footer.row_group(self.row_group_index(i))
        for j in range(group.num_columns):
            column = group.column(j)
            if column.path_in_schema != name:
                continue
            leaf = footer.schema.column(j)
            if (column.compression != "UNCOMPRESSED" or column.has_dictionary_page
                    or leaf.max_definition_level or leaf.max_repetition_level
                    or leaf.physical_type != "BYTE_ARRAY"):
                return None
            return column
        return None

    def value_pages(self, i: int, name: str) -> tuple[str, _pages.PlainLayout] | None:
        """A local file's path, and where each value of column ``name`` in row group ``i`` lies in it, and
        each page with its checksum (`_pages.PlainLayout`), for a column stored as it is
        (`stored_as_is`); nothing is checked yet: `check_value_pages` checks the pages read. None when the
        values cannot be read in place: they are read through Parquet then."""
        if not self.location.is_local or self.kept.get(i) is not None or self.casts:
            return None
        rg = self.row_groups[i]
        column = self._column_meta(i, name)
        if column is None:
            return None
        path = os.path.abspath(self.location.join(rg.file))
        start, length = _pages.chunk_range(column)
        with self.mapped(i, path) as f:
            layout = _pages.plain_layout(_pages.ranges_of(f)(length, start), start)
        if layout is None or len(layout.starts) != rg.num_rows:
            return None
        return path, layout

    def check_value_pages(self, i: int, path: str, checks: _pages.PageChecks, offsets: np.ndarray) -> int:
        """Check the pages of row group ``i``'s local file ``path`` that hold the values at file ``offsets``
        and that ``checks`` (`page_checks`) has not checked yet (a mismatch: `CorruptDatasetError` naming
        the row group, the column and the page); returns how many were checked."""
        with self.mapped(i, path) as f:
            return checks.check(_pages.ranges_of(f), offsets)

    def page_checks(self, i: int, name: str, layout: _pages.PlainLayout) -> _pages.PageChecks:
        """The checks of the pages of `value_pages`' layout of column ``name`` in row group ``i``, made as
        its values are read (`PageChecks.check`), none made yet."""
        rg = self.row_groups[i]
        return _pages.PageChecks(f"row group {rg.index} of {self.location.join(rg.file)!r}", name,
                                 layout.bodies, layout.crcs)

    @contextlib.contextmanager
    def mapped(self, i: int, path: str) -> Iterator[pa.MemoryMappedFile]:
        """A memory map of row group ``i``'s local file ``path`` (`value_pages`' path); errors as a read's
        (`CorruptDatasetError`, `PermissionError`)."""
        rg = self.row_groups[i]
        where = f"row group {rg.index} of {self.location.join(rg.file)!r}"
        try:
            f = pa.memory_map(path)
        except OSError as e:  # (only the opening's: an error of the caller's reads is its own)
            if is_denied(e):
                raise permission_error(self.location, path, e) from e
            raise _pages.unreadable_error(where, one_line(e)) from e
        with f:
            yield f

    def deletions_tag(self, i: int) -> str:
        """A digest of the rows of row group ``i`` deleted by the table's log ('' when none are): what a
        cache key of the row group's rows needs besides its file's version (another version of the
        table may delete other rows of the same file)."""
        keep = self.kept.get(i)
        if keep is None:
            return ""
        return hashlib.sha256(np.packbits(keep).tobytes()).hexdigest()[:16]

    @staticmethod
    def _without_deleted(keep: np.ndarray, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        start = 0
        for batch in batches:
            mask = keep[start:start + batch.num_rows]
            start += batch.num_rows
            if mask.all():
                yield batch
            elif mask.any():
                yield batch.filter(pa.array(mask))

    def _cast(self, batch: pa.RecordBatch, where: str) -> pa.RecordBatch:
        """``batch`` with the hinted columns cast (`casts`)."""
        arrays = [self._cast_column(c, self.casts[f.name], f.name, where) if f.name in self.casts else c
                  for f, c in zip(batch.schema, batch.columns, strict=True)]
        schema = pa.schema([pa.field(f.name, self.casts.get(f.name, f.type), nullable=f.nullable)
                            for f in batch.schema])
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def _cast_column(self, column: pa.Array, target: pa.DataType, name: str, where: str) -> pa.Array:
        try:
            return column.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            hinted = f" (the schema= hint of {name!r})" if name in self.casts else ""
            raise SchemaMismatchError(
                f"column {name!r} of {where} cannot be read as {target}{hinted}: {one_line(e)}. A row of "
                "another length or type than the field says: fix the hint's shape, or the data"
            ) from e

    def _fits(self, pf: pq.ParquetFile, names: list[str] | None) -> bool:
        """Whether the file's columns ``names`` (None: all of the table's) are the table's, in its
        order and types, so that its batches need no change."""
        wanted = names if names is not None else self.arrow_schema.names
        stored = pf.schema_arrow
        if [n for n in stored.names if n in set(wanted)] != list(wanted):
            return False
        for name in wanted:
            k = stored.get_field_index(name)
            if k < 0 or stored.field(k).type != self.arrow_schema.field(name).type:
                return False
        return True

    def _as_table_schema(self, batch: pa.RecordBatch, names: list[str] | None, where: str,
                         file: str) -> pa.RecordBatch:
        """A batch of a table's data file in the table's schema: a column the table keeps in its log
        (`constants`) holds the file's value, the columns a file written before they were added (schema
        evolution) lacks are nulls, and types widened since are cast."""
        wanted = names if names is not None else self.arrow_schema.names
        constants = self.constants.get(file, {})
        arrays = []
        for name in wanted:
            target = self.arrow_schema.field(name).type
            k = batch.schema.get_field_index(name)
            if k < 0:
                nulls = pa.nulls(batch.num_rows, target)
                value = constants.get(name)
                arrays.append(nulls if value is None else nulls.fill_null(pa.scalar(value, target)))
                continue
            column = batch.column(k)
            arrays.append(column if column.type == target else self._cast_column(column, target, name, where))
        schema = pa.schema([self.arrow_schema.field(n) for n in wanted])
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def note_once(self, key: str, message: str) -> None:
        """Log ``message`` on the ``shardkit.dataset`` logger (INFO) the first time ``key`` is noted for
        this opened dataset (each `take` makes a `RowAccess` of its own: a note per call would repeat)."""
        with self._footer_lock:
            if key in self._noted:
                return
            self._noted.add(key)
        logging.getLogger("shardkit.dataset").info("%s", message)

    def read_rows(self, i: int, columns: Sequence[str], wanted: np.ndarray, *,
                  whole: Callable[[list[str]], pa.Table] | None = None,
                  kept: KeptRows | None = None) -> tuple[pa.Table, int] | None:
        """Rows ``wanted`` (sorted, distinct positions) of row group ``i`` of ``columns``, reading only the
        pages that hold them (Parquet's offset index; a field whose pages are mostly needed read whole, by
        ``whole(fields)`` where given; from a store, the ranges ``kept`` holds not fetched again), and how
        many pages that read; None where the file has no page index, or the dataset is a table or read
        through hints (`_page_reads.read_rows`)."""
        from shardkit.dataset._page_reads import read_rows

        return read_rows(self, i, columns, wanted, whole=whole, kept=kept)

    def page_footer(self, file: str) -> tuple[Any, list[str]]:
        """``file``'s footer (the summary's, where there is one) parsed for page reads
        (`_page_reads.Footer`), and the field each of its leaf columns belongs to; kept (LRU)."""
        from shardkit.dataset._page_reads import Footer

        key = "" if self.metadata is not None else file
        with self._footer_lock:
            found = self._page_footers.get(key)
            if found is not None:
                self._page_footers.move_to_end(key)
                return found
            metadata = self.metadata if self.metadata is not None else self._footers.get(file)
        if metadata is None:
            metadata = self.open_file(file).metadata
        out = io.BytesIO()
        metadata.write_metadata_file(out)  # (the footer's Thrift bytes again: PAR1, footer, length, PAR1)
        leaves = [metadata.schema.column(j).path.split(".", 1)[0] for j in range(metadata.num_columns)]
        found = (Footer.parse(out.getvalue()[4:-8]), leaves)
        with self._footer_lock:
            self._page_footers[key] = found
            while len(self._page_footers) > FOOTERS_KEPT:
                self._page_footers.popitem(last=False)
        return found

    def read_ranges(self, file: str, ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """The bytes ``(start, end)`` of each of ``ranges`` of data file ``file``: of a local file, views
        of its memory map (no copy; unmapped once they are dropped); from an object store, concurrent
        range requests (one per range). A request that fails is named as a read's (`request_error`,
        `permission_error`)."""
        path = self.location.join(file)
        try:
            if self.location.is_local:
                mapped = pa.memory_map(path)
                out = []
                for start, end in ranges:
                    mapped.seek(start)
                    out.append(mapped.read_buffer(end - start))
                return out
            got = self.location.fs.cat_ranges([path] * len(ranges), [s for s, _ in ranges],
                                              [e for _, e in ranges])
        except Exception as e:
            if is_denied(e):
                raise permission_error(self.location, path, e) from e
            error = request_error(self.url, path, e)
            if error is not None:
                raise error from e
            raise
        for blob, (start, end) in zip(got, ranges, strict=True):
            if isinstance(blob, BaseException):
                error = request_error(self.url, path, blob)
                raise (error or blob) from blob
            if len(blob) > end - start:  # the whole file: the server ignored the range
                raise no_ranges_error(self.url, path)
        return list(got)

    def read_row_group(self, i: int, columns: Sequence[str] | None = None) -> pa.Table:
        """Read row group ``i`` of the index (Arrow, not decoded): a table of `SLICE_ROWS`-row chunks."""
        return self.table_of(list(self.iter_row_group(i, columns)), columns)

    def table_of(self, batches: Sequence[pa.RecordBatch], columns: Sequence[str] | None = None) -> pa.Table:
        """Batches of ``columns`` (None: all) as one table, no copy; an empty table when there are none."""
        if batches:
            return pa.Table.from_batches(batches)
        names = list(columns) if columns is not None else self.arrow_schema.names
        schema = pa.schema([self.arrow_schema.field(n) for n in names], metadata=self.arrow_schema.metadata)
        return schema.empty_table()

    def decoded_row_bytes(self, columns: Sequence[str] | None = None) -> int:
        """About how many bytes one row of ``columns`` takes decoded (what a shuffle buffer holds).

        Fixed-shape numeric fields (images included) count their dtype's size times their shape;
        strings, bytes and variable shapes count their uncompressed Parquet bytes per row in the first
        row group with rows (at least 8 bytes: the pointer of an object array).
        """
        names = list(columns) if columns is not None else self.schema.names
        fixed, variable = 0, []
        for name in names:
            field = self.schema[name]
            if field.fixed_shape and field.dtype.kind in "biuf":
                fixed += field.dtype.itemsize * int(np.prod([d or 1 for d in field.shape]))
            else:
                variable.append(name)
        return fixed + sum(max(8, b) for b in self._plain_bytes_per_row(variable).values())

    def encoded_row_bytes(self, columns: Sequence[str]) -> int:
        """About how many bytes one row of ``columns`` takes as stored, uncompressed (an image: its JPEG
        or PNG bytes), from the first row group with rows."""
        return sum(self._plain_bytes_per_row(list(columns)).values())

    def _plain_bytes_per_row(self, names: Sequence[str]) -> dict[str, int]:
        out = dict.fromkeys(names, 0)
        k, rg = next(((k, rg) for k, rg in enumerate(self.row_groups) if rg.num_rows), (0, None))
        if not names or rg is None:
            return out
        if self.metadata is not None:  # the summary holds every row group: no data file is opened
            meta = self.metadata.row_group(k)
        else:
            try:
                footer = self._footers.get(rg.file) or self.open_file(rg.file).metadata
            except CorruptDatasetError:
                return out  # the read itself reports it, naming the row group
            meta = footer.row_group(rg.index)
        for j in range(meta.num_columns):
            col = meta.column(j)
            top = col.path_in_schema.split(".", 1)[0]
            if top in out:
                out[top] += col.total_uncompressed_size // max(1, rg.num_rows)
        return out

    def decode(self, table: pa.Table | pa.RecordBatch) -> dict[str, np.ndarray]:
        """Decode an Arrow table of this dataset's columns to numpy."""
        return self.schema.decode(table)


def _present(pf: pq.ParquetFile, names: list[str] | None) -> list[str] | None:
    """The columns of ``names`` (None: all) that the file ``pf`` has."""
    if names is None:
        return None
    have = set(pf.schema_arrow.names)
    return [n for n in names if n in have]


def partition_keys(files: Iterable[str]) -> list[str]:
    """The Hive partition keys in the folders of ``files`` (relative paths), in order of appearance:
    ``["year", "month"]`` for ``year=2020/month=1/part-0.parquet``."""
    keys: dict[str, None] = {}
    for name in files:
        for folder in name.split("/")[:-1]:
            match = _PARTITION.fullmatch(folder)
            if match:
                keys.setdefault(match.group(1), None)
    return list(keys)
