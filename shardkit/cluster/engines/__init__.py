"""Engines by name: where a job's processes run (``engine:`` in the job config), imported lazily.

An engine starts the processes of one attempt and hands back a `ProcessGroup`; the supervisor does
everything else (heartbeats, restarts, summary), so an engine only has to start, report exits, show
output and stop.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shardkit.cluster._spec import ClusterSpec
from shardkit.errors import ConfigError
from shardkit.job.config.messages import located

if TYPE_CHECKING:
    from shardkit.job.config import JobConfig

__all__ = ["ENGINES", "Engine", "ProcessGroup", "RoleProcess", "check_engine", "check_job", "get_engine"]

#: name -> "module:class" of the engine, or None for engines that are rendered (`shardkit render`), not run.
ENGINES: dict[str, str | None] = {
    "local": "shardkit.cluster.engines.local:LocalEngine",
    "torchrun": "shardkit.cluster.engines.torchrun:TorchrunEngine",
    "ray": "shardkit.cluster.engines.ray:RayEngine",
    "spark": "shardkit.cluster.engines.spark:SparkEngine",
    "kubernetes": None,
    "yarn": None,
}
_RENDERED = {  # name -> what `shardkit render` writes for it (shardkit does not run these engines)
    "kubernetes": "manifests of a Kubeflow PyTorchJob or TFJob",
    "yarn": "spec of a Skein application",
}


class RoleProcess(Protocol):
    """One started process as the supervisor sees it."""

    @property
    def role(self) -> str: ...

    @property
    def index(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def started(self) -> float:
        """``time.monotonic()`` when it was started."""

    @property
    def log_path(self) -> Path: ...

    @property
    def returncode(self) -> int | None:
        """None while it runs; the exit code, or ``-signal`` when a signal ended it."""

    @property
    def lost_reason(self) -> str | None:
        """Why the engine gave the process up without its exit status (its node unreachable, its actor
        dead), said in place of one; None when ``returncode`` is what the process exited with."""

    def tail(self, lines: int = 20) -> list[str]:
        """The last ``lines`` lines of its output."""


class ProcessGroup(Protocol):
    """The processes of one attempt."""

    @property
    def processes(self) -> Sequence[RoleProcess]: ...

    def poll(self) -> list[RoleProcess]:
        """Processes that exited since the last call (each reported once)."""

    def output(self) -> Iterator[tuple[RoleProcess, str]]:
        """Complete output lines written since the last call, per process."""

    def stop(self, grace: float | None = None) -> None:
        """Stop every process and everything it started; return when all are gone."""


class Engine(Protocol):
    """Starts the processes of a `ClusterSpec`.

    Building one starts nothing and connects nowhere: the constructor checks the options and that the
    engine's package is installed, and `start` does the rest (`check_engine` relies on this).
    """

    name: str

    def start(self, spec: ClusterSpec, *, log_dir: Path) -> ProcessGroup:
        """Start every process of ``spec``, their output going under ``log_dir``."""


def get_engine(name: str, options: Mapping[str, Any] | None = None) -> Engine:
    """The engine called ``name``, built with its ``options`` (the config's ``engine:`` entry).

    Example:
        >>> engine = get_engine(config.engine.name, config.engine.options)

    Raises:
        ConfigError: an unknown engine, one that is only rendered (kubernetes, yarn), or an
            option the engine does not take.
    """
    if name not in ENGINES:
        raise ConfigError(f"engine.name={name!r} is not an engine. Fix: use one of {', '.join(ENGINES)}")
    target = ENGINES[name]
    if target is None:
        raise ConfigError(
            f"engine.name={name!r}: shardkit does not start processes on {name}; it writes the "
            f"{_RENDERED[name]}. "
            f"Fix: run `shardkit render CONFIG --engine {name}` and submit what it writes, or use "
            "engine: local to run every process on this machine"
        )
    module, _, cls = target.partition(":")
    engine: Engine = getattr(importlib.import_module(module), cls)(dict(options or {}))
    return engine


def check_job(engine: Engine, config: JobConfig) -> None:
    """What ``engine`` can tell from the config alone that it could never run (its ``check_job``, where
    it has one: too few Spark slots, a local Ray instance too small): `ConfigError`, before anything
    starts. `check_engine` and the supervisor call it."""
    check = getattr(engine, "check_job", None)
    if callable(check):
        check(config)


def check_engine(config: JobConfig, *, node_rank: int | None = None) -> None:
    """Refuse now what `shardkit.cluster.run_job` would refuse about the config's engine before it
    starts anything; what ``shardkit validate`` checks besides the config itself.

    Example:
        >>> check_engine(load_config("job.yaml", ["engine=torchrun"]))   # a TensorFlow job
        ConfigError: ... engine.name = 'torchrun' runs torch allreduce jobs with workers only; ...

    Checked with the very calls `run_job` makes, so the two cannot disagree: the engine is built as
    the supervisor builds it (`get_engine`: a known engine, one shardkit runs rather than renders, its
    options, its package installed) and closed again, or for ``engine: torchrun`` the node's checks
    (`shardkit.cluster.engines.torchrun.check_node`: options, with ``node_rank`` as ``--node-rank``,
    and a job torch's elastic agent can run), and a ``module:function`` entrypoint's module located by
    the roles' Python (`shardkit.cluster.monitor.preflight.check_entrypoint`, which runs it once without
    running any of the job's code). Nothing else is started, connected, read or written: the data
    and the logdir are `run_job`'s to check (they may exist only where the job runs), and so are
    secrets' values.

    Raises:
        ConfigError: an unknown or rendered-only engine (kubernetes, yarn: use ``shardkit render``), an
            engine option the engine does not take or a bad value, or a job the engine cannot run.
        MissingDependencyError: the engine's package (torch, ray, pyspark) is not installed.
    """
    from shardkit.cluster.monitor.preflight import check_entrypoint

    check_entrypoint(config)  # as train does: a module:function the roles' Python cannot find
    if config.engine.name == "torchrun":  # as run_job: one node's agent, not an engine the supervisor builds
        from shardkit.cluster.engines.torchrun import check_node

        check_node(config, node_rank=node_rank)
        return
    with located(config):
        engine = get_engine(config.engine.name, config.engine.options)
    try:
        check_job(engine, config)
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()
