"""A write's destination: ``mode`` checked against what is at the URL; the clean-up of a failed write.

`shardkit.dataset.write.write_dataset` (and `shardkit.dataset.spark`) call these before they write
(a missing bucket, an existing dataset, the schema an append keeps) and when a write fails (its
staging folder, and the root if the write created it).
"""

from __future__ import annotations

import contextlib
import re
import uuid
from typing import Any, Literal

from shardkit._storage.access import is_denied
from shardkit._storage.location import STAGING, SUMMARY, Location
from shardkit.dataset._dataset import Dataset
from shardkit.dataset._field import Field
from shardkit.dataset._footers import data_files, read_footer
from shardkit.dataset.open import open_location
from shardkit.dataset.schema import SCHEMA_KEY, Schema
from shardkit.dataset.write.commit import collect_garbage, write_refusals
from shardkit.errors import (
    DatasetExistsError,
    DatasetNotFoundError,
    NotADatasetError,
    SchemaMismatchError,
)

Mode = Literal["error", "overwrite", "append"]
#: The name of a part file written by `shardkit.dataset.write.PartWriter`.
PART_NAME = re.compile(r"part-[0-9a-f]{12}-[0-9]{5}\.parquet")


def check_bucket(loc: Location) -> None:
    """Raise `DatasetNotFoundError` when ``loc`` is on an object store whose bucket does not exist.

    Called before writing to a root that does not exist yet (one request; none off object stores).
    shardkit never creates a bucket (s3fs's ``makedirs`` would: a typo in the URL made a bucket in
    the user's account), so a missing one fails here, before any input is consumed, and with no write.

    The bucket's ``HEAD`` is refused to credentials that may list and read it (moto asks for
    ``s3:HeadBucket``, AWS for a ``ListBucket`` that a policy may scope to prefixes), which then took
    the bucket for missing. Only then the bucket is listed (its top level): an answer, even an empty
    one, says it exists (the write's probe, `check_writable`, says next whether they may write); the
    store's "not found" says it does not; a refused listing keeps "or these credentials cannot see it".
    """
    bucket = loc.missing_bucket()
    if bucket is not None:
        try:
            loc.fs.ls(bucket.split("://", 1)[-1], detail=False)
        except FileNotFoundError:
            pass
        except OSError as e:
            if not is_denied(e):
                raise
        else:
            return
        example = f" (e.g. `aws s3 mb {bucket}`)" if bucket.startswith(("s3://", "s3a://")) else ""
        raise DatasetNotFoundError(
            f"cannot write {loc.url!r}: the bucket {bucket!r} does not exist, or these credentials cannot "
            f"see it. shardkit does not create buckets: fix the URL, or create the bucket first{example}"
        )


def check_writable(loc: Location) -> None:
    """Raise `DatasetPermissionError` naming the URL and what a write needs when ``loc``'s object store
    refuses these credentials a write or a delete: checked before a write consumes any input.

    Credentials that may list and read a bucket pass every look a write takes first; their first
    write was a staged part, after the input was consumed, and it failed with a bare
    ``PermissionError: Access Denied``. So an empty object is written under ``_staging`` and deleted
    (two requests; none off object stores, where `shardkit.dataset.write.commit.write_lock` creates its
    lock file in the root first). A probe whose delete is refused stays in ``_staging``, which the
    next write collects as a killed write's.
    """
    if not loc.is_object_store:
        return
    probe = loc.join(STAGING, f"probe-{uuid.uuid4().hex}")
    with write_refusals(loc):
        loc.fs.pipe_file(probe, b"")
        loc.fs.rm_file(probe)


def discard_staging(loc: Location, *, created_root: bool) -> None:
    """Remove what a failed write left: ``_staging``, and the root folder if the write created it.

    Every staging folder is garbage once no write runs (one writer at a time: locked on local folders,
    see `shardkit.dataset.write.commit`), so all of ``_staging`` goes, as in `collect_garbage`.
    """
    with contextlib.suppress(FileNotFoundError):
        loc.fs.rm(loc.join(STAGING), recursive=True)
    # Object stores have no folders: once its keys are gone the root does not exist any more. rmdir
    # only on a real, empty folder (s3fs's rmdir of a bare bucket name would delete the bucket).
    with contextlib.suppress(OSError):
        if created_root and loc.fs.exists(loc.root) and not loc.fs.ls(loc.root):
            loc.fs.rmdir(loc.root)


def resolve_target(loc: Location, mode: Mode, schema: Schema | list[Field] | None
                   ) -> tuple[Dataset | None, Schema | None]:
    """Check ``mode`` against ``loc``; returns the dataset appended to (if any) and the schema to write.

    Appending keeps the existing schema, the tensors' stored layout included (a given schema that
    differs only in that layout is taken as the existing one); a different given schema is a
    `SchemaMismatchError`.
    """
    existing = check_existing(loc, mode)
    if isinstance(schema, list):
        schema = Schema(schema)
    if mode == "append" and existing is not None:
        if schema is not None and _layout_free(schema) != _layout_free(existing.schema):
            raise SchemaMismatchError(
                f"cannot append to {loc.url!r}: the given schema differs from the dataset's "
                f"({_schema_difference(existing.schema, schema)}); append with the dataset's schema "
                "(leave schema= out), write to a new URL, or use mode='overwrite'"
            )
        schema = existing.schema
    return existing, schema


def _schema_difference(existing: Schema, given: Schema) -> str:
    """What differs between two schemas that `_layout_free` finds different, named attribute by attribute."""
    if existing.names != given.names:
        return f"the dataset has the fields {existing.names}, the given schema {given.names}"
    diffs = []
    for old, new in zip(existing, given, strict=True):
        for attr in ("dtype_name", "shape", "nullable", "codec"):
            was, now = getattr(old, attr), getattr(new, attr)
            if attr == "codec" and was.name == now.name == "tensor":
                continue  # the stored layout: an append keeps the dataset's
            if was != now:
                diffs.append(f"field {old.name!r}: {attr.removesuffix('_name')} {was!r} in the dataset, "
                             f"{now!r} given")
    return "; ".join(diffs)


def _layout_free(schema: Schema) -> list[tuple[Any, ...]]:
    """The schema's fields with the tensor codec's stored layout left out (for comparing)."""
    return [(f.name, f.dtype, f.shape, f.nullable, "tensor" if f.codec.name == "tensor" else f.codec)
            for f in schema]


def check_existing(loc: Location, mode: Mode) -> Dataset | None:
    """Check ``mode`` against what is at ``loc``; returns the dataset to append to, if any.

    Shardkit parts with no ``_metadata`` beside them are no dataset (they do not open). They are the
    parts of a write killed between moving them in and its commit, or a dataset whose summary was
    deleted or not copied (a copy that skipped ``_`` files). With a ``_staging`` folder beside them
    (what such a write leaves until its end: the parts not yet moved, or on local disks its empty
    folder) they are a killed write's, and any mode collects them. Without one nothing tells the two
    apart, so only ``mode="overwrite"`` replaces them: ``"error"`` and ``"append"``, which never
    delete data, refuse with `DatasetExistsError` naming both fixes (as Spark's ``mode("error")``
    refuses a path that holds files). They used to be garbage for every mode, so a write of either
    deleted a dataset that had only lost its summary.
    """
    if not loc.fs.exists(loc.root):
        return None
    if loc.fs.isfile(loc.root):
        raise NotADatasetError(f"{loc.url!r} is a file; a dataset is a folder: write it to another path")
    has_summary = loc.exists(SUMMARY)
    files = data_files(loc) if not has_summary else ["_metadata"]
    if not has_summary and files and unfinished_write(loc, files):
        if mode != "overwrite" and not loc.fs.exists(loc.join(STAGING)):
            raise DatasetExistsError(
                f"{loc.url!r} holds {len(files)} part file(s) written by shardkit but no _metadata: the "
                "parts of a write killed before its commit, or a dataset whose _metadata was deleted or "
                f"not copied. mode={mode!r} does not delete them: pass mode='overwrite' to replace them, "
                "or adopt them as a dataset with shardkit.write_summary(url)"
            )
        files = []  # replaced: collected below
    if mode == "error" and files:
        raise DatasetExistsError(
            f"a dataset already exists at {loc.url!r}; pass mode='overwrite' to replace it or "
            "mode='append' to add rows to it"
        )
    if mode == "append" and files:
        if not has_summary:
            raise DatasetExistsError(
                f"cannot append to {loc.url!r}: it is not a shardkit dataset (no _metadata). Index it first "
                "with shardkit.write_summary(url), or write to a new URL"
            )
        ds = open_location(loc)
        if ds.kind != "shardkit":
            raise DatasetExistsError(
                f"cannot append to {loc.url!r}: it is a {ds.kind} dataset, not shardkit's"
            )
        return ds
    if not files:
        collect_garbage(loc, set())
    return None


def unfinished_write(loc: Location, files: list[str]) -> bool:
    """Whether ``files`` (with no ``_metadata`` beside them) are the parts of a killed shardkit write."""
    if not all(PART_NAME.fullmatch(name) for name in files):
        return False
    return SCHEMA_KEY in (read_footer(loc, files[0]).schema.to_arrow_schema().metadata or {})
