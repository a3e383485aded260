"""A torch DDP rank that draws from every global RNG at each step: ``python rng_draws.py OUT``.

Each rank seeds python, numpy and torch with ``100 + rank`` (so the ranks' streams differ), restores
(``ctx.checkpoint``, from ``SHARDKIT_CONFIG``), then for each step up to ``STEPS`` draws one number from
each RNG and calls ``ctx.step`` (which saves when due). Writes ``{"start", "draws": {step: [...]}}`` to
``OUT.rank<r>``.
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import torch

import shardkit.trainer

STEPS = 4


def main() -> None:
    ctx = shardkit.trainer.init()
    seed = 100 + ctx.rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = ctx.checkpoint.restore(model=model, optimizer=optimizer)
    torch.distributed.barrier()  # as DDP's first allreduce would
    draws = {}
    with ctx:
        for step in range(start + 1, STEPS + 1):
            draws[step] = [torch.rand(1).item(), float(np.random.rand()), random.random()]
            ctx.step()
    with open(f"{sys.argv[1]}.rank{ctx.rank}", "w") as f:
        json.dump({"start": start, "draws": draws}, f)


if __name__ == "__main__":
    main()
