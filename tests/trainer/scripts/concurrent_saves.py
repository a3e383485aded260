"""Two processes saving into one checkpoint folder at once (the test starts it twice with ``spawn``).

`save` runs ``steps`` saves of the same steps, each after a barrier that both processes pass, so the
saves overlap; it puts ``(rank, [(step, url or None, error or None), ...])`` on ``out``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from shardkit.trainer.checkpoint import CheckpointManager


def save(url: str, rank: int, steps: int, barrier: Any, out: Any) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model = torch.nn.Linear(128, 128)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank))
    ckpt = CheckpointManager(url, keep=None)
    results: list[tuple[int, str | None, str | None]] = []
    for step in range(1, steps + 1):
        barrier.wait(timeout=60)
        try:
            results.append((step, ckpt.save(step, model=model, extra={"rank": rank}), None))
        except Exception as e:  # the test reports every one
            results.append((step, None, f"{type(e).__name__}: {e}"))
    out.put((rank, results))
