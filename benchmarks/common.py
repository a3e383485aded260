"""Measurement helpers: one case per fresh process, medians, machine info, tables and saved results.

A *case* is a function ``f(**params) -> dict`` in a benchmarks module. `run_case` runs it in a fresh
interpreter (``python -m benchmarks.common --child module:function PARAMS_JSON``), so imports, caches
and the peak RSS (``VmHWM``) belong to that one run. The child prints one line
``BENCH_RESULT {json}``: the case's dict plus ``peak_rss`` (this process's ``VmHWM``) and
``children_peak_rss`` (waited-for children, e.g. a JVM that exited).

This module imports only the standard library, so the child runner also works in the other venvs
(Petastorm's, Hugging Face's) with ``python=`` pointing there.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
#: Where data caches and scratch outputs go; a test points it at a temporary folder.
BENCH_DIR = Path(os.environ.get("SHARDKIT_BENCH_DIR") or ROOT / ".bench")
SCRATCH = BENCH_DIR / "scratch"
MARKER = "BENCH_RESULT "
MB = 1e6


class CaseFailed(RuntimeError):
    """A case's process exited non-zero or printed no result."""


def run_case(
    target: str,
    params: dict[str, Any],
    *,
    python: str | os.PathLike[str] = sys.executable,
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> dict[str, Any]:
    """Run the case ``"module:function"`` with ``params`` in a fresh process and return its result."""
    cmd = [str(python), "-m", "benchmarks.common", "--child", target, json.dumps(params)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise CaseFailed(f"{target} {params} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(MARKER):])
    result["process_seconds"] = time.perf_counter() - started
    return result


def median_of(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs: the median of every number, the individual runs kept under ``runs``."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs if key in r]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        out[key] = statistics.median(values) if numeric else value
    out["runs"] = [{k: v for k, v in r.items() if isinstance(v, int | float)} for r in runs]
    return out


def round_robin(cases: Sequence[str], run: Callable[[str], dict[str, Any]], repeat: int,
                log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Run every case once, then every case again, ``repeat`` times (drift on a shared machine hits every
    case alike): ``{case: {"case": case, **median_of(its runs)}}``, or ``{"case": case, "error": ...}``
    for a case whose run failed (not run again). ``run(case)`` runs one case in a fresh process."""
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    errors: dict[str, str] = {}
    width = max(map(len, cases), default=0) + 1
    for i in range(repeat):
        for name in cases:
            if name in errors:
                continue
            try:
                res = run(name)
            except (CaseFailed, RuntimeError, OSError) as e:
                errors[name] = str(e)[-3000:]
                log(f"  {name}: FAILED\n{errors[name]}")
                continue
            runs[name].append(res)
            log(f"  [{i + 1}/{repeat}] {name:<{width}} {res['rows'] / res['seconds']:>10,.0f} rows/s  "
                f"RSS {fmt_bytes(res['rss'])}  load {res.get('load_1m', 0):.1f}")
    out = {name: {"case": name, **median_of(r)} for name, r in runs.items() if r}
    out.update({name: {"case": name, "error": e} for name, e in errors.items()})
    return out


def repeat_case(target: str, params: dict[str, Any], k: int, **kwargs: Any) -> dict[str, Any]:
    """`run_case` ``k`` times (each a fresh process); the median of them (see `median_of`)."""
    return median_of([run_case(target, params, **kwargs) for _ in range(k)])


def current_rss() -> int:
    """This process's resident set size now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's peak resident set size, in bytes: the kernel's ``VmHWM``.

    Not ``ru_maxrss``: the kernel carries it across fork+exec, so a child started by a large parent
    (the benchmark driver, a test runner) would report the parent's peak. ``ru_maxrss`` only where
    ``/proc`` is missing.
    """
    return _vm_hwm() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _vm_hwm(pid: int | str = "self") -> int:
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0


def descendants(pid: int | None = None) -> set[int]:
    """Process ids of every live descendant of ``pid`` (default: this process)."""
    root = os.getpid() if pid is None else pid
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def reset_peak_rss(*, children: bool = False) -> None:
    """Restart the peak-RSS high-water mark (``VmHWM``) of this process, and of its descendants if asked.

    Linux >= 4.0: writing 5 to ``/proc/PID/clear_refs`` resets it, so the peak of one phase (the write)
    is not hidden by an earlier one (building the input). Where that is refused, nothing happens and
    `phase_peak_rss` reports the whole-life peak.
    """
    for pid in ["self", *(descendants() if children else ())]:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            continue


def phase_peak_rss() -> int:
    """This process's peak RSS since `reset_peak_rss`, in bytes."""
    return peak_rss()


def descendants_peak_rss(pid: int | None = None) -> int:
    """Sum of the peak RSS (``VmHWM``) of every live descendant of ``pid``: e.g. Spark's JVM and workers.

    A sum of peaks is an upper bound of the peak of the sum; call it before the children exit.
    """
    return sum(_vm_hwm(p) for p in descendants(pid))


def _cpu_ticks(pid: int | str) -> int:
    """utime + stime (+ waited-for children's) of ``pid`` in clock ticks; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime


def tree_cpu_seconds(*, children: bool = False) -> float:
    """CPU seconds used so far by this process (all threads) and its waited-for children, and by its live
    descendants if asked. This process's own to the nanosecond (``process_time``, ``getrusage``), not in
    clock ticks: a tick is 10 ms, a fifth of a 50 ms case."""
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = time.process_time() + reaped.ru_utime + reaped.ru_stime
    return own + sum(_cpu_ticks(p) for p in (descendants() if children else ())) / os.sysconf("SC_CLK_TCK")


class Phase:
    """The measured part of a case: ``with Phase() as ph: write(...)``, then ``ph.result()``.

    Wall seconds; CPU seconds (steadier than wall time when other work shares the machine); the RSS
    the input holds at the start and the peak RSS during the phase; with ``children=True`` also the CPU
    and summed peak RSS of live child processes (Spark's JVM and Python workers).
    """

    def __init__(self, *, children: bool = False) -> None:
        self.children = children
        self.rss_input = self._cpu0 = self._t0 = 0.0
        self.seconds = self.cpu_seconds = 0.0
        self.write_peak_rss = self.descendants_peak_rss = 0

    def __enter__(self) -> Phase:
        gc.collect()
        reset_peak_rss(children=self.children)
        self.rss_input = current_rss()
        self._cpu0 = tree_cpu_seconds(children=self.children)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = tree_cpu_seconds(children=self.children) - self._cpu0
        self.write_peak_rss = phase_peak_rss()
        self.descendants_peak_rss = descendants_peak_rss() if self.children else 0

    def result(self) -> dict[str, Any]:
        keys = ["seconds", "cpu_seconds", "rss_input", "write_peak_rss"]
        return {k: getattr(self, k) for k in [*keys, *(["descendants_peak_rss"] if self.children else [])]}


def dir_bytes(path: str | os.PathLike[str]) -> int:
    """Total size of the files under ``path`` (or of the file itself)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def machine_info() -> dict[str, Any]:
    """CPU count and model, RAM, OS, Python and the main libraries' versions of this process."""
    model = "unknown"
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        model = m.group(1).strip() if m else model
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = {}
    for name in ("numpy", "pyarrow", "pandas", "pyspark", "shardkit"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = None
    return {
        "cpus": os.cpu_count(), "cpu_model": model, "ram_gib": round(ram / 2**30, 1),
        "os": platform.platform(), "python": platform.python_version(), "versions": versions,
    }


def machine_id(info: dict[str, Any]) -> str:
    """A short file-name-safe name of the machine kind: ``2cpu-amd-epyc-24gib``."""
    model = re.sub(r"\(.*?\)|cpu|processor|@.*|\d+-core", "", str(info["cpu_model"]), flags=re.I)
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "cpu"
    return f"{info['cpus']}cpu-{slug}-{round(info['ram_gib'])}gib"


def save_results(name: str, payload: dict[str, Any], *, directory: Path = RESULTS) -> Path:
    """Write ``payload`` (plus machine info and a timestamp) to ``results/<name>-<machine>.json``."""
    info = machine_info()
    created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    doc = {"benchmark": name, "machine": info, "created": created,
           "command": " ".join(["python", *sys.orig_argv[1:]]), **payload}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{machine_id(info)}.json"
    write_json(path, doc)
    return path


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write a results document with the paths of the machine it ran on taken out: a path inside the
    repository as the repository names it (``benchmarks/common.py``), one under the home folder as
    ``~/...`` (a traceback of a case that failed names both). Results speak of the project, not of the
    machine it was checked out on; every writer of ``results/`` goes through here."""
    text = json.dumps(doc, indent=2, sort_keys=False) + "\n"
    for prefix, short in ((f"{ROOT}/", ""), (f"{Path.home()}/", "~/")):
        text = text.replace(json.dumps(prefix)[1:-1], short)
    path.write_text(text)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (right-aligned numbers) that reads well in a terminal too."""
    body = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    numeric = [bool(body) and all(re.match(r"^[-\d.,x ]+[a-zA-Z/%]*$|^-$", r[i]) for r in body)
               for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w)
                                 for c, w, num in zip(cells, widths, numeric, strict=True)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                         for w, num in zip(widths, numeric, strict=True)) + "|"
    return "\n".join([line(list(headers)), sep, *(line(r) for r in body)])


def _child(target: str, params_json: str) -> None:
    module, _, func = target.partition(":")
    fn: Callable[..., dict[str, Any]] = getattr(importlib.import_module(module), func)
    load = os.getloadavg()[0]  # other work on the machine skews a run: keep the evidence with it
    result = fn(**json.loads(params_json))
    result["load_1m"] = max(load, os.getloadavg()[0])
    result["peak_rss"] = peak_rss()
    result["children_peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    sys.stdout.flush()
    print(MARKER + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="run one benchmark case (used by run_case)")
    parser.add_argument("--child", nargs=2, metavar=("MODULE:FUNCTION", "PARAMS_JSON"), required=True)
    args = parser.parse_args()
    _child(*args.child)


if __name__ == "__main__":
    main()
