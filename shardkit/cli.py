"""The ``shardkit`` command: parses arguments and calls the Python API, nothing more."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from shardkit.errors import JobError, ShardkitError, interrupt_behind

# Only the standard library and shardkit.errors at import: the console script imports this module before
# it calls `main`, and a Ctrl-C during an import outside `main` would end in a traceback (see `main`).
if TYPE_CHECKING:
    from types import TracebackType

    from shardkit.cluster.config import JobConfig
    from shardkit.dataset import Dataset


def _interrupted_outside_main(kind: type[BaseException], value: BaseException,
                              traceback: TracebackType | None) -> None:
    """`sys.excepthook` from the end of this module's import until `main` returns: a Ctrl-C that lands in
    the console script's own lines around ``main()`` prints main's line, not a traceback."""
    if issubclass(kind, KeyboardInterrupt):
        print(_interrupted(sys.argv[1:]), file=sys.stderr)
    else:
        _EXCEPTHOOK(kind, value, traceback)


def _the_command() -> bool:
    """Whether this process is the ``shardkit`` command (its console script, or ``python -m shardkit``),
    not a program that imports this module."""
    started = sys.modules.get("__main__")
    spec = getattr(started, "__spec__", None)
    return (getattr(spec, "name", None) == "shardkit.__main__"
            or os.path.basename(getattr(started, "__file__", None) or "") == "shardkit")


_EXCEPTHOOK = sys.excepthook
if _the_command():  # the hook is the command's own: a program that imports this module keeps its hook
    sys.excepthook = _interrupted_outside_main
_COMMANDS = frozenset({"inspect", "verify", "index", "write", "train", "validate", "render", "bench"})


def _interrupted(argv: Sequence[str]) -> str:
    """The line for a Ctrl-C, ``shardkit <command>: interrupted``: the command as ``argv`` names it, read
    here since argparse may not have read it yet (``shardkit: interrupted`` when it names none)."""
    command = next((word for word in argv if not word.startswith("-")), "")
    return f"shardkit {command}: interrupted" if command in _COMMANDS else "shardkit: interrupted"


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
    files = [[f["file"], str(f["row_groups"]), f"{f['rows']:,}", _human(f["bytes"])] for f in info["files"]]
    snap = info.get("snapshot")
    what = f"{info['kind']} dataset"
    if snap:
        word = "version" if snap["format"] == "delta" else "snapshot"
        what = (f"{'Delta Lake' if snap['format'] == 'delta' else 'Iceberg'} table, {word} {snap['version']}"
                f"{' of ' + snap['time'] if snap['time'] else ''}, {snap['versions']} {word}s in its history")
    head = (f"{info['url']}  ({what})\n"
            f"{info['rows']:,} rows in {info['row_groups']:,} row groups, "
            f"{len(info['files']):,} files, {_human(info['bytes'])} uncompressed")
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
def _warnings_after(show: type[Warning], *, hide: type[Warning] | None = None,
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


def _names(text: str | None) -> list[str] | None:
    """``--columns a,b``: the names, blanks left out; None when not given."""
    return None if text is None else [c.strip() for c in text.split(",") if c.strip()]


def _inspect(args: argparse.Namespace) -> int:
    from shardkit.dataset import SummaryMissingWarning, open_dataset

    with _warnings_after(SummaryMissingWarning):
        ds = open_dataset(args.url, version=args.table_version)
    info = describe(ds)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0


def _verify(args: argparse.Namespace) -> int:
    """``shardkit verify``: exit 0 when every page and row group checks out, 1 when something is damaged
    (2, as for every command, when the dataset cannot be opened)."""
    from shardkit.dataset import SummaryMissingWarning
    from shardkit.dataset.verify import FileReport, verify_dataset

    show = sys.stderr.isatty() if args.progress is None else args.progress
    bar: Any = None
    started = time.perf_counter()

    def progress(report: FileReport) -> None:
        nonlocal bar
        if not show:
            return
        if bar is None:
            from tqdm.auto import tqdm

            bar = tqdm(unit="B", unit_scale=True, desc="verify", dynamic_ncols=True)
        bar.update(report.bytes)
        bar.set_postfix(files=len(done) + 1, damaged=sum(len(r.damage) for r in done) + len(report.damage))
        done.append(report)

    done: list[FileReport] = []
    try:
        with _warnings_after(SummaryMissingWarning):
            report = verify_dataset(args.url, version=args.table_version, workers=args.workers,
                                    progress=progress)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    info = report.to_json()
    if args.json:
        print(json.dumps({**info, "seconds": round(seconds, 3)}, indent=2))
        return 0 if report.ok else 1
    size = sum(f.bytes for f in report.files)
    rows = sum(f.rows for f in report.files)
    print(f"verified {report.url}: {info['files']:,} files, {info['row_groups']:,} row groups, "
          f"{info['pages']:,} pages, {rows:,} rows ({_human(size)}) in {seconds:.2f} s "
          f"({size / max(seconds, 1e-9) / 2**20:,.0f} MiB/s): "
          + ("no damage found" if report.ok else f"{len(report.damaged):,} damaged"))
    for damage in report.damaged:
        print(f"DAMAGED {damage}")
    if report.unchecked_pages:
        without = info["files_without_checksums"]
        print(f"note: {report.unchecked_pages:,} of {report.pages:,} pages, in {len(without):,} of "
              f"{info['files']:,} files (first: {without[0]}), carry no page checksum (written by "
              "another tool, or by shardkit before it wrote checksums): they decode, but their bytes "
              f"cannot be checked. `shardkit write {args.url} NEW_URL` rewrites the dataset with them")
    if not report.ok:
        print("Fix: restore the damaged files from their source (a backup, the store's versions), or "
              "rewrite the dataset from its source; until then, a reader with on_error='skip' leaves the "
              "damaged row groups out")
    return 0 if report.ok else 1


def _index(args: argparse.Namespace) -> int:
    from shardkit.dataset import SummaryMissingWarning, UncommittedFilesWarning, write_summary

    with _warnings_after(UncommittedFilesWarning, hide=SummaryMissingWarning):
        ds = write_summary(args.url)
    summary = f"{args.url.rstrip('/')}/_metadata"
    print(f"wrote {summary}: {len(ds.row_groups):,} row groups in {len(ds.files):,} files")
    return 0


def _load(args: argparse.Namespace) -> JobConfig:
    from shardkit.cluster.config import load_config

    return load_config(args.config, args.set)


def _validate(args: argparse.Namespace) -> int:
    from shardkit.cluster.config import describe
    from shardkit.cluster.engines import check_engine

    config = _load(args)
    check_engine(config)  # what `train` refuses before starting anything, the data and logdir aside
    print(describe(config))
    return 0


def _train(args: argparse.Namespace) -> int:
    from shardkit.cluster import run_job

    config = _load(args)
    try:
        run_job(config, node_rank=args.node_rank, echo=not args.quiet, rerun=args.rerun)
    except JobError as e:
        print(f"shardkit train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        return 128 + int(getattr(e, "signum", signal.SIGINT))
    return 0


def _render(args: argparse.Namespace) -> int:
    from shardkit.cluster.render import RENDERERS, render

    if args.engine is not None and args.engine not in RENDERERS:  # a usage error, checked before the config
        choices = ", ".join(repr(name) for name in RENDERERS)
        args.parser.error(f"argument --engine: invalid choice: {args.engine!r} (choose from {choices}; jobs "
                          "on the other engines are started by `shardkit train`)")
    files = render(_load(args), engine=args.engine, out_dir=args.out)
    for name, text in files.items():
        if args.out is None:
            print(f"# ---- {name} ----\n{text}")
        else:
            print(f"wrote {os.path.join(args.out, name)}")
    return 0


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the job's YAML file")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config value (YAML), e.g. --set roles.worker.count=4; repeatable")


_DESCRIPTION = ("Parquet datasets for distributed training: inspect, verify, index, write (convert) and "
                "bench datasets; validate, train and render training jobs described by one YAML file.")


def build_parser() -> argparse.ArgumentParser:
    from shardkit import __version__
    from shardkit.cli_bench import add_parser as add_bench_parser
    from shardkit.cli_write import add_parser as add_write_parser

    parser = argparse.ArgumentParser(prog="shardkit", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # every command's parser= is its own: `main`'s usage errors after parsing print its usage, not the top's
    p = sub.add_parser("inspect", help="print a dataset's schema, files and row groups")
    p.add_argument("url", help="the dataset's folder (any fsspec URL, e.g. s3://bucket/ds)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--table-version", type=int, default=None, metavar="VERSION",
                   help="a Delta table's version or an Iceberg table's snapshot id (default: the "
                        "current one)")
    p.set_defaults(func=_inspect, parser=p)
    p = sub.add_parser("verify", help="scrub a dataset: check every page checksum and decode every row "
                                      "group; exit 1 when something is damaged")
    p.add_argument("url", help="the dataset's folder or table (any fsspec URL)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="files checked at once (default 8)")
    p.add_argument("--table-version", type=int, default=None, metavar="VERSION",
                   help="a Delta table's version or an Iceberg table's snapshot id (default: the "
                        "current one)")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--progress", action="store_const", const=True, dest="progress", default=None,
                       help="a progress bar (default: one on a terminal)")
    shown.add_argument("--no-progress", action="store_const", const=False, dest="progress",
                       help="no progress bar")
    p.set_defaults(func=_verify, parser=p)
    p = sub.add_parser("index", help="write the _metadata summary of a plain Parquet folder")
    p.add_argument("url", help="the folder of Parquet files (any fsspec URL)")
    p.set_defaults(func=_index, parser=p)
    add_write_parser(sub)
    p = sub.add_parser("train", help="run a training job: start its processes, watch, restart, summarize")
    _add_config(p)
    p.add_argument("--quiet", action="store_true", help="show progress lines only, not the processes' output")
    rerun = p.add_mutually_exclusive_group()  # a logdir that holds a completed run is refused without one
    rerun.add_argument("--resume", action="store_const", const="resume", dest="rerun", default="refuse",
                       help="continue the completed run in the logdir from its last checkpoint (more epochs, "
                            "a longer schedule); an interrupted or failed run resumes without it")
    rerun.add_argument("--fresh", action="store_const", const="fresh", dest="rerun",
                       help="start a new run from step 0: the earlier run's checkpoints and logs are moved "
                            "to <logdir>/previous/<time>/ (nothing is deleted)")
    p.add_argument("--node-rank", type=int, default=None, metavar="K",
                   help="engine torchrun: this node's rank (node 0 hosts the rendezvous); "
                        "default engine.node_rank, else 0")
    p.set_defaults(func=_train, parser=p)
    p = sub.add_parser("validate", help="check a job config and its engine as train does before it starts "
                                        "anything (not the data, not the logdir); print what it would start")
    _add_config(p)
    p.set_defaults(func=_validate, parser=p)
    p = sub.add_parser("render", help="write the manifests that submit a job to Kubernetes or YARN")
    _add_config(p)
    p.add_argument("--engine", help="kubernetes or yarn (default: the config's engine.name)")
    p.add_argument("--out", metavar="DIR", help="write the files into DIR (default: print them)")
    p.set_defaults(func=_render, parser=p)
    add_bench_parser(sub)
    return parser


def _stdout_gone() -> bool:
    """Whether the reader of stdout went away (``shardkit inspect URL | head -1``); then stdout is pointed
    at /dev/null, so that the interpreter's own flush at exit does not fail again."""
    try:
        sys.stdout.flush()
        gone = False
    except BrokenPipeError:
        gone = True
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if not gone:  # the failed write dropped what it held: ask the pipe (POLLERR: no reader left)
            poll = select.poll()
            poll.register(sys.stdout.fileno(), select.POLLOUT)
            gone = any(events & select.POLLERR for _, events in poll.poll(0))
        if gone:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> None:
    """argparse's usage error for arguments no command takes; for ``write``, given paths past DEST: most
    likely a glob pattern that the shell expanded into its files."""
    hint = ""
    if command == "write" and not any(e.startswith("-") for e in extra):
        hint = ("; write takes one SRC and one DEST: if SRC is a glob pattern, quote it so that the shell "
                "leaves it to shardkit (shardkit write 'data/*.csv' DEST)")
    parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; exit 2 with one line, ``shardkit <command>: error: <message>``, for a
    `ShardkitError`, and (with the type named) for an ``OSError`` or ``ImportError`` the API let through:
    a user's path, permission or missing package, never worth a traceback. Anything else is a bug and
    keeps its traceback.

    Ctrl-C (SIGINT) ends any command with one line, ``shardkit <command>: interrupted`` (``write`` says
    what it left, ``train`` prints its job's summary instead), and status 130, as a shell reports a
    process that SIGINT ended. That holds from the end of this module's import (the console script's
    lines around ``main()``: `_interrupted_outside_main`), through the imports of the command's modules
    (here, not at this module's import, which takes a few milliseconds), to the end. Before it, Python
    starts (``site``), imports the package and this module's standard-library modules: a Ctrl-C there
    is Python's own.
    """
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:
            _unrecognized(getattr(args, "parser", parser), args.command, extra)
        return _run(args)
    except Exception as e:  # a Ctrl-C that a library turned into its own error is still one
        if (interrupt := interrupt_behind(e)) is None:
            raise
        print(_interrupted(sys.argv[1:] if argv is None else argv), file=sys.stderr)
        return 128 + int(getattr(interrupt, "signum", signal.SIGINT))
    except KeyboardInterrupt as e:
        print(_interrupted(sys.argv[1:] if argv is None else argv), file=sys.stderr)
        return 128 + int(getattr(e, "signum", signal.SIGINT))
    finally:
        if sys.excepthook is _interrupted_outside_main:  # a program that calls main gets its hook back
            sys.excepthook = _EXCEPTHOOK


def _run(args: argparse.Namespace) -> int:
    """The parsed command's function, its errors as `main` says."""
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit: a reader that went away (`| head -1`): `_stdout_gone`
        return code
    except ShardkitError as e:
        print(f"shardkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError as e:
        if not _stdout_gone():
            print(f"shardkit {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        return 128 + signal.SIGPIPE  # as a process SIGPIPE ends; the command's work is done, said once
    except (OSError, ImportError) as e:
        # the backstop for what the API does not wrap (yet): a user's error (a path, a permission, a
        # missing package) deserves one line, not a traceback; bugs (other exceptions) keep theirs
        print(f"shardkit {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
