"""`open_dataset`: a dataset's schema and row-group index, from its summary files when it has them.

Three kinds of folders open:

- a shardkit dataset: ``_metadata`` holds the schema and every row group of every file, so opening
  reads one file, however many data files there are;
- a Petastorm dataset: the schema comes from the (never executed) pickle in ``_common_metadata``, the
  row groups from the data files' footers;
- a plain Parquet folder (Spark, pandas, DuckDB): schema inferred from the Arrow types, row groups
  from the footers, with a `SummaryMissingWarning` that says how to add the summary.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.dataset.location import COMMON, SUMMARY, Location
from shardkit.dataset.schema import SCHEMA_KEY, Schema, schema_from_arrow
from shardkit.errors import (
    CorruptDatasetError,
    DatasetNotFoundError,
    NotADatasetError,
    SchemaError,
    SchemaMismatchError,
)

PETASTORM_KEY = b"dataset-toolkit.unischema.v1"
PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")


class SummaryMissingWarning(UserWarning):
    """A dataset without ``_metadata`` was opened by reading every file's footer (slower)."""


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """One row group: ``file`` (relative to the root), its ``index`` in that file, rows and bytes."""

    file: str
    index: int
    num_rows: int
    num_bytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """An opened dataset: schema plus row-group index. Create with `open_dataset`."""

    location: Location
    schema: Schema
    arrow_schema: pa.Schema
    row_groups: tuple[RowGroup, ...]
    kind: Literal["shardkit", "petastorm", "parquet"]
    metadata: pq.FileMetaData | None = dataclasses.field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.location.url

    @cached_property
    def files(self) -> list[str]:
        return list(dict.fromkeys(rg.file for rg in self.row_groups))

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
        """Open one data file, raising `CorruptDatasetError` (naming it) if it is not readable Parquet."""
        path = self.location.join(file)
        try:
            return pq.ParquetFile(self.location.arrow_fs.open_input_file(path))
        except FileNotFoundError as e:
            raise CorruptDatasetError(
                f"data file {path!r} of dataset {self.url!r} is missing; the dataset was changed outside "
                "shardkit. Rewrite it, or run shardkit.write_summary(url) to index the files that remain"
            ) from e
        except (pa.ArrowInvalid, OSError) as e:
            raise CorruptDatasetError(
                f"data file {path!r} of dataset {self.url!r} is not readable Parquet ({e}); "
                "it is truncated or corrupt: rewrite the dataset or remove the file and rerun write_summary"
            ) from e

    def read_row_group(self, i: int, columns: Sequence[str] | None = None) -> pa.Table:
        """Read row group ``i`` of the index (Arrow, not decoded)."""
        rg = self.row_groups[i]
        where = f"row group {rg.index} of {self.location.join(rg.file)!r}"
        try:
            pf = self.open_file(rg.file)
        except CorruptDatasetError as e:
            raise CorruptDatasetError(f"{where} cannot be read: {e}") from e
        try:
            return pf.read_row_group(rg.index, columns=list(columns) if columns is not None else None,
                                     use_threads=False)
        except (pa.ArrowInvalid, OSError) as e:
            raise CorruptDatasetError(
                f"{where} cannot be read ({e}); the file is corrupt: rewrite the dataset, or read with "
                "on_error='skip'"
            ) from e

    def decode(self, table: pa.Table) -> dict[str, np.ndarray]:
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
    """
    return open_location(Location.of(url, storage_options))


def open_location(loc: Location) -> Dataset:
    """`open_dataset` of a `Location` (keeps the filesystem, and so its storage options)."""
    if not loc.fs.exists(loc.root):
        raise DatasetNotFoundError(
            f"no dataset at {loc.url!r}: the path does not exist. Check the URL (and credentials), or "
            "write one first with shardkit.write_dataset(data, url)"
        )
    if loc.fs.isfile(loc.root):
        raise NotADatasetError(f"{loc.url!r} is a file; a dataset is a folder of Parquet files")
    if loc.exists(SUMMARY):
        md = read_footer(loc, SUMMARY)
        arrow_schema, groups = md.schema.to_arrow_schema(), tuple(_groups_of(md))
    else:
        md, arrow_schema, groups = None, *_index_footers(loc)
    if SCHEMA_KEY in (arrow_schema.metadata or {}):
        return Dataset(loc, _schema(loc, arrow_schema), arrow_schema, groups, "shardkit", md)
    if is_petastorm(loc):
        from shardkit.dataset.petastorm import petastorm_schema

        blob = read_footer(loc, COMMON).metadata[PETASTORM_KEY]
        schema = petastorm_schema(blob, where=loc.join(COMMON))
        return Dataset(loc, schema, arrow_schema, groups, "petastorm", md)
    return Dataset(loc, _schema(loc, arrow_schema), arrow_schema, groups, "parquet", md)


def is_petastorm(loc: Location) -> bool:
    """Whether ``loc`` is a Petastorm dataset (its pickled schema sits in ``_common_metadata``)."""
    return loc.exists(COMMON) and PETASTORM_KEY in (read_footer(loc, COMMON).metadata or {})


def _index_footers(loc: Location) -> tuple[pa.Schema, tuple[RowGroup, ...]]:
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
    return first_schema, tuple(groups)


def _schema(loc: Location, arrow_schema: pa.Schema) -> Schema:
    try:
        return schema_from_arrow(arrow_schema)
    except SchemaError as e:
        raise SchemaError(f"dataset {loc.url!r}: {e}") from e


def data_files(loc: Location) -> list[str]:
    """Relative paths of the Parquet data files under the root (hidden and ``_``-prefixed skipped).

    A file is data when its name ends in ``.parquet`` (``.parq``, ``.pq``), or, for tools that name
    files otherwise (Hive's ``000000_0``), when it starts with the Parquet magic ``PAR1``.
    Anything else (a README, a CSV, Spark's ``.crc`` files) is not data: it is neither indexed nor
    removed by an overwrite.
    """
    out = []
    root = loc.root.rstrip("/") + "/"
    for path in sorted(loc.fs.find(loc.root)):
        rel = path[len(root):] if path.startswith(root) else path
        if any(part.startswith(("_", ".")) for part in rel.split("/")):
            continue
        if rel.lower().endswith(PARQUET_SUFFIXES) or _has_magic(loc, path):
            out.append(rel)
    return out


def _has_magic(loc: Location, path: str) -> bool:
    try:
        with loc.fs.open(path, "rb") as f:
            return bool(f.read(4) == b"PAR1")
    except OSError:
        return False


def read_footer(loc: Location, name: str) -> pq.FileMetaData:
    path = loc.join(name)
    try:
        with loc.arrow_fs.open_input_file(path) as f:
            return pq.read_metadata(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise CorruptDatasetError(
            f"{path!r} is not a readable Parquet footer ({e}); the file is truncated or corrupt. "
            "Remove it (or rewrite the dataset)"
        ) from e


def read_footers(loc: Location, files: Sequence[str]) -> list[tuple[str, pq.FileMetaData]]:
    """The footers of ``files``, which must all have the columns and types of the first one."""
    footers = [(name, read_footer(loc, name)) for name in files]
    first_name, first = footers[0]
    for name, md in footers[1:]:
        if not md.schema.equals(first.schema):
            raise SchemaMismatchError(
                f"the data files of {loc.url!r} differ: {name!r} has the columns ({_columns(md)}), "
                f"{first_name!r} has ({_columns(first)}). Every file of a dataset needs the same columns "
                "and types: rewrite the odd file(s), or move them out of the folder"
            )
    return footers


def _columns(md: pq.FileMetaData) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in md.schema.to_arrow_schema())


def _groups_of(md: pq.FileMetaData) -> list[RowGroup]:
    groups: list[RowGroup] = []
    per_file: dict[str, int] = {}
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        path = rg.column(0).file_path if rg.num_columns else ""
        idx = per_file.get(path, 0)
        per_file[path] = idx + 1
        groups.append(RowGroup(path, idx, rg.num_rows, rg.total_byte_size))
    return groups
