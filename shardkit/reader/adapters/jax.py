"""JAX adapter: reader batches as dicts of ``jax.Array``, put on a device (or a sharding) batches ahead.

Public as ``shardkit.jax``. Importing it without JAX installed raises `MissingDependencyError` naming
``pip install 'shardkit[jax]'``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeAlias

import numpy as np

from shardkit.errors import AdapterError, one_line, require

require("jax", extra="jax", purpose="shardkit.jax (jax.Array batches on a device)")

import jax  # noqa: E402

from shardkit.dataset import Dataset  # noqa: E402
from shardkit.reader.adapters._loading import LoaderBase, open_loader  # noqa: E402
from shardkit.reader.adapters.collate import Collate, FieldPlan, plan_fields, prepare  # noqa: E402
from shardkit.reader.reader import Reader  # noqa: E402

Batch = dict[str, Any]
CollateFn = Callable[[dict[str, np.ndarray]], Mapping[str, Any]]
Target: TypeAlias = "jax.Device | jax.sharding.Sharding | None"

# what jax makes of the 64-bit dtypes with jax_enable_x64 off (its default); plan_fields(..., "jax") lets
# them pass, and `_narrowed` does this per batch
_NARROWED = {"int64": "int32", "uint64": "uint32", "float64": "float32"}


def x64_enabled() -> bool:
    """Whether jax keeps 64-bit values (``jax_enable_x64``); off, it silently narrows them to 32 bits."""
    return bool(jax.dtypes.canonicalize_dtype(np.int64) == np.int64)  # follows jax's x64 contexts too


def _x64_fix(name: str) -> str:
    return ("jax.config.update('jax_enable_x64', True) before making the loader keeps 64-bit values; or "
            f"leave {name!r} out with columns=[...], or map it into 32 bits with a collate function")


def resolve_device(device: str | jax.Device | None) -> jax.Device | None:
    """``device`` as a `jax.Device` of this process, or `AdapterError` (before anything is read).

    A string names a jax backend and an optional index among its devices: ``"cpu"``, ``"gpu:1"``,
    ``"cuda"``, ``"tpu:0"`` (no index: its first device).
    """
    if device is None:
        return None
    if isinstance(device, jax.Device):
        if device.process_index != jax.process_index():
            raise AdapterError(f"device={device!r} belongs to process {device.process_index}, not this one "
                               f"({jax.process_index()}); use one of jax.local_devices()")
        return device
    if not isinstance(device, str):
        raise AdapterError(f"device={device!r} is not a jax device; use a jax.Device, or a string such as "
                           "'cpu', 'gpu', 'gpu:1', 'tpu:0'")
    backend, _, index_text = device.lower().partition(":")
    if not index_text.isdigit() and index_text:
        raise AdapterError(f"device={device!r}: the index after ':' must be a number, as in 'gpu:1'")
    try:
        devices = jax.local_devices(backend=backend or None)
    except RuntimeError as e:  # an unknown backend, or one whose plugin is not installed
        raise AdapterError(f"device={device!r} does not exist here: {one_line(e)}; use device=None (jax's "
                           f"default, {jax.devices()[0]}) or one of {jax.local_devices()}") from e
    index = int(index_text or 0)
    if index >= len(devices):
        raise AdapterError(f"device={device!r} does not exist: jax sees {len(devices)} {backend} device(s) "
                           f"here, {backend}:0 to {backend}:{len(devices) - 1}")
    return devices[index]


def resolve_target(device: str | jax.Device | None, sharding: jax.sharding.Sharding | None) -> Target:
    """Where batches go: a device, a sharding, or None (jax's default device); `AdapterError` if neither
    can be served here."""
    if sharding is None:
        return resolve_device(device)
    if device is not None:
        raise AdapterError(f"make_loader got device={device!r} and sharding={sharding!r}; pass one of them "
                           "(a sharding says its devices)")
    if not isinstance(sharding, jax.sharding.Sharding):
        raise AdapterError(f"sharding={sharding!r} is not a jax.sharding.Sharding; use e.g. "
                           "NamedSharding(mesh, PartitionSpec('data'))")
    if not sharding.is_fully_addressable:
        raise AdapterError(
            f"sharding={sharding!r} spans devices of other processes; shardkit.jax puts each process's own "
            "batch: read shard=jax.process_index(), num_shards=jax.process_count() with a sharding over "
            "jax.local_devices(), or pass a collate function that calls "
            "jax.make_array_from_process_local_data")
    return sharding


def _check_sharding(sharding: jax.sharding.Sharding, plans: list[FieldPlan], batch_size: int) -> None:
    """Fields a batch sharding cannot split, named before anything is read."""
    for plan in plans:
        if plan.kind == "rows":
            raise AdapterError(
                f"field {plan.name!r} has a variable shape {plan.field.shape}: its rows are arrays of their "
                f"own shapes (Collate(variable='rows')), which sharding={sharding!r} cannot split; use "
                "Collate(variable='pad'), or leave it out with columns=[...]")
        if plan.kind == "dense":
            try:
                sharding.shard_shape((batch_size, *(int(d) for d in plan.field.shape if d is not None)))
            except ValueError as e:
                raise AdapterError(f"field {plan.name!r}, shape (batch_size={batch_size}, "
                                   f"*{plan.field.shape}), does not divide among sharding={sharding!r}: "
                                   f"{one_line(e)}; use a batch_size that divides among its devices") from e


def _puttable(value: Any) -> bool:
    """Whether jax takes ``value`` (numbers, or a list of per-row arrays); the rest stays on the host."""
    if isinstance(value, jax.Array):
        return True
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "biufc"
    if isinstance(value, list) and value:
        return all(v is None or _puttable(v) for v in value) and any(v is not None for v in value)
    return False


def _narrowed(key: str, value: Any) -> Any:
    """``value`` (an array, or a list of per-row arrays) with its 64-bit numbers as the 32-bit ones
    jax makes of them with ``jax_enable_x64`` off: integers only where every one fits (else
    `AdapterError` naming the field and the first that does not, where jax would wrap it), floats
    rounded to float32 as jax rounds them."""
    if isinstance(value, list):
        return [v if v is None else _narrowed(key, v) for v in value]
    if not isinstance(value, np.ndarray) or value.dtype.name not in _NARROWED:
        return value
    narrow = np.dtype(_NARROWED[value.dtype.name])
    if value.dtype.kind in "iu" and value.size:
        info = np.iinfo(narrow)
        if value.min() < info.min or value.max() > info.max:
            bad = value.ravel()[(value.ravel() < info.min) | (value.ravel() > info.max)][0]
            raise AdapterError(
                f"the batch's {key!r} holds {bad} ({value.dtype}), past the {narrow} that jax makes of "
                f"{value.dtype} with jax_enable_x64 off (as it is now: it would wrap to "
                f"{np.array(bad).astype(narrow)}); " + _x64_fix(key))
    return value.astype(narrow)


def to_jax(batch: Mapping[str, Any], target: Target, text_lists: bool = True) -> Batch:
    """The numbers of ``batch`` put on ``target`` in one ``jax.device_put``; text (object arrays) as
    lists (``text_lists=False``: as they are), other values as they are (see `make_loader`)."""
    tree = {k: v for k, v in batch.items() if _puttable(v)}
    if not x64_enabled():
        tree = {key: _narrowed(key, value) for key, value in tree.items()}
    try:
        put = jax.device_put(tree, target)
    except (ValueError, TypeError) as e:
        raise AdapterError(_put_error(tree, target, e)) from e
    out: Batch = {}
    for key, value in batch.items():
        if key in put:
            out[key] = put[key]
        elif text_lists and isinstance(value, np.ndarray) and value.dtype == object:
            out[key] = value.tolist()
        else:
            out[key] = value
    return out


def _put_error(tree: Mapping[str, Any], target: Target, error: Exception) -> str:
    """The message for a failed ``device_put``: the key whose value ``target`` does not take."""
    for key, value in tree.items():
        shape = getattr(value, "shape", None)
        if isinstance(target, jax.sharding.Sharding) and shape is not None:
            try:
                target.shard_shape(tuple(shape))
            except ValueError:
                return (f"the batch's {key!r}, shape {tuple(shape)}, does not divide among "
                        f"sharding={target!r} ({one_line(error)}); an epoch's last batch is short unless "
                        "drop_last=True or remainder='mask': pass remainder='mask' (every batch full, "
                        "masked rows marked in batch['__valid__']), drop_last=True, or a batch_size and "
                        "shard size that divide among its devices")
        if isinstance(target, jax.sharding.Sharding) and isinstance(value, list):
            return f"the batch's {key!r} is a list of per-row arrays, which sharding={target!r} cannot split"
    return f"jax.device_put of the batch to {target!r} failed: {one_line(error)}"


class Loader(LoaderBase):
    """A `Reader` whose batches are dicts of ``jax.Array``. Create with `make_loader`; see its docstring.

    Passes, ``len``, ``state_dict`` and ``load_state_dict`` are `LoaderBase`'s, as they are
    `shardkit.torch.Loader`'s; this class converts the batches and puts them on ``target``.
    """

    def __init__(self, reader: Reader, *, target: Target = None, prefetch: int = 2,
                 collate: Collate | CollateFn | None = None) -> None:
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise AdapterError(f"prefetch={prefetch!r} must be an int >= 0 (batches put on the device ahead "
                               "of the one in use; 0: none)")
        super().__init__(reader)
        self.target, self.prefetch = target, prefetch
        policy = Collate() if collate is None else collate
        self._text_lists = isinstance(policy, Collate)  # a function's values are its own choice
        if isinstance(policy, Collate):
            plans = plan_fields(reader.schema, policy, "jax")
            if isinstance(target, jax.sharding.Sharding):
                _check_sharding(target, plans, reader.batch_size)
            self._convert: Callable[[dict[str, np.ndarray]], Mapping[str, Any]] = (
                lambda b: prepare(plans, b, policy))
        elif callable(policy):
            self._convert = policy
        else:
            raise AdapterError(f"collate={collate!r} must be a shardkit Collate or a function of a batch")

    def __iter__(self) -> Iterator[Batch]:
        """One pass: batch k is handed out once batches k+1 .. k+prefetch were read and put (jax copies
        asynchronously, so their transfers run while batch k is computed on). The reader is then ahead of
        the user: the position the user has seen is kept for `state_dict`, and a pass that stops early
        puts the reader back there (no batch is lost between passes)."""
        return self._look_ahead(self._put, self.prefetch)

    def _put(self, batch: dict[str, np.ndarray]) -> Batch:
        return to_jax(self._convert(batch), self.target, self._text_lists)

    def __repr__(self) -> str:
        return f"Loader({self.reader!r}, target={self.target!r}, prefetch={self.prefetch})"


def make_loader(reader_or_url: Reader | str | os.PathLike[str] | Dataset, *,
                device: str | jax.Device | None = None, sharding: jax.sharding.Sharding | None = None,
                prefetch: int = 2, collate: Collate | CollateFn | None = None,
                **make_reader_kwargs: Any) -> Loader:
    """Batches of a reader as dicts of ``jax.Array``, put on a device or a sharding ``prefetch`` ahead.

    Example:
        >>> with shardkit.jax.make_loader("runs/digits", batch_size=64, columns=["pixels", "label"],
        ...                               drop_last=True) as loader:  # label: int64 -> int32 (x64 off)
        ...     for batch in loader:
        ...         params, loss = step(params, batch["pixels"], batch["label"])

    What flax's ``prefetch_to_device`` does for an iterator of numpy batches, with the reader's
    resume: each batch is put with one ``jax.device_put`` of its numeric fields, which returns at once
    and copies in the background, and batch k is handed out once batches k+1 .. k+``prefetch`` were
    read and put, so their transfers overlap the compute on batch k (at most ``prefetch`` + 1 batches
    are on the device besides the ones you keep). ``device=None`` puts them where ``jax.device_put``
    does (jax's default device, or a ``jax.default_device`` in effect), uncommitted; a device or
    ``sharding`` commits them there.

    What jax cannot hold follows the `Collate` policy: ``str`` / ``bytes`` fields stay on the host as
    lists (None for a null); variable shapes are a list of per-row arrays (``variable="rows"``, None for
    a null; each row its own shape, so a jitted function compiles once per shape) or one padded array
    plus ``<name>__mask`` (``variable="pad"``: still one shape per longest row of a batch); nullable
    fields add ``<name>__valid``. ``Collate.writable`` has no effect (jax arrays are never written).

    With ``remainder="mask"`` every batch has ``batch_size`` rows (one shape: one compilation) and a bool
    ``jax.Array`` ``batch["__valid__"]``, False on the masked rows that fill a shard's last batch; a masked
    mean loss: ``jnp.sum(loss * valid) / jnp.maximum(jnp.sum(valid), 1)``.

    64-bit values: jax keeps them only with ``jax_enable_x64`` on; off (jax's default) it narrows
    int64, uint64 and float64 to 32 bits without a word, which would wrap ids past 2**31. So, with x64
    off, the loader narrows them itself, as jax would, checking each batch: integers that fit become
    int32 / uint32, and one that does not fit raises `AdapterError` naming the field, the value and the
    options (turn x64 on, leave the field out, or map it in a collate function) instead of wrapping;
    float64 becomes float32, rounded as jax rounds it. With x64 on (read at each batch), 64-bit values
    stay 64-bit. uint16 and uint32 are kept (jax computes on them; torch does not). datetime64 needs a
    cast (units since the epoch).

    A pass (``for batch in loader``), ``len``, ``state_dict()`` / ``load_state_dict()`` and ``close``
    are those of `shardkit.torch.make_loader`: each pass is the next ``num_epochs`` epochs, the state
    counts the batches handed out (not those put ahead) and resumes at the next one, on the same or
    another number of shards.

    Args:
        reader_or_url: a `Reader`, or a dataset URL and ``make_reader_kwargs`` for `make_reader`.
        device: None (jax's default), a `jax.Device`, or a backend and index: "cpu", "gpu", "gpu:1",
            "tpu:0". One that does not exist here raises `AdapterError` before anything is read.
        sharding: instead of ``device``, a ``jax.sharding.Sharding`` of this process's devices, e.g.
            ``NamedSharding(mesh, PartitionSpec("data"))`` to split each batch among them. The batch
            size must divide among them, and so must an epoch's last batch: pass ``remainder="mask"``
            (every batch full) or ``drop_last=True``.
        prefetch: batches put on the device ahead of the one handed out (0: none).
        collate: a `Collate` policy (default ``Collate()``), or a function from a numpy batch to a dict:
            its numeric numpy arrays, jax arrays and lists of them are put like the others, other
            values are handed out as they are.

    Raises:
        AdapterError: a field jax cannot hold as it is (naming it and the options), a device or sharding
            that is not here, or reader options passed along with a `Reader`.
    """
    target = resolve_target(device, sharding)
    return open_loader(reader_or_url, make_reader_kwargs,
                       lambda reader: Loader(reader, target=target, prefetch=prefetch, collate=collate))


__all__ = ["Loader", "make_loader", "resolve_device", "resolve_target", "to_jax", "x64_enabled"]
