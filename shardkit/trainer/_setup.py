"""How `shardkit.trainer.init` sets a process up: its config, server roles, the torch process group."""

from __future__ import annotations

import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from shardkit.errors import ConfigError
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig, load_config

if TYPE_CHECKING:
    from shardkit.trainer._context import TrainContext

__all__ = ["CONFIG_ENV", "check_place", "collective_timeout", "init_torch_allreduce", "int_env",
           "load_job_config", "serve_if_server"]

CONFIG_ENV = "SHARDKIT_CONFIG"  # a job YAML for a script started by hand (python / torchrun)


def int_env(name: str, default: int | None = None) -> int | None:
    """An integer environment variable (``default`` when unset or empty); `ConfigError` when malformed."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ConfigError(f"the environment variable {name}={value!r} is not an integer; it is set by "
                          "`shardkit train` (or torchrun): do not set it by hand") from e


def check_place(rank: int | None, world: int | None, shard: int | None, shards: int | None) -> None:
    """Refuse a rank or data shard from the environment that is not one of its job's: ``RANK`` must be
    in ``0 .. WORLD_SIZE - 1`` (``WORLD_SIZE`` unset: one process, so 0), and ``SHARDKIT_DATA_SHARD`` in
    ``0 .. SHARDKIT_DATA_NUM_SHARDS - 1``. Otherwise a process would run alone as a rank that never
    checkpoints (``RANK=1`` with no ``WORLD_SIZE``: a one-process group whose only member is no chief).
    """
    fix = ("set both as torchrun and `shardkit train` do (RANK=0 .. WORLD_SIZE-1), or unset them to run "
           "a single process")
    if world is not None and world < 1:
        raise ConfigError(f"the environment variable {p.WORLD_SIZE}={world} is not a number of processes "
                          f"(>= 1); {fix}")
    if rank is not None and not 0 <= rank < (world if world is not None else 1):
        total = f"{p.WORLD_SIZE}={world}" if world is not None else f"{p.WORLD_SIZE} unset (1 process)"
        raise ConfigError(f"the environment variables {p.RANK}={rank} and {total} do not fit: a rank is "
                          f">= 0 and < {p.WORLD_SIZE}; {fix}")
    if (shard, shards) != (None, None) and (shard is None or shards is None or not 0 <= shard < shards):
        raise ConfigError(
            f"the environment variables {p.ENV_DATA_SHARD}={'unset' if shard is None else shard} and "
            f"{p.ENV_DATA_NUM_SHARDS}={'unset' if shards is None else shards} do not fit: a shard is "
            ">= 0 and < the number of shards, both set. `shardkit train` sets them: do not set them by hand")


def load_job_config(config: str | os.PathLike[str] | JobConfig | None) -> JobConfig | None:
    """The job's config: the supervisor's ``job.json`` inside a job, else ``config``, else the YAML named
    by ``SHARDKIT_CONFIG``, else None (see `shardkit.trainer.init`)."""
    job_json = os.environ.get(p.ENV_JOB_CONFIG)
    if job_json:  # inside a job: the supervisor's resolved config (with its --set overrides) wins
        path = Path(job_json)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{p.ENV_JOB_CONFIG}={job_json}: cannot read the job's config ({e}); it is "
                              "written by `shardkit train` before the processes start") from e
        return JobConfig.from_redacted(data, source=path)
    if isinstance(config, JobConfig):
        return config
    if config is not None:
        return load_config(config)
    if os.environ.get(CONFIG_ENV):
        return load_config(os.environ[CONFIG_ENV])
    return None


def serve_if_server(ctx: TrainContext, cfg: JobConfig) -> None:
    if cfg.strategy != "parameter_server":
        return
    if cfg.framework == "torch" and ctx.role == "ps":
        from shardkit.trainer.strategies import torch_ps

        torch_ps.serve(ctx, heartbeat_interval=ctx.heartbeat_interval)
    elif cfg.framework == "tensorflow" and ctx.role in ("ps", "worker"):
        from shardkit.trainer.strategies import tf as tf_strategy

        tf_strategy.serve(ctx, heartbeat_interval=ctx.heartbeat_interval)
    else:
        return
    ctx.finish(save=False)
    sys.exit(0)


def collective_timeout() -> timedelta | None:
    """How long one torch.distributed collective may wait: ``SHARDKIT_COLLECTIVE_TIMEOUT`` seconds (set
    by every engine from ``fault_tolerance.collective_timeout``), so that a worker blocked in an
    allreduce whose peers vanished fails in bounded time; None (torch's default) in a script started
    without shardkit."""
    value = os.environ.get(p.ENV_COLLECTIVE_TIMEOUT)
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"the environment variable {p.ENV_COLLECTIVE_TIMEOUT}={value!r} is not a number "
                          "of seconds > 0; it is set by `shardkit train` from "
                          "fault_tolerance.collective_timeout: set that instead, or unset the variable")
    return timedelta(seconds=seconds)


def init_torch_allreduce(ctx: TrainContext, backend: str | None) -> None:
    import torch
    import torch.distributed as dist

    local_world = int_env(p.LOCAL_WORLD_SIZE, ctx.world_size) or 1
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(ctx.local_rank)
        ctx.device = torch.device("cuda", ctx.local_rank)
    else:
        ctx.device = torch.device("cpu")
    if dist.is_initialized():
        return
    timeout = collective_timeout()
    if p.MASTER_ADDR in os.environ and p.WORLD_SIZE in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    elif ctx.world_size == 1:  # a script started alone: a one-process group, so DDP works unchanged
        from shardkit.job.layout import free_ports

        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}", rank=0,
                                world_size=1, timeout=timeout)
    else:
        raise ConfigError(f"WORLD_SIZE={ctx.world_size} without {p.MASTER_ADDR}: start the script with "
                          "`shardkit train job.yaml` or torchrun, which set the rendezvous variables")
    ctx._owns_process_group = True
