"""A role for the tests of the samples a job's summary counts: it trains ``batch + index`` samples a step.

params: steps, batch, sleep (seconds per step), late: {index, seconds} (that process sleeps before its
restore, so the others may save a checkpoint first), allreduce (a torch ``all_reduce`` each step, so the
workers step together as in DDP: a job with ``framework: torch``), fault: {index, step, how, attempts}
where how is ``raise`` (a RuntimeError inside ``with ctx``), ``kill`` (SIGKILL to its own pid),
``corrupt`` (flip a byte of the newest checkpoint's state.json, keeping its size, then raise), ``stop``
(SIGSTOP to its own pid: it hangs, stopped, until the supervisor stops it) or ``hang`` (sleeps an hour:
it hangs, sleeping), before the step's work. Checkpoints a step counter (JSON, through ``ctx.checkpoint``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import shardkit.trainer


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def main() -> None:
    ctx = shardkit.trainer.init()
    params = ctx.params
    counter = Counter()
    late = params.get("late") or {}
    if late.get("index") == ctx.role_index:
        time.sleep(float(late["seconds"]))
    start = ctx.checkpoint.restore(reader=counter)
    fault = params.get("fault") or {}
    mine = fault.get("index") == ctx.role_index and ctx.attempt in fault.get("attempts", [0])
    batch = int(params.get("batch", 4)) + ctx.role_index
    print(f"{ctx.role}-{ctx.role_index} attempt {ctx.attempt} starts at step {start}", flush=True)
    with ctx:
        for step in range(start + 1, int(params.get("steps", 20)) + 1):
            if mine and step == fault.get("step"):
                print(f"fault {fault['how']} at step {step}", flush=True)
                if fault["how"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault["how"] == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                if fault["how"] == "hang":
                    time.sleep(3600)
                if fault["how"] == "corrupt":
                    newest = ctx.checkpoint.manager.list()[-1]
                    path = Path(newest.url) / "state.json"
                    data = bytearray(path.read_bytes())
                    data[-2] ^= 0x01  # same size: only the sha256 tells
                    path.write_bytes(bytes(data))
                raise RuntimeError(f"fault at step {step}")
            if params.get("allreduce"):
                import torch
                import torch.distributed as dist

                dist.all_reduce(torch.ones(1))
            time.sleep(float(params.get("sleep", 0.01)))
            counter.value += 1
            ctx.step({"loss": 1.0 / step}, samples=batch)


if __name__ == "__main__":
    main()
