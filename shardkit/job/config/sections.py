"""The sections of a job config: the validated, frozen pydantic models of ``resources``, ``roles``, ``data``,
``checkpoint``, ``fault_tolerance``, ``engine`` and ``secrets`` that `JobConfig` is made of, and the base
model and error helpers they share with it."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shardkit.job.config._paths import absolute, location
from shardkit.job.config.values import NO_VALUE as _NO_VALUE
from shardkit.job.config.values import Problem, plain_data_problems

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "ENGINES",
    "EngineConfig",
    "EngineName",
    "FaultTolerance",
    "MAX_CPUS",
    "MAX_GPUS",
    "MAX_PROCESSES",
    "MIN_COLLECTIVE_TIMEOUT",
    "MIN_HEARTBEAT_INTERVAL",
    "MIN_LOST_JOB_TIMEOUT",
    "Resources",
    "RoleConfig",
    "SecretRef",
    "SourceConfig",
]

EngineName = Literal["local", "torchrun", "ray", "spark", "kubernetes", "yarn"]
ENGINES: tuple[str, ...] = get_args(EngineName)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MAX_MEMORY = 2**63  # bytes: no 64-bit count holds it (Ray, YARN and Kubernetes count in int64)
_MEMORY = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*\Z", re.IGNORECASE)
#: Per process: more CPUs or GPUs than any machine has are a slip (``gpus: 1e30`` passed before).
MAX_CPUS, MAX_GPUS = 4096, 256
#: Seconds: heartbeats more often are no more use (the supervisor polls every 0.1 s), only more datagrams.
MIN_HEARTBEAT_INTERVAL = 0.01
#: Seconds: below these, a loaded machine's pauses would end healthy nodes and collectives (`FaultTolerance`).
MIN_LOST_JOB_TIMEOUT, MIN_COLLECTIVE_TIMEOUT = 3.0, 1.0
#: Seconds: ``fault_tolerance.lost_job_timeout``'s default. With ``engine.grace`` (5 s) after it, what the
#: job started on a host cut off from it ends within a minute of the cut.
DEFAULT_LOST_JOB_TIMEOUT = 45.0
#: The most processes a role, and a whole job, may have (see `RoleConfig`).
MAX_PROCESSES = 10_000
#: `shardkit.make_reader`'s arguments, in its order (a test holds them to its signature): named here so
#: that checking a config does not import the reader, whose pyarrow.dataset and pandas were most of the
#: time from `shardkit train` to its first process.
READER_ARGUMENTS = ("url", "shard", "num_shards", "batch_size", "columns", "filter", "shuffle", "seed",
                    "num_epochs", "remainder", "drop_last", "shuffle_buffer", "cache", "prefetch", "workers",
                    "max_inflight_bytes", "on_error", "storage_options", "version", "schema", "weights",
                    "samples_per_epoch", "reweight", "transform", "transform_workers", "transform_timeout",
                    "decode", "variable", "quick_start")
# Keys of make_reader that the trainer sets itself (from the job and the process's shard).
_READER_OWNED = frozenset({"url", "shard", "num_shards", "batch_size", "seed", "shuffle", "num_epochs"})
_PER_SOURCE = ("filter", "version", "storage_options")  # a mixture's source's own make_reader options
# Keys of make_reader that a mixture's config gives elsewhere, with where
_MIXTURE_KEYS = {"weights": "give each source its weight: data.sources.<name>.weight",
                 "samples_per_epoch": "use data.samples_per_epoch (with data.sources)"}
# storage_options keys that hold credentials (s3fs, gcsfs, adlfs, fsspec's http/ftp/sftp/smb): a config
# value lands in job.json, the processes' logs and rendered specs in plain text; secrets: does not
_CREDENTIAL_KEYS = frozenset({"key", "secret", "token", "password", "session_token", "account_key",
                              "sas_token", "client_secret", "connection_string", "aws_access_key_id",
                              "aws_secret_access_key", "aws_session_token", "credentials"})
_NOT_SECRET_TOKENS = frozenset({"anon", "google_default", "cloud", "browser", "cache"})  # gcsfs's modes


class _Model(BaseModel):
    # allow_inf_nan=False: .inf and .nan are no timeout, interval or CPU count (``every_seconds: .inf`` would
    # crash the chief's save schedule mid-run); "never" is null, or the key left out, where it exists.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Resources(_Model):
    """What one process of a role needs: ``{cpus: 1, gpus: 0, memory: 2G}``.

    ``memory`` is read in binary units (``512M``, ``2G``, ``1.5Gi``, ``2GB`` all mean powers of 1024, as
    Docker and the JVM read them) and stored in bytes; None means no limit. Engines that schedule
    (kubernetes, yarn, ray) use these; where the processes run on this machine, GPUs it lacks are
    refused before anything starts (`shardkit.cluster.monitor.preflight.check_local_gpus`).
    """

    cpus: float = Field(default=1.0, gt=0, le=MAX_CPUS)
    gpus: int = Field(default=0, ge=0, le=MAX_GPUS)
    memory: int | None = Field(default=None, gt=0)

    @field_validator("memory", mode="before")
    @classmethod
    def _parse_memory(cls, value: Any) -> Any:
        if isinstance(value, float):  # 1.5 bytes: a unit was meant
            raise Problem((), value, "a number without a unit is a count of bytes, and this one is not whole",
                          f"write a number and a unit, e.g. {value:g}G or {value:g}M")
        if isinstance(value, str):
            match = _MEMORY.match(value)
            if match is None:
                raise Problem((), value, "not a memory size",
                              "write a number and a unit, e.g. 512M, 2G or 1.5Gi")
            number, unit = float(match.group(1)), match.group(2).lower()
            size = int(number * 1024 ** " kmgtp".index(unit or " "))
            if size < 1:  # "0.4": shown as the user wrote it, not as the 0 bytes it rounds to
                raise Problem((), value, "less than 1 byte", "write a size with a unit, e.g. 512M or 2G")
        elif type(value) is int:
            size = value
        else:
            return value  # the strict int check names the type
        if size >= _MAX_MEMORY:
            raise Problem((), value, "8 EiB or more, more than any machine has (and than a 64-bit count of "
                          "bytes can hold, which Kubernetes, YARN and Ray need)",
                          "write the size a process needs, e.g. 2G")
        return size


class RoleConfig(_Model):
    """One role: ``worker: {count: 2, resources: {...}}``; 1 to `MAX_PROCESSES` processes.

    The bound is there so that a slip (``count: 100000000000``) fails here, not after minutes of
    building a cluster spec that no machine could start; 10,000 is far above the largest jobs one
    supervisor or torchrun agent runs (each process is an entry in ``TF_CONFIG``, a log file, ...).
    """

    count: int = 1
    resources: Resources = Field(default_factory=Resources)

    @field_validator("count")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise Problem((), value, "a role needs at least 1 process",
                          "set it to 1 or more, or remove the role (where the strategy allows)")
        if value > MAX_PROCESSES:
            raise Problem((), value, f"more than {MAX_PROCESSES:,} processes in one role (shardkit's limit)",
                          f"set it to {MAX_PROCESSES} or less")
        return value


class SourceConfig(_Model):
    """One source of a mixture (``data.sources.<name>``): ``{url: s3://lake/web, weight: 3}``.

    ``url`` is resolved as ``data.url`` is. ``weight``: its share of the stream is its weight over the
    sum of the sources' (0 leaves it out); give every source one, or none (then the sources weigh as
    their rows). A weight may change with the samples the job has read: a list of ``[samples, weight]``
    pairs runs linearly from one to the next (``weight: [[0, 3], [1000000, 1]]``), ``{steps: [[samples,
    weight], ...]}`` holds each weight until the next point (`shardkit.reader.mixture.WeightSchedule`).
    ``filter``, ``version`` and ``storage_options`` are this source's own `make_reader` options (a filter
    for every source goes in ``data.options.filter``).
    """

    url: str
    weight: Any = None
    filter: Any = None
    version: int | None = Field(default=None, ge=0)
    storage_options: dict[str, Any] | None = None

    @field_validator("url")
    @classmethod
    def _resolve_url(cls, value: str) -> str:
        if not value.strip():
            raise Problem((), value, "the source's URL is empty", "give the dataset's folder or URL")
        return location(value)

    @field_validator("weight")
    @classmethod
    def _weight_or_schedule(cls, value: Any) -> Any:
        _schedule_points(value)
        return value

    @field_validator("storage_options")
    @classmethod
    def _no_credentials(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:  # the paths of these problems are below the field, not data.options
            found = [Problem(path[1:], bad, problem, fix) for p in _credential_problems(value)
                     for path, bad, problem, fix in p.items]
            _raise_all(found or plain_data_problems(value))
        return value

    @field_validator("filter")
    @classmethod
    def _plain_filter(cls, value: Any) -> Any:
        _raise_all(plain_data_problems({"filter": value}))
        return value


class DataConfig(_Model):
    """The job's dataset; each data-reading process opens its own shard with `make_reader`.

    ``url`` is resolved against the config file's folder unless it has a scheme (``s3://...``).
    ``options`` are more `shardkit.make_reader` keyword arguments (``columns``, ``filter``, ``cache``,
    ...); their names are checked against make_reader's signature here, their values when the reader
    opens. ``shard``/``num_shards`` come from the process's place in the job, never from the config.

    A mixture of datasets gives ``sources`` instead of ``url`` (name -> `SourceConfig`, with weights) and
    may give ``samples_per_epoch``, the epoch's samples of all sources together (default: their rows)::

        data: {sources: {web: {url: s3://lake/web, weight: 3}, books: {url: s3://lake/books, weight: 1}},
               samples_per_epoch: 1000000, batch_size: 256}
    """

    url: str | None = None
    sources: dict[str, SourceConfig] | None = None
    samples_per_epoch: int | None = Field(default=None, ge=1)
    batch_size: int = Field(default=256, ge=1)
    seed: int = Field(default=0, ge=0)
    shuffle: bool = True
    num_epochs: int | None = Field(default=1, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _resolve_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise Problem((), value, "the data URL is empty", "give the dataset's folder or URL")
        return location(value)

    @field_validator("options")
    @classmethod
    def _known_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:
            return value
        allowed = [name for name in READER_ARGUMENTS if name not in _READER_OWNED]
        problems: list[Problem] = []
        for key, option in value.items():
            if key in _MIXTURE_KEYS:
                problems.append(Problem((key,), option, f"{key!r} belongs to a mixture's sources",
                                        _MIXTURE_KEYS[key]))
            elif key in _READER_OWNED:
                fix = f"use data.{key} instead" if key not in ("url", "shard", "num_shards") else (
                    "remove it: the trainer sets it for each process")
                problems.append(Problem((key,), option, f"{key!r} is set by the trainer, not in data.options",
                                        fix))
            elif key not in allowed:
                problems.append(Problem((key,), option, f"make_reader has no argument {key!r}",
                                        _did_you_mean(key, allowed)))
            elif key == "storage_options" and isinstance(option, Mapping):
                problems.extend(_credential_problems(option))
        _raise_all(problems or plain_data_problems(value))
        return value

    @model_validator(mode="after")
    def _one_dataset_or_sources(self) -> DataConfig:
        if (self.url is None) == (self.sources is None):
            both = self.url is not None
            raise Problem(("url",), self.url if both else _NO_VALUE,
                          "both url and sources are given" if both else "missing (and so is data.sources)",
                          ("keep one: url: for one dataset, or sources: for a mixture" if both else
                           "add url: <the dataset's folder or URL>, or sources: {name: {url: ..., weight: "
                           "...}} for a mixture of several"))
        if self.sources is None:
            if self.samples_per_epoch is not None:
                raise Problem(("samples_per_epoch",), self.samples_per_epoch,
                              "samples_per_epoch is for a mixture (data.sources)",
                              "remove it: an epoch of one dataset is its rows")
            return self
        if not self.sources:
            raise Problem(("sources",), self.sources, "no source is given",
                          "give at least one: sources: {web: {url: s3://lake/web, weight: 1}}")
        weighed = [name for name, source in self.sources.items() if source.weight is not None]
        if weighed and len(weighed) < len(self.sources):
            missing = [name for name in self.sources if name not in weighed]
            raise Problem(("sources", missing[0], "weight"), _NO_VALUE,
                          f"the sources {weighed} have a weight and {missing} do not",
                          "give every source a weight (0 leaves one out), or none (they then weigh as "
                          "their rows)")
        if weighed:
            points = {name: _schedule_points(s.weight) for name, s in self.sources.items()}
            for x in sorted({0, *(x for pairs in points.values() for x, _, _ in pairs)}):
                if not any(_weight_at(pairs, x) for pairs in points.values()):
                    constant = all(not isinstance(s.weight, list | dict) for s in self.sources.values())
                    raise Problem(("sources",), {n: s.weight for n, s in self.sources.items()},
                                  "every source's weight is 0" + ("" if constant else f" at {x:,} samples")
                                  + ", so none would be read" + ("" if constant else " there"),
                                  "give at least one source a positive weight" + (
                                      "" if constant else " at every point of the schedules"))
        problems = [Problem(("sources", name, key), getattr(source, key),
                            f"data.options.{key} is set too, for every source",
                            f"give {key} either per source or in data.options, not both")
                    for name, source in self.sources.items() for key in _PER_SOURCE
                    if getattr(source, key) is not None and key in self.options]
        _raise_all(problems)
        return self

    def reader_kwargs(self) -> dict[str, Any]:
        """The `make_reader` arguments of this section (but the shard): ``url`` is the dataset's, or a
        mixture's dict of its sources' URLs, with ``weights``, ``samples_per_epoch`` and the per-source
        ``filter``, ``version`` and ``storage_options`` as dicts of source name -> value."""
        kwargs: dict[str, Any] = {"batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle,
                                  "num_epochs": self.num_epochs, **self.options}
        if self.sources is None:
            return {"url": self.url, **kwargs}
        kwargs["url"] = {name: source.url for name, source in self.sources.items()}
        if any(source.weight is not None for source in self.sources.values()):
            kwargs["weights"] = {name: source.weight for name, source in self.sources.items()}
        if self.samples_per_epoch is not None:
            kwargs["samples_per_epoch"] = self.samples_per_epoch
        for key in _PER_SOURCE:
            given = {name: getattr(source, key) for name, source in self.sources.items()
                     if getattr(source, key) is not None}
            if given:
                kwargs[key] = given
        return kwargs


def _schedule_points(value: Any) -> list[tuple[int, float, str]]:
    """A source's ``weight`` as ``(samples, weight, kind)`` points (none: no weight), or a `Problem`: a number
    >= 0, ``[[samples, weight], ...]`` (samples ints >= 0 that increase) or ``{linear|steps: pairs}``. The
    reader checks the same (`shardkit.reader.mixture.check_weights`); this is so that a bad schedule fails
    before any process starts."""
    example = "[[0, 3], [1000000, 1]]"
    if value is None:
        return []
    kind = "linear"
    if isinstance(value, dict):
        if len(value) != 1 or next(iter(value)) not in ("linear", "steps"):
            raise Problem((), value, "a weight given as a mapping has one key, linear or steps",
                          f"write weight: {example} (linear between points) or weight: {{steps: {example}}}")
        kind, value = next(iter(value.items()))
        path: tuple[str, ...] = (kind,)
    else:
        path = ()
    if not isinstance(value, list):
        if not _finite(value):
            raise Problem(path, value, "a weight is a number >= 0 or a schedule",
                          f"write a number, or [samples, weight] pairs: weight: {example}")
        if value < 0:
            raise Problem(path, value, "the weight is negative: it must be greater than or equal to 0",
                          "give a weight >= 0 (0 leaves the source out)")
        return [(0, float(value), "steps")]
    if not value:
        raise Problem(path, value, "the schedule has no points", f"give [samples, weight] pairs: {example}")
    out: list[tuple[int, float, str]] = []
    for j, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise Problem((*path, j), pair, "not a [samples, weight] pair", f"write pairs: {example}")
        x, w = pair
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise Problem((*path, j, 0), x, "a point's samples are an int >= 0",
                          "give the samples the job has read at that point (all shards together)")
        if out and x <= out[-1][0]:
            raise Problem((*path, j, 0), x, f"the points' samples must increase (after {out[-1][0]})",
                          "sort the points and give each place once")
        if not _finite(w):
            raise Problem((*path, j, 1), w, "a weight is a number", "give a number >= 0")
        if w < 0:
            raise Problem((*path, j, 1), w, "the weight is negative: it must be greater than or equal to 0",
                          "give a weight >= 0 (0 leaves the source out there)")
        out.append((x, float(w), kind))
    return out


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _weight_at(points: Sequence[tuple[int, float, str]], x: int) -> float:
    """The weight of ``points`` (`_schedule_points`) at ``x`` samples (0: no points)."""
    if not points:
        return 0.0
    before = [p for p in points if p[0] <= x]
    if not before:
        return points[0][1]
    x0, w0, kind = before[-1]
    if kind == "steps" or len(before) == len(points):
        return w0
    x1, w1, _ = points[len(before)]
    return w0 + (w1 - w0) * (x - x0) / (x1 - x0)


def _credential_problems(options: Mapping[str, Any]) -> Iterator[Problem]:
    """Credentials written in ``data.options.storage_options``: refused (their values are not shown), since
    the config is copied in plain text into job.json, the role processes' logs and rendered specs."""
    for name, value in options.items():
        if str(name).lower() not in _CREDENTIAL_KEYS or value is None:
            continue
        if str(name).lower() == "token" and isinstance(value, str) and value in _NOT_SECRET_TOKENS:
            continue
        yield Problem(("storage_options", str(name)), _NO_VALUE,
                      "a credential in the config is copied in plain text into job.json, the processes' "
                      "logs and rendered Kubernetes/YARN specs (its value is not shown here)",
                      "remove it, and give it as a secret the filesystem reads from the environment, e.g. "
                      "secrets: {AWS_SECRET_ACCESS_KEY: {env: MY_SECRET}} (and AWS_ACCESS_KEY_ID) for s3fs, "
                      "or point to a credentials file")


class CheckpointConfig(_Model):
    """``{dir, every_steps, every_seconds, keep}``; with neither ``every_*``, only the script's own
    `ctx.checkpoint.save()` calls write checkpoints. ``dir`` is any fsspec URL; it defaults to
    ``<logdir>/checkpoints`` and is never None in a `JobConfig` (use `JobConfig.checkpoint_dir`)."""

    dir: str | None = None
    every_steps: int | None = Field(default=None, ge=1)
    every_seconds: float | None = Field(default=None, gt=0)
    keep: int = Field(default=3, ge=1)

    @field_validator("dir")
    @classmethod
    def _resolve_dir(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip():  # would be the config file's folder itself
            raise Problem((), value, "the checkpoint folder is empty",
                          "give a folder or URL, or null for <logdir>/checkpoints")
        return location(value)


class FaultTolerance(_Model):
    """Restart policy: a role silent for ``heartbeat_timeout`` seconds after its first heartbeat (or
    ``startup_timeout`` before it), or dead, stops the group, which restarts up to ``max_restarts``.

    Across machines, ``startup_timeout`` also bounds a torchrun node's first rendezvous: a node whose
    peers never come (node 0 refused or never started, a node that crashed before joining) exits with
    code 1 after it, with one line naming what it waited for (or after ``engine.rdzv_conf.join_timeout``
    where that is shorter). Two more bounds (seconds):

    - ``lost_job_timeout`` (default 45, at least 3): a torchrun node whose rendezvous store (hosted by
      node 0) has not answered for this long, once the job has started (a partition, node 0's machine
      or agent gone), has lost the job: it stops its workers and exits with code 1 a few seconds later
      (``engine.grace`` for its workers to stop, and a connection attempt of up to 2 s), its summary
      and last line naming the store and what to do. The other nodes go on without it where
      ``nnodes`` allows. On ray and spark, an actor or task that has not heard from the job's driver
      for this long stops its process and exits, and a Spark session the engine creates has its
      executors give up on the driver after about as long. With the default ``engine.grace``, what
      the job started on a cut-off host ends within a minute of the cut: short enough that it frees
      its GPUs soon; long enough to ride out a brief network blip.
    - ``collective_timeout`` (default 300): torch.distributed's timeout for one collective (gloo,
      NCCL), given to ``init_process_group`` in every worker of every engine, instead of torch's 30
      minutes: a worker blocked in an allreduce whose peers vanished fails in bounded time. Longer
      than the longest legitimate wait of one rank for the others (rank 0 writing a large
      checkpoint while the others wait in the next allreduce).
    """

    max_restarts: int = Field(default=3, ge=0)
    heartbeat_interval: float = Field(default=1.0, ge=MIN_HEARTBEAT_INTERVAL)
    heartbeat_timeout: float = Field(default=30.0, gt=0)
    startup_timeout: float = Field(default=120.0, gt=0)
    lost_job_timeout: float = Field(default=DEFAULT_LOST_JOB_TIMEOUT, ge=MIN_LOST_JOB_TIMEOUT)
    collective_timeout: float = Field(default=300.0, ge=MIN_COLLECTIVE_TIMEOUT)

    @model_validator(mode="after")
    def _timeout_after_interval(self) -> FaultTolerance:
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise Problem(("heartbeat_timeout",), self.heartbeat_timeout,
                          f"it is not longer than heartbeat_interval ({self.heartbeat_interval})",
                          "make heartbeat_timeout several times heartbeat_interval (e.g. 30 and 1)")
        return self


class EngineConfig(_Model):
    """Where the processes run. YAML ``engine: local`` or ``engine: {name: ray, address: auto}``: every
    key but ``name`` lands in ``options``, which the engine checks when it is built (``run_job``, and
    ``shardkit validate`` through `shardkit.cluster.engines.check_engine`), or the renderer."""

    name: EngineName = "local"
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _plain_options(self) -> EngineConfig:
        # after, not on the field: reported as engine.<option>, as the YAML writes it and the engines report
        _raise_all(plain_data_problems(self.options))
        return self

    @model_validator(mode="before")
    @classmethod
    def _from_yaml(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"name": value}
        if isinstance(value, Mapping) and not set(value) <= {"name", "options"}:
            options = {k: v for k, v in value.items() if k != "name"}
            return {"name": value.get("name", "local"), "options": options}
        return value


class SecretRef(_Model):
    """Where a secret's value comes from: ``{env: VAR}`` (this process's environment) or ``{file: path}``
    (the file's text without its trailing newline). Only the reference is stored; the value is read by
    `JobConfig.secret_values` and goes only into the roles' environment: ``job.json`` and rendered specs
    name it, ``processes.json`` shows ``<redacted>``, and what the roles print shows ``***`` (a value of
    4 characters or more). An ``env:`` entry whose name looks like a credential (a part of it ends with
    TOKEN, SECRET, PASSWORD, PASSWD, PASSPHRASE, KEY, CREDENTIAL, CRED or AUTH, or is PASS, PWD, PAT or
    AUTHORIZATION: ``API_TOKEN``, ``DB_PASSWORD``; `shardkit.job.config.values.secret_word`) is a secret
    too, with a `SecretInEnvWarning` that says to move it here, since the config file holds its value.
    Not protected: the config file, a value the script transforms before printing it, or writes to its
    own files (the training jobs guide, Secrets)."""

    env: str | None = None
    file: Path | None = None

    @field_validator("env")
    @classmethod
    def _variable(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.match(value):  # it would only ever be "not set"
            raise Problem((), value, "not an environment variable name",
                          "use letters, digits and _, not starting with a digit")
        return value

    @field_validator("file", mode="before")
    @classmethod
    def _resolve_file(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # would be the config file's folder
            raise Problem((), value, "the file name is empty",
                          "write {file: path/to/file} or {env: VARIABLE}")
        return absolute(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _exactly_one(self) -> SecretRef:
        if (self.env is None) == (self.file is None):
            raise Problem((), self.model_dump(exclude_none=True), "a secret needs exactly one source",
                          "write {env: VARIABLE} or {file: path/to/file}")
        return self


def _raise_all(problems: list[Problem]) -> None:
    """Raise ``problems`` as one `Problem` (pydantic then reports them together), if there are any."""
    if problems:
        first = problems[0]
        for other in problems[1:]:
            first.add(other)
        raise first


def _did_you_mean(key: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}remove it or use one of: {', '.join(sorted(allowed))}"
