"""A torch DDP role for the fault-tolerance tests: a linear model on a shardkit dataset of ids.

Each rank appends, per trained step, ``{"attempt", "step", "ids", "loss", "saved"}`` to
``<job dir>/ids-rank<r>.jsonl`` (after ``ctx.step``, which may checkpoint: ``saved``), and one
``{"attempt", "start"}`` line when it starts. ``params.sleep``: seconds after each step (a slow training
step); ``params.slow_data``: seconds per sample in the reader's transform (a slow data stage);
``params.stall_data``: ``{"rank", "step", "seconds"}``, from that step on attempt 0 one sample's transform
sleeps that long (a stalled data stage). Rank 0 saves the final weights to ``<job dir>/final.pt``.

Faults (``params.fault``, or several in ``params.faults``; each on its listed ``attempts`` only, attempt
0 by default): ``{"rank": r, "step": s, "how": h}`` with ``h`` = ``kill`` (SIGKILL itself before step s),
``kill_after_step`` (SIGKILL itself once ``ctx.step`` of step s returned, before the step's record is
written: the end of a step, after its checkpoint was taken), ``hang`` (sleep without heartbeats before
step s), ``crash_commit`` / ``crash_write`` (rank 0 SIGKILLs itself while saving the checkpoint of step
s: before its COMMIT is written, or halfway through writing optimizer.pt), ``kill_after_commit`` (rank 0
SIGKILLs itself as soon as the COMMIT of step s is written).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import shardkit.trainer
from shardkit.trainer.checkpoint import _store


def _inject_save_crash(step: int, how: str) -> None:
    """SIGKILL this process at a chosen point inside `CheckpointManager.save` of ``step``."""
    commit, write = _store.Store.commit, _store.Store.write

    def crashing_commit(self: Any, s: int, *args: Any, **kwargs: Any) -> Any:
        if s == step and how == "crash_commit":
            os.kill(os.getpid(), signal.SIGKILL)
        done = commit(self, s, *args, **kwargs)
        if s == step and how == "kill_after_commit":
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    def crashing_write(self: Any, s: int, name: str, data: bytes) -> Any:
        if s == step and how == "crash_write" and name == "optimizer.pt":
            path = self.path(s, name)
            with open(path, "wb") as f:  # a torn file, as a non-atomic filesystem would leave
                f.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return write(self, s, name, data)

    _store.Store.commit = crashing_commit  # type: ignore[method-assign]
    _store.Store.write = crashing_write  # type: ignore[method-assign]


_STALL = [0.0]  # seconds the next sample's transform sleeps once (params.stall_data)


def _slow(seconds: float, sample: dict[str, Any]) -> dict[str, Any]:
    """A transform that takes ``seconds`` per sample: a planted slow data stage (``params.slow_data``),
    and once ``_STALL[0]`` seconds more (a stalled data stage: ``params.stall_data``)."""
    stall, _STALL[0] = _STALL[0], 0.0
    time.sleep(seconds + stall)
    return sample


def main() -> None:
    ctx = shardkit.trainer.init()
    params = ctx.params
    faults = params.get("faults") or ([params["fault"]] if params.get("fault") else [])
    mine = [f for f in faults if ctx.attempt in f.get("attempts", [0]) and f.get("rank") == ctx.rank]
    fault = mine[0] if mine else {}
    armed = bool(mine)
    if armed and fault["how"].startswith(("crash_", "kill_after_commit")):
        _inject_save_crash(fault["step"], fault["how"])
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=params.get("lr", 0.05), momentum=0.9)
    slow = params.get("slow_data", 0.0)  # seconds per sample in the reader's transform
    stall = params.get("stall_data") or {}  # {"rank", "step", "seconds"}: the data stage stalls, attempt 0
    stalls = stall.get("rank") == ctx.rank and ctx.attempt == 0
    loader = (ctx.torch_loader(transform=functools.partial(_slow, slow)) if slow or stalls
              else ctx.torch_loader())
    start = ctx.checkpoint.restore(model=model, optimizer=optimizer, reader=loader)
    job_dir = os.environ["SHARDKIT_JOB_DIR"]
    log = open(os.path.join(job_dir, f"ids-rank{ctx.rank}.jsonl"), "a")  # noqa: SIM115
    log.write(json.dumps({"attempt": ctx.attempt, "start": start}) + "\n")
    log.flush()
    with ctx:
        for batch in loader:
            step = ctx.step_count + 1
            if armed and step == fault["step"] and fault["how"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if armed and step == fault["step"] and fault["how"] == "hang":
                time.sleep(3600)
            if stalls and step == stall["step"]:
                _STALL[0] = stall["seconds"]
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])
            loss.backward()
            optimizer.step()
            ctx.step({"loss": loss.detach()}, samples=len(batch["id"]))
            if armed and step == fault["step"] and fault["how"] == "kill_after_step":
                os.kill(os.getpid(), signal.SIGKILL)
            saved = ctx.checkpoint.manager is not None and ctx.checkpoint.manager.schedule.last_step == step
            log.write(json.dumps({"attempt": ctx.attempt, "step": step, "ids": batch["id"].tolist(),
                                  "loss": loss.item(), "saved": saved}) + "\n")
            log.flush()
            time.sleep(params.get("sleep", 0.0))
        if ctx.rank == 0:
            torch.save(model.module.state_dict(), os.path.join(job_dir, "final.pt"))


if __name__ == "__main__":
    main()
