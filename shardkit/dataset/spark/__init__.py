"""`write_spark`: materialize a PySpark DataFrame as a shardkit dataset, encoded and written by executors.

How it runs:

1. On the driver, before any Spark job: the mode is checked against what is at the URL (exactly as
   `shardkit.write_dataset` does), the schema is taken or inferred from ``df.schema``
   (`shardkit.dataset.spark._columns`), and the DataFrame's columns are checked against it.
2. One Spark job, ``df.mapInArrow``: every task converts its Arrow record batches into the schema's
   columns, encodes them with the codecs, and writes row groups and part files (`PartWriter`) into its
   own folder ``_staging/<write id>/<task attempt>/``, then yields the paths it wrote.
3. On the driver: the footers of those files are read (Parquet metadata only, nothing is unpickled) and
   the write is committed atomically by `shardkit.dataset.write.commit.commit`; the result is opened.

``mapInArrow`` rather than ``mapInPandas``: the codecs take Arrow directly, so there is no pandas step
that would turn arrays into object columns of Python lists, integer columns with nulls into floats, or
timestamps into the session time zone; nor does it need pandas on the executors.

A task that fails removes only its own folder, so a retried attempt never deletes a sibling's files;
a failed job removes the whole write's staging folder and commits nothing. Files of killed task
attempts that outlive the job are garbage that the next write to the URL removes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from shardkit import errors
from shardkit._storage.location import STAGING, Location
from shardkit.dataset._dataset import Dataset
from shardkit.dataset._field import Field
from shardkit.dataset._footers import data_files, read_footer
from shardkit.dataset.open import open_location
from shardkit.dataset.schema import Schema
from shardkit.dataset.spark._columns import check_spark_columns, columns_from_batch, schema_from_spark
from shardkit.dataset.write import (
    Mode,
    PartWriter,
    check_bucket,
    discard_staging,
    parse_size,
    resolve_target,
)
from shardkit.dataset.write.commit import commit, write_lock
from shardkit.errors import DatasetError, SchemaError, ShardkitError, require

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

_OUTPUT = pa.schema([pa.field("path", pa.string())])
# The last shardkit exception in a Python worker's traceback, as Spark (classic or Connect) renders it.
_WORKER_ERROR = re.compile(
    r"shardkit\.errors\.(?P<cls>\w+): (?P<msg>.*?)(?=\n\s*SQLSTATE|\n\s+at |\nJVM stacktrace|\Z)", re.DOTALL
)

_MISSING = re.compile(
    r"(?P<purpose>.*) needs the package '(?P<package>[^']+)'.*shardkit\[(?P<extra>[\w,]+)\]'", re.DOTALL
)


@dataclasses.dataclass(frozen=True)
class _WriteTask:
    """What every Spark task runs. Its fields are plain data (URL, schema JSON, sizes); the class is
    imported on the executors, which is why they need shardkit installed."""

    url: str
    storage_options: dict[str, Any] | None
    staging: str  # relative to the root: "_staging/<write id>"
    schema_json: str
    rg_bytes: int
    rg_rows: int | None
    file_bytes: int
    compression: str

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        loc = Location.of(self.url, self.storage_options)
        schema = Schema.from_json(self.schema_json)
        folder = loc.join(self.staging, uuid.uuid4().hex)
        parts: PartWriter | None = None
        seen = 0
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                table = schema.encode(columns_from_batch(batch, schema), batch.num_rows)
                if parts is None:
                    # no create_parents: if the driver already gave up and removed the staging
                    # folder, a straggling task must fail rather than recreate it
                    loc.fs.mkdir(folder, create_parents=False)
                    parts = PartWriter(loc, folder, schema, rg_bytes=self.rg_bytes, rg_rows=self.rg_rows,
                                       file_bytes=self.file_bytes, compression=self.compression)
                parts.add(table)
                seen += batch.num_rows
            staged = parts.finish() if parts is not None else []
        except SchemaError as e:
            if parts is not None:
                parts.abort()
            where = f"in Spark partition {_partition_id()}, in the batch that starts at its row {seen}"
            raise type(e)(f"{where}: {e}") from e
        except BaseException:
            if parts is not None:
                parts.abort()
            raise
        root = loc.root.rstrip("/") + "/"
        yield pa.RecordBatch.from_pydict({"path": [path[len(root):] for path, _ in staged]}, schema=_OUTPUT)


def _partition_id() -> int:
    pyspark: Any = require("pyspark", extra="spark", purpose="write_spark's executors")
    ctx = pyspark.TaskContext.get()
    return ctx.partitionId() if ctx is not None else -1


def write_spark(
    df: DataFrame,
    url: str | os.PathLike[str],
    *,
    schema: Schema | list[Field] | None = None,
    mode: Mode = "error",
    row_group_size: int | str = "32MiB",
    file_size: int | str = "128MiB",
    compression: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> Dataset:
    """Write a Spark DataFrame as a shardkit dataset at ``url``; executors encode and write the files.

    Example:
        >>> os.environ["PYSPARK_PYTHON"] = sys.executable   # before the SparkSession starts
        >>> schema = Schema([Field("id", "int64"),
        ...                  Field("image", "uint8", (28, 28), codec=ImageCodec("png"))])
        >>> ds = write_spark(spark.table("mnist"), "s3://bucket/mnist", schema=schema, mode="overwrite")

    The result is the same format, with the same arguments and ``mode`` semantics, as
    `shardkit.write_dataset`. Executors must run a Python with shardkit (and pyarrow, pillow) installed:
    set ``PYSPARK_PYTHON`` to that interpreter (locally, ``sys.executable``) before the session starts,
    or tasks run the system Python. The URL must be reachable from every executor: on a cluster, an
    object store, HDFS or a shared mount (``memory://`` never is). Each non-empty Spark partition writes
    its own part file(s), in partition order: ``df.repartition(n)`` sets how many.

    Args:
        df: the DataFrame; its columns must be exactly the schema's fields.
        url: a folder on any fsspec filesystem that the driver and every executor can reach.
        schema: the fields; inferred from ``df.schema`` when omitted (fixed shapes and images must be
            declared; their values are Spark arrays, flat or nested as deep as the shape). With
            ``mode="append"`` it defaults to the existing dataset's schema.
        mode: ``"error"``, ``"overwrite"`` or ``"append"``, as in `shardkit.write_dataset`.
        row_group_size: encoded bytes per row group (``"32MiB"``), or an int number of rows.
        file_size: encoded bytes per part file before a task starts a new one.
        compression: as in `shardkit.write_dataset` (``"auto"``, or a Parquet codec for every column);
            with ``"auto"`` each task decides from its first row group.
        storage_options: fsspec options for ``url``; sent to the executors too.

    Raises:
        DatasetExistsError: ``mode="error"`` and a dataset exists at ``url`` (no Spark job runs).
        SchemaError: a Spark type has no shardkit equivalent, or a bad argument.
        SchemaMismatchError: the data does not fit the schema (also when an executor finds it);
            nothing is committed and the staging folder is removed.
    """
    require("pyspark", extra="spark", purpose="write_spark")
    if mode not in ("error", "overwrite", "append"):
        raise SchemaError(f"mode={mode!r} is not one of 'error', 'overwrite', 'append'")
    rg_rows: int | None = None
    if isinstance(row_group_size, int) and not isinstance(row_group_size, bool):
        rg_rows = row_group_size
    if rg_rows is not None and rg_rows <= 0:
        raise SchemaError(f"row_group_size={row_group_size!r} must be positive")
    rg_bytes = 1 << 62 if rg_rows else parse_size(row_group_size, what="row_group_size")
    file_bytes = parse_size(file_size, what="file_size")
    loc = Location.of(url, storage_options)
    if "memory" in (loc.fs.protocol if isinstance(loc.fs.protocol, tuple) else (loc.fs.protocol,)):
        raise DatasetError(
            f"write_spark cannot write to {loc.url!r}: executors run in other processes and cannot see "
            "the driver's in-memory filesystem; use a local folder, an object store or HDFS"
        )
    root_existed = loc.fs.exists(loc.root)
    if not root_existed:
        check_bucket(loc)
    with write_lock(loc):  # the driver holds it for the whole job (local folders)
        existing, schema = resolve_target(loc, mode, schema)
        if schema is None:
            schema = schema_from_spark(df.schema)
        check_spark_columns(schema, df.schema)
        replaced = data_files(loc) if mode == "overwrite" and root_existed else []

        write_id = uuid.uuid4().hex
        staging = loc.join(STAGING, write_id)
        loc.makedirs(staging)  # none on object stores, where it would create a missing bucket
        task = _WriteTask(loc.root if loc.is_local else loc.url, storage_options, f"{STAGING}/{write_id}",
                          schema.to_json(), rg_bytes, rg_rows, file_bytes, compression)
        try:
            names = [row.path for row in df.mapInArrow(task, "path string").collect()]
            with ThreadPoolExecutor(max_workers=8) as pool:  # one footer per file: overlap the round trips
                footers = list(pool.map(lambda name: read_footer(loc, name), names))
            staged = [(loc.join(name), md) for name, md in zip(names, footers, strict=True)]
            if not staged:  # an empty DataFrame still gets one (empty) file that carries the schema
                staged = PartWriter(loc, staging, schema, rg_bytes=rg_bytes, rg_rows=rg_rows,
                                    file_bytes=file_bytes, compression=compression).finish()
        except BaseException as e:
            # a straggling task of the failed job may still be writing: never let cleanup hide the error
            with contextlib.suppress(OSError):
                discard_staging(loc, created_root=not root_existed)
            raised = _from_worker(e)
            if raised is not None:
                raise raised from e
            raise
        keep = [existing.metadata] if existing is not None and existing.metadata is not None else []
        keep_files = existing.files if existing is not None else []
        commit(loc, schema.storage_schema(), staged, keep=keep, keep_files=keep_files, replace=replaced)
    return open_location(loc)


def _from_worker(e: BaseException) -> ShardkitError | None:
    """The shardkit error that a Python worker raised, rebuilt from Spark's wrapper ``e``, if any."""
    if isinstance(e, ShardkitError) or not isinstance(e, Exception):
        return None
    text = str(e)
    found = list(_WORKER_ERROR.finditer(text))
    if found:
        cls = getattr(errors, found[-1].group("cls"), None)
        message = found[-1].group("msg").strip()
        if cls is errors.MissingDependencyError:  # its constructor builds the message from parts
            missing = _MISSING.fullmatch(message)
            if missing is not None:
                return errors.MissingDependencyError(missing["package"], missing["extra"], missing["purpose"])
        elif isinstance(cls, type) and issubclass(cls, ShardkitError):
            return cls(message)
    if "No module named 'shardkit'" in text:
        return errors.MissingDependencyError(
            "shardkit", "spark", "the Python of write_spark's executors (PYSPARK_PYTHON, else the system one)"
        )
    return None


__all__ = ["schema_from_spark", "write_spark"]
