"""A dataset folder's Parquet files and their footers: which files are data, the ``_metadata`` summary,
and each file's row groups (`RowGroup`), read without reading any data."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from shardkit._storage.access import is_denied, permission_error
from shardkit._storage.location import SUMMARY, Location
from shardkit.errors import (
    CorruptDatasetError,
    DatasetError,
    SchemaMismatchError,
    one_line,
)

__all__ = ["PARQUET_SUFFIXES", "Footers", "RowGroup", "data_files", "read_footer", "read_footers", "summary",
           "summary_row_groups"]

PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
FOOTER_READS = 16  # footers read at once from an object store (a dataset without a summary)
Footers = list[tuple[str, pq.FileMetaData]]


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """One row group: ``file`` (relative to the root), its ``index`` in that file, rows and bytes."""

    file: str
    index: int
    num_rows: int
    num_bytes: int


def data_files(loc: Location) -> list[str]:
    """Relative paths of the Parquet data files under the root (hidden and ``_``-prefixed skipped).

    A file is data when its name ends in ``.parquet`` (``.parq``, ``.pq``), or, for tools that name
    files otherwise (Hive's ``000000_0``), when it starts with the Parquet magic ``PAR1``.
    Anything else (a README, a CSV, Spark's ``.crc`` files) is not data: it is neither indexed nor
    removed by an overwrite. Files in Hive partition folders (``year=2020/``) are data; their partition
    columns are not read (see the module docstring). A local folder this user may not list raises
    `DatasetPermissionError` (fsspec's listing would leave it out silently, and its files with it).
    """
    out = []
    root = loc.root.rstrip("/") + "/"
    for path in sorted(_local_files(loc) if loc.is_local else loc.fs.find(loc.root)):
        rel = path[len(root):] if path.startswith(root) else path
        if any(part.startswith(("_", ".")) for part in rel.split("/")):
            continue
        if rel.lower().endswith(PARQUET_SUFFIXES) or _has_magic(loc, path):
            out.append(rel)
    return out


def _local_files(loc: Location) -> list[str]:
    """Every file under a local root, as fsspec's ``find`` lists them (symlinks followed), except that a
    folder this user may not list raises `DatasetPermissionError` where ``find`` leaves it out (even
    with ``on_error="raise"``, which fsspec does not pass on below the root). Folders whose names
    start with ``_`` or ``.`` hold no data and are not entered."""

    def refused(e: OSError) -> None:
        if is_denied(e):
            raise permission_error(loc, str(e.filename or loc.root), e, action="list") from e

    out: list[str] = []
    for folder, dirs, files in os.walk(loc.root, onerror=refused, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        out.extend(os.path.join(folder, name) for name in files)
    return out


def _has_magic(loc: Location, path: str) -> bool:
    try:
        with loc.fs.open(path, "rb") as f:
            return bool(f.read(4) == b"PAR1")
    except OSError:
        return False


def summary(loc: Location) -> pq.FileMetaData | None:
    """The ``_metadata`` footer, or None when it cannot be opened (missing, or the root is no folder);
    `DatasetPermissionError` when this user may not read it."""
    path = loc.join(SUMMARY)
    if not loc.is_local:  # one request (its size and then its bytes would be two round trips) ...
        with contextlib.suppress(Exception):  # ... and where it fails, the checks below say why
            data = loc.fs.cat_file(path, start=0)  # s3fs: a HEAD first without a start
            with pa.BufferReader(data) as f:
                return _footer_of(loc, f, path)
    try:
        f = loc.arrow_fs.open_input_file(path)
    except OSError as e:
        if is_denied(e):
            raise permission_error(loc, path, e) from e
        return None
    with f:
        return _footer_of(loc, f, path)


def read_footer(loc: Location, name: str) -> pq.FileMetaData:
    """The Parquet footer of the file ``name`` under the root.

    Raises:
        CorruptDatasetError: the file is not Parquet (truncated, corrupt).
        DatasetPermissionError: this user may not read it (checked first: it is no corruption).
    """
    path = loc.join(name)
    try:
        f = loc.arrow_fs.open_input_file(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise _not_a_footer(loc, path, e) from e
    with f:
        return _footer_of(loc, f, path)


def _footer_of(loc: Location, f: pa.NativeFile, path: str) -> pq.FileMetaData:
    try:
        return pq.read_metadata(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise _not_a_footer(loc, path, e) from e


def _not_a_footer(loc: Location, path: str, e: Exception) -> DatasetError:
    if is_denied(e):
        return permission_error(loc, path, e)
    return CorruptDatasetError(f"{path!r} is not a readable Parquet footer ({one_line(e)}); the "
                               "file is truncated or corrupt. Remove it (or rewrite the dataset)")


def read_footers(loc: Location, files: Sequence[str]) -> list[tuple[str, pq.FileMetaData]]:
    """The footers of ``files``, which must all have the columns and types of the first one; on an object
    store read in parallel (a round trip or two each)."""
    if loc.is_local or len(files) < 2:
        footers = [(name, read_footer(loc, name)) for name in files]
    else:
        with ThreadPoolExecutor(max_workers=min(FOOTER_READS, len(files)),
                                thread_name_prefix="shardkit-footer") as pool:
            footers = list(zip(files, pool.map(lambda name: read_footer(loc, name), files), strict=True))
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


def summary_row_groups(md: pq.FileMetaData) -> list[RowGroup]:
    """The row groups a ``_metadata`` summary lists, each with its file and its index in that file."""
    groups: list[RowGroup] = []
    per_file: dict[str, int] = {}
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        path = rg.column(0).file_path if rg.num_columns else ""
        idx = per_file.get(path, 0)
        per_file[path] = idx + 1
        groups.append(RowGroup(path, idx, rg.num_rows, rg.total_byte_size))
    return groups
