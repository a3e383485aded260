"""The partition case shared by the engines' multi-host tests: a host cut off mid-job (silence, no reset),
the bounds the job runs with, and what of the job still runs on the cut host."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import yaml

from tests.multihost.netns import Host

#: The partition case's bounds, small so that it runs in a few minutes: a role silent for 8 s stops the
#: group; a node (Ray actor, Spark task) that has not heard from the trainer for 10 s ends the job's
#: processes there.
PARTITION = {"heartbeat_timeout": 8.0, "lost_job_timeout": 10.0, "collective_timeout": 30.0}
#: The issue's bound: every process the job started on the cut host ends within this of the cut.
CUT_HOST_CLEAR_S = 60.0


def with_partition_bounds(config: Path) -> Path:
    """The job config at ``config`` with the `PARTITION` bounds in its ``fault_tolerance`` (in place)."""
    settings = yaml.safe_load(config.read_text())
    settings["fault_tolerance"].update(PARTITION)
    config.write_text(yaml.safe_dump(settings))
    return config


def job_processes(host: Host, job_dir: Path, commands: Sequence[str]) -> list[str]:
    """What of the job runs on ``host``, as ``pid command``: its role processes (their environment names
    the job) and the engine's processes whose command line holds one of ``commands``."""
    found = []
    for pid in host.pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"SHARDKIT_JOB_DIR={job_dir}\0" in raw + "\0" or any(part in cmd for part in commands):
            found.append(f"{pid} {cmd.strip()[:120]}")
    return found


def when_seen(events: Mapping[str, Callable[[], bool]], since: float, job: subprocess.Popen[bytes],
              limit: float) -> dict[str, float]:
    """Seconds from ``since`` (``time.monotonic()``) until each of ``events`` first held, polled every
    0.1 s while ``job`` runs, for at most ``limit`` seconds; an event that never held is left out."""
    seen: dict[str, float] = {}
    while len(seen) < len(events) and job.poll() is None and time.monotonic() - since < limit:
        for name, happened in events.items():
            if name not in seen and happened():
                seen[name] = time.monotonic() - since
        time.sleep(0.1)
    return seen
