"""The cluster spec: from a `JobConfig`, every process of the job with its argv and environment."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from shardkit.errors import ConfigError
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig
from shardkit.job.layout import ProcessSlot, free_ports, layout

__all__ = ["ClusterSpec", "ProcessSpec", "build_spec"]

REDACTED = "<redacted>"


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: ``argv`` with ``env`` added to the engine's own environment.

    ``env`` holds only what the trainer sets (never the parent's environment): the engine starts
    from ``os.environ`` (or a clean one) and overlays it. It includes secret values, so it is left out
    of ``repr``; log `redacted_env` instead.
    """

    role: str
    index: int
    argv: list[str]
    env: dict[str, str] = field(repr=False)
    secret_names: frozenset[str] = frozenset()
    slot: ProcessSlot | None = None

    @property
    def name(self) -> str:
        """``worker-0``: a name for logs and log files."""
        return f"{self.role}-{self.index}"

    def redacted_env(self) -> dict[str, str]:
        """``env`` with every secret's value replaced by ``<redacted>``: safe to log."""
        return {k: REDACTED if k in self.secret_names else v for k, v in self.env.items()}


@dataclass(frozen=True)
class ClusterSpec:
    """Every process of one attempt of a job, in start order (ps, chief, workers, evaluator)."""

    processes: list[ProcessSpec]
    host: str
    attempt: int
    job_dir: Path
    heartbeat_addr: str | None
    ports: list[int]

    def process(self, role: str, index: int = 0) -> ProcessSpec:
        """The process of ``role`` number ``index``; KeyError when the job has none."""
        for proc in self.processes:
            if (proc.role, proc.index) == (role, index):
                return proc
        raise KeyError(f"no process {role}[{index}] in this job")


def build_spec(
    config: JobConfig,
    *,
    host: str = "127.0.0.1",
    attempt: int = 0,
    job_dir: Path | str | None = None,
    heartbeat_addr: str | None = None,
    resume_step: int | None = None,
) -> ClusterSpec:
    """The processes of one attempt of ``config``, with fresh free ports and their environments.

    Example:
        >>> spec = build_spec(config, attempt=0, heartbeat_addr="127.0.0.1:41000")
        >>> for proc in spec.processes:
        ...     subprocess.Popen(proc.argv, env={**os.environ, **proc.env})

    Environment of each process, in this order (later wins; the config cannot override trainer
    variables): ``SHARDKIT_*`` (job config ``<job_dir>/job.json``, job dir, role, index, attempt,
    the collectives' timeout (``fault_tolerance.collective_timeout``), heartbeat address when given,
    data shard for data-reading roles, see `layout`); for torch
    ``MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE`` (processes in the process
    group; one machine, so local rank = rank); for tensorflow ``TF_CONFIG`` (the cluster of chief,
    worker and ps addresses, and this process's task; an evaluator is only a task, never in the
    cluster, as TensorFlow expects); then ``config.env``; then the secrets' values (read now).
    argv: ``[python, "-u", script]`` or ``[python, "-u", "-m", "shardkit.trainer.run", "mod:fn"]``.

    Args:
        host: the address the roles listen on and connect to (``MASTER_ADDR``, TF_CONFIG hosts).
        attempt: 0 for the first start, then one more per restart (``SHARDKIT_ATTEMPT``).
        job_dir: the job's folder (default ``config.logdir``); ``job.json`` is expected there.
        heartbeat_addr: the supervisor's UDP ``host:port``; None leaves heartbeats off.
        resume_step: the newest checkpoint step as the attempt starts (0: none), the newest any process
            of it restores (``SHARDKIT_RESUME_STEP``): a process slow to start does not take a checkpoint
            a faster one saved meanwhile. None: not pinned, each restores the newest.

    Raises:
        ConfigError: a secret that cannot be read, or a bad ``attempt``/``heartbeat_addr``.
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ConfigError(f"build_spec: attempt {attempt!r} is not an integer >= 0. Fix: pass 0, 1, ...")
    if heartbeat_addr is not None:
        try:
            p.parse_addr(heartbeat_addr)
        except ValueError as e:
            raise ConfigError(f"build_spec: heartbeat_addr: {e}. Fix: pass the UDP socket's host:port") from e
    secrets = config.secret_values()  # first: a missing secret fails before any port is taken
    job_path = Path(job_dir) if job_dir is not None else config.logdir
    slots = layout(config)
    torch = config.framework == "torch"
    tf_members = [s for s in slots if not torch and s.role != "evaluator"]
    # torch: one rendezvous port (MASTER_PORT); tensorflow: one gRPC port per cluster member.
    ports = free_ports(1 if torch else len(tf_members), host)
    tf_cluster: dict[str, list[str]] = {}
    for slot, port in zip(tf_members, ports if not torch else [], strict=True):
        tf_cluster.setdefault(slot.role, []).append(p.format_addr(host, port))

    processes = []
    for slot in slots:
        env = {
            p.ENV_JOB_CONFIG: str(job_path / p.JOB_CONFIG_FILE),
            p.ENV_JOB_DIR: str(job_path),
            p.ENV_ROLE: slot.role,
            p.ENV_ROLE_INDEX: str(slot.index),
            p.ENV_ATTEMPT: str(attempt),
            p.ENV_COLLECTIVE_TIMEOUT: f"{config.fault_tolerance.collective_timeout:g}",
        }
        if heartbeat_addr is not None:
            env[p.ENV_HEARTBEAT_ADDR] = heartbeat_addr
        if resume_step is not None:
            env[p.ENV_RESUME_STEP] = str(resume_step)
        if slot.data_shard is not None:
            env[p.ENV_DATA_SHARD] = str(slot.data_shard)
            env[p.ENV_DATA_NUM_SHARDS] = str(slot.num_data_shards)
        if slot.rank is not None:
            env.update({p.MASTER_ADDR: host, p.MASTER_PORT: str(ports[0]), p.RANK: str(slot.rank),
                        p.WORLD_SIZE: str(slot.world_size), p.LOCAL_RANK: str(slot.rank),
                        p.LOCAL_WORLD_SIZE: str(slot.world_size)})
        if not torch:
            task = {"type": slot.role, "index": slot.index}
            env[p.TF_CONFIG] = json.dumps({"cluster": tf_cluster, "task": task}, separators=(",", ":"))
        env.update(config.env)
        env.update(secrets)
        processes.append(ProcessSpec(slot.role, slot.index, _argv(config), env, frozenset(secrets), slot))
    return ClusterSpec(processes, host, attempt, job_path, heartbeat_addr, ports)


def _argv(config: JobConfig) -> list[str]:
    python = os.fspath(config.python)
    if config.entrypoint_kind == "script":
        return [python, "-u", config.entrypoint]
    return [python, "-u", "-m", "shardkit.trainer.run", config.entrypoint]
