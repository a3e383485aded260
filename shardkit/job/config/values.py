"""What a job config's values may be: the `Problem` a validator reports, the check of the free-form
sections (``params``, ``data.options``, engine options), which reach the processes as JSON, and the rule
that tells an ``env:`` name that looks like a credential (`secret_word`)."""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_FREE_FORM_VALUES", "NO_VALUE", "Problem", "plain_data_problems", "secret_word"]

#: The most values a free-form section (``params``, ``data.options``, engine options) may hold, each counted
#: every time it appears: YAML aliases can make a few lines mean billions of values (a "billion laughs"),
#: which job.json would then spell out.
MAX_FREE_FORM_VALUES = 1_000_000
_MAX_PROBLEMS_SHOWN = 10  # of one free-form section
_MAX_DEPTH = 200  # how deep a free-form section may nest
# What a part of a credential's name ends with (OPENAI_API_KEY, HFTOKEN, OAUTH, DB_PASSWORD, GCP_CREDS)...
_SECRET_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "KEY", "CREDENTIAL", "CRED", "AUTH")
# ... or the whole part is (SMTP_PASS, MYSQL_PWD, GITHUB_PAT, HTTP_AUTHORIZATION); never PWD alone, the
# working folder
_SECRET_PARTS = ("PASS", "PWD", "PAT", "AUTHORIZATION")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


class Problem(ValueError):
    """One or more config problems found inside a validator: a key path relative to where pydantic
    raised it, the bad value, what is wrong and the fix (`ConfigError` is built from these)."""

    def __init__(self, path: Sequence[str | int], value: Any, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.items: list[tuple[tuple[str | int, ...], Any, str, str]] = [(tuple(path), value, problem, fix)]

    def add(self, other: Problem) -> Problem:
        self.items.extend(other.items)
        return self


NO_VALUE = object()  # a problem about a missing key: no value to show


def plain_data_problems(value: Any) -> list[Problem]:
    """What a free-form section (``params``, ``data.options``, engine options) holds that its processes
    would not get as written: they read the config from JSON (``job.json``), so a key must be a string and
    a value a string, a finite number, a boolean, null, a list or a mapping. YAML gives more (``1:`` keys,
    dates, ``.inf``, ``!!binary``, ``!!set``) and each would arrive changed (``"1"``, a string, null) or fail
    the job's start; and aliases can repeat one value more often (or inside itself) than JSON can spell out.
    Problems are returned with their key paths below the section, at most `_MAX_PROBLEMS_SHOWN`."""
    problems: list[Problem] = []
    sizes: dict[int, int] = {}  # containers already walked (YAML aliases share them): their value counts
    open_ids: set[int] = set()  # containers being walked: meeting one again is a cycle

    def add(path: tuple[str | int, ...], bad: Any, problem: str, fix: str) -> None:
        if len(problems) < _MAX_PROBLEMS_SHOWN:
            problems.append(Problem(path, bad, problem, fix))

    def walk(node: Any, path: tuple[str | int, ...]) -> int:
        if isinstance(node, dict | list | tuple):
            if len(open_ids) >= _MAX_DEPTH:  # built in Python (YAML stops earlier): no RecursionError
                add(path, NO_VALUE, f"it nests more than {_MAX_DEPTH} levels deep", "nest it less")
                return 1
            if id(node) in open_ids:
                add(path, NO_VALUE, "it contains itself (a YAML alias inside its own anchor)",
                    "write the value out; JSON cannot hold a value that contains itself")
                return 1
            if id(node) in sizes:
                return sizes[id(node)]
            open_ids.add(id(node))
            count = 1
            if isinstance(node, dict):
                for key, item in node.items():
                    if not isinstance(key, str):
                        add((*path, str(key)), NO_VALUE, *_key_problem(key))
                    count += walk(item, (*path, str(key)))
            else:
                for i, item in enumerate(node):
                    count += walk(item, (*path, i))
            open_ids.discard(id(node))
            sizes[id(node)] = count
            return count
        if isinstance(node, float) and not math.isfinite(node):
            add(path, node, "not a finite number; the processes read the config as JSON, where it becomes "
                "null", "write a finite number, or a string ('inf') for the code that reads it to convert")
        elif not isinstance(node, str | int | float | type(None)):  # bool is an int
            add(path, node, *_value_problem(node))
        return 1

    total = walk(value, ())
    if total > MAX_FREE_FORM_VALUES:
        problems.insert(0, Problem((), NO_VALUE, f"it holds {total:,} values once YAML aliases are spelled "
                                   f"out, more than shardkit's limit of {MAX_FREE_FORM_VALUES:,}",
                                   "write the data out without nested aliases, or keep it in a file that "
                                   "the script reads (its path in params)"))
    return problems


def _key_problem(key: Any) -> tuple[str, str]:
    why = ", as YAML reads yes/no/on/off/true/false unquoted" if isinstance(key, bool) else ""
    example = "yes" if isinstance(key, bool) else str(key)
    return (f"a key that is not a string ({_kind(key)} {key!r}{why}); the processes read the config as JSON, "
            "whose keys are strings", f"quote the key, e.g. '{example}': ..., and read it as a string")


def _value_problem(value: Any) -> tuple[str, str]:
    if isinstance(value, datetime.date):  # and datetime
        return (f"a {_kind(value)}; the processes read the config as JSON, where it becomes the string "
                f"{value.isoformat()!r}", f"quote it ('{value.isoformat()}') to make it a string")
    if isinstance(value, bytes | bytearray):
        return ("binary data (!!binary), which JSON cannot hold",
                "write it as a string (e.g. the base64 text, decoded by the script)")
    if isinstance(value, set | frozenset):
        return ("a set (!!set); the processes read the config as JSON, where it becomes a list",
                "write a list: [a, b]")
    return (f"a {type(value).__name__}, which JSON cannot hold unchanged",
            "use strings, numbers, booleans, null, lists and mappings")


def _kind(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
             datetime.date: "date", datetime.datetime: "date and time"}
    return names.get(type(value), type(value).__name__)


def secret_word(name: str) -> str | None:
    """The word that makes the environment variable ``name`` look like a credential, or None.

    Example:
        >>> secret_word("WANDB_API_KEY"), secret_word("HF_TOKEN"), secret_word("TOKENIZERS_PARALLELISM")
        ('KEY', 'TOKEN', None)

    The name is cut into parts at ``_`` and where a lower-case letter or digit meets an upper-case one
    (``apiKey``: ``api``, ``Key``). A part, upper-cased, without its trailing digits, with or without a
    plural ``S``, that ends with TOKEN, SECRET, PASSWORD, PASSWD, PASSPHRASE, KEY, CREDENTIAL, CRED or
    AUTH, or that is PASS, PWD, PAT or AUTHORIZATION, makes it a credential. Parts, not substrings, so that
    ``TOKENIZERS_PARALLELISM``, ``KEYBOARD_LAYOUT`` or ``GIT_AUTHOR_NAME`` are not; a name such as
    ``SORT_KEY`` or ``SSH_AUTH_SOCK`` is, though its value is no secret: the value still reaches the
    processes, but it is kept out of files and masked in their output all the same. ``PWD`` alone (the
    working folder) is not.
    """
    if name.upper() == "PWD":
        return None
    for piece in _CAMEL.sub("_", name).upper().split("_"):
        part = piece.rstrip("0123456789")
        for form in (part, part[:-1]) if part.endswith("S") else (part,):  # SECRETS as SECRET, PASS as PASS
            for word in _SECRET_ENDINGS:
                if form.endswith(word):
                    return word
            if form in _SECRET_PARTS:
                return form
    return None
