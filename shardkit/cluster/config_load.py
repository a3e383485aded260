"""Job config files: YAML -> `JobConfig` (with ``--set`` overrides), pydantic errors -> `ConfigError`
with key paths, and `describe` (what ``shardkit validate`` prints)."""

from __future__ import annotations

import contextvars
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from shardkit.cluster.config import _NO_VALUE, EngineConfig, JobConfig, Problem, _did_you_mean
from shardkit.cluster.protocol import ROLES
from shardkit.errors import ConfigError

__all__ = ["describe", "load_config", "translate"]


# -- errors ----------------------------------------------------------------------------------------

# Where each key path was set (a YAML line number, or the --set override), to point errors at it.
_WHERE: contextvars.ContextVar[dict[tuple[str, ...], str]] = contextvars.ContextVar("shardkit_config_where")
_MISSING_HINTS = {
    "name": "name: my-job",
    "entrypoint": "entrypoint: train.py (a script next to the config) or package.module:function",
    "framework": "framework: torch (or tensorflow)",
    "roles": "roles: {worker: {count: 2}}",
    "url": "url: path/to/dataset (or s3://bucket/dataset)",
}
_Item = tuple[tuple[str | int, ...], Any, str, str]


def _show(value: Any) -> str:
    text = repr(str(value) if isinstance(value, Path) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def config_error(source: Path | None, items: Sequence[_Item]) -> ConfigError:
    """Problems as ``(key path, value, problem, fix)`` -> one `ConfigError`, each line naming where the
    key was set (YAML line or ``--set``); the models in `shardkit.cluster.config` report through it."""
    where_map = _WHERE.get({})
    lines = []
    for path, value, problem, fix in items:
        key = ".".join(str(p) for p in path) or "(top level)"
        shown = "" if value is _NO_VALUE else f" = {_show(value)}"
        where = next((where_map[tuple(map(str, path[:n]))] for n in range(len(path), 0, -1)
                      if tuple(map(str, path[:n])) in where_map), "")
        lines.append(f"  - {key}{shown}{f' ({where})' if where else ''}: {problem}. Fix: {fix}.")
    head = f"invalid job config {source or '(built in Python)'}"
    count = f"{len(items)} problems" if len(items) > 1 else "1 problem"
    return ConfigError(f"{head}: {count}\n" + "\n".join(lines))


def translate(error: ValidationError, source: Path | None) -> ConfigError:
    """pydantic's errors (all of them, in order) -> one `ConfigError` with a key path and fix per problem."""
    items: list[_Item] = []
    for err in error.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if p != "[key]")
        kind, value = err["type"], err.get("input", _NO_VALUE)
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, Problem):
            items.extend((loc + path, v, problem, fix) for path, v, problem, fix in cause.items)
        elif "[key]" in err["loc"] and loc[:1] == ("roles",):
            items.append((loc, _NO_VALUE, f"unknown role {loc[-1]!r}", f"use one of {', '.join(ROLES)}"))
        elif "[key]" in err["loc"]:
            items.append((loc, value, "a key here must be a string", "quote the key"))
        elif kind == "missing":
            hint = _MISSING_HINTS.get(str(loc[-1]), f"{loc[-1]}: ...")
            items.append((loc, _NO_VALUE, "a required key is missing", f"add {hint}"))
        elif kind == "extra_forbidden":
            allowed = _model_at([str(p) for p in loc[:-1]])
            items.append((loc, value, "unknown key", _did_you_mean(str(loc[-1]), allowed)))
        elif kind == "literal_error":
            expected = err["msg"].removeprefix("Input should be ")
            items.append((loc, value, "not one of the accepted values", f"use {expected}"))
        else:
            expected = re.sub(r"a valid dictionary( or instance of \w+)?", "a mapping of keys", err["msg"])
            expected = expected.replace("an instance of Path", "a path").removeprefix("Input should be ")
            fix = f"make it {expected}"
            if isinstance(value, str) and kind in ("int_type", "float_type", "bool_type"):
                fix += _unquote_hint(value, kind)
            elif isinstance(value, bool) and kind == "string_type":
                fix = "quote it ('yes'): YAML reads yes/no/on/off/true/false unquoted as booleans"
            items.append((loc, value, f"a {_yaml_kind(value)} where {expected} belongs", fix))
    return config_error(source, items)


def _unquote_hint(text: str, kind: str) -> str:
    """How to write ``text`` so that YAML reads a number or boolean. A string that YAML would read as
    one without quotes was quoted; one that is a number to Python but not to YAML is YAML 1.1's
    exponent rule (PyYAML): ``1e3`` and ``1.0e3`` are strings, ``1.0e+3`` is a float."""
    try:
        unquoted = yaml.safe_load(text)
    except yaml.YAMLError:
        unquoted = None
    if type(unquoted) in (int, float, bool):
        return " (write it without quotes)"
    if kind == "bool_type":
        return ""
    try:
        number = float(text)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return " (YAML writes infinity and not-a-number as .inf, -.inf and .nan)"
    whole = number.is_integer() and abs(number) < 1e16
    if kind == "int_type":
        return f" (YAML reads {text} as a string: write {int(number)})" if whole else ""
    mantissa, e, exponent = text.strip().lower().partition("e")
    forms = [str(int(number))] if whole else []
    if e:
        dotted = mantissa if "." in mantissa else f"{mantissa}.0"
        signed = exponent if exponent[:1] in ("+", "-") else f"+{exponent}"
        if isinstance(yaml.safe_load(f"{dotted}e{signed}"), float):
            forms.append(f"{dotted}e{signed}")
    if not forms:
        return ""
    return (f" (YAML reads {text} as a string: YAML 1.1 wants a dot and a signed exponent; write "
            f"{' or '.join(forms)})")


def _yaml_kind(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _model_at(parts: Sequence[str]) -> list[str]:
    """The keys allowed under a key path (for "did you mean"); [] when free-form."""
    tp: Any = JobConfig
    for part in parts:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            tp = tp.model_fields[part].annotation if part in tp.model_fields else Any
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
    tp = _unwrap(tp)
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _unwrap(tp: Any) -> Any:
    """``X | None`` -> X."""
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if get_origin(tp) is not dict and get_origin(tp) is not Literal and len(args) == 1 else tp


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
    source = Path(os.path.abspath(os.path.expanduser(path)))
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        problem = "it does not exist" if isinstance(e, FileNotFoundError) else f"it cannot be read ({e})"
        raise ConfigError(f"job config {source}: {problem}. Fix: give the path of a YAML job config "
                          "(see examples/digits.yaml)") from e
    raw, where = _parse_yaml(text, source)
    for override in overrides:
        _apply_override(raw, override, source, where)
    token = _WHERE.set(where)
    try:
        return JobConfig.from_dict(raw, base_dir=source.parent, source=source)
    finally:
        _WHERE.reset(token)


def _parse_yaml(text: str, source: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"job config {source}: YAML syntax error{at}: {e.problem or e.context}. Fix: "
                          "correct the YAML there (indentation, a missing ':', unclosed quotes or brackets)",
                          ) from e
    except yaml.YAMLError as e:
        raise ConfigError(f"job config {source}: not valid YAML ({e}). Fix: correct the file") from e
    if not isinstance(data, dict):
        raise ConfigError(f"job config {source}: the file holds {type(data).__name__}, not a mapping of "
                          "keys. Fix: write name:, entrypoint:, framework:, roles: ... at the top level")
    where: dict[tuple[str, ...], str] = {}
    _index_lines(node, (), where, source, set())
    return data, where


def _index_lines(node: Any, path: tuple[str, ...], where: dict[tuple[str, ...], str], source: Path,
                 seen: set[int]) -> None:
    """Record the line of every key, and refuse a key written twice (YAML would keep the last silently)."""
    if id(node) in seen:  # an alias of an anchor already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in lines and key != "<<":
                dotted = ".".join((*path, key))
                raise ConfigError(f"job config {source}: {dotted} is written twice (lines {lines[key]} and "
                                  f"{line}). Fix: keep one of them")
            lines[key] = line
            where[(*path, key)] = f"line {line}"
            _index_lines(value_node, (*path, key), where, source, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            where[(*path, str(i))] = f"line {item.start_mark.line + 1}"
            _index_lines(item, (*path, str(i)), where, source, seen)


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
    except yaml.YAMLError as e:
        why = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"job config {source}: override {override!r}: the value is not YAML ({why}). "
                          "Fix: quote it, e.g. --set 'name=\"my: job\"'") from e
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
    from shardkit.cluster.spec import layout  # on use: loading a config needs no spec

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
        out.append(f"  data: {d.url}, batch {d.batch_size}, {shuffle}, epochs {d.num_epochs}{options}")
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
    if config.env:
        out.append(f"  env: {', '.join(sorted(config.env))}")
    for name, ref in sorted(config.secrets.items()):
        if ref.env is not None:
            state = "set" if ref.env in os.environ else "NOT SET"
            out.append(f"  secret {name}: from env {ref.env} ({state})")
        else:
            state = "found" if ref.file is not None and ref.file.is_file() else "MISSING"
            out.append(f"  secret {name}: from file {ref.file} ({state})")
    return "\n".join(out)
