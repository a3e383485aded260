"""Kubernetes manifests of a job: a Kubeflow ``PyTorchJob`` or ``TFJob`` and a ``ConfigMap`` of its config."""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shardkit.cluster.render import (
    DNS_LABEL_MAX,
    container_config,
    dump,
    engine_options,
    fitting_label,
    k8s_name,
    local_paths,
    rendered_from,
    script_relative,
)
from shardkit.job.config import JobConfig, Resources
from shardkit.job.config.values import Problem
from shardkit.job.layout import layout

__all__ = ["CONFIG_MOUNT", "KubernetesOptions", "render_kubernetes", "replica_counts"]

CONFIG_MOUNT = "/etc/shardkit"  # where the ConfigMap's job.json is mounted in every pod
_TF_REPLICAS = {"chief": "Chief", "worker": "Worker", "ps": "PS", "evaluator": "Evaluator"}
# The Kubeflow training operator sets MASTER_ADDR/RANK/TF_CONFIG only in the container of this name, and
# takes the rendezvous port from the container port of this name (pkg/apis/kubeflow.org/v1).
_CONTAINER = {"torch": ("pytorch", "pytorchjob-port", 23456),
              "tensorflow": ("tensorflow", "tfjob-port", 2222)}
_DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")


class KubernetesOptions(BaseModel):
    """``engine:`` options of ``shardkit render --engine kubernetes``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    image: str = Field(min_length=1, description=(
        "the container image every role runs, with Python, shardkit, the job's framework and the config "
        "file's folder at workdir, e.g. engine: {name: kubernetes, image: registry.example.com/digits:1} "
        "or --set engine.image=IMAGE"))
    namespace: str | None = None
    python: str = Field(default="python", min_length=1, description="the interpreter in the image")
    workdir: str = Field(default="/workspace", pattern=r"^/", description="where the config's folder is")
    restart_policy: Literal["OnFailure", "ExitCode"] = "OnFailure"

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and not _DNS_1123.match(value):
            fitting = fitting_label(value, DNS_LABEL_MAX, letter_first=False)
            raise Problem((), value, f"not a Kubernetes namespace name: at most {DNS_LABEL_MAX} lower-case "
                          "letters, digits and '-', starting and ending with a letter or digit (a DNS-1123 "
                          "label)", f"--set engine.namespace={fitting}")
        return value


def render_kubernetes(config: JobConfig) -> dict[str, str]:
    """``{"<name>-config.yaml": ConfigMap, "<name>-pytorchjob.yaml" or "<name>-tfjob.yaml": the job}``.

    Example:
        >>> files = render_kubernetes(load_config("examples/digits.yaml", ["engine.image=reg/digits:1"]))

    Replicas: torch jobs are ``PyTorchJob``s, whose operator numbers ``RANK`` Master 0 then Worker 1..;
    shardkit's rank 0 (allreduce: worker 0; parameter server: ps 0, which hosts the RPC store) is the
    Master and every other rank a Worker replica (``WORLD_SIZE`` = their sum, as shardkit's layout). With
    more than one ps, ps 1.. run in Worker pods, which then get the larger of the ps and worker
    resources. TensorFlow jobs are ``TFJob``s with Chief, Worker, PS, Evaluator replicas as the roles
    (the operator's ``TF_CONFIG`` names them as shardkit does). Resources: ``cpus`` and ``memory`` as both
    requests and limits (Guaranteed QoS, so training pods are evicted last), ``gpus`` as the
    ``nvidia.com/gpu`` limit. ``restartPolicy`` is the ``restart_policy`` option (``OnFailure``, or
    ``ExitCode``: restart only on exit codes 128-255, i.e. killed, not a failing script),
    ``runPolicy.backoffLimit`` is ``fault_tolerance.max_restarts`` and ``cleanPodPolicy: Running`` stops
    parameter servers when the job is done.
    """
    opts = engine_options(config, KubernetesOptions, "kubernetes")
    counts = replica_counts(config)
    name = k8s_name(config, suffixes=[f"-{rtype.lower()}-{count - 1}" for rtype, count in counts.items()])
    container, port_name, port = _CONTAINER[config.framework]
    if config.entrypoint_kind == "script":
        entrypoint = posixpath.join(opts.workdir, script_relative(config))
    else:
        entrypoint = config.entrypoint
    job_json = container_config(config, engine="kubernetes", entrypoint=entrypoint, python=opts.python,
                                logdir=posixpath.join(opts.workdir, "runs", config.name))
    metadata: dict[str, Any] = {"name": name}
    if opts.namespace is not None:
        metadata["namespace"] = opts.namespace
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**metadata, "name": f"{name}-config"},
                  "data": {"job.json": json.dumps(job_json, indent=2, sort_keys=True) + "\n"}}

    env: list[dict[str, Any]] = [{"name": "SHARDKIT_JOB_CONFIG", "value": f"{CONFIG_MOUNT}/job.json"}]
    env += [{"name": key, "value": value} for key, value in config.plain_env.items()]
    env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": f"{name}-secrets", "key": key}}}
            for key in config.secret_names]  # env: entries that look like credentials too

    def replica(count: int, resources: Resources) -> dict[str, Any]:
        spec = {"containers": [{
            "name": container, "image": opts.image,
            "command": [opts.python, "-u", "-m", "shardkit.cluster.render.entry"],
            "workingDir": opts.workdir, "env": env,
            "ports": [{"name": port_name, "containerPort": port}],
            "resources": _resources(resources),
            "volumeMounts": [{"name": "shardkit-config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
        }], "volumes": [{"name": "shardkit-config", "configMap": {"name": f"{name}-config"}}]}
        return {"replicas": count, "restartPolicy": opts.restart_policy,
                "template": {"metadata": {"labels": {"shardkit/job": name}}, "spec": spec}}

    notes = local_paths(config)
    if config.framework == "torch":
        kind, key = "PyTorchJob", "pytorchReplicaSpecs"
        ranked = _ranked(config)
        resources = {role: spec.resources for role, spec in config.roles.items()}
        replicas = {"Master": replica(counts["Master"], resources[ranked[0]])}  # type: ignore[index]
        rest = set(ranked[1:])
        if rest:
            replicas["Worker"] = replica(counts["Worker"], _largest([resources[r] for r in rest]))  # type: ignore[index]
        if len(rest) > 1:
            notes.append("ps 1.. share the Worker replicas with the workers (PyTorchJob has Master and "
                         "Worker only): those pods get the larger of the ps and worker resources")
    else:
        kind, key = "TFJob", "tfReplicaSpecs"
        replicas = {_TF_REPLICAS[role]: replica(counts[_TF_REPLICAS[role]], spec.resources)
                    for role, spec in config.roles.items()}
    run_policy = {"backoffLimit": config.fault_tolerance.max_restarts, "cleanPodPolicy": "Running"}
    job = {"apiVersion": "kubeflow.org/v1", "kind": kind,
           "metadata": {**metadata, "labels": {"shardkit/job": name}},
           "spec": {"runPolicy": run_policy, key: replicas}}
    source = rendered_from(config)
    header = [f"{kind} {name}, rendered by `shardkit render`{source}.",
              f"Submit: kubectl apply -f {name}-config.yaml -f {name}-{kind.lower()}.yaml "
              "(needs the Kubeflow training operator).",
              f"The image {opts.image} must hold Python ({opts.python}), shardkit, {config.framework} and "
              f"the config's folder at {opts.workdir}."]
    if config.secret_names:
        sources = []
        for key in config.secret_names:
            ref = config.secrets.get(key)  # None: an env: entry, whose value is set in the shell
            sources.append(f"--from-file={key}={ref.file}" if ref is not None and ref.file is not None else
                           f'--from-literal={key}="${key if ref is None else ref.env}"')
        literals = " ".join(sources)
        header.append(f"Secrets, first: kubectl create secret generic {name}-secrets {literals}")
        header += [f"  {key}: its value (env.{key} of the config, a name that looks like a credential) is "
                   f"kept out of these files: set {key} in your shell first" for key in config.env_secrets]
    header += [f"Note: {note}." for note in notes]
    config_header = [f"The config of {kind} {name} (no secret values), mounted at {CONFIG_MOUNT}/job.json."]
    return {f"{name}-config.yaml": dump([config_map], config_header),
            f"{name}-{kind.lower()}.yaml": dump([job], header)}


def replica_counts(config: JobConfig) -> dict[str, int]:
    """The Kubeflow replica types of the job and their replica counts, ``{"Master": 1, "Worker": 3}``; the
    operator names replica ``i`` of type ``T`` (its pod and its Service) ``<job>-<t lower-cased>-<i>``."""
    if config.framework == "torch":
        ranked = _ranked(config)
        return {"Master": 1, **({"Worker": len(ranked) - 1} if len(ranked) > 1 else {})}
    return {_TF_REPLICAS[role]: spec.count for role, spec in config.roles.items()}


def _ranked(config: JobConfig) -> list[str]:
    """The role of each torch rank, rank 0 first."""
    ranked = sorted((s for s in layout(config) if s.rank is not None), key=lambda s: s.rank or 0)
    return [s.role for s in ranked]


def _resources(res: Resources) -> dict[str, dict[str, Any]]:
    cpu = int(res.cpus) if res.cpus == int(res.cpus) else f"{round(res.cpus * 1000)}m"
    amounts: dict[str, Any] = {"cpu": cpu}
    if res.memory is not None:
        amounts["memory"] = _bytes(res.memory)
    limits = dict(amounts)
    if res.gpus:
        limits["nvidia.com/gpu"] = res.gpus
    return {"requests": amounts, "limits": limits}


def _bytes(n: int) -> str:
    """Bytes as a Kubernetes quantity: the largest binary unit that divides them exactly."""
    for unit, size in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _largest(resources: list[Resources]) -> Resources:
    memories = [r.memory for r in resources if r.memory is not None]
    return Resources(cpus=max(r.cpus for r in resources), gpus=max(r.gpus for r in resources),
                     memory=max(memories) if memories else None)
