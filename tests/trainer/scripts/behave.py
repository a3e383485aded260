"""A role for supervisor tests: counts steps, checkpoints a counter (JSON, no torch), misbehaves on request.

params: steps, sleep (seconds per step), fault: {role, index, step, attempts, how} where how is
kill (SIGKILL itself), exit (code 3), hang (alive, silent), abort_after_done, linger_after_done (a
thread that is not a daemon keeps it from exiting), done_early (ends at that step, then waits for the
others to end, as torch ranks do at `finish`'s barrier), or none; spawn_child (start a
grandchild ``sleep``), secret_env (print the sha256 of that variable, never its value), leak (print it).
Each process appends one JSON line per start to <job dir>/record-<role>-<index>.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import shardkit.trainer


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def barrier(job_dir: str, attempt: int, index: int, count: int) -> None:
    """Wait until every worker of this attempt has restored: the processes share no collective, and
    a fast one must not save a checkpoint that a slow one would then restore at its start."""
    open(os.path.join(job_dir, f"ready-{attempt}-{index}"), "w").close()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(job_dir, f"ready-{attempt}-{i}")) for i in range(count)):
        if time.monotonic() > deadline:
            sys.exit("barrier: the other workers did not start")
        time.sleep(0.02)


def main() -> None:
    if os.environ.get("BEHAVE_SILENT_START"):
        time.sleep(3600)
    ctx = shardkit.trainer.init()
    params = ctx.params
    counter = Counter()
    start = ctx.checkpoint.restore(reader=counter)
    child = None
    if params.get("spawn_child"):
        child = subprocess.Popen(["sleep", "3600"])
    record = {"attempt": ctx.attempt, "start": start, "counter": counter.value, "pid": os.getpid(),
              "child": child.pid if child else None, "rank": ctx.rank, "world": ctx.world_size}
    secret_env = params.get("secret_env")
    if secret_env:
        value = os.environ.get(secret_env, "")
        record["secret_sha256"] = hashlib.sha256(value.encode()).hexdigest()
        if params.get("leak"):
            print(f"the secret is {value}", flush=True)
    job_dir = os.environ.get("SHARDKIT_JOB_DIR", ".")
    with open(os.path.join(job_dir, f"record-{ctx.role}-{ctx.role_index}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    barrier(job_dir, ctx.attempt, ctx.role_index, ctx.num_data_shards or 1)
    fault = params.get("fault") or {}
    mine = (fault.get("role", "worker"), fault.get("index", 0)) == (ctx.role, ctx.role_index) and (
        ctx.attempt in fault.get("attempts", [0]))
    print(f"{ctx.role}-{ctx.role_index} attempt {ctx.attempt} starts at step {start}", flush=True)
    with ctx:
        for step in range(start + 1, params.get("steps", 10) + 1):
            if mine and step == fault.get("step") and fault["how"] == "done_early":
                break
            if mine and step == fault.get("step"):
                how = fault["how"]
                print(f"fault {how} at step {step}", flush=True)
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif how == "exit":
                    sys.exit(3)
                elif how == "hang":
                    time.sleep(3600)
            counter.value += 1
            time.sleep(params.get("sleep", 0.01))
            ctx.step({"loss": 1.0 / step, "counter": counter.value}, samples=4)
    open(os.path.join(job_dir, f"ended-{ctx.attempt}-{ctx.role_index}"), "w").close()
    if mine and fault.get("how") == "done_early":
        others = [os.path.join(job_dir, f"ended-{ctx.attempt}-{i}") for i in range(ctx.num_data_shards or 1)]
        while not all(os.path.exists(path) for path in others):
            time.sleep(0.02)
    if mine and fault.get("how") == "abort_after_done":
        os.abort()
    if mine and fault.get("how") == "linger_after_done":  # a thread that is not a daemon: no exit
        threading.Thread(target=time.sleep, args=(3600,), name="lingering").start()


if __name__ == "__main__":
    main()
