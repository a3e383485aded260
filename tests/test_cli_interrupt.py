"""Ctrl-C at any moment of a real ``shardkit`` process: one line on stderr, no traceback, status 130.

Each test starts the command as a user does (the console script, or ``python -m shardkit``) and sends a
real SIGINT at a moment it can see, not after a delay:

- ``start`` and ``import``: the process writes a line as each module finishes importing
  (``PYTHONPROFILEIMPORTTIME``), on a pipe of one page that the test stops reading once it has seen the
  line it waits for; a process more than a page of lines ahead blocks on that pipe, so the signal
  lands while its modules are still importing however slow this machine is;
- ``later``: the job config is a named pipe: the command waits in its read.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("shardkit")  # the console script ([project.scripts])
ENTRY = {"script": [str(SCRIPT)], "module": [sys.executable, "-m", "shardkit"]}
PAGE = 4096
IMPORT_LINE = "import time:"

pytestmark = pytest.mark.timeout(120)


def test_the_console_script_is_installed() -> None:
    assert SCRIPT.exists(), f"no console script at {SCRIPT}: install shardkit (scripts/setup) to test it"


def test_a_program_that_imports_the_cli_keeps_its_excepthook() -> None:
    code = ("import sys; hook = sys.excepthook; import shardkit.cli; "
            "assert sys.excepthook is hook, sys.excepthook; shardkit.cli.main(['--version'])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr


def _start(argv: list[str], *, stderr: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    # (a test run started in the background ignores SIGINT, and its children would inherit that)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=stderr)
    finally:
        signal.signal(signal.SIGINT, handler)


def _modules(fd: int) -> Iterator[str]:
    """The name of each module the process imported, as it says so (at most a page read ahead)."""
    pending = b""
    while chunk := os.read(fd, PAGE):
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            text = line.decode(errors="replace")
            if text.startswith(IMPORT_LINE):
                yield text.rsplit("|", 1)[-1].strip()


def _finish(proc: subprocess.Popen[bytes], fd: int) -> tuple[int, list[str]]:
    """Wait for the process, reading the rest of its stderr from ``fd``: its status, and stderr's lines
    other than the import times."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    code = proc.wait(timeout=60)
    err = b"".join(chunks).decode(errors="replace")
    assert "Traceback" not in err, err
    assert "Exception ignored" not in err, err
    return code, [line for line in err.splitlines() if not line.startswith(IMPORT_LINE)]


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Kill the process if the test failed before it ended, and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _interrupt_once_imported(argv: list[str], module: str) -> tuple[int, list[str]]:
    """Start ``argv``, send it SIGINT as soon as it imports ``module`` (its ``-X importtime`` lines on
    stderr say when); its exit code and the rest of its stderr."""
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PAGE)
    try:
        proc = _start(argv, stderr=write)
    finally:
        os.close(write)
    try:
        assert module in _modules(read), f"{module} was never imported"
        proc.send_signal(signal.SIGINT)
        return _finish(proc, read)
    finally:
        _end(proc)
        os.close(read)


def _interrupted(code: int, lines: list[str], command: str) -> None:
    # 130: main's status. -SIGINT (which a shell reports as 130 too): Python ends itself with SIGINT at
    # exit once a KeyboardInterrupt went uncaught in code it ran with PyRun_* (Cython modules' import
    # does), even when main caught it later
    assert code in (130, -signal.SIGINT), (code, lines)
    assert lines == [f"shardkit {command}: interrupted"], lines


@pytest.mark.parametrize(("entry", "after"), [("script", "shardkit.cli"), ("module", "shardkit.cli"),
                                              ("script", "numpy")],
                         ids=["start-script", "start-module", "import-script"])
def test_ctrl_c_while_modules_import(entry: str, after: str, tmp_path: Path) -> None:
    """``start``: right after the module holding main imported (main's first lines); ``import``: while
    numpy's dependents (pyarrow, pandas) import, the first 0.4 s of any command. Both printed
    Python's KeyboardInterrupt traceback: the package imported them before main could catch it."""
    code, lines = _interrupt_once_imported([*ENTRY[entry], "inspect", str(tmp_path / "missing")], after)
    _interrupted(code, lines, "inspect")


def test_ctrl_c_while_a_torchrun_node_imports_torch(tmp_path: Path) -> None:
    """``train`` of a torchrun node interrupted while torch imports (the first seconds of the node, before
    its job has a summary to print) exited 130 without a word: it says ``interrupted`` as every command
    does. Later, in the rendezvous or at work, the node's summary says it (tests/cluster/test_torchrun.py)."""
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text("")
    config = tmp_path / "job.yaml"
    config.write_text(f"name: j\nentrypoint: {script}\nframework: torch\nroles: {{worker: {{count: 1}}}}\n"
                      "engine: {name: torchrun, nnodes: 2, rdzv_endpoint: '127.0.0.1:29400'}\n"
                      f"logdir: {tmp_path / 'job'}\n")
    code, lines = _interrupt_once_imported([*ENTRY["script"], "train", str(config), "--node-rank", "1"],
                                           "torch.nn")
    _interrupted(code, lines, "train")
    assert not (tmp_path / "job").exists(), "interrupted before the node prepared its logdir"


def test_ctrl_c_while_a_command_waits(tmp_path: Path) -> None:
    """Later: ``validate`` reading its config (a named pipe nobody writes) printed a traceback."""
    config = tmp_path / "job.yaml"
    os.mkfifo(config)
    proc = _start([*ENTRY["script"], "validate", str(config)],
                  stderr=subprocess.PIPE)
    writer = None
    try:
        deadline = time.monotonic() + 60
        while writer is None:  # the process opened the pipe to read it: it waits in open() or read()
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "validate did not open its config in 60 s"
            try:
                writer = os.open(config, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
                time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        assert proc.stderr is not None
        code, lines = _finish(proc, proc.stderr.fileno())
    finally:
        if writer is not None:
            os.close(writer)
        _end(proc)
    _interrupted(code, lines, "validate")


def _interrupted_then(error: type[Exception]) -> Exception:
    """``error`` raised while a real SIGINT's ``KeyboardInterrupt`` is handled, as pyarrow raises its
    own error when the interrupt lands in a file object it calls from C++."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the signal's handler runs at the next bytecode
            raise AssertionError("SIGINT did not arrive")
        except KeyboardInterrupt:
            try:
                raise error("I/O operation on closed file")
            except Exception as e:
                return e
    finally:
        signal.signal(signal.SIGINT, handler)


def test_an_interrupt_behind_another_error_is_found() -> None:
    from shardkit.errors import interrupt_behind

    chained = _interrupted_then(ValueError)
    assert isinstance(interrupt_behind(chained), KeyboardInterrupt)
    with pytest.raises(RuntimeError) as outer:
        raise RuntimeError("outer") from chained
    assert interrupt_behind(outer.value) is chained.__context__
    assert interrupt_behind(ValueError("plain")) is None
    assert interrupt_behind(KeyboardInterrupt()) is None  # the interrupt itself: the caller's own except


@pytest.mark.parametrize("command", ["write", "inspect"])
def test_an_interrupt_that_pyarrow_turned_into_its_error_ends_as_ctrl_c(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CI run where ``shardkit write`` printed a traceback and exited 1: the command says
    ``interrupted`` and exits 130."""
    from shardkit import cli
    from shardkit.dataset import convert as convert_module

    def interrupted(*args: object, **kwargs: object) -> None:
        raise _interrupted_then(ValueError)

    monkeypatch.setattr(convert_module, "convert", interrupted)
    monkeypatch.setattr("shardkit.dataset.open_dataset", interrupted)
    argv = ["write", str(tmp_path / "src.parquet"), str(tmp_path / "out")] if command == "write" else [
        "inspect", str(tmp_path)]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("command", ["write", "inspect"])
def test_an_interrupt_that_a_library_swallowed_before_it_failed_ends_as_ctrl_c(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CI run of ``shardkit write`` stopped with SIGINT exited 1 with ``ValueError: I/O operation on
    closed file`` and no interrupt in its chain: pyarrow had swallowed the ``KeyboardInterrupt`` and failed
    afterwards. A real SIGINT arrives during the command, is swallowed, and a plain error follows: the
    command still says ``interrupted`` and exits 130."""
    from shardkit import cli
    from shardkit.dataset import convert as convert_module

    def swallowed_then_failed(*args: object, **kwargs: object) -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            raise AssertionError("SIGINT did not arrive")
        except KeyboardInterrupt:
            pass  # what pyarrow does with an exception inside a file object it calls
        raise ValueError("I/O operation on closed file")

    monkeypatch.setattr(convert_module, "convert", swallowed_then_failed)
    monkeypatch.setattr("shardkit.dataset.open_dataset", swallowed_then_failed)
    argv = ["write", str(tmp_path / "src.parquet"), str(tmp_path / "out")] if command == "write" else [
        "inspect", str(tmp_path)]
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a shell's foreground
    try:
        assert cli.main(argv) == 130
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
    finally:
        signal.signal(signal.SIGINT, handler)
    err = capsys.readouterr().err
    assert "interrupted" in err, err
    assert "Traceback" not in err, err


def test_an_error_without_a_ctrl_c_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error after an earlier command's Ctrl-C is not taken for one: each command counts afresh."""
    from shardkit import cli
    from shardkit.dataset import convert as convert_module

    def failed(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(convert_module, "convert", failed)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(ValueError, match="a bug"):
            cli.main(["write", "src.parquet", "out"])
    finally:
        signal.signal(signal.SIGINT, handler)


def test_a_program_with_its_own_handler_is_not_told_of_an_earlier_commands_ctrl_c(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C counted during one call of `main` does not turn a later call's plain error (in a program
    with a SIGINT handler of its own, where nothing is counted) into an interruption."""
    from shardkit import cli
    from shardkit.cli import _interrupts

    _interrupts._seen.append(KeyboardInterrupt())  # what an earlier command's Ctrl-C left
    from shardkit.dataset import convert as convert_module

    def failed(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(convert_module, "convert", failed)
    handler = signal.signal(signal.SIGINT, lambda signum, frame: None)  # the program's own
    try:
        with pytest.raises(ValueError, match="a bug"):
            cli.main(["write", str(tmp_path / "src.parquet"), str(tmp_path / "out")])
    finally:
        signal.signal(signal.SIGINT, handler)
