"""PyTorch adapter: reader batches as torch tensors, staged through reused pinned memory onto a CUDA device.

Public as ``shardkit.torch`` (with `ShardkitIterableDataset` from `shardkit.reader.adapters.torch_workers`).
Importing
it without torch installed raises `MissingDependencyError` naming ``pip install 'shardkit[torch]'``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from shardkit.errors import AdapterError, require

require("torch", extra="torch", purpose="shardkit.torch (PyTorch tensors and DataLoader workers)")

import torch  # noqa: E402

from shardkit.reader.adapters._loading import LoaderBase, open_loader  # noqa: E402
from shardkit.reader.adapters.collate import Collate, plan_fields, prepare  # noqa: E402
from shardkit.reader.reader import Reader  # noqa: E402

Batch = dict[str, Any]
CollateFn = Callable[[dict[str, np.ndarray]], Mapping[str, Any]]
_STAGING_SLOTS = 2  # pinned buffer sets: batch k+1 is staged while batch k is in use
_warned: set[str] = set()  # messages said once per process


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a `torch.device` that exists here, or `AdapterError` (before anything is read)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise AdapterError(f"device={device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:<index>'"
                           ) from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise AdapterError(f"device={device!r}: shardkit.torch copies batches to 'cpu' or 'cuda' devices; "
                           f"use device=None and move them to {dev.type!r} yourself")
    if not torch.cuda.is_available():
        raise AdapterError(f"device={device!r}, but this torch ({torch.__version__}) sees no CUDA device; "
                           "use device='cpu' (or None) on this machine")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise AdapterError(f"device={device!r} does not exist: this machine has {count} CUDA device(s), "
                           f"cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def _tensor(a: np.ndarray, writable: bool) -> torch.Tensor:
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    if a.flags.writeable:
        return torch.from_numpy(a)
    if writable:
        return torch.from_numpy(a.copy())
    with warnings.catch_warnings():  # "The given NumPy array is not writable": the caller chose to share it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def to_torch(prepared: Mapping[str, Any], writable: bool = True, text_lists: bool = True) -> Batch:
    """Arrays from `shardkit.reader.adapters.collate.prepare` as torch values (see `Collate` for the policy).

    ``text_lists=False`` leaves text as the reader's object arrays (a DataLoader worker's batch turns
    them into lists in the main process: see `shardkit.reader.adapters.torch_workers._WorkerBatch`).
    """
    out: Batch = {}
    for key, value in prepared.items():
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                out[key] = value.tolist() if text_lists else value
            else:
                out[key] = _tensor(value, writable)
        else:  # rows of a variable-shape field
            out[key] = [None if r is None else _tensor(r, writable) for r in value]
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a batch value: the tensor itself, or those in a list of row tensors. A list holds
    one kind of row (`Collate`: text, or tensors of a variable-shape field), so its first row tells."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list):
        first = next((v for v in value if v is not None), None)
        if isinstance(first, torch.Tensor):
            return [v for v in value if v is not None]
    return []

#: bytes: a larger tensor goes in chunks, each chunk's host copy overlapping the transfer of the one before.
#: Large, because a chunk's copy is split over the pool's threads, and pieces of a MiB or two cost nearly
#: as much in the threads' hand-offs as in copying (`benchmarks.gpu` measures the path)
_CHUNK = 64 << 20
_PARALLEL_MIN = 4 << 20  # bytes: a host copy is split over `_copy_pool`'s threads in pieces this large
#: one core copies into pinned memory several times slower than a PCIe 5 link takes it: many cores copy
_COPY_THREADS = min(16, os.cpu_count() or 1)
_PACK_MAX = 4 << 20  # bytes: tensors up to this size go together in one transfer per batch
_ALIGN = 64  # bytes: where each tensor of a packed batch starts (any dtype's view of it is aligned)


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="shardkit-pin")


# A forked child (a DataLoader worker) makes its own pool: the parent's would take its tasks and never run
# them, its threads being the parent's
os.register_at_fork(after_in_child=_copy_pool.cache_clear)


def _flat_bytes(value: torch.Tensor) -> np.ndarray | None:
    """A contiguous CPU tensor's bytes as a flat numpy uint8 view; None where numpy cannot view it."""
    if value.device.type != "cpu" or not value.is_contiguous():
        return None
    try:
        return value.detach().numpy().reshape(-1).view(np.uint8)
    except (TypeError, RuntimeError, ValueError):  # bfloat16 and other dtypes numpy has no name for
        return None


def _pinned_bytes(nbytes: int) -> np.ndarray:
    """Page-locked host memory from torch's caching host allocator, as a numpy array."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def _host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for two flat uint8 arrays; large ones in parallel pieces."""
    n = src.shape[0]
    parts = min(_COPY_THREADS, n // _PARALLEL_MIN)  # pieces of 4 MiB or more: a thread's wake-up is dear
    if parts < 2:
        np.copyto(dst, src)
        return
    step = -(-n // parts)
    pool = _copy_pool()
    pieces = [pool.submit(np.copyto, dst[a:a + step], src[a:a + step]) for a in range(0, n, step)]
    for piece in pieces:
        piece.result()


class _CudaStager:
    """Copies batches to a CUDA device: host tensors into reused pinned buffers, then ``non_blocking``
    copies on a side stream, so the copy of the next batch overlaps the compute on this one.

    Pinned slot ``i`` is rewritten only after the event of its previous copy has completed; device tensors
    are fresh (the caching allocator makes that cheap) and marked with ``record_stream`` for the stream that
    uses them, so neither host nor device memory is reused while a copy or a kernel still needs it.

    A shuffled batch is already in pinned memory (the loader asks its reader for it:
    `Reader.set_batch_memory`) and goes to the device without a host copy; the others are copied into the
    slot first. The host copy into the pinned slot is numpy's (`_host_copy`), not ``Tensor.copy_``:
    torch's CPU copy runs on its OpenMP pool, whose threads spin after every parallel region and took the
    cores the reader's own threads decode on (the loader then ran well below the reader's speed). A
    tensor larger than `_CHUNK` is copied chunk by chunk, each chunk sent as soon as it is in pinned
    memory, so the host copy of chunk k+1 overlaps the transfer of chunk k; a chunk is split over a few
    threads in pieces of `_PARALLEL_MIN` or more (numpy's copy releases the GIL). The tensors of a batch
    up to `_PACK_MAX` each go together: one pinned buffer, one transfer, the device tensors views of it
    (a transfer has a fixed CPU cost, whatever its size, and batches are usually a few small tensors).
    """

    def __init__(self, device: torch.device, slots: int = _STAGING_SLOTS) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self.done: list[torch.cuda.Event | None] = [None] * slots
        self.held: list[list[torch.Tensor]] = [[] for _ in range(slots)]  # pinned sources being copied
        self.slot = 0

    def _pinned(self, slot: int, key: str, nbytes: int) -> torch.Tensor:
        """Slot ``slot``'s pinned bytes for ``key``: at least ``nbytes``, reused while large enough."""
        buf = self.buffers[slot].get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[slot][key] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]

    def _send(self, slot: int, key: str, value: torch.Tensor) -> torch.Tensor:
        nbytes = value.numel() * value.element_size()
        pinned = self._pinned(slot, key, nbytes)
        src = _flat_bytes(value)
        if src is None:  # a dtype numpy has no name for (bfloat16), or strided: torch copies it
            staged = pinned.view(value.dtype).view(value.shape)
            staged.copy_(value)
            return staged.to(self.device, non_blocking=True)
        dst = pinned.numpy()
        if nbytes <= _CHUNK:
            _host_copy(dst, src)
            return pinned.view(value.dtype).view(value.shape).to(self.device, non_blocking=True)
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        for start in range(0, nbytes, _CHUNK):
            end = min(start + _CHUNK, nbytes)
            _host_copy(dst[start:end], src[start:end])
            out[start:end].copy_(pinned[start:end], non_blocking=True)
        return out.view(value.dtype).view(value.shape)

    def _send_packed(self, slot: int, parts: list[tuple[str, torch.Tensor, np.ndarray]]) -> Batch:
        """Small tensors of one batch in one pinned buffer and one transfer (a transfer has a fixed
        CPU cost whatever its size)."""
        offsets, total = [], 0
        for _, _, src in parts:
            offsets.append(total)
            total += -(-src.nbytes // _ALIGN) * _ALIGN
        pinned = self._pinned(slot, "", total)
        dst = pinned.numpy()
        for (_, _, src), start in zip(parts, offsets, strict=True):
            np.copyto(dst[start:start + src.nbytes], src)
        device = pinned.to(self.device, non_blocking=True)
        return {key: device[start:start + src.nbytes].view(value.dtype).view(value.shape)
                for (key, value, src), start in zip(parts, offsets, strict=True)}

    def stage(self, batch: Batch) -> tuple[Batch, torch.cuda.Event]:
        i = self.slot
        self.slot = (i + 1) % len(self.buffers)
        previous = self.done[i]
        if previous is not None:
            previous.synchronize()
        held = self.held[i] = []
        out: Batch = {}
        with torch.cuda.stream(self.stream):
            packed: list[tuple[str, torch.Tensor, np.ndarray]] = []
            for key, value in batch.items():
                if isinstance(value, torch.Tensor) and value.is_contiguous() and value.is_pinned():
                    # already page-locked (a shuffled batch: `Reader.set_batch_memory`): sent as it is, and
                    # kept alive (out of the reader's reuse) until this slot's copy is done
                    out[key] = value.to(self.device, non_blocking=True)
                    held.append(value)
                elif isinstance(value, torch.Tensor):
                    src = _flat_bytes(value)
                    if src is not None and src.nbytes <= _PACK_MAX:
                        packed.append((key, value, src))
                    else:
                        out[key] = self._send(i, key, value)
                elif _tensors(value):  # rows of varying shape: pageable, copied one by one
                    out[key] = [None if v is None else v.to(self.device) for v in value]
                else:
                    out[key] = value
            if packed:
                out.update(self._send_packed(i, packed))
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        self.done[i] = event
        return {key: out[key] for key in batch}, event

    def hand(self, staged: tuple[Batch, torch.cuda.Event]) -> Batch:
        out, event = staged
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)  # this batch's copy only: the next one keeps running on the side stream
        for value in out.values():
            for t in _tensors(value):
                t.record_stream(stream)
        return out


class Loader(LoaderBase):
    """A `Reader` whose batches are dicts of torch values. Create with `make_loader`; see its docstring.

    Passes, ``len``, ``state_dict`` and ``load_state_dict`` are `LoaderBase`'s; this class converts the
    batches and places them: each as it is read (`LoaderBase._look_ahead` at depth 0: host tensors,
    pinned ones, or a plain ``.to(device)``), or copied through `_CudaStager` one batch ahead (`_staged`).
    """

    def __init__(self, reader: Reader, *, device: torch.device | None = None, pin_memory: bool | None = None,
                 collate: Collate | CollateFn | None = None, _stager: Any = None) -> None:
        super().__init__(reader)
        self.device = device
        policy = Collate() if collate is None else collate
        if isinstance(policy, Collate):
            plans = plan_fields(reader.schema, policy, "torch")
            self._convert: Callable[[dict[str, np.ndarray]], Batch] = (
                lambda b: to_torch(prepare(plans, b, policy), policy.writable))
        elif callable(policy):
            self._convert = lambda b: dict(policy(b))
        else:
            raise AdapterError(f"collate={collate!r} must be a shardkit Collate or a function of a batch")
        cuda = device is not None and device.type == "cuda"
        pin = cuda if pin_memory is None else bool(pin_memory)
        if pin and not torch.cuda.is_available():
            _warn_no_pinning()
            pin = False
        self.pin_memory = pin
        self._stager = _stager if _stager is not None else (_CudaStager(device) if cuda and pin and device
                                                             else None)
        if isinstance(self._stager, _CudaStager):
            reader.set_batch_memory(_pinned_bytes)

    def __iter__(self) -> Iterator[Batch]:
        if self._stager is None:
            return self._look_ahead(lambda b: self._place(self._convert(b)), 0)
        return self._staged(self._stager)

    def _place(self, batch: Batch) -> Batch:
        if self.pin_memory and (self.device is None or self.device.type == "cpu"):
            return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if self.device is not None and self.device.type != "cpu":
            return {k: v.to(self.device) if isinstance(v, torch.Tensor)
                    else [None if r is None else r.to(self.device) for r in v] if _tensors(v) else v
                    for k, v in batch.items()}
        return batch

    def _staged(self, stager: Any) -> Iterator[Batch]:
        """Batch k is handed out only after batch k+1 is read and its copy issued: the reader is one batch
        ahead of the user, so the position the user has seen is kept for `state_dict`, and a pass that
        stops early puts the reader back there (no batch is lost between passes).

        Not `_look_ahead` at depth 1, which differs in two corners: that one marks the pass started before
        its first batch is put (this one after: a first batch that fails to convert or copy leaves a loaded
        pass in `state_dict`), and, stopped just after handing out the pass's last batch, it leaves the
        reader where the pass took it (this one loads back the position after that batch, which is behind
        it at the end of an uneven shard's epoch)."""
        self._rewind()
        self._generation += 1
        generation = self._generation
        self._seen = self.reader.state_dict()
        pending = None
        try:
            for batch in self._passes():
                staged = (stager.stage(self._convert(batch)), self.reader.state_dict())
                if pending is not None:
                    self._seen = pending[1]
                    yield stager.hand(pending[0])
                else:
                    self._started(generation)
                pending = staged
            # the passes end when this pass is over, or when a newer pass or a load_state_dict took the
            # reader: then the batch read ahead is not this pass's to hand out, nor its position to keep
            if pending is not None and generation == self._generation:
                self._seen = pending[1]
                yield stager.hand(pending[0])
            pending = None
            self._ended(generation)
        finally:
            if generation == self._generation:
                if pending is not None:
                    self._rewind()
                self._seen = None

    def __repr__(self) -> str:
        return f"Loader({self.reader!r}, device={self.device}, pin_memory={self.pin_memory})"


def _warn_no_pinning() -> None:
    if "pinning" not in _warned:
        _warned.add("pinning")
        warnings.warn("shardkit.torch: pin_memory=True, but torch sees no CUDA device here: pinning is off "
                      "and batches stay in ordinary host memory", UserWarning, stacklevel=4)


def make_loader(reader_or_url: Reader | str | Any, *, device: str | torch.device | None = None,
                pin_memory: bool | None = None, collate: Collate | CollateFn | None = None,
                **make_reader_kwargs: Any) -> Loader:
    """Batches of a reader as dicts of torch tensors, on the host or copied to a CUDA device.

    Example:
        >>> with shardkit.torch.make_loader("s3://bucket/train", shard=rank, num_shards=world,
        ...                                 batch_size=256, device="cuda") as loader:
        ...     for batch in loader:
        ...         loss = model(batch["image"].float() / 255).loss(batch["label"])

    On the host, fixed-shape numbers are zero-copy ``torch.from_numpy`` views of the reader's arrays
    (read-only ones are copied, see `Collate`). With a CUDA ``device``, each batch is copied into pinned
    buffers that are reused from batch to batch and sent with ``non_blocking=True`` on a side stream;
    batch k is handed out after the copy of batch k+1 has been issued, so that copy overlaps the compute
    on batch k. The tensors are then safe on the current stream (it waits for their copy; they carry
    ``record_stream``). Strings, bytes and variable shapes follow the `Collate` policy.

    With ``remainder="mask"`` every batch has ``batch_size`` rows and a ``torch.bool`` tensor
    ``batch["__valid__"]`` (False on the masked rows that fill a shard's last batch); a masked mean loss:
    ``(per_sample_loss * batch["__valid__"]).sum() / batch["__valid__"].sum().clamp(min=1)``.

    A pass (``for batch in loader``) yields ``num_epochs`` epochs from where the reader is (one, by
    default), and the next pass goes on from there: ``for epoch in range(3): for batch in loader:``
    reads three epochs, each shuffled anew. ``state_dict()`` / ``load_state_dict()`` are the reader's,
    counting the batches handed out (not those read ahead), plus the pass they are in: saved with a
    checkpoint, they resume at the next batch, with the same or a different number of shards; the
    next pass after ``load_state_dict`` is the rest of the saved pass, or a new one when the state was
    saved after its pass ended (see `Loader.load_state_dict`).

    Args:
        reader_or_url: a `Reader`, or a dataset URL and ``make_reader_kwargs`` for `make_reader`.
        device: None or "cpu" (host tensors), "cuda", "cuda:1", or a `torch.device`. A device that does
            not exist raises `AdapterError` before anything is read.
        pin_memory: stage through pinned memory; default True for a CUDA device. With a CPU device, True
            yields tensors in (fresh) pinned memory. Where torch sees no CUDA, it is turned off with a
            warning, once.
        collate: a `Collate` policy (default ``Collate()``), or a function from a numpy batch to a dict
            of torch values (tensors are then staged and copied like the others).

    Raises:
        AdapterError: a field torch cannot represent (naming it and the options), a device that does not
            exist, or reader options passed along with a `Reader`.
    """
    dev = resolve_device(device)
    return open_loader(reader_or_url, make_reader_kwargs,
                       lambda reader: Loader(reader, device=dev, pin_memory=pin_memory, collate=collate))


__all__ = ["Loader", "make_loader", "resolve_device", "to_torch"]
