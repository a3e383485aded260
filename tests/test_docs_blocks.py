"""Every Python, shell and console block of README.md, docs/index.md and docs/guides/*.md runs as written.

A reader clones the repository, runs ``./scripts/demo`` and then follows a page from its top: this
test does the same. It clones the committed tree (uncommitted files never matter) into a temporary
folder, uses the test's own virtual environment there (``.venv`` links to it; ``scripts/setup`` finds
it installed and installs nothing), runs ``./scripts/demo``, and then runs each page in a copy of that
checkout, its blocks in order (see ``tests/docs_blocks.py`` for what runs and how outputs compare).
A block that is ``./scripts/demo`` alone is that run: its output is compared, the demo not run again.
A block that needs what this machine lacks (a Kubernetes cluster, a GPU, a bucket of yours) says so in
the page, in a ``*Not run by the docs test: ...*`` line above it.

``pip install`` lines run with ``--dry-run --no-deps --ignore-installed``: pip finds (or builds) what
they name, as for a reader, without changing the environment the rest of the test suite runs in.

A failure names the page, the line and the first lines of each block that failed, with its output.
``SHARDKIT_DOCS_PAGES=README.md,docs/guides/pytorch.md`` runs only those pages;
``SHARDKIT_DOCS_WORKTREE=1`` takes README.md, docs/ and examples/ from the working tree instead of the
last commit (to try edits before committing them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.docs_blocks import Block, Outcome, extract, output_mismatch, run_page

REPO = Path(__file__).resolve().parents[1]
STAMP = Path(".venv") / ".shardkit-installed"
BLOCK_TIMEOUT = 300.0


def pages(root: Path) -> list[str]:
    """README.md, docs/index.md, then the guides in the site's order (guides not in the nav last)."""
    nav = re.findall(r"guides/[\w.-]+\.md", (root / "mkdocs.yml").read_text())
    guides = [f"docs/{g}" for g in dict.fromkeys(nav)]
    rest = sorted(str(p.relative_to(root)) for p in (root / "docs" / "guides").glob("*.md"))
    return ["README.md", "docs/index.md", *guides, *(g for g in rest if g not in guides)]


def test_pages_lists_every_guide() -> None:
    listed = pages(REPO)
    assert len(listed) == len(set(listed))
    assert set(listed) >= {str(p.relative_to(REPO)) for p in (REPO / "docs" / "guides").glob("*.md")}


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _checkout(dest: Path) -> None:
    _git("clone", "-q", "--no-hardlinks", str(REPO), str(dest), cwd=REPO)
    if os.environ.get("SHARDKIT_DOCS_WORKTREE") == "1":
        for rel in ["README.md", "docs", "examples"]:
            src = REPO / rel
            if src.is_dir():
                shutil.copytree(src, dest / rel, dirs_exist_ok=True)
            else:
                shutil.copy2(src, dest / rel)


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "COV_"))}
    env["PATH"] = f"{root / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(root)           # `import shardkit` is the checkout's, not the venv's source
    env["SHARDKIT_DOCS_PYTHON"] = str(root / ".venv" / "bin" / "python")
    env.pop("VIRTUAL_ENV", None)
    # the pages' Spark JVMs JIT at C1 only (the `java` launcher reads this; it notes so on stderr): each
    # lives a minute, and the C2 compiler's threads would take a 2-core machine's CPU from the job
    env.setdefault("JDK_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1")
    return env


def _report(outcomes: list[Outcome], skipped: list[Block], failed: list[str], seconds: float) -> str:
    ran = sum(1 for o in outcomes if o.block.kind)
    compared = sum(1 for o in outcomes if not o.block.kind)
    lines = [f"docs blocks: {ran} ran, {compared} outputs compared, {len(skipped)} marked not run, "
             f"{len(failed)} failed, in {seconds:.0f} s"]
    for o in sorted(outcomes, key=lambda o: -o.seconds)[:30]:
        lines.append(f"  {o.seconds:6.1f} s  {o.block.page}:{o.block.line}")
    for b in skipped:
        lines.append(f"  not run  {b.page}:{b.line}: {b.not_run}")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.serial  # after the rest, beside the multi-host tests: real jobs on every engine
@pytest.mark.timeout(1200)
def test_docs_blocks_run_as_written(tmp_path: Path) -> None:
    venv = REPO / ".venv"
    if not (REPO / STAMP).is_file():
        pytest.skip("needs the .venv that scripts/setup installs (scripts/test makes it)")
    t0 = time.monotonic()
    base = tmp_path / "checkout"
    _checkout(base)
    (base / ".venv").symlink_to(venv.resolve())
    # scripts/setup reinstalls when pyproject.toml or its constraints are newer than its stamp: a fresh
    # clone's always are, and a reinstall from here would point the shared environment at this checkout
    stamp_mtime = (REPO / STAMP).stat().st_mtime
    for watched in ("pyproject.toml", "scripts/constraints.txt"):
        os.utime(base / watched, (stamp_mtime - 1, stamp_mtime - 1))
    env = _env(base)
    where = subprocess.run([env["SHARDKIT_DOCS_PYTHON"], "-c", "import shardkit; print(shardkit.__file__)"],
                           cwd=base, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(base), f"shardkit imported from {where}, not from the checkout"

    demo = subprocess.run(["./scripts/demo"], cwd=base, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600, check=False)
    assert demo.returncode == 0, f"./scripts/demo failed ({demo.returncode}):\n{demo.stdout[-3000:]}"
    assert (REPO / STAMP).stat().st_mtime == stamp_mtime, "scripts/setup reinstalled the environment"

    selected = os.environ.get("SHARDKIT_DOCS_PAGES")
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    outcomes: list[Outcome] = []
    skipped: list[Block] = []
    failed: list[str] = []
    for page in pages(base):
        if selected and page not in selected.split(","):
            continue
        root = tmp_path / Path(page).stem
        shutil.copytree(base, root, symlinks=True)
        result = run_page(root, page, _env(root), log_dir, BLOCK_TIMEOUT,
                          ran_before={"./scripts/demo": demo.stdout})
        outcomes += result.outcomes
        skipped += result.not_run
        failed += result.failures
    report = _report(outcomes, skipped, failed, time.monotonic() - t0)
    print(report)
    assert not failed, report + "\n\n" + "\n\n".join(failed)


# the harness itself, on small pages of its own (fast)

def _page(tmp_path: Path, text: str) -> Path:
    (tmp_path / "page.md").write_text(text)
    return tmp_path


def test_tolerant_output_matching() -> None:
    shown = ("[shardkit] job digits succeeded in 7.2 s: 480 steps, 30,000 samples trained\n"
             "...\n"
             "[worker-0] test accuracy: 0.9630 after 480 steps\n"
             "  logs: .../runs/digits-job/logs\n"
             "part-e3c97412e4ed-00000.parquet  1           3     266 B\n")
    printed = ("[worker-0] test accuracy: 0.9574 after 470 steps\n"
               "noise\n"
               "[shardkit] job digits succeeded in 31.8 s: 470 steps, 29,936 samples trained\n"
               "  logs: /tmp/x/runs/digits-job/logs\n"
               "part-0a1b2c3d4e5f-00000.parquet  1     3  270 B\n")
    assert output_mismatch(shown, printed) is None        # processes interleave; numbers and ids vary
    changed = printed.replace("succeeded in", "ended in")
    why = output_mismatch(shown, changed)
    assert why is not None
    assert "[shardkit] job digits succeeded in 7.2 s" in why
    out_of_order = "  logs: /tmp/x/runs/digits-job/logs\nfirst\n"
    assert output_mismatch("first\n  logs: .../runs/digits-job/logs\n", out_of_order) is not None


def test_not_run_notes_are_visible_lines_with_a_reason(tmp_path: Path) -> None:
    root = _page(tmp_path, "# t\n\n*Not run by the docs test: it needs a cluster\nof yours.*\n\n"
                           "```bash\nkubectl apply -f x\n```\n\n<!-- Not run by the docs test: hidden -->\n"
                           "```python\nprint(1)\n```\n")
    first, second = extract(root / "page.md", "page.md")
    assert first.not_run == "it needs a cluster of yours."
    assert second.not_run is None                          # an HTML comment is not a note
    (root / "page.md").write_text("*Not run by the docs test: *\n\n```bash\ntrue\n```\n")
    with pytest.raises(ValueError, match=r"page\.md:1: a not-run note needs its reason"):
        extract(root / "page.md", "page.md")


@pytest.mark.timeout(120)
def test_a_block_whose_output_changed_fails_naming_the_block(tmp_path: Path) -> None:
    root = _page(tmp_path, "# t\n\n```python\nx = 2\n```\n\nProse.\n\n```python\nprint(f'rows: {x * 3}')\n"
                           "print('done')\n```\n\n```text\nrows: 6\nall done\n```\n\n```console\n"
                           "$ echo hello 12\nhello 7\n```\n")
    env = dict(os.environ)
    result = run_page(root, "page.md", env, tmp_path, block_timeout=60)
    assert len(result.failures) == 1
    failure = result.failures[0]
    assert failure.startswith("page.md:14 (```text)\n    | rows: 6\n    | all done\nshows the output of\n"
                              "page.md:9 (```python)\n    | print(f'rows: {x * 3}')")
    assert "    all done\nbut no line of the output matches it" in failure
    assert [o.error for o in result.outcomes if o.block.kind] == [None, None, None]   # the console matched
    (root / "page.md").write_text("```python\nimport os\nos._exit(3)\n```\n\n```bash\necho never\n```\n")
    result = run_page(root, "page.md", env, tmp_path, block_timeout=60)
    assert len(result.outcomes) == 1
    assert result.failures[0].startswith("page.md:1 (```python)")
    assert "the page's Python exited with 3" in result.failures[0]
