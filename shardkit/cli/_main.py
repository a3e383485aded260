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
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from shardkit.cli import _interrupts
from shardkit.cli._output import (
    describe,
    describe_mixture,
    format_description,
    format_mixture,
    human,
    sources_of,
    warnings_after,
    weights_of,
)
from shardkit.errors import JobError, SecretInEnvWarning, ShardkitError

# Only the standard library and shardkit.errors at import: the console script imports this module before
# it calls `main`, and a Ctrl-C during an import outside `main` would end in a traceback (see `main`).
if TYPE_CHECKING:
    from types import TracebackType

    from shardkit.job.config import JobConfig


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
    return (getattr(spec, "name", None) in ("shardkit.__main__", "shardkit.cli.__main__")
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


def _inspect(args: argparse.Namespace) -> int:
    """``shardkit inspect URL``: one dataset; ``shardkit inspect URL URL ...``: each of them and the
    mixture they make (`describe_mixture`), with ``--weights`` and ``--samples-per-epoch``."""
    from shardkit.dataset import SummaryMissingWarning, open_dataset

    mixed = len(args.url) > 1 or args.weights is not None or args.samples_per_epoch is not None \
        or args.at is not None
    options = args.storage_options
    if args.row is not None and mixed:
        args.parser.error("--row prints a row of one dataset; give one URL (shardkit inspect URL --row N)")
    if not mixed:
        with warnings_after(SummaryMissingWarning), _in_flags(args, version=args.version):
            ds = open_dataset(args.url[0], version=args.version, storage_options=options)
        if args.row is not None:
            return _print_row(ds, args.row, args.json)
        info = describe(ds)
        print(json.dumps(info, indent=2) if args.json else format_description(info))
        return 0
    if args.version is not None:
        args.parser.error("--table-version reads one table; with several sources, inspect each table "
                          "alone (shardkit inspect URL --table-version N)")
    sources = sources_of(args.url)
    weights = weights_of(args.weights, list(sources))
    with warnings_after(SummaryMissingWarning), _in_flags(args):
        datasets = {name: open_dataset(url, storage_options=options) for name, url in sources.items()}
    info = describe_mixture(datasets, weights, args.samples_per_epoch, args.at)
    print(json.dumps(info, indent=2) if args.json else format_mixture(info))
    return 0


def _print_row(ds: Any, row: int, as_json: bool) -> int:
    """``shardkit inspect URL --row N``: row ``N`` of the dataset (negative: from the end), decoded."""
    from shardkit.cli._sample import format_sample, sample_json
    from shardkit.dataset import RowAccess

    sample = RowAccess(ds, cache_bytes=0).row(row)
    at = row + ds.num_rows if row < 0 else row
    print(json.dumps(sample_json(ds.url, at, ds.num_rows, sample), indent=2) if as_json
          else format_sample(ds.schema, ds.url, at, ds.num_rows, sample))
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
        with warnings_after(SummaryMissingWarning), _in_flags(args, version=args.version):
            report = verify_dataset(args.url, version=args.version, workers=args.workers, progress=progress,
                                    storage_options=args.storage_options)
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
          f"{info['pages']:,} pages, {rows:,} rows ({human(size)}) in {seconds:.2f} s "
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

    with warnings_after(UncommittedFilesWarning, hide=SummaryMissingWarning), _in_flags(args):
        ds = write_summary(args.url, storage_options=args.storage_options)
    summary = f"{args.url.rstrip('/')}/_metadata"
    print(f"wrote {summary}: {len(ds.row_groups):,} row groups in {len(ds.files):,} files")
    return 0


def _load(args: argparse.Namespace) -> JobConfig:
    from shardkit.job.config import load_config

    with warnings_after(SecretInEnvWarning):  # `warning: env.API_TOKEN looks like a credential ...`
        return load_config(args.config, args.set)


def _validate(args: argparse.Namespace) -> int:
    from shardkit.cluster.engines import check_engine
    from shardkit.job.config import describe

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
        if not hasattr(e, "signum"):  # before the job started (config, imports): no summary says so
            raise
        return 128 + int(e.signum)  # the job's summary was printed
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


@contextlib.contextmanager
def _in_flags(args: argparse.Namespace, **given: Any) -> Iterator[None]:
    """The API's errors raised inside, with each argument they name written as the command's flag
    (``version=3`` is ``--table-version 3``: `shardkit.cli._flags.in_flags`); ``given``: the API's
    arguments from the flags."""
    from shardkit.cli._flags import in_flags

    try:
        yield
    except ShardkitError as e:
        message = in_flags(str(e), args.parser, given)
        if message == str(e):
            raise
        raise type(e)(message) from e


def _add_table_version(p: argparse.ArgumentParser) -> None:
    # dest `version`: the API's argument, so that its messages about `version=` name this flag
    p.add_argument("--table-version", dest="version", type=int, default=None, metavar="VERSION",
                   help="a Delta table's version or an Iceberg table's snapshot id (default: the "
                        "current one)")


def _samples_list(text: str) -> list[int]:
    try:
        points = [int(p.replace("_", "")) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give samples as ints, e.g. --at 0,500000,1000000") \
            from None
    if not points or min(points) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give samples >= 0, e.g. --at 0,500000,1000000")
    return points


def _add_mixture(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", metavar="W,W",
                   help="a mixture's weights: one per URL in order (3,1) or by name (web=3,books=1), or "
                        "JSON with schedules ('{\"web\": [[0, 3], [1000000, 1]], \"books\": 1}'); "
                        "default: the sources' rows")
    p.add_argument("--samples-per-epoch", type=int, metavar="N",
                   help="a mixture's epoch in samples of all sources (default: their rows together)")


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the job's YAML file")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config value (YAML), e.g. --set roles.worker.count=4; repeatable")


_DESCRIPTION = ("Parquet datasets for distributed training: inspect, verify, index, write (convert) and "
                "bench datasets; validate, train and render training jobs described by one YAML file.")


def build_parser() -> argparse.ArgumentParser:
    from shardkit import __version__
    from shardkit.cli._bench import add_parser as add_bench_parser
    from shardkit.cli._flags import add_storage_options
    from shardkit.cli._write import add_parser as add_write_parser

    parser = argparse.ArgumentParser(prog="shardkit", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # every command's parser= is its own: `main`'s usage errors after parsing print its usage, not the top's
    p = sub.add_parser("inspect", help="print a dataset's schema, files and row groups (several: and the "
                                       "mixture they make)")
    p.add_argument("url", nargs="+", metavar="URL",
                   help="the dataset's folder (any fsspec URL, e.g. s3://bucket/ds); several, each NAME=URL "
                        "or named by its last path part, for a mixture")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_mixture(p)
    p.add_argument("--at", metavar="N,N", type=_samples_list,
                   help="a mixture's shares at these samples read (default, for weights that change: at "
                        "their breakpoints)")
    p.add_argument("--row", type=int, metavar="N",
                   help="print row N of the dataset (negative: from the end), each field decoded, instead of "
                        "its description")
    _add_table_version(p)
    add_storage_options(p, "each URL")
    p.set_defaults(func=_inspect, parser=p)
    p = sub.add_parser("verify", help="scrub a dataset: check every page checksum and decode every row "
                                      "group; exit 1 when something is damaged")
    p.add_argument("url", help="the dataset's folder or table (any fsspec URL)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="files checked at once (default 8)")
    _add_table_version(p)
    add_storage_options(p)
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--progress", action="store_const", const=True, dest="progress", default=None,
                       help="a progress bar (default: one on a terminal)")
    shown.add_argument("--no-progress", action="store_const", const=False, dest="progress",
                       help="no progress bar")
    p.set_defaults(func=_verify, parser=p)
    p = sub.add_parser("index", help="write the _metadata summary of a plain Parquet folder")
    p.add_argument("url", help="the folder of Parquet files (any fsspec URL)")
    add_storage_options(p)
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
        with _interrupts.counting():
            parser = build_parser()
            args, extra = parser.parse_known_args(argv)
            if extra:
                _unrecognized(getattr(args, "parser", parser), args.command, extra)
            return _run(args)
    except Exception as e:  # a Ctrl-C that a library turned into its own error is still one
        if (interrupt := _interrupts.behind(e)) is None:
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

