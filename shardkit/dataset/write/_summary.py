"""`write_summary`: index an existing Parquet folder by writing its ``_metadata`` summary."""

from __future__ import annotations

import os
import warnings
from typing import Any

from shardkit._storage.access import root_exists
from shardkit._storage.location import COMMON, SUMMARY, Location
from shardkit.dataset._dataset import Dataset
from shardkit.dataset._footers import data_files, read_footer, read_footers, summary_row_groups
from shardkit.dataset.open import UncommittedFilesWarning, is_petastorm, open_location
from shardkit.dataset.schema import SCHEMA_KEY
from shardkit.dataset.write.commit import summary_bytes, write_lock
from shardkit.errors import CorruptDatasetError, DatasetNotFoundError, NotADatasetError


def write_summary(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Dataset:
    """Index an existing Parquet folder by writing its ``_metadata`` (and ``_common_metadata``).

    Example:
        >>> shardkit.write_summary("s3://bucket/spark-output")   # later opens read one file

    The data files are not rewritten; their footers are read once and merged. A Petastorm dataset
    keeps its own ``_common_metadata`` (where its schema lives).

    A folder without a readable shardkit ``_metadata`` (plain Parquet, Petastorm, the parts of a
    killed first write) gets every data file in it indexed. A shardkit dataset (its ``_metadata``
    holds shardkit's schema) gets only the files that summary lists and that still exist, in its
    order: the fix for a dataset whose file was deleted (`CorruptDatasetError` "is missing"). Other
    data files beside them are the parts of a write that did not commit (killed, or still running)
    and are left out, with an `UncommittedFilesWarning` that names them; the next write removes them.
    To adopt such files on purpose, delete ``_metadata`` first.
    """
    loc = Location.of(url, storage_options)
    if not root_exists(loc):
        raise DatasetNotFoundError(f"cannot index {loc.url!r}: the path does not exist. Check the URL")
    if loc.fs.isfile(loc.root):
        raise NotADatasetError(f"cannot index {loc.url!r}: it is a file; a dataset is a folder of Parquet "
                               "files. Point at the folder that holds it")
    from shardkit.dataset.tables import detect, enclosing

    table = detect(loc)
    inside = (table, loc.url) if table is not None else enclosing(loc)
    if inside is not None:  # a summary of every file there would list old snapshots' files as data
        raise NotADatasetError(
            f"cannot index {loc.url!r}: it is (in) the {inside[0]} table {inside[1]!r}, whose log says which "
            "of its files make a snapshot; open the table itself, it needs no summary: "
            f"shardkit.make_reader({inside[1]!r})")
    with write_lock(loc):
        _write_summary(loc)
    return open_location(loc)


def _write_summary(loc: Location) -> None:
    """`write_summary` once the root exists and the write lock is held."""
    files = data_files(loc)
    committed = _committed_files(loc)
    if committed is not None:
        present = set(files)
        _warn_uncommitted(loc, [name for name in files if name not in set(committed)])
        files = [name for name in committed if name in present]
    if not files and committed is None:
        raise NotADatasetError(
            f"{loc.url!r} has no Parquet data files to index; point at the folder that holds the "
            "*.parquet files"
        )
    mds = []
    for name, md in read_footers(loc, files) if files else []:
        md.set_file_path(name)
        mds.append(md)
    # no file left of a shardkit dataset: an empty one, of the schema its summary holds
    arrow_schema = (mds[0] if mds else read_footer(loc, SUMMARY)).schema.to_arrow_schema()
    meta, common = summary_bytes(arrow_schema, mds)
    loc.write_atomic(SUMMARY, meta)
    if not is_petastorm(loc):
        loc.write_atomic(COMMON, common)


def _committed_files(loc: Location) -> list[str] | None:
    """The data files the shardkit ``_metadata`` at ``loc`` lists, in its order; None when there is no
    readable ``_metadata`` or it is not shardkit's (its files are then not known to be all committed)."""
    if not loc.exists(SUMMARY):
        return None
    try:
        md = read_footer(loc, SUMMARY)
    except CorruptDatasetError:
        return None
    if SCHEMA_KEY not in (md.schema.to_arrow_schema().metadata or {}):
        return None
    return list(dict.fromkeys(rg.file for rg in summary_row_groups(md)))


def _warn_uncommitted(loc: Location, names: list[str]) -> None:
    """Warn about the unlisted files ``names`` of a shardkit dataset that hold rows (an empty dataset's
    one empty part, which carries the schema, is never listed and holds none)."""
    with_rows = []
    for name in names:
        try:
            rows = read_footer(loc, name).num_rows
        except CorruptDatasetError:
            rows = -1  # unreadable: not data of this dataset either, say so
        if rows:
            with_rows.append(name)
    if with_rows:
        warnings.warn(
            UncommittedFilesWarning(
                f"{loc.url!r}: left {len(with_rows)} data file(s) out of the summary, as its _metadata does "
                f"not list them: {with_rows[:5]}{' ...' if len(with_rows) > 5 else ''}. They are parts of a "
                "write that did not commit (or one still running); the next write removes them. To index "
                "them anyway, delete _metadata and run write_summary again"
            ),
            stacklevel=4,  # write_summary's caller
        )
