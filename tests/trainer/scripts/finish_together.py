"""A torch DDP rank whose ``with ctx:`` ends at once, except rank 0's, whose `on_finish` callback takes
two seconds (as a long last save would): ``python finish_together.py OUT``. Writes ``{"hook_end": time
rank 0's callback returned (rank 0), "left": time ``with ctx:`` returned}`` to ``OUT.rank<r>``."""

from __future__ import annotations

import json
import sys
import time

import shardkit.trainer


def main() -> None:
    ctx = shardkit.trainer.init()
    out: dict[str, float] = {}

    def slow_last_save() -> bool:
        time.sleep(2.0)
        out["hook_end"] = time.time()
        return False

    if ctx.rank == 0:
        ctx.on_finish(slow_last_save)
    with ctx:
        pass
    out["left"] = time.time()
    with open(f"{sys.argv[1]}.rank{ctx.rank}", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
