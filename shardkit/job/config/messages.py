"""A job config's problems -> one `ConfigError`: pydantic's errors and the models' own, each as its key
path, the bad value, the problem and the fix, and where the key was set (its YAML line, or ``--set``);
`located` and `option_error` do the same for problems found after loading (an engine's options).

Apart from `shardkit.job.config.load`, which reads the file and records where each key was set; the
names here are importable from there too.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from shardkit.errors import ConfigError
from shardkit.job.config import JobConfig
from shardkit.job.config.sections import _did_you_mean
from shardkit.job.config.values import NO_VALUE as _NO_VALUE
from shardkit.job.config.values import Problem
from shardkit.job.protocol import ROLES

__all__ = ["config_error", "located", "option_error", "translate"]

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


#: the longest value an error shows whole: paths and URLs are longer than a line, and one cut short
#: does not name the place; past this, the middle goes (a path's end, its file, is what tells most)
SHOWN = 400


def _show(value: Any) -> str:
    text = repr(str(value) if isinstance(value, Path) else value)
    if len(text) <= SHOWN:
        return text
    half = (SHOWN - 3) // 2
    return text[:half] + "..." + text[-half:]


def config_error(source: Path | None, items: Sequence[_Item]) -> ConfigError:
    """Problems as ``(key path, value, problem, fix)`` -> one `ConfigError`, each line naming where the
    key was set (YAML line or ``--set``); the models in `shardkit.job.config` report through it."""
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
        is_key = "[key]" in err["loc"] or kind == "invalid_key"
        if is_key and value is not _NO_VALUE:
            loc = (*loc[:-1], str(value))  # pydantic writes a key True as 1
        if isinstance(cause, Problem):
            items.extend((loc + path, v, problem, fix) for path, v, problem, fix in cause.items)
        elif is_key and not isinstance(value, str):
            fix = (f"use one of {', '.join(ROLES)}" if loc[:1] == ("roles",) and len(loc) == 2
                   else "quote the key, or remove it")
            items.append((loc, _NO_VALUE, f"a key that is not a string ({_yaml_kind(value)} {value!r}"
                          f"{_BOOLEAN_NOTE if isinstance(value, bool) else ''})", fix))
        elif is_key and loc[:1] == ("roles",):
            items.append((loc, _NO_VALUE, f"unknown role {loc[-1]!r}", f"use one of {', '.join(ROLES)}"))
        elif is_key:
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
        elif kind == "finite_number":
            items.append((loc, value, "not a finite number", "write a finite number, e.g. 30 (.inf and .nan "
                          "are not accepted here)"))
        elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            expected = err["msg"].removeprefix("Input should be ")
            items.append((loc, value, f"it must be {expected}", f"set it to a number {expected}"))
        else:
            expected = re.sub(r"a valid dictionary( or instance of \w+)?", "a mapping of keys", err["msg"])
            expected = expected.replace("an instance of Path", "a path").removeprefix("Input should be ")
            items.append((loc, value, f"{_a(_yaml_kind(value))} where {expected} belongs",
                          _type_fix(kind, value, expected, loc)))
    return config_error(source, items)


_BOOLEAN_NOTE = ", as YAML reads yes/no/on/off/true/false unquoted"


def _type_fix(kind: str, value: Any, expected: str, loc: tuple[str | int, ...]) -> str:
    """The fix for a value of the wrong type, with what YAML made of it where that is the cause."""
    fix = f"make it {expected}"
    if isinstance(value, str) and kind in ("int_type", "float_type", "bool_type"):
        return fix + _unquote_hint(value, kind)
    if isinstance(value, bool) and kind == "string_type":
        return "quote it ('yes'): YAML reads yes/no/on/off/true/false unquoted as booleans"
    if isinstance(value, bool) and kind in ("int_type", "float_type"):
        return "write a number: YAML reads yes/no/on/off/true/false unquoted as booleans"
    if kind == "bool_type" and isinstance(value, int | float):
        return "write true or false"
    if kind == "string_type" and value is None and str(loc[-1]) in _MISSING_HINTS:
        return f"write {_MISSING_HINTS[str(loc[-1])]}"
    if kind == "string_type" and isinstance(value, int | float | datetime.date):
        text = value.isoformat() if isinstance(value, datetime.date) else str(value)
        return f"quote it ('{text}'): YAML reads it unquoted as {_a(_yaml_kind(value))}"
    return fix


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "an integer", "a string"."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


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
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping",
             datetime.date: "date", datetime.datetime: "date and time", bytes: "binary value (!!binary)",
             set: "set (!!set)"}
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


_LOCATED: contextvars.ContextVar[JobConfig | None] = contextvars.ContextVar("shardkit_located", default=None)


@contextlib.contextmanager
def located(config: JobConfig, **more: str) -> Iterator[None]:
    """Problems found in ``config`` after it loaded (its engine options, checked when the engine is
    built) name the config file and where each key was set, as loading's do; ``more`` adds places not
    in the file (``node_rank="from --node-rank"`` for ``engine.node_rank``). See `option_error`."""
    where = dict(config._where)
    where.update({("engine", key): text for key, text in more.items()})
    tokens = _WHERE.set(where), _LOCATED.set(config)
    try:
        yield
    finally:
        _WHERE.reset(tokens[0])
        _LOCATED.reset(tokens[1])


def option_error(items: Sequence[_Item]) -> ConfigError:
    """`config_error` of the config being checked (`located`), else of none (options given in Python)."""
    config = _LOCATED.get()
    return config_error(config.source if config is not None else None, items)
