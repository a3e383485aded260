"""The digits job read by index: a map-style dataset, a sampler of your own, DataLoader workers.

    shardkit train examples/digits_map.yaml

The same model, schedule and augmentation as `train_digits.py` (whose functions it uses), but the data
comes from `shardkit.torch.MapDataset` through a torch DataLoader with 2 workers, in the order a
`WeightedRandomSampler` draws: each class as often as the others (weights 1 / the class's count), with
replacement. Each rank draws its own sample indices from a generator seeded by (seed, rank), as many as
its shard of the stream holds over the job's epochs, so the job trains as many samples as `digits.yaml`.

Resuming: the sampler's draws are a function of (seed, rank), so a run restored at step ``s`` draws them
again and skips the first ``s`` batches' worth; with the model, the optimizer and the random shifts
(seeded by step) restored, it goes on as the interrupted run would have.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from train_digits import evaluate, learning_rate, make_model, random_shift

import shardkit.torch
import shardkit.trainer
from shardkit.dataset import take


def main() -> None:
    default = Path(__file__).with_name("digits_map.yaml")
    ctx = shardkit.trainer.init(config=os.environ.get("SHARDKIT_CONFIG", default))
    params: dict[str, Any] = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "seed": 0, **ctx.params}
    torch.manual_seed(params["seed"])
    data = ctx.config.data
    batch_size, epochs = data.batch_size, data.num_epochs or 1
    options = ctx.reader_kwargs()   # the job's data: its url, columns and filter (the train split)
    train = shardkit.torch.MapDataset(options["url"], columns=options["columns"], filter=options["filter"])
    labels = take(train.rows().dataset, train.positions, columns=["label"])["label"]
    weights = torch.as_tensor(1.0 / np.bincount(labels)[labels])   # each class drawn as often
    samples = epochs * (len(train) // ctx.world_size)                 # as many as this rank's stream shard
    total_steps = -(-samples // batch_size)                          # the last batch may be short
    sampler = torch.utils.data.WeightedRandomSampler(
        weights, num_samples=samples,
        generator=torch.Generator().manual_seed(params["seed"] * 1_000_003 + ctx.rank))

    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=params["momentum"],
                                weight_decay=params["weight_decay"])
    start = ctx.checkpoint.restore(model=model, optimizer=optimizer)
    drawn = list(itertools.islice(iter(sampler), start * batch_size, None))   # the batches not trained yet
    loader = torch.utils.data.DataLoader(train, batch_size=batch_size, sampler=drawn, num_workers=2,
                                         persistent_workers=True)
    print(f"rank {ctx.rank}/{ctx.world_size} attempt {ctx.attempt}: "
          + (f"resuming at step {start}" if start else f"starting, {total_steps} steps"), flush=True)
    loss_fn = nn.CrossEntropyLoss()
    counts = np.zeros(10, np.int64)
    loss = torch.tensor(0.0)
    with ctx:
        for batch in ctx.timed(loader):
            step = ctx.step_count
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total_steps, params["lr"])
            seed = params["seed"] * 1_000_003 + ctx.rank * 100_003 + step
            images = random_shift(batch["pixels"], torch.Generator().manual_seed(seed))
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(images), batch["label"])
            loss.backward()
            optimizer.step()
            counts += np.bincount(batch["label"].numpy(), minlength=10)
            ctx.step({"loss": loss.detach()}, samples=len(batch["label"]))
        if ctx.rank == 0:
            accuracy = evaluate(ctx, model.module)
            ctx.metrics = {"loss": float(loss.detach()), "test_accuracy": accuracy}
            stats = {"steps": ctx.step_count, "test_accuracy": accuracy, "label_counts": counts.tolist()}
            print(f"TRAIN_STATS {json.dumps(stats)}", flush=True)
            print(f"test accuracy: {accuracy:.4f} after {ctx.step_count} steps "
                  f"(labels drawn, rank 0: {counts.min()} to {counts.max()} per class)", flush=True)


if __name__ == "__main__":
    main()
