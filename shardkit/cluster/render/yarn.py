"""A job as a Skein application spec for YARN: one service per role, the trainer as the application master."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shardkit.cluster.render import (
    container_config,
    dump,
    engine_options,
    k8s_name,
    local_paths,
    rendered_from,
    script_relative,
)
from shardkit.cluster.render.entry import SECRETS_ENV
from shardkit.job.config import JobConfig

__all__ = ["CONFIG_FILE", "DEFAULT_MEMORY", "SECRETS_ENV", "YarnOptions", "render_yarn"]

CONFIG_FILE = "shardkit-job.json"  # the job's config, uploaded by Skein into every container's folder
DEFAULT_MEMORY = 2 * 1024**3  # YARN needs a memory request: for roles whose resources.memory is unset


class YarnOptions(BaseModel):
    """``engine:`` options of ``shardkit render --engine yarn``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    queue: str = Field(default="default", min_length=1)
    python: str | None = Field(default=None, min_length=1, description="the interpreter on the YARN nodes")
    environment: str | None = Field(default=None, min_length=1, description=(
        "a packed Python environment (venv-pack or conda-pack archive, local path or hdfs:// URL) that "
        "Skein unpacks as ./environment in every container"))


def render_yarn(config: JobConfig) -> dict[str, str]:
    """``{"<name>-skein.yaml": the Skein spec, "<name>-job.json": the job's config (no secret values)}``.

    Example:
        >>> files = render_yarn(load_config("examples/digits.yaml", ["engine.queue=ml"]))
        >>> skein.ApplicationSpec.from_yaml(files["digits-skein.yaml"])

    Choices: one Skein service per role (``instances`` = ``count``; ``vcores`` = ``cpus`` rounded up,
    ``memory`` = ``resources.memory`` or 2 GiB, ``gpus``), each running
    ``python -m shardkit.cluster.render.entry``, which takes its role and index from Skein's container
    id and exchanges addresses through Skein's key-value store (the torch rank-0 address, or every
    TensorFlow server's for ``TF_CONFIG``). The application master runs the trainer's
    ``render_entry --yarn-master``: it ends the application when the driver roles (workers, or the
    chief of a TensorFlow parameter-server job) have all succeeded, since parameter servers never exit
    by themselves. Skein uploads the script (a ``module:function`` entrypoint must be installed on the
    nodes), the config and the ``environment`` archive. Containers are not restarted
    (``max_restarts: 0``): Skein gives a restarted container a new instance number, which has no place
    in the job's layout, so a failure fails the application and submitting it again resumes from the
    newest checkpoint (``fault_tolerance.max_restarts`` is not used). Secrets never enter the spec:
    containers wait for ``shardkit/secret/<NAME>`` in the key-value store, which the submitter fills
    (the header says how).
    """
    opts = engine_options(config, YarnOptions, "yarn")
    name = k8s_name(config)
    python = opts.python or ("./environment/bin/python" if opts.environment else "python3")
    files: dict[str, Any] = {CONFIG_FILE: f"{name}-job.json"}  # relative: next to the spec file
    if opts.environment is not None:
        files["environment"] = {"source": opts.environment, "type": "archive"}
    if config.entrypoint_kind == "script":
        files[script_relative(config)] = config.entrypoint
        entrypoint = script_relative(config)
    else:
        entrypoint = config.entrypoint
    job_json = container_config(config, engine="yarn", entrypoint=entrypoint, python=python,
                                logdir="shardkit-logs")
    env = {**config.plain_env, "SHARDKIT_JOB_CONFIG": CONFIG_FILE}
    if config.secret_names:  # env: entries that look like credentials too
        env[SECRETS_ENV] = ",".join(config.secret_names)
    launch = f"{python} -u -m shardkit.cluster.render.entry"
    services = {}
    for role, spec in config.roles.items():
        res = spec.resources
        services[role] = {
            "instances": spec.count,
            "resources": {"vcores": math.ceil(res.cpus), "gpus": res.gpus,
                          "memory": f"{math.ceil((res.memory or DEFAULT_MEMORY) / 2**20)} MiB"},
            "max_restarts": 0,  # a restarted container gets a new instance number: no place in the job
            "files": files, "env": env, "script": f"set -e\n{launch}\n",
        }
    master_env = {key: value for key, value in env.items() if key != SECRETS_ENV}
    spec_doc = {
        "name": name, "queue": opts.queue, "max_attempts": 1, "tags": ["shardkit"],
        "master": {"resources": {"vcores": 1, "memory": "512 MiB"}, "files": files, "env": master_env,
                   "script": f"set -e\n{launch} --yarn-master\n"},
        "services": services,
    }
    source = rendered_from(config)
    header = [f"Skein application {name}, rendered by `shardkit render`{source}.",
              f"Submit: skein application submit {name}-skein.yaml ({name}-job.json must lie beside it; "
              "needs a YARN cluster and skein).",
              f"The nodes need Python ({python}) with shardkit and {config.framework}"
              + (" (from the environment archive)." if opts.environment else ".")]
    if config.secret_names:
        header.append("Secrets, right after submitting (APP is the application id):")
        for key in config.secret_names:
            ref = config.secrets.get(key)  # None: an env: entry, whose value is set in the shell
            value = f'"$(cat {ref.file})"' if ref is not None and ref.file is not None else \
                f'"${key if ref is None else ref.env}"'
            header.append(f"  skein kv put APP --key shardkit/secret/{key} --value {value}")
        header += [f"  {key}: its value (env.{key} of the config, a name that looks like a credential) is "
                   f"kept out of these files: set {key} in your shell first" for key in config.env_secrets]
    if any((spec.resources.memory is None) for spec in config.roles.values()):
        header.append(f"Note: roles without resources.memory ask YARN for {DEFAULT_MEMORY // 2**30} GiB.")
    header += [f"Note: {note}." for note in local_paths(config)]
    header.append("Note: a failed container fails the application (no restarts on YARN); submit it again to "
                  "resume from the newest checkpoint.")
    if config.entrypoint_kind == "script":
        header.append(f"Note: the script is uploaded from {os.path.dirname(config.entrypoint)}.")
    return {f"{name}-skein.yaml": dump([spec_doc], header),
            f"{name}-job.json": json.dumps(job_json, indent=2, sort_keys=True) + "\n"}
