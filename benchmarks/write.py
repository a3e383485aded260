"""WRITE benchmark: plain pyarrow vs shardkit's writers (pandas, Arrow, Spark), same rows, one run.

Every case runs in a fresh process (see `benchmarks.common`), builds its input in memory from the
deterministic ANCHORS rows of `benchmarks.data` (an Arrow table, record batches, a pandas DataFrame of
per-row arrays; Spark: a DataFrame over the cached raw Parquet copy), and only then starts the clock;
the clock stops when the dataset is complete on disk (shardkit: committed). Ratios are to plain
``pyarrow.parquet.write_table`` on the same rows, with the same compression and row-group size,
measured in the same run.

Cases:
    pyarrow             pq.write_table(table) — arrays as fixed_size_list, pyarrow's default options
    pyarrow-tuned       the same, with shardkit's column options (dictionary and statistics on scalars only)
    shardkit-arrow      write_dataset(iterator of record batches, arrays as fixed_shape_tensor)
    shardkit-arrow-nocrc  the same without Parquet page checksums (shardkit.dataset.write.PAGE_CHECKSUMS =
                        False in its process): the cost of the CRC-32 shardkit writes on every page
    shardkit-pandas     write_dataset(DataFrame whose tensor cells are numpy arrays)
    shardkit-numpy-png  write_dataset(dict of numpy columns) with the image stored as PNG (ImageCodec("png"))
    spark-parquet       Spark's own df.write.parquet of the same rows (the Spark baseline)
    shardkit-spark      shardkit.dataset.spark.write_spark(df, url, schema=...)
    petastorm           Petastorm 0.13.1 materialize_dataset (PNG image, npy features), in its own venv

Usage (from the repository root):
    python -m benchmarks.write                  # full run (sizes 20k, 100k, 200k), saves results/
    python -m benchmarks.write --quick          # smoke run: 2,000 rows, no Spark, no Petastorm, not saved
    python -m benchmarks.write --sizes 20000 --cases pyarrow,shardkit-arrow --repeat 5
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

import shardkit
from benchmarks import data
from benchmarks.common import (
    MB,
    RESULTS,
    SCRATCH,
    CaseFailed,
    Phase,
    dir_bytes,
    fmt_bytes,
    machine_id,
    machine_info,
    median_of,
    run_case,
    save_results,
    table,
    write_json,
)
from benchmarks.petastorm_env import SIDE, run_in_petastorm


def _shardkit_row_group_bytes() -> int:
    """shardkit's default ``row_group_size`` (encoded bytes), so pyarrow's row groups match it."""
    from shardkit.dataset.write import parse_size

    default = inspect.signature(shardkit.write_dataset).parameters["row_group_size"].default
    return parse_size(default, what="row_group_size")


ROW_GROUP_BYTES = _shardkit_row_group_bytes()
BASELINE = "pyarrow"
CORE = ["pyarrow", "pyarrow-tuned", "shardkit-arrow", "shardkit-arrow-nocrc", "shardkit-pandas"]
QUICK = ["pyarrow", "shardkit-arrow", "shardkit-arrow-nocrc", "shardkit-pandas", "shardkit-numpy-png"]
# the cost of writing page checksums: shardkit-arrow (on, the default) vs the same without them
CHECKSUM_PAIR = ("shardkit-arrow", "shardkit-arrow-nocrc")
CHECKSUM_COST = 0.05  # writing page checksums costs at most 5 % of rows/s (issue 27)
SPARK = ["spark-parquet", "shardkit-spark"]
ALL_CASES = [*CORE, "shardkit-numpy-png", *SPARK, "petastorm"]
SLOW = ["shardkit-numpy-png", *SPARK, "petastorm"]  # context, not targets: fewer runs, smaller sizes


# ---- cases: each runs in its own process and returns what it measured -------------------------------

def _out(name: str, rows: int) -> Path:
    path = SCRATCH / f"write-{name}-{rows}"
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _finish(out: Path, rows: int, measured: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """What every case reports (see `Phase`), plus the bytes it wrote; removes the output."""
    result = {"rows": rows, **measured, "bytes_out": dir_bytes(out), **extra}
    shutil.rmtree(out, ignore_errors=True)
    return result


def case_pyarrow(rows: int, tuned: bool = False) -> dict[str, Any]:
    """Plain ``pq.write_table`` of the raw table (fixed_size_list arrays)."""
    tbl = data.table(rows, "list")
    rg_rows = max(1, int(ROW_GROUP_BYTES / (tbl.nbytes / max(1, tbl.num_rows))))
    options: dict[str, Any] = {}
    if tuned:
        options = {"use_dictionary": ["id", "label", "text"], "write_statistics": ["id", "label", "text"]}
    out = _out("pyarrow-tuned" if tuned else "pyarrow", rows)
    out.mkdir()
    with Phase() as ph:
        pq.write_table(tbl, out / "part-0.parquet", compression=data.COMPRESSION, row_group_size=rg_rows,
                       **options)
    return _finish(out, rows, ph.result(), row_group_rows=rg_rows)


def case_shardkit_arrow(rows: int, image: str = "tensor", page_checksums: bool = True) -> dict[str, Any]:
    """``write_dataset`` from an iterator of record batches whose arrays are ``fixed_shape_tensor``.

    ``page_checksums=False``: without Parquet page checksums (the writer's module-level switch, set in
    this process before the write). The pages written are counted, with and without a CRC, after the clock.
    """
    import shardkit.dataset.write as writer

    writer.PAGE_CHECKSUMS = page_checksums
    batches = list(data.iter_batches(rows, "tensor"))
    schema = data.shardkit_schema(image)  # type: ignore[arg-type]
    out = _out(f"shardkit-arrow-{image}{'' if page_checksums else '-nocrc'}", rows)
    with Phase() as ph:
        shardkit.write_dataset(iter(batches), out, schema=schema, compression=data.COMPRESSION,
                               progress=False)
    with_crc, pages = data.page_checksums(out)
    return _finish(out, rows, ph.result(), pages=pages, pages_with_crc=with_crc)


def case_shardkit_numpy(rows: int, image: str = "png") -> dict[str, Any]:
    """``write_dataset`` from one dict of numpy columns (``(n, 32, 32, 3)`` images)."""
    columns = data.numpy_columns(rows)
    schema = data.shardkit_schema(image)  # type: ignore[arg-type]
    out = _out(f"shardkit-numpy-{image}", rows)
    with Phase() as ph:
        shardkit.write_dataset(columns, out, schema=schema, compression=data.COMPRESSION, progress=False)
    return _finish(out, rows, ph.result())


def case_shardkit_pandas(rows: int) -> dict[str, Any]:
    """``write_dataset`` from a pandas DataFrame whose tensor cells are numpy arrays."""
    df = data.frame(rows)
    schema = data.shardkit_schema()
    out = _out("shardkit-pandas", rows)
    with Phase() as ph:
        shardkit.write_dataset(df, out, schema=schema, compression=data.COMPRESSION, progress=False)
    return _finish(out, rows, ph.result())


def _spark() -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    return (SparkSession.builder.master("local[2]").appName("shardkit-bench")
            .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.memory", "4g")
            .config("spark.sql.shuffle.partitions", "2").getOrCreate())


def case_spark(rows: int, writer: str) -> dict[str, Any]:
    """A Spark DataFrame over the raw Parquet file, written by Spark itself or by ``write_spark``."""
    spark = _spark()
    started = time.perf_counter()
    df = spark.read.parquet(str(data.materialize_raw(rows)))
    df.limit(1).collect()  # JVM warm-up outside the clock: the session and the file listing are ready
    setup = time.perf_counter() - started
    out = _out(f"spark-{writer}", rows)
    with Phase(children=True) as ph:
        if writer == "spark":
            df.write.option("compression", data.COMPRESSION).parquet(str(out))
        else:
            from shardkit.dataset.spark import write_spark

            write_spark(df, str(out), schema=data.shardkit_schema(), compression=data.COMPRESSION)
    spark.stop()
    return _finish(out, rows, ph.result(), setup_seconds=setup)


def case_petastorm(rows: int) -> dict[str, Any]:
    """Petastorm's ``materialize_dataset``, run in its own venv (see `benchmarks.petastorm_env`)."""
    raw = data.materialize_raw(rows)
    out = _out("petastorm", rows)
    result = run_in_petastorm(SIDE / "materialize.py", [str(raw), str(out), str(rows)])
    # the numbers are those of the process in the Petastorm venv, not of this wrapper
    keys = ("seconds", "cpu_seconds", "rss_input", "write_peak_rss", "descendants_peak_rss")
    return _finish(out, rows, {k: result[k] for k in keys})


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "pyarrow": ("case_pyarrow", {}),
    "pyarrow-tuned": ("case_pyarrow", {"tuned": True}),
    "shardkit-arrow": ("case_shardkit_arrow", {}),
    "shardkit-arrow-nocrc": ("case_shardkit_arrow", {"page_checksums": False}),
    "shardkit-pandas": ("case_shardkit_pandas", {}),
    "shardkit-numpy-png": ("case_shardkit_numpy", {"image": "png"}),
    # not in the default run: ImageCodec.encode cannot take fixed_shape_tensor Arrow input yet
    "shardkit-arrow-png": ("case_shardkit_arrow", {"image": "png"}),
    "spark-parquet": ("case_spark", {"writer": "spark"}),
    "shardkit-spark": ("case_spark", {"writer": "shardkit"}),
    "petastorm": ("case_petastorm", {}),
}


# ---- the driver --------------------------------------------------------------------------------------

def has_write_spark() -> bool:
    return importlib.util.find_spec("pyspark") is not None and (
        Path(__file__).resolve().parent.parent / "shardkit" / "dataset" / "spark.py"
    ).exists()


def run(rows: int, cases: list[str], repeat: int, slow_repeat: int) -> list[dict[str, Any]]:
    """Every case at one size, round-robin (case A, B, C, then A, B, C again, ...) so that other work
    on the machine disturbs all of them alike; a failed case is recorded with its error, not fatal."""
    if any(c in SLOW for c in cases):
        data.materialize_raw(rows)  # their input: built here once, outside every clock
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    failed: dict[str, str] = {}
    for rep in range(max(repeat, slow_repeat)):
        for name in cases:
            if name in failed or rep >= (slow_repeat if name in SLOW else repeat):
                continue
            func, params = CASES[name]
            try:
                res = run_case(f"benchmarks.write:{func}", {"rows": rows, **params})
            except CaseFailed as e:
                print(f"  {name} @ {rows}: FAILED\n{e}", file=sys.stderr)
                failed[name] = str(e)[-2000:]
                continue
            runs[name].append(res)
            print(f"  {name:<20} {rows:>8,} rows  {res['seconds']:7.2f} s  CPU {res['cpu_seconds']:6.2f} s  "
                  f"load {res['load_1m']:.1f}", file=sys.stderr)
    results = []
    for name in cases:
        if name in failed:
            results.append({"case": name, "rows": rows, "error": failed[name]})
        else:
            results.append({**median_of(runs[name]), "case": name, "repeat": len(runs[name])})
    return results


def report(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table, each case with its ratio to plain pyarrow at the same size.

    ``vs pyarrow`` compares wall time (rows/s); ``CPU vs pyarrow`` compares CPU seconds, which other
    work on the machine disturbs less. Both are > 1 when the case is faster than pyarrow.
    """
    base = {r["rows"]: r for r in results if r["case"] == BASELINE and "seconds" in r}
    lines = []
    for r in results:
        if "error" in r:
            lines.append([f"{r['rows']:,}", r["case"], "failed", *["-"] * 7])
            continue
        rate = r["rows"] / r["seconds"]
        b = base.get(r["rows"])
        extra = r.get("descendants_peak_rss")
        lines.append([
            f"{r['rows']:,}", r["case"], f"{rate:,.0f}", f"{rate * data.ROW_BYTES / MB:,.0f}",
            f"{b['seconds'] / r['seconds']:.2f}x" if b else "-",
            f"{b['cpu_seconds'] / r['cpu_seconds']:.2f}x" if b and r.get("cpu_seconds") else "-",
            f"{r['bytes_out'] / MB:,.0f}",
            fmt_bytes(r["write_peak_rss"]) + (f" (+{fmt_bytes(extra)} JVM/workers)" if extra else ""),
            fmt_bytes(max(0, r["write_peak_rss"] - r["rss_input"])),
            f"{r.get('load_1m', 0):.1f}",
        ])
    headers = ["rows", "writer", "rows/s", "MB/s", "vs pyarrow", "CPU vs pyarrow", "MB on disk",
               "peak RSS (write)", "over input", "load"]
    return table(headers, lines)


def report_checksums(results: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """What writing page checksums costs, per size: shardkit-arrow (checksums on) vs shardkit-arrow-nocrc,
    same rows, same run (round-robin); plus how many pages each wrote with a CRC."""
    on, off = CHECKSUM_PAIR
    by = {(r["case"], r["rows"]): r for r in results if "seconds" in r}
    lines, verdicts = [], []
    for rows in sorted({r["rows"] for r in results}):
        a, b = by.get((on, rows)), by.get((off, rows))
        if not (a and b):
            continue
        ratio = b["seconds"] / a["seconds"]
        cpu = f"{b['cpu_seconds'] / a['cpu_seconds']:.2f}x" if a.get("cpu_seconds") and b.get("cpu_seconds") \
            else "-"
        rounds = [rb["seconds"] / ra["seconds"] for ra, rb in zip(a.get("runs", []), b.get("runs", []),
                                                                  strict=False) if ra.get("seconds")]
        spread = f"; per round {min(rounds):.2f}x-{max(rounds):.2f}x" if len(rounds) > 1 else ""
        crc = (f"pages with a CRC {a.get('pages_with_crc', 0):,.0f}/{a.get('pages', 0):,.0f} vs "
               f"{b.get('pages_with_crc', 0):,.0f}/{b.get('pages', 0):,.0f}")
        cpu_ratio = b["cpu_seconds"] / a["cpu_seconds"] if a.get("cpu_seconds") and b.get("cpu_seconds") \
            else None
        ok = ratio >= 1 - CHECKSUM_COST and (cpu_ratio is None or cpu_ratio >= 1 - CHECKSUM_COST)
        target = (f"page checksums on write ({rows:,} rows): <= {CHECKSUM_COST:.0%} of rows/s and of rows "
                  "per CPU-second")
        verdicts.append({"target": target, "result": "PASS" if ok else "MISS",
                         "detail": f"{ratio:.2f}x, {cpu}"})
        lines.append(f"page checksum cost (write, {rows:,} rows): {on} vs {off} = {ratio:.2f}x rows/s, {cpu} "
                     f"rows/CPU-s ({rows / a['seconds']:,.0f} vs {rows / b['seconds']:,.0f} rows/s; load "
                     f"{a.get('load_1m', 0):.1f} / {b.get('load_1m', 0):.1f}; k={a.get('repeat', 1)}"
                     f"{spread}; "
                     f"{crc}) target >= {1 - CHECKSUM_COST:.2f}x: {'PASS' if ok else 'MISS'}")
    return "\n".join(lines), verdicts


def merge_into(path: Path, results: list[dict[str, Any]], cases: list[str], sizes: list[int],
               seconds: float, load_before: Any) -> None:
    """Put ``results`` into the saved run at ``path`` (each replaces the saved result of its case and
    size; the others are kept), note when this part ran, and render the tables and verdicts again."""
    doc = json.loads(path.read_text())
    new = {(r["case"], r["rows"]) for r in results}
    doc["results"] = [r for r in doc["results"] if (r.get("case"), r.get("rows")) not in new] + results
    doc["results"].sort(key=lambda r: (r.get("rows", 0), doc["cases"].index(r["case"])
                                       if r.get("case") in doc["cases"] else len(doc["cases"])))
    doc["parts"] = [p for p in doc.get("parts", []) if not (set(p["cases"]) <= set(cases)
                                                           and set(p["sizes"]) <= set(sizes))]
    doc["parts"].append({"cases": cases, "sizes": sizes, "command": " ".join(["python", *sys.orig_argv[1:]]),
                         "created": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                         "seconds": seconds, "load_before": load_before, "load_after": os.getloadavg()})
    checksum_text, verdicts = report_checksums(doc["results"])
    doc["table"] = "\n\n".join(t for t in (report(doc["results"]), checksum_text) if t)
    doc["targets"] = verdicts
    write_json(path, doc)
    print(doc["table"])
    print(f"merged {cases} x {sizes} into {path.name}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2,000 rows, the main cases once, no Spark/Petastorm, not saved")
    parser.add_argument("--sizes", default="20000,100000,200000", help="comma-separated row counts")
    parser.add_argument("--cases", default="all", help=f"comma-separated, from {sorted(CASES)}")
    parser.add_argument("--repeat", type=int, default=3, help="fresh-process runs per case (median)")
    parser.add_argument("--slow-repeat", type=int, default=1, help="runs of the PNG, Spark, Petastorm cases")
    parser.add_argument("--slow-max-rows", type=int, default=100_000,
                        help="PNG, Spark and Petastorm run only up to this size (~1 min each at 100k)")
    parser.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other cases and sizes of this machine's saved run: these (case, "
                             "rows) results replace theirs, and the file records when each part ran")
    args = parser.parse_args(argv)

    sizes = [2000] if args.quick else [int(s) for s in args.sizes.split(",")]
    cases = QUICK if args.quick else (ALL_CASES if args.cases == "all" else args.cases.split(","))
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {sorted(CASES)}")
    repeat = 1 if args.quick else args.repeat
    if any(c in SPARK for c in cases) and not has_write_spark():
        print("shardkit.dataset.spark (write_spark) is not there: skipping shardkit-spark", file=sys.stderr)
        cases = [c for c in cases if c != "shardkit-spark"]
    info = machine_info()
    print(f"write benchmark on {machine_id(info)} ({info['cpu_model']}), sizes {sizes}, cases {cases}",
          file=sys.stderr)
    results: list[dict[str, Any]] = []
    started, load_before = time.perf_counter(), os.getloadavg()
    for rows in sizes:
        here = [c for c in cases if c not in SLOW or rows <= args.slow_max_rows]
        results += run(rows, here, repeat, args.slow_repeat)
    saved = RESULTS / f"write-{machine_id(info)}.json"
    if args.merge and not (args.quick or args.no_save) and saved.exists():
        merge_into(saved, results, cases, sizes, time.perf_counter() - started, load_before)
        return
    checksum_text, verdicts = report_checksums(results)
    text = "\n\n".join(t for t in (report(results), checksum_text) if t)
    print(text)
    if not (args.quick or args.no_save):
        path = save_results("write", {"sizes": sizes, "cases": cases, "repeat": repeat,
                                      "row_bytes": data.ROW_BYTES, "table": text, "targets": verdicts,
                                      "results": results})
        print(f"saved {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}",
              file=sys.stderr)
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
