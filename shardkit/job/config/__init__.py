"""The job config of `shardkit train`: the validated, frozen `JobConfig` model (its sections are in
`shardkit.job.config.sections`, YAML loading is in `shardkit.job.config.load`; their public names
are importable from here too)."""

from __future__ import annotations

import contextvars
import os
import re
import shutil
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from shardkit.errors import ConfigError, SecretInEnvWarning
from shardkit.job.config._paths import BASE_DIR, absolute, in_yaml_dir, plain_path
from shardkit.job.config.sections import (
    _ENV_NAME,
    MAX_PROCESSES,
    CheckpointConfig,
    DataConfig,
    EngineConfig,
    FaultTolerance,
    Resources,
    RoleConfig,
    SecretRef,
    _Model,
    _raise_all,
)
from shardkit.job.config.values import NO_VALUE as _NO_VALUE
from shardkit.job.config.values import Problem, plain_data_problems, secret_word
from shardkit.job.masking import MIN_SECRET_LENGTH, warn_short_secrets
from shardkit.job.protocol import ALL_ENV

if TYPE_CHECKING:
    from shardkit.job.config.load import describe, load_config
    from shardkit.job.config.messages import translate

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

# Which file errors name, while validating (where relative paths resolve: `config_paths.BASE_DIR`).
_SOURCE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("shardkit_config_source", default=None)
_FUNCTION = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*\Z")
_SECTIONS = frozenset({"checkpoint", "fault_tolerance", "engine", "params", "env", "secrets", "python"})


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
    An ``env`` entry whose name looks like a credential (``API_TOKEN``, ``DB_PASSWORD``;
    `shardkit.job.config.values.secret_word`) is a secret too (`secret_names`): its value reaches the
    processes, but ``job.json``, ``processes.json`` and rendered specs name it only, and output masks
    it; a `SecretInEnvWarning` per name, as the config is validated, says to move it under ``secrets``
    (the config file itself holds it). A warning, not a refusal: a name can look like one and not be.
    A script entrypoint is a ``.py`` file (``python`` runs it in each role; a file without the suffix is
    far more often a slip than a script). ``params``, ``data.options`` and engine options reach the roles
    as JSON (``job.json``), so they must be what JSON holds unchanged
    (`shardkit.job.config.values.plain_data_problems`): a config that would reach the script
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
    _short_secrets_warned: bool = PrivateAttr(default=False)  # `secret_values` warns once per config
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

    @model_validator(mode="after")
    def _secrets_in_env(self) -> JobConfig:
        for name in self.env_secrets:  # once per name, here: the config is validated once per load
            short = (f" (not this one: a value under {MIN_SECRET_LENGTH} characters is not masked)"
                     if len(self.env[name]) < MIN_SECRET_LENGTH else "")
            warnings.warn(SecretInEnvWarning(
                f"env.{name} looks like a credential (its name has {secret_word(name)}), so its value is "
                "treated as a secret: job.json, processes.json and rendered specs name it without the value, "
                f"and logs, the console and the summary show *** for it{short}. The config file itself still "
                f"holds it. Fix: move it under secrets:, e.g. secrets: {{{name}: {{env: MY_{name}}}}} (or "
                "{file: path}); if it is not a secret, rename it or ignore this warning"),
                stacklevel=_caller())
        return self

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # repr() and str() name the env: credentials' values as processes.json does: "<redacted>"
        for key, value in super().__repr_args__():
            yield key, ({k: "<redacted>" if secret_word(k) is not None else v for k, v in self.env.items()}
                        if key == "env" else value)

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

    @property
    def env_secrets(self) -> list[str]:
        """The ``env`` names that look like credentials (`shardkit.job.config.values.secret_word`), sorted:
        treated as secrets (`secret_names`)."""
        return sorted(name for name in self.env if secret_word(name) is not None)

    @property
    def plain_env(self) -> dict[str, str]:
        """``env`` without its `env_secrets`: what may be written in a file or shown."""
        return {name: value for name, value in self.env.items() if secret_word(name) is None}

    @property
    def secret_names(self) -> list[str]:
        """Every variable whose value is a secret, sorted: ``secrets`` and the credential-named ``env``
        entries (`env_secrets`). Their values are in `secret_values`; ``job.json`` (`redacted`) names them
        under ``secrets``, and what shardkit writes or prints masks them (`shardkit.job.masking`)."""
        return sorted({*self.secrets, *self.env_secrets})

    def secret_values(self) -> dict[str, str]:
        """Read every secret now: ``{NAME: value}`` for the roles' environment, the ``env`` entries that
        look like credentials included (`secret_names`). Never log the result.

        A ``secrets`` value shorter than 4 characters (or empty) is warned about
        (`SecretTooShortWarning`, naming the secret; once per config, the first time): it is not masked
        in the roles' output (`shardkit.job.masking`); an ``env`` one was told of by its
        `SecretInEnvWarning`.

        Raises:
            ConfigError: a variable that is not set or a file that cannot be read (the message names
                the secret, the variable or file, and never a value).
        """
        values: dict[str, str] = {}
        problems: list[tuple[tuple[str | int, ...], object, str, str]] = []  # every one, said at once
        for name, ref in self.secrets.items():
            if ref.env is not None:
                value = os.environ.get(ref.env)
                if value is None:
                    problems.append((("secrets", name, "env"), ref.env,
                                     f"the environment variable {ref.env} is not set",
                                     f"export {ref.env}=... before starting the job, or point secrets.{name} "
                                     "at a file"))
                    continue
            else:
                try:
                    value = Path(str(ref.file)).read_text(encoding="utf-8").removesuffix("\n")
                except (OSError, UnicodeDecodeError) as e:
                    why = f"{type(e).__name__}: {e.strerror}" if isinstance(e, OSError) else "not UTF-8 text"
                    problems.append((("secrets", name, "file"), str(ref.file),
                                     f"cannot read the file ({why})",
                                     "create the file with the secret as its only content, or fix the path"))
                    continue
            if "\0" in value:
                problems.append((("secrets", name), _NO_VALUE, "the value holds a NUL character",
                                 "an environment variable cannot hold NUL; fix the value"))
                continue
            values[name] = value.removesuffix("\r")
        if problems:
            raise _error(self._source, problems)
        if not self._short_secrets_warned:  # read at the start and again for each attempt: said once
            self._short_secrets_warned = True
            warn_short_secrets(values)
        return {**values, **{name: self.env[name] for name in self.env_secrets}}

    def redacted(self) -> dict[str, Any]:
        """The config as JSON-able data with secrets as names only; what ``job.json`` and logs hold.

        Every name of `secret_names` is listed under ``secrets`` (an ``env`` entry that looks like a
        credential moves there, without its value). `JobConfig.from_redacted` reads it back (inside a
        role, a secret is its environment variable).
        """
        data = self.model_dump(mode="json", exclude={"secrets", "env"})
        data["env"] = self.plain_env
        data["secrets"] = self.secret_names
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
        from shardkit.job.config.optimizer import optimizer_problem

        problem = optimizer_problem(config.params["optimizer"])
        if problem is not None:
            path, value, what, fix = problem
            yield Problem(("params", "optimizer", *path), value, what, fix)


def _caller() -> int:
    """The `warnings.warn` stacklevel of the first frame outside pydantic and this package, from a
    validator: where the config was loaded, not pydantic's insides."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__")).startswith(
            ("pydantic", "shardkit.job.config")):
        frame, level = frame.f_back, level + 1
    return level


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
        from shardkit.job.config import load, messages

        return getattr(messages if name == "translate" else load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _translate(error: ValidationError, source: Path | None) -> ConfigError:
    from shardkit.job.config.messages import translate

    return translate(error, source)


def _error(source: Path | None, items: Sequence[tuple[tuple[str | int, ...], Any, str, str]]) -> ConfigError:
    from shardkit.job.config.messages import config_error

    return config_error(source, items)
