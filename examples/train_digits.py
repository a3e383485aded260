"""Train a small CNN on scikit-learn's digits with torch DDP: the script of `examples/digits.yaml`.

    shardkit train examples/digits.yaml                                 # 2 workers, checkpoints, restarts
    SHARDKIT_CONFIG=examples/digits.yaml torchrun --nproc_per_node 2 examples/train_digits.py   # by hand

Everything about the job (ranks, ports, the data shard of this worker, checkpoints) comes from
`shardkit.trainer.init()`; the rest is an ordinary DDP training loop. Choices that make it resumable
exactly: the learning rate is a function of the step (warmup, then cosine), and the random shifts that
augment each batch come from a generator seeded by (seed, rank, step), so a run restarted from a
checkpoint goes on as the interrupted one would have. After training, rank 0 evaluates on the test
split (the last 297 digits) and prints the accuracy.

Rank 0's ``TRAIN_STATS`` line times the steps after the first one (which builds DDP's buckets), and
counts the samples of those steps only. Every rank trains as many: the steps are collective, and each
rank's shard holds as many samples (the reader's default ``remainder="drop"``). The job summary
counts every rank's samples from their heartbeats.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shardkit.trainer


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8)), nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16, 10),
    )


def random_shift(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Each 8x8 image moved by -1, 0 or +1 pixel in each direction (zeros shifted in)."""
    n = images.shape[0]
    padded = nn.functional.pad(images, (1, 1, 1, 1))
    dy, dx = torch.randint(0, 3, (2, n), generator=generator)
    rows, cols = dy[:, None] + torch.arange(8), dx[:, None] + torch.arange(8)
    return padded[torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


def learning_rate(step: int, total: int, peak: float, warmup: float = 0.15) -> float:
    warm = max(1, int(total * warmup))
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def evaluate(ctx: shardkit.trainer.TrainContext, model: nn.Module) -> float:
    """Accuracy on the test split (the whole of it, read by this process alone)."""
    test = ctx.torch_loader(filter=[("split", "=", "test")], shard=0, num_shards=1, shuffle=False,
                            num_epochs=1, batch_size=512)
    correct = total = 0
    model.eval()
    with torch.no_grad():
        for batch in test:
            predicted = model(batch["pixels"]).argmax(dim=1)
            correct += int((predicted == batch["label"]).sum())
            total += len(batch["label"])
    return correct / total


def main() -> None:
    # Inside `shardkit train` the job's config is used; started by hand, $SHARDKIT_CONFIG or digits.yaml.
    default = Path(__file__).with_name("digits.yaml")
    ctx = shardkit.trainer.init(config=os.environ.get("SHARDKIT_CONFIG", default))
    params: dict[str, Any] = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "seed": 0, **ctx.params}
    torch.manual_seed(params["seed"])
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=params["momentum"],
                                weight_decay=params["weight_decay"])
    loader = ctx.torch_loader()
    total_steps = len(loader) * (loader.reader.num_epochs or 1)
    start = ctx.checkpoint.restore(model=model, optimizer=optimizer, reader=loader)
    print(f"rank {ctx.rank}/{ctx.world_size} attempt {ctx.attempt}: "
          + (f"resuming at step {start}" if start else f"starting, {total_steps} steps"), flush=True)
    loss_fn = nn.CrossEntropyLoss()
    first, first_unix, samples, loss = 0.0, None, 0, torch.tensor(0.0)  # samples: of the timed steps
    with ctx:
        for batch in loader:
            step = ctx.step_count  # steps done so far: this batch is step + 1
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total_steps, params["lr"])
            seed = params["seed"] * 1_000_003 + ctx.rank * 100_003 + step
            images = random_shift(batch["pixels"], torch.Generator().manual_seed(seed))
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(images), batch["label"])
            loss.backward()
            optimizer.step()
            ctx.step({"loss": loss.detach()}, samples=len(batch["label"]))
            if first:
                samples += len(batch["label"])
            else:  # the clock starts when the first step ends: its samples are not timed
                first, first_unix = time.perf_counter(), time.time()
        if ctx.rank == 0:
            seconds = time.perf_counter() - first if first else 0.0
            accuracy = evaluate(ctx, model.module)
            stats = {"steps": ctx.step_count, "world": ctx.world_size, "seconds": seconds,
                     "samples": samples * ctx.world_size,
                     "samples_per_s": samples * ctx.world_size / seconds if seconds else 0.0,
                     "first_step_unix": first_unix, "test_accuracy": accuracy}
            ctx.metrics = {"loss": float(loss.detach()), "test_accuracy": accuracy}
            print(f"TRAIN_STATS {json.dumps(stats)}", flush=True)
            print(f"test accuracy: {accuracy:.4f} after {ctx.step_count} steps", flush=True)


if __name__ == "__main__":
    main()
