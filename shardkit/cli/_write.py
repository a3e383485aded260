"""``shardkit write SRC DEST``: its flags, and `convert`'s errors and warnings written in the flags' words."""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

from shardkit.cli import _interrupts
from shardkit.cli._flags import add_storage_options, in_flags
from shardkit.cli._output import column_names, describe, format_description, human, warnings_after
from shardkit.errors import DatasetError, SchemaError, ShardkitError

# convert's `columns=` followed by the names of --columns it is about (absent from the source, or too few
# for the dataset appended to): `in_flags` alone would write `--columns ['zz']`, a Python list after a flag
_COLUMNS_NAMED = re.compile(r"\bcolumns= (?=\[|leaves out\b)")
_COMMANDS = [  # the Python API's calls where the command line has a flag or a command (longest first)
    ("columns= (shardkit write --columns)", "--columns"),
    ("shardkit.write_summary(url) (or `shardkit index URL`)", "`shardkit index URL`"),
    ("shardkit.write_summary(url)", "`shardkit index URL`"),
]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``shardkit write SRC DEST [flags]`` to the command's subparsers."""
    p = sub.add_parser("write", help="convert a CSV, JSON-lines or Parquet file or folder, or a Petastorm, "
                                     "shardkit or plain Parquet dataset, into a shardkit dataset")
    p.add_argument("src", help="a file or folder, or a quoted glob pattern ('data/*.csv'); any fsspec URL")
    p.add_argument("dest", help="the dataset's folder (any fsspec URL)")
    p.add_argument("--mode", choices=["error", "overwrite", "append"], default="error",
                   help="when DEST holds a dataset: fail (default), replace it, or add the rows to it")
    p.add_argument("--schema", metavar="FILE.json", help="fields to declare (a JSON list of fields, or what "
                                                         "`shardkit inspect --json` prints); others inferred")
    p.add_argument("--columns", metavar="A,B", help="the columns to write, comma-separated (default: all)")
    p.add_argument("--row-group-size", default="16MiB", metavar="SIZE",
                   help="encoded bytes per row group (default 16MiB), or a number of rows (e.g. 10000)")
    p.add_argument("--file-size", default="128MiB", metavar="SIZE", help="encoded bytes per file (128MiB)")
    p.add_argument("--compression", default="auto", help="auto (default), snappy, zstd, lz4, none, ...")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None,
                   help="no progress bar (default: one on a terminal)")
    add_storage_options(p, "SRC and DEST")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    """Run `shardkit.dataset.convert.convert` with the flags given and say what it wrote; its errors and
    warnings about their values name the flags as typed (`worded`: ``--row-group-size 0``, not
    ``row_group_size=0``; ``--mode overwrite``, not ``mode='overwrite'``). Ctrl-C prints one line saying
    what was left, and returns 130 (the write cleans up after itself)."""
    from shardkit.dataset import open_dataset
    from shardkit.dataset.convert import convert

    columns = column_names(args.columns)
    if columns is not None and (not columns or len(set(columns)) < len(columns)):  # the flag's own text
        twice = sorted({c for c in columns if columns.count(c) > 1})
        what = f"names {twice} more than once" if twice else "names no column"
        args.parser.error(f"argument --columns: {args.columns!r} {what}; name each column to write once, "
                          "comma-separated (--columns a,b), or leave --columns out to write them all")
    size = args.row_group_size  # a number of rows, else a size ('²' is a digit that int() does not take)
    kwargs: dict[str, Any] = {
        "schema": args.schema, "columns": columns, "mode": args.mode,
        "row_group_size": int(size) if size.isdecimal() else size, "file_size": args.file_size,
        "compression": args.compression, "progress": args.progress, "storage_options": args.storage_options,
    }
    before = None  # the rows of the dataset appended to: rows/s counts the rows written
    if args.mode == "append":
        with warnings.catch_warnings(), contextlib.suppress(ShardkitError):
            warnings.simplefilter("ignore")
            before = open_dataset(args.dest, storage_options=args.storage_options).num_rows
    start = time.perf_counter()
    try:
        try:
            with warnings_after(UserWarning, worded=lambda message: worded(message, args.parser, kwargs)):
                ds = convert(args.src, args.dest, **kwargs)
        except Exception as e:  # a Ctrl-C that pyarrow turned into its own error (`_interrupts`)
            if (interrupt := _interrupts.behind(e)) is not None:
                raise interrupt from e
            raise
    except (DatasetError, SchemaError) as e:
        message = worded(str(e), args.parser, kwargs)
        if message == str(e):
            raise
        raise type(e)(message) from e
    except KeyboardInterrupt as e:  # Ctrl-C: one line, as for errors (the write cleaned up after itself)
        print(f"shardkit write: interrupted; nothing was committed to {args.dest} unless the write had "
              "finished (see `shardkit inspect`): run it again", file=sys.stderr)
        return 128 + int(getattr(e, "signum", signal.SIGINT))
    seconds = time.perf_counter() - start
    info = describe(ds)
    written = info["rows"] - (before or 0)
    rows, now = (f"{written:,} rows appended (now {info['rows']:,} rows", ")") if before is not None else (
        f"{written:,} rows", "")
    print(f"wrote {info['url']}: {rows} in {info['row_groups']:,} row groups, {len(info['files']):,} files, "
          f"{human(info['bytes'])} uncompressed{now}, in {seconds:.2f} s "
          f"({written / max(seconds, 1e-9):,.0f} rows/s)\n")
    print(format_description(info).split("\n\n")[1])  # the fields table
    return 0


def worded(message: str, parser: argparse.ArgumentParser, given: Mapping[str, Any]) -> str:
    """``message`` of `convert` as the command line says it: each argument as the flag that sets it
    (`shardkit.cli._flags.in_flags`; ``given``: convert's arguments from the flags), and the phrases that
    a flag alone would leave in Python's words.

    Example:
        >>> worded("columns= ['zz'], but 'a.csv' has no such column(s)", parser, {"columns": ["a", "zz"]})
        "--columns a,zz names ['zz'], but 'a.csv' has no such column(s)"

    ``columns= [...]`` (convert's names of --columns the source lacks) says the flag as typed, then
    those names; ``columns= (shardkit write --columns)`` is the flag once; ``shardkit.write_summary(url)``
    is ``shardkit index URL`` (the URL the message names: SRC's or DEST's).
    """
    if given.get("columns") is not None:
        message = _COLUMNS_NAMED.sub(
            lambda m: f"columns={given['columns']!r} {'names ' if message[m.end()] == '[' else ''}", message)
    for python, command in _COMMANDS:
        message = message.replace(python, command)
    return in_flags(message, parser, given)
