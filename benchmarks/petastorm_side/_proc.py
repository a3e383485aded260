"""Process measurements for the scripts in the Petastorm venv (stdlib only; they never import shardkit)."""

import os
import re
import resource
from pathlib import Path


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """VmHWM of this process (ru_maxrss, carried across fork+exec from the parent, only without /proc)."""
    return _vm_hwm() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _descendants() -> set:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _vm_hwm(pid="self") -> int:
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0


def reset_peak_rss() -> None:
    """Restart the VmHWM mark of this process and its descendants (Linux: write 5 to clear_refs)."""
    for pid in ["self", *_descendants()]:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            continue


def phase_peak_rss() -> int:
    """Peak RSS of this process since reset_peak_rss."""
    return _vm_hwm() or peak_rss()


def descendants_peak_rss() -> int:
    """Sum of VmHWM of every live descendant of this process (Spark's JVM and Python workers)."""
    return sum(_vm_hwm(p) for p in _descendants())


def tree_cpu_seconds() -> float:
    """CPU seconds (utime + stime, and waited-for children's) of this process and its live descendants."""
    total = 0
    for pid in ["self", *_descendants()]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += sum(int(v) for v in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")
