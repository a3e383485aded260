"""What the commands print: sizes, a dataset's description (``inspect``, ``write``), a mixture's
(``inspect URL URL ...``) and the warnings a command shows after its work; and the sources and weights
of ``inspect`` and ``bench`` as typed. Shared by the commands of `shardkit.cli`."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardkit.errors import ReaderError
from shardkit.job.config.load import weight_text

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


_NAMED = re.compile(r"([A-Za-z_][\w.-]*)=(.+)\Z")


def sources_of(urls: Sequence[str]) -> dict[str, str]:
    """The sources of ``shardkit inspect|bench URL [URL ...]``: each ``NAME=URL``, or a URL named by its
    last path part (``s3://lake/web`` is ``web``). A path with ``=`` in its first part (a Hive folder,
    ``year=2024``) is written ``./year=2024``.

    Example:
        >>> sources_of(["web=s3://lake/web-2024", "s3://lake/books"])
        {'web': 's3://lake/web-2024', 'books': 's3://lake/books'}
    """
    out: dict[str, str] = {}
    for text in urls:
        match = _NAMED.match(text)
        name, url = (match.group(1), match.group(2)) if match else (_last_part(text), text)
        if name in out:
            raise ReaderError(f"two sources are named {name!r} ({out[name]!r} and {url!r}); name each one: "
                             f"NAME=URL, e.g. a={out[name]} b={url}")
        out[name] = url
    return out


def _last_part(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1].split("://")[-1] or url


def weights_of(text: str | None, names: Sequence[str]) -> dict[str, Any] | None:
    """``--weights 3,1`` (in the order of the sources), ``--weights web=3,books=1``, or a JSON object of
    source name -> weight or schedule (``{"web": [[0, 3], [1000000, 1]], "books": 1}``); None when not
    given. The values are checked by the mixture (`shardkit.reader.mixture.check_weights`)."""
    if text is None:
        return None
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ReaderError(f"--weights {text}: not JSON ({e}); e.g. --weights "
                              '\'{"web": [[0, 3], [1000000, 1]], "books": 1}\'') from None
        if not isinstance(value, dict):
            raise ReaderError(f"--weights {text}: give a JSON object of source name -> weight")
        return value
    parts = [p.strip() for p in text.split(",") if p.strip()]
    named = [p.partition("=") for p in parts]
    try:
        if all(sep for _, sep, _ in named):
            return {k.strip(): _number(v) for k, _, v in named}
        if not any(sep for _, sep, _ in named) and len(parts) == len(names):
            return {name: _number(p) for name, p in zip(names, parts, strict=True)}
    except ValueError as e:
        raise ReaderError(f"--weights {text}: {e}; give numbers, e.g. --weights 3,1") from None
    example = ",".join(f"{n}=1" for n in names)
    raise ReaderError(f"--weights {text} gives {len(parts)} weight(s) for {len(names)} source(s) "
                     f"{list(names)}; give one per source, in their order (--weights "
                     f"{','.join('1' for _ in names)}) or by name (--weights {example})")


def _number(text: str) -> float:
    value = float(text.strip())
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def describe_mixture(datasets: Mapping[str, Dataset], weights: Mapping[str, Any] | None,
                     samples_per_epoch: int | None, at: Sequence[int] | None = None) -> dict[str, Any]:
    """A JSON-able description of a mixture of ``datasets`` (what ``shardkit inspect --json URL URL ...``
    prints): each dataset's `describe` with its name, and the mixture: each source's rows, weight, share,
    samples and passes per epoch (at the start of a schedule), the schedule's bound, the shares at the
    samples ``at`` (default: a schedule's breakpoints; none for constant weights), and whether the fields
    agree (the message of the mismatch, as a reader would raise it, or None)."""
    from shardkit.errors import ShardkitError
    from shardkit.reader.mixture import Mixture, shared_schema  # on use: the reader pulls in pyarrow

    names = list(datasets)
    mixture = Mixture.of(names, [d.num_rows for d in datasets.values()], weights, samples_per_epoch)
    try:
        shared_schema({name: d.schema for name, d in datasets.items()})
        fields = None
    except ShardkitError as e:
        fields = str(e)
    return {
        "sources": [{"name": name, **describe(d)} for name, d in datasets.items()],
        "mixture": {"samples_per_epoch": mixture.samples_per_epoch, "sources": mixture.to_json(),
                    "bound": mixture.bound, "period": mixture.schedule.period,
                    "shares_at": mixture.schedule_json(at), "fields_differ": fields},
    }


def format_mixture(info: dict[str, Any]) -> str:
    """`describe_mixture` for people: each source as ``inspect`` shows it, then the mixture."""
    parts = [f"source {d['name']}: {format_description(d)}" for d in info["sources"]]
    mix = info["mixture"]
    rows = [[m["name"], f"{m['rows']:,}", weight_text(m["weight"]), f"{m['share']:.2%}",
             f"{m['samples_per_epoch']:,.1f}", f"{m['passes_per_epoch']:.3g}"] for m in mix["sources"]]
    head = (f"mixture: {len(rows)} sources, {mix['samples_per_epoch']:,} samples per epoch; in every prefix "
            f"of the stream each source is within {mix['bound']:.3g} of its share (schedule period "
            f"{mix['period']:,})")
    fields = ("fields: the same in every source" if mix["fields_differ"] is None
              else f"fields: DIFFER: {mix['fields_differ']}")
    table = _table(rows, ["source", "rows", "weight", "share", "samples/epoch", "passes/epoch"])
    out = [*parts, "\n".join([head, fields]), table]
    if mix.get("shares_at"):
        names = [m["name"] for m in mix["sources"]]
        shares = [[f"{p['samples']:,}", *(f"{p['shares'][n]:.2%}" for n in names)] for p in mix["shares_at"]]
        out.append("shares along the schedule (samples read, all shards together):\n"
                   + _table(shares, ["samples", *names]))
    return "\n\n".join(out)


def column_names(text: str | None) -> list[str] | None:
    """``--columns a,b``: the names, blanks left out; None when not given."""
    return None if text is None else [c.strip() for c in text.split(",") if c.strip()]
