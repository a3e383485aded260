"""The group watcher with real process groups: what it stops when its pipe ends, and what it never touches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardkit.cluster.monitor.watcher import GroupWatcher
from tests.trainer.scripts import proctree

pytestmark = [pytest.mark.distributed]


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


def group_leader(code: str = "") -> subprocess.Popen[bytes]:
    """A process leading its own group, as the local engine starts a role; it runs ``code``, says
    ready, and sleeps."""
    proc = subprocess.Popen([sys.executable, "-c", f"{code}\nprint('ready', flush=True)\n"
                             "import time\ntime.sleep(600)"], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.stdout.close()
    return proc


@pytest.mark.timeout(60)
def test_at_end_of_file_it_stops_the_listed_groups_and_never_one_it_was_told_is_gone() -> None:
    stubborn = group_leader("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    listed, gone = group_leader(), group_leader()
    watcher = GroupWatcher(grace=0.5)
    assert watcher.proc is not None
    for proc in (stubborn, listed, gone):
        watcher.started(proc.pid)
    watcher.gone(gone.pid)
    watcher_proc = watcher.proc
    started = time.monotonic()
    watcher.close()  # end of file, as when the trainer dies
    assert watcher_proc.returncode == 0
    assert listed.wait(10) == -15  # SIGTERM first
    assert stubborn.wait(10) == -9  # SIGKILL after the grace period
    assert time.monotonic() - started >= 0.5
    assert gone.poll() is None, "the watcher signalled a group it had been told was gone"
    gone.kill()
    gone.wait()


@pytest.mark.timeout(60)
def test_a_stopped_group_ends_by_its_sigterm_not_after_the_grace_period() -> None:
    stopped = group_leader()
    os.kill(stopped.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 20
    while (info := proctree._stat(stopped.pid)) is None or info[0] != "T":
        assert time.monotonic() < deadline, info
        time.sleep(0.02)
    watcher = GroupWatcher(grace=30)
    watcher.started(stopped.pid)
    watcher.close()
    assert stopped.wait(10) == -signal.SIGTERM  # a SIGKILL would come only after 30 s


@pytest.mark.timeout(60)
def test_it_lives_outside_the_trainers_session_and_exits_when_nothing_is_listed() -> None:
    watcher = GroupWatcher(grace=5.0)
    proc = watcher.proc
    assert proc is not None
    try:
        assert os.getsid(proc.pid) == proc.pid  # its own session: a signal to the trainer's group misses it
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        deadline = time.monotonic() + 10
        while not cmdline.read_bytes() and time.monotonic() < deadline:  # set a moment after the exec
            time.sleep(0.01)
        assert b"-S" in cmdline.read_bytes().split(b"\0")  # no site, no shardkit import: small and fast
    finally:
        watcher.close()
    assert proc.returncode == 0  # exited by itself (close kills it after 5 s): nothing was listed


def test_it_never_lists_group_0_1_or_its_own() -> None:
    """killpg(0) is the caller's own group and killpg(1) is kill(-1), every process: never sent."""
    from shardkit.cluster.monitor.watcher import _listed

    assert _listed(f"+0\n+1\n+{os.getpgid(0)}\n+123456\n+77\n-77\nnoise\n+\n".encode()) == [123456]
