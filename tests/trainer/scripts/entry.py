"""A ``module:function`` entrypoint for tests: writes what `init` saw to $ENTRY_OUT."""

from __future__ import annotations

import json
import os

import shardkit.trainer


def main() -> None:
    ctx = shardkit.trainer.init()
    with ctx, open(os.environ["ENTRY_OUT"], "w") as f:
        seen = {"role": ctx.role, "rank": ctx.rank, "world": ctx.world_size, "params": dict(ctx.params)}
        json.dump(seen, f)
