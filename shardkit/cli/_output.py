"""What the commands print: sizes, a dataset's description (``inspect``, ``write``) and the warnings a
command shows after its work; shared by the commands of `shardkit.cli`."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardkit.dataset import Dataset


def human(n: float) -> str:
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
    snapshot = None
    if ds.snapshot is not None:
        time = ds.snapshot.time
        snapshot = {"format": ds.snapshot.format, "version": ds.snapshot.version,
                    "time": None if time is None else time.isoformat(), "versions": len(ds.snapshot.versions)}
    from shardkit.dataset.verify import checksum_presence

    return {
        "url": ds.url,
        "kind": ds.kind,
        "snapshot": snapshot,
        "page_checksums": checksum_presence(ds),
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
    files = [[f["file"], str(f["row_groups"]), f"{f['rows']:,}", human(f["bytes"])] for f in info["files"]]
    snap = info.get("snapshot")
    what = f"{info['kind']} dataset"
    if snap:
        word = "version" if snap["format"] == "delta" else "snapshot"
        what = (f"{'Delta Lake' if snap['format'] == 'delta' else 'Iceberg'} table, {word} {snap['version']}"
                f"{' of ' + snap['time'] if snap['time'] else ''}, {snap['versions']} {word}s in its history")
    head = (f"{info['url']}  ({what})\n"
            f"{info['rows']:,} rows in {info['row_groups']:,} row groups, "
            f"{len(info['files']):,} files, {human(info['bytes'])} uncompressed")
    if (sums := info.get("page_checksums")) and sums["files_checked"]:
        head += "\n" + _checksums_line(sums)
    return "\n\n".join([head, _table(fields, ["field", "dtype", "shape", "codec", "nullable"]),
                        _table(files, ["file", "row groups", "rows", "bytes"])])


def _checksums_line(sums: dict[str, int]) -> str:
    """What `describe`'s ``page_checksums`` says, in words."""
    checked, have = sums["files_checked"], sums["with_checksums"]
    of = f"{checked} file{'s' if checked > 1 else ''} looked at"
    if have == checked:
        return f"page checksums: yes, every read verifies them ({of}; `shardkit verify` checks every page)"
    fix = "`shardkit write URL NEW_URL` rewrites it with them"
    if have == 0:
        return (f"page checksums: none ({of}): damaged pages are caught only where they do not decode; {fix}")
    return f"page checksums: in {have} of {checked} files looked at; the others are not checked; {fix}"


@contextlib.contextmanager
def warnings_after(show: type[Warning], *, hide: type[Warning] | None = None,
                    worded: Callable[[str], str] | None = None) -> Iterator[None]:
    """Warnings of class ``show`` raised in the block, each printed once on stderr after it ends
    (``warning: <message>``; not when it raises); ``hide``'s not at all. ``worded`` rewrites a message
    first (``shardkit bench``: the Python arguments it names as the flags that set them)."""
    with warnings.catch_warnings(record=True) as caught:
        if hide is not None:
            warnings.simplefilter("ignore", hide)
        warnings.simplefilter("always", show)
        yield
    for w in caught:
        message = str(w.message)
        print(f"warning: {message if worded is None else worded(message)}", file=sys.stderr)


def column_names(text: str | None) -> list[str] | None:
    """``--columns a,b``: the names, blanks left out; None when not given."""
    return None if text is None else [c.strip() for c in text.split(",") if c.strip()]
