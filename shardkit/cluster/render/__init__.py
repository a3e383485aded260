"""``shardkit render``: the manifests that run a job on a cluster shardkit does not start itself."""

from __future__ import annotations

import importlib
import os
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from shardkit.errors import ConfigError
from shardkit.job.config import JobConfig
from shardkit.job.config.sections import _did_you_mean
from shardkit.job.config.values import NO_VALUE as _NO_VALUE
from shardkit.job.config.values import Problem

__all__ = ["DNS_LABEL_MAX", "RENDERERS", "fitting_label", "k8s_name", "render"]

#: engine name -> "module:function" of its renderer, imported on use.
RENDERERS: dict[str, str] = {
    "kubernetes": "shardkit.cluster.render.k8s:render_kubernetes",
    "yarn": "shardkit.cluster.render.yarn:render_yarn",
}
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
#: The longest DNS label (RFC 1123/1035): Kubernetes object names such as a Service's, and namespaces.
DNS_LABEL_MAX = 63
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_Options = TypeVar("_Options", bound=BaseModel)


def render(config: JobConfig, *, engine: str | None = None,
           out_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The files that submit ``config`` to a cluster: ``{file name: YAML or JSON text}``.

    Example:
        >>> files = render(load_config("examples/digits.yaml", ["engine.image=registry/digits:1"]),
        ...                engine="kubernetes", out_dir="deploy/")
        >>> sorted(files)
        ['digits-config.yaml', 'digits-pytorchjob.yaml']

    Choices:
    - ``engine`` (default: the config's ``engine.name``) is ``kubernetes`` (a Kubeflow ``PyTorchJob``
      or ``TFJob`` plus a ``ConfigMap`` holding the job's config) or ``yarn`` (a Skein application
      spec plus the job's config, which Skein uploads with the script). The engine options are the
      config's ``engine:`` keys, whichever engine they were written for, and each renderer checks them.
    - The job's config goes along as JSON without secret values (`JobConfig.redacted`), with the
      entrypoint, python and logdir rewritten to where they are inside the container; ``data.url``
      and ``checkpoint.dir`` are kept as they are, so they must be URLs every container can reach
      (``s3://...``) or paths mounted at the same place: a comment at the top of each manifest says
      which are local paths.
    - Secrets are referenced by name, never by value (a Kubernetes ``Secret``, Skein's key-value
      store); each manifest's header says how to create them.
    - Inside each container ``python -m shardkit.cluster.render.entry`` finds the process's place in
      the job (from the ``RANK`` or ``TF_CONFIG`` the Kubeflow operator sets, or Skein's container id),
      sets the ``SHARDKIT_*`` environment `shardkit.trainer.init` reads, and starts the entrypoint.
      Heartbeats are off there: restarts are the cluster's (``restartPolicy``/``backoffLimit``, Skein's
      ``max_restarts``), from ``fault_tolerance.max_restarts``.

    Raises:
        ConfigError: an engine that renders nothing (``local``, ``ray``, ...), an unknown or invalid
            engine option (key path ``engine.<option>``), a missing required option (``image`` for
            kubernetes) or a job name the cluster cannot take; each with the fix.
    """
    name = engine if engine is not None else config.engine.name
    if name not in RENDERERS:
        raise ConfigError(
            f"engine {name!r}{' (engine.name in the job config)' if engine is None else ''} has nothing "
            f"to render: only {' and '.join(RENDERERS)} jobs are submitted as manifests ({name} jobs are "
            "started by `shardkit train`). Fix: shardkit render CONFIG --engine kubernetes (or yarn), or set "
            "engine: {name: kubernetes, image: ...} in the config")
    module, _, function = RENDERERS[name].partition(":")
    renderer: Callable[[JobConfig], dict[str, str]] = getattr(importlib.import_module(module), function)
    files = renderer(config)
    if out_dir is not None:
        _write_all(Path(out_dir), files)
    return files


def _write_all(folder: Path, files: dict[str, str]) -> None:
    """Write ``files`` into ``folder``, all or none: each to a temporary name first, then each renamed
    into place (a rename does not fail for want of space or permission once the write has succeeded),
    so a failure (a name taken by a folder, a full disk) leaves none of them behind."""
    temps: list[Path] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        taken = [name for name in files if (folder / name).is_dir()]
        if taken:
            raise IsADirectoryError(f"{folder / taken[0]} is a folder")
        for file_name, text in files.items():
            temp = folder / f".{file_name}.{os.getpid()}.tmp"
            temps.append(temp)
            temp.write_text(text, encoding="utf-8")
        for temp, file_name in zip(temps, files, strict=True):
            os.replace(temp, folder / file_name)
    except OSError as e:
        for temp in temps:
            temp.unlink(missing_ok=True)
        raise ConfigError(f"render: cannot write the manifests into {folder} ({e}); none was written. Fix: "
                          "give a folder you can write with --out") from e


# -- helpers shared by the renderers ---------------------------------------------------------------


def engine_options(config: JobConfig, model: type[_Options], engine: str) -> _Options:
    """The config's engine options checked against ``model`` (pydantic, ``extra="forbid"``); each problem
    is reported with its key path ``engine.<option>``."""
    from shardkit.job.config.messages import config_error

    try:
        return model.model_validate(dict(config.engine.options))
    except ValidationError as e:
        items: list[tuple[tuple[str | int, ...], Any, str, str]] = []
        for err in e.errors(include_url=False):
            key = str(err["loc"][0]) if err["loc"] else ""
            allowed = ", ".join(model.model_fields)
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, Problem):  # a validator's own problem and fix
                items.extend((("engine", key, *path), value, problem, fix)
                             for path, value, problem, fix in cause.items)
                continue
            if err["type"] == "extra_forbidden":
                problem = f"not an option of the {engine} renderer"
                fix = _did_you_mean(key, list(model.model_fields))
            elif err["type"] == "missing":
                field = model.model_fields[key]
                problem, fix = "a required option is missing", f"add it: {field.description}"
            else:
                problem, fix = err["msg"], f"see the {engine} options: {allowed}"
            items.append((("engine", key), _NO_VALUE if err["type"] == "missing" else err.get("input"),
                          problem, fix))
        raise config_error(config.source, items) from None


def k8s_name(config: JobConfig, *, suffixes: Sequence[str] = ()) -> str:
    """The job's name as Kubernetes and YARN objects take it (a DNS-1035 label: lower case, ``-``).

    ``suffixes`` are appended to it to name other objects, each of which must be a DNS-1035 label as
    well: the Kubeflow operator names every replica's pod and Service ``<job>-<replica type>-<index>``
    (``digits-master-0``), so the name is refused when the longest of those exceeds 63 characters. The
    fix in the message is always a name that passes both checks.
    """
    name = config.name.lower().replace("_", "-").replace(".", "-")
    where = f"in {config.source or 'the job config'}"
    longest = max(suffixes, key=len, default="")
    room, full = DNS_LABEL_MAX - len(longest), name + longest
    if not _DNS_1035.match(name):
        raise ConfigError(f"name={config.name!r} ({where}): it becomes the cluster object name {name!r}, "
                          "which must start with a letter and end with a letter or digit (a DNS-1035 label). "
                          f"Fix: rename the job (--set name={fitting_label(name, room)})")
    if len(full) > DNS_LABEL_MAX:
        raise ConfigError(f"name={config.name!r} ({where}): the cluster names objects after it, and the "
                          f"longest, {full!r}, has {len(full)} characters, more than the {DNS_LABEL_MAX} of "
                          "a DNS-1035 label (the Kubeflow operator names each replica's pod and Service "
                          f"<job>-<replica type>-<index>). Fix: a job name of at most {room} characters, "
                          f"e.g. --set name={fitting_label(name, room)}")
    return name


def fitting_label(name: str, size: int, *, letter_first: bool = True) -> str:
    """``name`` made a DNS label of at most ``size`` characters, for a message's fix: lower case, ``-``
    for anything else, no ``-`` at either end, a letter first (``job-`` put before a digit) unless not
    ``letter_first``; ``job`` if nothing is left."""
    label = re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-")
    if letter_first and label and not label[0].isalpha():
        label = f"job-{label}"
    label = label[:size].rstrip("-")
    return label or "job"[:size]


def container_config(config: JobConfig, *, engine: str, entrypoint: str, python: str, logdir: str
                     ) -> dict[str, Any]:
    """`JobConfig.redacted` (no secret values) with the engine and the paths a container sees."""
    data = config.redacted()
    data.update(entrypoint=entrypoint, python=python, logdir=logdir,
                engine={"name": engine, "options": data["engine"]["options"]})
    return data


def script_relative(config: JobConfig) -> str:
    """A script entrypoint relative to the config file's folder (how it lies in an image or upload); its
    file name for a config built in Python, which has no folder."""
    if config.source is None:
        return Path(config.entrypoint).name
    base = config.source.parent
    rel = Path(os.path.relpath(config.entrypoint, base))
    if rel.parts[:1] == ("..",):
        raise ConfigError(f"entrypoint={config.entrypoint!r} is outside the config file's folder {base}, "
                          "so it has no place beside the config in the container. Fix: move the script into "
                          "that folder, or use a package.module:function entrypoint installed in the image")
    return rel.as_posix()


def rendered_from(config: JobConfig) -> str:
    """`` from <config file>`` for a header (relative to the current folder when inside it), or ``""``."""
    if config.source is None:
        return ""
    rel = os.path.relpath(config.source)
    return f" from {config.source if rel.startswith('..') else rel}"


def local_paths(config: JobConfig) -> list[str]:
    """Header notes for ``data.url`` (a mixture's sources' URLs)/``checkpoint.dir`` that are paths of this
    machine."""
    notes = []
    data = config.data
    urls: list[tuple[str, str | None]] = [("data.url", data.url if data else None)]
    if data is not None and data.sources is not None:
        urls = [(f"data.sources.{name}.url", source.url) for name, source in data.sources.items()]
    for key, value in [*urls, ("checkpoint.dir", config.checkpoint_dir)]:
        if value is not None and not _SCHEME.match(value):
            notes.append(f"{key} is the local path {value}: every container must see it at that path (a "
                         "mounted volume), or make it a URL (s3://bucket/path)")
    return notes


class _Dumper(yaml.SafeDumper):
    """Block style; no ``&id001`` anchors for repeated objects; multi-line strings as ``|`` blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def dump(documents: Sequence[Mapping[str, Any]], header: Sequence[str] = ()) -> str:
    """YAML documents (block style, keys in the order given) under a ``#`` comment header."""
    lines = [f"# {part}" for line in header
             for part in textwrap.wrap(line, 106, subsequent_indent="  ", break_on_hyphens=False)]
    body = "---\n".join(yaml.dump(dict(doc), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                                   width=100) for doc in documents)
    return "\n".join(lines) + ("\n" if lines else "") + body
