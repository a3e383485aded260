"""Every error shardkit raises, in one tree.

    ShardkitError
    ├── DatasetError
    │   ├── DatasetNotFoundError      (also FileNotFoundError)  nothing at the URL
    │   ├── NotADatasetError          (also ValueError)         a folder with no Parquet data in it
    │   ├── DatasetExistsError        (also FileExistsError)    mode="error" over an existing dataset
    │   ├── CorruptDatasetError       (also OSError)            a file or row group that cannot be read
    │   │   └── ImageShapeError       (also SchemaMismatchError) an image not its field's size or pixel type
    │   ├── DatasetPermissionError    (also PermissionError)    a file or folder this user may not read/write
    │   ├── TableVersionError         (also LookupError)        a version or snapshot id a table lacks
    │   ├── UnsupportedTableError     (also ValueError)         a table feature shardkit cannot read
    │   ├── StorageFullError          (also OSError)            the disk or bucket filled during a write
    │   ├── RowIndexError             (also IndexError)         an index out of range, a mask too long/short
    │   │   └── RowIndexTypeError     (also TypeError)          an index that is no integer (a float, a bool)
    │   └── UnsafePickleError         (also ValueError)         a Petastorm schema pickle with foreign content
    ├── SchemaError                   (also ValueError)         a schema, field or codec invalid in itself
    │   └── SchemaMismatchError                                 data that does not fit the declared schema
    ├── ReaderError                   (also ValueError)         bad reader arguments or resume state
    │   ├── UnknownArgumentError      (also TypeError)          a keyword a reader function does not take
    │   └── TransformError                                      a per-sample transform raised, hung or died
    ├── AdapterError                  (also ValueError)         a field or device an adapter cannot serve
    ├── ConfigError                   (also ValueError)         a job config key missing, unknown or wrong
    │   ├── EngineUnreachableError                              a cluster engine's address does not answer
    │   └── CompletedRunError                                   a completed run started again without a choice
    ├── CheckpointError               (also OSError)            no checkpoint can be written or restored
    │   └── CorruptCheckpointError                              a commit or file that does not verify
    ├── JobError                      (also RuntimeError)       a job that failed (restarts exhausted)
    │   └── LostJobError                                        a node cut off from its job (store silent)
    ├── UnsupportedURLError           (also ValueError)         a URL whose protocol no filesystem serves
    ├── StorageOptionsError           (also ValueError)         a storage option its filesystem does not take
    └── MissingDependencyError        (also ImportError)        an optional extra is not installed
        └── MissingFilesystemError                              a URL's filesystem package is not installed

    CheckpointWarning                 (a UserWarning)           a broken newer checkpoint was skipped
    CacheWarning                      (a UserWarning)           the default row-group cache cannot be used
    PartitionColumnsWarning           (a UserWarning)           Hive partition columns (key=value) not read
    ColumnsLeftOutWarning             (a UserWarning)           plain Parquet columns with no field type
    FilesLeftOutWarning               (a UserWarning)           files of a converted folder not in its format
    TimeZoneWarning                   (a UserWarning)           converted times with a zone stored as UTC
    SecretTooShortWarning             (a UserWarning)           a secret too short to be masked in output
    SecretInEnvWarning                (a UserWarning)           an env: name that looks like a credential

Each message names the bad value, where it came from (URL, file, row group, field) and what to do.
Every class also subclasses the matching built-in, so ``except FileNotFoundError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "AdapterError",
    "CheckpointError",
    "CheckpointWarning",
    "ColumnsLeftOutWarning",
    "CompletedRunError",
    "ConfigError",
    "CorruptCheckpointError",
    "CorruptDatasetError",
    "DatasetChangedError",
    "DatasetError",
    "DatasetExistsError",
    "DatasetNotFoundError",
    "DatasetPermissionError",
    "EngineUnreachableError",
    "FilesLeftOutWarning",
    "ImageShapeError",
    "JobError",
    "LostJobError",
    "MissingDependencyError",
    "MissingFilesystemError",
    "NotADatasetError",
    "PartitionColumnsWarning",
    "ReaderError",
    "RowIndexError",
    "RowIndexTypeError",
    "SchemaError",
    "SchemaMismatchError",
    "SecretInEnvWarning",
    "SecretTooShortWarning",
    "ShardkitError",
    "StorageFullError",
    "StorageOptionsError",
    "TableVersionError",
    "TimeZoneWarning",
    "TransformError",
    "UnknownArgumentError",
    "UnsafePickleError",
    "UnsupportedTableError",
    "UnsupportedURLError",
    "interrupt_behind",
    "one_line",
]


class ShardkitError(Exception):
    """Base of every error raised by shardkit."""


class DatasetError(ShardkitError):
    """A dataset on storage cannot be opened, written or read."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """Raised when nothing exists at the dataset URL."""


class NotADatasetError(DatasetError, ValueError):
    """Raised when the URL exists but holds no Parquet data (and no shardkit/Petastorm summary)."""


class DatasetExistsError(DatasetError, FileExistsError):
    """Raised by ``write_dataset(mode="error")`` when a dataset already exists at the URL."""


class CorruptDatasetError(DatasetError, OSError):
    """Raised when a data or summary file is truncated, corrupt, or not Parquet."""


class DatasetChangedError(CorruptDatasetError):
    """Raised when a data file was replaced (another ETag, size or mtime) after this process first read
    it: the row groups opened no longer describe it. Open the dataset again."""


class DatasetPermissionError(DatasetError, PermissionError):
    """Raised when a data or summary file may not be read, a folder listed, or written, by this user.

    Never a corruption: ``on_error="skip"`` does not skip it, and the message names the file and its
    owner and mode (or, on an object store, the credentials) to fix, never "remove it".
    """


class UnsafePickleError(DatasetError, ValueError):
    """Raised when a Petastorm schema pickle references anything outside the whitelist.

    The pickle is never executed: shardkit interprets its opcodes itself and refuses the first
    reference to a class that is not a Petastorm schema/codec class, a Spark type or a numpy dtype.
    """


class TableVersionError(DatasetError, LookupError):
    """Raised when a Delta version or Iceberg snapshot id asked for (``version=``, a resume state) is not
    one of the table's; the message lists the versions it has."""


class UnsupportedTableError(DatasetError, ValueError):
    """Raised when a Delta or Iceberg table needs what shardkit does not read: a protocol version or
    table feature it does not know, or deleted rows (deletion vectors, delete files) it cannot apply
    exactly. The message names the table, the version and the fix."""


class StorageFullError(DatasetError, OSError):
    """Raised when the disk or bucket a write goes to fills up (``ENOSPC``, ``EDQUOT``): nothing of the
    write is committed, the previous dataset is intact, and the message names the URL, the bytes this
    write had staged, the space left where that can be told, and the fix."""


class RowIndexError(DatasetError, IndexError):
    """Raised by random access (`shardkit.dataset.take`, ``dataset[i]``, ``shardkit.torch.MapDataset``)
    for a row index out of range, or a boolean mask whose length is not the dataset's number of rows. The
    message names the index, the dataset and its number of rows. An ``IndexError`` too, so ``for row in
    dataset`` ends as Python's sequence protocol expects."""


class RowIndexTypeError(RowIndexError, TypeError):
    """Raised by random access for an index that is not an integer: a float, a bool, a string, a nested
    list. A ``TypeError`` too, as Python's own ``[1, 2][1.0]`` raises."""


class SchemaError(ShardkitError, ValueError):
    """Raised when a schema, a field or a codec is invalid in itself (bad dtype, shape, codec option)."""


class SchemaMismatchError(SchemaError):
    """Raised when data does not fit the declared schema (missing column, wrong dtype/shape, null).

    Where the message is a problem and its fix, ``problem`` holds the first alone: a caller for whom the
    fix does not apply (an append, which keeps the dataset's schema) says the problem with its own fix.
    """

    def __init__(self, message: str, *, problem: str | None = None) -> None:
        super().__init__(message)
        self.problem = problem


class ImageShapeError(CorruptDatasetError, SchemaMismatchError):
    """Raised when a stored image is not of its field's size or pixel type, whether its header says so
    (checked before decoding: a few bytes can claim gigapixels) or its decoded pixels do: another height
    or width than a fixed-shape field's, more than 8 bits per sample (the field holds uint8), other
    channels than the field's (a grey image in an RGB field, of fixed or varying size), or a palette of
    colours in a grey field.

    A corruption (``on_error="skip"`` skips its row) and, as it was before headers were checked, a
    `SchemaMismatchError`: ``except`` clauses written for either keep working.
    """


class ReaderError(ShardkitError, ValueError):
    """Raised for bad reader arguments (shard, columns, filter) or a resume state that does not fit."""


class UnknownArgumentError(ReaderError, TypeError):
    """Raised for keyword arguments a reader function does not take, before it runs: Petastorm's names
    (``cur_shard``, ``schema_fields``, ...) with what shardkit takes instead, other names with the closest
    ones it takes. A ``TypeError`` too, as Python's own error for an unexpected keyword is."""


class TransformError(ReaderError):
    """Raised when a reader's per-sample transform (``transform=``) fails a batch: it raised on a sample
    (under ``on_error="raise"``; the original exception is chained), returned something other than a
    dict, returned a field whose shape or dtype differs from sample to sample, took longer than
    ``transform_timeout``, or its worker process died. The message names the sample (dataset, row group,
    row) and the fix."""


class AdapterError(ShardkitError, ValueError):
    """Raised when a framework adapter cannot represent a field (names the field and the options) or a
    requested device does not exist."""


class ConfigError(ShardkitError, ValueError):
    """Raised when a job config is invalid: the message names the key path (``roles.worker.count``)
    and the fix. Raised before any process starts."""


class CheckpointError(ShardkitError, OSError):
    """Raised when a checkpoint cannot be written, or none can be restored when one is required."""


class CorruptCheckpointError(CheckpointError):
    """Raised when a checkpoint's commit marker or files do not verify (size, checksum, format)."""


class CheckpointWarning(UserWarning):
    """Warned when a broken or incomplete newer checkpoint is skipped for an older complete one."""


class CacheWarning(UserWarning):
    """Warned when the default row-group cache (``cache="auto"``) cannot be used (its folder cannot be
    created): the reader reads the remote data without it."""


class PartitionColumnsWarning(UserWarning):
    """Warned when a dataset's files sit under Hive partition folders (``year=2020/``, Spark's
    ``partitionBy``): shardkit reads the files but not the partition columns in the folder names."""


class ColumnsLeftOutWarning(UserWarning):
    """Warned when a plain Parquet dataset has columns of types shardkit does not map to a field
    (decimals, times of day, structs, maps, zone-aware timestamps...): it opens without them, and each is
    named with the cast that makes it readable."""


class FilesLeftOutWarning(UserWarning):
    """Warned when ``shardkit write`` (`shardkit.dataset.convert.convert`) leaves out files of the folder
    or pattern it converts that are not in its data format (a README.txt, a notes.json beside Parquet
    files): each is named, so no data is left out unsaid."""


class TimeZoneWarning(UserWarning):
    """Warned when ``shardkit write`` stores times that carry a time zone (Arrow's ``timestamp[us,
    tz=...]``) as UTC wall times: each instant is kept, the zone is not (datetime64 has none). The
    message names the column and the zone."""


class SecretInEnvWarning(UserWarning):
    """Warned when a job config's ``env:`` has a name that looks like a credential (``API_TOKEN``,
    ``DB_PASSWORD``, ...; `shardkit.job.config.values.secret_word`), once per name as the config is
    validated: its value is treated as a secret (kept out of ``job.json``, ``processes.json`` and
    rendered specs, masked in output) but it is written in the config file itself. The message names the
    variable, never its value, and says to move it under ``secrets:``. A warning, not an error: a name can
    look like a credential and not be one."""


class SecretTooShortWarning(UserWarning):
    """Warned when a job's secret is empty or shorter than 4 characters: its value is not masked in the
    roles' output (masking it would mask ordinary text everywhere). The message names the secret, never
    its value."""


class JobError(ShardkitError, RuntimeError):
    """Raised when a training job fails for good (restarts exhausted); the message holds the history."""


class LostJobError(JobError):
    """Raised on a torchrun node that lost its job: the rendezvous store (node 0) did not answer for
    ``fault_tolerance.lost_job_timeout`` seconds (a partition, node 0 gone). Its workers were stopped;
    the message names the store's address, how long it was silent and what to do."""


class StorageOptionsError(ShardkitError, ValueError):
    """Raised when a key of ``storage_options`` is not taken by the URL's filesystem, before any request
    (the filesystem would raise ``TypeError`` at its first one); names the key, the URL, the options the
    filesystem takes and, for s3fs, where botocore's go."""


class MissingDependencyError(ShardkitError, ImportError):
    """Raised when an optional dependency is missing; the message names the extra to install."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the package {package!r}, which is not installed. "
            f"Install it with: pip install 'shardkit[{extra}]'"
        )
        self.package = package
        self.extra = extra


class MissingFilesystemError(MissingDependencyError):
    """Raised when a URL's protocol needs a filesystem that no shardkit extra installs (gcsfs for
    ``gs://``, adlfs for ``abfs://``, HDFS's native client): the message names it and how to install it."""

    def __init__(self, package: str, url: str, install: str) -> None:
        ImportError.__init__(self, f"{url!r} needs {package}, which is not installed or cannot be loaded. "
                                   f"{install}")
        self.package = package
        self.extra = ""


class UnsupportedURLError(ShardkitError, ValueError):
    """Raised when no filesystem serves a URL's protocol (``foo://``, a typo); the message names the URL."""


class EngineUnreachableError(ConfigError):
    """Raised within seconds when a cluster engine's address does not answer (``engine.master`` of a Spark
    standalone cluster, ``engine.address`` of a Ray cluster): the message names the address, the engine
    option and the fix. A `ConfigError`: nothing of the job has started."""


class CompletedRunError(ConfigError):
    """Raised before anything starts (``shardkit train``, exit 2; ``ctx.checkpoint.restore`` by hand) when
    the job's checkpoint folder holds a run that completed and the new run did not choose what to do with
    it: the message names the logdir, when the run completed, the overrides that would change what a
    resumed run trains, and the choices (``--resume``, ``--fresh``, another logdir; by hand
    ``SHARDKIT_RERUN=resume`` / ``fresh``)."""


def require(module: str, *, extra: str, purpose: str) -> object:
    """Import an optional dependency or raise `MissingDependencyError` with the install hint."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(module.split(".", maxsplit=1)[0], extra, purpose) from e


def one_line(text: object) -> str:
    r"""``text`` (another library's error) fit to go inside a shardkit message: one line, whitespace runs
    as one space, control characters escaped (Arrow's Thrift errors hold newlines and raw bytes).

    Example:
        >>> one_line("Couldn't deserialize thrift: \x0f\nDeserializing page header failed.")
        "Couldn't deserialize thrift: \\x0f Deserializing page header failed."
    """
    words = " ".join(str(text).split())
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in words)


def interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (``KeyboardInterrupt``) that ``error`` was raised from or while handling, if any;
    ``None`` for a ``KeyboardInterrupt`` itself. A SIGINT that lands in a Python file object that pyarrow
    reads or writes through from C++ can come out as pyarrow's own error with the interrupt as its
    context (a CI run of ``shardkit write``: ``ValueError: I/O operation on closed file``): the work was
    interrupted, and the caller says so rather than print a traceback."""
    seen: set[int] = set()
    cause = None if isinstance(error, KeyboardInterrupt) else error.__cause__ or error.__context__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None
