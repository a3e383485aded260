"""`init()` -> `TrainContext`: a training script's place in its job, its data, checkpoints and heartbeats."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from shardkit.errors import ConfigError
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig
from shardkit.trainer._heartbeat import Beacon
from shardkit.trainer._setup import (
    CONFIG_ENV,
    check_place,
    init_torch_allreduce,
    int_env,
    load_job_config,
    serve_if_server,
)
from shardkit.trainer.checkpoint.policy import Checkpoints

if TYPE_CHECKING:
    from shardkit.reader.reader import Reader

__all__ = ["CONFIG_ENV", "TrainContext", "init"]

_LOADER_KEYS = frozenset({"device", "pin_memory", "collate"})
_DATASET_KEYS = frozenset({"label", "features", "collate", "prefetch"})


VALID = "__valid__"  # the mask column of a reader's batches with remainder="mask"


def batch_samples(batch: Mapping[str, Any]) -> int:
    """The samples a batch holds: its ``__valid__`` rows (``remainder="mask"``), else its first column's rows
    (numpy arrays, torch or tf tensors, jax arrays, lists)."""
    valid = batch.get(VALID)
    if valid is not None:
        return int(valid.sum()) if hasattr(valid, "sum") else sum(bool(v) for v in valid)
    for value in batch.values():
        return len(value)
    return 0


class TrainContext:
    """What `init` returns: this process's rank and role, its data, checkpoints and heartbeats.

    Attributes: ``rank``, ``world_size``, ``local_rank`` (torch.distributed's, or this process's
    data shard for TensorFlow), ``role`` (``worker``, ``ps``, ``chief``, ``evaluator``), ``role_index``,
    ``attempt`` (0, then 1 after the first restart), ``is_chief`` (the process that writes
    checkpoints), ``params`` (the config's free-form ``params``), ``config`` (the `JobConfig`, or
    None), ``checkpoint`` (`Checkpoints`), ``step_count`` (steps counted, from the restored step on).
    """

    def __init__(self, *, config: JobConfig | None, role: str, role_index: int, attempt: int, rank: int,
                 world_size: int, local_rank: int, data_shard: int | None, num_data_shards: int | None,
                 heartbeat_addr: str | None) -> None:
        self.config = config
        self.role, self.role_index, self.attempt = role, role_index, attempt
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.data_shard, self.num_data_shards = data_shard, num_data_shards
        self.params: Mapping[str, Any] = dict(config.params) if config is not None else {}
        self.framework = config.framework if config is not None else None
        self.strategy = config.strategy if config is not None else None
        roles = config.roles if config is not None else {}
        if role == "chief" or "chief" in roles:
            self.is_chief = role == "chief"
        else:
            self.is_chief = role == "worker" and role_index == 0
        ft = config.fault_tolerance if config is not None else None
        self.heartbeat_interval = ft.heartbeat_interval if ft is not None else 1.0
        self.heartbeat_timeout: float | None = ft.heartbeat_timeout if ft is not None else None
        self.step_count = 0
        self.samples = 0
        self.metrics: Mapping[str, Any] = {}
        self.device: Any = None  # set by init for torch allreduce: the torch.device of this rank
        self._beacon = Beacon(heartbeat_addr, role=role, index=role_index, attempt=attempt)
        self._readers: list[Any] = []
        self._finish_hooks: list[Callable[[], bool]] = []
        self._owns_process_group = False
        self._finished = False
        self._last_beat = -math.inf
        self._clocks: list[Any] = []  # the WaitClocks of the readers made here and of `timed` (data wait)
        self._waited = (time.monotonic(), 0.0)  # when data_wait was last measured, and the seconds by then
        self._last_wait: dict[str, float] | None = None  # the last step beat's _data_waits
        self._blocked = (0.0, 0.0)  # the readers' read_blocked and stage_blocked seconds by then
        self._step_seconds: float | None = None  # a step's usual time (a moving average), for stall reports
        self._last_step_at: float | None = None
        self._watcher: _StallWatcher | None = None
        self.checkpoint = Checkpoints(self)

    def __repr__(self) -> str:
        return (f"TrainContext(role={self.role!r}, index={self.role_index}, "
                f"rank={self.rank}/{self.world_size}, attempt={self.attempt}, step={self.step_count})")

    # -- data ------------------------------------------------------------------------------------------
    def reader_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """The `make_reader` arguments of this process's shard of ``config.data`` with ``overrides``: of a
        mixture (``data.sources``), ``url`` is the dict of its sources' URLs, with ``weights`` and
        ``samples_per_epoch`` (`shardkit.job.config.DataConfig.reader_kwargs`)."""
        kwargs: dict[str, Any] = {}
        data = self.config.data if self.config is not None else None
        if data is not None:
            kwargs = data.reader_kwargs()  # a mixture's: its sources' URLs, weights and own options
            if "url" in overrides and data.sources is not None:  # another dataset in the mixture's place
                for key in ("weights", "samples_per_epoch", "filter", "version", "storage_options"):
                    if key not in data.options:
                        kwargs.pop(key, None)
        shard = (self.data_shard, self.num_data_shards) if self.data_shard is not None else (0, 1)
        kwargs["shard"], kwargs["num_shards"] = shard
        kwargs.update(overrides)
        if kwargs.get("url") is None:
            raise ConfigError("ctx.reader(): the job config has no data section, so there is nothing to "
                              "read. Fix: add data: {url: path/to/dataset} to the job config, or pass url=")
        return kwargs

    def reader(self, **overrides: Any) -> Reader:
        """`shardkit.make_reader` over ``config.data`` for this process's shard (see `reader_kwargs`).

        Example:
            >>> reader = ctx.reader()                                   # this rank's shard of the job data
            >>> test = ctx.reader(filter=[("split", "=", "test")], shard=0, num_shards=1, shuffle=False)

        With ``data.sources`` in the config, a `shardkit.reader.MixedReader` of them; checkpoints hold its
        state as a reader's (`Checkpoints` saves and restores it alike).

        Roles that read no job data (an evaluator) get the whole dataset (shard 0 of 1). The reader is
        closed by `finish`.
        """
        from shardkit.reader.api import make_reader

        kwargs = self.reader_kwargs(**overrides)
        reader = make_reader(kwargs.pop("url"), **kwargs)
        self._readers.append(reader)
        self._watch(reader.waited)
        return reader

    def torch_loader(self, **overrides: Any) -> Any:
        """``shardkit.reader.adapters.torch.make_loader`` over `reader` (``device``, ``pin_memory``,
        ``collate`` go
        to the loader, the rest to the reader)."""
        from shardkit.reader.adapters.torch import make_loader

        loader_kwargs = {k: v for k, v in overrides.items() if k in _LOADER_KEYS}
        reader = self.reader(**{k: v for k, v in overrides.items() if k not in _LOADER_KEYS})
        return make_loader(reader, **loader_kwargs)

    def tf_dataset(self, **overrides: Any) -> Any:
        """``shardkit.reader.adapters.tf.make_dataset`` over `reader` (``label``, ``features``, ``collate``,
        ``prefetch`` go to the dataset, the rest to the reader)."""
        from shardkit.reader.adapters.tf import make_dataset

        dataset_kwargs = {k: v for k, v in overrides.items() if k in _DATASET_KEYS}
        reader = self.reader(**{k: v for k, v in overrides.items() if k not in _DATASET_KEYS})
        # tf.data reads it ahead in its own threads: the reader's time is not the loop's wait (`timed`)
        self._clocks.remove(reader.waited)  # (and no stall report: the loop does not wait in it)
        return make_dataset(reader, **dataset_kwargs)

    # -- progress --------------------------------------------------------------------------------------
    def step(self, metrics: Mapping[str, Any] | None = None, *, samples: int | Mapping[str, Any] = 0) -> int:
        """Count one training step: heartbeat (at most every ``heartbeat_interval``) and checkpoint when due.

        Example:
            >>> for batch in reader:
            ...     loss = train_step(batch)
            ...     ctx.step({"loss": loss}, samples=batch)   # or samples=len(batch["label"])

        ``samples``: the samples this step trained, or the batch itself, which counts its valid rows
        (with ``remainder="mask"``, its ``__valid__`` rows; else the rows of its first column), so that
        the job's sample counts leave masked rows out.

        Every process of an allreduce job must call it once per step (the checkpoint decision is the
        same on all of them; rank 0 / the chief writes). Metric values may be tensors: they are read
        only when a heartbeat goes out. Returns the new step number.

        A checkpoint due at step ``s`` is written here, with the objects as they are now, and committed
        (restorable) when the next step is counted or at `finish`: what the script does after
        ``ctx.step`` in step ``s`` (recording what it trained, say) belongs to step ``s``, and a process
        killed before the end of step ``s`` resumes from the checkpoint before (see
        `shardkit.trainer.checkpoint.policy.Checkpoints.commit_pending`).
        """
        # The step saved at the previous call is over only now (see `Checkpoints.commit_pending`): commit
        # it before this one is counted, so that its heartbeat tells the step and samples it holds.
        url = self.checkpoint.commit_pending()
        if url is not None:
            self._beat("checkpoint", checkpoint=url)
        self.step_count += 1
        now = time.monotonic()
        if self._last_step_at is not None:  # the usual step, for a stall report (`_StallWatcher`)
            took = now - self._last_step_at
            self._step_seconds = took if self._step_seconds is None else 0.9 * self._step_seconds + 0.1 * took
        self._last_step_at = now
        self.samples += batch_samples(samples) if isinstance(samples, Mapping) else int(samples)
        if metrics is not None:
            self.metrics = metrics
        step = self.step_count
        if self.checkpoint.due(step):
            self._beat("step")  # a save may take a while: show progress first
            self.checkpoint.save(step, commit=False)  # committed at the next step, or by finish
        elif time.monotonic() - self._last_beat >= self.heartbeat_interval:
            self._beat("step")
        return step

    def heartbeat(self, kind: str = "alive") -> None:
        """Tell the supervisor this process is alive (call it during long work between steps)."""
        self._beat(kind if kind in p.HEARTBEAT_KINDS else "alive")  # type: ignore[arg-type]

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches`` (any iterable: a DataLoader of your own, a tf.data iterator), timed for the job's
        ``data_wait``: the seconds each batch took to come count as waiting for data.

        Example:
            >>> loader = DataLoader(ShardkitIterableDataset(url), batch_size=None, num_workers=2)
            >>> for batch in ctx.timed(loader):
            ...     ctx.step({"loss": train_step(batch)}, samples=batch)

        The readers `reader` and `torch_loader` make are timed already.
        """
        from shardkit.reader._clock import WaitClock, timed

        clock = WaitClock()
        self._watch(clock)
        return timed(iter(batches), clock)

    def _watch(self, clock: Any) -> None:
        """Count ``clock`` in ``data_wait``, and report a stall on it (`_StallWatcher`)."""
        self._clocks.append(clock)
        if self._watcher is None:
            self._watcher = _StallWatcher(self)

    def data_wait(self) -> float | None:
        """The fraction of the time since the last call that this process spent waiting for batches of
        the readers it made (or of `timed`), 0..1; None when it reads through none of them. Sent with each
        step heartbeat as the metric ``data_wait`` (the progress line, TensorBoard, ``summary.json``)."""
        parts = self._data_waits()
        return None if parts is None else parts["data_wait"]

    def _data_waits(self) -> dict[str, float] | None:
        """`data_wait` since the last call, and its parts by what the readers were waiting for:
        ``data_wait/read`` (rows being read: fetch and Parquet) and ``data_wait/transform`` (the
        decode/transform stage), fractions of the same time (their rest: assembling batches, and loops
        of `timed`)."""
        if not self._clocks:
            return None
        now, seconds = time.monotonic(), float(sum(c.seconds for c in self._clocks))
        times = [r.times.seconds for r in self._readers if getattr(r, "times", None) is not None
                 and r.waited in self._clocks]
        read = float(sum(t["read_blocked"] for t in times))
        stage = float(sum(t["stage_blocked"] for t in times))
        (then, before), (read_before, stage_before) = self._waited, self._blocked
        if now <= then:
            return None
        self._waited, self._blocked = (now, seconds), (read, stage)
        span = now - then

        def share(x: float) -> float:
            return min(1.0, max(0.0, x / span))

        return {"data_wait": share(seconds - before), "data_wait/read": share(read - read_before),
                "data_wait/transform": share(stage - stage_before)}

    def _beat(self, kind: p.HeartbeatKind, checkpoint: str | None = None, *, paced: bool = True) -> None:
        """Send a heartbeat; ``paced=False``: one that does not count for the rate limit of step beats
        (the restore's: the first step beat must still go out, it times the first step). A step's carries
        ``data_wait`` since the last step heartbeat (and its parts, `_data_waits`) beside the script's
        metrics."""
        if kind != "start" and paced:  # "start" does not end the startup window either
            self._last_beat = time.monotonic()
        metrics = self.metrics
        if kind == "step":
            waits = self._data_waits()
            if waits is not None:
                self._last_wait = waits
        if self._last_wait is not None:  # the last step's, also on the beats between steps and at the end
            metrics = {**metrics, **self._last_wait}
        self._beacon.send(kind, step=self.step_count, samples=self.samples, metrics=metrics,
                          checkpoint=checkpoint)

    def on_finish(self, callback: Callable[[], bool]) -> None:
        """Have `finish` call ``callback()`` before its last save; it returns whether the tracked objects
        may have changed since the last save (then that save happens even for a step saved already).

        `shardkit.trainer.strategies.torch_ps.connect` registers the wait for the other workers' last pushes.
        """
        self._finish_hooks.append(callback)

    def finish(self, *, save: bool = True) -> None:
        """End training: run the `on_finish` callbacks, save a last checkpoint of the current step (unless
        ``save=False``, or it was just saved and no callback says the objects changed since, or nothing
        is tracked), record on the chief that the run completed (``<checkpoint dir>/COMPLETED``: started
        again, it is not resumed silently, see `shardkit.trainer.rerun`), send the final ``done``
        heartbeat, close the readers made by `reader` and end the torch process group `init` started
        once every rank has finished (a barrier: a rank that finishes first waits there for the others'
        last saves). Called by ``with ctx:`` on success.

        If a callback or the save raises, the process is failing: as `__exit__` on an exception, it sends
        the count it trained, and the exception goes on (no ``done``)."""
        if self._finished:
            return
        self._finished = True
        try:
            url = self.checkpoint.commit_pending()  # the last step saved by `step`: the script is done
            if url is not None:
                self._beat("checkpoint", checkpoint=url)
            changed = [hook() for hook in self._finish_hooks]  # a list: every callback runs
            if save and self.checkpoint.pending(self.step_count, again=any(changed)):
                url = self.checkpoint.save(self.step_count)
                if url is not None:
                    self._beat("checkpoint", checkpoint=url)
            self.checkpoint.mark_completed()  # started again, the run is not resumed silently
        except BaseException:
            restored = self.checkpoint.restored
            if self.step_count > (restored.step if restored is not None else 0):
                self._beat("step")  # the count trained (see __exit__)
            raise
        self._beat("done")
        self._close(together=True)

    def _close(self, *, together: bool = False) -> None:
        """Close the readers and end the torch process group `init` started; ``together`` (`finish`):
        after a barrier, so every rank ends the group at once, as `destroy_process_group` asks. A rank
        that left while another still saved its checkpoint aborted at exit in gloo's destructor
        (``terminate called without an active exception``, torch 2.13). A failing process does not
        wait: the others may never get there."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        for reader in self._readers:
            reader.close()
        self._readers.clear()
        if self._owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                if together:
                    self._wait_for_all(dist)
                dist.destroy_process_group()
            self._owns_process_group = False
        self._beacon.close()

    def _wait_for_all(self, dist: Any) -> None:
        """The barrier before the group ends, with an ``alive`` heartbeat each ``heartbeat_interval``
        while it waits, so the supervisor and the torchrun node monitor see a process waiting for the
        others' last steps, evaluation or save (minutes, it may be), not one that cannot exit."""
        self._wait_beating(dist.barrier(async_op=True))

    def _wait_beating(self, work: Any) -> None:
        """Wait for a collective's ``work`` (``async_op=True``), with an ``alive`` heartbeat each
        ``heartbeat_interval`` (`_wait_for_all`; the commit of a save, `Checkpoints.commit_pending`)."""
        while not work.is_completed():
            if time.monotonic() - self._last_beat >= self.heartbeat_interval:
                self._beat("alive")
            time.sleep(min(0.05, self.heartbeat_interval))
        work.wait()  # raises what the barrier met (a rank that died)

    def __enter__(self) -> TrainContext:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if exc_type is None:
            self.finish()
        elif not self._finished:  # the process is failing: no final checkpoint, no "done"
            self._finished = True
            url = self.checkpoint.fail_pending()  # alone: committed; with others, the one before serves
            if url is not None:
                self._beat("checkpoint", checkpoint=url)
            # Step heartbeats are rate-limited: the supervisor may not have heard of the last steps. If it
            # trained a step in this attempt, this one tells it the steps and samples trained (a process
            # killed by a signal cannot send it).
            restored = self.checkpoint.restored
            if self.step_count > (restored.step if restored is not None else 0):
                self._beat("step")
            self._close()
        return False


class _StallWatcher:
    """A thread that reports, on this process's stderr (the role's log and the job's console), a batch
    that is long in coming: no batch for ``max(2 s, 10 x the usual step)``, and at most half the
    ``heartbeat_timeout``, so the report comes before the supervisor's restart. It names what the
    reader is waiting for (rows being read, the decode/transform stage). Once per wait. It never
    sends a heartbeat: a stuck process must still be restarted."""

    EVERY = 0.25  # seconds between looks

    def __init__(self, ctx: TrainContext) -> None:
        self._ctx = ctx
        self._done = threading.Event()
        self._reported: set[tuple[int, float]] = set()  # (clock, the wait's start): reported once
        self._thread = threading.Thread(target=self._run, name="shardkit-stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def after(self) -> float:
        """Seconds without a batch that make a stall."""
        step = self._ctx._step_seconds
        limit = max(2.0, 10 * step) if step is not None else 2.0
        timeout = self._ctx.heartbeat_timeout
        return min(limit, timeout / 2) if timeout is not None else limit

    def _run(self) -> None:
        while not self._done.wait(self.EVERY):
            now = time.perf_counter()
            for clock in list(self._ctx._clocks):
                since = clock.since
                if since is None or (id(clock), since) in self._reported:
                    continue
                if now - since >= self.after():
                    self._reported.add((id(clock), since))
                    self._report(clock, now - since)

    def _report(self, clock: Any, seconds: float) -> None:
        ctx = self._ctx
        stage = clock.waiting_on() if clock.waiting_on is not None else None
        step = f" (a step takes {ctx._step_seconds:.2g} s)" if ctx._step_seconds is not None else ""
        timeout = (f"; the supervisor restarts this process after {ctx.heartbeat_timeout:g} s without a "
                   "heartbeat" if ctx.heartbeat_timeout is not None else "")
        print(f"[shardkit] {ctx.role}-{ctx.role_index} (rank {ctx.rank}): no batch for {seconds:.1f} s after "
              f"step {ctx.step_count}{step}: the reader is waiting for {stage or 'its next batch'}"
              f"{timeout}", file=sys.stderr, flush=True)


def init(config: str | os.PathLike[str] | JobConfig | None = None, *, backend: str | None = None
         ) -> TrainContext:
    """This process's `TrainContext`; call it once, at the start of the training script.

    Example:
        >>> ctx = shardkit.trainer.init()
        >>> model = DDP(Net())                                  # torch allreduce: the group is ready
        >>> reader = ctx.reader()
        >>> start = ctx.checkpoint.restore(model=model, optimizer=opt, reader=reader)
        >>> with ctx:
        ...     for batch in reader:
        ...         ctx.step({"loss": train_step(batch)}, samples=len(batch["label"]))

    Where the config comes from: inside ``shardkit train``, the job's (``SHARDKIT_JOB_CONFIG``; the
    argument is ignored); else ``config`` (a YAML path or a `JobConfig`); else the YAML named by
    ``SHARDKIT_CONFIG``; else none (rank and world from ``RANK``/``WORLD_SIZE``, no data section, no
    checkpoints). Started by hand (``python train.py``, ``torchrun ... train.py``), the process reads
    shard ``RANK`` of ``WORLD_SIZE`` and sends no heartbeats. A ``RANK`` outside ``0 .. WORLD_SIZE - 1``
    (``WORLD_SIZE`` unset counts as 1) raises `ConfigError`, and so does a data shard outside its count:
    such a process would run alone and never checkpoint.

    What it does for the job's strategy:
    - torch allreduce: ``torch.distributed.init_process_group`` from the env (``nccl`` when CUDA has a
      device per local process, else ``gloo``; ``backend`` overrides), with a one-process group when
      the script runs alone; `finish` destroys it. ``ctx.device`` is this rank's device.
    - server roles never return from `init`: they serve until the job is done, then the process exits
      (torch parameter server: ``ps`` runs `shardkit.trainer.strategies.torch_ps.serve`; TensorFlow parameter
      server: ``ps`` and ``worker`` run `shardkit.trainer.strategies.tf.serve`).
    - checkpoints every ``checkpoint.every_seconds``: in an allreduce job the chief (rank 0) decides
      and tells the others every few steps, so every process saves at the same step (torch: a broadcast;
      TensorFlow: an all-reduce of the strategy `shardkit.trainer.strategies.tf.strategy` made).
    """
    cfg = load_job_config(config)
    env = os.environ
    in_job = p.ENV_ROLE in env
    role = env.get(p.ENV_ROLE, "worker")
    rank_env, world_env = int_env(p.RANK), int_env(p.WORLD_SIZE)
    index = int_env(p.ENV_ROLE_INDEX, rank_env or 0) or 0
    attempt = int_env(p.ENV_ATTEMPT, int_env("TORCHELASTIC_RESTART_COUNT", 0)) or 0
    shard, shards = int_env(p.ENV_DATA_SHARD), int_env(p.ENV_DATA_NUM_SHARDS)
    check_place(rank_env, world_env, shard, shards)
    if not in_job and shard is None:
        shard, shards = rank_env or 0, world_env or 1
    rank = rank_env if rank_env is not None else (shard if shard is not None else index)
    world = world_env if world_env is not None else (shards if shards is not None else 1)
    ctx = TrainContext(config=cfg, role=role, role_index=index, attempt=attempt, rank=rank, world_size=world,
                       local_rank=int_env(p.LOCAL_RANK, 0) or 0, data_shard=shard, num_data_shards=shards,
                       heartbeat_addr=env.get(p.ENV_HEARTBEAT_ADDR) if in_job else None)
    ctx._beat("start")
    if cfg is not None:
        serve_if_server(ctx, cfg)
        if cfg.framework == "torch" and cfg.strategy == "allreduce":
            init_torch_allreduce(ctx, backend)
    return ctx
