"""`open_dataset`: a dataset's schema and row-group index, from its summary files when it has them
(the `Dataset` it returns, and its reads, are `shardkit.dataset._dataset`'s).

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
them (`shardkit.reader._filter.Partitions`). Opening one warns once, with a `PartitionColumnsWarning`
that names those keys and the fix: rewrite the data with
``shardkit.write_dataset(pyarrow.dataset.dataset(path, partitioning="hive").to_table(), url)``,
which stores them as columns.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from shardkit._storage.access import root_exists, storage_errors
from shardkit._storage.location import COMMON, SUMMARY, Location
from shardkit.dataset._dataset import FOOTERS_KEPT, Dataset, partition_keys
from shardkit.dataset._field import Field
from shardkit.dataset._footers import (
    Footers,
    RowGroup,
    data_files,
    read_footer,
    read_footers,
    summary_row_groups,
)
from shardkit.dataset._footers import summary as _summary
from shardkit.dataset.schema import SCHEMA_KEY, Schema, field_from_arrow, schema_from_arrow
from shardkit.errors import (
    ColumnsLeftOutWarning,
    CorruptDatasetError,
    DatasetNotFoundError,
    NotADatasetError,
    PartitionColumnsWarning,
    SchemaError,
    TableVersionError,
)

PETASTORM_KEY = b"dataset-toolkit.unischema.v1"


class SummaryMissingWarning(UserWarning):
    """A dataset without ``_metadata`` was opened by reading every file's footer (slower)."""


class UncommittedFilesWarning(UserWarning):
    """`write_summary` of a shardkit dataset left out data files its ``_metadata`` did not list (the
    parts of a write that did not commit)."""


def open_dataset(url: str | os.PathLike[str] | Any, *, storage_options: dict[str, Any] | None = None,
                 version: int | None = None, schema: Schema | Sequence[Field] | None = None,
                 filter: Any = None) -> Dataset:
    """Open the dataset at ``url`` without reading its data.

    Example:
        >>> ds = shardkit.open_dataset("s3://bucket/train")
        >>> ds.schema, ds.num_rows, len(ds.row_groups)
        >>> shardkit.open_dataset("s3://bucket/delta_table", version=3).snapshot

    ``url`` is a shardkit dataset, a Petastorm dataset, a plain Parquet folder, a Delta Lake table (a
    folder with ``_delta_log/``), an Iceberg table (a folder with ``metadata/*.metadata.json``, or the URL
    of a metadata file), or a ``deltalake.DeltaTable`` / ``pyiceberg.table.Table`` object
    (`shardkit.dataset.tables`). A table opens at its current snapshot, or at ``version`` (a Delta
    version, an Iceberg snapshot id); its `Dataset` lists that snapshot's files only.

    ``schema`` declares fields for columns of data shardkit did not write (a fixed shape for a list
    column, an image codec for a binary one): `shardkit.dataset.hints`.

    ``filter`` (DNF tuples, as `make_reader` takes them) lists only the files of a table that its log or
    manifests say may hold a matching row (partition values, column bounds: no footer of a pruned file
    is read; `shardkit.dataset.tables._prune`); the rows are filtered by the reader. Other datasets open
    whole (their row groups are pruned by their statistics when a reader plans).

    Raises:
        DatasetNotFoundError: nothing exists at ``url``.
        NotADatasetError: the folder has no Parquet data, or holds an unfinished shardkit write.
        CorruptDatasetError: a summary or (for folders without one) a data file is not readable.
        DatasetPermissionError: this user may not list the folder or read a file it needs.
        DatasetError: the store cannot be reached (no credentials, no connection: the message says
            which and what to set).
        UnsupportedURLError, MissingDependencyError: no filesystem serves ``url`` here, or a table's
            library is not installed (the message names the extra: ``shardkit[delta]``,
            ``shardkit[iceberg]``).
        TableVersionError: ``version`` is not one of the table's (the message lists them), or is given
            for a dataset that is no table.
        UnsupportedTableError: a table needs a feature shardkit does not read, or has deleted rows it
            does not apply (deletion vectors, delete files): the message names the version and the fix.
    """
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise TableVersionError(f"version={version!r} must be an int: a Delta table's version or an "
                                "Iceberg table's snapshot id")
    from shardkit.dataset.tables import is_table_object, open_table_object

    if is_table_object(url) is not None:
        ds = open_table_object(url, version=version, storage_options=storage_options, filter=filter)
    else:
        loc = Location.of(url, storage_options)
        with storage_errors(loc.url):
            ds = open_location(loc, version=version, storage_options=storage_options, filter=filter)
    if schema is None:
        return ds
    from shardkit.dataset.hints import apply_hints

    return apply_hints(ds, schema)


def open_location(loc: Location, *, version: int | None = None,
                  storage_options: dict[str, Any] | None = None, filter: Any = None) -> Dataset:
    """`open_dataset` of a `Location` (keeps the filesystem, and so its storage options).

    A dataset with a ``_metadata`` summary opens by reading it, and nothing else (on an object store:
    the summary's size and bytes, two requests); the root is checked only when there is none, and then
    whether it holds a table's log or metadata (`shardkit.dataset.tables.detect`: two requests), which
    its table format opens: a table's folder is never read as a plain folder (the files of its old
    snapshots are there too).
    """
    md = _summary(loc)
    if md is None:
        if not root_exists(loc):
            raise _not_found(loc)
        from shardkit.dataset.tables import detect, enclosing, open_table

        table_format = detect(loc)
        if table_format is not None:
            return open_table(table_format, loc, version=version, storage_options=storage_options,
                              filter=filter)
        if (inside := enclosing(loc)) is not None:
            raise NotADatasetError(
                f"{loc.url!r} is a folder of the {inside[0]} table {inside[1]!r}: it holds the data files of "
                "every version of the table, including rows deleted or overwritten since, so it is not read "
                f"as a plain Parquet folder. Open the table itself: shardkit.make_reader({inside[1]!r})")
        if loc.fs.isfile(loc.root):
            raise NotADatasetError(f"{loc.url!r} is a file; a dataset is a folder of Parquet files")
        if loc.exists(SUMMARY):  # there after all (written meanwhile): read it, or say why it cannot be
            md = read_footer(loc, SUMMARY)
    if version is not None:
        raise TableVersionError(f"version={version!r} was given for {loc.url!r}, which is a dataset folder, "
                                "not a Delta or Iceberg table: it has one version. Leave version= out")
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
        schema, left_out = plain_schema(loc, arrow_schema)
        ds = Dataset(loc, schema, arrow_schema, groups, "parquet", md, left_out=left_out)
    for name, footer in footers[:FOOTERS_KEPT]:  # read already: the first reads need not fetch them again
        ds.keep_footer(name, footer)
    warn_partitions(ds)
    warn_left_out(ds)
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


def plain_schema(loc: Location, arrow_schema: pa.Schema) -> tuple[Schema, dict[str, str]]:
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


def warn_left_out(ds: Dataset) -> None:
    """Warn (once per opening) which columns of a plain Parquet dataset are left out, and why."""
    if ds.left_out:
        warnings.warn(ColumnsLeftOutWarning(
            f"{ds.url!r}: column(s) {list(ds.left_out)} are left out of its fields, as shardkit has no "
            f"field type for them: " + "; ".join(ds.left_out.values()) + ". The other columns read as "
            "usual; to read these, rewrite them with the cast (shardkit.write_dataset)"), stacklevel=3)


def warn_partitions(ds: Dataset) -> None:
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
            "finish, or the summary was deleted. Rerun the write with mode='overwrite' (it replaces these "
            "files), or adopt them with shardkit.write_summary(url)"
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


__all__ = [
    "PETASTORM_KEY",
    "SummaryMissingWarning",
    "UncommittedFilesWarning",
    "check_columns",
    "is_petastorm",
    "open_dataset",
    "open_location",
]
