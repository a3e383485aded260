"""mkdocs hooks: the reference pages that are generated from the code at build time, so they cannot
drift from it: the command line (from `shardkit.cli.build_parser`), the job config (from the pydantic
models of `shardkit.job.config`) and the error tree (from `shardkit.errors`).

A page asks for one by holding its marker on a line of its own: ``<!-- generated: cli -->``,
``<!-- generated: config -->`` or ``<!-- generated: errors -->``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import typing
from typing import Any

MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.M)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


def _cli() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps its help at the terminal's width: a fixed one here
    from shardkit.cli import build_parser

    parser = build_parser()
    out = ["## `shardkit`", "", "```text", parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        out += [f"## `shardkit {name}`", "", "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = (text.replace("typing.", "").replace("shardkit.job.config.sections.", "")
            .replace("NoneType", "None"))
    return text.replace(" | ", " or ")  # (a "|" would end a cell of the Markdown table)


def _config() -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from shardkit.job.config import JobConfig

    out: list[str] = []
    seen: set[type] = set()
    queue: list[tuple[str, type[BaseModel]]] = [("", JobConfig)]
    while queue:
        prefix, model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        title = f"`{prefix}`" if prefix else "Top level"
        doc = inspect.getdoc(model) or ""
        first = doc.split("\n\n")[0].replace("\n", " ")
        out += [f"## {title}", "", first, "", "| key | type | default |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            if field.default is not PydanticUndefined:
                default = f"`{field.default!r}`"
            elif field.default_factory is not None:
                default = "(see below)" if _models(field.annotation) else "`{}`"
            else:
                default = "required"
            out.append(f"| `{name}` | `{_type_name(field.annotation)}` | {default} |")
            for sub in _models(field.annotation):
                key = f"{prefix}.{name}" if prefix else name
                if typing.get_origin(field.annotation) is dict:
                    key += ".<name>"
                queue.append((key, sub))
        out.append("")
    return "\n".join(out)


def _models(annotation: Any) -> list[type]:
    """The pydantic models inside an annotation (``RoleConfig`` in ``dict[str, RoleConfig]``)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _errors() -> str:
    from shardkit import errors

    doc = inspect.getdoc(errors) or ""
    blocks = doc.split("\n\n")  # the module docstring: a title line, then the tree
    tree = blocks[1] if len(blocks) > 1 and blocks[0].startswith("Every error") else blocks[0]
    out = ["```text", tree.rstrip(), "```", ""]
    for name in sorted(errors.__all__):
        obj = getattr(errors, name)
        if not isinstance(obj, type):
            continue
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        out += [f"## `{name}`", "", f"*({bases})*", "", inspect.getdoc(obj) or "", ""]
    return "\n".join(out)


GENERATORS = {"cli": _cli, "config": _config, "errors": _errors}
