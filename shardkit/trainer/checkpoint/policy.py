"""``ctx.checkpoint``: the job's `CheckpointManager` with the objects it saves, and the writer decision."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from shardkit.errors import CheckpointError, CheckpointWarning, ConfigError
from shardkit.job import protocol as p
from shardkit.trainer._setup import int_env

if TYPE_CHECKING:
    from shardkit.trainer._context import TrainContext
    from shardkit.trainer.checkpoint import CheckpointManager, Restored
    from shardkit.trainer.rerun import Rerun

__all__ = ["Checkpoints"]

_OBJECTS = ("model", "optimizer", "reader", "tf_checkpoint")
LATENESS = 0.02  # a time-based save in a job of several processes comes at most this x every_seconds late
MAX_STEPS_BETWEEN = 1000  # steps between two exchanges of the chief's decision, at most


@runtime_checkable
class TracksReaders(Protocol):
    """An "optimizer" that every worker updates at its own pace and that knows, for its state, where each
    worker's reader was: `shardkit.trainer.strategies.torch_ps.ParameterServerClient`."""

    def state_dict_with_readers(self) -> tuple[dict[str, Any], list[dict[str, Any] | None]]: ...

    def load_reader_states(self, states: Sequence[Mapping[str, Any] | None]) -> None: ...


class _Taken:
    """A state taken already, saved as it is."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> Mapping[str, Any]:
        return self.state


class Checkpoints:
    """The job's checkpoints as seen from one process (``ctx.checkpoint``).

    Example:
        >>> step = ctx.checkpoint.restore(model=model, optimizer=opt, reader=reader)   # 0 when none
        >>> ctx.checkpoint.extra["best_accuracy"] = 0.97                              # saved with each one

    `restore` registers the objects; from then on ``ctx.step`` saves them when the config's
    ``checkpoint.every_steps`` / ``every_seconds`` say so, and ``ctx.finish`` saves the last step. Only
    the chief (rank 0) writes; the other processes call the same methods at the same steps (TensorFlow
    MultiWorkerMirrored takes part in the save through collectives). Without a job config there is no
    checkpoint folder: `restore` returns 0 and nothing is saved.

    ``extra`` is saved as JSON with each checkpoint: str keys only (others raise `CheckpointError` at the
    save, since JSON would turn ``3`` into ``"3"``), and tuples come back as lists.

    RNG states: in a torch allreduce job of several processes every rank's are gathered at each save (a
    collective, with no pickle: JSON bytes in a tensor), and `restore` gives each rank its own. Where
    only the chief's are saved (TensorFlow), the other processes keep the RNGs as the script seeded them
    after a restore, with a `CheckpointWarning`, as every process does after a change of the number of
    processes (see `restore`).

    Reader positions: in a torch parameter-server job (``optimizer`` is a `TracksReaders`) each worker
    reads at its own pace, so the chief saves every worker's reader state as of the saved ps state (the
    ps take it together with the parameters: `torch_ps.ParameterServerClient.state_dict_with_readers`),
    and `restore` gives each worker its own (``state.json``'s ``reader_shards``, by data shard). Restored
    with another number of workers, every worker gets worker 0's, re-sharded, with a
    `CheckpointWarning` (see `CheckpointManager.restore`). Elsewhere the chief's reader state is every
    process's: allreduce ranks step together.

    ``every_seconds`` reads a clock, and processes read theirs at different moments, so in an
    allreduce job of several processes the chief's clock decides and the others learn its answer every
    few steps (`_chief_decides`: a time-based save comes about 2% of ``every_seconds`` late at most, and
    at most one message goes per step): torch broadcasts it (``torch.distributed``); TensorFlow sums it
    over the workers with an all-reduce of the job's ``MultiWorkerMirroredStrategy``
    (`share_decisions`, which `shardkit.trainer.strategies.tf.strategy` calls). ``every_steps`` alone needs no
    message.
    """

    def __init__(self, ctx: TrainContext) -> None:
        self._ctx = ctx
        self.objects: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.restored: Restored | None = None
        self.manager: CheckpointManager | None = None
        self._due_cache: tuple[int, bool] | None = None
        self._tf_strategy: Any = None  # a MultiWorkerMirroredStrategy that tells the chief's answers
        self._tf_agree: Any = None  # its all-reduce, a tf.function made at the first exchange
        self._next_exchange = 0  # the step of the next exchange of the chief's decision
        self._pending: int | None = None  # the step of a save(commit=False) not committed yet
        self._last_exchange: tuple[int, float] | None = None  # (step, time) of the chief's last one
        config = ctx.config
        if config is None:
            return
        from shardkit.trainer.checkpoint import CheckpointManager

        c = config.checkpoint
        self.manager = CheckpointManager(config.checkpoint_dir, keep=c.keep, every_steps=c.every_steps,
                                         every_seconds=c.every_seconds)

    @property
    def url(self) -> str | None:
        """The checkpoint folder (None without a job config)."""
        return self.manager.url if self.manager is not None else None

    def track(self, **objects: Any) -> None:
        """Register objects to save (``model``, ``optimizer``, ``reader``, ``tf_checkpoint``) without
        restoring (`restore` does both)."""
        unknown = sorted(set(objects) - set(_OBJECTS))
        if unknown:
            raise TypeError(f"ctx.checkpoint: unknown object(s) {unknown}; use {', '.join(_OBJECTS)}")
        self.objects.update({k: v for k, v in objects.items() if v is not None})

    def restore(self, *, model: Any = None, optimizer: Any = None, reader: Any = None,
                tf_checkpoint: Any = None, rng: bool = True) -> int:
        """Load the newest complete checkpoint into the objects and register them; the restored step or 0.

        The step count of ``ctx`` continues from the restored step. A reader (or loader) continues
        the epoch where the checkpoint was taken. ``rng=True``: each rank of a torch allreduce job gets
        its own saved RNG states (every rank's are saved). A process with no saved states of its own
        keeps the RNGs as the script seeded them, with a `CheckpointWarning`: every rank when the job
        resumes with another number of processes; in other jobs, where only the chief's states are
        saved, every process but the chief. See `CheckpointManager.restore` for which checkpoint is
        chosen (a broken newer one is skipped with a warning).

        A run that completed (`shardkit.trainer.rerun`): inside ``shardkit train`` the supervisor has
        decided already (refused it, or left it to resume), so its checkpoint is restored. In a script
        started by hand, a completed run is not resumed silently: `CompletedRunError` names it, when it
        ended and the choices, unless ``SHARDKIT_RERUN`` says ``resume`` (continue it) or ``fresh`` (the
        chief moves its checkpoints to ``<logdir>/previous/<time>/``; every process starts at step 0,
        whatever was there). Started by hand, the chief prints the checkpoint it resumed on stderr.

        Raises:
            CompletedRunError: by hand, a completed run and no ``SHARDKIT_RERUN``.
        """
        self.track(model=model, optimizer=optimizer, reader=reader, tf_checkpoint=tf_checkpoint)
        if self.manager is None:
            return 0
        by_hand = p.ENV_ROLE not in os.environ
        done = self._by_hand_rerun() if by_hand else None
        if done == "fresh":
            self._ctx._beat("alive", checkpoint="", paced=False)
            return 0
        rank, world = self._rng_place()
        ctx = self._ctx
        shard = None
        if ctx.data_shard is not None and ctx.num_data_shards:
            shard = (ctx.data_shard, ctx.num_data_shards)
        at_most = int_env(p.ENV_RESUME_STEP, None)  # the attempt's checkpoint (`shardkit.cluster._spec`)
        restored = self.manager.restore(**self.objects, rng=rng, rank=rank, world_size=world,
                                        reader_shard=shard, at_most=at_most)
        self.restored = restored
        if restored is None:
            self._ctx._beat("alive", checkpoint="", paced=False)  # for the supervisor: none restored
            return 0
        tracker = self.objects.get("optimizer")
        if isinstance(tracker, TracksReaders) and restored.reader_shards is not None:
            tracker.load_reader_states(restored.reader_shards)  # for workers that save before they push
        self.extra = dict(restored.extra)
        self._ctx.step_count = restored.step
        self._ctx._beat("alive", checkpoint=restored.url, paced=False)  # which one, for the supervisor
        if by_hand and self._ctx.is_chief:
            what = ("the run that completed there (SHARDKIT_RERUN=resume)" if done == "resume"
                    else "an unfinished run")
            print(f"shardkit: resumed checkpoint step {restored.step} ({restored.url}) of {what}",
                  file=sys.stderr, flush=True)
        return restored.step

    def _by_hand_rerun(self) -> Rerun | None:
        """A script started by hand: what ``$SHARDKIT_RERUN`` says to do with a completed run, done.

        Returns ``"fresh"`` (start at step 0: the chief moved the checkpoints aside), ``"resume"`` (a
        completed run goes on: the chief removed its marker) or None (nothing completed: resume as usual).
        """
        from shardkit.trainer import rerun

        config, manager = self._ctx.config, self.manager
        if config is None or manager is None:
            return None
        choice = rerun.rerun_from_env()
        if choice == "fresh":
            if self._ctx.is_chief:
                dest = rerun.checkpoints_aside(config, rerun.aside_dir(config))
                if manager.move_aside(dest):
                    print(f"shardkit: SHARDKIT_RERUN=fresh: a new run from step 0; the earlier run's "
                          f"checkpoints are in {dest}", file=sys.stderr, flush=True)
            return "fresh"
        done = manager.completed()
        if done is None:
            return None
        if choice == "refuse":
            changed = rerun.changes(rerun.previous_job(config.logdir), config.redacted())
            raise rerun.refusal(config, done, changed, by_hand=True)
        if self._ctx.is_chief:
            manager.forget_completed()
        return "resume"

    def mark_completed(self) -> None:
        """The chief records that the run ended at the current step (`CheckpointManager.mark_completed`),
        when its last save (or restore) is of that step: a run that ends past its last checkpoint
        (``finish(save=False)``) has something left to train from it. A failure to write it is a
        `CheckpointWarning` (the run's checkpoints stand, but starting it again would then resume the
        last one silently)."""
        step = self._ctx.step_count
        if (self.manager is None or not self.objects or not self._ctx.is_chief or step <= 0
                or self.manager.schedule.last_step != step):
            return
        try:
            self.manager.mark_completed(step)
        except (CheckpointError, OSError) as e:
            warnings.warn(f"could not record that the run completed at step {step} under {self.manager.url} "
                          f"({e}); started again, it would resume its last checkpoint: start it with "
                          "--fresh then", CheckpointWarning, stacklevel=2)

    def due(self, step: int) -> bool:
        """Whether ``ctx.step`` saves at ``step``; the same answer on every process of the job.

        With ``every_seconds`` in an allreduce job of several processes, the chief's clock decides (see
        the class docstring): then every process must call this (``ctx.step`` does) for each step.

        Raises:
            ConfigError: ``every_seconds`` in a TensorFlow allreduce job of several processes whose
                strategy was not made by `shardkit.trainer.strategies.tf.strategy` nor given to
                `share_decisions`.
        """
        if self.manager is None or not self.objects:
            return False
        if self._due_cache is not None and self._due_cache[0] == step:
            return self._due_cache[1]
        due = self.manager.due(step)
        every_seconds = self.manager.schedule.every_seconds
        if every_seconds is not None and self._processes() > 1:
            by_steps = self.manager.due(step, now=-math.inf)  # what every process knows alike
            due = self._chief_decides(step, due, by_steps, every_seconds)
        self._due_cache = (step, due)
        return due

    def _chief_decides(self, step: int, due: bool, by_steps: bool, every_seconds: float) -> bool:
        """``due`` as the chief sees it, told to the others every few steps (the chief says how many).

        Between exchanges only ``every_steps`` counts (every process knows the step). At an exchange the
        chief sends its clock's answer and the number of steps to the next exchange: about `LATENESS` x
        ``every_seconds`` at the recent step time (at most `MAX_STEPS_BETWEEN`). So a time-based save
        comes about that much late at most (more if steps slow down suddenly), and fast steps do not
        pay a message each.
        """
        if step < self._next_exchange:
            return by_steps
        mine = (0, 0)
        if self._decides():
            now, steps = time.monotonic(), 1
            if self._last_exchange is not None and step > self._last_exchange[0]:
                per_step = (now - self._last_exchange[1]) / (step - self._last_exchange[0])
                steps = max(1, min(MAX_STEPS_BETWEEN, int(LATENESS * every_seconds / max(per_step, 1e-9))))
            self._last_exchange = (step, now)
            mine = (1 if due else 0, steps)
        told, steps = self._tell(mine)
        self._next_exchange = step + max(1, steps)
        return by_steps or told > 0

    def _tell(self, mine: tuple[int, int]) -> tuple[int, int]:
        """The chief's ``(due, steps)`` on every process (the others pass zeros)."""
        if self._ctx.framework == "torch":
            import torch
            import torch.distributed as dist

            values = torch.tensor(mine, dtype=torch.int64, device=self._ctx.device)
            dist.broadcast(values, src=0)
            due, steps = values.tolist()
            return int(due), int(steps)
        if self._tf_strategy is None:
            raise ConfigError(
                "checkpoint.every_seconds in a TensorFlow allreduce job of several workers: the workers "
                "must agree on the step to save, through the job's strategy. Make it with "
                "shardkit.trainer.strategies.tf.strategy(ctx), or pass yours to "
                "ctx.checkpoint.share_decisions(strategy) before the first ctx.step; or use "
                "checkpoint.every_steps")
        import tensorflow as tf

        if self._tf_agree is None:
            strategy = self._tf_strategy

            def agree(values: Any) -> Any:  # the chief's values summed with every other worker's zeros
                return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(tf.identity, args=(values,)),
                                       axis=None)

            self._tf_agree = tf.function(agree, input_signature=[tf.TensorSpec([2], tf.float32)])
        due, steps = self._tf_agree(tf.constant(mine, tf.float32)).numpy().tolist()
        return round(due), round(steps)

    def share_decisions(self, strategy: Any) -> None:
        """Tell the workers the chief's checkpoint decisions through ``strategy`` (a
        ``MultiWorkerMirroredStrategy``; see `due`).

        `shardkit.trainer.strategies.tf.strategy` calls it; call it yourself with a strategy you make
        otherwise,
        before the first ``ctx.step``. Only ``checkpoint.every_seconds`` needs it.
        """
        self._tf_strategy, self._tf_agree = strategy, None

    def _decides(self) -> bool:
        """Whether this process's clock decides: rank 0 of torch (the broadcast's source), else the chief."""
        if self._ctx.framework == "torch":
            import torch.distributed as dist

            return dist.get_rank() == 0
        return self._ctx.is_chief

    def _processes(self) -> int:
        """How many processes must save together: those of an allreduce job (1 for other strategies)."""
        ctx = self._ctx
        if ctx.strategy != "allreduce":
            return 1
        if ctx.framework == "torch":
            import torch.distributed as dist

            return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return ctx.num_data_shards or 1

    def _rng_place(self) -> tuple[int, int]:
        """This process's (rank, world size) as a checkpoint's RNG states count them: torch allreduce's
        ranks, whose states are all saved; elsewhere only the chief's are, as rank 0, and any other
        process has a rank past it."""
        ctx = self._ctx
        processes = self._processes()
        if ctx.framework == "torch" and processes > 1:
            import torch.distributed as dist

            return dist.get_rank(), processes
        world = max(processes, ctx.world_size, 1)
        if ctx.is_chief:
            return 0, world
        return max(ctx.rank, 1), max(world, ctx.rank + 1, 2)

    def _gather_rng(self) -> list[dict[str, Any]]:
        """Every rank's `capture_rng`, in rank order, on every rank (torch allreduce), never pickled: each
        rank's JSON bytes in a uint8 tensor on ``ctx.device``; one all_gather of the lengths, then one of
        the bytes padded to the longest."""
        import torch
        import torch.distributed as dist

        from shardkit.trainer.checkpoint._state import capture_rng, check_rng

        device = self._ctx.device if self._ctx.device is not None else torch.device("cpu")
        world = dist.get_world_size()
        data = json.dumps(capture_rng(), separators=(",", ":")).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size)
        lengths = [int(n.item()) for n in sizes]
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(device)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        return [check_rng(json.loads(bytes(part[:n].cpu().numpy().tobytes())))
                for part, n in zip(parts, lengths, strict=True)]

    def pending(self, step: int, *, again: bool = False) -> bool:
        """Whether ``step`` has objects to save and has not been saved (or restored) already; with
        ``again``, also when it has (its objects changed since: a torch parameter server's state, which
        the other workers update)."""
        return (self.manager is not None and bool(self.objects)
                and step > (0 if again else self.manager.schedule.last_step))

    def save(self, step: int | None = None, *, extra: dict[str, Any] | None = None,
             commit: bool = True) -> str | None:
        """Save the registered objects as ``step`` (default: the current step); the URL on the writer
        (the chief), None elsewhere. Every process of an allreduce job calls it at the same step (torch:
        the ranks' RNG states are gathered then). ``extra``: see the class docstring.

        ``commit=False`` (``ctx.step``'s scheduled saves): the files are written now, the checkpoint is
        committed by `commit_pending` when the script is done with the step. A step saved so and not
        committed yet is committed first."""
        if self.manager is None:
            return None
        url = self.commit_pending()
        if url is not None:
            self._ctx._beat("checkpoint", checkpoint=url)
        if extra is not None:
            self.extra.update(extra)
        step = self._ctx.step_count if step is None else step
        rng_ranks = self._gather_rng() if self._ctx.framework == "torch" and self._processes() > 1 else None
        objects, reader_shards = self._with_reader_shards()
        where = self.manager.save(step, **objects, extra=self.extra, writer=self._ctx.is_chief,
                                  rng_ranks=rng_ranks, reader_shards=reader_shards, commit=commit)
        if not commit:
            self._pending = step
        return where

    def commit_pending(self) -> str | None:
        """Commit the step that ``save(commit=False)`` wrote, now that the script is done with it; its URL
        on the writer, None elsewhere or when none is pending. ``ctx.step`` calls it as the next step
        is counted, and ``ctx.finish`` before the last save.

        Why a scheduled save is committed one step late: ``ctx.step(s)`` runs inside step ``s`` of the
        script, and what the script does after it (record the ids it trained, log, push metrics) is part
        of step ``s`` too. Committed inside ``ctx.step(s)``, the checkpoint was the newest as soon as it
        was written: a process that died before the rest of step ``s`` ran (SIGKILLed there, or stopped
        by the supervisor because a peer was killed meanwhile; in an allreduce job the others are past
        the save's collective and finish step ``s`` while the chief writes) left a checkpoint that
        resumes at step ``s + 1``, so the end of step ``s`` was in no attempt's lineage: a run lost the
        record of a trained batch that way. Committed when the next step is counted, every process has
        finished step ``s`` first: in a torch allreduce job of several processes a barrier here makes
        sure of it for every rank (the writer's own order does for it); where one is killed before
        that, the checkpoint stays uncommitted and the attempt resumes from the one before, redoing
        those steps.
        """
        if self._pending is None or self.manager is None:
            return None
        self._pending = None
        if self._ctx.framework == "torch" and self._processes() > 1:
            import torch
            import torch.distributed as dist

            # a barrier (as an all-reduce on the job's device: NCCL's barrier guesses one): every rank is
            # done with the step before it may be the newest checkpoint. It beats while it waits: at
            # `finish` a rank may wait here for another's evaluation (minutes, it may be)
            zero = torch.zeros(1, dtype=torch.int64, device=self._ctx.device)
            self._ctx._wait_beating(dist.all_reduce(zero, async_op=True))
        return self.manager.commit_pending()

    def fail_pending(self) -> str | None:
        """A process failing (an exception out of ``with ctx``) with a save not committed yet: alone in
        its job, it commits it and returns its URL, as the error came from the script after
        ``ctx.step`` (the next step, most often: a failing step does not cost the checkpoint before
        it). With other processes it is left uncommitted (a restore skips it for the one before),
        since another process may still be in the rest of the saved step: committing it here would
        bring back the loss `commit_pending` prevents. A commit that fails here warns: the error on
        its way out is the one to see."""
        if self._pending is None or self.manager is None:
            return None
        ctx = self._ctx
        if self._processes() > 1 or ctx.world_size > 1 or (ctx.num_data_shards or 1) > 1:
            self._pending = None
            self.manager.discard_pending()
            return None
        try:
            return self.commit_pending()
        except (CheckpointError, OSError) as e:
            warnings.warn(f"could not commit the checkpoint of step {ctx.step_count} under "
                          f"{self.manager.url} as the script failed ({e}); the job resumes from the one "
                          "before",
                          CheckpointWarning, stacklevel=2)
            return None

    def _with_reader_shards(self) -> tuple[dict[str, Any], list[dict[str, Any] | None] | None]:
        """The objects to save and every worker's reader state, taken with the ps state (chief of a torch
        parameter-server job); elsewhere the objects as they are, and None. Reader states are saved
        as inside their pass (`_in_pass`)."""
        objects = dict(self.objects)
        reader = objects.get("reader")
        if reader is not None:
            objects["reader"] = _Taken(_in_pass(reader.state_dict()))
        tracker = objects.get("optimizer")
        if not self._ctx.is_chief or not isinstance(tracker, TracksReaders):
            return objects, None
        state, readers = tracker.state_dict_with_readers()
        readers = [None if r is None else _in_pass(r) for r in readers]
        objects["optimizer"] = _Taken(state)
        if "reader" not in objects:
            return objects, None
        mine = readers[self._ctx.data_shard or 0] if (self._ctx.data_shard or 0) < len(readers) else None
        if mine is not None:  # the chief's own, as of the same state (a push of its own may be in flight)
            objects["reader"] = _Taken(mine)
        return objects, readers


def _in_pass(state: Mapping[str, Any]) -> dict[str, Any]:
    """A loader's state (``shardkit.torch.make_loader``) as saved inside its pass, never after it ended.

    Such a state says whether its pass had ended (``pass_done``): one that had resumes with a new pass
    (``num_epochs`` more epochs, for a loop over epochs that saves after each). A job's checkpoint is
    resumed by the same script from the top, whose ``for batch in loader`` is the rest of the job: it
    must read what is left of ``num_epochs`` and, from the final checkpoint (``ctx.finish``, after the
    loop), nothing; so the trainer saves every state as inside its pass."""
    return {**state, "pass_done": False} if state.get("pass_done") else dict(state)
