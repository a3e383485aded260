"""The real Petastorm 0.13.1 in its own pinned venv (``.bench/petastorm-venv``), and running scripts in it.

Petastorm does not import with pyarrow >= 16, cannot read with pyarrow 15 and fails with numpy 2, so it
cannot share shardkit's venv. The pins are the set ANCHORS.md measured Petastorm with on this machine kind
(the same set wrote the fixtures under shared/fixtures/petastorm). torch goes in with a SECOND pip command:
petastorm wants setuptools<70 and torch>=2.13 wants setuptools>=77, so one resolver run refuses both.

Usage (from the repository root):
    python -m benchmarks.petastorm_env            # create it (once) and check it reads a fixture
    run_in_petastorm("benchmarks/petastorm_side/read.py", ["--url", url])   # -> the JSON it printed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".bench" / "petastorm-venv"
PYTHON = VENV / "bin" / "python"
SIDE = Path(__file__).resolve().parent / "petastorm_side"
PINS = [
    "petastorm==0.13.1",
    "pyarrow==14.0.2",
    "numpy==1.26.4",
    "pandas==3.0.6",
    "pyspark==4.3.0",
    "opencv-python-headless==4.11.0.86",
    "s3fs==2026.9.0",  # Petastorm reads s3:// through s3fs (the latency cases of benchmarks.read)
]
TORCH = "torch==2.13.0"  # never unpinned: an unpinned torch pulls several GB of CUDA packages
# for make_petastorm_dataset (benchmarks/adapters.py): a THIRD pip command, after torch; 2.21 is the
# newest that still takes numpy 1.26 (checked: it installs beside pyarrow 14 and imports)
TF = "tensorflow-cpu==2.21.0"
STAMP = VENV / ".pins.json"
FIXTURES = Path(os.environ.get("SHARDKIT_SHARED", ROOT.parent / "shared")) / "fixtures" / "petastorm"


def _pip(*args: str) -> None:
    cmd = [str(PYTHON), "-m", "pip", "install", "-q", *args]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def ensure_venv(*, with_torch: bool = True, with_tf: bool = False) -> Path:
    """Create the Petastorm venv if it is missing or its pins changed; return its python.

    ``with_tf`` adds TensorFlow (a third pip command); a venv that has it also serves callers that do
    not ask for it.
    """
    wanted = {"pins": PINS, "torch": TORCH if with_torch else None, **({"tf": TF} if with_tf else {})}
    if PYTHON.exists() and STAMP.exists():
        have = json.loads(STAMP.read_text())
        if all(have.get(k) == v for k, v in wanted.items()):
            return PYTHON
    if not PYTHON.exists():
        VENV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    started = time.monotonic()
    _pip(*PINS)
    if with_torch:
        _pip(TORCH)
    if with_tf:  # with numpy and pyarrow pinned again: alone, pip would move numpy to 2.x under pyarrow 14
        _pip(TF, *(p for p in PINS if p.startswith(("numpy==", "pyarrow=="))))
    STAMP.write_text(json.dumps(wanted))
    print(f"petastorm venv ready in {time.monotonic() - started:.0f} s: {VENV}", file=sys.stderr)
    return PYTHON


def petastorm_env() -> dict[str, str]:
    """Environment for a process in the venv: Spark's workers must run this venv's python too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
    env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = str(PYTHON)
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_in_petastorm(
    script_path: str | os.PathLike[str], args: list[str], *, timeout: float = 1800
) -> dict[str, Any]:
    """Run ``script_path`` with the Petastorm venv's python in a fresh process; return the JSON it printed.

    The script prints one JSON object as its last line of stdout. A failure raises `RuntimeError`
    carrying the script's stderr.
    """
    python = ensure_venv()
    proc = subprocess.run(
        [str(python), str(script_path), *args],
        capture_output=True, text=True, timeout=timeout, env=petastorm_env(), cwd=ROOT, check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{script_path} failed in the Petastorm venv (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-torch", action="store_true", help="skip the second pip command (torch)")
    parser.add_argument("--fixture", default="images", help="which shared Petastorm fixture to read back")
    args = parser.parse_args()
    ensure_venv(with_torch=not args.no_torch)
    out = run_in_petastorm(SIDE / "check.py", [str(FIXTURES / args.fixture)])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
