"""The atomic commit of a write: staged parts move in, then ``_metadata`` is replaced in one step.

Order, and what a crash at each point leaves (readers open only what ``_metadata`` lists):

1. parts are written to ``_staging/<write id>/``   -> previous dataset (or none); staging is garbage
2. parts move into the root under unique names     -> previous dataset; unlisted parts are garbage
3. ``_metadata`` is replaced atomically            -> THE COMMIT: the new dataset
4. ``_common_metadata`` is replaced                -> new dataset (``_common_metadata`` is a courtesy copy
                                                      of the schema for other tools)
5. parts no longer listed (overwrite) and staging are removed; so is garbage of killed writers.

A folder that has shardkit parts but no ``_metadata`` is an unfinished first write and does not open.
One writer at a time per dataset: concurrent writers are not coordinated.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.dataset.location import COMMON, STAGING, SUMMARY, Location


def summary_bytes(arrow_schema: pa.Schema, parts: Sequence[pq.FileMetaData]) -> tuple[bytes, bytes]:
    """Serialized ``_metadata`` (schema + every row group of ``parts``) and ``_common_metadata``."""
    common = pa.BufferOutputStream()
    pq.write_metadata(arrow_schema, common)
    if not parts:
        return common.getvalue().to_pybytes(), common.getvalue().to_pybytes()
    merged = parts[0]
    for md in parts[1:]:
        merged.append_row_groups(md)
    out = pa.BufferOutputStream()
    merged.write_metadata_file(out)
    return out.getvalue().to_pybytes(), common.getvalue().to_pybytes()


def commit(
    loc: Location,
    arrow_schema: pa.Schema,
    staged: Sequence[tuple[str, pq.FileMetaData]],
    *,
    keep: Sequence[pq.FileMetaData] = (),
    keep_files: Sequence[str] = (),
    replace: Sequence[str] = (),
) -> None:
    """Move ``staged`` (staging path, footer) parts into the root and commit them.

    ``keep`` are row groups of an existing summary that stay in the dataset (append), whose files are
    ``keep_files``; the data files ``replace`` (overwrite) and every other ``part-*`` in the root are
    removed after the commit.
    """
    mds = list(keep)
    names = list(keep_files)
    for src, md in staged:
        name = src.rsplit("/", 1)[-1]
        loc.move(src, loc.join(name))
        md.set_file_path(name)
        mds.append(md)
        names.append(name)
    meta, common = summary_bytes(arrow_schema, mds)
    loc.write_atomic(SUMMARY, meta)
    loc.write_atomic(COMMON, common)
    live = set(names)
    for old in replace:
        if old not in live and loc.exists(old):
            loc.fs.rm(loc.join(old))
    collect_garbage(loc, live)


def collect_garbage(loc: Location, live: set[str]) -> None:
    """Remove staging folders and root ``part-*`` files not in ``live`` (left by killed writers)."""
    if loc.exists(STAGING):
        loc.fs.rm(loc.join(STAGING), recursive=True)
    for path in loc.fs.ls(loc.root, detail=False):
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        dead_part = name.startswith("part-") and name.endswith(".parquet") and name not in live
        if dead_part or name.startswith((f".{SUMMARY}.tmp-", f".{COMMON}.tmp-")):
            loc.fs.rm(path)
