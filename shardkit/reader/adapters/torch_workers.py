"""`ShardkitIterableDataset`: a dataset for ``DataLoader(num_workers=k)``, one shard per worker of every rank.

Every DataLoader worker of every rank reads its own shard: ``shard = rank * k + worker``, ``num_shards =
world_size * k``, so the workers of all ranks read orthogonal slices whose union is the whole dataset,
once per epoch (with the reader's default ``remainder="drop"``, fewer than ``world_size * k`` samples
per epoch are left out, and every worker yields the same number of batches).

Resume (torchdata's ``StatefulDataLoader`` protocol: it calls ``state_dict()`` in each worker after every
batch, keeps the states of the batches it yielded, and hands each worker its state back through
``load_state_dict()`` before it iterates). What a resume guarantees:

- Same ``world_size`` and ``num_workers``: exact. Each worker continues its own shard at its next batch,
  and the DataLoader continues its round-robin over workers, so the stream goes on as if never stopped.
  Ranks step together, so worker ``w`` has read as many batches on every rank: loading rank 0's
  DataLoader state on every rank is as exact as loading each rank's own.
- A different ``world_size`` or ``num_workers``: convert the saved DataLoader state with `job_state` and
  load the result into the new dataset (``ds.load_state_dict(job_state(saved))``) before making the
  DataLoader. The DataLoader takes batches from its workers in turn, so after ``s`` steps the first
  ``s % num_workers`` workers have delivered one batch more than the others. `job_state` keeps what each
  worker delivered (``"workers"``: each worker's position, the same on every rank), and each new worker's
  reader resumes from a stage that says how many samples each old shard (``rank * num_workers +
  worker``) consumed (`_exact_state`): the rest of the epoch is exactly what no worker delivered, split
  among the new shards, and nothing is read twice.
- A plain ``DataLoader`` cannot hand worker states to the main process: resume it with ``num_workers=0``,
  or use torchdata's ``StatefulDataLoader``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Iterator, Mapping
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np

from shardkit.dataset import Dataset
from shardkit.errors import AdapterError, ReaderError, require
from shardkit.reader._plan import shard_ranges, total
from shardkit.reader.adapters.collate import Collate, Passes, jump_to_epoch, plan_fields, prepare
from shardkit.reader.adapters.torch import Batch, CollateFn, to_torch
from shardkit.reader.api import make_reader
from shardkit.reader.mixture import MixedReader
from shardkit.reader.reader import Reader

require("torch", extra="torch", purpose="shardkit.torch (PyTorch tensors and DataLoader workers)")

import torch  # noqa: E402

STATE_KIND = "shardkit.ShardkitIterableDataset"
_LAYOUT = ("world_size", "num_workers", "worker")
_ALIGN = 64  # each tensor of a packed batch starts at a multiple of this many bytes
_SEGMENT_ROUND = 1 << 20  # a worker's shared-memory segments are sized in whole MiB (plus the header)
_Slot = tuple[int, int, torch.dtype, tuple[int, ...]]  # a packed tensor's (start, bytes, dtype, shape)


class _Segments:
    """A DataLoader worker's shared-memory segments, each reused once the main process lets go of it.

    torch sends every batch through a new shared-memory segment: the worker creates and fills it
    (fresh pages, faulted in), and the main process fetches its file descriptor over a new,
    authenticated connection to the worker (``multiprocessing.resource_sharer``), then maps it. Making
    and filling a new segment, and the handover, cost more than reading the batch, so reusing segments
    makes a DataLoader with workers much faster. Each worker keeps up to `MAX_SEGMENTS` anonymous
    segments (``memfd_create``: no name, so nothing is left behind when a process dies). A segment's
    file descriptor goes to the main process once, with its first batch; the main process keeps it
    mapped (`_MAPPED`) and, when the last tensor of a batch is gone, marks the segment free in its first
    byte, and the worker fills it again. When none is free (the consumer holds on to batches), a batch
    goes the way torch sends it. Linux only (elsewhere every batch goes torch's way).
    """

    MAX_SEGMENTS = 6
    HEADER = 64  # bytes before a segment's data: byte 0 is 1 while the main process holds the batch

    def __init__(self) -> None:
        self.token = f"{os.getpid()}-{secrets.token_hex(8)}"  # tells this process's segments from others'
        self.segments: list[tuple[int, int, mmap.mmap]] = []  # (serial, size, mapping)
        self.dropped: list[int] = []  # serials closed here, for the main process to unmap
        self.unsent: dict[int, int] = {}  # serial -> file descriptor, of segments the main process lacks
        # batch_memory's arrays not sent yet: serial -> (address, bytes, what frees the segment)
        self.made: dict[int, tuple[int, int, weakref.finalize[Any, Any]]] = {}
        self._serial = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[int, int, mmap.mmap] | None:
        """A free segment of ``nbytes`` or more, marked in use: (serial, size, mapping); None when every
        segment is in use. Its file descriptor goes to the main process with the first batch sent in it
        (`handover`)."""
        with self._lock:
            free = [i for i, (_, size, mm) in enumerate(self.segments) if mm[0] == 0]
            for i in free:
                serial, size, mm = self.segments[i]
                if size >= self.HEADER + nbytes:
                    mm[0] = 1
                    return serial, size, mm
            if len(self.segments) >= self.MAX_SEGMENTS:
                if not free:
                    return None
                serial, _, mm = self.segments.pop(free[0])  # too small: make room for a larger one
                with contextlib.suppress(BufferError):  # a stale view of it in this process: unmapped later
                    mm.close()
                unsent = self.unsent.pop(serial, None)
                if unsent is None:
                    self.dropped.append(serial)
                else:  # the main process never had it
                    os.close(unsent)
            size = self.HEADER + -(-nbytes // _SEGMENT_ROUND) * _SEGMENT_ROUND
            fd = os.memfd_create("shardkit-batch", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
            except OSError:
                os.close(fd)
                raise
            self._serial += 1
            self.segments.append((self._serial, size, mm))
            self.unsent[self._serial] = fd
            mm[0] = 1
            return self._serial, size, mm

    def handover(self, serial: int) -> Any:
        """What the main process needs to map segment ``serial``: a ``DupFd`` the first time, then None."""
        with self._lock:
            fd = self.unsent.pop(serial, None)
        if fd is None:
            return None
        handle = DupFd(fd)
        os.close(fd)  # DupFd keeps its own duplicate until the main process takes it
        return handle

    def batch_memory(self, nbytes: int) -> np.ndarray | None:
        """A flat array of ``nbytes`` in a free segment, for a transformed batch to be made in
        (`Reader._set_output_memory`), or None when every segment is in use. Sent as it is
        (`_WorkerBatch`), the main process frees the segment when it drops the batch; a batch that never
        leaves this process (or that is sent by copy) frees it when its arrays are gone."""
        got = self.take(nbytes)
        if got is None:
            return None
        serial, _, mm = got
        flat = np.frombuffer(mm, np.uint8, nbytes, self.HEADER)
        start = flat.ctypes.data
        release = weakref.finalize(flat, _free_here, mm)
        with self._lock:
            self.made[serial] = (start, nbytes, release)
        return flat

    def made_in(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int, dict[str, _Slot]] | None:
        """(serial, bytes, layout) when every one of ``tensors`` is a contiguous view of the one segment a
        batch was made in (`batch_memory`): the batch is sent as it lies there; else None."""
        if not tensors:
            return None
        with self._lock:
            spans = list(self.made.items())
        first = next(iter(tensors.values())).data_ptr()
        for serial, (start, nbytes, release) in spans:
            if not start <= first < start + nbytes or not release.alive:
                continue
            layout: dict[str, _Slot] = {}
            end = 0
            for key, t in tensors.items():
                at, size = t.data_ptr() - start, t.numel() * t.element_size()
                if not t.is_contiguous() or at < 0 or at + size > nbytes:
                    return None
                layout[key] = (at, size, t.dtype, tuple(t.shape))
                end = max(end, at + size)
            with self._lock:
                self.made.pop(serial, None)
            release.detach()  # the main process frees it now
            return serial, end, layout
        return None

    def drained_drops(self) -> list[int]:
        with self._lock:
            out, self.dropped = self.dropped, []
            return out


_OWN: dict[int, _Segments] = {}  # this process's segments, by pid: a forked child makes its own
_MAPPED: dict[tuple[str, int], np.ndarray] = {}  # in the main process: the workers' segments, mapped
_MAPPED_LOCK = threading.Lock()


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, _Slot], int]:
    layout: dict[str, _Slot] = {}
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        layout[key] = (size, nbytes, t.dtype, tuple(t.shape))
        size += -(-nbytes // _ALIGN) * _ALIGN
    return layout, size


def _fill(dest: torch.Tensor, tensors: Mapping[str, torch.Tensor], layout: Mapping[str, _Slot],
          blobs: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
    for key, t in tensors.items():
        start, nbytes = layout[key][:2]
        if nbytes:
            dest[start:start + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    if blobs:
        out = memoryview(dest.numpy())  # type: ignore[arg-type]
        for key, (array, lengths) in blobs.items():
            at = layout[key][0]
            for value, n in zip(array.tolist(), lengths.tolist(), strict=True):
                if n > 0:
                    out[at:at + n] = value
                    at += n


_LENGTHS = "\x00lengths"  # a blob field's lengths in a packed batch's layout: its key + this


def _blob_lengths(array: np.ndarray) -> np.ndarray | None:
    """Per value of an object array, its length if it is bytes (-1: None); None if any is something else."""
    values = array.tolist()
    if not values or not all(type(v) is bytes or v is None for v in values):
        return None
    return np.fromiter((-1 if v is None else len(v) for v in values), np.int64, len(values))


def _blobs_out(data: torch.Tensor, lengths: torch.Tensor) -> list[bytes | None]:
    """The values of a packed blob field: bytes copied out of the segment (None where -1)."""
    view = memoryview(data.numpy())  # type: ignore[arg-type]
    out: list[bytes | None] = []
    at = 0
    for n in lengths.tolist():
        if n < 0:
            out.append(None)
        else:
            out.append(bytes(view[at:at + n]))
            at += n
    return out


class _WorkerBatch(dict[str, Any]):
    """A batch made in a DataLoader worker: it crosses to the main process as ONE shared-memory block.

    Pickling it (in the worker) copies its tensors into a reused segment of `_Segments` (or, when none
    is free, into one new shared-memory tensor, the copy torch's ``share_memory_`` would make anyway);
    it unpickles in the main process as a plain dict of tensors that are views of that block. Text comes
    as the reader's object arrays (keys in ``lists``) and becomes lists in the main process: DataLoader's
    ``default_convert`` passes an array through, but walks a list string by string (a Python step per
    string). A list of bytes (an encoded image field read with ``decode=False``: MiBs per batch) goes
    through the block too, and is copied out into bytes objects in the main process: through the
    DataLoader's pipe, pickled, it took 2-3x longer than the reading. Strings and row lists are
    pickled as usual. A transformed batch is made in a segment to begin with (the transform writes each
    sample's output there: `Reader._set_output_memory`, `_Segments.batch_memory`) and goes as it lies,
    without the copy: a worker then holds no batch of images of its own beside the segments.
    """

    def __init__(self, values: Mapping[str, Any], lists: frozenset[str] = frozenset()) -> None:
        super().__init__(values)
        self.lists = lists

    def __copy__(self) -> _WorkerBatch:  # DataLoader's default_convert copies the batch in the worker
        return _WorkerBatch(self, self.lists)

    def __reduce__(self) -> tuple[Any, ...]:
        tensors = {k: v for k, v in self.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
        others = {k: v for k, v in self.items() if k not in tensors}
        blobs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key in self.lists & others.keys():
            value = others[key]
            if isinstance(value, np.ndarray):
                lengths = _blob_lengths(value)
                if lengths is None:
                    others[key] = _Listed(value)
                else:
                    blobs[key] = (others.pop(key), lengths)
                    tensors[key + _LENGTHS] = torch.from_numpy(lengths)
        layout, size = _layout(tensors)
        for key, (_, lengths) in blobs.items():
            nbytes = int(lengths[lengths > 0].sum())
            layout[key] = (size, nbytes, torch.uint8, (nbytes,))
            size += -(-nbytes // _ALIGN) * _ALIGN
        if hasattr(os, "memfd_create"):
            own = _own_segments()
            if not blobs:  # made where it goes (a transformed batch): sent without a copy
                made = own.made_in(tensors)
                if made is not None:
                    serial, size, layout = made
                    seg_size = next(s for n, s, _ in own.segments if n == serial)
                    where = (own.token, serial, seg_size, own.handover(serial), own.drained_drops())
                    return _unpack_segment, (where, size, layout, others, list(self))
            got = own.take(size)
            if got is not None:
                serial, seg_size, mm = got
                view = np.frombuffer(mm, np.uint8, size, _Segments.HEADER)
                _fill(torch.from_numpy(view), tensors, layout, blobs)
                del view  # the mapping may be closed later only if nothing exports it
                where = (own.token, serial, seg_size, own.handover(serial), own.drained_drops())
                return _unpack_segment, (where, size, layout, others, list(self))
        packed = torch.empty(size, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
        _fill(packed, tensors, layout, blobs)
        return _unpack, (packed, layout, others, list(self))


def _unpack(packed: torch.Tensor, layout: Mapping[str, _Slot], others: Mapping[str, Any],
            order: list[str]) -> dict[str, Any]:
    """A packed `_WorkerBatch` as the plain dict of tensors (views of ``packed``) it was, keys in order."""
    out: dict[str, Any] = {}
    for key in order:
        if key + _LENGTHS in layout:
            start, nbytes = layout[key][:2]
            at, count, _, shape = layout[key + _LENGTHS]
            out[key] = _blobs_out(packed[start:start + nbytes], packed[at:at + count].view(torch.int64))
        elif key in layout:
            start, nbytes, dtype, shape = layout[key]
            out[key] = packed[start:start + nbytes].view(dtype).view(shape)
        else:
            value = others[key]
            out[key] = value.array.tolist() if isinstance(value, _Listed) else value
    return out


class _Listed:
    """A text array on its way to the main process, where it becomes a list."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        return _Listed, (self.array,)


def _release(segment: np.ndarray) -> None:
    segment[0] = 0  # the worker may fill it again


def _free_here(mm: mmap.mmap) -> None:
    """A segment a batch was made in, free again: the batch never left the worker (or went by copy)."""
    with contextlib.suppress(ValueError):  # closed already
        mm[0] = 0


def _own_segments() -> _Segments:
    pid = os.getpid()
    own = _OWN.get(pid)
    if own is None:
        _OWN.clear()  # a parent's, inherited through fork: its mappings are the parent's to use
        own = _OWN[pid] = _Segments()
    return own


def _unpack_segment(where: tuple[str, int, int, Any, list[int]], nbytes: int, layout: Mapping[str, _Slot],
                    others: Mapping[str, Any], order: list[str]) -> dict[str, Any]:
    """In the main process: a batch in a worker's segment, as a dict of tensor views.

    ``where``: the worker's token, the segment's serial and size, its file descriptor the first time
    (a ``DupFd``, else None), and the serials the worker has closed since.
    """
    token, serial, size, handle, dropped = where
    with _MAPPED_LOCK:
        for gone in dropped:
            _MAPPED.pop((token, gone), None)
        if handle is not None:
            fd = handle.detach()
            try:
                _MAPPED[(token, serial)] = np.frombuffer(mmap.mmap(fd, size), np.uint8)
            finally:
                os.close(fd)
            _forget_dead_workers(token)
        segment = _MAPPED.get((token, serial))
    if segment is None:
        raise AdapterError(f"a DataLoader worker sent a batch in shared-memory segment {serial} of {token}, "
                           "which this process never received; report this as a shardkit bug")
    data = segment[_Segments.HEADER:_Segments.HEADER + nbytes]  # its own object: freed with the last view
    weakref.finalize(data, _release, segment)
    return _unpack(torch.from_numpy(data), layout, others, order)


def _forget_dead_workers(current: str) -> None:
    """Unmap the segments of worker processes that have exited (non-persistent workers, each pass)."""
    for token in {t for t, _ in _MAPPED if t != current}:
        pid = int(token.split("-", 1)[0])
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        for key in [k for k in _MAPPED if k[0] == token]:
            del _MAPPED[key]


def _worker() -> tuple[int, int]:
    """(this DataLoader worker's id, the number of workers); (0, 1) outside a worker."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class ShardkitIterableDataset(torch.utils.data.IterableDataset[Batch]):
    """Batches of torch values for ``DataLoader(ds, batch_size=None, num_workers=k)``.

    Example:
        >>> ds = ShardkitIterableDataset("s3://bucket/train", batch_size=256, seed=42)  # rank from the job
        >>> loader = StatefulDataLoader(ds, batch_size=None, num_workers=2, pin_memory=True)
        >>> for epoch in range(10):
        ...     ds.set_epoch(epoch)
        ...     for batch in loader:
        ...         train_step(batch)

    The dataset yields whole batches (``batch_size`` is the reader's), so the DataLoader must not batch
    again: pass ``batch_size=None``. A pass over the DataLoader is ``num_epochs`` epochs (one, by
    default). Workers that are not persistent start from a copy of this object at every pass: call
    ``set_epoch(epoch)`` before each one (as with ``DistributedSampler``) so each epoch gets its own
    shuffle, or use ``persistent_workers=True``, where each worker's reader goes on to its next epoch.
    A persistent worker's copy is made once, when it starts: ``set_epoch`` reaches it then, and not
    later (calling it with each epoch in turn, as above, agrees with where its reader goes).
    See the module docstring for what resuming guarantees. In a worker, each batch crosses to the main
    process as one shared-memory block, its tensors views of it there (`_WorkerBatch`), in a segment the
    worker reuses once the main process has dropped the batch (`_Segments`): no new segment and no
    file-descriptor handover per batch. Tensors of a batch you keep hold their segment (at most
    `_Segments.MAX_SEGMENTS` per worker; beyond that, batches go torch's way, a segment each).

    Args:
        url: the dataset (any fsspec URL), or a dict of them: a mixture (``weights=`` and
            ``samples_per_epoch=`` then go with the reader options; see `make_reader`).
        rank: this process's rank; by default the job's (``RANK`` or an initialized
            ``torch.distributed``), else 0.
        world_size: the number of processes; by default the job's (``WORLD_SIZE``), else 1.
        collate: the `Collate` policy (default ``Collate()``) or a function from a numpy batch to a dict.
        **reader_kwargs: for `make_reader` (not ``shard``/``num_shards``: the dataset derives them). They
            are checked now, in this process, against the dataset.
    """

    def __init__(self, url: Any, *, rank: int | None = None, world_size: int | None = None,
                 collate: Collate | CollateFn | None = None, **reader_kwargs: Any) -> None:
        super().__init__()
        for key in ("shard", "num_shards"):
            if key in reader_kwargs:
                raise AdapterError(f"ShardkitIterableDataset got {key}=; pass rank= and world_size= instead "
                                   "(each DataLoader worker reads shard rank * num_workers + worker id)")
        with make_reader(url, shard=rank, num_shards=world_size, **reader_kwargs) as probe:
            self.rank, self.world_size, self.schema = probe.shard, probe.num_shards, probe.schema
            self.num_samples = probe.num_samples
            # Forked workers (and this process) read the dataset the probe opened: no second listing
            # or summary request per worker, which from a store is most of a worker's start (its
            # filesystem is made anew in the child, `Location._forked`). A table: every worker reads
            # the snapshot the probe saw, even if the table moves on before the workers start, and
            # deltalake's runtime does not survive a fork (it panics). Spawned workers open the URL
            # again (a table: at the probe's snapshot).
            self._opened: Dataset | None = None
            self._opened_pid = os.getpid()
            if isinstance(probe, MixedReader):  # a mixture's tables: their snapshots pinned by version
                pinned = {name: d.snapshot.version for name, d in probe.datasets.items() if d.snapshot}
                if pinned and reader_kwargs.get("version") is None:
                    reader_kwargs = {**reader_kwargs, "version": pinned}
            else:
                self._opened = probe.dataset
                if probe.dataset.snapshot is not None and reader_kwargs.get("version") is None:
                    reader_kwargs = {**reader_kwargs, "version": probe.dataset.snapshot.version}
        self.url, self.reader_kwargs = url, reader_kwargs
        self.collate: Collate | CollateFn = Collate() if collate is None else collate
        if isinstance(self.collate, Collate):
            self._plans = plan_fields(self.schema, self.collate, "torch")
        elif not callable(self.collate):
            raise AdapterError(f"collate={collate!r} must be a shardkit Collate or a function of a batch")
        self._epoch: int | None = None
        self._pending: dict[str, Any] | None = None  # a reader state to load when the reader is made
        self._pending_pass: int | None = None  # the epoch the pass of ``_pending`` started at, if known
        self._reader: Reader | None = None
        self._passes: Passes | None = None  # passes over _reader: a new pass ends the one before
        self._reader_pid = 0  # the process that made _reader (a forked worker must make its own)

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` in the next pass (from its start, or from where a worker's reader is in it).

        A state loaded with `load_state_dict` for an earlier epoch is dropped: workers that are not
        persistent start every pass from this object, and must not resume the same position twice.
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise AdapterError(f"set_epoch({epoch!r}) needs an int >= 0")
        if self._pending is not None and int(self._pending.get("epoch", epoch)) < epoch:
            self._pending = None
        self._epoch = epoch

    def shard_of(self, worker: int, num_workers: int) -> tuple[int, int]:
        """(shard, num_shards) that DataLoader worker ``worker`` of ``num_workers`` reads on this rank."""
        return self.rank * num_workers + worker, self.world_size * num_workers

    def _current_reader(self) -> tuple[Reader, Passes]:
        worker, workers = _worker()
        shard, num_shards = self.shard_of(worker, workers)
        reader, passes = self._reader, self._passes
        made = False  # a reader made now, in this process
        if reader is None or passes is None or self._reader_pid != os.getpid() or reader.shard != shard \
                or reader.num_shards != num_shards:
            if num_shards > self.num_samples:
                fits = max(1, self.num_samples // self.world_size)
                raise AdapterError(
                    f"DataLoader num_workers={workers} on {self.world_size} rank(s) makes {num_shards} "
                    f"shards (each rank's workers read shards rank * num_workers + worker), more than the "
                    f"{self.num_samples} samples of {self.url!r}, and every worker needs one; use "
                    f"num_workers <= {fits}" + (" (or fewer ranks)" if self.world_size > 1 else "")
                    + ", or num_workers=0 to read in the main process")
            try:
                if self._opened is not None:  # the dataset the probe opened, its schema= hints applied
                    kwargs = {k: v for k, v in self.reader_kwargs.items()
                              if k not in ("storage_options", "schema")}
                    reader = make_reader(self._opened, shard=shard, num_shards=num_shards, **kwargs)
                else:
                    reader = make_reader(self.url, shard=shard, num_shards=num_shards, **self.reader_kwargs)
            except ReaderError as e:
                raise AdapterError(f"DataLoader worker {worker} of num_workers={workers} on rank {self.rank} "
                                   f"of {self.world_size} reads shard {shard} of {num_shards}: {e}; fewer "
                                   "workers give each one more samples") from e
            passes = Passes(reader)
            self._reader, self._reader_pid, self._passes, made = reader, os.getpid(), passes, True
        if self._pending is not None:
            reader.load_state_dict(self._pending)
            if self._pending_pass is not None:  # the rest of the pass the state was saved in
                passes.resumed(self._pending_pass)
            self._pending, self._pending_pass = None, None
        elif self._epoch is not None and reader.state_dict()["epoch"] != self._epoch and (
                made or torch.utils.data.get_worker_info() is None):
            # In a persistent worker (one that outlives a pass), this object is the copy made when the
            # worker started: set_epoch() in the main process since then does not reach it. Its reader
            # is put at _epoch when it is made and goes on to its next epoch each pass (set_epoch()
            # called with each epoch in turn agrees); jumping back to the stale _epoch would replay it.
            jump_to_epoch(reader, self._epoch)
        return reader, passes

    def __iter__(self) -> Iterator[Batch]:
        reader, passes = self._current_reader()
        collate = self.collate
        in_worker = torch.utils.data.get_worker_info() is not None
        if in_worker and hasattr(os, "memfd_create") and not isinstance(reader, MixedReader):
            reader._set_output_memory(_own_segments().batch_memory)  # transformed batches: made in a segment
        text = frozenset(p.name for p in self._plans if p.kind == "text") if isinstance(collate, Collate) \
            else frozenset()
        for batch in passes():
            if isinstance(collate, Collate):
                values = to_torch(prepare(self._plans, batch, collate), collate.writable,
                                  text_lists=not in_worker)
                yield _WorkerBatch(values, text) if in_worker else values
            else:
                yield _WorkerBatch(collate(batch)) if in_worker else dict(collate(batch))

    def state_dict(self) -> dict[str, Any]:
        """This worker's position: its reader's state and its place in the layout (JSON-able)."""
        worker, workers = _worker()
        live = self._reader is not None and self._reader_pid == os.getpid() and self._pending is None
        reader_state = self._reader.state_dict() if live and self._reader is not None else self._pending
        started = self._passes.start if live and self._passes is not None else self._pending_pass
        return {"kind": STATE_KIND, "version": 1, "reader": reader_state, "epoch": self._epoch,
                "pass": started, "rank": self.rank, "world_size": self.world_size, "num_workers": workers,
                "worker": worker}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: a worker's own (same layout), one from `job_state`, or a reader state.

        A worker's state loads only into the same worker of the same layout (``world_size`` and
        ``num_workers``; any rank); convert it with `job_state` for another layout.
        """
        if not isinstance(state, Mapping):
            raise AdapterError(f"not a ShardkitIterableDataset state: {state!r:.200}")
        if state.get("kind") != STATE_KIND:  # a plain reader state (e.g. make_loader's): the job's position
            self._pending, self._pending_pass, self._epoch = self._in_order(state), None, None
            self._pin_table(self._pending)
            return
        if state.get("worker") is not None:
            worker, workers = _worker()
            mine = {"world_size": self.world_size, "num_workers": workers, "worker": worker}
            if any(state.get(k) != mine[k] for k in _LAYOUT):
                saved = {k: state.get(k) for k in _LAYOUT}
                raise AdapterError(
                    f"this dataset state was saved by DataLoader worker {saved}, and is loaded into worker "
                    f"{mine}; a worker's state resumes the same worker of the same world size and number of "
                    "workers. For another layout, load shardkit.torch.job_state(<saved DataLoader state>) "
                    "into the dataset before making the DataLoader"
                )
        self._pending = None if state.get("reader") is None else self._in_order(state["reader"])
        delivered = state.get("workers")
        if self._pending is not None and isinstance(delivered, Mapping):  # a job's: exactly what is left
            self._pending = _resume_state(delivered, self._pending, self.num_samples)
        self._pin_table(self._pending)
        started = state.get("pass")
        self._pending_pass = started if isinstance(started, int) and not isinstance(started, bool) else None
        self._epoch = state.get("epoch")
        if self._pending is None and self._epoch is None:
            self._epoch = 0  # saved before its worker read anything: the start of the first epoch

    def _in_order(self, reader_state: Mapping[str, Any]) -> dict[str, Any]:
        """A reader state, a mixture's with its sources in the order of this dataset's: the states a
        ``StatefulDataLoader`` collects from its workers come back with their keys in another order, and
        a mixture resumes only from its sources in its own order."""
        sources = reader_state.get("sources")
        if isinstance(self.url, Mapping) and isinstance(sources, Mapping) and set(sources) == set(self.url):
            return {**reader_state, "sources": {name: sources[name] for name in self.url}}
        return dict(reader_state)

    def _pin_table(self, reader_state: Mapping[str, Any] | None) -> None:
        """A table's reader state saved on another snapshot: open that snapshot here, once, for every
        worker (the workers' readers would each reopen it; a forked worker cannot run deltalake)."""
        saved = (reader_state or {}).get("snapshot")
        table = self._opened
        if table is None or table.snapshot is None or not isinstance(saved, Mapping):
            return
        version = saved.get("version")
        if not isinstance(version, int) or version == table.snapshot.version:
            return
        if table.snapshot.format == "delta" and os.getpid() != self._opened_pid:
            raise AdapterError(
                f"this DataLoader worker resumes the Delta table {table.url!r} on version {version} (the "
                f"dataset was made on version {table.snapshot.version}), and deltalake cannot run in a "
                "forked worker. Load the state into the dataset before making the DataLoader "
                "(dataset.load_state_dict(shardkit.torch.job_state(saved))), or make the DataLoader with "
                "multiprocessing_context='spawn'")
        self._opened = table.snapshot.reopen(version)
        if table.hints:
            from shardkit.dataset.hints import apply_hints

            self._opened = apply_hints(self._opened, table.hints)
        self.reader_kwargs = {**self.reader_kwargs, "version": version}
        if self._reader is not None and self._reader_pid == os.getpid():
            self._reader.close()
        self._reader, self._passes = None, None  # a reader of the other snapshot is made on the next pass

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)  # a reader (and its threads) never travels to a worker
        state["_reader"], state["_reader_pid"], state["_passes"] = None, 0, None
        state["_opened"] = None  # a spawned worker opens the dataset by its URL (a table: at its version)
        return state


def _dataset_states(obj: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(obj, Mapping):
        if obj.get("kind") == STATE_KIND:
            yield obj
            return
        for value in obj.values():
            yield from _dataset_states(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _dataset_states(value)


def _position(state: Mapping[str, Any]) -> tuple[int, list[Any]]:
    reader = state["reader"]
    if reader is None:
        return int(state.get("epoch") or 0), []
    return int(reader["epoch"]), [list(stage) for stage in reader["history"]]


def _delivered(states: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """What each DataLoader worker of the job delivered: ``{"world_size", "num_workers", "positions"}``,
    ``positions[w]`` worker ``w``'s ``{"epoch", "history"}`` (the same on every rank: ranks step
    together; where states of several ranks are given, the one furthest behind). None when the states do
    not hold every worker of one layout."""
    layouts = {(s.get("world_size"), s.get("num_workers")) for s in states if s.get("worker") is not None}
    if len(layouts) != 1:
        return None
    ((world_size, workers),) = layouts
    if not isinstance(world_size, int) or not isinstance(workers, int) or min(world_size, workers) < 1:
        return None
    positions = []
    for w in range(workers):
        mine = [s for s in states if s.get("worker") == w]
        if not mine:
            return None
        epoch, history = _position(min(mine, key=_position))
        positions.append({"epoch": epoch, "history": history})
    return {"world_size": world_size, "num_workers": workers, "positions": positions}


def _resume_state(job: Mapping[str, Any], behind: dict[str, Any], num_samples: int) -> dict[str, Any]:
    """Where the workers of ``job`` (`_delivered`) leave the epoch: exactly what none of them delivered
    (`_exact_state`), or, where that cannot be said, the position ``behind`` of those furthest behind."""
    exact = _exact_state(job, behind, num_samples)
    return behind if exact is None else exact


def _exact_state(job: Mapping[str, Any], behind: Mapping[str, Any], num_samples: int
                 ) -> dict[str, Any] | None:
    """The reader state that leaves out exactly what the workers of ``job`` (`_delivered`) delivered, or
    None where their positions are not one stage apart (then ``behind``, the position of those furthest
    behind, stands).

    Old shard ``rank * num_workers + w`` consumed what worker ``w`` consumed on rank 0 (ranks step
    together): the batches it delivered, in samples (on another rank's shorter piece, with ``uneven`` or
    ``mask``, the plan reads the count as the whole piece). A worker that finished the epoch consumed
    its whole piece. So the current stage becomes ``[num_shards, [count of each shard]]``, and the next
    stage splits among the new shards exactly what no worker delivered.
    """
    try:
        world_size, workers = int(job["world_size"]), int(job["num_workers"])
        positions = [(int(p["epoch"]), [(int(w), c) for w, c in p["history"]]) for p in job["positions"]]
        batch = int(behind["batch_size"])
        epoch = int(behind["epoch"])
    except (KeyError, TypeError, ValueError):
        return None
    num_shards = world_size * workers
    if len(positions) != workers or batch < 1 or epoch != min(e for e, _ in positions):
        return None
    current = [h for e, h in positions if e == epoch]
    if any(e != epoch and (e != epoch + 1 or h) for e, h in positions):
        return None  # a worker past the end of this epoch's stage: not one stage apart
    prefix: list[tuple[int, Any]] = []
    for stages in zip(*current, strict=False):
        if any(s != stages[0] for s in stages):
            break
        prefix.append(stages[0])
    if [(int(w), c) for w, c in behind["history"]][:len(prefix)] != prefix:
        return None
    first = shard_ranges(num_samples, shard=0, num_shards=num_shards, history=prefix, batch_size=batch,
                         remainder=behind["remainder"], drop_last=behind["drop_last"])
    longest = total(first)  # shard 0's piece: the longest
    counts = []
    for e, history in positions:
        tail = history[len(prefix):]
        if e != epoch:  # finished the epoch: its whole piece
            counts.append(longest)
        elif not tail:
            counts.append(0)
        elif len(tail) == 1 and tail[0][0] == num_shards and isinstance(tail[0][1], int):
            counts.append(min(longest, -(-tail[0][1] // batch) * batch))  # whole batches delivered
        else:
            return None
    per_shard = [counts[shard % workers] for shard in range(num_shards)]
    stage: list[Any] = [[num_shards, per_shard if len(set(per_shard)) > 1 else per_shard[0]]]
    history = [[w, c] for w, c in prefix] + (stage if any(per_shard) else [])
    return {**behind, "epoch": epoch, "history": history}


def job_state(saved: Any) -> dict[str, Any]:
    """The job's position from a saved DataLoader state: one state that loads into any layout.

    Example:
        >>> saved = torch.load("ckpt.pt")["data"]                # StatefulDataLoader.state_dict()
        >>> ds = ShardkitIterableDataset(url, batch_size=256)   # the new world size / num_workers
        >>> ds.load_state_dict(shardkit.torch.job_state(saved))
        >>> loader = StatefulDataLoader(ds, batch_size=None, num_workers=4)   # no load_state_dict here

    ``saved`` is anything holding the workers' dataset states (a ``StatefulDataLoader`` state, or a list of
    `ShardkitIterableDataset.state_dict` results) of one rank, or of several. The state holds what each
    worker delivered (``"workers"``), so the new workers read exactly what none of them delivered (see
    the module docstring), and the position of the workers furthest behind (``"reader"``), which a plain
    `Reader` or `make_loader` resumes from (reading again what the others delivered past it).
    """
    states = list(_dataset_states(saved))
    if not states:
        raise AdapterError(f"no ShardkitIterableDataset state found in {saved!r:.200}; pass the "
                           "StatefulDataLoader.state_dict() (or dataset state_dict()s) saved by the job")
    readers = [s["reader"] for s in states if s["reader"] is not None]
    same = {k: {repr(r.get(k)) for r in readers} for k in ("fingerprint", "seed", "shuffle", "batch_size")}
    if any(len(v) > 1 for v in same.values()):
        differ = [k for k, v in same.items() if len(v) > 1]
        raise AdapterError(f"the saved worker states disagree on {differ}; they come from different datasets "
                           "or jobs")
    behind = min(states, key=_position)
    if behind["reader"] is None and readers:  # a worker that delivered nothing yet: the start of its epoch
        epoch = _position(behind)[0]
        base = next((r for r in readers if int(r["epoch"]) == epoch), None)
        behind = {**behind, "reader": None if base is None else {**base, "epoch": epoch, "history": []}}
    out = {"kind": STATE_KIND, "version": 1, "reader": behind["reader"], "pass": behind.get("pass"),
           "epoch": _position(behind)[0], "job": True, "worker": None}
    delivered = _delivered(states)
    if delivered is not None:
        out["workers"] = delivered
    return out


__all__ = ["ShardkitIterableDataset", "job_state"]
