"""The performance page of the docs (``docs/performance.md``), generated from ``benchmarks/results/*.json``.

A measured figure lives in one place: the results file its benchmark saved, and this page made from
them. Nothing here measures; run a benchmark to change a figure, then this to publish it.

Usage (from the repository root):
    python -m benchmarks.report            # write docs/performance.md
    python -m benchmarks.report --check    # exit 1 when the page is not what the results make
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"

#: the benchmarks in the page's order, with what each measures
ABOUT = {
    "read": "shardkit's reader beside raw pyarrow, Petastorm, HF datasets and a loopback S3 store, on the "
            "same rows; the cost of checking page checksums (the `-noverify` rows).",
    "write": "writing datasets (pandas, Arrow, numpy with PNG images, Spark) beside pyarrow and Petastorm; "
             "the cost of writing page checksums (the `-nocrc` row).",
    "write_images": "existing JPEG files written as a dataset: stored as they are (`bytes` values) beside "
                    "decoded and encoded again (pixels); how many stored values are byte-identical to "
                    "their files.",
    "tables": "Delta Lake and Iceberg tables read in place beside the same files read as a plain folder and "
              "Ray Data's own readers; opening and planning tables of 1,000 and 10,000 files.",
    "images": "JPEG pipelines (decode + augment, decode only, raw bytes) in shardkit beside LitData and "
              "Mosaic Streaming on the same JPEG bytes: images/s, first batch, memory, CPU, shuffle reach, "
              "resume, and converting the JPEGs.",
    "take": "random access by index: single rows and 256-row batches looked up by shardkit (`Dataset.take`, "
            "`MapDataset`) beside HF datasets, Mosaic Streaming, LitData and Lance, locally and from a "
            "loopback S3 store 0 and 50 ms away; bytes fetched per row beside the bytes of the pages holding "
            "the rows.",
    "adapters": "the PyTorch, TensorFlow and JAX adapters beside the reader they wrap and their peers.",
    "train": "a real training job's samples/s with shardkit's reader and supervisor beside a bare loop.",
    "engines": "one job on every engine (local, torchrun, Ray, Spark, across hosts): first step, "
               "throughput, recovery.",
    "gpu": "the CUDA path: host-to-device copies and loaders into GPU memory.",
}


def _machine(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    return (f"{m.get('cpus', '?')} CPUs ({m.get('cpu_model', '?')}), {m.get('ram_gib', '?')} GiB, "
            f"Python {m.get('python', '?')}, pyarrow {m.get('versions', {}).get('pyarrow', '?')}")


def _tables_text(doc: dict[str, Any]) -> str:
    """The tables benchmark's figures (its results hold data, not a printed table)."""
    lines = ["| case | rows/s | rows/CPU-s |", "|---|---:|---:|"]
    for name, r in doc.get("read", {}).items():
        cpu = f"{r['rows_per_cpu_s']:,.0f}" if "rows_per_cpu_s" in r else "-"
        lines.append(f"| {name} | {r['rows_per_s']:,.0f} | {cpu} |")
    if doc.get("ray"):
        lines += ["", "| Ray Data | rows/s |", "|---|---:|"]
        for name, r in doc["ray"].items():
            lines.append(f"| {name} | {r['rows_per_s']:,.0f} |" if "rows_per_s" in r else f"| {name} | - |")
    if doc.get("plan"):
        lines += ["", "| table | files | open (cold) | open (footers cached) | plan | open, 1% filter |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, r in doc["plan"].items():
            filtered = (f"{r['open_filtered_cold_s']:.2f} s ({r['files_filtered']:,} files)"
                        if "open_filtered_cold_s" in r else "-")
            lines.append(f"| {name} | {r['files']:,} | {r['open_cold_s']:.2f} s | {r['open_warm_s']:.2f} s | "
                         f"{r['plan_s'] * 1000:.0f} ms | {filtered} |")
    if "load_1m" in doc:
        lines += ["", f"load (1 min) during the run: {doc['load_1m']:.2f}"]
    return "\n".join(lines)


def render(results: Path = RESULTS) -> str:
    docs = []
    for path in sorted(results.glob("*.json")):
        doc = json.loads(path.read_text())
        docs.append((path.name, doc))
    order = {name: k for k, name in enumerate(ABOUT)}
    docs.sort(key=lambda item: (order.get(item[1].get("benchmark", ""), len(order)), item[0]))
    out = [
        "# Performance",
        "",
        "Every figure on this page comes from a results file in `benchmarks/results/`, saved by the "
        "benchmark that measured it, one file per benchmark and machine kind; the page is generated "
        "from them (`python -m benchmarks.report`). Each section names the machine, the command and "
        "when it ran. Ratios are measured in one run, beside the peers, on the same data; rows per "
        "CPU-second are steadier than rows/s where other work shared the machine (the load is shown). "
        "How to run them: [development](development.md).",
        "",
    ]
    current = None
    for name, doc in docs:
        bench = doc.get("benchmark", name.split("-")[0])
        if bench != current:
            current = bench
            out += [f"## {bench}", "", ABOUT.get(bench, ""), ""]
        out += [f"### {name.removesuffix('.json').removeprefix(bench + '-')}", "",
                f"{_machine(doc)}; `{doc.get('command', '?')}`; {doc.get('created', '?')}", ""]
        for part in doc.get("parts", []):  # cases measured again later (`--merge`) on the same machine
            out += [f"- {', '.join(part['cases'])}: `{part['command']}`; {part['created']}"]
        if doc.get("parts"):
            out += [""]
        text = doc["table"] if "table" in doc else _tables_text(doc)
        out += ["```text", text.rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/performance.md is not what the results make")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: the results in {RESULTS.relative_to(ROOT)} make "
                  "another page. Run `python -m benchmarks.report` and commit the page", file=sys.stderr)
            sys.exit(1)
        print(f"{PAGE.relative_to(ROOT)} is up to date")
        return
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
