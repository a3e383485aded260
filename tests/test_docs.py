"""The docs site builds with ``mkdocs build --strict`` (every page in the nav, every link resolves, the
reference pages generate from the code), and the performance page is what the results make."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    site = tmp_path / "site"
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "shardkit verify" in cli  # generated from the argument parser
    config = (site / "reference" / "config" / "index.html").read_text()
    assert "fault_tolerance" in config
    assert "lost_job_timeout" in config  # generated from the job config's models
    errors = (site / "reference" / "errors" / "index.html").read_text()
    assert "StorageFullError" in errors
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "make_reader" in api
    assert "write_dataset" in api


def test_the_performance_page_is_what_the_results_make() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.report", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_install_line_installs_this_checkout_with_the_torch_pin_it_states(page: str) -> None:
    """shardkit is not on PyPI: the install line installs the clone (``.``) with extras it has, and the
    torch pin the page states is the torch extra's (tests/test_docs_blocks.py runs the line itself)."""
    import re
    import tomllib

    text = (REPO / page).read_text()
    line = re.search(r"^pip install (\S+)", text, re.MULTILINE)
    assert line is not None, f"{page} has no pip install line"
    target = line.group(1).strip("'\"")
    assert target.startswith(".["), f"{page}: {target!r} is not installed from the checkout"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(target[2:-1].split(",")) <= set(extras)
    pins = re.findall(r"torch==[\d.]+", text)
    assert pins
    assert set(pins) == {p for p in extras["torch"] if p.startswith("torch==")}
