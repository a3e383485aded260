"""`write_dataset`: pandas, Arrow, columns or rows -> a schema-extended Parquet dataset, atomically.

Input is consumed as a stream of batches, encoded by the schema's codecs, cut into row groups by
encoded bytes (and optionally rows), rolled into part files, and committed as described in
`shardkit.dataset.write.commit`. What a write checks at its destination first (and removes when it fails)
is `shardkit.dataset.write._target`; `write_summary` (`shardkit.dataset.write._summary`) is importable from
here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from shardkit._storage.access import root_exists, storage_errors
from shardkit._storage.location import STAGING, Location
from shardkit.dataset._dataset import Dataset
from shardkit.dataset._field import Field
from shardkit.dataset._footers import data_files
from shardkit.dataset._pages import ChecksumSink
from shardkit.dataset.codecs import TensorCodec
from shardkit.dataset.open import open_location
from shardkit.dataset.schema import Schema, infer_field
from shardkit.dataset.write._sources import is_row, iter_batches, whole_columns
from shardkit.dataset.write._summary import write_summary
from shardkit.dataset.write._target import (
    PART_NAME,
    Mode,
    check_bucket,
    check_existing,
    check_writable,
    discard_staging,
    resolve_target,
    unfinished_write,
)
from shardkit.dataset.write.commit import commit, overlap_error, write_lock, write_refusals
from shardkit.errors import (
    DatasetPermissionError,
    SchemaError,
    SchemaMismatchError,
    StorageFullError,
    interrupt_behind,
)

__all__ = [
    "AUTO_CODEC",
    "AUTO_MIN_SAVING",
    "AUTO_SAMPLE_BYTES",
    "EncodedTables",
    "Mode",
    "PAGE_BYTES",
    "PART_NAME",
    "PartWriter",
    "check_bucket",
    "check_compression",
    "check_existing",
    "check_writable",
    "column_codecs",
    "discard_staging",
    "infer_schema",
    "page_rows",
    "parse_size",
    "resolve_target",
    "unfinished_write",
    "write_dataset",
    "write_summary",
]

AUTO_CODEC = "snappy"  # compression="auto": this codec, except where it barely shrinks a binary column
AUTO_MIN_SAVING = 0.10  # ... i.e. saves less than this fraction of the sample
AUTO_SAMPLE_BYTES = 4 << 20  # bytes of a column's first row group compressed to decide
_AUTO_PIECE = 1 << 20  # compressed piece by piece, about as Parquet pages are
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(value: int | str, *, what: str) -> int:
    """``"64MiB"`` -> 67108864; an int is returned as is."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise SchemaError(f"{what}={value!r} is not a size; use a positive number of bytes or e.g. '64MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _small_int_leaves(schema: Schema) -> list[str]:
    """Parquet leaf paths of list-stored tensors of 1- and 2-byte integers: they get a dictionary.

    Parquet stores list elements of such types as INT32 with no 1-byte physical type; a dictionary
    page turns them back into a few bits per value (on small-integer images it halves the file and
    speeds up reads). Floats gain nothing from a dictionary, and it stays off for them, as for tensors
    in the bytes layout (one value per row).
    """
    leaves = []
    for f in schema:
        if f.dtype.kind not in "iu" or f.dtype.itemsize > 2:
            continue
        listed = isinstance(f.codec, TensorCodec) and f.codec.storage == "list"
        if listed or (f.codec.name == "ndarray" and len(f.shape) == 1):
            leaves.append(f"{f.name}.list.element")
        elif f.codec.name == "ndarray":
            leaves.append(f"{f.name}.data.list.element")
    return leaves


@dataclasses.dataclass(frozen=True)
class EncodedTables:
    """Data for `write_dataset` that is encoded already: tables of the schema's `Schema.arrow_schema` (what
    `Schema.encode` returns), written as they are; ``schema=`` must be given. `shardkit.dataset.convert`
    passes them, as it copies encoded images byte for byte, which no codec's ``encode`` of pixels does."""

    tables: Iterable[pa.Table]
    num_rows: int | None = None  # for the progress bar, when known


#: Every page written carries Parquet's page checksum (CRC-32 of its bytes), which every read verifies
#: (`shardkit.dataset._dataset.VERIFY_PAGE_CHECKSUMS`). Off only to measure what it costs
#: (``benchmarks.write``). pyarrow writes the pages without one, and `ChecksumSink` adds them on their
#: way to the file: the same bytes as pyarrow's ``write_page_checksum=True``, its CRC-32 several times
#: slower than ISA-L's (`shardkit.dataset._pages.crc32`).
PAGE_CHECKSUMS = True

#: The bytes a data page holds, about: pyarrow's default (``data_page_size``). pyarrow ends a page only
#: between its write batches (1,024 rows by default), so a column of large values (images, tensors in the
#: bytes layout) would get pages of 1,024 values, tens of MB each; `PartWriter` writes batches of as many
#: rows as fill a page of the widest column. A page is what a lookup (`Dataset.take`) or a batch of images
#: read in place reads and checks: small ones keep a lookup and a first batch short.
PAGE_BYTES = 1 << 20


class PartWriter:
    """Rolls encoded tables into row groups and part files under the staging folder."""

    def __init__(self, loc: Location, staging: str, schema: Schema, *, rg_bytes: int, rg_rows: int | None,
                 file_bytes: int, compression: str) -> None:
        self.loc, self.staging, self.schema = loc, staging, schema
        self.arrow_schema = schema.storage_schema()
        self.rg_bytes, self.rg_rows, self.file_bytes = rg_bytes, rg_rows, file_bytes
        # "auto" (any case, as check_compression takes it): decided at the first row group
        self._codecs: str | dict[str, str] | None = None if compression.lower() == "auto" else compression
        scalars = [f.name for f in schema if f.codec.name == "scalar"]
        self.options = {"use_dictionary": scalars + _small_int_leaves(schema), "write_statistics": scalars,
                        "write_page_checksum": False, "write_page_index": True}
        self.checksums = PAGE_CHECKSUMS
        self.pending: list[pa.Table] = []
        self.pending_rows = self.pending_bytes = 0
        self.writer: pq.ParquetWriter | None = None
        self.sink: Any = None
        self.path = ""
        self.file_written = 0
        self.done: list[tuple[str, pq.FileMetaData]] = []

    def add(self, table: pa.Table) -> None:
        """Add an encoded table (`Schema.encode`); it is written in the schema's stored layout."""
        table = self.schema.to_storage(table)
        self.pending.append(table)
        self.pending_rows += table.num_rows
        self.pending_bytes += table.nbytes
        while self.pending_rows and (
            self.pending_bytes >= self.rg_bytes or (self.rg_rows and self.pending_rows >= self.rg_rows)
        ):
            self._flush_group(final=False)

    def _flush_group(self, *, final: bool) -> None:
        table = pa.concat_tables(self.pending)
        per_row = max(1.0, table.nbytes / max(1, table.num_rows))
        n = table.num_rows if final else min(table.num_rows, max(1, int(self.rg_bytes / per_row)))
        if self.rg_rows:
            n = min(n, self.rg_rows)
        group, rest = table.slice(0, n), table.slice(n)
        self._writer(group).write_table(group, row_group_size=max(1, n))
        self.file_written += group.nbytes
        self.pending = [rest] if rest.num_rows else []
        self.pending_rows, self.pending_bytes = rest.num_rows, rest.nbytes
        if self.file_written >= self.file_bytes:
            self._close_file()

    def _writer(self, first: pa.Table | None = None) -> pq.ParquetWriter:
        if self.writer is None:
            if self._codecs is None:  # "auto": decided from the first row group, kept for every file
                self._codecs = column_codecs(first, self.arrow_schema) if first is not None else AUTO_CODEC
            if first is not None and "write_batch_size" not in self.options:  # kept for every file
                self.options.update(data_page_size=PAGE_BYTES, write_batch_size=page_rows(first))
            self.path = f"{self.staging}/part-{uuid.uuid4().hex[:12]}-{len(self.done):05d}.parquet"
            self.sink = self.loc.fs.open(self.path, "wb")
            if self.checksums:
                self.sink = ChecksumSink(self.sink)
            self.writer = pq.ParquetWriter(self.sink, self.arrow_schema, compression=self._codecs,
                                           **self.options)
        return self.writer

    def _close_file(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.sink.close()
            # the footer written (offsets moved by the checksums added), not the one pyarrow counted
            footer = self.sink.metadata if isinstance(self.sink, ChecksumSink) else None
            self.done.append((self.path, footer or self.writer.writer.metadata))
            self.writer, self.file_written = None, 0

    def finish(self) -> list[tuple[str, pq.FileMetaData]]:
        while self.pending_rows:
            self._flush_group(final=True)
        if not self.done and self.writer is None:
            self._writer()  # an empty dataset still gets one (empty) file that carries the schema
        self._close_file()
        return self.done

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            if self.writer is not None:
                self.writer.close()
                self.sink.close()
        with contextlib.suppress(FileNotFoundError):
            self.loc.fs.rm(self.staging, recursive=True)


def _storage_full(loc: Location, staging: str, error: BaseException) -> StorageFullError | None:
    """The error to raise when ``error`` says the storage is full (``ENOSPC``, or a quota's ``EDQUOT``),
    naming what this write had staged and the space left; None for any other error."""
    if not isinstance(error, OSError) or error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    staged = 0
    with contextlib.suppress(OSError):
        staged = int(loc.fs.du(staging))
    left = ""
    if loc.is_local:
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(loc.root if os.path.exists(loc.root) else os.path.dirname(loc.root))
            left = f", {usage.free:,} bytes are left of {usage.total:,}"
    return StorageFullError(
        error.errno, f"the storage of {loc.url!r} is full ({os.strerror(error.errno or 0)}): this write had "
        f"staged {staged:,} bytes when it was refused more{left}. Nothing of it was committed and the "
        "dataset there (if any) is unchanged. Free space there (or raise the quota), or write to a "
        "store with room for the dataset, and run the write again")


def _append_mismatch(url: str, schema: Schema, problem: str, offset: int) -> SchemaMismatchError:
    """An append's mismatch, with the fixes an append can take (its schema is the dataset's)."""
    fields = ", ".join(f"{f.name}: {f.dtype_name}{list(f.shape) if f.shape else ''}" for f in schema)
    where = f"in the batch that starts at input row {offset}: " if offset else ""
    return SchemaMismatchError(
        f"cannot append to {url!r}: {where}{problem}; an append keeps the dataset's schema ({fields}), so "
        "cast the new data to it (drop the columns it does not have, convert the dtypes, e.g. "
        "df.astype({...})), or write every row again with the new columns or dtypes: mode='overwrite' "
        "(or a new URL)", problem=problem)


def _require_fields(schema: Schema | None, url: str) -> None:
    """A dataset without a field is refused, as `shardkit write` refuses input without a column."""
    if schema is not None and len(schema) == 0:
        raise SchemaError(f"cannot write {url!r}: the data has no columns (and so the dataset no fields), so "
                          "there is nothing to write; pass data with at least one column (a DataFrame "
                          "with columns, {'id': [...]}) or a schema with at least one field")


def write_dataset(
    data: Any,
    url: str | os.PathLike[str],
    *,
    schema: Schema | list[Field] | None = None,
    mode: Mode = "error",
    row_group_size: int | str = "16MiB",
    file_size: int | str = "128MiB",
    compression: str = "auto",
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Dataset:
    """Write ``data`` as a shardkit dataset at ``url`` and return it opened.

    Example:
        >>> schema = shardkit.Schema([
        ...     shardkit.Field("id", "int64"),
        ...     shardkit.Field("image", "uint8", (28, 28), codec=shardkit.ImageCodec("png")),
        ... ])
        >>> shardkit.write_dataset(df, "s3://bucket/mnist", schema=schema, mode="overwrite")

    Args:
        data: a pandas DataFrame, an Arrow Table or RecordBatch, a mapping of column -> values, or an
            iterable (streamed: only one row group is held in memory) of DataFrames, Arrow tables or
            record batches, mappings of column -> Arrow or numpy array (batches, as a reader yields
            them: ``write_dataset(iter(reader), url, schema=reader.schema)``), or row dicts. A mapping
            of numpy arrays with one first dimension could be a row of tensors or a batch: the schema
            decides, and without one it is refused (`shardkit.dataset.write._sources.item_kind`).
            An image field's values are pixels (uint8 arrays), or PNG/JPEG images as ``bytes`` (or an
            Arrow binary column), stored as they are once their headers fit the field
            (`shardkit.dataset.codecs.image.ImageCodec.encode`).
        url: a folder on any fsspec filesystem.
        schema: the fields; when omitted, inferred from the whole input if it is in memory (a
            DataFrame, table or dict of columns), else from its first batch (images must be declared).
            With ``mode="append"`` it defaults to the existing dataset's schema.
        mode: ``"error"`` refuses an existing dataset, ``"overwrite"`` replaces it (the old one stays
            readable until the new one commits), ``"append"`` adds row groups to it.
        row_group_size: encoded bytes per row group (``"16MiB"``), or an int number of rows.
        file_size: encoded bytes per part file before a new one starts.
        compression: ``"auto"``: snappy, but binary columns (tensors, images, bytes) that snappy shrinks
            by less than 10% in the first row group are written uncompressed (`column_codecs`:
            reading them then skips a copy); or a Parquet codec for every column (``"snappy"``,
            ``"zstd"``, ``"lz4"``, ``"none"``).
        progress: show a progress bar with rows/s; default: when stderr is a terminal.

    Raises:
        DatasetExistsError: ``mode="error"`` and a dataset exists at ``url``.
        DatasetNotFoundError: ``url`` is on an object store whose bucket does not exist (shardkit never
            creates buckets).
        NotADatasetError: ``url`` is a file.
        DatasetPermissionError: the store refuses these credentials (a key it does not know, one that
            may not look at ``url``, or one that may read but not write there): the message names the
            URL and what they need, before any input is consumed (`shardkit._storage.access.root_exists`,
            `shardkit.dataset.write._target.check_writable`).
        SchemaMismatchError: the data does not fit the schema; nothing is written.
        DatasetError: another write to ``url`` overlapped this one (see `shardkit.dataset.write.commit` for
            what is guaranteed where); this one committed nothing.
    """
    if mode not in ("error", "overwrite", "append"):
        raise SchemaError(f"mode={mode!r} is not one of 'error', 'overwrite', 'append'")
    rg_rows: int | None = None
    if isinstance(row_group_size, int) and not isinstance(row_group_size, bool):
        rg_rows = row_group_size
    if rg_rows is not None and rg_rows <= 0:
        raise SchemaError(f"row_group_size={row_group_size!r} must be positive")
    rg_bytes = 1 << 62 if rg_rows else parse_size(row_group_size, what="row_group_size")
    file_bytes = parse_size(file_size, what="file_size")
    check_compression(compression)
    loc = Location.of(url, storage_options)
    root_existed = root_exists(loc, action="write to")  # the first request: refused credentials named there
    with storage_errors(loc.url):
        if not root_existed:
            check_bucket(loc)
        check_writable(loc)  # credentials that may read but not write: refused here, not at the first part
    with write_lock(loc):
        existing, schema = resolve_target(loc, mode, schema)
        if schema is None and isinstance(data, EncodedTables):  # encoded columns tell no field's codec
            raise SchemaError("EncodedTables need schema=..., the schema their tables were encoded for")
        replaced = data_files(loc) if mode == "overwrite" and root_existed else []
        if schema is None and (whole := whole_columns(data)) is not None:
            schema = infer_schema(whole)
        _require_fields(schema, loc.url)
        staging = loc.join(STAGING, uuid.uuid4().hex)
        loc.makedirs(staging)  # none on object stores, where it would create a missing bucket
        parts: PartWriter | None = None
        bar = _progress_bar(data, progress)
        try:
            offset = 0
            encoded = isinstance(data, EncodedTables)
            batches = ((t, t.num_rows) for t in data.tables) if encoded else iter_batches(data, schema)
            for columns, n in batches:
                if schema is None:
                    schema = infer_schema(columns)
                    _require_fields(schema, loc.url)
                if parts is None:
                    parts = PartWriter(loc, staging, schema, rg_bytes=rg_bytes, rg_rows=rg_rows,
                                       file_bytes=file_bytes, compression=compression)
                try:
                    table = columns if encoded else schema.encode(columns, n)
                except SchemaMismatchError as e:
                    if existing is not None and mode == "append" and e.problem:
                        raise _append_mismatch(loc.url, schema, e.problem, offset) from e
                    if not offset:
                        raise
                    raise SchemaMismatchError(f"in the batch that starts at input row {offset}: {e}") from e
                with write_refusals(loc):
                    parts.add(table)
                offset += n
                if bar is not None:
                    bar.update(n)
            if parts is None:
                if schema is None:
                    raise SchemaError("the data has no rows and no schema was given; pass schema=...")
                parts = PartWriter(loc, staging, schema, rg_bytes=rg_bytes, rg_rows=rg_rows,
                                   file_bytes=file_bytes, compression=compression)
            with write_refusals(loc):
                staged = parts.finish()
        except BaseException as e:
            full = _storage_full(loc, staging, e)
            if parts is not None:
                parts.abort()
            discard_staging(loc, created_root=not root_existed)
            if full is not None:
                raise full from e
            if isinstance(e, FileNotFoundError) and staging in str(e):  # not one of the input's own
                raise overlap_error(loc, "its staging folder was removed") from e
            if (interrupt := interrupt_behind(e)) is not None:
                raise interrupt from e
            raise
        finally:
            if bar is not None:
                bar.close()
        keep = [existing.metadata] if existing is not None and existing.metadata is not None else []
        keep_files = existing.files if existing is not None else []
        try:
            commit(loc, parts.arrow_schema, staged, keep=keep, keep_files=keep_files, replace=replaced)
        except DatasetPermissionError:
            with contextlib.suppress(OSError):  # what a refused delete leaves, the next write collects
                discard_staging(loc, created_root=not root_existed)
            raise
    return open_location(loc)


def page_rows(table: pa.Table) -> int:
    """The rows of a write batch (``write_batch_size``) that fill `PAGE_BYTES` of ``table``'s widest column,
    so that its pages end after one batch: from 1 (values of a page each or more) to pyarrow's 1,024
    (columns of numbers)."""
    widest = max((column.nbytes for column in table.columns), default=0) / max(1, table.num_rows)
    return int(min(1024, max(1, -(-PAGE_BYTES // max(1, int(widest))))))  # pyarrow ends a page at >= its size


def column_codecs(table: pa.Table, arrow_schema: pa.Schema) -> dict[str, str]:
    """``compression="auto"``: the codec of each Parquet leaf column of ``arrow_schema``.

    `AUTO_CODEC`, except for binary columns (tensors in the bytes layout, encoded images, bytes) in
    which it saves less than `AUTO_MIN_SAVING` of a sample of ``table`` (up to `AUTO_SAMPLE_BYTES`,
    compressed in 1 MiB pieces): those are written uncompressed. Reading a compressed page costs a
    decompression into a fresh buffer (one more copy of every byte) to save almost nothing; PNG/JPEG
    and noisy tensors do not shrink.
    """
    sink = pa.BufferOutputStream()
    pq.write_metadata(arrow_schema, sink)
    parquet_schema = pq.read_metadata(pa.BufferReader(sink.getvalue())).schema
    plain = {name for name in table.column_names if _barely_shrinks(table.column(name))}
    paths = [parquet_schema.column(i).path for i in range(len(parquet_schema))]
    return {path: "none" if path.split(".")[0] in plain else AUTO_CODEC for path in paths}


def _barely_shrinks(column: pa.ChunkedArray) -> bool:
    kind = column.type.storage_type if isinstance(column.type, pa.ExtensionType) else column.type
    if not any(is_kind(kind) for is_kind in (pa.types.is_binary, pa.types.is_large_binary,
                                             pa.types.is_fixed_size_binary)):
        return False
    raw = packed = 0
    for chunk in column.chunks:
        data = chunk.buffers()[-1]
        for start in range(0, 0 if data is None else data.size, _AUTO_PIECE):
            if raw >= AUTO_SAMPLE_BYTES:
                break
            piece = data.slice(start, min(_AUTO_PIECE, data.size - start, AUTO_SAMPLE_BYTES - raw))
            raw += piece.size
            packed += pa.compress(piece, codec=AUTO_CODEC, asbytes=False).size
    return raw > 0 and packed > (1 - AUTO_MIN_SAVING) * raw


def check_compression(compression: str) -> None:
    """Raise `SchemaError` unless ``compression`` is ``"auto"`` or names a Parquet codec this pyarrow has."""
    if isinstance(compression, str) and compression.lower() in ("none", "auto"):
        return
    try:
        ok = isinstance(compression, str) and pa.Codec.is_available(compression)
    except ValueError:
        ok = False
    if not ok:
        raise SchemaError(
            f"compression={compression!r} is not a Parquet codec available here; use 'auto', 'snappy', "
            "'zstd', 'lz4', 'gzip', 'brotli' or 'none'"
        )


def infer_schema(columns: Mapping[str, Any]) -> Schema:
    """A schema inferred from columns of data (see `shardkit.dataset.schema.infer_field`)."""
    return Schema([infer_field(name, values) for name, values in columns.items()])


def _progress_bar(data: Any, progress: bool | None) -> Any:
    show = sys.stderr.isatty() if progress is None else progress
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=_num_rows(data), unit=" rows", unit_scale=True, desc="write_dataset",
                dynamic_ncols=True)


def _num_rows(data: Any) -> int | None:
    """The number of input rows when it is known up front (not for streams or lists of batches)."""
    if isinstance(data, pa.Table | pa.RecordBatch | EncodedTables):
        return data.num_rows
    whole = whole_columns(data)
    if whole is not None:
        return len(data) if hasattr(data, "columns") else len(next(iter(whole.values()), ()))
    if isinstance(data, list | tuple) and data and is_row(data[0]):
        return len(data)
    return None
