"""A torch DDP worker for the torchrun engine tests: a linear model on a shardkit dataset of ids.

Each process appends to ``<job dir>/ids/attempt<a>-rank<r>.jsonl``: first ``{"start": step, "world",
"pid", "env": {...}}`` (the step it resumed from and what `shardkit.trainer.init` saw), then per trained
step ``{"step", "ids", "saved"}`` (``saved``: ``ctx.step`` wrote or took part in the checkpoint of that
step). ``params.sleep`` seconds pass after each step, so that a test can act while the job runs;
``params.linger_rank``: that rank waits for ever after its work (``with ctx:``), so it never exits;
``params.evaluate_rank``: that rank spends ``params.evaluate_s`` seconds after its last step inside
``with ctx:``, beating (as an evaluation on rank 0 would), while the others wait at `finish`'s barrier.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import shardkit.trainer


def main() -> None:
    ctx = shardkit.trainer.init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = ctx.torch_loader()
    start = ctx.checkpoint.restore(model=model, optimizer=optimizer, reader=loader)
    folder = Path(os.environ["SHARDKIT_JOB_DIR"]) / "ids"
    folder.mkdir(exist_ok=True)
    log = open(folder / f"attempt{ctx.attempt}-rank{ctx.rank}.jsonl", "a")  # noqa: SIM115
    seen = {k: os.environ.get(k) for k in ("SHARDKIT_DATA_SHARD", "SHARDKIT_DATA_NUM_SHARDS", "RANK",
                                           "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR",
                                           "GLOO_SOCKET_IFNAME", "SHARDKIT_COLLECTIVE_TIMEOUT")}
    log.write(json.dumps({"start": start, "world": ctx.world_size, "pid": os.getpid(), "env": seen,
                          "shard": [ctx.data_shard, ctx.num_data_shards]}) + "\n")
    log.flush()
    with ctx:
        for batch in loader:
            step = ctx.step_count + 1
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])
            loss.backward()
            optimizer.step()
            ctx.step({"loss": loss.detach()}, samples=len(batch["id"]))
            saved = ctx.checkpoint.manager is not None and ctx.checkpoint.manager.schedule.last_step == step
            log.write(json.dumps({"step": step, "ids": batch["id"].tolist(), "saved": saved}) + "\n")
            log.flush()
            time.sleep(float(ctx.params.get("sleep", 0.0)))
        if ctx.params.get("evaluate_rank") == ctx.rank:
            until = time.monotonic() + float(ctx.params["evaluate_s"])
            while time.monotonic() < until:
                time.sleep(0.1)
                ctx.heartbeat()
    if ctx.params.get("linger_rank") == ctx.rank:  # hangs after its work (the worker wrapper's
        threading.Event().wait()  # os._exit(0) would end a thread that is not a daemon)


if __name__ == "__main__":
    main()
