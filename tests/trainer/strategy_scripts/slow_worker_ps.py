"""A torch parameter-server worker script whose worker 1 is slower than worker 0 (tests only).

Linear model on the job's data (``x``: 4 floats, ``y``: 0 or 1), one `ps.step` per batch; worker 1
sleeps ``params.test.slow`` seconds after each step, so worker 0 finishes first and its final save
must wait for worker 1's last pushes.
"""

from __future__ import annotations

import time

import torch

import shardkit.trainer
from shardkit.trainer.strategies import torch_ps

ctx = shardkit.trainer.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
ps = torch_ps.connect(ctx, model)
reader = ctx.reader()
ctx.checkpoint.restore(model=model, optimizer=ps, reader=reader)
ps.pull()
with ps, ctx:
    for batch in reader:
        model.zero_grad()
        logits = model(torch.as_tensor(batch["x"]))
        loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(batch["y"]))
        loss.backward()
        ps.step()
        ctx.step({"loss": float(loss)}, samples=len(batch["y"]))
        if ctx.role_index == 1:
            time.sleep(float(ctx.params["test"]["slow"]))
