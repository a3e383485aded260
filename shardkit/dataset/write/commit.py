"""The atomic commit of a write: staged parts move in, then ``_metadata`` is replaced in one step.

Order, and what a crash at each point leaves (readers open only what ``_metadata`` lists):

1. parts are written to ``_staging/<write id>/``   -> previous dataset (or none); staging is garbage
2. parts move into the root under unique names     -> previous dataset; unlisted parts are garbage
3. ``_metadata`` is replaced atomically            -> THE COMMIT: the new dataset
4. ``_common_metadata`` is replaced                -> new dataset (``_common_metadata`` is a courtesy copy
                                                      of the schema for other tools)
5. parts no longer listed (overwrite) and staging are removed; so is garbage of killed writers.

A folder that has shardkit parts but no ``_metadata`` is an unfinished first write and does not open.

One writer at a time per dataset: the garbage collection of step 5 (and of a write's start) takes
every staging folder and every unlisted part for a killed writer's. What overlapping writers get:

- local folders: a write holds an exclusive advisory lock (``fcntl.flock`` on ``_write.lock`` in the
  root, removed when the write ends) from its first look at the folder to its last removal; a second
  write (or `write_summary`) that starts meanwhile raises `DatasetError` at once and changes nothing.
  ``flock`` coordinates processes of one machine; on network mounts (NFS) it may not.
- object stores (and any other fsspec filesystem) have no lock: overlapping writers are detected, not
  prevented. A writer checks that every file it is about to list exists just before it writes
  ``_metadata`` and raises `DatasetError` instead of committing when one is gone, and a write whose
  staging files vanish raises `DatasetError` too, not a bare ``FileNotFoundError``. Another writer's
  removal between that check and the commit (milliseconds) can still leave a ``_metadata`` that lists
  a missing file; `write_summary` repairs it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from shardkit._storage import lockfile
from shardkit._storage.access import is_denied, permission_error
from shardkit._storage.location import COMMON, STAGING, SUMMARY, Location
from shardkit.errors import DatasetError, ShardkitError

LOCK = "_write.lock"


@contextlib.contextmanager
def write_refusals(loc: Location) -> Iterator[None]:
    """Raise a write or delete under ``loc`` that the store refuses as `DatasetPermissionError` naming
    the URL and what a write needs (`permission_error`, action ``"write to"``); anything else goes
    through as it is. s3fs raises a bare ``PermissionError: Access Denied`` (no path, no fix) for
    credentials that may read a bucket but not write to it."""
    try:
        yield
    except OSError as e:
        if isinstance(e, ShardkitError) or not is_denied(e):
            raise
        raise permission_error(loc, loc.root, e, action="write to") from e


def overlap_error(loc: Location, what: str) -> DatasetError:
    """The error of a write that overlapped another one at ``loc``; ``what`` says how it showed."""
    return DatasetError(
        f"another write to {loc.url!r} overlapped this one ({what}); writers to one dataset must not "
        "overlap. Nothing was committed by this write: wait for the other to finish and run it again, or "
        "write to another URL"
    )


@contextlib.contextmanager
def write_lock(loc: Location) -> Iterator[None]:
    """Hold ``loc``'s write lock (local folders; elsewhere a no-op, see the module docstring).

    Creates the root folder when it is missing (the lock file lives there) and removes the lock file,
    and the root when this created it and left it empty, at the end. Raises `DatasetError` when
    another write holds the lock, `DatasetPermissionError` (naming the folder, its owner and mode) when
    this user may not create the lock file there. A root that is a file is left for the caller to refuse.
    """
    if not lockfile.SUPPORTED or not loc.is_local or os.path.isfile(loc.root):
        yield
        return
    created = not os.path.isdir(loc.root)
    path = loc.join(LOCK)
    try:
        os.makedirs(loc.root, exist_ok=True)
    except OSError as e:
        if not is_denied(e):
            raise
        raise permission_error(loc, str(e.filename or loc.root), e, action="write in") from e
    try:
        fd = lockfile.acquire(path, block=False)
    except BlockingIOError:
        raise overlap_error(loc, f"it holds the lock file {path!r}") from None
    except OSError as e:  # a read-only folder: a write (or write_summary) could not change it anyway
        if not is_denied(e):
            raise
        raise permission_error(loc, loc.root, e, action="write in") from e
    try:
        yield
    finally:
        lockfile.release(path, fd)  # still holding the lock: a writer that opened the file fails its flock
        with contextlib.suppress(OSError):
            if created and not os.listdir(loc.root):
                os.rmdir(loc.root)


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
    removed after the commit. A move, write or removal the store refuses raises
    `DatasetPermissionError` (`write_refusals`).
    """
    with write_refusals(loc):
        _commit(loc, arrow_schema, staged, keep=keep, keep_files=keep_files, replace=replace)


def _commit(loc: Location, arrow_schema: pa.Schema, staged: Sequence[tuple[str, pq.FileMetaData]], *,
            keep: Sequence[pq.FileMetaData], keep_files: Sequence[str], replace: Sequence[str]) -> None:
    mds = list(keep)
    names = list(keep_files)
    for src, md in staged:
        name = src.rsplit("/", 1)[-1]
        try:
            loc.move(src, loc.join(name))
        except FileNotFoundError as e:
            raise overlap_error(loc, f"its staged part {src!r} was removed") from e
        md.set_file_path(name)
        mds.append(md)
        names.append(name)
    check_present(loc, names)
    meta, common = summary_bytes(arrow_schema, mds)
    loc.write_atomic(SUMMARY, meta)
    loc.write_atomic(COMMON, common)
    live = set(names)
    for old in replace:
        if old not in live:
            with contextlib.suppress(FileNotFoundError):  # gone already: what this wanted
                loc.fs.rm(loc.join(old))
    collect_garbage(loc, live)


def check_present(loc: Location, names: Sequence[str]) -> None:
    """Raise `DatasetError` unless every file in ``names`` (relative to the root) exists: the summary
    about to be committed lists them. One listing of the root (one request on an object store)."""
    if not names:
        return
    loc.fs.invalidate_cache(loc.root)  # another writer's removals are what this looks for
    root = loc.root.rstrip("/") + "/"
    here = {str(p)[len(root):] if str(p).startswith(root) else str(p) for p in loc.fs.find(loc.root)}
    missing = [name for name in names if name not in here]
    if missing:
        gone = f"{len(missing)} file(s) this write was about to list are gone: {missing[:3]}"
        raise overlap_error(loc, gone)


def collect_garbage(loc: Location, live: set[str]) -> None:
    """Remove staging folders and root ``part-*`` files not in ``live`` (left by killed writers)."""
    with contextlib.suppress(FileNotFoundError):
        loc.fs.rm(loc.join(STAGING), recursive=True)
    for path in loc.fs.ls(loc.root, detail=False):
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        dead_part = name.startswith("part-") and name.endswith(".parquet") and name not in live
        if dead_part or name.startswith((f".{SUMMARY}.tmp-", f".{COMMON}.tmp-")):
            with contextlib.suppress(FileNotFoundError):
                loc.fs.rm(path)
