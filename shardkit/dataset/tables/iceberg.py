"""Apache Iceberg tables (a folder with ``metadata/*.metadata.json``, or the URL of one metadata file),
read in place at a snapshot through ``pyiceberg``: its scan plan says which data files make the
snapshot; shardkit plans their row groups.

The table's metadata file is the newest one: the one ``metadata/version-hint.text`` names where there
is one (tables of a Hadoop catalog), else the one with the highest version number in its name
(``00004-<uuid>.metadata.json``, ``v4.metadata.json``). A catalog (SQL, REST, Glue) knows its tables'
current metadata file: pass ``catalog.load_table(name)`` itself as the URL to read what it says.

Columns are matched by Iceberg's field ids: a data file whose column of a field id has another name
(a renamed column) is refused, naming the snapshot and the fix (rewrite the data files). Files written
before a column was added read it as nulls.

Rows deleted without rewriting their files: position deletes (a merge-on-read ``DELETE`` by Spark or
Flink writes them: Parquet files of ``file_path, pos``) are applied exactly, as Delta's deletion vectors
are: the delete files pyiceberg's plan attaches to a data file (by partition and sequence number) are
read once each, and the positions they list for that file are left out of every read. Equality deletes
(rows matched by column values) are refused, naming the snapshot and the fix (rewrite the data files).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

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

METADATA = "metadata"
HINT = "version-hint.text"
SUFFIX = ".metadata.json"
_NUMBER = re.compile(r"v?(\d+)")
_FIELD_ID = b"PARQUET:field_id"
_REWRITE = ("rewrite the data files so that the deleted rows are gone from them (Spark: "
            "`CALL catalog.system.rewrite_data_files(table => 't', options => map('delete-file-threshold', "
            "'1'))`), then read the new snapshot")


def is_iceberg(loc: Location) -> bool:
    """Whether ``loc`` is an Iceberg table's folder (``metadata/*.metadata.json``) or metadata file."""
    if loc.root.endswith(SUFFIX):
        return True
    if not loc.exists(METADATA):
        return False
    try:
        names = loc.fs.ls(loc.join(METADATA), detail=False)
    except (OSError, NotADirectoryError):
        return False
    return any(str(n).endswith(SUFFIX) for n in names)


def metadata_file(loc: Location) -> str:
    """The path of the table's current metadata file (see the module docstring)."""
    if loc.root.endswith(SUFFIX):
        return loc.root
    folder = loc.join(METADATA)
    names = sorted(str(n).rsplit("/", 1)[-1] for n in loc.fs.ls(folder, detail=False)
                   if str(n).endswith(SUFFIX))
    if loc.exists(METADATA, HINT):
        hint = loc.fs.cat_file(loc.join(METADATA, HINT)).decode().strip()
        named = [n for n in names if n == hint or _number(n) == _int(hint)]
        if not named:
            raise CorruptDatasetError(
                f"the Iceberg table {loc.url!r}: {loc.join(METADATA, HINT)!r} names version {hint!r}, and no "
                f"metadata file of {names} is that version; the metadata is partly missing. Restore it, or "
                "point at a metadata.json file itself")
        return f"{folder}/{named[-1]}"
    numbered = [n for n in names if _number(n) is not None]
    if not numbered:
        raise CorruptDatasetError(
            f"the Iceberg table {loc.url!r}: no metadata file of {names} has a version number in its name; "
            "pass the URL of the current metadata.json, or the table from its catalog (catalog.load_table)")
    return f"{folder}/{max(numbered, key=lambda n: _number(n) or 0)}"


def _number(name: str) -> int | None:
    m = _NUMBER.match(name)
    return int(m.group(1)) if m else None


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def open_iceberg(loc: Location, version: int | None, storage_options: dict[str, Any] | None,
                 filter: Any = None) -> Dataset:
    """The `Dataset` of the Iceberg table at ``loc`` at snapshot ``version`` (None: the current one), of
    the files ``filter`` may match (`shardkit.dataset.tables._prune`)."""
    require("pyiceberg", extra="iceberg", purpose=f"reading the Iceberg table {loc.url!r}")
    from pyiceberg.table import StaticTable

    path = metadata_file(loc)
    uri = path if "://" in path else (f"file://{path}" if loc.is_local else loc.fs.unstrip_protocol(path))
    try:
        table = StaticTable.from_metadata(uri, properties=iceberg_properties(storage_options))
    except Exception as e:  # pyiceberg raises its own errors and OSError for metadata it cannot read
        raise CorruptDatasetError(
            f"the Iceberg metadata {uri!r} of {loc.url!r} cannot be read ({one_line(e)}); it is corrupt or "
            "partly missing. Restore it, or point at an older metadata.json") from e
    return open_iceberg_table(table, version, storage_options=storage_options, url=loc.url, filter=filter)


def open_iceberg_table(table: Any, version: int | None, *, storage_options: dict[str, Any] | None = None,
                       url: str | None = None, filter: Any = None) -> Dataset:
    """The `Dataset` of a ``pyiceberg.table.Table`` at snapshot ``version`` (None: its current one), of
    the files ``filter`` may match by their manifests' column bounds."""
    loc = Location.of(table.location(), storage_options)
    name = url or table.location()
    snapshots = list(table.snapshots())
    ids = [s.snapshot_id for s in snapshots]
    if version is None:
        current = table.current_snapshot()
        if current is None:
            raise DatasetError(f"the Iceberg table {name!r} has no snapshot yet (0 rows); append rows to it "
                               "first, or read another table")
    else:
        current = table.snapshot_by_id(version)
        if current is None:
            raise TableVersionError(
                f"the Iceberg table {name!r} has no snapshot id {version!r}; its snapshots are {ids} "
                "(oldest first). Pass one of them as version=, or leave version= out for the current one")
    where = f"the Iceberg table {name!r} at snapshot {current.snapshot_id}"
    if table.format_version > 2:
        raise UnsupportedTableError(
            f"{where} is of Iceberg format version {table.format_version}; shardkit reads versions 1 and 2. "
            "Read it with pyiceberg, or rewrite it as version 2")
    try:
        scan = table.scan(snapshot_id=current.snapshot_id)
        tasks = list(scan.plan_files())
        projection = scan.projection()
    except Exception as e:
        if "equality delete" in str(e).lower():  # pyiceberg's plan refuses them: "does not yet support"
            raise UnsupportedTableError(
                f"{where} has equality delete files (rows deleted by their values, without rewriting their "
                "data files), which shardkit does not apply. To read it, " + _REWRITE) from e
        raise CorruptDatasetError(
            f"{where}: its manifests cannot be read ({one_line(e)}); they are corrupt or partly missing. "
            "Restore them, or read another snapshot") from e
    for task in tasks:
        if str(task.file.file_format).rsplit(".", 1)[-1].upper() != "PARQUET":
            raise UnsupportedTableError(f"{where} has the data file {task.file.file_path!r} in "
                                        f"{task.file.file_format}; shardkit reads Parquet data files only")
    if not tasks:
        raise DatasetError(f"{where} holds no data files (0 rows); read another snapshot (its snapshots are "
                           f"{ids})")
    tasks = _pruned(tasks, projection, filter)
    ids_by_name = {f.name: f.field_id for f in projection.fields}
    files = [TableFile(t.file.file_path, t.file.record_count) for t in tasks]
    reopen = functools.partial(open_iceberg_table, table, storage_options=storage_options, url=url,
                               filter=filter)
    snapshot = Snapshot("iceberg", current.snapshot_id, current.timestamp_ms, tuple(ids), name, reopen)
    return table_dataset(
        loc, files, pa.schema(projection.as_arrow()), snapshot, where=where,
        fix_missing=(f"Read a snapshot whose files are all kept (its snapshots are {ids}), or restore the "
                     "file; expiring snapshots removes the files only they list"),
        check_file=functools.partial(_check_ids, ids_by_name, where), kept=_kept_rows(table, tasks, where))


#: Iceberg's types whose bounds prune (`shardkit.dataset.tables._prune`): numbers and booleans
_BOUNDED = ("int", "long", "float", "double", "boolean")


def _pruned(tasks: list[Any], projection: Any, filter: Any) -> list[Any]:
    """The scan tasks of the files ``filter`` may match by their lower and upper bounds (all of them
    when it is no DNF; one when none may, so that the dataset keeps its schema)."""
    dnf = dnf_of(filter)
    if dnf is None:
        return tasks
    from pyiceberg.conversions import from_bytes

    named = {c for conjunction in dnf for c, _, _ in conjunction}
    fields = [f for f in projection.fields if f.name in named and str(f.field_type) in _BOUNDED]

    def bounds(attribute: str) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for f in fields:
            column = []
            for task in tasks:
                raw = (getattr(task.file, attribute) or {}).get(f.field_id)
                column.append(None if raw is None else from_bytes(f.field_type, raw))
            out[f.name] = column
        return out

    keep = files_to_read(dnf, len(tasks), {}, bounds("lower_bounds"), bounds("upper_bounds"))
    return [t for t, k in zip(tasks, keep, strict=True) if k]


def _kept_rows(table: Any, tasks: list[Any], where: str) -> dict[str, np.ndarray]:
    """The keep mask (True: kept) of each data file that position deletes delete rows of, by its path as
    the manifest gives it. Each delete file is read once (one may list rows of many data files).

    Raises:
        UnsupportedTableError: an equality delete file (naming it and the fix).
        CorruptDatasetError: a delete file that cannot be read, or a position past its data file's rows.
    """
    from pyiceberg.manifest import DataFileContent

    positions: dict[str, pa.Table] = {}
    kept: dict[str, np.ndarray] = {}
    for task in tasks:
        path, rows = task.file.file_path, task.file.record_count
        for delete in sorted(task.delete_files, key=lambda d: d.file_path):
            if delete.content != DataFileContent.POSITION_DELETES:
                raise UnsupportedTableError(
                    f"{where} has the equality delete file {delete.file_path!r} (rows of "
                    f"{path!r} deleted by their values, without rewriting the file), which shardkit does not "
                    "apply. To read it, " + _REWRITE)
            if delete.file_path not in positions:
                positions[delete.file_path] = _read_positions(table, delete.file_path, where)
            listed = positions[delete.file_path]
            pos = listed.filter(pc.equal(listed.column("file_path"), path)).column("pos").to_numpy()
            if not len(pos):
                continue
            if pos.min() < 0 or pos.max() >= rows:
                raise CorruptDatasetError(
                    f"{where}: the delete file {delete.file_path!r} deletes row {int(pos.max())} of "
                    f"{path!r}, which has {rows} rows; the table's files do not agree. Restore the table's "
                    "files, or read another snapshot")
            mask = kept.setdefault(path, np.ones(rows, dtype=bool))
            mask[pos] = False
    return kept


def _read_positions(table: Any, path: str, where: str) -> pa.Table:
    """The ``file_path`` and ``pos`` columns of a position delete file (through the table's own FileIO)."""
    try:
        with table.io.new_input(path).open() as f:
            return pq.read_table(f, columns=["file_path", "pos"])
    except Exception as e:  # pyiceberg's FileIO and pyarrow raise their own errors
        raise CorruptDatasetError(
            f"{where}: its position delete file {path!r} cannot be read ({one_line(e)}); it is corrupt or "
            "missing. Restore it, or read another snapshot") from e


def _check_ids(ids_by_name: dict[str, int], where: str, name: str, schema: pa.Schema) -> None:
    """Refuse a data file whose columns are not the table's fields of those names (renamed columns)."""
    names_by_id = {v: k for k, v in ids_by_name.items()}
    for f in schema:
        raw = (f.metadata or {}).get(_FIELD_ID)
        if raw is None:
            continue
        field_id = int(raw)
        if names_by_id.get(field_id, f.name) != f.name or ids_by_name.get(f.name, field_id) != field_id:
            raise UnsupportedTableError(
                f"{where}: the column {f.name!r} of the data file {name!r} is field id {field_id}, which the "
                f"table now names {names_by_id.get(field_id)!r} (a renamed or replaced column); shardkit "
                "matches columns by name. Rewrite the data files (or the table) to read it")


def iceberg_properties(storage_options: dict[str, Any] | None) -> dict[str, str]:
    """fsspec's (s3fs's) storage options as pyiceberg's FileIO properties."""
    if not storage_options:
        return {}
    so = dict(storage_options)
    client = dict(so.pop("client_kwargs", None) or {})
    names = {"key": "s3.access-key-id", "secret": "s3.secret-access-key", "token": "s3.session-token",
             "endpoint_url": "s3.endpoint", "region_name": "s3.region"}
    out = {}
    for source in (so, client):
        for k, v in source.items():
            if k in names and v is not None:
                out[names[k]] = str(v)
    return out
