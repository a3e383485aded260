"""Run the code blocks of the docs as a reader follows them: extract, run in order, compare outputs.

Used by ``tests/test_docs_blocks.py``. What a page holds decides what runs:

- a ```` ```python ```` block runs in the page's one Python interpreter (blocks of a page build on each
  other, as in a notebook); a ```` ```bash ```` (``sh``, ``shell``) block runs with ``bash -e`` in the
  checkout's root; a ```` ```console ```` block's ``$ command`` lines run there one by one, and what
  each prints is compared with the lines the page shows under it;
- a ```` ```text ```` block right after a block that ran shows that block's output: it is compared with
  what the block printed (other languages, and bare ```` ``` ```` blocks, are not run);
- a block right under a visible line ``*Not run by the docs test: <reason>*`` is not run (the reason
  is shown in the page; an empty reason is refused).

Outputs are compared by :func:`output_mismatch`: numbers, hex ids and runs of spaces may differ, ``...``
matches any text in a line and any lines as a line of its own, and the output may hold more lines
than the page shows. Lines of one process (one ``[prefix]``) keep their order; processes interleave.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

RUNS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash",
        "console": "console"}
NOT_RUN = re.compile(r"^\*Not run by the docs test: (?P<reason>[^*]*)\*$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class Block:
    """One fenced code block of a page."""

    page: str                 # as given to extract: relative to the checkout
    line: int                 # 1-based line of the opening fence
    lang: str                 # the info string's first word ("" for a bare fence)
    code: str                 # dedented to the fence's indent, ending in a newline
    not_run: str | None = None    # the visible reason, where the page marks the block not run
    follows: Block | None = None  # the block right before it, with nothing but blank lines between

    @property
    def kind(self) -> str | None:
        return RUNS.get(self.lang)

    def describe(self) -> str:
        first = [ln for ln in self.code.splitlines() if ln.strip()][:3]
        shown = "\n".join(f"    | {ln}" for ln in first)
        return f"{self.page}:{self.line} (```{self.lang})\n{shown}"


def extract(path: Path, page: str) -> list[Block]:
    """The fenced blocks of a Markdown file, in order, with their not-run reasons."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    last_end = -10          # index of the line that closed the previous block
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m["indent"]), m["fence"], m["info"].strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0] * len(fence)) and not close.strip(fence[0]):
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
            i += 1
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        first = prev                # the paragraph right above the block, which may wrap
        while first > 0 and lines[first - 1].strip() and not _FENCE.match(lines[first - 1]):
            first -= 1
        paragraph = " ".join(ln.strip() for ln in lines[first:prev + 1])
        marker = NOT_RUN.match(paragraph) if prev >= 0 else None
        block = Block(page=page, line=start + 1, lang=info.split()[0] if info else "",
                      code="\n".join(body) + "\n", not_run=marker["reason"].strip() if marker else None)
        if marker and not block.not_run:
            raise ValueError(f"{page}:{first + 1}: a not-run note needs its reason after the colon")
        if blocks and prev == last_end:
            block.follows = blocks[-1]
        blocks.append(block)
        last_end = i
        i += 1
    return blocks


# ---------------------------------------------------------------------------------------------------
# comparing outputs

_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")
_HEX = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{8,}\b")


def _line_pattern(expected: str) -> re.Pattern[str]:
    out: list[str] = []
    for k, part in enumerate(expected.strip().split("...")):
        if k:
            out.append(".*")
        pos = 0
        tokens = sorted([*(_NUMBER.finditer(part)), *(_HEX.finditer(part))], key=lambda t: t.start())
        for tok in tokens:
            if tok.start() < pos:
                continue
            out.append(_escape(part[pos:tok.start()]))
            out.append(r"[0-9a-f]+" if _HEX.fullmatch(tok.group()) else r"-?\d+(?:[.,:]\d+)*")
            pos = tok.end()
        out.append(_escape(part[pos:]))
    return re.compile(r"\s*" + "".join(out) + r"\s*")


def _escape(text: str) -> str:
    return r"\s+".join(re.escape(word) for word in re.split(r"\s+", text))


def _stream(line: str) -> str:
    m = re.match(r"\s*(\[[^\]]+\])", line)
    return m.group(1) if m else ""


def clean_output(text: str) -> list[str]:
    """Output lines as a terminal would end up showing them (progress bars' last state, no colours)."""
    lines = []
    for raw in _ANSI.sub("", text).splitlines():
        lines.append(raw.split("\r")[-1].rstrip())
    return lines


def output_mismatch(expected: str, actual: str) -> str | None:
    """None when ``actual`` shows every line of ``expected`` (tolerantly, see the module), else why not."""
    got = clean_output(actual)
    used = [False] * len(got)
    last: dict[str, int] = {}
    for want in expected.splitlines():
        if not want.strip() or want.strip() == "...":
            continue
        pattern = _line_pattern(want)
        stream = _stream(want)
        start = last.get(stream, -1) + 1
        hit = next((j for j in range(start, len(got)) if not used[j] and pattern.fullmatch(got[j])), None)
        if hit is None:
            near = [g for g in got if g.strip()][-15:]
            return (f"the page shows\n    {want.strip()}\nbut no line of the output matches it (after the "
                    "lines matched before it); the output ends:\n" + "\n".join(f"    {g}" for g in near))
        used[hit] = True
        last[stream] = hit
    return None


def console_steps(code: str) -> Iterator[tuple[str, str]]:
    """``(command, expected output)`` pairs of a console block (``$ `` lines, ``\\`` continues one)."""
    command: list[str] | None = None
    expected: list[str] = []
    continued = False
    for line in code.splitlines():
        if continued and command is not None:
            command.append(line)
            continued = line.rstrip().endswith("\\")
            continue
        if line.startswith("$ "):
            if command is not None:
                yield "\n".join(command), "\n".join(expected)
            command, expected = [line[2:]], []
            continued = line.rstrip().endswith("\\")
        else:
            expected.append(line)
    if command is not None:
        yield "\n".join(command), "\n".join(expected)


# ---------------------------------------------------------------------------------------------------
# running

_INTERPRETER = """\
import json, os, sys, traceback
commands, results = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
sys.argv = [""]
sys.path[0] = ""                      # as `python` started in the checkout
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
for message in commands:
    block = json.loads(message)
    code = "\\n" * (block["line"] - 1) + block["code"]      # tracebacks name the page's own lines
    try:
        exec(compile(code, block["path"], "exec"), namespace)
        result = {"ok": True}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    sys.stdout.flush()
    sys.stderr.flush()
    results.write(json.dumps(result) + "\\n")
    results.flush()
"""


@dataclass
class Outcome:
    block: Block
    seconds: float
    output: str
    error: str | None = None          # why the block failed, None when it passed


def _kill_group(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@dataclass
class PageRunner:
    """Runs one page's blocks in order in ``root``; python blocks share one interpreter."""

    root: Path
    env: Mapping[str, str]
    block_timeout: float
    log_dir: Path
    _python: subprocess.Popen[bytes] | None = None
    _commands: int = -1
    _results: int = -1
    _out_path: Path | None = None
    _offset: int = 0

    def _start_python(self, name: str) -> None:
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        self._out_path = self.log_dir / f"{name}.python.log"
        out = open(self._out_path, "wb")  # noqa: SIM115 - handed to the child
        self._python = subprocess.Popen(
            [self.env.get("SHARDKIT_DOCS_PYTHON", sys.executable), "-u", "-c", _INTERPRETER,
             str(cmd_r), str(res_w)],
            cwd=self.root, env=dict(self.env), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, pass_fds=(cmd_r, res_w), start_new_session=True)
        out.close()
        os.close(cmd_r)
        os.close(res_w)
        self._commands, self._results = cmd_w, res_r
        self._offset = 0

    def close(self) -> None:
        if self._python is not None:
            os.close(self._commands)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._python.wait(timeout=30)
            _kill_group(self._python)
            self._python.wait()
            os.close(self._results)
            self._python = None

    def _new_output(self) -> str:
        assert self._out_path is not None
        data = self._out_path.read_bytes()
        text = data[self._offset:].decode("utf-8", "replace")
        self._offset = len(data)
        return text

    def run_python(self, block: Block) -> Outcome:
        if self._python is None:
            self._start_python(Path(block.page).stem)
        assert self._python is not None
        message = {"code": block.code, "line": block.line + 1, "path": str(self.root / block.page)}
        os.write(self._commands, (json.dumps(message) + "\n").encode())
        t0 = time.monotonic()
        buf = b""
        while b"\n" not in buf:
            left = self.block_timeout - (time.monotonic() - t0)
            ready, _, _ = select.select([self._results], [], [], max(left, 0))
            if not ready:
                _kill_group(self._python)
                self._python.wait()
                self._python = None
                return Outcome(block, time.monotonic() - t0, self._new_output(),
                               f"still running after {self.block_timeout:.0f} s (killed)")
            chunk = os.read(self._results, 65536)
            if not chunk:
                code = self._python.wait()
                self._python = None
                return Outcome(block, time.monotonic() - t0, self._new_output(),
                               f"the page's Python exited with {code} in this block")
            buf += chunk
        result = json.loads(buf.decode())
        return Outcome(block, time.monotonic() - t0, self._new_output(), result.get("error"))

    def run_shell(self, block: Block, script: str, *, errexit: bool = True) -> Outcome:
        """``bash -e -o pipefail`` (a block stops at its first failing command); without ``errexit``,
        as typed at a prompt."""
        t0 = time.monotonic()
        options = ["-e", "-o", "pipefail"] if errexit else []
        proc = subprocess.Popen(["bash", *options, "-c", script], cwd=self.root,
                                env=dict(self.env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=self.block_timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            return Outcome(block, time.monotonic() - t0, out.decode("utf-8", "replace"),
                           f"still running after {self.block_timeout:.0f} s (killed)")
        finally:
            _kill_group(proc)       # what the block left in the background
        text = out.decode("utf-8", "replace")
        error = None if proc.returncode == 0 else f"exited with {proc.returncode}"
        return Outcome(block, time.monotonic() - t0, text, error)

    def run_console(self, block: Block) -> Outcome:
        t0 = time.monotonic()
        outputs = []
        for command, expected in console_steps(block.code):
            step = self.run_shell(block, command, errexit=False)
            outputs.append(f"$ {command}\n{step.output}")
            # a command may fail where the page shows what it prints then (an error message)
            shown = any(ln.strip() for ln in expected.splitlines())
            why = step.error if step.error and (not shown or "exited with" not in step.error) else None
            why = why or output_mismatch(expected, step.output)
            if why:
                return Outcome(block, time.monotonic() - t0, "".join(outputs), f"$ {command}: {why}")
        return Outcome(block, time.monotonic() - t0, "".join(outputs))

    def run(self, block: Block) -> Outcome:
        if block.kind == "python":
            outcome = self.run_python(block)
        elif block.kind == "bash":
            outcome = self.run_shell(block, block.code)
        elif block.kind == "console":
            outcome = self.run_console(block)
        else:
            raise ValueError(f"{block.page}:{block.line}: ```{block.lang} blocks do not run")
        return outcome


_PIP_INSTALL = re.compile(r"^(\s*pip install\b[^#\n]*?)(\s*(#.*)?)$", re.MULTILINE)


def shell_text(block: Block) -> str:
    """What runs of a shell block: ``pip install`` lines as a dry run that changes no environment
    (``--dry-run --no-deps --ignore-installed``: pip still finds or builds what the line names)."""
    return _PIP_INSTALL.sub(lambda m: f"{m.group(1)} --dry-run --no-deps --ignore-installed{m.group(2)}",
                            block.code)


@dataclass
class PageResult:
    outcomes: list[Outcome] = field(default_factory=list)
    not_run: list[Block] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def run_page(root: Path, page: str, env: Mapping[str, str], log_dir: Path, block_timeout: float,
             ran_before: Mapping[str, str] | None = None) -> PageResult:
    """Run the blocks of ``root / page`` in order in ``root``; stop the page at its first failure.

    ``ran_before`` maps a shell block's text (``./scripts/demo``) to the output of that command, run
    before the page: such a block is not run again, and that output stands for its own.
    """
    result = PageResult()
    runner = PageRunner(root=root, env=env, block_timeout=block_timeout, log_dir=log_dir)
    ran: dict[int, Outcome] = {}
    try:
        for block in extract(root / page, page):
            if block.not_run is not None:
                if block.kind or block.lang == "text":
                    result.not_run.append(block)
                continue
            if block.kind is None:
                before = ran.get(id(block.follows)) if block.follows else None
                if block.lang == "text" and before is not None:
                    why = output_mismatch(block.code, before.output)
                    result.outcomes.append(Outcome(block, 0.0, "", why))
                    if why:
                        result.failures.append(f"{block.describe()}\nshows the output of\n"
                                               f"{before.block.describe()}\n{why}")
                continue
            if block.kind == "bash" and block.code.strip() in (ran_before or {}):
                outcome = Outcome(block, 0.0, (ran_before or {})[block.code.strip()])
            elif block.kind == "bash":
                outcome = runner.run_shell(block, shell_text(block))
            else:
                outcome = runner.run(block)
            result.outcomes.append(outcome)
            ran[id(block)] = outcome
            if outcome.error:
                result.failures.append(f"{block.describe()}\nfailed: {outcome.error}\n--- its output "
                                       f"(end):\n{outcome.output[-2500:]}")
                break               # the page's later blocks build on this one
    finally:
        runner.close()
    return result
