"""The repository speaks of the project only: no tracked file names a path of the machine it was developed
or measured on (a benchmark's saved traceback, a doc's example output, a comment)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: an absolute path that may lead into a checkout of this repository: ``/any/where/benchmarks/x.py``
_CHECKOUT_PATH = re.compile(r"(?<![\w.~])(?P<prefix>(?:/[\w.+-]+)+?)/"
                            r"(?P<rel>(?:benchmarks|shardkit|tests|examples|scripts|docs)/[\w./-]*\.[a-z]+)\b")
#: the placeholder the docs use for "your checkout"
_PLACEHOLDER = "/path/to/"
#: a user's home folder on Linux or macOS, or root's
_HOME_PATH = re.compile(r"(?<![\w.~])/(?:home/[\w.-]+|Users/[\w.-]+|root)/")


def tracked_files() -> list[Path]:
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if proc.returncode != 0:
        pytest.fail(f"`git ls-files` failed in {REPO}: {proc.stderr.decode(errors='replace')}")
    return [REPO / name for name in proc.stdout.decode().split("\0") if name]


def machine_paths(text: str) -> list[str]:
    """The paths of a machine that ``text`` names: this checkout's own folder and home folder, any
    absolute path into a checkout of the repository, any home folder."""
    found = [p for p in (f"{REPO}/", f"{Path.home()}/") if p != "//" and p in text]
    found += [m.group(0) for m in _CHECKOUT_PATH.finditer(text)  # a file this repository has, elsewhere
              if (REPO / m["rel"]).is_file() and not (m["prefix"] + "/").startswith(_PLACEHOLDER)]
    found += [m.group(0) for m in _HOME_PATH.finditer(text)]
    return found


def test_no_tracked_file_names_a_path_of_a_machine() -> None:
    offenders: dict[str, list[str]] = {}
    for path in tracked_files():
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # binary fixtures (Parquet, images)
            continue
        if found := machine_paths(text):
            offenders[str(path.relative_to(REPO))] = sorted(set(found))[:3]
    assert not offenders, f"tracked files name paths of a machine (name them from the repo): {offenders}"


@pytest.mark.parametrize("text", [
    '  File "/srv/ci/checkout/benchmarks/common.py", line 319, in <module>',
    "see /home/alice/.cache/x",
    "saved to /Users/bob/runs",
    "token under /root/.ray/",
])
def test_the_check_sees_a_machine_path(text: str) -> None:
    assert machine_paths(text)


@pytest.mark.parametrize("text", [
    '  File "benchmarks/common.py", line 319, in <module>',
    "~/.ray/session_latest",
    "s3://bucket/train/part-0.parquet",
    "runs/digits-job/checkpoints/step-000000100",
    "2.32 GiB JVM/workers",
    "/etc/shardkit/job.json",  # a path inside a container, not a checkout
    "python /path/to/project/examples/train_digits.py",
])
def test_the_check_passes_repository_paths(text: str) -> None:
    assert not machine_paths(text)
