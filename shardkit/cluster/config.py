"""The job config of `shardkit train`: the validated, frozen `JobConfig` model (YAML loading is in
`shardkit.cluster.config_load`; its public names are importable from here too)."""

from __future__ import annotations

import contextvars
import difflib
import inspect
import os
import re
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from shardkit.cluster.config_paths import BASE_DIR, absolute, in_yaml_dir, location, plain_path
from shardkit.cluster.config_values import NO_VALUE as _NO_VALUE
from shardkit.cluster.config_values import Problem, plain_data_problems
from shardkit.cluster.protocol import ALL_ENV
from shardkit.errors import ConfigError

if TYPE_CHECKING:
    from shardkit.cluster.config_load import describe, load_config, translate

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "EngineConfig",
    "FaultTolerance",
    "JobConfig",
    "MAX_PROCESSES",
    "Resources",
    "RoleConfig",
    "SecretRef",
    "describe",
    "load_config",
    "translate",
]

Framework = Literal["torch", "tensorflow"]
Strategy = Literal["allreduce", "parameter_server"]
RoleName = Literal["worker", "ps", "chief", "evaluator"]
EngineName = Literal["local", "torchrun", "ray", "spark", "kubernetes", "yarn"]
ENGINES: tuple[str, ...] = get_args(EngineName)

# Which file errors name, while validating (where relative paths resolve: `config_paths.BASE_DIR`).
_SOURCE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("shardkit_config_source", default=None)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_FUNCTION = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*\Z")
_MAX_MEMORY = 2**63  # bytes: no 64-bit count holds it (Ray, YARN and Kubernetes count in int64)
_MEMORY = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*\Z", re.IGNORECASE)
_SECTIONS = frozenset({"checkpoint", "fault_tolerance", "engine", "params", "env", "secrets", "python"})
#: Per process: more CPUs or GPUs than any machine has are a slip (``gpus: 1e30`` passed before).
MAX_CPUS, MAX_GPUS = 4096, 256
#: Seconds: heartbeats more often are no more use (the supervisor polls every 0.1 s), only more datagrams.
MIN_HEARTBEAT_INTERVAL = 0.01
#: The most processes a role, and a whole job, may have (see `RoleConfig`).
MAX_PROCESSES = 10_000
# Keys of make_reader that the trainer sets itself (from the job and the process's shard).
_READER_OWNED = frozenset({"url", "shard", "num_shards", "batch_size", "seed", "shuffle", "num_epochs"})
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
    refused before anything starts (`shardkit.cluster.preflight.check_local_gpus`).
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


class DataConfig(_Model):
    """The job's dataset; each data-reading process opens its own shard with `make_reader`.

    ``url`` is resolved against the config file's folder unless it has a scheme (``s3://...``).
    ``options`` are more `shardkit.make_reader` keyword arguments (``columns``, ``filter``, ``cache``,
    ...); their names are checked against make_reader's signature here, their values when the reader
    opens. ``shard``/``num_shards`` come from the process's place in the job, never from the config.
    """

    url: str
    batch_size: int = Field(default=256, ge=1)
    seed: int = Field(default=0, ge=0)
    shuffle: bool = True
    num_epochs: int | None = Field(default=1, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _resolve_url(cls, value: str) -> str:
        if not value.strip():
            raise Problem((), value, "the data URL is empty", "give the dataset's folder or URL")
        return location(value)

    @field_validator("options")
    @classmethod
    def _known_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:
            return value
        from shardkit.reader.api import make_reader  # lazily: the reader pulls in pyarrow

        allowed = [name for name in inspect.signature(make_reader).parameters if name not in _READER_OWNED]
        problems: list[Problem] = []
        for key, option in value.items():
            if key in _READER_OWNED:
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
    ``startup_timeout`` before it), or dead, stops the group, which restarts up to ``max_restarts``."""

    max_restarts: int = Field(default=3, ge=0)
    heartbeat_interval: float = Field(default=1.0, ge=MIN_HEARTBEAT_INTERVAL)
    heartbeat_timeout: float = Field(default=30.0, gt=0)
    startup_timeout: float = Field(default=120.0, gt=0)

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
    `JobConfig.secret_values` and goes only into the roles' environment."""

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


class JobConfig(_Model):
    """A validated job: what `shardkit train` starts. Build it with `load_config` (or `from_dict`).

    Example:
        >>> config = load_config("examples/digits.yaml", ["roles.worker.count=4"])
        >>> config.roles["worker"].count, config.entrypoint_kind, config.checkpoint_dir
        (4, 'script', '/.../runs/digits-job/checkpoints')

    Choices: relative paths (entrypoint script, data url, logdir, checkpoint dir, secret files,
    python) resolve against the YAML file's folder and are absolute here. A TensorFlow
    parameter-server job gets ``roles.chief: {count: 1}`` implicitly (its coordinator); torch jobs have
    no chief role (rank 0 is the chief). ``chief`` and ``evaluator`` have exactly 1 process. A
    ``module:function`` entrypoint is checked for syntax here and imported by the role at start
    (``shardkit.trainer.run``), since only the role's interpreter can tell whether it imports.
    ``env`` and ``secrets`` may not set the variables the trainer sets (``RANK``, ``TF_CONFIG``, ...).
    A script entrypoint is a ``.py`` file (``python`` runs it in each role; a file without the suffix is
    far more often a slip than a script). ``params``, ``data.options`` and engine options reach the roles
    as JSON (``job.json``), so they must be what JSON holds unchanged
    (`shardkit.cluster.config_values.plain_data_problems`): a config that would reach the script
    changed fails here, not in the script. Floats are finite everywhere.
    """

    name: str
    entrypoint: str
    framework: Framework
    strategy: Strategy = "allreduce"
    roles: dict[RoleName, RoleConfig]
    data: DataConfig | None = None
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault_tolerance: FaultTolerance = Field(default_factory=FaultTolerance)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    logdir: Path = Field(default=None, validate_default=True)  # type: ignore[assignment]
    python: Path = Field(default=None, validate_default=True)  # type: ignore[assignment]
    params: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    secrets: dict[str, SecretRef] = Field(default_factory=dict)

    _source: Path | None = PrivateAttr(default=None)
    # where each key path was set (``line 5``, ``from --set engine.x``), for errors found after loading
    _where: dict[tuple[str, ...], str] = PrivateAttr(default_factory=dict)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _translate(e, _SOURCE.get()) from None  # pydantic's text would repeat every input
        self._source = _SOURCE.get()

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # An empty YAML section (`checkpoint:` with nothing under it) means its defaults.
        data = {k: v for k, v in data.items() if v is not None or k not in _SECTIONS}
        if data.get("logdir") is None:
            name = data.get("name")
            data["logdir"] = f"runs/{name if isinstance(name, str) else 'job'}"  # a bad name: reported once
        checkpoint = data.get("checkpoint")
        if checkpoint is None:
            checkpoint = {}
        logdir = data.get("logdir")
        if (isinstance(checkpoint, dict) and checkpoint.get("dir") is None and isinstance(logdir, str | Path)
                and plain_path(str(logdir))):  # else logdir's problem is told once, not again as the dir's
            data["checkpoint"] = {**checkpoint, "dir": os.path.join(logdir, "checkpoints")}
        roles = data.get("roles")
        if (data.get("framework"), data.get("strategy")) == ("tensorflow", "parameter_server") and (
            isinstance(roles, dict) and "chief" not in roles
        ):
            data["roles"] = {**roles, "chief": {"count": 1}}
        if isinstance(data.get("env"), dict):
            # YAML reads OMP_NUM_THREADS: 1 as a number; an environment value is a string anyway.
            data["env"] = {k: str(v) if type(v) in (int, float) else v for k, v in data["env"].items()}
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", value):
            raise Problem((), value, "a job name is 1-63 letters, digits, '.', '_' or '-' (used in paths)",
                          "rename it, e.g. digits-ddp")
        return value

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, value: str) -> str:
        if _FUNCTION.match(value) and not value.endswith(".py"):
            return value
        path = absolute(value)
        words = value.split()
        if len(words) > 1 and not path.exists() and absolute(words[0]).is_file():
            raise Problem((), value, "an entrypoint is a script or a function, without command-line "
                          "arguments", f"write entrypoint: {words[0]} and put the values in params "
                          "(ctx.params in the script)")
        if path.is_dir():
            raise Problem((), value, f"{path} is a folder, not a script",
                          "give the .py file the roles run, or package.module:function")
        if not path.is_file():
            raise Problem((), value, f"the script {path} does not exist",
                          f"correct the path ({in_yaml_dir()}) or use package.module:function")
        if path.suffix.lower() != ".py":
            raise Problem((), value, f"{path} is not a Python script (.py)",
                          "give the .py file the roles run with python, or package.module:function")
        return str(path)

    @field_validator("logdir", mode="before")
    @classmethod
    def _logdir(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            # it would be the config file's folder, whose logs/ and tensorboard/ a run clears
            raise Problem((), value, "the logdir is empty", "give a folder, or null for runs/<name>")
        return absolute(value) if isinstance(value, str | Path) else value

    @field_validator("params")
    @classmethod
    def _plain_params(cls, value: dict[str, Any]) -> dict[str, Any]:
        _raise_all(plain_data_problems(value))
        return value

    @field_validator("python", mode="before")
    @classmethod
    def _python(cls, value: Any) -> Any:
        if value is None:
            return Path(sys.executable)
        if not isinstance(value, str | Path):
            return value  # the strict Path check names the type
        path = absolute(value)
        if not path.exists() and os.sep not in str(value) and shutil.which(str(value)):
            path = Path(shutil.which(str(value)) or value)  # a bare name such as python3.11: from PATH
        if path.is_dir():
            path = next((path / p for p in ("bin/python", "bin/python3", "Scripts/python.exe")
                         if (path / p).is_file()), path / "bin/python")
        if not path.is_file() or not os.access(path, os.X_OK):
            raise Problem((), str(value), f"{path} is not an executable Python interpreter",
                          "give an interpreter (/opt/venv/bin/python), a virtual environment's folder, "
                          f"or leave it out for {sys.executable}; {in_yaml_dir()}")
        return path

    @field_validator("env", "secrets")
    @classmethod
    def _variable_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        problems: list[Problem] = []
        for key, item in value.items():
            if not _ENV_NAME.match(key):
                problems.append(Problem((key,), key, "not an environment variable name",
                                        "use letters, digits and _, not starting with a digit"))
            elif key in ALL_ENV:
                problems.append(Problem((key,), key, "the trainer sets this variable for every process",
                                        "remove it; scripts get it from shardkit.trainer.init()"))
            elif isinstance(item, str) and "\0" in item:  # no process could be started with it
                problems.append(Problem((key,), item, "the value holds a NUL character",
                                        "an environment variable cannot hold NUL; remove the \\0"))
        _raise_all(problems)
        return value

    @model_validator(mode="after")
    def _roles(self) -> JobConfig:
        problems = [*_role_problems(self), *_params_problems(self)]
        for key in sorted(self.env.keys() & self.secrets.keys()):
            problems.append(Problem(("secrets", key), _NO_VALUE, f"{key} is also in env",
                                    f"remove env.{key} or secrets.{key}"))
        _raise_all(problems)
        return self

    # -- derived views -----------------------------------------------------------------------------

    @property
    def source(self) -> Path | None:
        """The YAML file this config came from (None when built in Python)."""
        return self._source

    @property
    def entrypoint_kind(self) -> Literal["script", "function"]:
        """``"script"`` (``entrypoint`` is an absolute path) or ``"function"`` (``module:function``)."""
        return "script" if os.path.isabs(self.entrypoint) else "function"

    @property
    def checkpoint_dir(self) -> str:
        """The checkpoint folder or URL (``<logdir>/checkpoints`` unless configured)."""
        return self.checkpoint.dir or str(self.logdir / "checkpoints")

    def secret_values(self) -> dict[str, str]:
        """Read every secret now: ``{NAME: value}`` for the roles' environment. Never log the result.

        Raises:
            ConfigError: a variable that is not set or a file that cannot be read (the message names
                the secret, the variable or file, and never a value).
        """
        values: dict[str, str] = {}
        for name, ref in self.secrets.items():
            if ref.env is not None:
                value = os.environ.get(ref.env)
                if value is None:
                    raise _error(self._source, [(("secrets", name, "env"), ref.env,
                                 f"the environment variable {ref.env} is not set",
                                 f"export {ref.env}=... before starting the job, or point secrets.{name} "
                                 "at a file")])
            else:
                try:
                    value = Path(str(ref.file)).read_text(encoding="utf-8").removesuffix("\n")
                except (OSError, UnicodeDecodeError) as e:
                    why = f"{type(e).__name__}: {e.strerror}" if isinstance(e, OSError) else "not UTF-8 text"
                    raise _error(self._source, [(("secrets", name, "file"), str(ref.file),
                                 f"cannot read the file ({why})",
                                 "create the file with the secret as its only content, or fix the path")],
                                 ) from None
            if "\0" in value:
                raise _error(self._source, [(("secrets", name), _NO_VALUE, "the value holds a NUL character",
                                             "an environment variable cannot hold NUL; fix the value")])
            values[name] = value.removesuffix("\r")
        return values

    def redacted(self) -> dict[str, Any]:
        """The config as JSON-able data with secrets as names only; what ``job.json`` and logs hold.

        `JobConfig.from_redacted` reads it back (inside a role, a secret is its environment variable).
        """
        data = self.model_dump(mode="json", exclude={"secrets"})
        data["secrets"] = sorted(self.secrets)
        return data

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, base_dir: Path | None = None, source: Path | None = None
    ) -> JobConfig:
        """Validate a config given as data; relative paths resolve against ``base_dir`` (default cwd)."""
        if not isinstance(data, Mapping):
            raise _error(source, [((), data, "the config is not a mapping of keys",
                                   "write name:, entrypoint:, framework:, roles: ... at the top level")])
        with _validating(base_dir, source):
            return cls(**{str(k): v for k, v in data.items()})

    @classmethod
    def from_redacted(cls, data: Mapping[str, Any], *, source: Path | None = None) -> JobConfig:
        """Rebuild a config from `redacted` output (``job.json``): each secret is read from its own
        environment variable, where the trainer put it."""
        data = dict(data)
        names = data.get("secrets") or []
        if isinstance(names, list):
            data["secrets"] = {name: {"env": name} for name in names}
        return cls.from_dict(data, source=source)


def _role_problems(config: JobConfig) -> Iterator[Problem]:
    roles, strategy, framework = config.roles, config.strategy, config.framework
    if "worker" not in roles:
        article = "an" if strategy == "allreduce" else "a"
        yield Problem(("roles", "worker"), _NO_VALUE, f"{article} {strategy} job needs workers",
                      "add roles: {worker: {count: 2}}")
    if strategy == "allreduce" and "ps" in roles:
        yield Problem(("roles", "ps"), roles["ps"].model_dump(), "an allreduce job has no parameter servers",
                      "remove roles.ps, or set strategy: parameter_server")
    if strategy == "parameter_server" and "ps" not in roles:
        yield Problem(("roles", "ps"), _NO_VALUE, "a parameter_server job needs parameter servers",
                      "add roles: {ps: {count: 1}}, or set strategy: allreduce")
    if framework == "torch" and "chief" in roles:
        yield Problem(("roles", "chief"), roles["chief"].model_dump(), "torch jobs have no chief role",
                      "remove roles.chief: worker 0 (rank 0) acts as the chief")
    for role in ("chief", "evaluator"):
        if role in roles and roles[role].count != 1:
            yield Problem(("roles", role, "count"), roles[role].count, f"a job has exactly one {role}",
                          f"set roles.{role}.count to 1")
    total = sum(spec.count for spec in roles.values())
    if total > MAX_PROCESSES:
        counts = ", ".join(f"{role} {spec.count:,}" for role, spec in roles.items())
        yield Problem(("roles",), _NO_VALUE, f"{total:,} processes in all ({counts}), more than shardkit's "
                      f"limit of {MAX_PROCESSES:,} per job", "lower the roles' counts")


def _params_problems(config: JobConfig) -> Iterator[Problem]:
    """``params`` keys that shardkit itself reads: a torch parameter-server job's ``params.optimizer``,
    checked here as its workers would check it (`ps_optimizer.optimizer_problem`, which needs no
    torch), so a bad one fails validation instead of every attempt of the job."""
    if (config.framework, config.strategy) == ("torch", "parameter_server") and "optimizer" in config.params:
        from shardkit.trainer.ps_optimizer import optimizer_problem

        problem = optimizer_problem(config.params["optimizer"])
        if problem is not None:
            path, value, what, fix = problem
            yield Problem(("params", "optimizer", *path), value, what, fix)


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


@contextmanager
def _validating(base_dir: Path | None, source: Path | None) -> Iterator[None]:
    tokens = BASE_DIR.set(base_dir), _SOURCE.set(source)
    try:
        yield
    finally:
        BASE_DIR.reset(tokens[0])
        _SOURCE.reset(tokens[1])


# -- the loading side, imported on use -------------------------------------------------------------
# config_load imports the models above, so this module reaches it only inside functions: either module
# can be imported first without a cycle.

_LOADING = frozenset({"describe", "load_config", "translate"})


def __getattr__(name: str) -> Any:
    if name in _LOADING:
        from shardkit.cluster import config_load

        return getattr(config_load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _translate(error: ValidationError, source: Path | None) -> ConfigError:
    from shardkit.cluster.config_load import translate

    return translate(error, source)


def _error(source: Path | None, items: Sequence[tuple[tuple[str | int, ...], Any, str, str]]) -> ConfigError:
    from shardkit.cluster.config_load import config_error

    return config_error(source, items)
