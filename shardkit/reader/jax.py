"""JAX adapter: reader batches as dicts of ``jax.Array``, put on a device (or a sharding) batches ahead.

Public as ``shardkit.jax``. Importing it without JAX installed raises `MissingDependencyError` naming
``pip install 'shardkit[jax]'``.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeAlias

import numpy as np

from shardkit.errors import AdapterError, one_line, require

require("jax", extra="jax", purpose="shardkit.jax (jax.Array batches on a device)")

import jax  # noqa: E402

from shardkit.dataset.index import Dataset  # noqa: E402
from shardkit.dataset.schema import Schema  # noqa: E402
from shardkit.reader.api import make_reader  # noqa: E402
from shardkit.reader.collate import Collate, FieldPlan, Passes, plan_fields, prepare  # noqa: E402
from shardkit.reader.reader import Reader  # noqa: E402

Batch = dict[str, Any]
CollateFn = Callable[[dict[str, np.ndarray]], Mapping[str, Any]]
Target: TypeAlias = "jax.Device | jax.sharding.Sharding | None"

# dtypes jax holds as they are; with jax_enable_x64 off (its default) it narrows the 64-bit ones
_DTYPES_32 = frozenset({"bool", "uint8", "uint16", "uint32", "int8", "int16", "int32", "float16", "float32"})
_NARROWED = {"int64": "int32", "uint64": "uint32", "float64": "float32"}  # what jax makes of them, x64 off


def x64_enabled() -> bool:
    """Whether jax keeps 64-bit values (``jax_enable_x64``); off, it silently narrows them to 32 bits."""
    return bool(jax.dtypes.canonicalize_dtype(np.int64) == np.int64)  # follows jax's x64 contexts too


def _x64_fix(name: str) -> str:
    return ("jax.config.update('jax_enable_x64', True) before making the loader keeps 64-bit values; or "
            f"leave {name!r} out with columns=[...], or map it into 32 bits with a collate function")


def check_dtypes(schema: Schema, collate: Collate) -> None:
    """`AdapterError` for a field (or a cast target) jax has no dtype for; see `make_loader`.

    Runs before `plan_fields`, which checks the rest of the policy (pad values, key collisions), and
    leaves it a cast of a field the batches do not hold: it names those first. 64-bit fields pass,
    whatever ``jax_enable_x64`` says: with it off, each batch is narrowed and checked (`to_jax`).
    """
    if set(collate.cast) - set(schema.names):
        return
    held = _DTYPES_32 | set(_NARROWED)
    leave_out = "or leave it out with columns=[...] (the other fields)"
    for f in schema:
        if f.dtype.kind in "US":
            continue
        if f.name in collate.cast:
            try:
                target = np.dtype(collate.cast[f.name]) if collate.cast[f.name] is not None else None
            except TypeError:
                target = None  # plan_fields says it is not a dtype
            if target is None or target.name in held:
                continue
            raise AdapterError(f"Collate(cast=...) casts {f.name!r} to {target}, which jax does not hold; "
                               f"use one of {sorted(held)}")
        if f.dtype.name in held:
            continue
        hint = "int64 (or int32)" if f.dtype.kind in "mM" else "float32"
        raise AdapterError(f"field {f.name!r} is {f.dtype}, which jax has no dtype for; options: "
                           f"Collate(cast={{{f.name!r}: '<dtype>'}}) converts it (for this field: {hint}), "
                           f"{leave_out}")


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
                        "drop_last=True: pass drop_last=True, or a batch_size and shard size that divide "
                        "among its devices")
        if isinstance(target, jax.sharding.Sharding) and isinstance(value, list):
            return f"the batch's {key!r} is a list of per-row arrays, which sharding={target!r} cannot split"
    return f"jax.device_put of the batch to {target!r} failed: {one_line(error)}"


class Loader:
    """A `Reader` whose batches are dicts of ``jax.Array``. Create with `make_loader`; see its docstring."""

    def __init__(self, reader: Reader, *, target: Target = None, prefetch: int = 2,
                 collate: Collate | CollateFn | None = None) -> None:
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise AdapterError(f"prefetch={prefetch!r} must be an int >= 0 (batches put on the device ahead "
                               "of the one in use; 0: none)")
        self.reader, self.target, self.prefetch = reader, target, prefetch
        policy = Collate() if collate is None else collate
        self._text_lists = isinstance(policy, Collate)  # a function's values are its own choice
        if isinstance(policy, Collate):
            check_dtypes(reader.schema, policy)
            plans = plan_fields(reader.schema, policy, "tf")  # tf's dtypes: jax's were checked just above
            if isinstance(target, jax.sharding.Sharding):
                _check_sharding(target, plans, reader.batch_size)
            self._convert: Callable[[dict[str, np.ndarray]], Mapping[str, Any]] = (
                lambda b: prepare(plans, b, policy))
        elif callable(policy):
            self._convert = policy
        else:
            raise AdapterError(f"collate={collate!r} must be a shardkit Collate or a function of a batch")
        self._passes = Passes(reader)
        self._seen: dict[str, Any] | None = None  # the position the user has seen, while the reader is ahead
        self._generation = 0
        # the pass the position belongs to, as in shardkit.torch's Loader: {"pass": its start epoch,
        # "pass_done": whether it ended}; a loaded one stands until the next pass starts
        self._loaded_pass: dict[str, Any] | None = None
        self._pass_done = False

    @property
    def schema(self) -> Schema:
        return self.reader.schema

    def __len__(self) -> int:
        """Batches per epoch for this shard (the reader's ``len``)."""
        return len(self.reader)

    def __iter__(self) -> Iterator[Batch]:
        """One pass: batch k is handed out once batches k+1 .. k+prefetch were read and put (jax copies
        asynchronously, so their transfers run while batch k is computed on). The reader is then ahead of
        the user: the position the user has seen is kept for `state_dict`, and a pass that stops early
        puts the reader back there (no batch is lost between passes)."""
        self._rewind()
        self._generation += 1
        generation = self._generation
        self._seen = self.reader.state_dict() if self.prefetch else None
        ahead: deque[tuple[Batch, dict[str, Any] | None]] = deque()
        try:
            for i, batch in enumerate(self._passes()):
                if i == 0:
                    self._started(generation)
                ahead.append((to_jax(self._convert(batch), self.target, self._text_lists),
                              self.reader.state_dict() if self.prefetch else None))
                if len(ahead) > self.prefetch:
                    out, self._seen = ahead.popleft()
                    yield out
            # the passes end when this pass is over, or when a newer pass or a load_state_dict took the
            # reader: then the batches read ahead are not this pass's to hand out, nor their positions
            while ahead and generation == self._generation:
                out, self._seen = ahead.popleft()
                yield out
            if not ahead:
                self._ended(generation)
        finally:
            if generation == self._generation:
                if ahead:
                    self._rewind()
                self._seen = None

    def _started(self, generation: int) -> None:
        if generation == self._generation:
            self._loaded_pass, self._pass_done = None, False

    def _ended(self, generation: int) -> None:
        """The pass of ``generation`` ran to its end (not stopped, nor taken over by a newer one)."""
        if generation == self._generation:
            self._loaded_pass, self._pass_done = None, True

    def _rewind(self) -> None:
        if self._seen is not None:
            seen, self._seen = self._seen, None
            self.reader.load_state_dict(seen)

    def state_dict(self) -> dict[str, Any]:
        """The reader's state after the last batch handed out (not those put ahead), with the pass it
        belongs to (``"pass"``, ``"pass_done"``), as `shardkit.torch.Loader.state_dict` says."""
        state = dict(self._seen) if self._seen is not None else self.reader.state_dict()
        if self._loaded_pass is not None:
            state.update(self._loaded_pass)
        elif self._passes.start is not None:
            state.update({"pass": self._passes.start, "pass_done": self._pass_done})
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; a pass in progress ends. The next pass is the rest of the saved pass,
        or a new one if it was saved after its pass ended (see `shardkit.torch.Loader.load_state_dict`)."""
        started = state.get("pass") if isinstance(state, Mapping) else None
        if not isinstance(started, int) or isinstance(started, bool) or started < 0:
            started = None
        done = bool(state.get("pass_done")) if started is not None else False
        self._generation += 1
        self._passes.stop()
        self._seen = None
        self.reader.load_state_dict(state)
        self._passes.resumed(None if done else 0 if started is None else started)
        self._pass_done = False
        self._loaded_pass = None if started is None else {"pass": started, "pass_done": done}

    def close(self) -> None:
        self._generation += 1
        self._passes.stop()
        self._seen = None
        self.reader.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            size must divide among them, and so must an epoch's last batch: pass ``drop_last=True``.
        prefetch: batches put on the device ahead of the one handed out (0: none).
        collate: a `Collate` policy (default ``Collate()``), or a function from a numpy batch to a dict:
            its numeric numpy arrays, jax arrays and lists of them are put like the others, other
            values are handed out as they are.

    Raises:
        AdapterError: a field jax cannot hold as it is (naming it and the options), a device or sharding
            that is not here, or reader options passed along with a `Reader`.
    """
    target = resolve_target(device, sharding)
    if isinstance(reader_or_url, Reader):
        if make_reader_kwargs:
            raise AdapterError(f"make_loader got a Reader and reader options {sorted(make_reader_kwargs)}; "
                               "pass the options to make_reader, or pass a URL instead of a Reader")
        return Loader(reader_or_url, target=target, prefetch=prefetch, collate=collate)
    if not isinstance(reader_or_url, str | Dataset) and not hasattr(reader_or_url, "__fspath__"):
        raise AdapterError(f"make_loader needs a Reader or a dataset URL, got {type(reader_or_url).__name__}")
    reader = make_reader(reader_or_url, **make_reader_kwargs)
    try:
        return Loader(reader, target=target, prefetch=prefetch, collate=collate)
    except BaseException:
        reader.close()
        raise


__all__ = ["Collate", "Loader", "check_dtypes", "make_loader", "resolve_device", "resolve_target", "to_jax",
           "x64_enabled"]
