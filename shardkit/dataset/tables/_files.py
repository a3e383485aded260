"""What Delta and Iceberg share once their library has said which files make a snapshot: the files'
paths under the table's folder, their footers (read in parallel, kept per file), their row groups, the
table's schema as fields, and the `Dataset` of all that.

A table's data files are never rewritten in place (a change writes new files and a new log entry), so
a footer read once is good for every version that lists the file: a resumed reader reopening an older
snapshot, or time travel in a notebook, reads only the footers it has not read before.
"""

from __future__ import annotations

import dataclasses
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardkit._storage.location import Location
from shardkit.dataset._dataset import FOOTERS_KEPT, Dataset
from shardkit.dataset._footers import RowGroup, read_footer
from shardkit.dataset.open import plain_schema, warn_left_out, warn_partitions
from shardkit.dataset.tables.snapshot import Snapshot
from shardkit.errors import CorruptDatasetError, DatasetPermissionError, UnsupportedTableError

#: footers kept across openings, by (table root, file): about 10,000 small files' worth of metadata
FOOTERS_CACHED = 20_000
#: footers read at once (object stores answer each in one round trip; the reads wait, not compute)
FOOTER_THREADS = 32

_cache: OrderedDict[tuple[str, str, str], pq.FileMetaData] = OrderedDict()
_cache_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class TableFile:
    """A data file of a snapshot: ``path`` as the table's log or manifest gives it (relative to the table,
    or a full URI), and the rows it holds when the log says (None: not recorded)."""

    path: str
    num_records: int | None = None


def relative_path(loc: Location, path: str, *, where: str) -> str:
    """``path`` (a log's relative path, or a full URI) relative to the table's root ``loc``.

    Raises:
        UnsupportedTableError: the file lies outside the table's folder (a shallow clone's files, an
            Iceberg table whose files were written elsewhere): its URL would need a filesystem of its own.
    """
    if "://" not in path and not path.startswith("/"):
        return urllib.parse.unquote(path)  # Delta's log holds URIs: percent-encoded partition values
    stripped = str(type(loc.fs)._strip_protocol(path))
    root = loc.root.rstrip("/") + "/"
    if not stripped.startswith(root):
        raise UnsupportedTableError(
            f"{where}: the data file {path!r} lies outside the table's folder {loc.url!r}; shardkit reads "
            "the files under a table's own folder only. Rewrite the table into one folder (e.g. "
            f"`shardkit write {loc.url} NEW_URL`, or the table library's own rewrite)"
        )
    return stripped[len(root):]


def table_dataset(
    loc: Location,
    files: Sequence[TableFile],
    arrow_schema: pa.Schema,
    snapshot: Snapshot,
    *,
    where: str,
    fix_missing: str,
    check_file: Callable[[str, pa.Schema], None] | None = None,
    kept: dict[str, np.ndarray] | None = None,
    constants: dict[str, dict[str, Any]] | None = None,
) -> Dataset:
    """The `Dataset` of a snapshot's ``files`` under ``loc``, in the table's ``arrow_schema``.

    ``where`` names the table and version in messages; ``fix_missing`` says what to do about a listed
    file that is gone (vacuumed, expired); ``check_file`` may refuse a file by its Arrow schema.
    ``kept`` (file, as the log names it -> which of its rows are kept) applies deleted rows: a row
    group counts its kept rows, and one with none left is not in the index. ``constants`` (file, as the
    log names it -> column -> value) are columns the log holds instead of the files (`Dataset.constants`).
    """
    kept_by_name = {relative_path(loc, path, where=where): keep for path, keep in (kept or {}).items()}
    names = [relative_path(loc, f.path, where=where) for f in files]
    footers = read_footers(loc, names, where=where, fix_missing=fix_missing)
    groups: list[RowGroup] = []
    masks: dict[int, np.ndarray] = {}
    for f, name, md in zip(files, names, footers, strict=True):
        if f.num_records is not None and md.num_rows != f.num_records:
            raise CorruptDatasetError(
                f"{where}: the data file {loc.join(name)!r} holds {md.num_rows} rows, its table's log says "
                f"{f.num_records}; the file was replaced outside the table. Restore it, or rewrite the table"
            )
        if check_file is not None:
            check_file(name, md.schema.to_arrow_schema())
        keep = kept_by_name.get(name)
        if keep is not None and len(keep) != md.num_rows:
            if len(keep) > md.num_rows:
                raise CorruptDatasetError(
                    f"{where}: the deletion vector of {loc.join(name)!r} covers {len(keep)} rows, the file "
                    f"holds {md.num_rows}; the log and the file disagree. Restore the file, or rewrite the "
                    "table")
            keep = np.concatenate([keep, np.ones(md.num_rows - len(keep), dtype=bool)])
        start = 0
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            n = rg.num_rows
            if keep is None or keep[start:start + n].all():
                groups.append(RowGroup(name, i, n, rg.total_byte_size))
            elif (left := int(keep[start:start + n].sum())) > 0:
                masks[len(groups)] = keep[start:start + n].copy()
                groups.append(RowGroup(name, i, left, rg.total_byte_size))
            start += n
    schema_of_files = _file_types(arrow_schema, footers)
    schema, left_out = plain_schema(loc, schema_of_files)
    by_file = {relative_path(loc, path, where=where): values for path, values in (constants or {}).items()}
    ds = Dataset(loc, schema, schema_of_files, tuple(groups), snapshot.format, None, snapshot=snapshot,
                 left_out=left_out, kept=masks, constants=by_file)
    for name, md in list(zip(names, footers, strict=True))[:FOOTERS_KEPT]:
        ds.keep_footer(name, md)
    warn_partitions(ds)
    warn_left_out(ds)
    return ds


def _file_types(table_schema: pa.Schema, footers: Sequence[pq.FileMetaData]) -> pa.Schema:
    """The table's columns, each typed as its newest data file stores it (so most reads need no cast:
    the table library's Arrow types may be other, equivalent ones, such as large strings), without the
    libraries' field metadata (Iceberg's field ids)."""
    stored: dict[str, pa.DataType] = {}
    for md in footers:  # oldest files first in neither log: any file that has the column says its type
        for f in md.schema.to_arrow_schema():
            stored.setdefault(f.name, f.type)
    fields = []
    for f in table_schema:
        t = stored.get(f.name, f.type)
        fields.append(pa.field(f.name, t if _castable(t, f.type) else f.type, nullable=f.nullable))
    return pa.schema(fields)


def _castable(stored: pa.DataType, table: pa.DataType) -> bool:
    """Whether the file's type can stand for the table's (the same type up to string, binary and list
    offset widths: pyiceberg says large_list where the files hold lists)."""
    if stored == table:
        return True
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_list_view, pa.types.is_large_list_view)
    if any(f(stored) for f in lists) and any(f(table) for f in lists):
        return _castable(stored.value_type, table.value_type)
    same = ({pa.string(), pa.large_string(), pa.string_view()},
            {pa.binary(), pa.large_binary(), pa.binary_view()})
    return any(stored in kinds and table in kinds for kinds in same)


def read_footers(loc: Location, names: Sequence[str], *, where: str,
                 fix_missing: str) -> list[pq.FileMetaData]:
    """The footers of ``names`` under ``loc``, read in parallel, from the cache where read before.

    Raises:
        CorruptDatasetError: a file is gone (named, with ``fix_missing``) or is not Parquet.
    """
    out: list[pq.FileMetaData | None] = []
    missing: list[int] = []
    with _cache_lock:
        for i, name in enumerate(names):
            md = _cache.get(_key(loc, name))
            if md is not None:
                _cache.move_to_end(_key(loc, name))
            else:
                missing.append(i)
            out.append(md)

    def read(name: str) -> pq.FileMetaData:
        try:
            return read_footer(loc, name)
        except DatasetPermissionError:
            raise
        except CorruptDatasetError as e:
            if not loc.exists(name):
                raise CorruptDatasetError(
                    f"{where} lists the data file {loc.join(name)!r}, which is gone from storage (removed by "
                    f"a vacuum or an expiry of old snapshots, or by hand). {fix_missing}"
                ) from e
            raise

    if missing:
        with ThreadPoolExecutor(max_workers=min(FOOTER_THREADS, len(missing))) as pool:
            read_now = list(pool.map(read, [names[i] for i in missing]))
        with _cache_lock:
            for i, md in zip(missing, read_now, strict=True):
                out[i] = md
                _cache[_key(loc, names[i])] = md
            while len(_cache) > FOOTERS_CACHED:
                _cache.popitem(last=False)
    return [md for md in out if md is not None]


def _key(loc: Location, name: str) -> tuple[str, str, str]:
    return str(loc.fs.protocol), loc.root, name
