"""The ``shardkit`` command: parses arguments and calls the Python API, nothing more."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from shardkit.dataset import Dataset, SummaryMissingWarning, open_dataset, write_summary
from shardkit.errors import ShardkitError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def describe(ds: Dataset) -> dict[str, Any]:
    """A JSON-able description of a dataset (what ``shardkit inspect --json`` prints)."""
    per_file: dict[str, dict[str, int]] = {}
    for rg in ds.row_groups:
        entry = per_file.setdefault(rg.file, {"row_groups": 0, "rows": 0, "bytes": 0})
        entry["row_groups"] += 1
        entry["rows"] += rg.num_rows
        entry["bytes"] += rg.num_bytes
    return {
        "url": ds.url,
        "kind": ds.kind,
        "rows": ds.num_rows,
        "bytes": ds.num_bytes,
        "row_groups": len(ds.row_groups),
        "fields": [f.to_json() for f in ds.schema],
        "files": [{"file": name, **v} for name, v in per_file.items()],
    }


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _codec(spec: dict[str, Any]) -> str:
    options = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "name")
    return f"{spec['name']}({options})" if options else str(spec["name"])


def format_description(info: dict[str, Any]) -> str:
    fields = [
        [f["name"], f["dtype"], str(tuple(f["shape"])).replace(",)", ")"), _codec(f["codec"]),
         "yes" if f["nullable"] else "no"]
        for f in info["fields"]
    ]
    files = [[f["file"], str(f["row_groups"]), f"{f['rows']:,}", _human(f["bytes"])] for f in info["files"]]
    head = (f"{info['url']}  ({info['kind']} dataset)\n"
            f"{info['rows']:,} rows in {info['row_groups']:,} row groups, "
            f"{len(info['files']):,} files, {_human(info['bytes'])} uncompressed")
    return "\n\n".join([head, _table(fields, ["field", "dtype", "shape", "codec", "nullable"]),
                        _table(files, ["file", "row groups", "rows", "bytes"])])


def _inspect(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SummaryMissingWarning)
        ds = open_dataset(args.url)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    info = describe(ds)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0


def _index(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SummaryMissingWarning)
        ds = write_summary(args.url)
    summary = f"{args.url.rstrip('/')}/_metadata"
    print(f"wrote {summary}: {len(ds.row_groups):,} row groups in {len(ds.files):,} files")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print a dataset's schema, files and row groups")
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("index", help="write the _metadata summary of a plain Parquet folder")
    p.add_argument("url")
    p.set_defaults(func=_index)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ShardkitError as e:
        print(f"shardkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
