"""The transform stage: a user's function on every sample of a batch, seeded from (seed, epoch, sample
key), in a thread of this process or in worker processes that hand batches back through shared memory.

`SampleStage` takes a reader's batches (dicts of numpy columns) and returns futures of the transformed
ones, in the order they were submitted and with their rows in input order (less the samples left out
under ``on_error="skip"``). Per batch it runs ``prepare`` (the reader's decoding: small handle columns
in, decoded numpy columns out) once, then ``fn`` once per sample, then stacks each output field into
one array.

Seeding. Before each call of ``fn`` the stage seeds, from splitmix64 hashes of (seed, epoch, key):
the `numpy.random.Generator` it passes as ``rng`` (a PCG64 whose whole 128-bit state and increment
come from the hash; the generator is for the call: a new one is made for every sample), Python's
`random`, numpy's legacy global generator (``np.random.seed``) and, when ``torch`` is already imported,
torch's default CPU generator. ``key`` is the sample's number in the dataset's order (among the rows
read), the same whatever the epoch's order, the number of shards, workers or batches, so the same
sample gets the same random draws in an epoch on a resumed or resized run.
Each generator gets its own hash (no two libraries share a stream). Setting
a PCG64's state costs about a microsecond where building a generator from a seed sequence costs ten;
seeding Python's and the legacy Mersenne twisters (and torch's) costs a few more, per sample.
numpy's legacy generator and torch's take 32 bits of seed (a 64-bit seed costs numpy's five times
more), so among some 65,000 samples two likely share those draws; ``rng`` (128 bits of state) is the
generator to draw from, the global ones are seeded for transforms written against them
(torchvision's).
In the calling process (``processes=0``) the global generators' states are saved before a batch
and restored after it: the training's own draws from them go on where they were (draws made by
another thread while a batch is being transformed may come from the transform's streams; worker
processes, ``processes > 0``, never touch the training process's generators).

``fn(sample)`` or ``fn(sample, rng)``: decided once, from the signature. ``rng`` is passed when ``fn``
has a second positional parameter without a default (or one named ``rng``), or a keyword parameter
named ``rng`` (then as ``rng=``). ``sample`` maps each column's name to the row's value (an image
field: its HxWxC uint8 array, a view of the batch; a null: None); ``fn`` returns a dict, with the same
keys or others.

Output. Per output field the samples' values are stacked into one array: the first sample the stage
sees sets each field's row shape and dtype, for every later batch too, and a sample that gives
another is an error naming the field, both shapes and dtypes, both samples and the fix. Fields named
in ``variable`` (or all, ``variable=True``) are instead 1-D object arrays of the samples' values, as
are fields of ``str`` or ``bytes`` values. ``torch.Tensor`` values become numpy arrays (``.numpy()``,
no copy: an adapter makes tensors again with ``torch.from_numpy``), scalars 0-d arrays (a field of
scalars is a 1-D array), anything else (a PIL image, a list) goes through ``np.asarray``.

Processes. ``processes=0``: one thread of this process runs the batches, one at a time (the reader
already prepares batches ahead). ``processes=N``: N worker processes, started when the stage is made,
so the first batch does not wait for them. A batch is cut into N slices of consecutive rows; each
worker runs ``prepare`` and ``fn`` on its slice and writes its rows straight into a shared-memory
segment (an anonymous ``memfd`` on Linux, so nothing is left in ``/dev/shm`` even if the process is
killed), which this process maps as the batch's arrays without a copy. Segments are reused: a
segment is free again once nothing refers to the arrays of its batch (the reference count check of
`batching.Recycler`), so a batch the user still holds keeps its memory, and free segments are kept
for the next batches (at most a few). The first batch, whose field shapes are not known yet, goes
to segments the workers make themselves (their file descriptors passed back over the pipe), and is
copied once into one of the stage's. Fields that cannot be shared so (object arrays, masked arrays
from ``prepare``) come back pickled through the pipe.

``stats``: ``batches``, ``samples`` (handed out), ``skipped_samples`` (left out: ``fn`` raised under
``"skip"``, or ``prepare`` left them out), ``seconds_busy`` (in ``prepare`` and ``fn``, summed over
workers), ``seconds_prepare``, ``seconds_waited`` (from a batch's start to its result, in this
process) and ``worker_restarts``.

Workers start with the ``fork`` method where the platform has it, as torch's DataLoader does: the
child gets the parent's modules already imported (no second import of numpy, torch or the decoder) and
starts in milliseconds. A forked child has only the thread that forked it; a lock another thread held
at that moment stays held in the child, so the worker runs nothing but its loop, the user's ``fn`` and
``prepare``: a transform that itself uses a library's thread pool (pyarrow's, OpenMP) in a process
that forked while that pool was busy can hang, which ``timeout`` then bounds (``start_method="spawn"``
or ``"forkserver"`` avoids it, at the cost of a start that imports ``fn``'s modules again). The worker
sets torch to one thread (as a DataLoader worker does: N workers times M threads oversubscribe the
cores), ignores SIGINT (Ctrl-C stops the parent, which stops the workers) and exits when its parent
is gone. A daemonic process (a torch DataLoader worker) cannot have worker processes: use
``processes=0`` there, the DataLoader's workers being the parallelism.

Errors. ``fn`` must be picklable when ``processes > 0`` (checked when the stage is made, for every
start method, so that code that works on Linux works on macOS). ``fn`` raising: ``on_error="raise"``
fails the batch with a `TransformError` naming the sample, with the original exception chained (from
a worker: with the worker's traceback text); ``"skip"`` leaves the sample out of its batch (counted in
``stats["skipped_samples"]``, warned once). A return that is not a dict, or a field that does not
stack, always fails the batch (it is the transform's contract, no sample's fault). A batch that takes
longer than ``timeout`` seconds, or a worker that dies (a segfault, the OOM killer), fails the batch
with a `TransformError` saying so; the workers are then killed and started again, and later batches
run on the new ones.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import mmap
import multiprocessing
import os
import pickle
import random
import signal
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import connection as mp_connection
from multiprocessing import reduction
from typing import Any, Literal

import numpy as np

from shardkit.errors import ReaderError, TransformError, one_line
from shardkit.reader._pipeline.batching import ALIGN, Columns, Recycler, concat, num_rows

_GOLDEN = 0x9E3779B97F4A7C15
_KEEP_FREE_SEGMENTS = 4  # free shared-memory segments kept for the next batches, per stage
_HANDED_OUT = 16  # batches in shared memory the user may hold (plus 2 per worker); the later are copied
_KEEP_FREE_BYTES = 64 << 20  # free output arrays kept for the next batches (processes=0): about one
_STOP_GRACE = 1.0  # seconds closing workers get to exit before they are killed

# A field's kind: ("array", row shape, dtype) stacks into one array; ("object",) is a 1-D object array.
Kind = tuple[Any, ...]
Spec = dict[str, Kind]


# -- seeding ------------------------------------------------------------------------------------------


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic: numpy arrays do not warn)."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def sample_seeds(seed: int, epoch: int, keys: np.ndarray) -> np.ndarray:
    """Per sample, seven 64-bit words hashed from (seed, epoch, key): the generator's PCG64 state (2)
    and increment (2), then Python's `random`, numpy's legacy global generator and torch's.

    Example:
        >>> w = sample_seeds(0, 1, np.array([5, 5, 6]))
        >>> w.shape, bool((w[0] == w[1]).all()), bool((w[0] == w[2]).any())
        ((3, 7), True, False)
    """
    head = _mix(np.array([seed % (1 << 64)], np.uint64))
    head = _mix(head ^ np.array([epoch % (1 << 64)], np.uint64))
    k = _mix(head ^ np.asarray(keys).astype(np.int64).view(np.uint64))
    steps = np.arange(1, 8, dtype=np.uint64) * np.uint64(_GOLDEN)
    return _mix(k[:, None] ^ steps[None, :])


class _Seeder:
    """Seeds the generators before each call of ``fn``; one per thread or worker."""

    def __init__(self) -> None:
        self.bits = np.random.PCG64(0)

    def seed(self, w: list[int]) -> np.random.Generator:
        self.bits.state = {"bit_generator": "PCG64", "state": {"state": (w[0] << 64) | w[1],
                           "inc": (w[2] << 64) | w[3] | 1}, "has_uint32": 0, "uinteger": 0}
        random.seed(w[4])
        np.random.seed(w[5] & 0xFFFFFFFF)
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.default_generator.manual_seed(w[6])
        return np.random.Generator(self.bits)


@contextlib.contextmanager
def _global_generators_kept() -> Any:
    """Restores Python's, numpy's legacy and torch's global generators after the block."""
    py, legacy = random.getstate(), np.random.get_state()
    torch = sys.modules.get("torch")
    state = torch.get_rng_state() if torch is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(legacy)
        if torch is not None and state is not None:
            torch.set_rng_state(state)


def takes_rng(fn: Callable[..., Any]) -> Literal["positional", "keyword", "no"]:
    """How ``fn`` takes the generator: as its second positional argument, as ``rng=``, or not at all.

    Example:
        >>> takes_rng(lambda s: s), takes_rng(lambda s, rng: s), takes_rng(lambda s, *, rng=None: s)
        ('no', 'positional', 'keyword')
    """
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or extension callable without a signature
        return "no"
    positional = [p for p in parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 and (positional[1].default is inspect.Parameter.empty
                                 or positional[1].name == "rng"):
        return "positional"
    rng = parameters.get("rng")
    if rng is not None and rng.kind in (inspect.Parameter.KEYWORD_ONLY,
                                        inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return "keyword"
    return "no"


def describe_callable(fn: object) -> str:
    """``fn``'s name as a user wrote it: ``module.qualname``, or its repr."""
    inner = getattr(fn, "func", fn)  # functools.partial
    name = getattr(inner, "__qualname__", None) or getattr(type(inner), "__qualname__", None)
    module = getattr(inner, "__module__", None) or getattr(type(inner), "__module__", None)
    if name is None:
        return repr(fn)
    return f"{module}.{name}" if module and module != "builtins" else str(name)


# -- running fn on a batch (in a thread or a worker) --------------------------------------------------


class _SampleFailure(Exception):
    """What went wrong with one row of a batch (its index in the batch given to `_Runner.run`)."""

    def __init__(self, row: int, kind: str, detail: Any) -> None:
        super().__init__(kind)
        self.row, self.kind, self.detail = row, kind, detail


def _kind_of(value: Any, variable: bool) -> tuple[Kind, Any]:
    """A returned value as it is stored, and its field kind."""
    if type(value) is np.ndarray:
        array = value
    elif isinstance(value, (str, bytes)):
        return ("object",), value
    else:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            array = value.detach().cpu().numpy()
        elif variable:
            return ("object",), value
        else:
            array = np.asarray(value)
    if variable:
        return ("object",), array
    if array.dtype.hasobject:
        return ("object",), array if array.ndim else array.item()
    return ("array", array.shape, array.dtype), array


def kind_text(kind: Kind) -> str:
    if kind[0] == "object":
        return "a 1-D object array of per-sample values (variable=)"
    return f"shape {tuple(kind[1])} dtype {np.dtype(kind[2])}"


class _Outcome:
    """One batch (or slice) transformed: ``kept`` rows (indices into the input), ``arrays`` holding
    ``len(kept)`` rows each (or written into ``dest``), the spec, the skipped rows' exceptions and the
    busy seconds."""

    def __init__(self) -> None:
        self.kept: list[int] = []
        self.arrays: dict[str, Any] = {}
        self.spec: Spec | None = None
        self.first_row = -1  # the input row whose output set ``spec`` (when this run set it)
        self.skipped: list[tuple[int, BaseException]] = []  # rows fn raised on (on_error="skip")
        self.dropped: list[int] = []  # rows prepare left out
        self.busy = 0.0
        self.prepare = 0.0


def _nulls(a: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A column's values and, for a masked one, which rows are null (all masked)."""
    if not isinstance(a, np.ma.MaskedArray):
        return a, None
    mask: np.ndarray = np.ma.getmaskarray(a)  # type: ignore[no-untyped-call]
    nulls: np.ndarray = np.asarray(mask.reshape(len(a), -1).all(axis=1))
    return np.asarray(a.data), nulls


class _Runner:
    """``prepare`` then ``fn`` on each row, seeded, outputs checked and stacked (into ``dest`` if given)."""

    def __init__(self, fn: Callable[..., Any] | None, prepare: Callable[[Columns], Any] | None,
                 on_error: Literal["raise", "skip"], variable: bool | frozenset[str]) -> None:
        self.fn = fn
        self.prepare = prepare
        self.on_error = on_error
        self.variable = variable
        self.calling = takes_rng(fn) if fn is not None else "no"
        self.seeder = _Seeder()
        self.empty: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty  # where outputs go
        self.allocate: Callable[[Spec, int], Columns] | None = None  # or all of a batch's at once

    def _variable(self, name: str) -> bool:
        return self.variable is True or (not isinstance(self.variable, bool) and name in self.variable)

    def run(self, batch: Columns, *, epoch: int, seed: int, keys: np.ndarray, spec: Spec | None,
            dest: Columns | None = None) -> _Outcome:
        out = _Outcome()
        start = time.perf_counter()
        rows = np.arange(len(keys))
        if self.prepare is not None:
            prepared = self.prepare(batch)
            if isinstance(prepared, tuple):  # (batch, keep): rows prepare leaves out (undecodable)
                prepared, keep = prepared
                rows = rows[np.asarray(keep, bool)]
                out.dropped = np.flatnonzero(~np.asarray(keep, bool)).tolist()
            batch = prepared
            out.prepare = time.perf_counter() - start
        if self.fn is None:
            out.kept = rows.tolist()
            out.arrays = dict(batch)
            out.busy = time.perf_counter() - start
            return out
        self._transform(batch, rows, out, epoch=epoch, seed=seed, keys=keys, spec=spec, dest=dest)
        out.busy = time.perf_counter() - start
        return out

    def _transform(self, batch: Columns, rows: np.ndarray, out: _Outcome, *, epoch: int, seed: int,
                   keys: np.ndarray, spec: Spec | None, dest: Columns | None) -> None:
        fn = self.fn
        if fn is None:
            return
        words = sample_seeds(seed, epoch, keys[rows]).tolist() if len(rows) else []
        # a null (a row all masked) is None; other rows of a masked column are its data
        columns = [(name, *_nulls(a)) for name, a in batch.items()]
        n = len(rows)
        objects: dict[str, list[Any]] = {}
        arrays: Columns | None = dest
        for j, row in enumerate(rows.tolist()):
            sample = {name: a[j] if nulls is None or not nulls[j] else None for name, a, nulls in columns}
            rng = self.seeder.seed(words[j])
            try:
                if self.calling == "positional":
                    result = fn(sample, rng)
                elif self.calling == "keyword":
                    result = fn(sample, rng=rng)
                else:
                    result = fn(sample)
            except Exception as e:
                if self.on_error == "skip":
                    out.skipped.append((row, e))
                    continue
                raise _SampleFailure(row, "raised", e) from e
            if not isinstance(result, dict):
                raise _SampleFailure(row, "not a dict", type(result))
            if spec is None:
                spec = {}
                for name, value in result.items():
                    spec[name] = _kind_of(value, self._variable(name))[0]
                out.first_row = row
            if result.keys() != spec.keys():
                raise _SampleFailure(row, "fields", (sorted(spec), sorted(result), out.first_row))
            if arrays is None:
                stacked = {name: k for name, k in spec.items() if k[0] == "array"}
                arrays = self.allocate(stacked, n) if self.allocate is not None else {
                    name: self.empty((n, *k[1]), np.dtype(k[2])) for name, k in stacked.items()}
            slot = len(out.kept)
            for name, value in result.items():
                kind, stored = _kind_of(value, self._variable(name))
                if kind != spec[name]:
                    if spec[name][0] == "object":  # anything goes in an object field
                        stored = value
                    else:
                        raise _SampleFailure(row, "mismatch", (name, spec[name], kind, out.first_row))
                if kind[0] == "array" and spec[name][0] == "array":
                    arrays[name][slot] = stored
                else:
                    objects.setdefault(name, []).append(stored)
            out.kept.append(row)
        out.spec = spec
        count = len(out.kept)
        if spec is not None:
            for name, kind in spec.items():
                if kind[0] == "array":
                    if dest is not None:
                        out.arrays[name] = None
                    elif arrays is None:  # every sample of the batch skipped (on_error="skip")
                        out.arrays[name] = np.empty((0, *kind[1]), np.dtype(kind[2]))
                    else:
                        out.arrays[name] = arrays[name][:count]
                else:
                    column = np.empty(count, object)
                    column[:] = objects.get(name, [])
                    out.arrays[name] = column


# -- shared memory ------------------------------------------------------------------------------------


def _shared_fd(size: int) -> int:
    """A file descriptor of ``size`` bytes of shared memory that has no name (nothing to leak)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("shardkit-transform", os.MFD_CLOEXEC)
    else:  # an unlinked file, in memory where the platform has /dev/shm
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        handle, path = tempfile.mkstemp(prefix="shardkit-transform-", dir=folder)
        os.unlink(path)
        fd = handle
    os.ftruncate(fd, size)
    return fd


class _Segment:
    """A shared-memory segment: its file descriptor (sent to the workers, as many times as they are
    started), this process's map of it and ``base``, the uint8 array every batch array made from it is
    a view of. The memory goes when the maps are gone (a map holds a descriptor of its own)."""

    def __init__(self, ident: int, size: int) -> None:
        self.ident = ident
        self.size = size
        self.fd = _shared_fd(size)
        self.map = mmap.mmap(self.fd, size)
        self.base = np.frombuffer(self.map, np.uint8)
        self.free_refs = sys.getrefcount(self.base)

    def in_use(self) -> bool:
        return sys.getrefcount(self.base) > self.free_refs

    def release(self) -> None:
        """Let go of this process's hold (arrays still in use keep the map, and its fd, until they go)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        in_use = self.in_use()
        del self.base
        if not in_use:
            with contextlib.suppress(BufferError):
                self.map.close()


def layout(spec: Spec, rows: int) -> tuple[dict[str, tuple[int, tuple[int, ...], str]], int]:
    """Where each array field's ``rows`` rows lie in a segment (byte offset, row shape, dtype), and the
    bytes they take; each field starts at a multiple of `ALIGN` (TensorFlow takes such arrays as they
    are)."""
    places: dict[str, tuple[int, tuple[int, ...], str]] = {}
    offset = 0
    for name, kind in spec.items():
        if kind[0] != "array":
            continue
        shape, dtype = tuple(kind[1]), np.dtype(kind[2])
        places[name] = (offset, shape, dtype.str)
        offset += -(-rows * math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return places, max(offset, ALIGN)


def _views(base: np.ndarray, places: dict[str, tuple[int, tuple[int, ...], str]], rows: int,
           start: int = 0, stop: int | None = None) -> Columns:
    out = {}
    for name, (offset, shape, dtype) in places.items():
        d = np.dtype(dtype)
        nbytes = rows * math.prod(shape) * d.itemsize
        full = base[offset : offset + nbytes].view(d).reshape(rows, *shape)
        out[name] = full[start:stop]
    return out


def _batch_arrays(allocate: Callable[[int], np.ndarray | None],
                  fallback: Callable[[tuple[int, ...], np.dtype], np.ndarray], spec: Spec,
                  rows: int) -> Columns:
    """The array fields of a batch of ``rows`` rows, views of one array from ``allocate`` (laid out by
    `layout`), or each from ``fallback`` when ``allocate`` has none to give."""
    places, nbytes = layout(spec, rows)
    flat = allocate(nbytes)
    if flat is None:
        return {name: fallback((rows, *shape), np.dtype(dtype)) for name, (_, shape, dtype) in places.items()}
    return _views(flat, places, rows)


# -- the worker process -------------------------------------------------------------------------------


def _worker_main(conn: Any, runner: _Runner, parent: int) -> None:
    """A worker's loop: map segments, run jobs, reply; ends on "stop", EOF, or a parent gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    segments: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
    while True:
        try:
            while not conn.poll(1.0):
                if os.getppid() != parent:
                    return
            message = conn.recv()
        except (EOFError, OSError):
            return
        what = message[0]
        if what == "stop":
            return
        if what == "segment":
            _, ident, size = message
            fd = reduction.recv_handle(conn)
            m = mmap.mmap(fd, size)
            os.close(fd)
            segments[ident] = (m, np.frombuffer(m, np.uint8))
        elif what == "drop":
            held = segments.pop(message[1], None)
            if held is not None:
                m, base = held
                del base, held
                with contextlib.suppress(BufferError):
                    m.close()
        elif what == "job":
            _worker_job(conn, runner, segments, message)


class _Own:
    """A worker's own segment for a batch whose shapes the parent does not know yet (the first): the
    rows are written there as ``fn`` returns them, and its fd goes to the parent with the reply."""

    def __init__(self) -> None:
        self.fd = -1
        self.map: mmap.mmap | None = None
        self.shape: tuple[dict[str, tuple[int, tuple[int, ...], str]], int, int] | None = None

    def allocate(self, spec: Spec, rows: int) -> Columns:
        places, nbytes = layout(spec, rows)
        self.fd = _shared_fd(nbytes)
        self.map = mmap.mmap(self.fd, nbytes)
        self.shape = (places, rows, nbytes)
        return _views(np.frombuffer(self.map, np.uint8), places, rows)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.map is not None:
            with contextlib.suppress(BufferError):  # views still alive: the map goes with them
                self.map.close()
            self.map = None


def _worker_job(conn: Any, runner: _Runner, segments: dict[int, tuple[mmap.mmap, np.ndarray]],
                message: Any) -> None:
    """One job: ``message`` is ("job", id, columns, epoch, seed, keys, spec, place), ``place`` None or
    (segment, field places, the batch's rows, this slice's first row) where to write the rows. Without
    a place, the rows go to a segment of the worker's own (`_Own`), sent after the reply."""
    _, job, batch, epoch, seed, keys, spec, place = message
    dest = None
    own = _Own()
    if place is not None:
        ident, places, rows, start = place
        dest = _views(segments[ident][1], places, rows, start, start + len(keys))
    else:
        runner.allocate = own.allocate
    try:
        out = runner.run(batch, epoch=epoch, seed=seed, keys=keys, spec=spec, dest=dest)
    except _SampleFailure as f:
        own.close()
        conn.send(("fail", job, f.row, f.kind, _portable(f.detail), _traceback_text(f)))
        return
    except Exception as e:  # prepare raised: the whole slice
        own.close()
        conn.send(("fail", job, -1, "prepare", _portable(e), _traceback_text(e)))
        return
    finally:
        runner.allocate = None
    arrays = out.arrays
    plain = {name: a for name, a in arrays.items() if type(a) is np.ndarray and not a.dtype.hasobject}
    if runner.fn is None and dest is not None:  # prepared columns that fit go to shared memory
        for name, d in dest.items():
            a = plain.get(name)
            if a is not None and a.shape[1:] == d.shape[1:] and a.dtype == d.dtype:
                d[: len(a)] = a
                arrays[name] = None
    elif runner.fn is None and plain and len(out.kept):  # the first batch: into a segment of its own
        views = own.allocate({name: ("array", a.shape[1:], a.dtype) for name, a in plain.items()},
                             len(out.kept))
        for name, a in plain.items():
            views[name][:] = a
        del views
    if own.shape is not None:
        for name in own.shape[0]:
            arrays[name] = None
    skipped = [(row, one_line(f"{type(e).__name__}: {e}")) for row, e in out.skipped]
    skipped += [(row, "") for row in out.dropped]
    conn.send(("done", job, out.kept, out.spec, out.first_row, arrays, skipped, out.busy, out.prepare,
               own.shape))
    del out, arrays, plain
    if own.shape is not None:
        reduction.send_handle(conn, own.fd, os.getppid())
    own.close()


def _portable(detail: Any) -> Any:
    """``detail`` if it pickles (an exception, a type), else its text."""
    try:
        pickle.dumps(detail)
    except Exception:
        return repr(detail)
    return detail


def _traceback_text(e: BaseException) -> str:
    cause = e.__cause__ if isinstance(e, _SampleFailure) and e.__cause__ is not None else e
    return "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))


class _RemoteTraceback(Exception):
    """A worker's traceback, as the cause of the exception it raised (printed with it)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


class _Worker:
    def __init__(self, context: Any, runner: _Runner, index: int) -> None:
        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(target=_worker_main, args=(child, runner, os.getpid()),
                                       name=f"shardkit-transform-{index}", daemon=True)
        self.process.start()
        child.close()
        self.segments: set[int] = set()
        self.job: int | None = None  # the job it works on, when one

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()

    def close(self) -> None:
        self.process.join(5)
        self.conn.close()
        if self.process.exitcode is not None:
            self.process.close()


def _stop(workers: list[_Worker], segments: list[_Segment], executor: ThreadPoolExecutor) -> None:
    """Stop the workers (a word, then SIGKILL past a grace) and let go of the segments (a stage closed,
    or dropped unclosed)."""
    executor.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        if w.job is None:
            with contextlib.suppress(Exception):
                w.conn.send(("stop",))
        else:
            w.kill()
    deadline = time.monotonic() + _STOP_GRACE
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
        if w.process.exitcode is None:
            w.kill()
        with contextlib.suppress(Exception):
            w.close()
    workers.clear()
    for s in segments:
        s.release()
    segments.clear()


# -- the stage ----------------------------------------------------------------------------------------


def check_picklable(what: str, obj: object) -> None:
    """`ReaderError` unless ``obj`` pickles, as transform worker processes need (naming it and the fix)."""
    try:
        pickle.dumps(obj)
    except Exception as e:
        raise ReaderError(
            f"{what}={describe_callable(obj)} cannot be sent to transform worker processes: it "
            f"does not pickle ({type(e).__name__}: {one_line(e)}). Define it at the top level of "
            "a module (not a lambda or a function inside a function), or bind its arguments "
            "with functools.partial of such a function, or pass transform_workers=0 to run it "
            "in the reading process") from e


class SampleStage:
    """Runs ``fn`` on every sample of the batches submitted, seeded, in order, in parallel.

    Example:
        >>> def flip(sample, rng):
        ...     return {"x": sample["x"][::-1] if rng.random() < 0.5 else sample["x"]}
        >>> with SampleStage(flip, seed=0, processes=0) as stage:
        ...     out = stage.submit({"x": np.arange(6).reshape(3, 2)}, epoch=0, keys=np.arange(3)).result()
        >>> out["x"].shape
        (3, 2)

    Args:
        fn: ``fn(sample) -> dict`` or ``fn(sample, rng) -> dict`` (see the module's docstring), or None
            to run ``prepare`` alone.
        prepare: run first on each batch (or worker slice) in the worker: columns in, columns of the same
            rows out, or ``(columns, keep)`` with ``keep`` a boolean mask of the rows it could prepare
            (the others are left out, counted as skipped).
        seed: the reader's seed; with the epoch and each sample's key it seeds the sample's draws.
        processes: 0 for one thread of this process, N for N worker processes.
        timeout: seconds a batch may take (None: no limit); past it the batch fails and the workers are
            started again. Honoured with ``processes > 0`` only (a thread cannot be stopped).
        on_error: what a sample whose ``fn`` raises does: ``"raise"`` fails its batch, ``"skip"``
            leaves it out.
        describe: names a sample by its key for error messages, when ``submit`` gets no ``where``.
        variable: fields (or all: True) returned as 1-D object arrays of per-sample values instead of
            stacked: for values whose shape varies from sample to sample.
        start_method: the multiprocessing start method (default: "fork" where the platform has it).
    """

    def __init__(self, fn: Callable[..., Any] | None, *, prepare: Callable[[Columns], Any] | None = None,
                 seed: int = 0, processes: int = 0, timeout: float | None = None,
                 on_error: Literal["raise", "skip"] = "raise", describe: Callable[[int], str] | None = None,
                 variable: bool | Collection[str] = False, start_method: str | None = None) -> None:
        if fn is not None and not callable(fn):
            raise ReaderError(f"transform={fn!r} is not callable: pass a function fn(sample) -> dict "
                              "(or fn(sample, rng) -> dict)")
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ReaderError(f"transform_workers={processes!r}: pass 0 (transform in the reading process) "
                              "or the number of worker processes")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ReaderError(f"transform_timeout={timeout!r}: pass a number of seconds > 0, or None")
        if on_error not in ("raise", "skip"):
            raise ReaderError(f"on_error={on_error!r}: pass 'raise' or 'skip'")
        self.fn, self.prepare = fn, prepare
        self.seed, self.processes, self.timeout, self.on_error = seed, processes, timeout, on_error
        self.describe = describe
        self.variable: bool | frozenset[str] = variable if isinstance(variable, bool) else frozenset(variable)
        self.name = describe_callable(fn) if fn is not None else describe_callable(prepare)
        self.stats: dict[str, float] = {"batches": 0, "samples": 0, "skipped_samples": 0, "seconds_busy": 0.0,
                                        "seconds_prepare": 0.0, "seconds_waited": 0.0, "worker_restarts": 0}
        self._spec: Spec | None = None
        self._spec_from = ""  # the sample whose output set the spec
        self._warned_skip = False
        self._closed = False
        self._runner = _Runner(fn, prepare, on_error, self.variable)
        if not processes:  # batches' arrays used again once dropped (fresh pages cost the kernel)
            self._runner.empty = Recycler(_KEEP_FREE_BYTES).empty
        self._workers: list[_Worker] = []
        self._segments: list[_Segment] = []
        self._next_segment = 0
        self._job = 0
        if processes:
            if multiprocessing.current_process().daemon:
                raise ReaderError(
                    f"transform_workers={processes}: this process is a daemonic process (a torch DataLoader "
                    "worker, a multiprocessing pool worker), which cannot start processes of its own; pass "
                    "transform_workers=0: the transform then runs in each DataLoader worker, which are the "
                    "parallelism")
            for what, obj in (("transform", fn), ("prepare", prepare)):
                if obj is not None:
                    check_picklable(what, obj)
            methods = multiprocessing.get_all_start_methods()
            method = start_method or ("fork" if "fork" in methods else "spawn")
            self._context = multiprocessing.get_context(method)
            self._start_workers()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="shardkit-transform")
        self._finalizer = weakref.finalize(self, _stop, self._workers, self._segments, self._executor)

    # -- public -----------------------------------------------------------------------------------
    def set_output_memory(self, allocate: Callable[[int], np.ndarray | None] | None) -> None:
        """Where the arrays of each transformed batch are made, in this process (``processes=0``; worker
        processes write to the stage's segments): ``allocate(nbytes)`` returns a new flat uint8 array for
        one batch's array fields (laid out by `layout`), or None for the stage's own memory. The stage
        never uses such an array for another batch: the allocator knows when it is free again. A
        DataLoader worker of `shardkit.torch` gives its shared-memory segments, so that a batch crosses
        to the main process without a copy. None: the stage's own memory again."""
        if self.processes:
            return
        self._runner.allocate = None if allocate is None else (
            lambda spec, rows: _batch_arrays(allocate, self._runner.empty, spec, rows))


    def submit(self, batch: Columns, epoch: int, keys: np.ndarray,
               where: Sequence[str] | None = None) -> Future[Columns]:
        """The batch transformed, when done: its rows in input order, less the samples skipped.

        ``keys``: per row, the sample's number in the dataset's order (its seed). ``where``: per
        row, how an error names the sample ("dataset X, row group 3, row 17").
        """
        if self._closed:
            raise ReaderError("this transform stage is closed")
        keys = np.asarray(keys)
        if len(keys) != num_rows(batch):
            raise ReaderError(f"{len(keys)} keys for a batch of {num_rows(batch)} rows")
        return self._executor.submit(self._run, batch, epoch, keys, where)

    def close(self) -> None:
        """Stop the workers and let go of the shared memory; batches handed out keep theirs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        for w in self._workers:
            if w.job is not None:  # a batch in flight: the driver thread then sees the worker go
                w.kill()
        self._executor.shutdown(wait=True)
        self._finalizer()

    def __enter__(self) -> SampleStage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the driver thread ------------------------------------------------------------------------

    def _sample_name(self, row: int, epoch: int, keys: np.ndarray, where: Sequence[str] | None) -> str:
        if where is not None:
            return where[row]
        if self.describe is not None:
            return self.describe(int(keys[row]))
        return f"the sample at position {int(keys[row])} of epoch {epoch}"

    def _run(self, batch: Columns, epoch: int, keys: np.ndarray, where: Sequence[str] | None) -> Columns:
        start = time.perf_counter()
        if self.processes:
            out, skipped = self._run_workers(batch, epoch, keys, where)
        else:
            out, skipped = self._run_here(batch, epoch, keys, where)
        self.stats["batches"] += 1
        self.stats["samples"] += num_rows(out) if out else len(keys) - len(skipped)
        self.stats["seconds_waited"] += time.perf_counter() - start
        if skipped:
            self.stats["skipped_samples"] += len(skipped)
            raised = [(row, text) for row, text in skipped if text]  # not those prepare left out: it says
            if raised and not self._warned_skip:
                self._warned_skip = True
                row, text = raised[0]
                warnings.warn(f"transform {self.name} raised on {self._sample_name(row, epoch, keys, where)} "
                              f"({text}): on_error='skip' leaves such samples out of their batches (counted "
                              "in the reader's transform stats); this is warned once", stacklevel=2)
        return out

    def _run_here(self, batch: Columns, epoch: int, keys: np.ndarray, where: Sequence[str] | None
                  ) -> tuple[Columns, list[tuple[int, str]]]:
        with _global_generators_kept():
            try:
                out = self._runner.run(batch, epoch=epoch, seed=self.seed, keys=keys, spec=self._spec)
            except _SampleFailure as f:
                raise self._failure(f.row, f.kind, f.detail, epoch=epoch, keys=keys, where=where) from (
                    f.detail if isinstance(f.detail, BaseException) else None)
        self.stats["seconds_busy"] += out.busy
        self.stats["seconds_prepare"] += out.prepare
        if self._spec is None and out.spec is not None:
            self._spec, self._spec_from = out.spec, self._sample_name(out.first_row, epoch, keys, where)
        skipped = [(row, one_line(f"{type(e).__name__}: {e}")) for row, e in out.skipped]
        arrays = dict(out.arrays)
        if not arrays and self.fn is not None and self._spec is not None:  # no rows: the fields, empty
            arrays = {name: np.empty((0, *k[1]), k[2]) if k[0] == "array" else np.empty(0, object)
                      for name, k in self._spec.items()}
        return arrays, skipped + [(row, "") for row in out.dropped]

    def _failure(self, row: int, kind: str, detail: Any, *, epoch: int, keys: np.ndarray,
                 where: Sequence[str] | None, remote: str | None = None) -> TransformError:
        sample = self._sample_name(row, epoch, keys, where) if row >= 0 else "its batch"
        if kind == "raised":
            text = one_line(f"{type(detail).__name__}: {detail}") if isinstance(detail, BaseException) \
                else one_line(detail)
            return TransformError(f"transform {self.name} raised {text} on {sample}; fix the transform for "
                                  "this sample, or pass on_error='skip' to leave out samples it raises on")
        if kind == "not a dict":
            got = detail.__name__ if isinstance(detail, type) else str(detail)
            return TransformError(f"transform {self.name} returned a {got} for {sample}, not a dict: return "
                                  "a dict of field name -> value (e.g. {'image': array, 'label': label})")
        origin = self._spec_from or "the first sample"
        if kind in ("fields", "mismatch") and detail[-1] >= 0:  # the first sample was in this batch
            origin = self._sample_name(detail[-1], epoch, keys, where)
        if kind == "fields":
            return TransformError(f"transform {self.name} returned the fields {detail[1]} for {sample}, but "
                                  f"{detail[0]} for {origin}: every sample must return the same fields (a "
                                  "batch holds each field for every row)")
        if kind == "mismatch":
            name, want, got, _ = detail
            return TransformError(
                f"transform {self.name} returned field {name!r} as {kind_text(got)} for {sample}, but as "
                f"{kind_text(want)} for {origin}: a batch stacks a field's "
                "values into one array, so every sample must give it the same shape and dtype. Make them "
                "equal (resize or crop images to one size, cast to one dtype), or pass "
                f"variable={{{name!r}}} to get the field as a 1-D object array of per-sample values")
        if kind == "prepare":  # the reader's own step (decoding) raised: its error, as it was
            error = detail if isinstance(detail, BaseException) else TransformError(str(detail))
            if remote:
                error.__cause__ = _RemoteTraceback(remote)
            return error  # type: ignore[return-value]
        return TransformError(f"transform {self.name}: {kind} on {sample}: {detail}")

    # -- worker processes -------------------------------------------------------------------------

    def _start_workers(self) -> None:
        self._workers.extend(_Worker(self._context, self._runner, i) for i in range(self.processes))

    def _restart_workers(self) -> None:
        """Kill every worker and start new ones (segments kept: no worker writes to them any more)."""
        for w in self._workers:
            w.kill()
        for w in self._workers:
            with contextlib.suppress(Exception):
                w.close()
        self._workers.clear()
        if not self._closed:
            self._start_workers()
            self.stats["worker_restarts"] += 1

    def _segment(self, nbytes: int) -> _Segment:
        free = [s for s in self._segments if not s.in_use()]
        fits = [s for s in free if s.size >= nbytes]
        if fits:
            return min(fits, key=lambda s: s.size)
        size = -(-nbytes * 9 // 8 // mmap.PAGESIZE) * mmap.PAGESIZE  # a somewhat larger batch fits too
        segment = _Segment(self._next_segment, size)
        self._next_segment += 1
        for old in free[: max(0, len(free) + 1 - _KEEP_FREE_SEGMENTS)] + [s for s in free if s.size < nbytes]:
            if old in self._segments:
                self._drop(old)
        self._segments.append(segment)
        return segment

    def _drop(self, segment: _Segment) -> None:
        self._segments.remove(segment)
        for w in self._workers:
            if segment.ident in w.segments:
                w.segments.discard(segment.ident)
                with contextlib.suppress(Exception):
                    w.conn.send(("drop", segment.ident))
        segment.release()

    def _send(self, w: _Worker, message: tuple[Any, ...], segment: _Segment | None) -> None:
        if segment is not None and segment.ident not in w.segments:
            w.conn.send(("segment", segment.ident, segment.size))
            reduction.send_handle(w.conn, segment.fd, w.process.pid)
            w.segments.add(segment.ident)
        w.conn.send(message)

    def _run_workers(self, batch: Columns, epoch: int, keys: np.ndarray, where: Sequence[str] | None
                     ) -> tuple[Columns, list[tuple[int, str]]]:
        n = len(keys)
        if n == 0:
            return self._run_here(batch, epoch, keys, where)
        parts = min(self.processes, n)
        cuts = [n * i // parts for i in range(parts + 1)]
        spec = self._spec
        places: dict[str, tuple[int, tuple[int, ...], str]] | None = None
        segment = None
        if spec is not None:
            places, nbytes = layout(spec, n)
            segment = self._segment(nbytes)
        self._job += 1
        job = self._job
        replies: list[Any] = [None] * parts
        try:
            for i in range(parts):
                a, b = cuts[i], cuts[i + 1]
                w = self._workers[i]
                place = None if segment is None or places is None else (segment.ident, places, n, a)
                piece = {name: col[a:b] for name, col in batch.items()}
                w.job = job
                self._send(w, ("job", job, piece, epoch, self.seed, keys[a:b], spec, place), segment)
            failure = self._collect(job, replies, cuts, epoch=epoch, keys=keys, where=where)
        except (OSError, EOFError) as e:  # a pipe to a worker broke: it died
            self._restart_workers()
            raise self._closed_error() if self._closed else TransformError(
                f"a transform worker process broke its pipe ({type(e).__name__}: {one_line(e)}) while "
                f"transforming {self._range_text(0, n, epoch, keys, where)}; the workers were started "
                "again") from e
        if failure is not None:
            raise failure
        out, skipped = self._assemble(replies, cuts, segment=segment, places=places, epoch=epoch, keys=keys,
                                      where=where)
        if sum(s.in_use() for s in self._segments) > _HANDED_OUT + 2 * self.processes:
            # the user keeps many batches (a list of them): this one is copied out, and its segment
            # is free for the next, so segments (and their file descriptors) stay few
            out = {name: np.array(a) if type(a) is np.ndarray and not a.dtype.hasobject else a
                   for name, a in out.items()}
        return out, skipped

    def _closed_error(self) -> TransformError:
        return TransformError("the transform stage was closed while this batch was being transformed")

    def _range_text(self, a: int, b: int, epoch: int, keys: np.ndarray, where: Sequence[str] | None) -> str:
        first = self._sample_name(a, epoch, keys, where)
        last = self._sample_name(b - 1, epoch, keys, where)
        return first if b - a == 1 else f"{b - a} samples from {first} to {last}"

    def _collect(self, job: int, replies: list[Any], cuts: list[int], *, epoch: int, keys: np.ndarray,
                 where: Sequence[str] | None) -> TransformError | None:
        """Wait for every worker's reply to ``job``; the first failure, if any (once all replied)."""
        parts = len(cuts) - 1
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        failure: TransformError | None = None  # of the first row that failed (whichever worker is first)
        failed_row = -1
        pending = set(range(parts))
        while pending:
            waiting = {self._workers[i].conn: i for i in pending}
            sentinels = {self._workers[i].process.sentinel: i for i in pending}
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mp_connection.wait([*waiting, *sentinels], left)
            if not ready:
                self._restart_workers()
                if self._closed:
                    return self._closed_error()
                return failure or TransformError(
                    f"transform {self.name} took longer than transform_timeout={self.timeout} s on a batch "
                    f"of {cuts[-1]} samples ({self._range_text(0, cuts[-1], epoch, keys, where)}); its "
                    "worker processes were killed and started again. Find what hangs in the transform (a "
                    "lock, a network call, a thread pool used after fork: see start_method), or raise "
                    "transform_timeout if a batch truly takes that long")
            for obj in ready:
                i = waiting[obj] if obj in waiting else sentinels[obj]
                if i not in pending:
                    continue
                w = self._workers[i]
                try:
                    reply = w.conn.recv() if w.conn.poll(0) else None
                    if reply is not None and reply[0] == "done" and reply[9] is not None:
                        fd = reduction.recv_handle(w.conn)  # the worker's own segment: map it
                        try:
                            shared = mmap.mmap(fd, reply[9][2])
                        finally:
                            os.close(fd)
                        reply = (*reply, shared)
                except (EOFError, OSError, RuntimeError):  # it died (RuntimeError: no fd came)
                    reply = None
                if reply is not None:
                    if reply[1] != job:
                        continue  # a late reply of an earlier failed batch
                    replies[i] = reply
                    pending.discard(i)
                    w.job = None
                    if reply[0] == "fail" and (failure is None or cuts[i] + max(reply[2], 0) < failed_row):
                        row, kind, detail, text = reply[2], str(reply[3]), reply[4], str(reply[5])
                        absolute = cuts[i] + row if row >= 0 else -1
                        if kind in ("fields", "mismatch") and detail[-1] >= 0:
                            detail = (*detail[:-1], cuts[i] + detail[-1])
                        failure = self._failure(absolute, kind, detail, epoch=epoch, keys=keys, where=where,
                                                remote=text)
                        failed_row = cuts[i] + max(row, 0)
                        if kind == "raised":
                            cause = detail if isinstance(detail, BaseException) else None
                            if cause is not None:
                                cause.__cause__ = _RemoteTraceback(text)
                            failure.__cause__ = cause or _RemoteTraceback(text)
                    continue
                w.process.join(1.0)  # gone (its pipe's end, or its sentinel): its exit status
                code, pid = w.process.exitcode, w.process.pid
                self._restart_workers()
                if self._closed:
                    return self._closed_error()
                how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
                       and -code in signal.Signals._value2member_map_ else f"exited with status {code}")
                return failure or TransformError(
                    f"transform worker process {pid} {how} while transforming "
                    f"{self._range_text(cuts[i], cuts[i + 1], epoch, keys, where)}; the workers were "
                    "started again. A signal from outside (the OOM killer: see dmesg), or a crash in "
                    "native code the transform calls (a segfault), ends a worker; run the transform "
                    "with transform_workers=0 to see it in this process")
        return failure

    def _assemble(self, replies: list[Any], cuts: list[int], *, segment: _Segment | None,
                  places: dict[str, tuple[int, tuple[int, ...], str]] | None, epoch: int,
                  keys: np.ndarray, where: Sequence[str] | None) -> tuple[Columns, list[tuple[int, str]]]:
        """One batch from the workers' replies: in place in ``segment`` where they wrote their rows there
        (the gaps skipped samples left closed), else copied from what they sent (the first batch)."""
        n = cuts[-1]
        skipped: list[tuple[int, str]] = []
        counts = []
        for i, reply in enumerate(replies):
            kept, skips, busy, prep = reply[2], reply[6], reply[7], reply[8]
            self.stats["seconds_busy"] += busy
            self.stats["seconds_prepare"] += prep
            skipped.extend((cuts[i] + row, text) for row, text in skips)
            counts.append(len(kept))
        total = sum(counts)
        if self._spec is None:
            spec = self._first_spec(replies, counts, cuts, epoch=epoch, keys=keys, where=where)
            if spec is None:  # every sample skipped, or no columns
                return {}, skipped
            self._spec = spec
        spec = self._spec
        sent = [reply[5] for reply in replies]
        theirs = [_views(np.frombuffer(reply[10], np.uint8), reply[9][0], reply[9][1])
                  if reply[0] == "done" and reply[9] is not None else {} for reply in replies]
        if segment is not None and places is not None and all(
                sent[i].get(name) is None for i in range(len(sent)) if counts[i] for name in places):
            full = _views(segment.base, places, n)  # every worker wrote its rows: close the gaps
            pos = 0
            for i, c in enumerate(counts):
                if pos != cuts[i] and c:
                    for a in full.values():
                        a[pos : pos + c] = a[cuts[i] : cuts[i] + c]
                pos += c
            out: Columns = {name: a[:total] for name, a in full.items()}
        else:
            out = {}
        old = _views(segment.base, places, n) if segment is not None and places is not None else {}
        pieces: dict[str, list[Any]] = {name: [] for name in spec if name not in out}
        for i, c in enumerate(counts):
            if c:
                for name, parts in pieces.items():
                    value = sent[i].get(name)
                    if value is None:
                        value = theirs[i][name][:c] if name in theirs[i] else old[name][cuts[i] : cuts[i] + c]
                    parts.append(value)
        stackable = {name: spec[name] for name, parts in pieces.items() if spec[name][0] == "array" and all(
            type(p) is np.ndarray and p.shape[1:] == tuple(spec[name][1]) and p.dtype == spec[name][2]
            for p in parts)}
        if stackable:  # into shared memory of its own, reused as the later batches' are
            new_places, nbytes = layout(stackable, total)
            out.update(_views(self._segment(nbytes).base, new_places, total))
            for name in stackable:
                pos = 0
                for p in pieces[name]:
                    out[name][pos : pos + len(p)] = p
                    pos += len(p)
        for name, parts in pieces.items():
            if name in stackable:
                continue
            if not parts:
                out[name] = np.empty(0, object)
            elif any(isinstance(p, np.ma.MaskedArray) for p in parts):
                out[name] = np.ma.concatenate(parts)  # type: ignore[no-untyped-call]
            else:
                try:
                    out[name] = np.concatenate(parts)
                except ValueError as e:
                    raise TransformError(
                        f"prepare step {describe_callable(self.prepare)} gave field {name!r} rows of other "
                        f"shapes in the slices of one batch ({one_line(e)}): its rows must stack") from e
        result = {name: out[name] for name in spec}
        del out, pieces, theirs, old, sent
        for reply in replies:  # the workers' own segments: copied out
            if len(reply) > 10:
                with contextlib.suppress(BufferError):
                    reply[10].close()
        return result, skipped

    def _first_spec(self, replies: list[Any], counts: list[int], cuts: list[int], *, epoch: int,
                    keys: np.ndarray, where: Sequence[str] | None) -> Spec | None:
        """The fields' kinds from the first batch: each slice's own, which must agree (``fn`` set), or
        the prepared columns' (no ``fn``)."""
        spec: Spec | None = None
        for i, reply in enumerate(replies):
            s, first_row, arrays = reply[3], reply[4], reply[5]
            if self.fn is None:
                if counts[i]:
                    theirs = reply[9][0] if reply[9] is not None else {}
                    return {name: ("array", theirs[name][1], np.dtype(theirs[name][2])) if name in theirs
                            else ("array", a.shape[1:], a.dtype)
                            if type(a) is np.ndarray and not a.dtype.hasobject else ("object",)
                            for name, a in arrays.items()}
                continue
            if s is None:
                continue
            sample = self._sample_name(cuts[i] + first_row, epoch, keys, where)
            if spec is None:
                spec, self._spec_from = s, sample
                continue
            if s.keys() != spec.keys():
                raise self._failure(cuts[i] + first_row, "fields", (sorted(spec), sorted(s), -1), epoch=epoch,
                                    keys=keys, where=where)
            for name, kind in s.items():
                if kind != spec[name] and spec[name][0] != "object":
                    raise self._failure(cuts[i] + first_row, "mismatch", (name, spec[name], kind, -1),
                                        epoch=epoch, keys=keys, where=where)
        return spec

    @staticmethod
    def _joined(parts: list[dict[str, Any]], counts: list[int]) -> Columns:
        present = [p for p, c in zip(parts, counts, strict=True) if c]
        if not present:
            return {k: v[:0] for k, v in parts[0].items()}
        return concat(present)
