"""``shardkit bench``: its flags, and `measure`'s errors about their values written in the flags' words."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import json
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from shardkit.cli import _names, _warnings_after
from shardkit.errors import DatasetError, ReaderError

# a Python repr of a str or bytes (a value, a path); a quote after a letter is an apostrophe ("the worker's")
_QUOTED = re.compile(r"""(?<!\w)b?(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")""")
_CALL = re.compile(r"[A-Za-z_][\w.]*\([^()]*\)")  # cache=CacheConfig(directory, size_limit)
_LITERAL = re.compile(rf"{_QUOTED.pattern}|\b(?:True|False|None)\b")
_JSON_WORDS = {"True": "true", "False": "false", "None": "null"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``shardkit bench URL [flags]`` to the command's subparsers."""
    p = sub.add_parser("bench", help="measure how fast a dataset reads: rows/s, MB/s, CPU, peak memory",
                       description="Read one shard as training would (after --warmup batches) and print "
                                   "its throughput; stops after --batches, --seconds or --epochs, whichever "
                                   "comes first (with none of them: one epoch).")
    p.add_argument("url", help="the dataset's folder (any fsspec URL, e.g. s3://bucket/ds)")
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
                   help="stop after N whole epochs (measured from the epoch after the warm-up)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cache", type=_folder, metavar="DIR",
                       help="cache row groups in DIR, local data too (default, auto: remote data only, "
                            "in $SHARDKIT_CACHE_DIR or ~/.cache/shardkit)")
    cache.add_argument("--no-cache", dest="cache", action="store_const", const=None,
                       help="no row-group cache, remote data included")
    p.add_argument("--storage-options", type=_json_object, metavar="JSON",
                   help="fsspec options for URL, a JSON object, e.g. "
                        """'{"client_kwargs": {"endpoint_url": "http://localhost:9000"}}'""")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run, parser=p, cache="auto")


def run(args: argparse.Namespace) -> int:
    """Run `shardkit.reader.throughput.measure` with the flags given and print its result; its errors and
    warnings about their values name the flags (`in_flags`: the default cache's `CacheWarning` says
    ``--cache DIR`` or ``--no-cache``, not ``cache=``). With ``--adapter tf``, TensorFlow's log lines are
    left out (`_import_tensorflow_quietly`). Ctrl-C is `shardkit.cli.main`'s: one line, status 130."""
    from shardkit.reader.throughput import measure

    columns = _names(args.columns)
    if columns == []:  # the flag's own text: a usage error, as `--batch-size x` is
        args.parser.error(f"argument --columns: {args.columns!r} names no field; name some, comma-separated "
                          "(--columns a,b), or leave --columns out to read them all")
    kwargs: dict[str, Any] = {
        "adapter": args.adapter, "batches": args.batches, "seconds": args.seconds, "epochs": args.epochs,
        "shard": args.shard, "num_shards": args.num_shards, "columns": columns, "shuffle": args.shuffle,
        "workers": args.workers, "prefetch": args.prefetch, "cache": args.cache,
        "storage_options": args.storage_options,
    }
    for name in ("batch_size", "warmup_batches", "seed"):  # None is no default of measure's for these
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.adapter == "tf":
        _import_tensorflow_quietly()
    try:
        with _warnings_after(UserWarning, worded=lambda message: in_flags(message, args.parser, kwargs)):
            result = measure(args.url, **kwargs)
    except (ReaderError, DatasetError) as e:
        message = in_flags(str(e), args.parser, kwargs)
        if message == str(e):
            raise
        raise type(e)(message) from e
    print(json.dumps(result.to_json(), indent=2) if args.json else result.summary())
    return 0


def in_flags(message: str, parser: argparse.ArgumentParser, given: Mapping[str, Any]) -> str:
    """``message`` of the Python API with each argument it names written as the flag of ``parser`` that
    sets it, as the user would type it.

    Example:
        >>> in_flags("warmup_batches=-1 must be an int >= 0", bench_parser, {"warmup_batches": -1})
        '--warmup -1 must be an int >= 0'

    ``name=<value passed>`` (``given``: what the flags passed, by argument name) becomes the flag and the
    value as typed (``--columns a,a``); ``name=None`` the flag that passes None (``--no-cache``);
    ``name=Class(...)`` the flag and its metavar (``--cache DIR``); a Python dict after a JSON flag's
    name that JSON, quoted for the shell; any other ``name=`` the flag (``--num-shards <number of
    workers>``), and so does a bare ``snake_case`` name (``num_shards``; a bare ``shard`` is English).
    Text in quotes (paths, field names, URLs) is left as it is.
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
    if (call := _CALL.match(rest)) is not None:
        return f"{flag} {action.metavar}", call.end()
    if action.type is _json_object and (literal := _braced(rest)) is not None:
        return f"{flag} {shlex.quote(_LITERAL.sub(_json_token, literal))}", len(literal)
    return (flag if rest[:1] in ("", " ", ";", ",", ".", ")", ":") else f"{flag} "), 0


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


def _folder(text: str) -> Path | str:
    """``--cache DIR``: a path, passed as one; ``auto`` is make_reader's default, ``cache="auto"`` (argparse
    reads the flag's default through this function too), and a folder of that name is ``./auto``."""
    if text == "auto":
        return text
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is no folder; give one, e.g. "
                                         "--cache /mnt/nvme/shardkit-cache")
    return Path(text)


def _json_object(text: str) -> dict[str, Any]:
    """``--storage-options JSON``: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e}); write an object, e.g. "
                                         """'{"anon": true}'""") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is JSON but not an object; write one, e.g. "
                                         """'{"anon": true}'""")
    return value


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
