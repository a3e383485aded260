"""Atomic checkpoints on any fsspec URL: torch or TensorFlow state, reader state, step and RNG, JSON only.

Layout (``docs/design/trainer.md``)::

    <dir>/step-000000050/model.pt        torch model state dict       (torch.save; loaded weights_only)
    <dir>/step-000000050/optimizer.pt    torch optimizer state dict
    <dir>/step-000000050/tf/ckpt.*       a tf.train.Checkpoint written with its own format
    <dir>/step-000000050/state.json      step, reader state, RNG states, user extra (JSON)
    <dir>/step-000000050/COMMIT          written LAST: {"version", "step", "time", "framework", "files"}
    <dir>/COMPLETED                      the run ended (ctx.finish): {"version", "step", "time", "checkpoint"}

A checkpoint exists only when its ``COMMIT`` exists and every file it lists has the listed size (and
sha256, checked before anything is loaded). Saving a step that has a folder already (a restart that
reaches it again) first deletes that folder's ``COMMIT``, then the folder: a crash while re-saving
leaves an uncommitted folder (the older checkpoints serve), never a commit that lists foreign files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from shardkit._storage.location import Location
from shardkit.errors import CheckpointError, CheckpointWarning, ConfigError, CorruptCheckpointError
from shardkit.trainer.checkpoint import _frameworks as fw
from shardkit.trainer.checkpoint import _load
from shardkit.trainer.checkpoint._load import MODEL, OPTIMIZER, STATE
from shardkit.trainer.checkpoint._state import capture_rng, encode_state, restore_rng
from shardkit.trainer.checkpoint._store import CheckpointInfo, Store

if TYPE_CHECKING:
    import tensorflow as tf
    import torch

__all__ = ["COMPLETED", "CheckpointInfo", "CheckpointManager", "Completion", "Restored", "Schedule",
           "Stateful"]

COMPLETED = "COMPLETED"
_COMPLETED_VERSION = 1


class Stateful(Protocol):
    """Anything with a JSON-able ``state_dict()`` and ``load_state_dict(state)``: a shardkit `Reader`."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], /) -> None: ...


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `CheckpointManager.restore` loaded: the step, where from, the reader state and the user extra.

    ``reader_state``: the saved reader state of this process (with ``restore(reader_shard=...)``, its
    shard's; None: its shard had read nothing, and the reader was not loaded). ``reader_shards`` (with
    ``reader_shard`` and a reader): what every data shard's reader is given, in shard order.
    """

    step: int
    url: str
    info: CheckpointInfo
    extra: Mapping[str, Any]
    reader_state: Mapping[str, Any] | None
    reader_shards: tuple[Mapping[str, Any] | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """A run that ended (`CheckpointManager.completed`): its last step, when (``time.time()``), and the
    URL of its last checkpoint."""

    step: int
    time: float
    checkpoint: str


@dataclasses.dataclass
class Schedule:
    """When a save is due, given the step and time of the last save (or restore).

    ``every_steps``: on multiples of it (a run resumed from step 50 saves at 100, 150, ... like the run it
    replaces). ``every_seconds``: that long since the last save. Either is enough; neither: never due. A
    step at or before the last save is never due. Times are ``time.monotonic()`` readings.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    last_step: int = 0
    last_time: float = 0.0

    def due(self, step: int, now: float) -> bool:
        if step <= self.last_step:
            return False
        if self.every_steps is not None and step // self.every_steps > self.last_step // self.every_steps:
            return True
        return self.every_seconds is not None and now - self.last_time >= self.every_seconds

    def record(self, step: int, now: float) -> None:
        self.last_step, self.last_time = step, now


class CheckpointManager:
    """Saves and restores checkpoints under one folder URL (local path, ``file://``, ``s3://``, ``memory://``).

    Example:
        >>> ckpt = CheckpointManager("s3://bucket/job/checkpoints", keep=3, every_steps=50)
        >>> restored = ckpt.restore(model=model, optimizer=opt, reader=reader)   # None on a fresh start
        >>> for step in range(restored.step + 1 if restored else 1, steps + 1):
        ...     train_one_step()
        ...     if ckpt.due(step):
        ...         ckpt.save(step, model=model, optimizer=opt, reader=reader, writer=rank == 0)

    Choices: one writer per job (the chief / rank 0); the others pass ``writer=False``. Saves that overlap
    in one local folder (two writers by mistake) take turns under a file lock, so each commits a
    checkpoint that verifies; on an object store (``s3://``, ``memory://``) nothing coordinates them, so
    one writer per folder is required there (``ctx.checkpoint`` writes on the chief only). ``keep=None`` keeps
    every checkpoint. torch state is serialized in memory before it is written (peak memory: one extra copy
    of the state dict's bytes), so its sha256 is known without reading the file back. ``every_seconds``
    reads each process's own clock: where every worker must take part in a save, decide on the chief and
    share the decision (``ctx.checkpoint`` does: `shardkit.trainer.checkpoint.policy.Checkpoints.due`).
    A remote TensorFlow checkpoint is restored from a local copy that lives as long as the
    ``tf.train.Checkpoint`` object (TensorFlow fills variables created later, such as Keras optimizer
    slots, from the file when they appear).
    """

    def __init__(self, url: str | os.PathLike[str], *, keep: int | None = 3, every_steps: int | None = None,
                 every_seconds: float | None = None, storage_options: dict[str, Any] | None = None) -> None:
        for name, value, low in (("keep", keep, 1), ("every_steps", every_steps, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ConfigError(f"checkpoint.{name}={value!r}: use an integer >= {low}, or null for "
                                  f"{'all' if name == 'keep' else 'no step-based saves'}")
        if every_seconds is not None and not every_seconds > 0:
            raise ConfigError(f"checkpoint.every_seconds={every_seconds!r}: use a number > 0, or null")
        self.url = os.fspath(url)
        self.keep = keep
        self.schedule = Schedule(every_steps, every_seconds, 0, time.monotonic())
        self._store = Store(Location.of(self.url, storage_options))
        # (step, files, framework) of a save(commit=False) whose COMMIT is not written yet
        self._pending: tuple[int, dict[str, Any], str] | None = None

    def __repr__(self) -> str:
        return f"CheckpointManager({self.url!r}, keep={self.keep})"

    def due(self, step: int, *, now: float | None = None) -> bool:
        """Whether ``step`` should be saved (see `Schedule`); ``now`` is a ``time.monotonic()`` reading."""
        return self.schedule.due(step, time.monotonic() if now is None else now)

    def save(self, step: int, *, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, reader: Stateful | None = None,
             tf_checkpoint: tf.train.Checkpoint | None = None, extra: Mapping[str, Any] | None = None,
             writer: bool = True, rng_ranks: Sequence[Mapping[str, Any]] | None = None,
             reader_shards: Sequence[Mapping[str, Any] | None] | None = None, commit: bool = True
             ) -> str | None:
        """Write step ``step`` and commit it; returns its URL (None when ``writer=False``).

        ``commit=False``: write the files only; the checkpoint exists once `commit_pending` writes its
        ``COMMIT`` (``ctx.step`` does so when the script comes back for the next step: see
        `shardkit.trainer.checkpoint.policy.Checkpoints.commit_pending`). Until then a restore skips it,
        as any uncommitted folder; a save of another step first commits the pending one.

        ``model`` may be wrapped in DDP, DataParallel or torch.compile (the module inside is saved).
        ``extra`` and the reader state must be JSON with str dict keys (tuples come back as lists).

        The torch states are checked before anything is written: numpy scalars in them (a learning rate
        computed with numpy) are saved as Python numbers, and come back as such; any other value that
        ``torch.load(weights_only=True)`` refuses (a numpy array, an object of your own class not
        registered with ``torch.serialization.add_safe_globals``) raises `CheckpointError` naming its key
        path, since such a checkpoint could never be restored. ``rng_ranks``: every rank's RNG states
        (`shardkit.trainer.checkpoint._state.capture_rng`) in rank order, which `restore` gives back rank by
        rank
        (``ctx.checkpoint`` gathers them in a torch allreduce job of several processes).
        ``reader_shards``: every data shard's own reader state in shard order (None: that shard starts
        from the beginning), which `restore` gives back shard by shard; ``ctx.checkpoint`` saves them in
        a torch parameter-server job, whose workers read at their own pace (then ``reader`` is worker 0's).

        ``writer=False``: a non-chief worker of ``MultiWorkerMirroredStrategy``, whose
        ``tf_checkpoint.write`` must run (it takes part in collectives) but into a temporary folder that is
        deleted; torch state is not touched. After the commit, checkpoints beyond the ``keep`` newest
        and uncommitted folders of earlier steps are deleted (never a folder of a later step).
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"checkpoint step {step!r} under {self.url}: pass the training step, "
                                  "an int >= 0")
        if not writer:
            if tf_checkpoint is not None:
                with tempfile.TemporaryDirectory(prefix="shardkit-ckpt-") as tmp:
                    fw.tf_write(tf_checkpoint, os.path.join(tmp, fw.TF_PREFIX))
            self.schedule.record(step, time.monotonic())
            return None
        self.commit_pending()  # a step saved earlier is over: this one comes after it
        where = self._store.url(step)
        state = encode_state(step, reader=reader.state_dict() if reader is not None else None,
                             rng=capture_rng(), extra=extra, where=where, rng_ranks=rng_ranks,
                             reader_shards=reader_shards)
        blobs = {}
        if model is not None:
            blobs[MODEL] = fw.torch_bytes(fw.unwrap(model).state_dict(), what="model",
                                          where=self._store.url(step, MODEL))
        if optimizer is not None:
            blobs[OPTIMIZER] = fw.torch_bytes(optimizer.state_dict(), what="optimizer",
                                              where=self._store.url(step, OPTIMIZER))
        kinds = ["torch"] * bool(blobs) + ["tensorflow"] * (tf_checkpoint is not None)
        with self._store.lock():  # another process saving into this folder finishes first
            try:
                self._store.begin(step)
                files = {name: self._store.write(step, name, data) for name, data in blobs.items()}
                if tf_checkpoint is not None:
                    files.update(_load.write_tf(self._store, step, tf_checkpoint))
                files[STATE] = self._store.write(step, STATE, state)
                if commit:
                    self._store.commit(step, files, "+".join(kinds) or "none")
            except CheckpointError:
                raise
            except OSError as e:
                raise CheckpointError(f"could not write checkpoint {where} ({e}); check that the folder is "
                                      "writable and has space (the previous checkpoints are intact)") from e
            self.schedule.record(step, time.monotonic())
            if not commit:
                self._pending = (step, files, "+".join(kinds) or "none")
                return where
            self._prune(step)
        return where

    @property
    def pending(self) -> int | None:
        """The step saved with ``commit=False`` and not committed yet (None: none)."""
        return self._pending[0] if self._pending is not None else None

    def commit_pending(self) -> str | None:
        """Commit the step saved with ``save(commit=False)``, then delete what ``keep`` leaves out; its
        URL, or None when none was pending."""
        if self._pending is None:
            return None
        step, files, framework = self._pending
        self._pending = None
        where = self._store.url(step)
        with self._store.lock():
            try:
                self._store.commit(step, files, framework)
            except CheckpointError:
                raise
            except OSError as e:
                raise CheckpointError(f"could not commit checkpoint {where} ({e}); check that the folder is "
                                      "writable and has space (the previous checkpoints are intact)") from e
            self._prune(step)
        return where

    def discard_pending(self) -> None:
        """Forget the step saved with ``save(commit=False)``: it stays an uncommitted folder, which a
        restore skips and the next save deletes (a process failing before its step was over)."""
        self._pending = None

    def restore(self, *, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                reader: Stateful | None = None, tf_checkpoint: tf.train.Checkpoint | None = None,
                rng: bool = True, required: bool = False, rank: int | None = None,
                world_size: int | None = None, reader_shard: tuple[int, int] | None = None,
                at_most: int | None = None) -> Restored | None:
        """Load the newest checkpoint that verifies into the given objects; None when there is none.

        A newer folder that is uncommitted or does not verify (missing or bad ``COMMIT``, a missing,
        truncated or altered file, a torch file that is not a plain state dict) is skipped with a
        `CheckpointWarning` naming it and why. Everything is read and checked before any object is
        changed. ``rng=True`` sets python's, numpy's and torch's global RNGs to their saved states, so the
        resumed run draws the same numbers as an uninterrupted one.

        ``rank`` and ``world_size`` (both or neither): this process's place in a job of several processes
        (``ctx.checkpoint`` passes them; rank 0 is the writer). The RNGs are then set to this rank's saved
        states when the checkpoint holds every rank's (``save(rng_ranks=...)``) for the same world size,
        and rank 0's to the writer's when it holds only those. Otherwise (another world size; a process
        other than the writer, and only the writer's states saved, as in a TensorFlow
        ``MultiWorkerMirroredStrategy`` job) the RNGs stay as the script seeded them and a
        `CheckpointWarning` says that this process's random streams do not continue exactly. Without
        them (one process), the writer's states are set. ``required=True`` raises instead of
        returning None: `CorruptCheckpointError` when folders exist but none verifies, `CheckpointError`
        when there are none. A checkpoint that verifies but does not fit the objects (another model,
        a reader of another dataset, a file that was not saved) raises `CheckpointError`: an older one
        would not fit either.

        ``reader_shard``: ``(shard, num_shards)``, this process's data shard. The reader gets that
        shard's own saved state when the checkpoint holds every shard's (``save(reader_shards=...)``)
        for as many shards; a shard saved as None (it had read nothing) is not loaded, so it starts from
        the beginning. Saved for another number of shards, every reader gets the ``reader`` state (the
        writer's: the reader re-shards it) with a `CheckpointWarning`, since a shard that was behind or
        ahead of the writer's then repeats or skips as many batches. Without ``reader_shard``, or with no
        shard states saved (allreduce: the ranks step together, so the writer's is every rank's), the
        reader gets the ``reader`` state.

        ``at_most``: restore no checkpoint newer than this step (0: none at all). Every process of an
        attempt of ``shardkit train`` restores at most the newest checkpoint there was when the attempt
        started, so one that starts late does not take a checkpoint a faster peer saved meanwhile.
        """
        if reader_shard is not None and not 0 <= reader_shard[0] < reader_shard[1]:
            raise CheckpointError(f"restore(reader_shard={reader_shard!r}) from {self.url}: pass "
                                  "(shard, num_shards) with 0 <= shard < num_shards")
        if (rank is None) != (world_size is None) or (rank is not None and not 0 <= rank < (world_size or 0)):
            raise CheckpointError(f"restore(rank={rank!r}, world_size={world_size!r}) from {self.url}: pass "
                                  "both or neither, with 0 <= rank < world_size")
        steps = [s for s in self._store.steps() if at_most is None or s <= at_most]
        for step in reversed(steps):
            tmp = tempfile.mkdtemp(prefix="shardkit-ckpt-")
            try:
                loaded = _load.load(self._store, step, tmp, model=model is not None,
                                    optimizer=optimizer is not None, reader=reader is not None,
                                    tf=tf_checkpoint is not None)
                if tf_checkpoint is not None and loaded.tf_prefix is not None:
                    fw.tf_read(tf_checkpoint, loaded.tf_prefix, self._store.url(step, "tf"))
            except CorruptCheckpointError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                warnings.warn(f"skipping checkpoint {self._store.url(step)}: {e}", CheckpointWarning,
                              stacklevel=2)
                continue
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if tf_checkpoint is None:
                shutil.rmtree(tmp, ignore_errors=True)
            else:  # TensorFlow restores variables created later (Keras optimizer slots) from the file,
                # lazily: the local copy of a remote checkpoint lives as long as the tf.train.Checkpoint
                weakref.finalize(tf_checkpoint, shutil.rmtree, tmp, True)
            shards, mine = None, loaded.state.get("reader")
            if reader is not None and reader_shard is not None:
                shards = self._reader_shards(loaded.state, loaded.info.url, reader_shard[1])
                mine = shards[reader_shard[0]]
                loaded.state = {**loaded.state, "reader": mine}
            _load.apply(loaded, model=model, optimizer=optimizer, reader=reader if mine is not None else None)
            if rng:
                self._restore_rng(loaded.state, loaded.info.url, rank, world_size)
            self.schedule.record(step, time.monotonic())
            return Restored(step, loaded.info.url, loaded.info, loaded.state["extra"], mine, shards)
        if required:
            if steps:
                raise CorruptCheckpointError(f"none of the {len(steps)} checkpoints under {self.url} "
                                             "verifies (see the warnings above); delete them to start afresh")
            raise CheckpointError(f"no checkpoint under {self.url}: save one first, or restore without "
                                  "required=True")
        if steps:
            warnings.warn(f"none of the {len(steps)} checkpoints under {self.url} verifies; starting from "
                          "scratch", CheckpointWarning, stacklevel=2)
        return None

    def _reader_shards(self, state: Mapping[str, Any], url: str,
                       num_shards: int) -> tuple[Mapping[str, Any] | None, ...]:
        """The reader state each of ``num_shards`` data shards gets from ``state`` (see `restore`)."""
        saved = state.get("reader_shards")
        if saved is not None and len(saved) == num_shards:
            return tuple(saved)
        if saved is not None:
            warnings.warn(f"checkpoint {url} holds the reader positions of {len(saved)} workers (data "
                          f"shards); this job has {num_shards}, so every worker continues from worker 0's "
                          "position, re-sharded: a worker that was behind or ahead of worker 0 at the save "
                          "trains again, or skips, as many batches. Restart with "
                          f"{len(saved)} workers for each to continue exactly where it was",
                          CheckpointWarning, stacklevel=3)
        return (state.get("reader"),) * num_shards

    def _restore_rng(self, state: Mapping[str, Any], url: str, rank: int | None,
                     world_size: int | None) -> None:
        """The RNG part of `restore`: this rank's saved states, or a warning that there are none."""
        ranks = state.get("rng_ranks")
        if rank is None or world_size is None:
            mine = state.get("rng")
        elif ranks is not None and len(ranks) == world_size:
            mine = ranks[rank]
        elif ranks is None and (rank == 0 or world_size == 1):
            mine = state.get("rng")
        else:
            saved = (f"the random states of {len(ranks)} processes" if ranks is not None else
                     "the random states of the process that wrote it only")
            warnings.warn(f"checkpoint {url} holds {saved}; process {rank} of {world_size} keeps its python, "
                          "numpy and torch random generators as the script seeded them, so its random "
                          "streams do not continue exactly as in an uninterrupted run", CheckpointWarning,
                          stacklevel=3)
            return
        if mine is not None:
            restore_rng(mine)

    def completed(self) -> Completion | None:
        """The run whose end `mark_completed` recorded, when its last step is the newest checkpoint
        folder's; else None: a checkpoint saved since (a run resumed from it and interrupted) or its
        last checkpoint gone (deleted, or never saved: ``finish(save=False)``) leave something to train.

        A marker that does not parse is taken for none: the newest checkpoint is resumed, as for an
        interrupted run.
        """
        raw = self._store.read_marker(COMPLETED)
        if raw is None:
            return None
        try:
            doc = json.loads(raw.decode())
            done = Completion(int(doc["step"]), float(doc["time"]), str(doc["checkpoint"]))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError):
            return None
        steps = self._store.steps()
        return done if steps and steps[-1] == done.step else None

    def mark_completed(self, step: int) -> None:
        """Record that the run ended at ``step`` (``<dir>/COMPLETED``), so that starting it again does not
        resume it silently (`shardkit.trainer.rerun`). The writer (chief) calls it after its last save."""
        doc = {"version": _COMPLETED_VERSION, "step": step, "time": time.time(),
               "checkpoint": self._store.url(step)}
        self._store.write_marker(COMPLETED, json.dumps(doc).encode())

    def forget_completed(self) -> None:
        """Remove the record of `mark_completed`: the run goes on (``--resume``), and until it ends again
        it resumes by default, as an interrupted run does."""
        self._store.remove_marker(COMPLETED)

    def move_aside(self, dest: str) -> list[str]:
        """Move every checkpoint folder and the ``COMPLETED`` marker into the folder ``dest`` on the same
        filesystem (``--fresh``: a new run starts from step 0, the old one's checkpoints are kept there);
        returns the names moved."""
        try:
            return self._store.move_to(dest, [COMPLETED])
        except OSError as e:
            raise CheckpointError(f"could not move the checkpoints under {self.url} to {dest} ({e}); check "
                                  "that both are writable (nothing was deleted)") from e

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints whose files have the committed sizes, oldest first."""
        return [info for info in map(self._info, self._store.steps()) if info is not None]

    def newest_folder(self) -> int:
        """The step of the newest checkpoint folder, committed or not (0: none): the newest a process
        starting now could find (`restore`'s ``at_most``)."""
        return max(self._store.steps(), default=0)

    def latest(self) -> CheckpointInfo | None:
        """The newest entry of `list` (sha256 not checked: `restore` does that)."""
        for step in reversed(self._store.steps()):
            info = self._info(step)
            if info is not None:
                return info
        return None

    def _info(self, step: int) -> CheckpointInfo | None:
        try:
            return self._store.info(step)
        except CorruptCheckpointError:
            return None

    def _prune(self, step: int) -> None:
        """Delete the uncommitted folders and the committed checkpoints past ``keep`` older than ``step``
        (committed). A store that fails to answer here deletes nothing and warns: training goes on."""
        try:
            older = [s for s in self._store.steps() if s < step]
            complete = [s for s in older if self._info(s) is not None] + [step]
        except (OSError, CheckpointError) as e:
            warnings.warn(f"checkpoint {self._store.url(step)} is committed, but the older ones under "
                          f"{self.url} could not be listed to delete those past keep={self.keep} ({e}); they "
                          "are kept, and the next save tries again", CheckpointWarning, stacklevel=3)
            return
        doomed = sorted(set(older) - set(complete)) + (complete[: -self.keep] if self.keep else [])
        for s in doomed:
            try:
                self._store.remove(s)
            except OSError as e:  # the new checkpoint is committed; a leftover must not stop training
                warnings.warn(f"could not delete old checkpoint {self._store.url(s)} ({e}); delete it "
                              "by hand", CheckpointWarning, stacklevel=3)
