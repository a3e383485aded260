"""``python -m shardkit.cluster.render.entry``: the command of every container of a rendered job.

It finds this process's place in the job (the ``RANK`` or ``TF_CONFIG`` that the Kubeflow training
operator sets, or Skein's ``SKEIN_CONTAINER_ID``), sets the ``SHARDKIT_*`` environment that
`shardkit.trainer.init` reads (role, index, data shard, rank), exchanges addresses through Skein's
key-value store on YARN, and replaces itself with the job's entrypoint. With ``--yarn-master`` it is
the Skein application master's script: it returns once the job's driver roles have all succeeded.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from shardkit.errors import ConfigError
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig
from shardkit.job.layout import ProcessSlot, free_ports, layout

__all__ = [
    "KeyValue", "entry_argv", "main", "place", "role_env", "yarn_addresses", "yarn_master", "yarn_secrets",
]

SECRETS_ENV = "SHARDKIT_YARN_SECRETS"  # = shardkit.cluster.render.yarn.SECRETS_ENV (kept free of yaml here)
_FINISHED = ("SUCCEEDED", "FAILED", "KILLED")


class KeyValue(Protocol):
    """What is used of Skein's ``ApplicationClient.kv``: put with ``kv[key] = value``, blocking ``wait``."""

    def __setitem__(self, key: str, value: bytes) -> None: ...

    def wait(self, key: str) -> bytes: ...


def place(config: JobConfig, env: Mapping[str, str]) -> tuple[str, int]:
    """This container's ``(role, index)``: from Skein's container id (``worker_1``), TensorFlow's
    ``TF_CONFIG`` task, or torch's ``RANK`` (the rank of `layout`, as the operator numbers it)."""
    container = env.get("SKEIN_CONTAINER_ID")
    try:
        if container:
            role, _, number = container.rpartition("_")
            index = int(number)
        elif config.framework == "tensorflow":
            task = json.loads(env[p.TF_CONFIG])["task"]
            role, index = str(task["type"]), int(task["index"])
        else:
            rank = int(env[p.RANK])
            slot = next((s for s in layout(config) if s.rank == rank), None)
            if slot is None:
                raise ConfigError(f"RANK={rank} is not a rank of job {config.name} (world "
                                  f"{sum(s.rank is not None for s in layout(config))})")
            role, index = slot.role, slot.index
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot tell this container's place in job {config.name} "
                          f"({type(e).__name__}: {e}): it reads SKEIN_CONTAINER_ID, TF_CONFIG or RANK, which "
                          "YARN (Skein) or the Kubeflow training operator set. Fix: submit the rendered "
                          "manifest, or use `shardkit train` on one machine") from e
    _slot(config, role, index)
    return role, index


def _slot(config: JobConfig, role: str, index: int) -> ProcessSlot:
    for slot in layout(config):
        if (slot.role, slot.index) == (role, index):
            return slot
    raise ConfigError(f"{role}[{index}] is not a process of job {config.name} (roles: "
                      f"{', '.join(f'{r} x{s.count}' for r, s in config.roles.items())}); YARN numbers a "
                      "restarted container on, so it has no place. Fix: submit the job again; it "
                      "resumes from its newest checkpoint")


def role_env(config: JobConfig, role: str, index: int) -> dict[str, str]:
    """The ``SHARDKIT_*`` variables (and torch's rank variables, one process per container) of a process."""
    slot = _slot(config, role, index)
    env = {p.ENV_ROLE: role, p.ENV_ROLE_INDEX: str(index)}
    if slot.data_shard is not None:
        env[p.ENV_DATA_SHARD], env[p.ENV_DATA_NUM_SHARDS] = str(slot.data_shard), str(slot.num_data_shards)
    if slot.rank is not None:
        env.update({p.RANK: str(slot.rank), p.WORLD_SIZE: str(slot.world_size), p.LOCAL_RANK: "0",
                    p.LOCAL_WORLD_SIZE: "1"})
    return env


def yarn_addresses(config: JobConfig, role: str, index: int, kv: KeyValue, *, host: str,
                   ports: Callable[[int], list[int]] = free_ports) -> dict[str, str]:
    """Publish this process's address in Skein's key-value store and read the others' (blocking).

    torch: rank 0 publishes ``shardkit/torch/master`` (``MASTER_ADDR``/``MASTER_PORT``); tensorflow: each
    cluster member publishes ``shardkit/tf/<role>/<index>`` and waits for all of them (``TF_CONFIG``;
    an evaluator is a task outside the cluster, as TensorFlow expects).
    """
    slot = _slot(config, role, index)
    if config.framework == "torch":
        if slot.rank is None:
            return {}
        if slot.rank == 0:
            kv["shardkit/torch/master"] = p.format_addr(host, ports(1)[0]).encode()
        master_host, master_port = p.parse_addr(kv.wait("shardkit/torch/master").decode())
        return {p.MASTER_ADDR: master_host, p.MASTER_PORT: str(master_port)}
    if role != "evaluator":
        kv[f"shardkit/tf/{role}/{index}"] = p.format_addr(host, ports(1)[0]).encode()
    cluster: dict[str, list[str]] = {}
    for s in layout(config):
        if s.role != "evaluator":
            cluster.setdefault(s.role, []).append(kv.wait(f"shardkit/tf/{s.role}/{s.index}").decode())
    task = {"type": role, "index": index}
    return {p.TF_CONFIG: json.dumps({"cluster": cluster, "task": task}, separators=(",", ":"))}


def yarn_secrets(names: str, kv: KeyValue) -> dict[str, str]:
    """The secrets named in ``names`` (comma-separated), each waited for at ``shardkit/secret/<NAME>``."""
    return {name: kv.wait(f"shardkit/secret/{name}").decode() for name in names.split(",") if name}


def yarn_master(config: JobConfig, app: Any, *, poll: float = 5.0, sleep: Callable[[float], None] = time.sleep
                ) -> int:
    """The Skein master's loop: 0 once every driver-role container succeeded, 1 when one failed.

    ``app`` is a ``skein.ApplicationClient``. Parameter servers (and TensorFlow workers serving a
    coordinator) never exit by themselves; returning ends the application, and Skein stops them.
    """
    from shardkit.cluster.supervisor import driver_roles

    drivers = driver_roles(config) & set(config.roles)
    expected = sum(spec.count for role, spec in config.roles.items() if role in drivers)
    while True:
        finished = app.get_containers(services=list(config.roles), states=list(_FINISHED))
        failed = [c for c in finished if str(c.state) != "SUCCEEDED"]
        if failed:
            print(f"shardkit: {', '.join(f'{c.id} {c.state}' for c in failed)}: the job failed",
                  file=sys.stderr, flush=True)
            return 1
        if sum(c.service_name in drivers for c in finished) >= expected:
            print(f"shardkit: {', '.join(sorted(drivers))} done: the job succeeded", flush=True)
            return 0
        sleep(poll)


def entry_argv(config: JobConfig) -> list[str]:
    """The command of the job's entrypoint, as `shardkit.cluster._spec` starts it."""
    python = os.fspath(config.python)
    if config.entrypoint_kind == "script":
        return [python, "-u", config.entrypoint]
    return [python, "-u", "-m", "shardkit.trainer.run", config.entrypoint]


def _load(env: Mapping[str, str]) -> JobConfig:
    path = env.get(p.ENV_JOB_CONFIG)
    if not path:
        raise ConfigError(f"{p.ENV_JOB_CONFIG} is not set: this command runs inside the containers of a job "
                          "rendered by `shardkit render`, which sets it")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p.ENV_JOB_CONFIG}={path}: cannot read the job's config ({e})") from e
    return JobConfig.from_redacted(data, source=Path(path))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args not in ([], ["--yarn-master"]):
        print("usage: python -m shardkit.cluster.render.entry [--yarn-master]", file=sys.stderr)
        return 2
    env = dict(os.environ)
    try:
        config = _load(env)
        app = None
        if args or env.get("SKEIN_CONTAINER_ID"):
            import skein  # only on YARN, where the nodes have it

            app = skein.ApplicationClient.from_current()
        if args:
            return yarn_master(config, app)
        role, index = place(config, env)
        extra = role_env(config, role, index)
        if app is not None:
            host = env.get("NM_HOST") or socket.getfqdn()
            extra.update(yarn_secrets(env.get(SECRETS_ENV, ""), app.kv))
            extra.update(yarn_addresses(config, role, index, app.kv, host=host))
    except ConfigError as e:
        print(f"shardkit: {e}", file=sys.stderr)
        return 1
    command = entry_argv(config)
    os.execvpe(command[0], command, {**env, **extra})
    return 0  # not reached: exec replaced the process


if __name__ == "__main__":
    sys.exit(main())
