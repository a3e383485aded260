"""The adapters' collate policy: how a reader batch's fields become framework values (masks, padding, casts).

Framework-neutral: `plan_fields` checks a schema against a framework's dtypes once, up front (so an
unrepresentable field fails before anything is read), and `prepare` turns each numpy batch into the
arrays the torch, TensorFlow and JAX adapters wrap. Everything here is numpy; the frameworks are imported by
the adapters only.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from shardkit.dataset import Field, Schema
from shardkit.errors import AdapterError

if TYPE_CHECKING:
    from shardkit.reader.reader import Reader

VALID_SUFFIX = "__valid"  # nullable fields: bool (rows,), True where the row has a value
MASK_SUFFIX = "__mask"  # padded variable-shape fields: bool (rows, *variable dims), True on real elements

Framework = Literal["torch", "tf", "jax"]
Kind = Literal["dense", "text", "rows", "pad"]

# dtypes a framework represents fully (arithmetic, device copies); others need Collate(cast=...)
_SUPPORTED = {
    "torch": {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"},
    "tf": {"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16",
           "float32", "float64"},
    # jax holds the 32-bit ones; the 64-bit ones pass too, whatever jax_enable_x64 says: with it off the
    # jax loader narrows them itself per batch, as jax would, checking that integers fit (`shardkit.jax`)
    "jax": {"bool", "uint8", "uint16", "uint32", "int8", "int16", "int32", "float16", "float32",
            "int64", "uint64", "float64"},
}
_SUGGEST = {"uint16": "int32", "uint32": "int64", "uint64": "int64 (if the values fit) or float64"}


@dataclasses.dataclass(frozen=True)
class Collate:
    """How the adapters turn the reader's numpy batches into framework batches.

    Example:
        >>> loader = shardkit.torch.make_loader(url, collate=Collate(variable="pad", cast={"depth": "int32"}))

    The policy, per kind of field:

    - numbers and bools of a fixed shape (images included): one tensor ``(rows, *shape)`` of the field's
      dtype. torch shares the reader's memory (``from_numpy``) where it is writable; see ``writable``.
    - ``str`` / ``bytes``: torch gets a Python list (``None`` for a null); TensorFlow a ``tf.string``
      tensor (``""`` / ``b""`` for a null).
    - variable shapes (``None`` in the field's shape, images of varying size): ``variable="rows"`` keeps
      each row's own shape: a list of tensors in torch (``None`` for a null), a ``tf.RaggedTensor`` in
      TensorFlow (a null is an empty row). ``variable="pad"`` gives one dense tensor padded with
      ``pad_value`` to the largest row of the batch, plus ``<name>__mask``: bool ``(rows, *variable
      dims)``, True on real elements (only the variable dimensions: ``(rows, L)`` for a sequence).
    - nullable fields: also ``<name>__valid``, bool ``(rows,)``, True where the row has a value; a null
      number reads as 0. It is there in every batch, nulls or not, so the keys never change.
    - the reader's ``__valid__`` column (``remainder="mask"``: True for a sample, False for a masked row)
      is a bool field of the schema like any other: a bool tensor / array ``(rows,)`` in every batch.
    - ``cast``: ``{field: dtype}`` converts a field first, e.g. ``{"depth": "int32"}`` for uint16 data
      (torch has no arithmetic on uint16/32/64) or ``{"when": "int64"}`` for datetime64 (units since the
      epoch). A field a framework cannot represent without a cast fails when the adapter is created.
    - ``writable`` (torch only: TensorFlow's tensors are never written in place): True gives tensors that
      may be written in place: the reader's read-only buffers (Arrow memory: unshuffled reads, the
      memory-mapped cache) are copied, writable ones are shared. False shares everything (no copy);
      writing into a read-only one is undefined (it can crash on a memory-mapped cache).
    """

    variable: Literal["rows", "pad"] = "rows"
    pad_value: float = 0
    cast: Mapping[str, str] = dataclasses.field(default_factory=dict)
    writable: bool = True

    def __post_init__(self) -> None:
        if self.variable not in ("rows", "pad"):
            raise AdapterError(f"Collate(variable={self.variable!r}) must be 'rows' or 'pad'")
        if not isinstance(self.cast, Mapping):
            raise AdapterError(f"Collate(cast={self.cast!r}) must be a dict of field name -> dtype")

    def __hash__(self) -> int:
        return hash((self.variable, self.pad_value, tuple(sorted(self.cast.items())), self.writable))


@dataclasses.dataclass(frozen=True)
class FieldPlan:
    """What one field becomes: its kind, output dtype and extra keys (``__valid``, ``__mask``)."""

    field: Field
    kind: Kind
    dtype: np.dtype[Any]
    nullable: bool

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def variable_dims(self) -> list[int]:
        return [i for i, d in enumerate(self.field.shape) if d is None]


def _target(field: Field, collate: Collate, framework: Framework) -> np.dtype[Any]:
    options = (f"options: Collate(cast={{{field.name!r}: '<dtype>'}}) converts it, or leave it out with "
               "columns=[...] (the other fields)")
    if field.name in collate.cast:
        if field.dtype.kind in "US":
            raise AdapterError(f"Collate(cast=...) names the {field.dtype_name} field {field.name!r}; "
                               "only number, bool and datetime fields can be cast")
        try:
            if collate.cast[field.name] is None:  # np.dtype(None) would be float64
                raise TypeError("None is not a dtype")
            target = np.dtype(collate.cast[field.name])
        except TypeError as e:
            raise AdapterError(f"Collate(cast={{{field.name!r}: {collate.cast[field.name]!r}}}) is not a "
                               "numpy dtype; use e.g. 'int32' or 'float32'") from e
        if target.name not in _SUPPORTED[framework]:
            lacks = "does not hold" if framework == "jax" else "does not support either"
            raise AdapterError(f"Collate(cast=...) casts {field.name!r} to {target}, which {framework} "
                               f"{lacks}; use one of {sorted(_SUPPORTED[framework])}")
        return target
    if field.dtype.kind in "US" or field.dtype.name in _SUPPORTED[framework]:
        return field.dtype
    if framework == "jax":  # jax holds every uint: what it lacks is datetimes and the like
        hint = "int64 (or int32)" if field.dtype.kind in "mM" else "float32"
        raise AdapterError(
            f"field {field.name!r} is {field.dtype}, which jax has no dtype for; options: Collate(cast="
            f"{{{field.name!r}: '<dtype>'}}) converts it (for this field: {hint}), or leave it out with "
            "columns=[...] (the other fields)")
    hint = _SUGGEST.get(field.dtype.name, "int64" if field.dtype.kind in "mM" else "float32")
    why = ("has no arithmetic on it" if field.dtype.kind in "u" else "has no such dtype")
    raise AdapterError(
        f"field {field.name!r} is {field.dtype}, which {framework} {why}; {options} (for this field: "
        f"{hint})"
    )


def plan_fields(schema: Schema, collate: Collate, framework: Framework) -> list[FieldPlan]:
    """Check every field of ``schema`` for ``framework`` and say what each becomes; raise `AdapterError`."""
    unknown = sorted(set(collate.cast) - set(schema.names))
    if unknown:
        raise AdapterError(f"Collate(cast=...) names {unknown}, which the batches do not hold; their "
                           f"fields are {schema.names}")
    plans = []
    for f in schema:
        dtype = _target(f, collate, framework)
        if f.dtype.kind in "US":
            kind: Kind = "text"
        elif f.fixed_shape:
            kind = "dense"
        else:
            kind = collate.variable if collate.variable == "pad" else "rows"
        plans.append(FieldPlan(f, kind, dtype, f.nullable))
        if kind == "pad":
            _check_pad_value(f.name, dtype, collate.pad_value)
    names = set(schema.names)
    for p in plans:
        for key in output_extras(p):
            if key in names:
                raise AdapterError(f"field {key!r} collides with the {key.rsplit('__', 1)[1]} key the "
                                   f"adapter adds for {p.name!r}; rename one of them, or leave one out "
                                   "with columns=[...]")
    return plans


def _check_pad_value(name: str, dtype: np.dtype[Any], value: float) -> None:
    """``value`` must be one of ``dtype``'s (padding is written with it), or `AdapterError`."""
    try:
        held = np.array(value, dtype=dtype)
        same = bool(held == value) or (dtype.kind == "f" and bool(np.isnan(held)) and bool(np.isnan(value)))
    except (OverflowError, TypeError, ValueError):
        same = False
    if not same:
        raise AdapterError(f"Collate(pad_value={value!r}) is not a value of field {name!r} ({dtype}), "
                           "which is padded with it; use one it holds (e.g. 0), or cast the field to a dtype "
                           f"that holds it: Collate(cast={{{name!r}: '<dtype>'}}, pad_value={value!r})")


def output_extras(plan: FieldPlan) -> list[str]:
    """The keys an adapter adds for ``plan`` beside its own (in output order)."""
    extras = [plan.name + MASK_SUFFIX] if plan.kind == "pad" else []
    return [*extras, plan.name + VALID_SUFFIX] if plan.nullable else extras


def _valid_rows(values: np.ndarray, n: int) -> np.ndarray:
    if isinstance(values, np.ma.MaskedArray):
        mask = np.ma.getmaskarray(values).reshape(n, -1)
        return np.asarray(~mask.any(axis=1)) if mask.shape[1] else np.ones(n, dtype=bool)
    if values.dtype == object:
        return np.fromiter((v is not None for v in values), dtype=bool, count=n)
    return np.ones(n, dtype=bool)


def _cast(values: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    return values if values.dtype == dtype else values.astype(dtype)


def _pad(plan: FieldPlan, rows: Sequence[np.ndarray | None], pad_value: float
         ) -> tuple[np.ndarray, np.ndarray]:
    """Rows of varying shape as one dense array padded to the largest, and the mask of real elements."""
    shape = plan.field.shape
    var = plan.variable_dims
    present = [r for r in rows if r is not None]
    largest = [max((r.shape[i] for r in present), default=0) if d is None else d for i, d in enumerate(shape)]
    out = np.full((len(rows), *largest), pad_value, dtype=plan.dtype)
    mask = np.zeros((len(rows), *(largest[i] for i in var)), dtype=bool)
    for i, r in enumerate(rows):
        if r is None:
            continue
        out[(i, *(slice(0, s) for s in r.shape))] = r  # type: ignore[index]
        mask[(i, *(slice(0, r.shape[d]) for d in var))] = True  # type: ignore[index]
    return out, mask


def prepare(plans: Sequence[FieldPlan], batch: Mapping[str, np.ndarray], collate: Collate) -> dict[str, Any]:
    """One reader batch as the arrays an adapter wraps, in plan order (extras after their field).

    ``dense``: an ndarray of the output dtype (the reader's own array when nothing changes); ``text``:
    the reader's object array of str/bytes/None; ``rows``: a list of per-row arrays (None for a null);
    ``pad``: the padded array, then its mask.
    """
    out: dict[str, Any] = {}
    for plan in plans:
        values = batch[plan.name]
        n = len(values)
        valid = _valid_rows(values, n) if plan.nullable else None
        if plan.kind == "dense":
            data = values.filled(0) if isinstance(values, np.ma.MaskedArray) else values
            out[plan.name] = _cast(data, plan.dtype)
        elif plan.kind == "text":
            out[plan.name] = values
        else:
            rows = [None if r is None else _cast(np.asarray(r), plan.dtype) for r in values]
            if plan.kind == "rows":
                out[plan.name] = rows
            else:
                out[plan.name], out[plan.name + MASK_SUFFIX] = _pad(plan, rows, collate.pad_value)
        if valid is not None:
            out[plan.name + VALID_SUFFIX] = valid
    return out


class Passes:
    """Passes over one reader, as every adapter iterates it; a new pass ends the one before.

    A pass is ``num_epochs`` epochs (None: forever) from where the reader is, so ``for epoch in
    range(3): for batch in adapter:`` reads three epochs, each shuffled anew (a plain `Reader` yields
    nothing once its ``num_epochs`` are done) — except the first pass after `resumed` (a checkpoint
    restore through the adapter's ``load_state_dict``), which reads only the epochs left of
    ``num_epochs``, as the `Reader` would. With ``fresh=True`` (tf.data, whose iterators are
    restartable descriptions that Keras and prefetching create and drop), every pass after the first
    that finds the reader inside an epoch starts the next epoch from its beginning instead: a dropped
    iterator then costs some reading, never the rest of an epoch. Thread-safe: tf.data runs
    generators on its own threads, and the batch a pass takes and its position are one step.
    """

    def __init__(self, reader: Reader, *, fresh: bool = False) -> None:
        self.reader, self.fresh = reader, fresh
        self._lock = threading.Lock()
        self._token = 0
        self._resume_from: int | None = None  # the start epoch of the pass the next one resumes (`resumed`)
        self.start: int | None = None  # the epoch the current pass started at (None: no pass yet)

    def resumed(self, started: int | None = 0) -> None:
        """The reader was just restored from a checkpoint taken in a pass that started at epoch
        ``started``: the next pass reads only what is left of that one, up to epoch ``started +
        num_epochs`` (by default the epochs left of ``num_epochs`` counted from epoch 0, as a `Reader`
        counts them), so a job restarted from its last checkpoint does not train ``num_epochs`` more
        epochs, and a checkpoint taken after the pass's last batch resumes with nothing left. Later
        passes are relative again. ``started=None`` undoes a ``resumed`` not yet used: the next pass
        is a new one."""
        with self._lock:
            self._resume_from = started

    def stop(self) -> None:
        """End the pass in progress (at its next batch)."""
        with self._lock:
            self._token += 1

    def __call__(self) -> Iterator[dict[str, np.ndarray]]:
        reader = self.reader
        with self._lock:
            self._token += 1
            token = self._token
            state = reader.state_dict() if self.fresh and token > 1 else {}
            if state.get("history"):
                jump_to_epoch(reader, int(state["epoch"]) + 1)
            started, self._resume_from = self._resume_from, None
            self.start = reader.epoch if started is None else started
            until = None if started is None or reader.num_epochs is None else started + reader.num_epochs
        done = 0
        while reader.num_epochs is None or (reader.epoch < until if until is not None
                                            else done < reader.num_epochs):
            epoch = reader.iter_epoch()
            while True:
                with self._lock:
                    if token != self._token:  # a newer pass owns the reader
                        return
                    batch = next(epoch, None)
                if batch is None:
                    break
                yield batch
            done += 1


def jump_to_epoch(reader: Reader, epoch: int) -> None:
    """Move ``reader`` to the start of ``epoch``: its own state with that epoch and no position in it."""
    state = reader.state_dict()
    state["epoch"], state["history"] = epoch, []
    state.pop("lead", None)  # the leads of the state's epoch, not of the one it starts
    reader.load_state_dict(state)


__all__ = ["MASK_SUFFIX", "VALID_SUFFIX", "Collate", "FieldPlan", "Passes", "jump_to_epoch", "plan_fields",
           "prepare"]
