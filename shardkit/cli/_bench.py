"""``shardkit bench``: its flags, and `measure`'s errors about their values written in the flags' words
(`shardkit.cli._flags.in_flags`)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from shardkit.cli._flags import add_storage_options, in_flags
from shardkit.cli._output import column_names, sources_of, warnings_after, weights_of
from shardkit.errors import DatasetError, ReaderError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``shardkit bench URL [flags]`` to the command's subparsers."""
    p = sub.add_parser("bench", help="measure how fast a dataset reads: rows/s, MB/s, CPU, peak memory",
                       description="Read one shard as training would (after --warmup batches) and print "
                                   "its throughput; stops after --batches, --seconds or --epochs, whichever "
                                   "comes first (with none of them: one epoch).")
    p.add_argument("url", nargs="+", metavar="URL",
                   help="the dataset's folder (any fsspec URL, e.g. s3://bucket/ds); several, each NAME=URL "
                        "or named by its last path part: a mixture of them")
    p.add_argument("--weights", metavar="W,W",
                   help="a mixture's weights: one per URL in order (3,1) or by name (web=3,books=1); "
                        "default: the sources' rows")
    p.add_argument("--samples-per-epoch", type=int, metavar="N",
                   help="a mixture's epoch in samples of all sources (default: their rows together)")
    p.add_argument("--adapter", choices=["numpy", "torch", "tf"], default="numpy",
                   help="the reader's numpy batches, shardkit.torch.make_loader or shardkit.tf.make_dataset")
    p.add_argument("--batch-size", type=int, metavar="N", help="rows per batch (default 256)")
    p.add_argument("--columns", metavar="A,B", help="fields to read, comma-separated (default: all)")
    p.add_argument("--shard", type=int, metavar="K", help="the shard to read (with --num-shards)")
    p.add_argument("--num-shards", type=int, metavar="N", help="shards the dataset is split into")
    p.add_argument("--workers", type=int, metavar="N", help="reading/decoding threads")
    p.add_argument("--prefetch", type=int, metavar="N", help="row-group slices read ahead")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="read in order")
    p.add_argument("--seed", type=int, metavar="N", help="the shuffle's seed (default 0)")
    p.add_argument("--warmup", dest="warmup_batches", type=int, metavar="N",
                   help="batches read before the clock starts (default 10)")
    p.add_argument("--batches", type=int, metavar="N", help="stop after N measured batches")
    p.add_argument("--seconds", type=float, metavar="S", help="stop after S seconds")
    p.add_argument("--epochs", type=int, metavar="N",
                   help="stop after N whole epochs (measured from the epoch after the warm-up); with --plan: "
                        "the epochs to plan for (default 1)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cache", type=_folder, metavar="DIR",
                       help="cache row groups in DIR, local data too (default, auto: remote data only, "
                            "in $SHARDKIT_CACHE_DIR or ~/.cache/shardkit)")
    cache.add_argument("--no-cache", dest="cache", action="store_const", const=None,
                       help="no row-group cache, remote data included")
    plan = p.add_argument_group("a plan before the run (--plan: nothing read but a probe's few row groups)")
    plan.add_argument("--plan", action="store_true",
                      help="estimate the GET requests, bytes fetched and cached, the fetch time at the "
                           "store's measured rate and the egress cost of --epochs epochs on --world-size "
                           "ranks, instead of measuring a read")
    plan.add_argument("--world-size", type=int, metavar="N", help="ranks reading the dataset (default 1)")
    plan.add_argument("--ranks-per-host", type=int, metavar="N",
                      help="ranks sharing a host's row-group cache (default 1)")
    plan.add_argument("--price-per-gb", type=float, metavar="P", help="the store's egress price per GB")
    plan.add_argument("--price-per-1k-requests", type=float, metavar="P",
                      help="the store's price per 1,000 GET requests")
    plan.add_argument("--probe-reads", type=int, metavar="N",
                      help="row groups the probe fetches to measure the store's rate and latency "
                           "(default 3; 0: no probe, no time)")
    plan.add_argument("--timeout", type=float, metavar="S",
                      help="seconds the store has to answer the open and the probe (default 60)")
    add_storage_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run, parser=p, cache="auto")


#: flags of the measured read that a plan has no use for, and those of the plan alone
_READ_ONLY = ("adapter", "batches", "seconds", "shard", "num_shards", "workers", "prefetch", "warmup_batches",
              "weights", "samples_per_epoch")
_PLAN_ONLY = ("world_size", "ranks_per_host", "price_per_gb", "price_per_1k_requests", "probe_reads",
              "timeout")


def run(args: argparse.Namespace) -> int:
    """Run `shardkit.bench.throughput.measure` with the flags given and print its result; its errors and
    warnings about their values name the flags (`in_flags`: the default cache's `CacheWarning` says
    ``--cache DIR`` or ``--no-cache``, not ``cache=``). With ``--adapter tf``, TensorFlow's log lines are
    left out (`_import_tensorflow_quietly`). Ctrl-C is `shardkit.cli.main`'s: one line, status 130."""
    from shardkit.bench.throughput import measure

    columns = column_names(args.columns)
    if columns == []:  # the flag's own text: a usage error, as `--batch-size x` is
        args.parser.error(f"argument --columns: {args.columns!r} names no field; name some, comma-separated "
                          "(--columns a,b), or leave --columns out to read them all")
    if args.plan:
        return _plan(args, columns)
    for name in _PLAN_ONLY:
        if getattr(args, name) is not None:
            args.parser.error(f"argument --{name.replace('_', '-')}: only a plan takes it; add --plan")
    kwargs: dict[str, Any] = {
        "adapter": args.adapter, "batches": args.batches, "seconds": args.seconds, "epochs": args.epochs,
        "shard": args.shard, "num_shards": args.num_shards, "columns": columns, "shuffle": args.shuffle,
        "workers": args.workers, "prefetch": args.prefetch, "cache": args.cache,
        "storage_options": args.storage_options,
    }
    for name in ("batch_size", "warmup_batches", "seed"):  # None is no default of measure's for these
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    url: str | dict[str, str] = args.url[0]
    if len(args.url) > 1 or args.weights is not None or args.samples_per_epoch is not None:
        url = sources_of(args.url)
        kwargs["weights"] = weights_of(args.weights, list(url))
        kwargs["samples_per_epoch"] = args.samples_per_epoch
    if args.adapter == "tf":
        _import_tensorflow_quietly()
    try:
        with warnings_after(UserWarning, worded=lambda message: in_flags(message, args.parser, kwargs)):
            result = measure(url, **kwargs)
    except (ReaderError, DatasetError) as e:
        message = in_flags(str(e), args.parser, kwargs)
        if message == str(e):
            raise
        raise type(e)(message) from e
    print(json.dumps(result.to_json(), indent=2) if args.json else result.summary())
    return 0


def _plan(args: argparse.Namespace, columns: list[str] | None) -> int:
    """``--plan``: `shardkit.bench.plan.plan_egress` with the flags given, printed (or its JSON)."""
    from shardkit.bench.plan import DEFAULT_TIMEOUT, PROBE_READS, plan_egress

    given = [n for n in _READ_ONLY if getattr(args, n) not in (None, "numpy")]
    if given:
        args.parser.error(f"argument --plan: --{given[0].replace('_', '-')} is a flag of a measured read; a "
                          "plan reads every shard (--world-size N), leave it out")
    if len(args.url) > 1:
        args.parser.error("argument --plan: plans one dataset; give one URL")
    for name in ("world_size", "ranks_per_host", "epochs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            args.parser.error(f"argument --{name.replace('_', '-')}: {value} is not a count; give 1 or more")
    for name in ("probe_reads", "price_per_gb", "price_per_1k_requests"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            args.parser.error(f"argument --{name.replace('_', '-')}: {value} is negative; give 0 or more")
    if args.timeout is not None and not args.timeout > 0:
        args.parser.error(f"argument --timeout: {args.timeout} is no time; give seconds > 0")
    plan = plan_egress(
        args.url[0], world_size=args.world_size or 1, epochs=args.epochs or 1,
        ranks_per_host=args.ranks_per_host or 1, columns=columns, cache=args.cache, shuffle=args.shuffle,
        seed=0 if args.seed is None else args.seed,
        batch_size=256 if args.batch_size is None else args.batch_size,
        probe_reads=PROBE_READS if args.probe_reads is None else args.probe_reads,
        timeout=DEFAULT_TIMEOUT if args.timeout is None else args.timeout,
        price_per_gb=args.price_per_gb, price_per_1k_requests=args.price_per_1k_requests,
        storage_options=args.storage_options)
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.summary())
    return 0


def _folder(text: str) -> Path | str:
    """``--cache DIR``: a path, passed as one; ``auto`` is make_reader's default, ``cache="auto"`` (argparse
    reads the flag's default through this function too), and a folder of that name is ``./auto``."""
    if text == "auto":
        return text
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is no folder; give one, e.g. "
                                         "--cache /mnt/nvme/shardkit-cache")
    return Path(text)


def _import_tensorflow_quietly() -> None:
    """Import TensorFlow without the log lines it writes on stderr, unless ``TF_CPP_MIN_LOG_LEVEL`` is set
    (the user's choice of what TensorFlow prints then stands).

    ``TF_CPP_MIN_LOG_LEVEL=2`` is set while it imports and removed after, so that the processes this one
    starts later do not inherit it: TensorFlow reads it once, at the first line it logs, which its import
    writes, and drops the info and warning lines of its C++ code for the rest of the run (errors stay).
    The import also writes absl's "All log messages before absl::InitializeLog() ..." line and the
    oneDNN notice whatever that level, so what it writes on stderr (file descriptor 2) goes to a
    temporary file, dropped when the import succeeds. When it fails, that text is written out and the
    error raised: a TensorFlow that is installed but cannot load (a missing shared library, a protobuf
    of the wrong version) must say why. One that is not installed at all is left to `measure`, which
    names the extra to install.
    """
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ or "tensorflow" in sys.modules:
        return
    if importlib.util.find_spec("tensorflow") is None:
        return
    with tempfile.TemporaryFile() as held:
        try:
            with _stderr_into(held):
                os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
                try:
                    importlib.import_module("tensorflow")
                finally:
                    del os.environ["TF_CPP_MIN_LOG_LEVEL"]
        except Exception:
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise


@contextlib.contextmanager
def _stderr_into(file: IO[bytes]) -> Iterator[None]:
    """File descriptor 2 pointed at ``file`` in the block (nothing done where it cannot be: no stderr,
    or a closed one)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    try:
        os.dup2(file.fileno(), 2)
        yield
    finally:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
