"""Run an example training script as a job role, recording its steps and injecting a fault (tests only).

params.test: {script: path of the example, fail_at_step: N (the chief exits with code 3 when it counts
step N in attempt 0; 0: never)}. Appends JSON lines to <job dir>/record-<role>-<index>.jsonl:
- {"attempt", "start"} when a checkpoint restore returns; {"attempt", "step", "loss"} per step;
- TensorFlow parameter server: {"attempt", "save", "applied"} at each save: the steps the workers have
  applied in this attempt (an exact counter added to the scheduled step function);
- TensorFlow allreduce: {"attempt", "save"} at each save, on every worker (all take part in it);
- torch parameter server: {"attempt", "roundtrip": bool, "updates", "saved_updates"} when worker 0 loads
  a checkpoint into the ps (whether the state read back from the ps equals the one loaded); the other
  workers' first push of a restarted attempt waits for that read-back (at most 60 s).
Only observes, crashes and (that one push) waits: the example, the trainer and the strategies run
unchanged."""

from __future__ import annotations

import json
import os
import runpy
import time
from pathlib import Path
from typing import Any

from shardkit.job import protocol
from shardkit.trainer import _context as context
from shardkit.trainer.checkpoint import policy as checkpointing

_step, _restore = context.TrainContext.step, checkpointing.Checkpoints.restore


def _record(ctx: context.TrainContext, **entry: Any) -> None:
    path = Path(os.environ[protocol.ENV_JOB_DIR]) / f"record-{ctx.role}-{ctx.role_index}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps({"attempt": ctx.attempt, **entry}) + "\n")


def step(self: context.TrainContext, metrics: Any = None, *, samples: int = 0) -> int:
    n = _step(self, metrics, samples=samples)
    loss = (metrics or {}).get("loss")
    _record(self, step=n, loss=None if loss is None else float(loss))
    if self.is_chief and self.attempt == 0 and n == int(self.params["test"].get("fail_at_step", 0)):
        os._exit(3)
    return n


def restore(self: checkpointing.Checkpoints, **objects: Any) -> int:
    start = _restore(self, **objects)
    _record(self._ctx, start=start)
    return start


def _patch_tf_ps() -> None:
    """Count the steps the workers applied, exactly (``assign_add`` on a ps variable; a Keras optimizer's
    ``iterations`` loses increments when two workers update at once), and record the count at each save."""
    import tensorflow as tf

    from shardkit.trainer.strategies import tf as shardkit_tf

    init = shardkit_tf.Scheduler.__init__
    counters: list[Any] = []

    def counting_init(self: Any, ctx: Any, coordinator: Any, step_fn: Any, **kwargs: Any) -> None:
        with coordinator.strategy.scope():
            counter = tf.Variable(0, dtype=tf.int64, trainable=False)
        counters.append(counter)

        @tf.function
        def counted(*args: Any) -> Any:
            out = step_fn(*args)
            counter.assign_add(1)  # after the step's updates: stateful ops run in program order
            return out

        init(self, ctx, coordinator, counted, **kwargs)

    save = checkpointing.Checkpoints.save

    def recording_save(self: checkpointing.Checkpoints, step: int | None = None, **kwargs: Any) -> str | None:
        if counters:
            _record(self._ctx, save=self._ctx.step_count if step is None else step,
                    applied=int(counters[-1].numpy()))
        return save(self, step, **kwargs)

    shardkit_tf.Scheduler.__init__ = counting_init  # type: ignore[method-assign]
    checkpointing.Checkpoints.save = recording_save  # type: ignore[method-assign]


def _patch_tf_allreduce() -> None:
    save = checkpointing.Checkpoints.save

    def recording_save(self: checkpointing.Checkpoints, step: int | None = None, **kwargs: Any) -> str | None:
        _record(self._ctx, save=self._ctx.step_count if step is None else step)
        return save(self, step, **kwargs)

    checkpointing.Checkpoints.save = recording_save  # type: ignore[method-assign]


def _patch_torch_ps() -> None:
    import torch

    from shardkit.trainer.strategies import torch_ps

    load = torch_ps.ParameterServerClient.load_state_dict

    def load_state_dict(self: torch_ps.ParameterServerClient, state: Any) -> None:
        load(self, state)
        if self.worker == 0:
            back = self.state_dict()
            same = back["params"].keys() == state["params"].keys() and all(
                torch.equal(back["params"][k], state["params"][k]) for k in state["params"]
            ) and back["state"].keys() == state["state"].keys() and all(
                torch.equal(back["state"][k][s], value)
                for k in state["state"] for s, value in state["state"][k].items()
            )
            _record(self._test_ctx, roundtrip=bool(same), updates=int(back["updates"]),  # type: ignore[attr-defined]
                    saved_updates=int(state["updates"]))
            _checked(self._test_ctx).touch()  # type: ignore[attr-defined]

    def _checked(ctx: Any) -> Path:
        return Path(os.environ[protocol.ENV_JOB_DIR]) / f"roundtrip-checked-{ctx.attempt}"

    def after_the_check(method: Any) -> Any:
        """Other workers push only once worker 0 has read the loaded state back: a push in between
        changes the ps state (updates 77 vs saved 76 in 1 of 8 runs)."""
        def wrapped(self: torch_ps.ParameterServerClient, *args: Any, **kwargs: Any) -> Any:
            ctx = getattr(self, "_test_ctx", None)
            waited = getattr(self, "_test_waited", False)
            if self.worker != 0 and ctx is not None and ctx.attempt > 0 and not waited:
                deadline = time.monotonic() + 60
                while not _checked(ctx).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                self._test_waited = True  # type: ignore[attr-defined]
            return method(self, *args, **kwargs)
        return wrapped

    connect = torch_ps.connect

    def connect_recording(ctx: Any, model: Any, **kwargs: Any) -> torch_ps.ParameterServerClient:
        client = connect(ctx, model, **kwargs)
        client._test_ctx = ctx  # type: ignore[attr-defined]
        return client

    torch_ps.ParameterServerClient.load_state_dict = load_state_dict  # type: ignore[method-assign]
    client = torch_ps.ParameterServerClient
    client.push = after_the_check(client.push)  # type: ignore[method-assign]
    client.step = after_the_check(client.step)  # type: ignore[method-assign]
    torch_ps.connect = connect_recording


context.TrainContext.step = step  # type: ignore[method-assign]
checkpointing.Checkpoints.restore = restore  # type: ignore[method-assign]
job = json.loads(Path(os.environ[protocol.ENV_JOB_CONFIG]).read_text())
if (job["framework"], job["strategy"]) == ("torch", "parameter_server"):
    _patch_torch_ps()
if (job["framework"], job["strategy"]) == ("tensorflow", "parameter_server"):
    _patch_tf_ps()
if (job["framework"], job["strategy"]) == ("tensorflow", "allreduce"):
    _patch_tf_allreduce()
runpy.run_path(job["params"]["test"]["script"], run_name="__main__")
