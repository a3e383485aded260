"""Job config files: YAML -> `JobConfig` (with ``--set`` overrides, and the line where each key was set,
for the errors), and `describe` (what ``shardkit validate`` prints). Problems become a `ConfigError` with
key paths in `shardkit.job.config.messages`, whose names are importable from here too."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel

from shardkit.errors import ConfigError
from shardkit.job.config import EngineConfig, JobConfig
from shardkit.job.config.messages import (
    _WHERE,
    _a,
    _show,
    _unwrap,
    _yaml_kind,
    config_error,
    located,
)
from shardkit.job.config.sections import _did_you_mean
from shardkit.job.protocol import ROLES

__all__ = ["check_locations", "describe", "load_config", "weight_text"]


# -- loading ---------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> JobConfig:
    """Read, override and validate a job config; nothing is started.

    Example:
        >>> config = load_config("examples/digits.yaml", ["roles.worker.count=4", "params.lr=0.1"])

    Args:
        path: the YAML file; relative paths inside it resolve against its folder.
        overrides: ``key.path=value`` strings (``--set`` on the command line), applied in order before
            validation; the value is YAML (``4``, ``true``, ``[a, b]``, ``{count: 2}``, ``null``). A key
            path the config cannot have is an error (keys under ``params``, ``env``, ``data.options`` and
            ``engine`` are free).

    Raises:
        ConfigError: an unreadable file, a YAML syntax error (line and column), a bad override, or every
            validation problem at once, each with its key path, the bad value and the fix.
    """
    if isinstance(overrides, str):
        overrides = [overrides]  # one override, not its characters
    source = _config_path(path)
    text = _read_config(source)
    raw, where = _parse_yaml(text, source)
    for override in overrides:
        _apply_override(raw, override, source, where)
    token = _WHERE.set(where)
    try:
        config = JobConfig.from_dict(raw, base_dir=source.parent, source=source)
    finally:
        _WHERE.reset(token)
    config._where = where
    check_locations(config)
    return config


def check_locations(config: JobConfig) -> None:
    """Refuse a logdir or ``checkpoint.dir`` that is a local dataset's folder or inside it: a run writes
    its lock, logs, TensorBoard files and checkpoints there, among the data files (which a reader of
    the folder as plain Parquet may then meet), and ``--fresh`` moves what the logdir holds aside, data
    included. `load_config` checks it; so does the supervisor, for a config built in Python.

    Example:
        >>> check_locations(config)     # ConfigError for logdir runs/digits with data.url runs/digits

    Raises:
        ConfigError: naming the folder's key, the dataset's key, both paths and a logdir to use instead.
    """
    if config.data is None:
        return
    sources = config.data.sources or {}
    datasets: list[tuple[tuple[str, ...], str]] = [(("data", "sources", name, "url"), source.url)
                                                   for name, source in sources.items()]
    if config.data.url is not None:
        datasets.append((("data", "url"), config.data.url))
    places: list[tuple[tuple[str, ...], str]] = [(("logdir",), str(config.logdir))]
    logdir, checkpoints = _local(str(config.logdir)), _local(config.checkpoint_dir)
    if checkpoints is not None and logdir is not None and logdir not in (checkpoints, *checkpoints.parents):
        places.append((("checkpoint", "dir"), config.checkpoint_dir))  # else the logdir's problem is its
    items: list[tuple[tuple[str | int, ...], Any, str, str]] = []
    for key, place in places:
        folder = _local(place)
        for data_key, url in datasets:
            data = _local(url)
            if folder is None or data is None or (folder != data and data not in folder.parents):
                continue
            where = config._where.get(data_key)
            dataset = f"the dataset folder {url} ({'.'.join(data_key)}{f', {where}' if where else ''})"
            what = "it is" if folder == data else "it is inside"
            if key == ("logdir",) and config.source is not None and key not in config._where:
                what = (f"the default logdir (runs/{config.name}, in the config file's folder) is"
                        + ("" if folder == data else " inside"))
            harm = "its checkpoints would be written among the data files"
            if key == ("logdir",):
                harm = "the run's lock, logs and checkpoints would be written among the data files" + (
                    ", and --fresh would move the data files aside" if folder == data else "")
            outside = data.parent / f"{data.name}-job"
            fix = (f"give the job a logdir outside the dataset, e.g. logdir: {outside} (or --set "
                   f"logdir={outside})" if key == ("logdir",) else
                   f"give a checkpoint.dir outside the dataset, or leave it out for "
                   f"{config.logdir / 'checkpoints'}")
            items.append((key, place, f"{what} {dataset}: {harm}", fix))
    if items:
        with located(config):
            raise config_error(config.source, items)


def _local(url: str) -> Path | None:
    """The real path of a local path or ``file://`` URL, None for another URL."""
    found = _URL.match(url)
    if found is not None and (found.group(1).lower(), found.group(2)) != ("file", "://"):
        return None
    return Path(os.path.realpath(url[len(found.group(0)):] if found is not None else url))


_GIVE_A_CONFIG = "Fix: give the path of a YAML job config (see examples/digits.yaml)"
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)(://|::)")


def _config_path(path: str | os.PathLike[str]) -> Path:
    """The config file's absolute local path; a URL (other than ``file://``) or an empty path is refused:
    the config's relative paths are relative to its folder, which only a local file has."""
    text = os.fspath(path)
    url = _URL.match(text)
    if url is not None and url.group(1).lower() == "file" and url.group(2) == "://":
        text = text[len(url.group(0)):]
    elif url is not None:
        raise ConfigError(f"job config {text!r}: a job config is read from a file on this machine, not a URL "
                          "(its relative paths are relative to its folder). Fix: copy it here first (e.g. "
                          "`aws s3 cp`, `gsutil cp`, `curl -O`) and give that file's path")
    if not text.strip():
        raise ConfigError(f"job config path {text!r} is empty. {_GIVE_A_CONFIG}")
    return Path(os.path.abspath(os.path.expanduser(text)))


def _read_config(source: Path) -> str:
    try:
        return source.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"job config {source}: it does not exist. {_GIVE_A_CONFIG}") from e
    except IsADirectoryError as e:
        found = sorted(p.name for p in source.glob("*.y*ml"))[:5]
        inside = f"; it holds {', '.join(found)}" if found else ""
        raise ConfigError(f"job config {source}: it is a folder, not a file{inside}. Fix: give the YAML "
                          f"file, e.g. {source / (found[0] if found else 'job.yaml')}") from e
    except PermissionError as e:
        raise ConfigError(f"job config {source}: this user (uid {_uid()}) may not read it ({e.strerror}). "
                          "Fix: make it readable (chmod a+r), or run as a user who may read it") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"job config {source}: it is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                          f"offset {e.start}). Fix: give the YAML job config, saved as UTF-8") from e
    except OSError as e:
        raise ConfigError(f"job config {source}: it cannot be read ({type(e).__name__}: {e.strerror or e}). "
                          f"{_GIVE_A_CONFIG}") from e


def _uid() -> str:
    geteuid = getattr(os, "geteuid", None)  # POSIX only
    return str(geteuid()) if geteuid is not None else "?"


def _tag_error(e: yaml.MarkedYAMLError) -> str | None:
    """The refusal of a tag PyYAML's safe loader has no constructor for (``!!python/object:...``, ``!foo``),
    or None for another error: the config is plain data, and safe loading never builds Python objects."""
    if not isinstance(e, yaml.constructor.ConstructorError):
        return None
    found = re.search(r"for the tag '([^']+)'", e.problem or "")
    if found is None:
        return None
    tag = found.group(1).replace("tag:yaml.org,2002:", "!!")
    return (f"the tag {tag} is not allowed: a job config is plain data (strings, numbers, booleans, null, "
            "lists, mappings), and shardkit never builds Python objects from YAML. Fix: remove the tag and "
            "write the plain value")


_TOO_DEEP = ("lists or mappings nest too deep for the YAML parser (hundreds of levels). Fix: nest them less; "
             "keep such data in a file that the script reads (its path in params)")


def _parse_yaml(text: str, source: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        refused = _tag_error(e)
        if refused is not None:
            raise ConfigError(f"job config {source}{at}: {refused}") from e
        raise ConfigError(f"job config {source}: YAML syntax error{at}: {e.problem or e.context}. Fix: "
                          "correct the YAML there (indentation, a missing ':', unclosed quotes or brackets)",
                          ) from e
    except yaml.YAMLError as e:
        raise ConfigError(f"job config {source}: not valid YAML ({e}). Fix: correct the file") from e
    except RecursionError as e:  # PyYAML parses nested collections recursively
        raise ConfigError(f"job config {source}: {_TOO_DEEP}") from e
    if not isinstance(data, dict):
        holds = "is empty" if data is None else f"holds {_a(_yaml_kind(data))}"
        raise ConfigError(f"job config {source}: the file {holds}, not a mapping of keys. Fix: write name:, "
                          "entrypoint:, framework:, roles: ... at the top level (see examples/digits.yaml)")
    where: dict[tuple[str, ...], str] = {}
    _index_lines(node, (), where, source, set())
    return data, where


def _index_lines(node: Any, path: tuple[str, ...], where: dict[tuple[str, ...], str], source: Path,
                 seen: set[int], *, override: str | None = None) -> None:
    """Record the line of every key, and refuse a key written twice (YAML would keep the last silently),
    in the file or in the value of ``override``."""
    if id(node) in seen:  # an alias of an anchor already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in lines and key != "<<":
                dotted = ".".join((*path, key))
                if override is not None:
                    raise ConfigError(f"job config {source}: override {override!r}: {dotted} is written "
                                      "twice. Fix: keep one of them")
                raise ConfigError(f"job config {source}: {dotted} is written twice (lines {lines[key]} and "
                                  f"{line}). Fix: keep one of them")
            lines[key] = line
            where[(*path, key)] = f"line {line}"
            _index_lines(value_node, (*path, key), where, source, seen, override=override)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            where[(*path, str(i))] = f"line {item.start_mark.line + 1}"
            _index_lines(item, (*path, str(i)), where, source, seen, override=override)


def _apply_override(
    raw: dict[str, Any], override: str, source: Path, where: dict[tuple[str, ...], str]
) -> None:
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"job config {source}: override {override!r} is not KEY.PATH=VALUE. Fix: write "
                          "e.g. --set roles.worker.count=4")
    _check_override_path(parts, override, source)
    try:
        value = yaml.safe_load(text)
    except RecursionError as e:
        raise ConfigError(f"job config {source}: override {override!r}: {_TOO_DEEP}") from e
    except yaml.YAMLError as e:
        refused = _tag_error(e) if isinstance(e, yaml.MarkedYAMLError) else None
        if refused is not None:
            raise ConfigError(f"job config {source}: override {override!r}: {refused}") from e
        why = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"job config {source}: override {override!r}: the value is not YAML ({why}). "
                          "Fix: quote it, e.g. --set 'name=\"my: job\"'") from e
    composed = yaml.compose(text, Loader=yaml.SafeLoader)
    _index_lines(composed, tuple(parts), {}, source, set(), override=override)  # a key written twice
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if i == 0 and part == "engine" and isinstance(child, str):
            child = {"name": child}  # `engine: local` then --set engine.workers=2
        if child is None:
            child = {}
        if not isinstance(child, dict):
            dotted = ".".join(parts[: i + 1])
            raise ConfigError(f"job config {source}: override {override!r}: {dotted} is {_show(child)}, "
                              f"not a mapping. Fix: set {dotted} itself, e.g. --set {dotted}=...")
        node[part] = child
        node = child
    node[parts[-1]] = value
    for stale in [k for k in where if k[: len(parts)] == tuple(parts)]:  # the file's keys it replaced
        del where[stale]
    where[tuple(parts)] = f"from --set {key.strip()}"


def _check_override_path(parts: Sequence[str], override: str, source: Path) -> None:
    tp: Any = JobConfig
    for i, part in enumerate(parts):
        tp = _unwrap(tp)
        dotted, parent = ".".join(parts[: i + 1]), ".".join(parts[:i]) or "the top level"
        allowed: Sequence[str] = ()
        if tp is EngineConfig or tp is Any:
            return  # engine options and free-form dicts take any key
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            allowed = list(tp.model_fields)
            tp = tp.model_fields[part].annotation if part in allowed else None
        elif get_origin(tp) is dict:
            key_type, value_type = get_args(tp)
            allowed = get_args(key_type) if get_origin(key_type) is Literal else ()
            tp = None if allowed and part not in allowed else value_type
        else:
            raise ConfigError(f"job config {source}: override {override!r}: {parent} is a single value, it "
                              f"has no key {part!r}. Fix: --set {parent}=VALUE")
        if tp is None:
            raise ConfigError(f"job config {source}: override {override!r}: unknown key {dotted}. Fix: "
                              f"{_did_you_mean(part, allowed)} (under {parent})")


# -- summary ---------------------------------------------------------------------------------------


def describe(config: JobConfig) -> str:
    """A human summary of a valid config (what ``shardkit validate`` prints); never a secret's value.

    Example:
        >>> print(describe(load_config("examples/digits.yaml")))
        job digits: torch allreduce, 2 processes, from examples/digits.yaml
        ...
    """
    from shardkit.job.layout import layout  # on use: the layout imports the config

    slots = layout(config)
    out = [f"job {config.name}: {config.framework} {config.strategy}, {len(slots)} processes"
           + (f", from {config.source}" if config.source else ""),
           f"  entrypoint: {config.entrypoint} ({config.entrypoint_kind})", f"  python: {config.python}",
           "  roles:"]
    for role in ROLES:
        if role in config.roles:
            spec = config.roles[role]
            res = spec.resources
            memory = f", memory {res.memory / 2**30:.3g} GiB" if res.memory else ""
            out.append(f"    {role} x{spec.count}: cpus {res.cpus:g}, gpus {res.gpus}{memory}")
    out.append("  processes:")
    for s in slots:
        rank = f" rank {s.rank}/{s.world_size}" if s.rank is not None else ""
        shard = f", data shard {s.data_shard}/{s.num_data_shards}" if s.data_shard is not None else ""
        out.append(f"    {s.role}[{s.index}]{rank}{shard}")
    if config.data is None:
        out.append("  data: none (the script reads its own)")
    else:
        d = config.data
        options = f", options: {', '.join(sorted(d.options))}" if d.options else ""
        shuffle = f"shuffle seed {d.seed}" if d.shuffle else "no shuffle"
        where = d.url
        if d.sources is not None:
            weights = {name: s.weight for name, s in d.sources.items()}
            where = "mixture of " + ", ".join(
                f"{name} {s.url}" + (f" (weight {weight_text(s.weight)})" if s.weight is not None else "")
                for name, s in d.sources.items())
            if all(w is None for w in weights.values()):
                where += " (weighed by their rows)"
            if d.samples_per_epoch is not None:
                where += f", {d.samples_per_epoch:,} samples per epoch"
        out.append(f"  data: {where}, batch {d.batch_size}, {shuffle}, epochs {d.num_epochs}{options}")
    c = config.checkpoint
    every = " and ".join(
        ([f"every {c.every_steps} steps"] if c.every_steps is not None else [])
        + ([f"every {c.every_seconds:g} s"] if c.every_seconds is not None else [])
    ) or "only when the script saves"
    out.append(f"  checkpoint: {config.checkpoint_dir}, {every}, keep {c.keep}")
    ft = config.fault_tolerance
    out.append(f"  fault tolerance: up to {ft.max_restarts} restarts, heartbeat every "
               f"{ft.heartbeat_interval:g} s, timeout {ft.heartbeat_timeout:g} s "
               f"(startup {ft.startup_timeout:g} s)")
    options = f" {json.dumps(config.engine.options, default=str)}" if config.engine.options else ""
    out += [f"  engine: {config.engine.name}{options}", f"  logdir: {config.logdir}"]
    if config.params:
        out.append(f"  params: {', '.join(sorted(config.params))}")
    if config.plain_env:
        out.append(f"  env: {', '.join(sorted(config.plain_env))}")
    for name in config.secret_names:
        ref = config.secrets.get(name)
        if ref is None:
            out.append(f"  secret {name}: from env: in the config (the name looks like a credential)")
        elif ref.env is not None:
            state = "set" if ref.env in os.environ else "NOT SET"
            out.append(f"  secret {name}: from env {ref.env} ({state})")
        else:
            state = "found" if ref.file is not None and ref.file.is_file() else "MISSING"
            out.append(f"  secret {name}: from file {ref.file} ({state})")
    return "\n".join(out)


def weight_text(weight: Any) -> str:
    """A source's weight as job summaries and ``shardkit inspect`` show it: ``3``, ``0:3 -> 1000000:1``
    (linear), ``steps 0:1, 1000:0``."""
    if isinstance(weight, dict):
        kind, pairs = next(iter(weight.items()))
        return f"{kind} " + ", ".join(f"{x}:{w:g}" for x, w in pairs)
    if isinstance(weight, list):
        return " -> ".join(f"{x}:{w:g}" for x, w in weight)
    return f"{weight:g}"
