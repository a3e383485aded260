"""The process layout of a job: from a `JobConfig`, every process with its role, index, torch rank and data
shard, in start order (`layout`); and the free ports a job's processes bind (`free_ports`). Shared by the
engines that start the processes (`shardkit.cluster`) and a training process that must find its own
place (`shardkit.trainer`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from shardkit.job import protocol as p
from shardkit.job.config import JobConfig

__all__ = ["ProcessSlot", "free_ports", "layout"]

_START_ORDER = ("ps", "chief", "worker", "evaluator")  # servers first: the others connect to them


@dataclass(frozen=True)
class ProcessSlot:
    """One process's place in the job, before ports are chosen (see `layout`).

    ``rank``/``world_size`` are the torch.distributed rank and world (None for TensorFlow and for
    processes outside the process group); ``data_shard``/``num_data_shards`` say which reader shard
    the process reads (None for roles that read no job data).
    """

    role: str
    index: int
    rank: int | None = None
    world_size: int | None = None
    data_shard: int | None = None
    num_data_shards: int | None = None


def layout(config: JobConfig) -> list[ProcessSlot]:
    """Every process of the job with its rank and data shard, in start order; pure (no ports).

    Example:
        >>> [(s.role, s.index, s.rank, s.data_shard) for s in layout(config)]
        [('worker', 0, 0, 0), ('worker', 1, 1, 1)]

    Who reads the job's data (gets ``SHARDKIT_DATA_SHARD``/``_NUM_SHARDS``):
    - allreduce (torch and tensorflow): every process of the collective, one shard each: torch
      worker i reads shard i; tensorflow chief (if any) reads shard 0 and worker i shard i + 1 (the
      order MultiWorkerMirroredStrategy numbers them in).
    - torch parameter server: the workers (worker j reads shard j of the workers' count); the ps only
      serve parameters.
    - tensorflow parameter server: the chief alone, as the one shard of 1: the coordinator builds
      the input and dispatches steps to workers, and a shardkit reader (Python) cannot run inside a
      remote worker's tf.data graph.
    - evaluators read no training data (they evaluate on their own data).
    torch ranks: allreduce worker i has rank i; parameter server: ps i has rank i and worker j rank
    ``num_ps + j`` (one `torch.distributed.rpc` world).
    """
    counts = {role: config.roles[role].count if role in config.roles else 0 for role in p.ROLES}
    torch = config.framework == "torch"
    allreduce = config.strategy == "allreduce"
    slots: list[ProcessSlot] = []
    for role in _START_ORDER:
        for index in range(counts[role]):
            rank = world = shard = shards = None
            if torch and role == "worker":
                rank = index + (0 if allreduce else counts["ps"])
                world = counts["worker"] + (0 if allreduce else counts["ps"])
                shard, shards = index, counts["worker"]
            elif torch and role == "ps":
                rank, world = index, counts["worker"] + counts["ps"]
            elif not torch and allreduce and role in ("chief", "worker"):
                shard = index + (counts["chief"] if role == "worker" else 0)
                shards = counts["chief"] + counts["worker"]
            elif not torch and role == "chief":
                shard, shards = 0, 1
            slots.append(ProcessSlot(role, index, rank, world, shard, shards))
    return slots


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that are free now on ``host``.

    Each port is found by binding port 0; all sockets stay open until every port is picked (so the
    ports differ) and are closed before returning, so the processes can bind them. That leaves a
    race: another program may take a port between this close and the role's bind. It is rare (the
    kernel hands out ephemeral ports in rotation), and the supervisor treats the failed start like
    any failure: the next attempt calls `build_spec` again and gets new ports.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            # The wildcard address: a port free there is free on every interface the role may bind.
            sock.bind(("::" if family == socket.AF_INET6 else "", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
