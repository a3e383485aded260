"""What a training script imports: `init` gives the `TrainContext` (rank, data, checkpoints, heartbeats)."""

from shardkit.trainer._context import TrainContext, init

__all__ = ["TrainContext", "init"]
