"""Delta Lake tables (a folder with ``_delta_log/``), read in place at a version through ``deltalake``
(delta-rs): its log says which files make the version; shardkit plans their row groups.

What is read, and what is refused (never ignored):

- the version's files as `deltalake.DeltaTable.get_add_actions` lists them, with their row counts;
- partition columns (``partition_by``) live in the log only (and in folder names, which are not read):
  their values come from the log, as columns of the batches, and a ``filter`` on them prunes whole files
  by those values without reading them (`Dataset.constants`);
- deletion vectors (rows deleted without rewriting their file) are applied exactly: deltalake gives each
  such file's keep mask (`deltalake.DeltaTable.deletion_vectors`), its row groups count the rows kept,
  and reads leave the others out (`Dataset.kept`). One that deltalake cannot read is refused, naming
  the version and the fix (``OPTIMIZE``/``REORG ... APPLY (PURGE)``, which rewrites the files without
  those rows);
- a column-mapped table (its files' column names are not the table's) and any reader feature not known
  here (`READER_FEATURES`) are refused, naming it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pyarrow as pa

from shardkit._storage.location import Location
from shardkit.dataset._dataset import Dataset
from shardkit.dataset.tables._files import TableFile, table_dataset
from shardkit.dataset.tables._prune import dnf_of, files_to_read
from shardkit.dataset.tables.snapshot import Snapshot
from shardkit.errors import (
    CorruptDatasetError,
    DatasetError,
    TableVersionError,
    UnsupportedTableError,
    one_line,
    require,
)

LOG = "_delta_log"
#: reader features whose tables read right as files plus log: the rest are refused, by name
READER_FEATURES = frozenset({
    "deletionVectors",  # allowed where the version has none (checked file by file)
    "timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "typeWidening", "typeWidening-preview",
    "variantType", "variantType-preview", "columnMapping",  # column mapping: allowed in mode "none"
})
_MAX_READER_VERSION = 3
_COMPACT = ("run OPTIMIZE on the table (Spark: `REORG TABLE t APPLY (PURGE)`), which rewrites the files "
            "without the deleted rows, then read the new version")


def is_delta(loc: Location) -> bool:
    """Whether ``loc`` holds a Delta table (a ``_delta_log`` folder)."""
    return loc.exists(LOG)


def open_delta(loc: Location, version: int | None, storage_options: dict[str, Any] | None,
               filter: Any = None) -> Dataset:
    """The `Dataset` of the Delta table at ``loc`` at ``version`` (None: the current one), of the files
    ``filter`` may match (`shardkit.dataset.tables._prune`)."""
    deltalake: Any = require("deltalake", extra="delta", purpose=f"reading the Delta table {loc.url!r}")
    options = delta_storage_options(storage_options)
    try:
        dt = deltalake.DeltaTable(loc.url if "://" in loc.url else loc.root, storage_options=options)
    except Exception as e:  # delta-rs raises its own DeltaError / OSError for a log it cannot read
        raise _log_error(loc, e) from e
    return open_delta_table(dt, version, loc=loc, storage_options=storage_options, filter=filter)


def open_delta_table(dt: Any, version: int | None, *, loc: Location | None = None,
                     storage_options: dict[str, Any] | None = None, filter: Any = None) -> Dataset:
    """The `Dataset` of a ``deltalake.DeltaTable`` at ``version`` (None: the version it is loaded at), of
    the files ``filter`` may match by the log's partition values and statistics.

    The table object is not changed: another version is loaded into a table object of its own.
    """
    if loc is None:
        loc = Location.of(dt.table_uri, storage_options)
    versions = _versions(dt)
    if version is not None and version != dt.version():
        if version not in versions:
            raise TableVersionError(
                f"the Delta table {loc.url!r} has no version {version!r}; its versions are "
                f"{_listed(versions)} (the current one is {dt.version()}). Pass one of them as version=, or "
                "leave version= out for the current one"
            )
        import deltalake

        try:
            dt = deltalake.DeltaTable(dt.table_uri, version=version, storage_options=_options_of(dt))
        except Exception as e:
            raise _log_error(loc, e, version=version) from e
    current = dt.version()
    where = f"the Delta table {loc.url!r} at version {current}"
    kept = _check_protocol(dt, where)
    actions = _pruned(pa.table(dt.get_add_actions(flatten=True)), filter)
    paths = actions.column("path").to_pylist()
    counts = (actions.column("num_records").to_pylist() if "num_records" in actions.column_names
              else [None] * len(paths))
    files = [TableFile(p, n) for p, n in zip(paths, counts, strict=True)]
    partitions = list(dt.metadata().partition_columns)
    values = {key: actions.column(f"partition.{key}").to_pylist() for key in partitions
              if f"partition.{key}" in actions.column_names}
    if missing := [key for key in partitions if key not in values]:
        raise UnsupportedTableError(
            f"{where}: deltalake gives no values of the partition column(s) {missing}; upgrade deltalake "
            "(pip install -U deltalake) to read this table")
    constants = {p: {key: column[k] for key, column in values.items()} for k, p in enumerate(paths)}
    arrow_schema = pa.schema(dt.schema().to_arrow())
    snapshot = Snapshot("delta", current, _timestamp(dt, current), tuple(versions), dt.table_uri,
                        functools.partial(_reopen, dt.table_uri, _options_of(dt), storage_options, filter))
    if not files:
        raise DatasetError(f"{where} holds no data files (0 rows); write rows to it first, or read another "
                           f"version (its versions are {_listed(versions)})")
    return table_dataset(loc, files, arrow_schema, snapshot, where=where, kept=kept,
                         constants=constants if values else None, fix_missing=(
        f"Read a version whose files are all kept (its versions are {_listed(versions)}), restore the "
        "file, or keep the files of versions you train from by vacuuming with a longer retention"))


def _reopen(table_uri: str, delta_options: dict[str, str] | None, storage_options: dict[str, Any] | None,
            filter: Any, version: int) -> Dataset:
    import deltalake

    dt = deltalake.DeltaTable(table_uri, storage_options=delta_options)
    return open_delta_table(dt, version, storage_options=storage_options, filter=filter)


def _pruned(actions: pa.Table, filter: Any) -> pa.Table:
    """The add actions of the files ``filter`` may match (all of them for no filter, or when none may:
    one file is kept, so that the dataset has its schema and the reader says the filter matches no row)."""
    dnf = dnf_of(filter)
    if dnf is None or actions.num_rows == 0:
        return actions
    names = actions.column_names

    def values(prefix: str) -> dict[str, list[Any]]:
        return {c.removeprefix(prefix): actions.column(c).to_pylist() for c in names if c.startswith(prefix)}

    keep = files_to_read(dnf, actions.num_rows, values("partition."), values("min."), values("max."))
    return actions.filter(pa.array(keep))


def _options_of(dt: Any) -> dict[str, str] | None:
    """The storage options a ``DeltaTable`` was loaded with (deltalake keeps them, unexposed), so that
    another version loads as it did; None where a deltalake release no longer keeps them there."""
    options = getattr(dt, "_storage_options", None)
    return dict(options) if isinstance(options, dict) else None


def _versions(dt: Any) -> list[int]:
    """Every version in the table's log, oldest first."""
    return sorted(int(h["version"]) for h in dt.history() if "version" in h)


def _timestamp(dt: Any, version: int) -> int | None:
    for h in dt.history(1) if version == dt.version() else dt.history():
        if h.get("version") == version and h.get("timestamp") is not None:
            return int(h["timestamp"])
    return None


def _check_protocol(dt: Any, where: str) -> dict[str, np.ndarray]:
    """Refuse what the files plus the log would read wrong (an unknown reader feature or protocol
    version, column mapping); the keep masks of the files with deletion vectors, by their URI."""
    protocol = dt.protocol()
    features = set(protocol.reader_features or ())
    unknown = sorted(features - READER_FEATURES)
    if protocol.min_reader_version > _MAX_READER_VERSION or unknown:
        what = (f"the reader feature(s) {unknown}" if unknown
                else f"reader protocol version {protocol.min_reader_version}")
        raise UnsupportedTableError(
            f"{where} needs {what}, which shardkit does not read (it reads reader versions 1 to "
            f"{_MAX_READER_VERSION}, features {sorted(READER_FEATURES)}). Rewrite the table without it "
            "(or convert it: `shardkit write TABLE NEW_URL` from a reader that supports it)"
        )
    mode = dt.metadata().configuration.get("delta.columnMapping.mode") or "none"
    if mode != "none" or (protocol.min_reader_version == 2 and "delta.columnMapping.mode" in
                          dt.metadata().configuration and mode != "none"):
        raise UnsupportedTableError(
            f"{where} uses column mapping (delta.columnMapping.mode={mode!r}): its files' column names "
            "are not the table's. Rewrite it without column mapping to read it with shardkit"
        )
    if "deletionVectors" not in features:
        return {}
    try:
        deleted = pa.table(dt.deletion_vectors())
    except Exception as e:  # delta-rs's DeltaError: a deletion vector it cannot read
        raise UnsupportedTableError(
            f"{where} has deletion vectors that deltalake cannot read ({one_line(e)}); shardkit never reads "
            f"their rows as if they were not deleted. To read it, {_COMPACT}") from e
    masks = deleted.column("selection_vector")
    return {path: np.asarray(masks[k].values.to_numpy(zero_copy_only=False), dtype=bool)
            for k, path in enumerate(deleted.column("filepath").to_pylist())}


def delta_storage_options(storage_options: dict[str, Any] | None) -> dict[str, str] | None:
    """fsspec's (s3fs's) storage options as delta-rs's object store takes them."""
    if not storage_options:
        return None
    so = dict(storage_options)
    client = dict(so.pop("client_kwargs", None) or {})
    out: dict[str, str] = {}
    names = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN",
             "endpoint_url": "AWS_ENDPOINT_URL", "region_name": "AWS_REGION"}
    for source in (so, client):
        for k, v in source.items():
            if k in names and v is not None:
                out[names[k]] = str(v)
    if out.get("AWS_ENDPOINT_URL", "").startswith("http://"):
        out["AWS_ALLOW_HTTP"] = "true"
    if so.get("anon"):
        out["AWS_SKIP_SIGNATURE"] = "true"
    return out


def _log_error(loc: Location, e: Exception, *, version: int | None = None) -> DatasetError:
    at = f" at version {version}" if version is not None else ""
    text = one_line(e)
    if "feature" in text.lower() or "protocol" in text.lower():
        return UnsupportedTableError(
            f"the Delta table {loc.url!r}{at} needs a protocol or table feature that deltalake does not read "
            f"({text}); upgrade deltalake (pip install -U deltalake), or rewrite the table without it")
    return CorruptDatasetError(
        f"the Delta log of {loc.url!r}{at} cannot be read ({text}): {loc.join(LOG)!r} is corrupt or partly "
        "missing. Restore the log's files, or rewrite the table")


def _listed(versions: list[int]) -> str:
    if len(versions) <= 20:
        return str(versions)
    return f"{versions[:5]} ... {versions[-5:]} ({len(versions)} in all)"
