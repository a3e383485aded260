"""`open_dataset`: a dataset's schema and row-group index, from its summary files when it has them.

Three kinds of folders open:

- a shardkit dataset: ``_metadata`` holds the schema and every row group of every file, so opening
  reads one file, however many data files there are;
- a Petastorm dataset: the schema comes from the (never executed) pickle in ``_common_metadata``, the
  row groups from the data files' footers;
- a plain Parquet folder (Spark, pandas, DuckDB): schema inferred from the Arrow types, row groups
  from the footers, with a `SummaryMissingWarning` that says how to add the summary.

Hive-partitioned folders (Spark's ``partitionBy``, pandas' ``partition_cols``:
``year=2020/part-0.parquet``) open with the columns their files hold; the partition columns, which
live only in the folder names, are not columns of the batches, though a reader's ``filter`` may name
them (`shardkit.reader.filter.Partitions`). Opening one warns once, with a `PartitionColumnsWarning`
that names those keys and the fix: rewrite the data with
``shardkit.write_dataset(pyarrow.dataset.dataset(path, partitioning="hive").to_table(), url)``,
which stores them as columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.dataset.access import is_denied, permission_error, root_exists, storage_errors
from shardkit.dataset.footers import (
    Footers,
    RowGroup,
    data_files,
    read_footer,
    read_footers,
    summary_row_groups,
)
from shardkit.dataset.footers import summary as _summary
from shardkit.dataset.location import COMMON, SUMMARY, Location
from shardkit.dataset.schema import SCHEMA_KEY, Schema, field_from_arrow, schema_from_arrow
from shardkit.errors import (
    ColumnsLeftOutWarning,
    CorruptDatasetError,
    DatasetNotFoundError,
    NotADatasetError,
    PartitionColumnsWarning,
    SchemaError,
    one_line,
)

PETASTORM_KEY = b"dataset-toolkit.unischema.v1"
#: Rows Parquet decodes at a time. A whole row group at once needs several times its decoded size in
#: scratch buffers (uint8 tensors go through int32 values plus repetition and definition levels), and
#: small slices decode faster (measured on the benchmark rows: 256 rows 14 % less CPU than 1024, which
#: took 30 % less than whole 4,600-row groups) as their scratch buffers stay in the CPU caches.
SLICE_ROWS = 256
FOOTERS_KEPT = 256  # data-file footers an opened dataset keeps (LRU), so a file's footer is read once
_PARTITION = re.compile(r"([^=/]+)=[^/]*")  # a Hive partition folder: key=value


class SummaryMissingWarning(UserWarning):
    """A dataset without ``_metadata`` was opened by reading every file's footer (slower)."""


class UncommittedFilesWarning(UserWarning):
    """`write_summary` of a shardkit dataset left out data files its ``_metadata`` did not list (the
    parts of a write that did not commit)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """An opened dataset: schema plus row-group index. Create with `open_dataset`."""

    location: Location
    schema: Schema
    arrow_schema: pa.Schema
    row_groups: tuple[RowGroup, ...]
    kind: Literal["shardkit", "petastorm", "parquet"]
    metadata: pq.FileMetaData | None = dataclasses.field(default=None, repr=False)
    _footers: OrderedDict[str, pq.FileMetaData] = dataclasses.field(
        default_factory=OrderedDict, init=False, repr=False, compare=False)
    _footer_lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, init=False, repr=False, compare=False)
    #: columns of a plain Parquet dataset left out of the schema: name -> why, and the cast that helps
    left_out: dict[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def url(self) -> str:
        return self.location.url

    @cached_property
    def files(self) -> list[str]:
        return list(dict.fromkeys(rg.file for rg in self.row_groups))

    @cached_property
    def partition_keys(self) -> list[str]:
        """Hive partition keys in the folders of the files (``year`` of ``year=2020/``) that are not
        columns of the dataset: their values are in folder names only, and not read (module docstring)."""
        return [key for key in partition_keys(self.files) if key not in self.schema.names]

    @property
    def num_rows(self) -> int:
        return sum(rg.num_rows for rg in self.row_groups)

    @property
    def num_bytes(self) -> int:
        return sum(rg.num_bytes for rg in self.row_groups)

    @cached_property
    def rows_per_group(self) -> np.ndarray:
        """Row counts of the row groups as an int64 array (what planning works on)."""
        counts = (rg.num_rows for rg in self.row_groups)
        return np.fromiter(counts, dtype=np.int64, count=len(self.row_groups))

    def open_file(self, file: str) -> pq.ParquetFile:
        """Open one data file, raising `CorruptDatasetError` (naming it) if it is not readable Parquet,
        `DatasetPermissionError` if this user may not read it (never taken for corruption).

        With a ``_metadata`` summary the file is opened with it, not with its own footer (one request
        less per file, on object stores one round trip less before the first batch): the summary holds
        every row group's column chunks, so its row group ``k`` is ``row_groups[k]``, read from this file
        (see `row_group_index`). Without one, the file's footer is read on its first opening and then
        reused (for the last `FOOTERS_KEPT` files).
        """
        path = self.location.join(file)
        with self._footer_lock:
            footer = self.metadata if self.metadata is not None else self._footers.get(file)
            if footer is not None and self.metadata is None:
                self._footers.move_to_end(file)
        try:
            pf = pq.ParquetFile(self.location.open_ranges(path), metadata=footer,
                                pre_buffer=not self.location.is_local)
        except FileNotFoundError as e:
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
        return pf

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
                       batch_size: int = SLICE_ROWS) -> Iterator[pa.RecordBatch]:
        """Row group ``i`` of the index as record batches of ``batch_size`` rows (Arrow, not decoded).

        Decoding slice by slice needs scratch memory for one slice, not for the whole row group, and
        is faster (the slice's buffers stay in the CPU caches).
        """
        rg = self.row_groups[i]
        where = f"row group {rg.index} of {self.location.join(rg.file)!r}"
        try:
            pf = self.open_file(rg.file)
        except CorruptDatasetError as e:
            raise CorruptDatasetError(f"{where} cannot be read: {e}") from e
        names = list(columns) if columns is not None else None
        try:
            yield from pf.iter_batches(batch_size=batch_size, row_groups=[self.row_group_index(i)],
                                       columns=names, use_threads=False)
        except (pa.ArrowInvalid, OSError) as e:
            if is_denied(e):
                raise permission_error(self.location, self.location.join(rg.file), e) from e
            raise CorruptDatasetError(
                f"{where} cannot be read ({one_line(e)}); the file is truncated or corrupt: "
                "rewrite the dataset, or read with on_error='skip'"
            ) from e

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


def open_dataset(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Dataset:
    """Open the dataset at ``url`` without reading its data.

    Example:
        >>> ds = shardkit.open_dataset("s3://bucket/train")
        >>> ds.schema, ds.num_rows, len(ds.row_groups)

    Raises:
        DatasetNotFoundError: nothing exists at ``url``.
        NotADatasetError: the folder has no Parquet data, or holds an unfinished shardkit write.
        CorruptDatasetError: a summary or (for folders without one) a data file is not readable.
        DatasetPermissionError: this user may not list the folder or read a file it needs.
        DatasetError: the store cannot be reached (no credentials, no connection: the message says
            which and what to set).
        UnsupportedURLError, MissingDependencyError: no filesystem serves ``url`` here.
    """
    loc = Location.of(url, storage_options)
    with storage_errors(loc.url):
        return open_location(loc)


def open_location(loc: Location) -> Dataset:
    """`open_dataset` of a `Location` (keeps the filesystem, and so its storage options).

    A dataset with a ``_metadata`` summary opens by reading it, and nothing else (on an object store:
    the summary's size and bytes, two requests); the root is checked only when there is none.
    """
    md = _summary(loc)
    if md is None:
        if not root_exists(loc):
            raise _not_found(loc)
        if loc.fs.isfile(loc.root):
            raise NotADatasetError(f"{loc.url!r} is a file; a dataset is a folder of Parquet files")
        if loc.exists(SUMMARY):  # there after all (written meanwhile): read it, or say why it cannot be
            md = read_footer(loc, SUMMARY)
    groups_from_summary = md is not None
    if md is not None:
        arrow_schema, groups = md.schema.to_arrow_schema(), tuple(summary_row_groups(md))
        footers: Footers = []
    else:
        md, (arrow_schema, groups, footers) = None, _index_footers(loc)
    if SCHEMA_KEY in (arrow_schema.metadata or {}):
        schema = _schema(loc, arrow_schema)
        check_columns(loc, schema, arrow_schema, where=loc.join(SUMMARY) if groups_from_summary else loc.url)
        ds = Dataset(loc, schema, arrow_schema, groups, "shardkit", md)
    elif (blob := _petastorm_blob(loc)) is not None:
        from shardkit.dataset.petastorm import petastorm_schema

        schema = petastorm_schema(blob, where=loc.join(COMMON))
        # a field Spark's partitionBy kept in folder names only (``part=1/``) is not in the files: left
        # out, as the key of any Hive-partitioned folder (a warning on opening; filters may name it)
        keys = set(partition_keys(rg.file for rg in groups)) - set(arrow_schema.names)
        schema = Schema([f for f in schema if f.name not in keys])
        ds = Dataset(loc, schema, arrow_schema, groups, "petastorm", md)
    else:
        schema, left_out = _plain_schema(loc, arrow_schema)
        ds = Dataset(loc, schema, arrow_schema, groups, "parquet", md, left_out=left_out)
    for name, footer in footers[:FOOTERS_KEPT]:  # read already: the first reads need not fetch them again
        ds.keep_footer(name, footer)
    _warn_partitions(ds)
    _warn_left_out(ds)
    return ds


def _not_found(loc: Location) -> DatasetNotFoundError:
    """Nothing at ``loc``'s root: its bucket named when that is what is missing, as writes name it
    (`Location.missing_bucket`: one more request, on object stores only), else the path."""
    with contextlib.suppress(OSError):  # a store that will not say: the path is what is known missing
        if (bucket := loc.missing_bucket()) is not None:
            return DatasetNotFoundError(f"no dataset at {loc.url!r}: the bucket {bucket!r} does not exist, "
                                        "or these credentials cannot see it. Check the bucket's name in the "
                                        "URL (and the credentials and endpoint)")
    return DatasetNotFoundError(f"no dataset at {loc.url!r}: the path does not exist. Check the URL (and "
                                "credentials), or write one first with shardkit.write_dataset(data, url)")


def _plain_schema(loc: Location, arrow_schema: pa.Schema) -> tuple[Schema, dict[str, str]]:
    """The fields of a plain Parquet dataset's columns, and the columns of no field type left out.

    A table from a data lake often holds a column shardkit does not map (a decimal, a struct, a map, a
    time of day): refusing the whole dataset left no way to read the others (``columns=`` applies
    after opening). So such columns are left out, with a `ColumnsLeftOutWarning`, and asking a reader
    for one names why and the cast that makes it readable. A dataset with no readable column is
    refused.
    """
    fields, left_out = [], {}
    for af in arrow_schema:
        try:
            fields.append(field_from_arrow(af))
        except SchemaError as e:
            left_out[af.name] = str(e)
    if not fields:
        raise SchemaError(f"dataset {loc.url!r}: no column maps to a field: " + "; ".join(left_out.values()))
    return Schema(fields), left_out


def _warn_left_out(ds: Dataset) -> None:
    """Warn (once per opening) which columns of a plain Parquet dataset are left out, and why."""
    if ds.left_out:
        warnings.warn(ColumnsLeftOutWarning(
            f"{ds.url!r}: column(s) {list(ds.left_out)} are left out of its fields, as shardkit has no "
            f"field type for them: " + "; ".join(ds.left_out.values()) + ". The other columns read as "
            "usual; to read these, rewrite them with the cast (shardkit.write_dataset)"), stacklevel=3)


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


def _warn_partitions(ds: Dataset) -> None:
    """Warn (once per opening) that the partition columns of a Hive-partitioned folder are not read."""
    keys = ds.partition_keys
    if not keys:
        return
    example = next(name for name in ds.files if "=" in name)
    warnings.warn(
        PartitionColumnsWarning(
            f"{ds.url!r} is partitioned Hive-style (e.g. {example!r}): shardkit reads the files but not "
            f"the partition column(s) {keys} in their folder names as columns of the batches (a reader's "
            "filter may name them). To keep them, convert the data into a shardkit dataset, streamed, "
            f"the partition keys as columns: `shardkit write {ds.url} NEW_URL`, or in Python "
            f"shardkit.dataset.convert.convert({ds.url!r}, new_url)"
        ),
        stacklevel=4,  # open_dataset's caller
    )


def is_petastorm(loc: Location) -> bool:
    """Whether ``loc`` is a Petastorm dataset (its pickled schema sits in ``_common_metadata``)."""
    return _petastorm_blob(loc) is not None


def _petastorm_blob(loc: Location) -> bytes | None:
    """Petastorm's pickled schema from ``_common_metadata`` (read once), or None when there is none."""
    if not loc.exists(COMMON):
        return None
    blob: bytes | None = (read_footer(loc, COMMON).metadata or {}).get(PETASTORM_KEY)
    return blob




def _index_footers(loc: Location) -> tuple[pa.Schema, tuple[RowGroup, ...], Footers]:
    files = data_files(loc)
    if not files:
        raise NotADatasetError(
            f"{loc.url!r} holds no Parquet data files (and no _metadata); point at the dataset's root "
            "folder, or write a dataset there with shardkit.write_dataset"
        )
    footers = read_footers(loc, files)
    first_schema = footers[0][1].schema.to_arrow_schema()
    if SCHEMA_KEY in (first_schema.metadata or {}):
        raise NotADatasetError(
            f"{loc.url!r} holds {len(files)} file(s) written by shardkit but no _metadata: a write did not "
            "finish, or the summary was deleted. Rerun the write, or adopt these files with "
            "shardkit.write_summary(url)"
        )
    warnings.warn(
        SummaryMissingWarning(
            f"{loc.url!r} has no _metadata summary, so opening it read the footers of {len(files)} files. "
            "Add the summary once with shardkit.write_summary(url) (or `shardkit index URL`) to open it "
            "in one read."
        ),
        stacklevel=4,
    )
    groups = []
    for name, md in footers:
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            groups.append(RowGroup(name, i, rg.num_rows, rg.total_byte_size))
    return first_schema, tuple(groups), footers


def _schema(loc: Location, arrow_schema: pa.Schema) -> Schema:
    try:
        return schema_from_arrow(arrow_schema)
    except SchemaError as e:
        raise SchemaError(f"dataset {loc.url!r}: {e}") from e


def check_columns(loc: Location, schema: Schema, arrow_schema: pa.Schema, *, where: str) -> None:
    """Raise `CorruptDatasetError` unless ``schema`` (stored as JSON) describes the Parquet columns.

    Every field needs a column of its name that its codec can read (`Codec.stored_problem`), and every
    column a field: shardkit writes exactly the schema's columns, so a difference means the stored
    schema was edited (or the files replaced) outside shardkit, and reading on would drop a field or
    decode wrong values. Metadata only: no data file is read. ``where`` names the file the schema and
    columns come from.
    """
    fix = ("The schema stored in the dataset no longer describes its Parquet files: rewrite the dataset "
           "with shardkit.write_dataset, or restore the schema it was written with")
    columns = {f.name: f.type for f in arrow_schema}
    for field in schema:
        if field.name not in columns:
            raise CorruptDatasetError(
                f"dataset {loc.url!r}: the field {field.name!r} of its schema has no Parquet column in "
                f"{where!r} (columns: {list(columns)}). {fix}"
            )
        problem = field.codec.stored_problem(field, columns[field.name])
        if problem is not None:
            raise CorruptDatasetError(
                f"dataset {loc.url!r}: the field {field.name!r} ({field.dtype_name}, shape "
                f"{field.shape}, codec {field.codec.name!r}) does not fit its Parquet column in {where!r}: "
                f"{problem}. {fix}"
            )
    extra = [name for name in columns if name not in schema]
    if extra:
        raise CorruptDatasetError(
            f"dataset {loc.url!r}: the Parquet column(s) {extra} in {where!r} are not in its schema "
            f"(fields: {schema.names}). {fix}"
        )
