"""A torch parameter-server worker script that records the samples each worker trains (tests only).

The model is a linear layer plus ``count``, one entry per worker, which counts exactly the pushes of
each worker that the ps state holds: a worker's gradient for it is ``-1/lr`` on its own entry (SGD), so
a saved ``count[k]`` says how many of worker k's pushes the saved parameters include.

Each worker appends ``{"attempt", "step", "ids"}`` to ``<job dir>/ids-worker-<k>.jsonl`` once its
`ps.step` has returned (its push is in the ps state). ``params.test``:
- ``stall_at``: in attempt 0, worker 1 stops pushing after that many steps (it heartbeats until the
  job stops it), and worker 0 starts only once worker 1 has got there: worker 0 runs ahead, so its
  checkpoints hold fewer of worker 1's pushes than of its own, as in any job with a slower worker;
- ``crash_at``: in attempt 0, worker 0 exits with code 3 after that step;
- ``slow``: seconds worker 1 sleeps after each step in later attempts (worker 0 ends first).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

import shardkit.trainer
from shardkit.job import protocol
from shardkit.trainer.strategies import torch_ps


class Net(torch.nn.Module):
    def __init__(self, workers: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.count = torch.nn.Parameter(torch.zeros(workers))


def records(job: Path, worker: int) -> list[dict[str, object]]:
    path = job / f"ids-worker-{worker}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


ctx = shardkit.trainer.init()
job = Path(os.environ[protocol.ENV_JOB_DIR])
test = ctx.params["test"]
lr = float(ctx.params["optimizer"]["lr"])
me, workers = ctx.role_index, int(ctx.num_data_shards or 1)
torch.manual_seed(0)
model = Net(workers)
ps = torch_ps.connect(ctx, model)
reader = ctx.reader()
ctx.checkpoint.restore(model=model, optimizer=ps, reader=reader)
ps.pull()
if me == 0 and ctx.attempt == 0:
    deadline = time.monotonic() + 60
    while sum(r["attempt"] == 0 for r in records(job, 1)) < int(test["stall_at"]):
        if time.monotonic() > deadline:
            raise SystemExit("worker 1 did not get to its stall within 60 s")
        ctx.heartbeat()
        time.sleep(0.02)
with ps, ctx:
    for steps, batch in enumerate(reader, start=1):
        model.zero_grad()
        logits = model.linear(torch.as_tensor(batch["x"]).clone())
        loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(batch["y"]))
        loss.backward()
        grad = torch.zeros(workers)
        grad[me] = -1.0 / lr
        model.count.grad = grad
        ps.step()
        with (job / f"ids-worker-{me}.jsonl").open("a") as f:
            f.write(json.dumps({"attempt": ctx.attempt, "step": steps,
                                "ids": [int(i) for i in batch["id"]]}) + "\n")
        ctx.step({"loss": loss.item()}, samples=len(batch["id"]))
        if me == 0 and ctx.attempt == 0 and ctx.step_count == int(test["crash_at"]):
            os._exit(3)
        if me == 1 and ctx.attempt == 0 and steps == int(test["stall_at"]):
            while True:  # until the job stops this attempt
                ctx.heartbeat()
                time.sleep(0.05)
        if me == 1:
            time.sleep(float(test["slow"]))
