"""``ctx.checkpoint``: the job's `CheckpointManager` with the objects it saves, and the writer decision."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardkit.trainer.checkpoint import CheckpointManager, Restored
    from shardkit.trainer.context import TrainContext

__all__ = ["Checkpoints"]

_OBJECTS = ("model", "optimizer", "reader", "tf_checkpoint")


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
    """

    def __init__(self, ctx: TrainContext) -> None:
        self._ctx = ctx
        self.objects: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.restored: Restored | None = None
        self.manager: CheckpointManager | None = None
        self._due_cache: tuple[int, bool] | None = None
        config = ctx.config
        if config is None:
            return
        from shardkit.trainer.checkpoint import CheckpointManager

        c = config.checkpoint
        every_seconds = c.every_seconds
        if every_seconds is not None and config.framework == "tensorflow" and config.strategy == "allreduce" \
                and (ctx.num_data_shards or 1) > 1:
            warnings.warn("checkpoint.every_seconds is ignored in a multi-process TensorFlow allreduce job: "
                          "the workers cannot agree on the step without a collective. Use "
                          "checkpoint.every_steps", UserWarning, stacklevel=3)
            every_seconds = None
        self.manager = CheckpointManager(config.checkpoint_dir, keep=c.keep, every_steps=c.every_steps,
                                         every_seconds=every_seconds)

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
        the epoch where the checkpoint was taken. See `CheckpointManager.restore` for which
        checkpoint is chosen (a broken newer one is skipped with a warning) and for ``rng``.
        """
        self.track(model=model, optimizer=optimizer, reader=reader, tf_checkpoint=tf_checkpoint)
        if self.manager is None:
            return 0
        restored = self.manager.restore(**self.objects, rng=rng)
        self.restored = restored
        if restored is None:
            return 0
        self.extra = dict(restored.extra)
        self._ctx.step_count = restored.step
        return restored.step

    def due(self, step: int) -> bool:
        """Whether ``ctx.step`` saves at ``step``; the same answer on every process of the job.

        With ``every_seconds`` in a torch allreduce job of several ranks, rank 0's clock decides and
        the answer is broadcast: then every rank must call this (``ctx.step`` does) for each step.
        """
        if self.manager is None or not self.objects:
            return False
        if self._due_cache is not None and self._due_cache[0] == step:
            return self._due_cache[1]
        due = self.manager.due(step)
        if self.manager.schedule.every_seconds is not None and self._collective():
            import torch
            import torch.distributed as dist

            flag = torch.tensor([1 if due else 0], dtype=torch.uint8, device=self._ctx.device)
            dist.broadcast(flag, src=0)
            due = bool(flag.item())
        self._due_cache = (step, due)
        return due

    def pending(self, step: int) -> bool:
        """Whether ``step`` has objects to save and has not been saved (or restored) already."""
        return self.manager is not None and bool(self.objects) and step > self.manager.schedule.last_step

    def save(self, step: int | None = None, *, extra: dict[str, Any] | None = None) -> str | None:
        """Save the registered objects as ``step`` (default: the current step); the URL on the writer
        (the chief), None elsewhere. Every process of an allreduce job calls it at the same step."""
        if self.manager is None:
            return None
        if extra is not None:
            self.extra.update(extra)
        step = self._ctx.step_count if step is None else step
        return self.manager.save(step, **self.objects, extra=self.extra, writer=self._ctx.is_chief)

    def _collective(self) -> bool:
        ctx = self._ctx
        if (ctx.framework, ctx.strategy) != ("torch", "allreduce") or ctx.world_size <= 1:
            return False
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
