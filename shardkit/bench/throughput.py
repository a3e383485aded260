"""`measure`: how fast a reader (or its torch / tf.data adapter) delivers batches; ``shardkit bench``."""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from shardkit.bench._sizes import peak_rss, size_of_batch
from shardkit.dataset import Dataset
from shardkit.errors import ReaderError
from shardkit.reader.adapters.collate import jump_to_epoch
from shardkit.reader.api import make_reader
from shardkit.reader.mixture import SOURCE, MixedReader
from shardkit.reader.reader import Reader

Adapter = Literal["numpy", "torch", "tf"]
StoppedBy = Literal["batches", "seconds", "epochs"]
ADAPTERS: tuple[Adapter, ...] = ("numpy", "torch", "tf")


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What `measure` measured. Rates are per second of the measured part (warm-up not counted).

    ``decoded_bytes`` are the bytes of the values of the fields read, as the adapter delivers them, the
    same with every adapter: numbers their ``nbytes`` (a null number counts its slot, which holds 0 or
    a masked value), text its UTF-8 bytes, bytes their length, a variable-shape row its elements (a
    null text or row counts 0); the adapters' ``<field>__valid`` masks are not counted (`nbytes`).
    ``peak_rss`` is this process's peak so far, in bytes (None where the platform does not tell),
    ``stats`` the reader's counters over the whole run, warm-up included (``reader.stats``, and
    ``cache_hits``... when it reads through a row-group cache). Of a mixture: ``mixture``, its sources
    (`shardkit.reader.mixture.Mixture.to_json`: rows, weight, share, samples per epoch), and
    ``rows_by_source``, the measured rows of each.
    """

    url: str
    adapter: Adapter
    shard: int
    num_shards: int
    batch_size: int
    batches_per_epoch: int
    warmup_batches: int
    stopped_by: StoppedBy
    batches: int
    rows: int
    decoded_bytes: int
    seconds: float
    first_batch_seconds: float
    cpu_seconds: float
    peak_rss: int | None
    stats: Mapping[str, int]
    mixture: Sequence[Mapping[str, Any]] | None = None
    rows_by_source: Mapping[str, int] | None = None

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds

    @property
    def batches_per_second(self) -> float:
        return self.batches / self.seconds

    @property
    def mb_per_second(self) -> float:
        """Decoded megabytes (10**6 bytes, see ``decoded_bytes``) per second."""
        return self.decoded_bytes / 1e6 / self.seconds

    @property
    def cpu_percent(self) -> float:
        """CPU time of every thread of this process over wall time, in % of one core (may pass 100)."""
        return 100 * self.cpu_seconds / self.seconds

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict: the fields and the rates (what ``shardkit bench --json`` prints)."""
        out = dataclasses.asdict(self)
        out["stats"] = dict(self.stats)
        out["mixture"] = None if self.mixture is None else [dict(m) for m in self.mixture]
        out["rows_by_source"] = None if self.rows_by_source is None else dict(self.rows_by_source)
        for name in ("rows_per_second", "batches_per_second", "mb_per_second", "cpu_percent"):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        """A few lines for people (what ``shardkit bench`` prints)."""
        bound = {"batches": f"{self.batches:,} batches", "seconds": f"{self.seconds:.2f} s",
                 "epochs": f"{self.batches // self.batches_per_epoch:,} epoch(s)"}[self.stopped_by]
        rss = "unknown" if self.peak_rss is None else f"{self.peak_rss / 2**20:,.1f} MiB"
        lines = [
            f"{self.url}  ({self.adapter}, shard {self.shard} of {self.num_shards}, batch_size "
            f"{self.batch_size}, {self.batches_per_epoch:,} batches per epoch)",
            f"measured     {self.batches:,} batches, {self.rows:,} rows in {self.seconds:.3f} s "
            f"(stopped after {bound}; {self.warmup_batches:,} warm-up batches before, not counted)",
            f"throughput   {self.rows_per_second:,.0f} rows/s, {self.batches_per_second:,.1f} batches/s, "
            f"{self.mb_per_second:,.1f} MB/s decoded",
            f"first batch  {self.first_batch_seconds:.3f} s after making the reader",
            f"cpu          {self.cpu_seconds:.2f} s, {self.cpu_percent:.0f}% of one core",
            f"peak rss     {rss}",
        ]
        if self.stats:
            lines.append("reader stats " + ", ".join(f"{k} {v:,}" for k, v in self.stats.items()))
        for i, source in enumerate(self.mixture or ()):
            got = (self.rows_by_source or {}).get(source["name"], 0)
            lines.append(f"{'mixture' if i == 0 else '':<12} {source['name']}: weight {source['weight']:g}, "
                         f"share {source['share']:.2%}, measured {got:,} rows "
                         f"({got / max(self.rows, 1):.2%}); {source['rows']:,} rows, "
                         f"{source['passes_per_epoch']:.3g} passes per epoch")
        return "\n".join(lines)


def measure(
    url: str | os.PathLike[str] | Dataset | Mapping[str, Any],
    *,
    adapter: Adapter = "numpy",
    warmup_batches: int = 10,
    batches: int | None = None,
    seconds: float | None = None,
    epochs: int | None = None,
    shard: int | None = None,
    num_shards: int | None = None,
    batch_size: int = 256,
    columns: Sequence[str] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    workers: int | None = None,
    prefetch: int | None = None,
    cache: Any = "auto",
    storage_options: dict[str, Any] | None = None,
    progress: bool | None = None,
    weights: Mapping[str, Any] | None = None,
    samples_per_epoch: int | None = None,
) -> Throughput:
    """Read batches of one shard as a training loop would, and time it (Petastorm's ``petastorm-throughput``).

    Example:
        >>> result = shardkit.bench.measure("s3://bucket/train", adapter="torch", seconds=30)
        >>> result.rows_per_second, result.mb_per_second, result.peak_rss

    The reader is made with `make_reader` (the arguments of the same names; its errors for bad ones) and
    ``num_epochs=None``, then wrapped in ``shardkit.torch.make_loader`` (host tensors) or
    ``shardkit.tf.make_dataset`` for those adapters. ``warmup_batches`` batches are read first and not
    counted (Petastorm's ``-w/--warmup-cycles``: imports, thread pools, page cache and tf.data's start
    are then behind); then the clock runs until ``batches`` batches, ``seconds`` seconds, or the end of
    ``epochs`` epochs, whichever comes first (Petastorm's ``-m/--measure-cycles``, in batches rather
    than rows: a training step takes a batch). With none of the three, it measures one epoch. Each
    batch is taken from the adapter and its fields' sizes read (nothing copied but non-ASCII text,
    encoded to count its UTF-8 bytes), as a training step would find them (``decoded_bytes``: the same
    bytes with every adapter); ``seconds`` is checked after each batch, so at least one batch is
    measured.

    The measured part follows the warm-up in the same stream, the read-ahead already full, except with
    ``epochs``: it then starts at the beginning of the epoch after the warm-up (the rest of that epoch is
    skipped), so that ``epochs=k`` measures exactly ``k * batches_per_epoch`` batches, each epoch all of
    the shard's rows, including the read-ahead's refill at each epoch's start that training sees.

    Args:
        url: a dataset URL (or an opened `Dataset`), or a dict of them: a mixture (with ``weights`` and
            ``samples_per_epoch``, as `make_reader` takes them); the result says how many rows of each
            source were measured.
        adapter: ``"numpy"`` (the reader's dicts of arrays), ``"torch"`` or ``"tf"``; the last two need
            ``shardkit[torch]`` / ``shardkit[tf]`` (`MissingDependencyError`), imported before the clock.
        warmup_batches: batches read before measuring (``>= 0``).
        batches: stop after this many batches (see above); None: no such bound.
        seconds: stop after this many seconds; None: no such bound.
        epochs: stop after this many epochs; None: no such bound.
        shard: as for `make_reader`, and so ``num_shards``, ``batch_size``, ``columns``, ``shuffle``,
            ``seed``, ``workers``, ``prefetch``, ``cache`` and ``storage_options``.
        progress: a live line on stderr (rows and rows/s) while measuring; None: when stderr is a
            terminal.

    Raises:
        ReaderError: a bad argument here or for `make_reader`, before anything is read.
        DatasetNotFoundError, NotADatasetError: no dataset at ``url``.
        MissingDependencyError: torch or TensorFlow is not installed; AdapterError: a field it cannot take.
        CorruptDatasetError...: the reader's own errors while reading, with every adapter (not tf.data's).
    """
    adapter, warmup_batches, batches, epochs = _checked(adapter, warmup_batches, batches, seconds, epochs)
    if batches is None and seconds is None and epochs is None:
        epochs = 1
    if adapter != "numpy":  # torch or TensorFlow imported now, not on the clock
        importlib.import_module(f"shardkit.{adapter}")
    started = time.perf_counter()
    reader = make_reader(url, shard=shard, num_shards=num_shards, batch_size=batch_size, columns=columns,
                         shuffle=shuffle, seed=seed, num_epochs=None, workers=workers, prefetch=prefetch,
                         cache=cache, storage_options=storage_options, weights=weights,
                         samples_per_epoch=samples_per_epoch)
    close: Callable[[], None] = reader.close
    it: Iterator[Any] | None = None
    read_error = _no_read_error
    try:
        source, close, read_error = _wrap(adapter, reader)
        per_epoch, fields = len(reader), reader.schema.names
        limit, stopped_by = _limit(batches, epochs, per_epoch)
        first: float | None = None
        it = iter(source)
        for _ in range(warmup_batches):
            size_of_batch(next(it), fields)
            first = time.perf_counter() - started if first is None else first
        if epochs is not None and warmup_batches % per_epoch:
            _stop(it)
            if adapter != "tf":  # a new tf.data iteration starts the next epoch by itself (`Passes`)
                jump_to_epoch(reader, int(reader.state_dict()["epoch"]) + 1)
            it = iter(source)
        bar = _progress_bar(progress)  # tqdm imported before the clock starts
        by_source = np.zeros(len(reader.sources), dtype=np.int64) if isinstance(reader, MixedReader) else None
        cpu0, t0 = time.process_time(), time.perf_counter()
        count, rows, decoded, first_at, timed_out = _timed(it, fields, limit, seconds, bar,
                                                           by_source=by_source)
        elapsed, cpu = max(time.perf_counter() - t0, 1e-9), time.process_time() - cpu0
        first = first_at - started if first is None else first
        stopped_by = "seconds" if timed_out else stopped_by
        stats = dict(reader.stats)
        row_cache = getattr(getattr(reader, "_source", None), "cache", None)
        if row_cache is not None:
            stats.update({f"cache_{k}": int(v) for k, v in row_cache.stats.items()})
    except BaseException as e:
        if adapter == "tf":  # its frames hold the tf.data iterator, which would read on (and hang the exit)
            traceback.clear_frames(e.__traceback__)
        own = read_error()
        if own is not None and e is not own and isinstance(e, Exception):
            raise own from own.__cause__  # the reader's own, its cause kept: not tf.data's OpError naming it
        raise
    finally:
        _stop(it)
        it = None  # a tf.data iterator lets go of the reader when dropped, before the reader closes
        close()
    mixture = rows_by_source = None
    if isinstance(reader, MixedReader) and by_source is not None:
        where = ", ".join(f"{name}={d.url}" for name, d in reader.datasets.items())
        mixture = reader.mixture.to_json()
        rows_by_source = {name: int(n) for name, n in zip(reader.sources, by_source, strict=True)}
    else:
        where = reader.dataset.url
    return Throughput(
        url=where, adapter=adapter, shard=reader.shard, num_shards=reader.num_shards,
        batch_size=reader.batch_size, batches_per_epoch=per_epoch, warmup_batches=warmup_batches,
        stopped_by=stopped_by, batches=count, rows=rows, decoded_bytes=decoded, seconds=elapsed,
        first_batch_seconds=first, cpu_seconds=cpu, peak_rss=peak_rss(), stats=stats, mixture=mixture,
        rows_by_source=rows_by_source,
    )


def _checked(adapter: Any, warmup: Any, batches: Any, seconds: Any, epochs: Any
             ) -> tuple[Adapter, int, int | None, int | None]:
    if adapter not in ADAPTERS:
        raise ReaderError(f"adapter={adapter!r} is not one of {', '.join(map(repr, ADAPTERS))}; "
                          "use 'numpy' for the reader's own batches")
    warmup = _count("warmup_batches", warmup, 0, "batches read before the clock starts")
    batches = None if batches is None else _count("batches", batches, 1, "batches to measure")
    epochs = None if epochs is None else _count("epochs", epochs, 1, "whole epochs to measure")
    real = isinstance(seconds, int | float | np.integer | np.floating) and not isinstance(seconds, bool)
    if seconds is not None and not (real and (isinstance(seconds, int) or math.isfinite(seconds))
                                    and seconds > 0):  # an int may be past float's range
        raise ReaderError(f"seconds={seconds!r} must be a finite number > 0 (how long to measure)")
    return adapter, warmup, batches, epochs


def _count(name: str, value: Any, minimum: int, what: str) -> int:
    value = int(value) if isinstance(value, np.integer) else value
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ReaderError(f"{name}={value!r} must be an int >= {minimum} ({what})")
    return value


def _limit(batches: int | None, epochs: int | None, per_epoch: int) -> tuple[int | None, StoppedBy]:
    """The most batches to measure and the bound that sets it (``seconds`` when neither does)."""
    if epochs is not None and (batches is None or epochs * per_epoch < batches):
        return epochs * per_epoch, "epochs"
    return batches, "batches" if batches is not None else "seconds"


def _wrap(adapter: Adapter, reader: Reader
          ) -> tuple[Any, Callable[[], None], Callable[[], Exception | None]]:
    """What to iterate for ``adapter`` (its module imported already: see `measure`), how to close it, and
    the reader's exception where tf.data runs it (``read_error``: tf.data raises an ``OpError`` of its
    own that holds only the text of it; see ``shardkit.tf.make_dataset``)."""
    if adapter == "torch":
        loader = importlib.import_module("shardkit.torch").make_loader(reader)
        return loader, loader.close, _no_read_error
    if adapter == "numpy":
        return reader, reader.close, _no_read_error
    ds = importlib.import_module("shardkit.tf").make_dataset(reader)
    return ds, reader.close, lambda: ds.read_error


def _no_read_error() -> Exception | None:
    """The reader's own exception where the adapter lets it through: none to find."""
    return None


def _stop(it: Iterator[Any] | None) -> None:
    """End an iteration now (a generator's ``close``; a tf.data iterator ends when dropped)."""
    getattr(it, "close", lambda: None)()


def _timed(it: Iterator[Any], fields: Sequence[str], limit: int | None, seconds: float | None, bar: Any, *,
           by_source: np.ndarray | None = None) -> tuple[int, int, int, float, bool]:
    """Batches, rows and decoded bytes (of ``fields``) taken from ``it`` until ``limit`` batches or
    ``seconds`` (then True, last), and when the first batch came; ``bar`` (if any) counts the rows and is
    closed. ``by_source`` (a mixture's): each source's rows are added to it."""
    count = rows = decoded = 0
    t0 = first = time.perf_counter()
    try:
        while limit is None or count < limit:
            batch = next(it)
            n, b = size_of_batch(batch, fields)
            if by_source is not None:
                by_source += np.bincount(np.asarray(batch[SOURCE]), minlength=len(by_source))
            now = time.perf_counter()
            first = now if count == 0 else first
            count, rows, decoded = count + 1, rows + n, decoded + b
            if bar is not None:
                bar.update(n)
            if seconds is not None and now - t0 >= seconds:
                return count, rows, decoded, first, True
        return count, rows, decoded, first, False
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(progress: bool | None) -> Any:
    show = sys.stderr.isatty() if progress is None else progress
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(unit=" rows", unit_scale=True, desc="shardkit bench", dynamic_ncols=True)


__all__ = ["ADAPTERS", "Adapter", "Throughput", "measure"]
