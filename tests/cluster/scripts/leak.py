"""A role that prints its secrets (no torch, no TensorFlow import), for the masking tests.

params: names (the secrets' variables), fail_attempts (attempts that exit 1 after every worker printed:
``workers`` of them), show (variables to print as they are, ``env NAME=value``). It prints
each value on stdout, on stderr, split across two writes with a pause between them, inside a JSON
string, and as the end of an unterminated last line; then one line ``done <attempt>``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import shardkit.trainer


def barrier(attempt: int, index: int, count: int) -> None:
    """Wait until every worker of this attempt has printed: one that fails first would have the others
    stopped before they print everything."""
    job_dir = os.environ["SHARDKIT_JOB_DIR"]
    open(os.path.join(job_dir, f"printed-{attempt}-{index}"), "w").close()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(job_dir, f"printed-{attempt}-{i}")) for i in range(count)):
        if time.monotonic() > deadline:
            sys.exit("barrier: the other workers did not print")
        time.sleep(0.02)


def main() -> None:
    ctx = shardkit.trainer.init()
    params = ctx.params
    for name in params.get("names", []):
        value = os.environ[name]
        print(f"stdout {name}={value}", flush=True)
        print(f"stderr {name}={value}", file=sys.stderr, flush=True)
        half = len(value) // 2
        sys.stdout.write(f"split {name}={value[:half]}")
        sys.stdout.flush()
        time.sleep(0.3)  # the halves reach the pipe in two reads
        sys.stdout.write(f"{value[half:]} end\n")
        sys.stdout.flush()
        print(json.dumps({"config": {name: value}}), flush=True)
    for name in params.get("show", []):
        print(f"env {name}={os.environ.get(name)}", flush=True)
    print(f"done {ctx.attempt}", flush=True)
    barrier(ctx.attempt, ctx.role_index, params.get("workers", 1))
    if ctx.attempt in params.get("fail_attempts", []):
        sys.stdout.write(f"last words {os.environ[params['names'][0]]}")  # no newline, then exit
        sys.stdout.flush()
        sys.exit(1)
    with ctx:
        ctx.step(samples=1)


if __name__ == "__main__":
    main()
