"""Train a small MLP on scikit-learn's digits with a torch parameter server; run by `digits_torch_ps.yaml`.

    shardkit train examples/digits_torch_ps.yaml

The ps processes never reach the training code: `shardkit.trainer.init()` serves the parameters there
(`shardkit.trainer.strategies.torch_ps.serve`) and exits when the workers are done. Each worker pulls the
weights, computes gradients on its shard of the data and pushes them; the ps applies them as they
arrive (asynchronous SGD). Worker 0 checkpoints the ps state (parameters and Adam moments) and, at the
end, evaluates on the test split.

Worker 0's ``TRAIN_STATS`` line gives its own samples and samples/s: the workers run at their own pace,
so it knows neither what the others trained nor when they end. The job's figures, over every worker,
are in the job summary (the last lines of ``shardkit train``, and ``<logdir>/summary.json``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

import shardkit.trainer
from shardkit.trainer.strategies import torch_ps


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    )


def evaluate(ctx: shardkit.trainer.TrainContext, model: torch.nn.Module) -> float:
    """Accuracy on the test split (the whole of it, read by this process alone)."""
    test = ctx.torch_loader(filter=[("split", "=", "test")], shard=0, num_shards=1, shuffle=False,
                            num_epochs=1, batch_size=512)
    correct = total = 0
    with torch.no_grad():
        for batch in test:
            correct += int((model(batch["pixels"]).argmax(dim=1) == batch["label"]).sum())
            total += len(batch["label"])
    return correct / total


def main() -> None:
    ctx = shardkit.trainer.init(config=os.environ.get("SHARDKIT_CONFIG", Path(__file__).with_name(
        "digits_torch_ps.yaml")))
    params = ctx.params
    torch.manual_seed(params.get("seed", 0))
    model = make_model(params.get("hidden", 128))
    ps = torch_ps.connect(ctx, model)  # the optimizer comes from params.optimizer
    loader = ctx.torch_loader()
    start = ctx.checkpoint.restore(model=model, optimizer=ps, reader=loader)
    print(f"worker {ctx.role_index} attempt {ctx.attempt}: "
          + (f"resuming at step {start}" if start else "starting"), flush=True)
    ps.pull()
    loss_fn = torch.nn.CrossEntropyLoss()
    began, samples = time.perf_counter(), 0
    with ps, ctx:
        for batch in loader:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch["pixels"]), batch["label"])
            loss.backward()
            ps.step()  # push the gradients, pull the weights after the update
            samples += len(batch["label"])
            ctx.step({"loss": loss.detach()}, samples=len(batch["label"]))
        if ctx.is_chief:
            ps.pull()
            seconds = time.perf_counter() - began
            accuracy = evaluate(ctx, model)
            ctx.metrics = {"loss": loss.item(), "test_accuracy": accuracy}
            # This worker's own figures (see the module docstring): the others may still be training.
            print("TRAIN_STATS " + json.dumps({"steps": ctx.step_count, "test_accuracy": accuracy,
                                               "worker": ctx.role_index, "worker_samples": samples,
                                               "worker_seconds": seconds,
                                               "worker_samples_per_s": samples / seconds}), flush=True)
            print(f"test accuracy: {accuracy:.4f} ({ctx.step_count} steps)", flush=True)


if __name__ == "__main__":
    main()
