"""The local engine with real processes: logs, exits, environment, and stopping whole process groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardkit.cluster._spec import ClusterSpec, ProcessSpec
from shardkit.cluster.engines import get_engine
from shardkit.cluster.engines.local import LocalEngine, LocalGroup, group_members
from shardkit.errors import ConfigError
from tests.trainer.scripts import proctree

pytestmark = [pytest.mark.distributed]


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


def spec(*codes: str, env: dict[str, str] | None = None) -> ClusterSpec:
    processes = [ProcessSpec("worker", i, [sys.executable, "-u", "-c", code], dict(env or {}))
                 for i, code in enumerate(codes)]
    return ClusterSpec(processes, "127.0.0.1", 0, Path("."), None, [])


def wait_exits(group: LocalGroup, count: int, timeout: float = 20.0) -> list[tuple[str, int | None]]:
    exited: list[tuple[str, int | None]] = []
    deadline = time.monotonic() + timeout
    while len(exited) < count and time.monotonic() < deadline:
        exited += [(p.name, p.returncode) for p in group.poll()]
        time.sleep(0.02)
    return exited


@pytest.mark.timeout(60)
def test_exits_logs_and_output(tmp_path: Path) -> None:
    group = LocalEngine().start(spec("print('hello'); import sys; print('oops', file=sys.stderr)",
                                     "import os, signal; print('bye', flush=True); os.kill(os.getpid(), 9)",
                                     "raise SystemExit(3)"), log_dir=tmp_path)
    try:
        exited = dict(wait_exits(group, 3))
        assert exited == {"worker-0": 0, "worker-1": -signal.SIGKILL, "worker-2": 3}
        assert group.poll() == []  # each exit is reported once
        assert (tmp_path / "worker-0.log").read_text().splitlines() == ["hello", "oops"]  # stderr too
        lines = [(p.name, line) for p, line in group.output()]
        assert ("worker-0", "hello") in lines
        assert ("worker-1", "bye") in lines
        assert list(group.output()) == []  # only new lines
        assert group.processes[0].tail(1) == ["oops"]
    finally:
        group.stop(0)


@pytest.mark.timeout(60)
def test_partial_lines_wait_for_their_newline(tmp_path: Path) -> None:
    code = ("import sys, time; sys.stdout.write('par'); sys.stdout.flush(); time.sleep(0.5); "
            "print('tial'); sys.stdout.write('rest')")
    group = LocalEngine().start(spec(code), log_dir=tmp_path)
    try:
        wait_exits(group, 1)
        assert [line for _, line in group.output()] == ["partial"]
    finally:
        group.stop(0)
    assert [line for _, line in group.final_output()] == ["rest"]
    assert list(group.final_output()) == []


@pytest.mark.timeout(60)
def test_a_progress_bar_shows_its_newest_redraw_and_a_long_line_comes_in_pieces(tmp_path: Path) -> None:
    """A tqdm-style bar (``\\r``, no newline) and a 200 kB line with no newline: both are shown while the
    process runs, and what the supervisor keeps of an unterminated line stays within 64 KiB."""
    bar = ("import sys, time; [sys.stdout.write(f'\\rstep {i:>8} |' + '#' * 80 + '|') "
           "for i in range(20000)]; sys.stdout.flush(); time.sleep(600)")
    long_line = "import sys, time; sys.stdout.write('x' * 200000); sys.stdout.flush(); time.sleep(600)"
    group = LocalEngine().start(spec(bar, long_line), log_dir=tmp_path)
    try:
        sizes = [20000 * 97, 200000]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and [p.log_path.stat().st_size for p in group.processes] != sizes:
            time.sleep(0.05)
        assert [p.log_path.stat().st_size for p in group.processes] == sizes
        out = [(p.name, line) for p, line in group.output()]
        assert out[0] == ("worker-0", f"step {19998:>8} |{'#' * 80}|")  # the newest finished redraw only
        assert [len(line) for name, line in out[1:]] == [65536] * 3
        assert all(name == "worker-1" for name, _ in out[1:])
        assert list(group.output()) == []
    finally:
        group.stop(0)
    assert [(p.name, line) for p, line in group.final_output()] == [
        ("worker-0", f"step {19999:>8} |{'#' * 80}|"), ("worker-1", "x" * (200000 - 3 * 65536))]


@pytest.mark.timeout(60)
def test_an_exited_process_keeps_its_group_id_until_the_group_is_stopped(tmp_path: Path) -> None:
    """An exited role is not reaped before `stop` has signalled its group for the last time: its zombie
    keeps the pid, so the kernel cannot give it to a new group that the stop's killpg would then hit."""
    group = LocalEngine().start(spec("import time; time.sleep(600)", "raise SystemExit(3)"),
                                log_dir=tmp_path)
    victims: list[subprocess.Popen[bytes]] = []
    try:
        assert wait_exits(group, 1) == [("worker-1", 3)]
        early = group.processes[1]
        time.sleep(0.3)
        assert group.poll() == []
        assert early.returncode == 3
        assert Path(f"/proc/{early.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        last_pid = Path("/proc/sys/kernel/ns_last_pid")
        if os.access(last_pid, os.W_OK):  # root: ask the kernel for exactly that pid, which it must refuse
            for _ in range(20):
                last_pid.write_text(str(early.pid - 1))
                victims.append(subprocess.Popen(["sleep", "600"], start_new_session=True))
                assert victims[-1].pid != early.pid, "the pid of an exited role was given to a new process"
    finally:
        group.stop(0)
    assert early.popen.returncode == 3  # reaped by stop, with the same code
    assert not Path(f"/proc/{early.pid}").exists()
    assert all(v.poll() is None for v in victims), "stopping the group hit another process group"
    for v in victims:
        v.kill()
        v.wait()


@pytest.mark.timeout(60)
def test_environment_is_the_specs_without_inherited_job_variables(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "7")  # as if the trainer itself ran inside another job
    monkeypatch.setenv("TF_CONFIG", "{}")
    monkeypatch.setenv("KEEP_ME", "yes")
    code = "import os; print(os.environ.get('RANK'), os.environ.get('TF_CONFIG'), os.environ['KEEP_ME'], " \
           "os.environ['MINE'], os.getpgid(0) == os.getpid(), os.getsid(0) == os.getpid())"
    group = LocalEngine().start(spec(code, env={"MINE": "1"}), log_dir=tmp_path)
    try:
        assert wait_exits(group, 1) == [("worker-0", 0)]
        assert (tmp_path / "worker-0.log").read_text().split() == ["None", "None", "yes", "1", "True", "True"]
    finally:
        group.stop(0)


@pytest.mark.timeout(60)
def test_stop_kills_stubborn_processes_and_their_children(tmp_path: Path) -> None:
    stubborn = ("import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "child = subprocess.Popen(['sleep', '600']); print(child.pid, flush=True); time.sleep(600)")
    polite = "import subprocess, time; c = subprocess.Popen(['sleep', '600']); print(c.pid, flush=True); " \
             "time.sleep(600)"
    group = LocalEngine({"grace": 0.5}).start(spec(stubborn, polite), log_dir=tmp_path)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(p.tail(1) for p in group.processes):
        time.sleep(0.05)
    children = [int(p.tail(1)[0]) for p in group.processes]
    pids = [p.pid for p in group.processes]
    assert all(proctree.alive(pid) for pid in children + pids)
    started = time.monotonic()
    group.stop()
    assert time.monotonic() - started >= 0.5  # the grace period was given to the SIGTERM-ignoring one
    assert [p.returncode for p in group.processes] == [-signal.SIGKILL, -signal.SIGTERM]
    assert [p.popen.returncode for p in group.processes] == [-signal.SIGKILL, -signal.SIGTERM]  # reaped
    assert proctree.wait_gone(children + pids, 5) == set()
    assert all(group_members(pid) == [] for pid in pids)
    assert group.watcher is None  # its watcher was ended with it
    group.stop()  # a second stop does nothing (the ids may belong to other processes by now)


@pytest.mark.timeout(60)
def test_stop_reaches_children_of_a_leader_that_already_exited(tmp_path: Path) -> None:
    code = "import subprocess; c = subprocess.Popen(['sleep', '600']); print(c.pid, flush=True)"
    group = LocalEngine().start(spec(code), log_dir=tmp_path)
    assert wait_exits(group, 1) == [("worker-0", 0)]
    orphan = int(group.processes[0].tail(1)[0])
    assert proctree.alive(orphan)
    assert group_members(group.processes[0].pid) == [orphan]
    group.stop()
    assert proctree.wait_gone([orphan], 5) == set()


@pytest.mark.timeout(60)
def test_a_process_that_cannot_start_stops_the_others(tmp_path: Path) -> None:
    good = ProcessSpec("worker", 0, [sys.executable, "-c", "import time; time.sleep(600)"], {})
    bad = ProcessSpec("worker", 1, [str(tmp_path / "no-such-python")], {})
    before = proctree.descendants(os.getpid())
    with pytest.raises(FileNotFoundError):
        LocalEngine().start(ClusterSpec([good, bad], "127.0.0.1", 0, tmp_path, None, []), log_dir=tmp_path)
    assert proctree.wait_gone(proctree.descendants(os.getpid()) - before, 5) == set()


def test_engine_options_and_registry() -> None:
    assert isinstance(get_engine("local", {"grace": 2}), LocalEngine)
    with pytest.raises(ConfigError, match="grace"):
        LocalEngine({"grace": -1})
    with pytest.raises(ConfigError, match="workers_per_node"):
        LocalEngine({"workers_per_node": 2})
    with pytest.raises(ConfigError, match="not an engine"):
        get_engine("slurm")
    for name in ("kubernetes", "yarn"):
        with pytest.raises(ConfigError, match="shardkit render"):
            get_engine(name)
