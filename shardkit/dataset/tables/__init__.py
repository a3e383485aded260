"""Lakehouse tables read in place at a snapshot: Delta Lake (``delta``) and Apache Iceberg (``iceberg``).

A table's library (deltalake, pyiceberg: the extras ``shardkit[delta]``, ``shardkit[iceberg]``) says
which data files make the snapshot; the `Dataset` opened lists those files only, so the reader's plan,
shuffle, shards and resume work on it as on any Parquet folder. Its `Dataset.snapshot` names the
version a resume pins.

`FORMATS` is the name -> format table: how to recognize a table at a location (one or two requests,
no library needed: a folder holding a table's log is never read as a plain folder, even where its
library is not installed) and the opener, imported when a table of its format is opened.

Example:
    >>> ds = shardkit.open_dataset("s3://bucket/events")            # a Delta or an Iceberg table
    >>> ds.snapshot.format, ds.snapshot.version, ds.snapshot.time
    >>> old = shardkit.open_dataset("s3://bucket/events", version=3)  # time travel
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, cast

from shardkit._storage.location import Location
from shardkit.dataset._dataset import Dataset
from shardkit.dataset.tables.snapshot import Snapshot, TableFormat
from shardkit.errors import MissingDependencyError

__all__ = ["FORMATS", "Snapshot", "TableFormat", "detect", "enclosing", "is_table_object", "open_table",
           "open_table_object"]

Opener = Callable[[Location, "int | None", "dict[str, Any] | None", Any], Dataset]


@dataclasses.dataclass(frozen=True)
class Format:
    """A table format: its module (imported lazily), the functions there that recognize a location and
    open it, the package it needs and the extra that installs it."""

    module: str
    recognize: str
    opener: str
    package: str
    extra: str

    def load(self, name: str) -> Any:
        return getattr(importlib.import_module(self.module), name)


FORMATS: dict[TableFormat, Format] = {
    "delta": Format("shardkit.dataset.tables.delta", "is_delta", "open_delta", "deltalake", "delta"),
    "iceberg": Format("shardkit.dataset.tables.iceberg", "is_iceberg", "open_iceberg", "pyiceberg",
                      "iceberg"),
}


def detect(loc: Location) -> TableFormat | None:
    """The format of the table at ``loc``, or None when it holds no table's log or metadata."""
    for name, fmt in FORMATS.items():
        if fmt.load(fmt.recognize)(loc):
            return name
    return None


def enclosing(loc: Location) -> tuple[TableFormat, str] | None:
    """The format and URL of the table whose folder holds ``loc`` (an Iceberg table's ``data/``, a Delta
    table's partition folder ``year=2024/``), or None. Reading such a folder as plain Parquet would read
    the files of every snapshot, deleted rows included; the opener refuses it with this table's name.
    """
    parts = loc.url.rstrip("/").rsplit("/", 1)
    url = loc.url.rstrip("/")
    name = parts[-1] if len(parts) == 2 else ""
    while len(parts) == 2 and parts[0] and (name == "data" or "=" in name):
        url = parts[0]
        parent = dataclasses.replace(loc, url=url, root=loc.root.rstrip("/").rsplit("/", 1)[0] or "/")
        found = detect(parent)
        if found is not None:
            return found, url
        loc, parts = parent, url.rsplit("/", 1)
        name = parts[-1] if len(parts) == 2 else ""
    return None


def open_table(name: TableFormat, loc: Location, *, version: int | None,
               storage_options: dict[str, Any] | None, filter: Any = None) -> Dataset:
    """Open the table of format ``name`` at ``loc`` at ``version`` (None: its current snapshot), listing
    the files ``filter`` may match (`shardkit.dataset.tables._prune`: DNF tuples; None: all).

    Raises:
        MissingDependencyError: the format's library is not installed (names the extra).
        TableVersionError: no such version (lists the table's).
        UnsupportedTableError: a feature, or deleted rows, shardkit does not read (names the fix).
        CorruptDatasetError: the log or manifests cannot be read, or a listed file is gone.
    """
    fmt = FORMATS[name]
    try:
        importlib.import_module(fmt.package)
    except ImportError as e:
        raise MissingDependencyError(fmt.package, fmt.extra, f"reading the {_title(name)} table "
                                                             f"{loc.url!r}") from e
    opener = cast(Opener, fmt.load(fmt.opener))
    return opener(loc, version, storage_options, filter)


def is_table_object(obj: object) -> TableFormat | None:
    """The format of a table object (``deltalake.DeltaTable``, ``pyiceberg.table.Table``), else None.

    Looked at by module name: neither library is imported to tell.
    """
    module = type(obj).__module__
    if module.startswith("deltalake") and hasattr(obj, "get_add_actions"):
        return "delta"
    if module.startswith("pyiceberg") and hasattr(obj, "scan") and hasattr(obj, "snapshots"):
        return "iceberg"
    return None


def open_table_object(obj: Any, *, version: int | None, storage_options: dict[str, Any] | None = None,
                      filter: Any = None) -> Dataset:
    """The `Dataset` of a table object (see `is_table_object`) at ``version``, of the files ``filter``
    may match."""
    name = is_table_object(obj)
    if name == "delta":
        from shardkit.dataset.tables.delta import open_delta_table

        return open_delta_table(obj, version, storage_options=storage_options, filter=filter)
    if name == "iceberg":
        from shardkit.dataset.tables.iceberg import open_iceberg_table

        return open_iceberg_table(obj, version, storage_options=storage_options, filter=filter)
    raise TypeError(f"{obj!r} is not a deltalake.DeltaTable or a pyiceberg Table")


def _title(name: TableFormat) -> str:
    return {"delta": "Delta Lake", "iceberg": "Iceberg"}[name]
