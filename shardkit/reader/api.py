"""`make_reader`: validate every argument up front, open the dataset, and build a `Reader`."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from shardkit.dataset import Dataset, Field, Schema
from shardkit.dataset.open import open_dataset
from shardkit.dataset.take import raw_fields
from shardkit.dataset.write import parse_size
from shardkit.errors import CacheWarning, ReaderError, SchemaError
from shardkit.reader._arguments import explained
from shardkit.reader._filter import Filter
from shardkit.reader._pipeline.assemble import VALID
from shardkit.reader._pipeline.decode import late_fields
from shardkit.reader._pipeline.transform import check_picklable
from shardkit.reader._plan import REMAINDERS, Remainder, validate_shard
from shardkit.reader.mixture import open_mixture
from shardkit.reader.reader import WINDOW_BYTES, Reader

HANDLE_BYTES = 16  # what a shuffle window holds per row of a field decoded late: its spill handle
#: the default shuffle window of late-decoded (image) fields spills at most about this many encoded bytes
#: to local disk (`shardkit.reader._pipeline.spill`), per reader
SPILL_BYTES = 8 << 30


@explained
def make_reader(
    url: str | os.PathLike[str] | Dataset | Any,
    *,
    shard: int | None = None,
    num_shards: int | None = None,
    batch_size: int = 256,
    columns: Sequence[str] | None = None,
    filter: Filter | None = None,
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = 1,
    remainder: Remainder = "drop",
    drop_last: bool = False,
    shuffle_buffer: int | None = None,
    cache: Any = "auto",
    prefetch: int | None = None,
    workers: int | None = None,
    max_inflight_bytes: int | str = "512MiB",
    on_error: Literal["raise", "skip"] = "raise",
    storage_options: dict[str, Any] | None = None,
    version: int | None = None,
    schema: Schema | Sequence[Field] | None = None,
    weights: Mapping[str, Any] | None = None,
    samples_per_epoch: int | None = None,
    reweight: bool = False,
    transform: Callable[..., Mapping[str, Any]] | None = None,
    transform_workers: int | None = None,
    transform_timeout: float | None = None,
    decode: bool | Mapping[str, bool] = True,
    variable: bool | Sequence[str] = False,
    quick_start: bool = True,
) -> Reader:
    """Read one shard of a dataset as batches (dicts of column name -> numpy array).

    Example:
        >>> with shardkit.make_reader("s3://bucket/train", shard=rank, num_shards=world,
        ...                           batch_size=256, seed=42, num_epochs=None) as reader:
        ...     for batch in reader:
        ...         train_step(batch["image"], batch["label"])

    Every sample goes to exactly one shard, shards get equal numbers of samples (so every rank runs the
    same number of steps), and ``state_dict()``/``load_state_dict()`` resume mid-epoch, with the same
    or a different number of shards, without repeating a sample. ``remainder="mask"`` also reads every
    sample, in every epoch and through any resume: a shard with fewer samples fills its last batch with
    masked rows, and every batch carries a bool ``__valid__`` column (the default ``"drop"`` leaves out
    fewer than ``num_shards`` samples per epoch: of an epoch resumed on another number of shards, fewer
    than the number that finishes it).

    Several datasets mix into one stream (a `shardkit.reader.mixture.MixedReader`; see the guide
    "Mixing datasets"): ``make_reader({"web": url_a, "books": url_b}, weights={"web": 3, "books": 1})``.

    Args:
        url: a shardkit dataset, a Petastorm dataset, a plain Parquet folder, a Delta Lake or an Iceberg
            table (any fsspec URL), an opened `Dataset`, or a ``deltalake.DeltaTable`` /
            ``pyiceberg.table.Table``. A table is read at one snapshot (see ``version``). A dict of
            source name -> any of these reads a weighted mixture of them; ``filter``,
            ``storage_options``, ``version`` and ``schema`` may then be dicts of source name -> value.
        shard: this worker's rank. ``make_reader(url, shard=rank)`` takes ``num_shards`` from the job
            (``WORLD_SIZE`` or an initialized ``torch.distributed``); with neither given, a single shard
            outside a job.
        num_shards: the number of workers (shards).
        batch_size: rows per batch; the last batch of an epoch may be smaller (see ``drop_last``), except
            with ``remainder="mask"``, where every batch has ``batch_size`` rows.
        columns: fields to read (default: all).
        filter: a ``pyarrow.compute`` expression or DNF tuples (``[("label", "<", 5)]``), pushed down
            to row-group statistics; matching rows are counted before reading so shards stay equal.
            It may name the Hive partition keys of a partitioned folder (``year`` of ``year=2024/``),
            typed as ``pyarrow.dataset``'s Hive partitioning types them, and a Delta table's partition
            columns (their values from its log); files whose partition values rule the filter out are
            not read.
        shuffle: shuffle row groups per epoch, then rows within a window of ``shuffle_buffer`` rows
            (default: about 32 MiB of decoded rows; image fields count 16 bytes a row, since they are
            shuffled as encoded bytes kept on local disk and decoded per batch, up to `SPILL_BYTES` of
            encoded images: see the images guide), reproducibly from ``seed`` and the epoch.
        seed: the shuffle's seed.
        num_epochs: epochs to iterate; None for forever.
        remainder: samples that do not divide among the shards: ``"drop"`` (default; fewer than
            ``num_shards`` per epoch are left out; in an epoch resumed on another number of shards,
            fewer than that number), ``"pad"`` (repeat a few), ``"uneven"`` (first shards get one
            more; ranks may then run different numbers of steps: can hang allreduce), ``"mask"`` (every
            sample exactly once, even through resumes on other shard counts, and every shard runs the
            same number of steps: each batch has ``batch_size`` rows and a bool column ``__valid__``,
            False on the masked rows that fill a shard's last batch, copies of a real row; weigh the
            loss with it: ``(loss * valid).sum() / valid.sum().clamp(min=1)``, since a batch may be all
            masked). A mixture too: every position of its epoch once (see `MixedReader`).
        drop_last: also drop each shard's last partial batch. Not with ``remainder="mask"``, whose
            batches are all full (masked rows fill the last one), so it could only drop samples.
        cache: ``"auto"`` (row groups of remote datasets are cached on local disk; where its folder
            cannot be created, a `CacheWarning` and no cache), None, a folder, or a
            ``shardkit.reader._cache.CacheConfig`` (whose folder must be writable: `ReaderError`).
        prefetch: tasks (row-group slices) read ahead; default ``2 * workers``.
        workers: reading/decoding threads; default ``min(4, cpus)``, at least 2.
        max_inflight_bytes: of a remote dataset, the most bytes fetched ahead of the reads (in flight, or
            fetched and not yet read): an int or a size such as ``"256MiB"``. The reader requests the
            row groups it will read next, in its order, as far ahead as the store's round trips need
            (measured), up to this. Local files are not fetched ahead (they are memory-mapped).
        on_error: ``"raise"`` on a corrupt row group (naming file and row group), or ``"skip"`` it,
            count it in ``reader.stats`` and warn at the end of the epoch. Each lost row's place in its
            batch is taken by a readable sample (half an epoch further in the epoch's order, see
            `shardkit.reader._lost.substitutes`), so a shard still yields ``len(reader)`` batches, every
            rank's state is the same, and a resumed reader yields what the uninterrupted one would have.
            A row group is then read whole before its rows are used (so it is lost whole or not at all).
        storage_options: passed to fsspec (credentials, endpoint), and to a table's library.
        version: a Delta table's version or an Iceberg table's snapshot id (time travel); default the
            current one when the reader opens. ``state_dict()`` names it, and ``load_state_dict()`` goes
            on with that snapshot's rows even after the table moved on (logged once).
        schema: fields for columns of data shardkit did not write (a plain Parquet folder, a table):
            ``[Field("emb", "float32", (16,)), Field("image", "uint8", (64, 64, 3), codec=ImageCodec())]``
            for Spark's arrays and binary images; the other columns keep the fields their Arrow types
            give (`shardkit.dataset.hints`).
        weights: a mixture's weights, source name -> number >= 0 (each source's share of the stream is
            its weight over their sum), or a schedule of the samples read: ``[(samples, weight), ...]``
            (linear between points), ``{"steps": [...]}`` or a `WeightSchedule` (see "Mixing datasets");
            default: the sources' rows (after ``filter``).
        samples_per_epoch: a mixture's epoch, in samples of all sources together; default: the rows of
            the sources of positive weight together.
        reweight: a mixture's: continue a state saved at other weights at these, from where it stopped
            (`MixedReader.load_state_dict`), each source's rows still once per pass.
        transform: a function run on every sample after decoding, ``fn(sample) -> sample`` or
            ``fn(sample, rng)`` (a dict of field -> numpy value in, a dict out: random crops, flips,
            resizes, tokenizing). Reproducible: ``rng`` (a ``numpy.random.Generator``), Python's
            ``random``, numpy's global generator and torch's are seeded from ``seed``, the epoch and the
            sample's row in the dataset, so a resumed or re-sharded run transforms each sample alike.
            Every sample of a batch must give the same fields, shapes and dtypes. A sample whose
            transform raises is named (file, row group, row); ``on_error="skip"`` leaves it out of its
            batch. See the images guide.
        transform_workers: processes that decode and transform, besides the reading process (0: in the
            reading process, in a thread). Default 0; use the cores a DataLoader's workers would.
            ``transform`` must then be picklable (a module-level function or a ``functools.partial``).
        transform_timeout: seconds a batch may take in the transform workers before a `ReaderError`
            (default: no limit).
        variable: fields a ``transform`` returns in shapes that vary from sample to sample (or True: all
            of them), delivered as a 1-D object array of the samples' arrays; any other field must come
            in one shape and dtype for every sample (`TransformError` names the first two).
        decode: False (or ``{field: False}``) delivers image fields as their encoded JPEG/PNG bytes (a 1-D
            object array of ``bytes`` per batch), for a decoder elsewhere (a GPU's); default True.
        quick_start: shuffled, where a window spans 4 row groups or more, each shard's first batch of an
            epoch comes from one row group (picked at random), so it waits for one row group to be read,
            not for its whole shuffle window (from an object store: fetched); every later batch mixes
            the whole window. False: the first batch
            mixes it too. A mixture's batches draw on its sources as they come: no quick start there.

    Raises:
        ReaderError: a bad argument (shard, columns, filter, sizes) — before anything is read.
        DatasetNotFoundError, NotADatasetError: no dataset at ``url``.
    """
    # numpy integers (a rank computed with numpy, a size read from an array) count as ints
    shard, num_shards, batch_size, seed, num_epochs, shuffle_buffer, prefetch, workers = map(
        _plain, (shard, num_shards, batch_size, seed, num_epochs, shuffle_buffer, prefetch, workers))
    shard, num_shards = _job_world(shard, num_shards)
    validate_shard(shard, num_shards)
    _positive("batch_size", batch_size)
    for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("quick_start", quick_start)):
        if not isinstance(flag, bool | np.bool_):
            raise ReaderError(f"{name}={flag!r} must be True or False")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ReaderError(f"seed={seed!r} must be an int >= 0")
    if num_epochs is not None:
        _positive("num_epochs", num_epochs)
    if remainder not in REMAINDERS:
        raise ReaderError(f"remainder={remainder!r} must be 'drop', 'pad', 'uneven' or 'mask'")
    if remainder == "mask" and drop_last:
        raise ReaderError(
            "drop_last=True with remainder='mask': mask fills each shard's last batch up to batch_size rows "
            "with masked rows (__valid__ False), so every batch is full and drop_last could only leave out "
            "samples, which mask is there to keep; leave drop_last out (False), or use remainder='drop' "
            "with drop_last=True")
    if on_error not in ("raise", "skip"):
        raise ReaderError(f"on_error={on_error!r} must be 'raise' or 'skip'")
    workers = _positive("workers", workers) if workers is not None else max(2, min(4, os.cpu_count() or 2))
    prefetch = _positive("prefetch", prefetch, 0) if prefetch is not None else 2 * workers
    if transform is not None and not callable(transform):
        if hasattr(transform, "func") and hasattr(transform, "edit_fields"):
            raise ReaderError(
                f"transform={transform!r}: transform= takes a function of one sample, and this looks like a "
                "Petastorm TransformSpec. Pass its function (transform=spec.func): shardkit learns the "
                "fields, shapes and dtypes from the samples it returns, so edit_fields and removed_fields "
                "have no counterpart (return the sample without the removed fields)")
        raise ReaderError(f"transform={transform!r} is not callable; pass a function fn(sample) -> sample")
    processes = 0 if transform_workers is None else _positive("transform_workers", transform_workers, 0)
    if processes and transform is not None:
        check_picklable("transform", transform)
    if not isinstance(variable, bool) and (isinstance(variable, str) or not all(
            isinstance(v, str) for v in variable)):
        raise ReaderError(f"variable={variable!r} must be True, False or a list of field names")
    if transform_timeout is not None and (not isinstance(transform_timeout, int | float)
                                          or isinstance(transform_timeout, bool) or transform_timeout <= 0):
        raise ReaderError(f"transform_timeout={transform_timeout!r} must be a number of seconds > 0, or None")
    if isinstance(url, Mapping):
        given: dict[str, Any] = {"transform": transform if transform is not None else None,
                                 "decode": None if decode is True else decode}
        for name, value in given.items():
            if value is not None:
                raise ReaderError(
                    f"{name}={value!r} is not supported for a mixture of datasets yet: a mixture decodes its "
                    "sources' rows as it reads them. Read each source with make_reader, or apply the "
                    "transform to the mixture's batches in your loop")
        each = {"columns": columns, "filter": filter, "shuffle_buffer": shuffle_buffer, "cache": cache,
                "on_error": on_error, "max_inflight_bytes": max_inflight_bytes,
                "storage_options": storage_options, "version": version, "schema": schema}
        return open_mixture(url, make_reader, weights=weights, samples_per_epoch=samples_per_epoch,
                            shard=shard, num_shards=num_shards, batch_size=batch_size, shuffle=bool(shuffle),
                            seed=seed, num_epochs=num_epochs, remainder=remainder, drop_last=bool(drop_last),
                            prefetch=prefetch, workers=workers, options=each, reweight=bool(reweight))
    for name, value in (("weights", weights), ("samples_per_epoch", samples_per_epoch),
                        ("reweight", reweight or None)):
        if value is not None:
            raise ReaderError(f"{name}={value!r} is for a mixture of several datasets, given as a dict: "
                              "make_reader({'web': url_a, 'books': url_b}, weights={'web': 3, 'books': 1}); "
                              f"with one dataset, leave {name}= out")
    try:
        inflight = parse_size(max_inflight_bytes, what="max_inflight_bytes")
    except SchemaError as e:
        raise ReaderError(str(e)) from None

    if isinstance(url, Dataset):
        if version is not None and (url.snapshot is None or url.snapshot.version != version):
            raise ReaderError(f"version={version!r} was given with an opened Dataset of {url.url!r}; open "
                              "it at that version (shardkit.open_dataset(url, version=...)) or pass its URL")
        dataset = url
        if schema is not None:
            from shardkit.dataset.hints import apply_hints

            dataset = apply_hints(dataset, schema)
    else:
        dataset = open_dataset(url, storage_options=storage_options, version=version, schema=schema,
                               filter=filter)  # a table lists only the files the filter may match
    names = dataset.schema.names
    if columns is None:
        columns = names
    else:
        if isinstance(columns, str):
            raise ReaderError(f"columns={columns!r} must be a list of names, e.g. [{columns!r}]")
        if not columns:
            raise ReaderError(f"columns=[] selects nothing; pass some of the fields {names}, or None for all")
        unknown = [c for c in columns if c not in names]
        keys = [c for c in unknown if c in dataset.partition_keys]
        if keys:
            raise ReaderError(
                f"columns={list(columns)!r}: {keys!r} of {dataset.url!r} are Hive partition keys, in its "
                "folder names (key=value/), not columns of its files, and shardkit does not read them "
                f"into batches (its fields are {names}). Filter on them (filter=[({keys[0]!r}, '=', ...)]) "
                "and leave them out of columns=, or rewrite the data with the keys as columns: "
                f"shardkit.write_dataset(pyarrow.dataset.dataset({dataset.url!r}, partitioning='hive')"
                ".to_table(), url)"
            )
        left_out = [c for c in unknown if c in dataset.left_out]
        if left_out:
            raise ReaderError(
                f"columns={list(columns)!r}: {left_out!r} of {dataset.url!r} have no field type, so they "
                f"were left out when it opened: {dataset.left_out[left_out[0]]} (its fields are {names})"
            )
        if unknown:
            raise ReaderError(f"unknown column(s) {unknown!r} for {dataset.url!r}; its fields are {names}")
        twice = sorted({c for c in columns if list(columns).count(c) > 1})
        if twice:
            raise ReaderError(f"columns={list(columns)!r} names {twice} more than once; name each field once")
    if remainder == "mask" and VALID in columns:
        raise ReaderError(
            f"remainder='mask': {dataset.url!r} has a field named {VALID!r}, the column mask adds to every "
            f"batch (True for a sample, False for a masked row); leave it out of the columns read "
            f"(columns={[c for c in names if c != VALID]!r}), rename it in the data, or read with "
            "remainder='drop' or 'pad'")
    raw = raw_fields(decode, dataset.schema, list(columns))
    fields = {name: dataset.schema[name] for name in columns}
    late = late_fields(fields, dict.fromkeys(raw, False))
    if on_error == "skip" or not (shuffle or processes):
        # a corrupt image's row is replaced by a readable one as the window is read (on_error="skip"), and
        # unshuffled windows are small anyway: images are decoded as they are read, in the reading threads
        # (unless transform workers decode them); only encoded bytes asked for stay late
        late = {name: f for name, f in late.items() if name in raw}
    row_bytes = max(1, dataset.decoded_row_bytes(columns))
    # decoded bytes, not Parquet's: compression and dictionaries (PNG images even more) make the
    # encoded size several times smaller than what the window holds in memory
    eager_window = max(1024, WINDOW_BYTES // row_bytes)
    if shuffle_buffer is None:
        shuffle_buffer = eager_window
        if late:  # a window holds a 16-byte handle per late field and row, the rest decoded
            window_bytes = max(1, dataset.decoded_row_bytes([c for c in columns if c not in late]) if
                               len(late) < len(columns) else 0) + HANDLE_BYTES * len(late)
            encoded = max(1, dataset.encoded_row_bytes(list(late)))
            shuffle_buffer = max(1024, min(WINDOW_BYTES // window_bytes, SPILL_BYTES // encoded))
    _positive("shuffle_buffer", shuffle_buffer)

    row_cache = None
    if cache is not None and not (cache == "auto" and dataset.location.is_local):
        from shardkit.reader._cache import CacheConfig, RowGroupCache

        config = CacheConfig.resolve(cache, remote=not dataset.location.is_local)
        try:
            row_cache = None if config is None else RowGroupCache(config)
        except ReaderError as e:
            if cache != "auto":  # a cache asked for by name: its folder must work
                raise
            # the default cache is an optimization: a home folder that is not writable must not stop a job
            warnings.warn(CacheWarning(f"{e}; reading {dataset.url!r} without the default row-group cache"),
                          stacklevel=2)
    return Reader(dataset, columns=list(columns), shard=shard, num_shards=num_shards, batch_size=batch_size,
                  shuffle=bool(shuffle), seed=seed, num_epochs=num_epochs, remainder=remainder,
                  drop_last=bool(drop_last), shuffle_buffer=shuffle_buffer, filter=filter,
                  cache=row_cache, prefetch=prefetch,
                  workers=workers, on_error=on_error,
                  row_bytes=row_bytes, max_inflight_bytes=inflight, late=late, raw=frozenset(raw),
                  eager_window=eager_window, transform=transform, transform_workers=processes,
                  transform_timeout=transform_timeout,
                  variable=variable if isinstance(variable, bool) else frozenset(variable),
                  quick_start=bool(quick_start))


def _plain(value: Any) -> Any:
    """A numpy integer as the Python int it is; anything else as it is (checked later)."""
    return int(value) if isinstance(value, np.integer) else value


def _job_world(shard: int | None, num_shards: int | None) -> tuple[int, int]:
    """Fill in shard/num_shards from the job this process runs in (WORLD_SIZE/RANK or torch.distributed)."""
    if num_shards is not None:
        if shard is None:
            raise ReaderError(f"num_shards={num_shards} was given without shard=; pass this worker's rank")
        return shard, num_shards
    world, rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    dist = _torch_dist()
    if dist is not None:
        world, rank = str(dist.get_world_size()), str(dist.get_rank())
    if world is None:
        if shard is None or shard == 0:
            return 0, 1
        raise ReaderError(
            f"shard={shard} was given without num_shards, and this process is not in a job (no WORLD_SIZE, "
            "no initialized torch.distributed); pass num_shards=<number of workers>"
        )
    if shard is None and rank is None:
        raise ReaderError(
            f"WORLD_SIZE={world} is set but RANK is not, so this worker's shard is unknown; pass "
            "shard=<rank> (every worker reading shard 0 would read the same samples)"
        )
    try:
        return (shard if shard is not None else int(str(rank))), int(world)
    except ValueError as e:
        raise ReaderError(
            f"the job's WORLD_SIZE={world!r} / RANK={rank!r} are not ints; pass shard= and num_shards="
        ) from e


def _torch_dist() -> Any:
    if "torch.distributed" not in sys.modules:
        return None
    dist = sys.modules["torch.distributed"]
    return dist if dist.is_available() and dist.is_initialized() else None


def _positive(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ReaderError(f"{name}={value!r} must be an int >= {minimum}")
    return value
