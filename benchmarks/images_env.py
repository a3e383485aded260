"""LitData and Mosaic Streaming in their own pinned venv (``.bench/images-venv``) for `benchmarks.images`.

Both want torchvision (``import streaming`` imports it), and the registry's torchvision 0.28.0 is a CUDA
build: pip would pull a CUDA torch with it unless the CPU torch is pinned first. So torch goes in with
its pin in a FIRST pip command and the pins of the peers in a second one that pins torch again; nothing
of this touches shardkit's venv. The pins are the set ANCHORS.md measured the peers with.

Usage (from the repository root):
    python -m benchmarks.images_env      # create it (once) and print the peers' versions
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".bench" / "images-venv"
PYTHON = VENV / "bin" / "python"
TORCH = "torch==2.13.0"  # never unpinned: an unpinned torch pulls several GB of CUDA packages
PINS = [
    "litdata==0.2.76",
    "mosaicml-streaming==0.13.0",
    TORCH,
    "torchvision==0.28.0",
    "pillow==13.0.0",
]
STAMP = VENV / ".pins.json"


def _pip(*args: str) -> None:
    cmd = [str(PYTHON), "-m", "pip", "install", "-q", *args]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def ensure_venv() -> Path:
    """Create the peers' venv if it is missing or its pins changed; return its python."""
    wanted = {"torch": TORCH, "pins": PINS}
    if PYTHON.exists() and STAMP.exists() and json.loads(STAMP.read_text()) == wanted:
        return PYTHON
    if not PYTHON.exists():
        VENV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    started = time.monotonic()
    _pip(TORCH)
    _pip(*PINS)
    STAMP.write_text(json.dumps(wanted))
    print(f"images venv ready in {time.monotonic() - started:.0f} s: {VENV}", file=sys.stderr)
    return PYTHON


def peer_env() -> dict[str, str]:
    """Environment for a process in the venv: its own site-packages only, no telemetry, no prompts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    python = ensure_venv()
    code = ("import benchmarks.images_peers as p; p.import_streaming(); import litdata, streaming, torch; "
            "print(litdata.__version__, streaming.__version__, torch.__version__)")
    subprocess.run([str(python), "-c", code], check=True, cwd=ROOT, env=peer_env())


if __name__ == "__main__":
    main()
