"""TensorFlow adapter: a reader as a ``tf.data.Dataset`` whose element_spec comes from the schema.

Public as ``shardkit.tf``. Importing it without TensorFlow installed raises `MissingDependencyError`
naming ``pip install 'shardkit[tf]'``.
"""

from __future__ import annotations

import copy
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from shardkit.errors import AdapterError, ShardkitError, require

require("tensorflow", extra="tf", purpose="shardkit.tf (tf.data datasets)")

import tensorflow as tf  # noqa: E402

from shardkit.dataset import Schema  # noqa: E402
from shardkit.reader._pipeline import batching  # noqa: E402
from shardkit.reader._pipeline.assemble import VALID  # noqa: E402
from shardkit.reader.adapters.collate import (  # noqa: E402
    MASK_SUFFIX,
    VALID_SUFFIX,
    Collate,
    FieldPlan,
    Passes,
    plan_fields,
    prepare,
)
from shardkit.reader.api import make_reader  # noqa: E402
from shardkit.reader.reader import Reader  # noqa: E402

RUN_BYTES = 16 << 20  # at most this much of consecutive batches goes to tf.data in one Python call
#: The note under a read error in tf.data's message (see make_dataset's "Read errors").
READ_ERROR_NOTE = "shardkit: this exception, with its cause, is read_error of the dataset from make_dataset"


def _ragged_rank(plan: FieldPlan) -> int:
    return max(plan.variable_dims) + 1


def _field_specs(plan: FieldPlan) -> dict[str, tf.TypeSpec]:
    shape, name = plan.field.shape, plan.name
    specs: dict[str, tf.TypeSpec] = {}
    if plan.kind == "text":
        specs[name] = tf.TensorSpec((None,), tf.string)
    elif plan.kind in ("dense", "pad"):
        specs[name] = tf.TensorSpec((None, *shape), tf.as_dtype(plan.dtype))
        if plan.kind == "pad":
            specs[name + MASK_SUFFIX] = tf.TensorSpec((None, *(None for _ in plan.variable_dims)), tf.bool)
    else:
        k = _ragged_rank(plan)
        specs[name] = tf.RaggedTensorSpec((None, *(None for _ in range(k)), *shape[k:]),
                                          tf.as_dtype(plan.dtype), ragged_rank=k, row_splits_dtype=tf.int64)
    if plan.nullable:
        specs[name + VALID_SUFFIX] = tf.TensorSpec((None,), tf.bool)
    return specs


def element_spec(schema: Schema, collate: Collate | None = None) -> dict[str, tf.TypeSpec]:
    """The ``tf.data`` element spec of batches of ``schema`` under ``collate`` (see `Collate`).

    Example:
        >>> shardkit.tf.element_spec(reader.schema)["image"]
        TensorSpec(shape=(None, 32, 32, 3), dtype=tf.uint8, name=None)

    The batch dimension and variable dimensions are None; str and bytes are ``tf.string``; variable
    shapes are `tf.RaggedTensorSpec` (``Collate(variable="rows")``, every dimension up to the last
    variable one ragged) or padded `tf.TensorSpec` plus a mask (``variable="pad"``). Specs carry no
    ``name``: the keys name the fields, and tf.data's own steps (``rebatch``, ``map``) drop names.
    """
    out: dict[str, tf.TypeSpec] = {}
    for plan in plan_fields(schema, collate or Collate(), "tf"):
        out.update(_field_specs(plan))
    return out


def _ragged(plan: FieldPlan, rows: Sequence[np.ndarray | None]) -> tf.RaggedTensor:
    """Rows of varying shape as a RaggedTensor (a null is an empty row), without per-element Python."""
    k = _ragged_rank(plan)
    trailing = tuple(int(d) for d in plan.field.shape[k:] if d is not None)
    empty = np.zeros((0,) * len(plan.field.shape), plan.dtype)
    arrays = [empty if r is None else r for r in rows]
    shapes = np.array([a.shape for a in arrays], dtype=np.int64).reshape(len(arrays), -1)
    lengths, counts = [], np.ones(len(arrays), dtype=np.int64)
    for j in range(k):  # level j: each of the prod(shape[:j]) sub-rows of row i has shape[i, j] items
        lengths.append(np.repeat(shapes[:, j], counts))
        counts = counts * shapes[:, j]
    parts = [a.reshape(-1, *trailing) for a in arrays] or [empty.reshape(0, *trailing)]
    flat = np.concatenate(parts)
    return tf.RaggedTensor.from_nested_row_lengths(flat, lengths, validate=False)


def _to_tf(plans: Sequence[FieldPlan], prepared: dict[str, Any]) -> dict[str, Any]:
    for plan in plans:
        value = prepared[plan.name]
        if plan.kind == "rows":
            prepared[plan.name] = _ragged(plan, value)
        elif plan.kind == "text" and plan.nullable:
            blank = "" if plan.field.dtype.kind == "U" else b""
            prepared[plan.name] = np.array([blank if v is None else v for v in value], dtype=object)
    return prepared


def make_dataset(reader_or_url: Reader | Any, *, label: str | None = None,
                 features: str | Sequence[str] | None = None, collate: Collate | None = None,
                 prefetch: int | None = tf.data.AUTOTUNE, **make_reader_kwargs: Any) -> tf.data.Dataset:
    """A reader's batches as a ``tf.data.Dataset`` (dicts of tensors, or ``(features, label)`` pairs).

    Example:
        >>> ds = shardkit.tf.make_dataset("runs/digits", batch_size=64, features="pixels", label="label")
        >>> model.fit(ds, epochs=3)

    The element spec comes from the schema (`element_spec`), so nothing is read to build it. Batches
    come from a Python generator yielding numpy arrays with that spec (``from_generator`` with
    ``output_signature``), and ``prefetch`` batches are prepared ahead of the model (the reader itself
    reads ahead too). Each call from tf.data into Python has a fixed cost whatever it carries (a large
    part of the reader's time per batch), so when every field is dense or text, consecutive batches
    that lie one after another in the reader's memory (those of a shuffle window) go as one run of up
    to `RUN_BYTES`, which tf.data takes without a copy (the reader's arrays are 64-byte aligned) and
    cuts back into the same batches (``rebatch``: one copy each). Variable shapes and padding go batch
    by batch.

    Each iteration of the dataset (each Keras epoch) is ``num_epochs`` whole epochs (one, by default),
    each shuffled anew, and its cardinality is known (Keras sees its steps); ``num_epochs=None`` never
    ends (give Keras ``steps_per_epoch``). The first iteration starts where the reader is (load a
    resume state into the reader before calling this); a later one that finds the reader inside an epoch
    (an iterator stopped early, or one Keras or prefetching made and dropped) starts the next epoch, so
    no iteration ever gets a partial epoch. One iteration runs at a time: a new one ends the previous.
    tf.data reads ahead of the model, so the reader's ``state_dict()`` during an epoch is ahead of
    training; between epochs it is exact.

    Under a ``tf.distribute`` strategy that distributes a dataset (``model.fit`` or
    ``experimental_distribute_dataset`` under ``MultiWorkerMirroredStrategy``), a dataset of one shard
    of several (``shard=rank, num_shards=world``, or ``ctx.tf_dataset()``) is not sharded again
    (``AutoShardPolicy.OFF``); one of the whole dataset is sharded by batch (``DATA``). `dataset_fn`
    shards by the strategy's ``InputContext`` instead.

    Read errors: tf.data turns what the generator raises into a ``tf.errors.OpError`` of its choice,
    iterating or in ``model.fit`` (TensorFlow 2.21 keeps no class through it: a generator raising
    ``tf.errors.DataLossError`` gives ``UnknownError``): ``InvalidArgumentError`` for a ``ValueError``
    (`SchemaMismatchError`, `ReaderError`), ``UnknownError`` for the others (`CorruptDatasetError`...).
    Its message holds the shardkit message as one line after the class name (``CorruptDatasetError: row
    group 1 of '.../part-00001.parquet' cannot be read ...``), tf.data's frames and `READ_ERROR_NOTE`,
    not the frames of the reader's threads nor the Arrow error under it. The exception itself, with its
    cause, is the returned dataset's ``read_error`` (None until an iteration fails; reset when one starts):
    ``raise ds.read_error`` where TensorFlow's error is caught. A dataset made from it has no such attribute.

    Args:
        reader_or_url: a `Reader`, or a dataset URL and ``make_reader_kwargs`` for `make_reader`.
        label: a field to yield apart, as ``(features, label)`` pairs for ``model.fit``; with
            ``remainder="mask"``, ``(features, label, sample_weight)`` triples, the weight 1.0 for a sample
            and 0.0 for a masked row (``__valid__`` as float32), which Keras applies to the loss.
        features: with ``label``: one field (yielded as a tensor) or several (a dict); default every
            other field. Without ``columns=``, only these fields and ``label`` are read.
        collate: the `Collate` policy for strings, nulls and variable shapes (``cast`` included).
        prefetch: batches tf.data prepares ahead (``tf.data.AUTOTUNE``; None or 0: none).

    Raises:
        AdapterError: a field TensorFlow cannot represent (datetime64; cast it with ``Collate(cast=...)``),
            or ``features``/``label`` that are not fields.
    """
    policy = collate or Collate()
    if isinstance(reader_or_url, Reader):
        if make_reader_kwargs:
            raise AdapterError(f"make_dataset got a Reader and reader options {sorted(make_reader_kwargs)}; "
                               "pass the options to make_reader, or pass a URL instead of a Reader")
        reader = reader_or_url
    else:
        if "columns" not in make_reader_kwargs and features is not None:
            wanted = [features] if isinstance(features, str) else list(features)
            fields = [_field_of(n) for n in [*wanted, *([label] if label is not None else [])]]
            make_reader_kwargs["columns"] = list(dict.fromkeys(fields))
        reader = make_reader(reader_or_url, **make_reader_kwargs)
    plans = plan_fields(reader.schema, policy, "tf")
    spec = element_spec(reader.schema, policy)
    split = _splitter(spec, label, features, VALID in spec)

    passes = Passes(reader, fresh=True)
    # dense and text fields are row by row: a run of batches prepares as the batches would, one by one
    joined = all(p.kind in ("dense", "text") for p in plans)

    returned: list[weakref.ref[Any]] = []  # the dataset returned, weakly: it holds `generate`

    def generate() -> Iterator[Any]:
        _keep(returned, None)
        try:
            batches = passes()
            for batch in batching.runs(batches, reader.batch_size, RUN_BYTES) if joined else batches:
                yield split(_to_tf(plans, prepare(plans, batch, policy)))
        except Exception as e:
            _keep(returned, e)
            if (shown := _shown(e)) is None:
                raise
            raise shown from None

    ds = tf.data.Dataset.from_generator(generate, output_signature=split(spec))
    if joined:  # each run back into its batches: full ones, then the short one that may end it
        ds = ds.flat_map(lambda *run: tf.data.Dataset.from_tensors(run if len(run) > 1 else run[0])
                         .rebatch(reader.batch_size))
    if reader.num_epochs is None:
        ds = ds.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    elif not reader.state_dict()["history"]:  # every pass is whole epochs: Keras knows its steps
        ds = ds.apply(tf.data.experimental.assert_cardinality(reader.num_epochs * len(reader)))
    ds = ds.prefetch(prefetch) if prefetch else ds
    ds = ds.with_options(_options(reader.num_shards))
    ds.read_error = None
    returned.append(weakref.ref(ds))
    return ds


def _keep(returned: list[weakref.ref[Any]], error: Exception | None) -> None:
    """Set the returned dataset's ``read_error``, the locals of ``error``'s finished frames cleared:
    kept there, they would hold the reader's arrays and the file it failed on."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        traceback.clear_frames(cause.__traceback__)  # skips the frames still running (generate's)
        cause = cause.__cause__ or cause.__context__
    dataset = returned[0]() if returned else None
    if dataset is not None:
        dataset.read_error = error


def _shown(error: Exception) -> Exception | None:
    """What tf.data gets of a shardkit ``error``: a copy without its cause and traceback (tf.data's
    message would hold both, every frame of the reader's threads included) and with `READ_ERROR_NOTE`;
    None (raise ``error`` itself) for other errors (a bug's frames tell where it is) and for a shardkit
    error that does not copy as itself."""
    if not isinstance(error, ShardkitError):
        return None
    try:
        shown = copy.copy(error)
    except Exception:
        return None
    if type(shown) is not type(error) or str(shown) != str(error):
        return None
    shown.__notes__ = [*getattr(error, "__notes__", []), READ_ERROR_NOTE]  # a new list: error's stays
    return shown


def _options(num_shards: int) -> tf.data.Options:
    """The dataset's ``tf.data.Options``: how a strategy may shard it, and autotuning off.

    Sharding (``experimental_distribute_dataset``, ``model.fit`` under ``MultiWorkerMirroredStrategy``):
    not at all when the reader reads one shard of several (it was sharded already: TensorFlow's
    default, AUTO, tried to shard it again by file and failed on its first batch), by batch (``DATA``)
    when it reads the whole dataset (each worker then keeps every n-th batch of it).

    Autotuning: deleting an iterator of an autotuned dataset (the end of every ``for batch in ds``)
    waits, now and then, for the autotuner's next round, which comes 10 ms, 20 ms, ... up to 60 s
    apart: with TensorFlow 2.21, even a pass of plain ``Dataset.range(n).map(f)`` then stood still for
    seconds (the cancellation wakes the autotuner before it counts as cancelled, so it sleeps on). A
    custom loop or ``strategy.run`` loop pays that at every epoch. Off, this dataset reads as fast, and
    a later ``map(num_parallel_calls=AUTOTUNE)`` keeps tf.data's default parallelism instead of a tuned
    one. To turn it back on:
    ``ds.with_options(opts)`` with ``opts.autotune.enabled = True``.
    """
    policy = tf.data.experimental.AutoShardPolicy
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy.OFF if num_shards > 1 else policy.DATA
    options.autotune.enabled = False
    return options


def _field_of(key: str) -> str:
    """The field an output key belongs to (``x__mask`` and ``x__valid`` belong to ``x``)."""
    for suffix in (MASK_SUFFIX, VALID_SUFFIX):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


def _splitter(spec: dict[str, Any], label: str | None, features: str | Sequence[str] | None,
              masked: bool = False) -> Callable[[dict[str, Any]], Any]:
    """Turns an element dict (or the spec itself) into what the dataset yields; ``masked``
    (``remainder="mask"``): pairs become ``(features, label, sample_weight)`` triples."""
    if label is None and features is None:
        return lambda d: d
    names = [features] if isinstance(features, str) else list(features or [])
    unknown = [n for n in [*names, *([label] if label is not None else [])] if n not in spec]
    if unknown:
        raise AdapterError(f"make_dataset: {unknown} are not fields of the batches; they hold {sorted(spec)}")
    if masked and (label is None or label == VALID or VALID in names):
        raise AdapterError(
            f"make_dataset(features={features!r}, label={label!r}) with remainder='mask': the batches' "
            f"{VALID!r} mask would be lost or taken for data; give label= (the dataset then yields "
            "(features, label, sample_weight) triples, the weight 0.0 on masked rows), or leave features= "
            f"and label= out (dicts holding {VALID!r})")
    if label is None:
        return (lambda d: d[names[0]]) if isinstance(features, str) else (lambda d: {n: d[n] for n in names})
    if features is None:
        pick: Callable[[dict[str, Any]], Any] = lambda d: {k: v for k, v in d.items()  # noqa: E731
                                                           if k not in (label, VALID)}
    elif isinstance(features, str):
        pick = lambda d: d[names[0]]  # noqa: E731
    else:
        pick = lambda d: {n: d[n] for n in names}  # noqa: E731
    if not masked:
        return lambda d: (pick(d), d[label])
    return lambda d: (pick(d), d[label], _weight(d[VALID]))


def _weight(valid: Any) -> Any:
    """``remainder="mask"``: the Keras ``sample_weight`` of a ``__valid__`` column (or its spec)."""
    if isinstance(valid, tf.TensorSpec):
        return tf.TensorSpec(valid.shape, tf.float32)
    return np.asarray(valid, dtype=np.float32)


def dataset_fn(url: Any, *, batch_size: int, **kwargs: Any) -> Callable[[tf.distribute.InputContext],
                                                                         tf.data.Dataset]:
    """The function ``strategy.distribute_datasets_from_function`` calls once per input pipeline.

    Pipeline ``input_pipeline_id`` of ``num_input_pipelines`` reads shard ``input_pipeline_id`` of
    ``num_input_pipelines``, in batches of ``batch_size / num_replicas_in_sync`` (``batch_size`` is the
    global batch, as in ``tf.distribute``). The other arguments go to `make_dataset`.
    """
    for key in ("shard", "num_shards"):
        if key in kwargs:
            raise AdapterError(f"dataset_fn got {key}=; the InputContext gives each input pipeline its shard")

    def fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        try:
            per_replica = context.get_per_replica_batch_size(batch_size)
        except ValueError as e:
            raise AdapterError(f"batch_size={batch_size} (the global batch) does not divide among "
                               f"{context.num_replicas_in_sync} replicas; use a multiple of it") from e
        return make_dataset(url, shard=context.input_pipeline_id, num_shards=context.num_input_pipelines,
                            batch_size=per_replica, **kwargs)

    return fn


def distribute_dataset(strategy: tf.distribute.Strategy, url: Any, *, batch_size: int,
                       **kwargs: Any) -> Any:
    """A distributed dataset for ``strategy``: each input pipeline reads its own shard (see `dataset_fn`).

    Example:
        >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()
        >>> dist = shardkit.tf.distribute_dataset(strategy, url, batch_size=512, label="label")
        >>> for features, labels in dist: strategy.run(step, args=(features, labels))
    """
    return strategy.distribute_datasets_from_function(dataset_fn(url, batch_size=batch_size, **kwargs))


__all__ = ["dataset_fn", "distribute_dataset", "element_spec", "make_dataset"]
