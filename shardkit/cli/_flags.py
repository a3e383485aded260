"""The Python API's messages in the words of the command line: each argument they name written as the flag
that sets it (`in_flags`), shared by the commands that pass their flags to one function (``shardkit bench``,
``shardkit write``); apart from the commands so that neither imports the other's module for it."""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
from collections.abc import Mapping
from typing import Any

# a Python repr of a str or bytes (a value, a path); a quote after a letter is an apostrophe ("the worker's")
_QUOTED = re.compile(r"""(?<!\w)b?(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")""")
_CALL = re.compile(r"[A-Za-z_][\w.]*\([^()]*\)")  # cache=CacheConfig(directory, size_limit)
_LITERAL = re.compile(rf"{_QUOTED.pattern}|\b(?:True|False|None)\b")
_JSON_WORDS = {"True": "true", "False": "false", "None": "null"}


def in_flags(message: str, parser: argparse.ArgumentParser, given: Mapping[str, Any]) -> str:
    """``message`` of the Python API with each argument it names written as the flag of ``parser`` that
    sets it, as the user would type it.

    Example:
        >>> in_flags("warmup_batches=-1 must be an int >= 0", bench_parser, {"warmup_batches": -1})
        '--warmup -1 must be an int >= 0'

    ``name=<value passed>`` (``given``: what the flags passed, by argument name) becomes the flag and the
    value as typed (``--columns a,a``); ``name=None`` the flag that passes None (``--no-cache``);
    ``name=Class(...)`` the flag and its metavar (``--cache DIR``); ``name='text'``, a value other than
    the one passed (a fix: ``mode='overwrite'``), the flag and that text (``--mode overwrite``); a Python
    dict after a JSON flag's name that JSON, quoted for the shell; any other ``name=`` the flag
    (``--num-shards <number of workers>``), and so does a bare ``snake_case`` name (``num_shards``; a
    bare ``shard`` is English). Text in quotes (paths, field names, URLs) is left as it is.
    """
    takes, sets = _flags(parser)
    token = re.compile(rf"(?<![\w.])({'|'.join(sorted(takes, key=len, reverse=True))})(?:(=)|(?![\w(]))")
    quoted = [m.span() for m in _QUOTED.finditer(message)]
    out, done = [], 0
    for m in token.finditer(message):
        name, assigned = m.group(1), m.group(2) is not None
        if m.start() < done or any(a <= m.start() < b for a, b in quoted) or not (assigned or "_" in name):
            continue
        action = takes[name]
        spelled = (_spelled(action, sets.get(name, {}), message[m.end():], given) if assigned
                   else (action.option_strings[0], 0))
        if spelled is not None:
            out.append(message[done:m.start()] + spelled[0])
            done = m.end() + spelled[1]
    return "".join(out) + message[done:]


def _flags(parser: argparse.ArgumentParser) -> tuple[dict[str, argparse.Action], dict[str, dict[str, str]]]:
    """By argument name: the flag that takes its value (else the one that sets it), and the flags that set
    it to a constant (by the constant's repr: ``{"cache": {"None": "--no-cache"}}``)."""
    takes: dict[str, argparse.Action] = {}
    sets: dict[str, dict[str, str]] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if action.nargs == 0:
            sets.setdefault(action.dest, {})[repr(action.const)] = action.option_strings[0]
            takes.setdefault(action.dest, action)
        else:
            takes[action.dest] = action
    return takes, sets


def _spelled(action: argparse.Action, sets: Mapping[str, str], rest: str, given: Mapping[str, Any]
             ) -> tuple[str, int] | None:
    """How the command line writes ``name=`` followed by ``rest``: the text, and how many characters of
    ``rest`` it stands for too; None: leave it as it is (see `in_flags`)."""
    for const, flag in sets.items():
        if re.match(rf"{re.escape(const)}(?!\w)", rest):
            return flag, len(const)
    flag, name = action.option_strings[0], action.dest
    if action.nargs == 0:  # a value that no flag of the argument sets
        return None
    if given.get(name) is not None and rest.startswith(repr(given[name])):
        return f"{flag} {_typed(given[name])}", len(repr(given[name]))
    if (text := _text(rest)) is not None:
        return f"{flag} {shlex.quote(text[0])}", text[1]
    if (call := _CALL.match(rest)) is not None:
        return f"{flag} {action.metavar}", call.end()
    if action.type is _json_object and (literal := _braced(rest)) is not None:
        return f"{flag} {shlex.quote(_LITERAL.sub(_json_token, literal))}", len(literal)
    return (flag if rest[:1] in ("", " ", ";", ",", ".", ")", ":") else f"{flag} "), 0


def _text(rest: str) -> tuple[str, int] | None:
    """The str literal that ``rest`` starts with (``'overwrite'``), and its length in ``rest``; None where
    it starts with none (a bytes literal is none: the command line types no bytes)."""
    quoted = _QUOTED.match(rest)
    if quoted is None:
        return None
    try:
        value = ast.literal_eval(quoted.group())
    except (ValueError, SyntaxError):  # an escape that Python's repr never writes ('\N')
        return None
    return (value, quoted.end()) if isinstance(value, str) else None


def _typed(value: Any) -> str:
    """A value passed to the API as the flag's text that passes it, quoted for the shell where needed."""
    if isinstance(value, list):
        text = ",".join(map(str, value))
    elif isinstance(value, dict):
        text = json.dumps(value)
    else:
        text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    return shlex.quote(text)


def _braced(text: str) -> str | None:
    """The ``{...}`` that ``text`` starts with (braces in quotes aside), or None."""
    if not text.startswith("{"):
        return None
    depth, i = 0, 0
    while i < len(text):
        quote = _QUOTED.match(text, i)
        if quote is not None:
            i = quote.end()
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
        if depth == 0:
            return text[:i]
    return None


def _json_token(m: re.Match[str]) -> str:
    """A str repr or True/False/None of a Python literal, as JSON writes it."""
    word = m.group()
    if word in _JSON_WORDS:
        return _JSON_WORDS[word]
    value = ast.literal_eval(word)
    return json.dumps(value) if isinstance(value, str) else word  # bytes have no JSON


def _json_object(text: str) -> dict[str, Any]:
    """``--storage-options JSON``: a JSON object (the flag type whose values `in_flags` writes as JSON)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e}); write an object, e.g. "
                                         """'{"anon": true}'""") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is JSON but not an object; write one, e.g. "
                                         """'{"anon": true}'""")
    return value


def add_storage_options(p: argparse.ArgumentParser, what: str = "URL") -> None:
    """``--storage-options JSON``, the fsspec options of a command's URLs (an object store's endpoint and
    credentials), as the Python API's ``storage_options=`` takes them."""
    p.add_argument("--storage-options", type=_json_object, metavar="JSON",
                   help=f"fsspec options for {what}, a JSON object, e.g. "
                        """'{"client_kwargs": {"endpoint_url": "http://localhost:9000"}}'""")
