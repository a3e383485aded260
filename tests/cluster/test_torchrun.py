"""The torchrun engine with real elastic agents: two "nodes" on 127.0.0.1 (one agent process each, one
worker each), a worker SIGKILLed, a whole node removed (world 2 -> 1), and sample-by-sample checks
(the helpers and the ids script: `tests.cluster.torchrun_tools`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from shardkit.cluster.engines import get_engine
from shardkit.cluster.engines.torchrun import TorchrunEngine, check_job, parse_options
from shardkit.errors import ConfigError
from shardkit.job.config import JobConfig, load_config
from tests.cluster.torchrun_tools import (
    EVERY,
    IDS,
    REPO,
    ROWS,
    effective_ids,
    finish,
    ids_config,
    max_step,
    output,
    records,
    start_nodes,
    summary,
    wait_until,
    write_config,
    write_ids_dataset,
)
from tests.trainer.scripts import proctree

if TYPE_CHECKING:  # imported where used: it imports torch's elastic agent
    from shardkit.cluster.engines.torchrun._agent import NodeMonitor


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


@pytest.fixture(scope="module")
def ids_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids_dataset(tmp_path_factory.mktemp("data"))


# -- end to end -------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_two_nodes_train_the_digits_example(tmp_path: Path, digits: str) -> None:
    example = yaml.safe_load((REPO / "examples" / "digits.yaml").read_text())
    data = {**example["data"], "url": digits, "num_epochs": 3}
    config = write_config(tmp_path, data=data, entrypoint=REPO / "examples" / "train_digits.py", nnodes="2",
                          params=example["params"], checkpoint={"every_steps": 20, "keep": 2})
    procs = start_nodes(config)
    codes = finish(procs)
    assert codes == [0, 0], output(config, 0) + output(config, 1)
    both = output(config, 0) + output(config, 1)
    stats = json.loads(re.findall(r"TRAIN_STATS (\{.*\})", both)[0])
    assert stats["world"] == 2
    assert stats["test_accuracy"] > 0.5  # 3 epochs of a small CNN: ~0.8; chance is 0.1
    job = tmp_path / "job"
    for node in (0, 1):
        result = summary(job, node)
        assert result["status"] == "succeeded"
        assert result["restarts"] == 0
        assert result["steps"] == stats["steps"]
    logs = [sorted(p.name for p in (job / f"logs/node-{node}/attempt-0").iterdir()) for node in (0, 1)]
    assert sorted(logs) == [["worker-0.log"], ["worker-1.log"]], "each node ran one of the two ranks"
    assert f"step-{stats['steps']:09d}" in os.listdir(job / "checkpoints")


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_killed_worker_restarts_the_group_from_the_checkpoint(tmp_path: Path, ids_dataset: str) -> None:
    config = ids_config(tmp_path, ids_dataset, nnodes="2")
    job = tmp_path / "job"
    procs = start_nodes(config)
    wait_until("a checkpoint and step 6", lambda: max_step(job, world=2) >= 6, procs)
    (log,) = (job / "logs/node-1/attempt-0").glob("worker-*.log")
    rank = int(log.stem.split("-")[1])
    pid = records(job)[(0, rank)][0]["pid"]
    assert pid in proctree.descendants(procs[1].pid), "the worker belongs to node 1's agent"
    os.kill(pid, signal.SIGKILL)
    assert finish(procs) == [0, 0], output(config, 0) + output(config, 1)

    ids, attempts = effective_ids(job)
    assert ids == Counter(range(ROWS)), "every sample of the epoch exactly once"
    assert [world for _, world, _ in attempts] == [2] * len(attempts)
    assert attempts[-1][2] >= EVERY, "the last attempt resumed from a checkpoint, not from the start"
    failures = summary(job, 1)["failures"]
    assert failures[0]["reason"] == "killed by SIGKILL"
    assert failures[0]["index"] == rank
    assert summary(job, 0)["status"] == "succeeded"
    assert summary(job, 0)["restarts"] >= 1
    envs = [lines[0]["env"] for lines in records(job).values()]
    assert {(env["MASTER_ADDR"], env["GLOO_SOCKET_IFNAME"]) for env in envs} == {("127.0.0.1", None)}, \
        "a loopback endpoint: 127.0.0.1 as before, no interface pinned"


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_removed_node_leaves_the_other_to_finish_the_epoch_alone(tmp_path: Path, ids_dataset: str) -> None:
    config = ids_config(tmp_path, ids_dataset, nnodes="1:2")
    job = tmp_path / "job"
    procs = start_nodes(config)
    wait_until("a 2-node attempt at step 6 after a checkpoint", lambda: max_step(job, world=2) >= 6, procs)
    tree = proctree.descendants(procs[1].pid) | {procs[1].pid}
    proctree.kill(tree)  # node 1 is gone: its agent and its worker
    assert proctree.wait_gone(tree, 10) == set()
    assert finish(procs[:1]) == [0], output(config, 0)
    procs[1].wait(5)

    ids, attempts = effective_ids(job)
    assert ids == Counter(range(ROWS)), "every sample of the epoch exactly once across the resize"
    *_, (_, world, start) = attempts
    assert world == 1, f"the last attempt ran alone: {attempts}"
    assert start >= EVERY, "the remaining node resumed from the checkpoint"
    result = summary(job, 0)
    assert result["status"] == "succeeded"
    assert result["restarts"] >= 1


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_worker_that_lingers_after_done_is_counted_as_finished(tmp_path: Path, ids_dataset: str) -> None:
    """Rank 1 waits for ever after its work (``with ctx:``): its node stops it after
    heartbeat_timeout and the job succeeds (it was killed as silent after startup_timeout, and torch's
    agent restarted the group, which resumed at the end and lingered again, until the restarts ran out)."""
    config = ids_config(tmp_path, ids_dataset, nnodes="2", linger_rank=1, sleep=0.0, heartbeat_timeout=2.0)
    procs = start_nodes(config)
    assert finish(procs) == [0, 0], output(config, 0) + output(config, 1)
    job = tmp_path / "job"
    ids, attempts = effective_ids(job)
    assert ids == Counter(range(ROWS))
    assert len(attempts) == 1
    results = [summary(job, node) for node in (0, 1)]
    for result in results:
        assert (result["status"], result["restarts"], result["failures"]) == ("succeeded", 0, [])
    (note,) = [n for r in results for n in r["notes"] if "reported done but had not exited" in n]
    assert re.match(r"node \d: attempt 0: worker-1 ", note)
    assert "counted as finished" in note


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_workers_done_first_wait_for_the_others_without_being_stopped(tmp_path: Path,
                                                                      ids_dataset: str) -> None:
    """Rank 0 (node 0) evaluates for twice heartbeat_timeout after its last step while rank 1 (node 1),
    done, waits at `finish`'s barrier: node 1 must not stop it as lingering (rank 0's barrier would
    fail, and the job restart)."""
    config = ids_config(tmp_path, ids_dataset, nnodes="2", sleep=0.0, heartbeat_timeout=2.0,
                        evaluate_rank=0, evaluate_s=4.0)
    procs = start_nodes(config)
    assert finish(procs) == [0, 0], output(config, 0) + output(config, 1)
    results = [summary(tmp_path / "job", node) for node in (0, 1)]
    for result in results:
        assert (result["status"], result["restarts"], result["failures"]) == ("succeeded", 0, [])
        assert not [n for n in result["notes"] if "had not exited" in n], result["notes"]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_stopped_or_killed_agent_leaves_no_worker_behind(tmp_path: Path, ids_dataset: str) -> None:
    """SIGTERM, Ctrl-C (SIGINT) or SIGKILL on a node at work. The workers get SIGTERM either way: a Ctrl-C
    passed on as SIGINT left each worker printing a KeyboardInterrupt traceback and slow to exit."""
    for how in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        folder = tmp_path / how.name
        folder.mkdir()
        config = ids_config(folder, ids_dataset, nnodes="1")
        (agent,) = start_nodes(config, count=1)
        def at_step_2(folder: Path = folder) -> bool:
            steps = [r.get("step", 0) for lines in records(folder / "job").values() for r in lines]
            return max(steps, default=0) >= 2

        wait_until("step 2", at_step_2, [agent])
        workers = proctree.descendants(agent.pid)
        assert workers
        agent.send_signal(how)
        assert agent.wait(30) == (-signal.SIGKILL if how == signal.SIGKILL else 128 + how)
        assert proctree.wait_gone(workers, 10) == set(), f"{how.name}: the workers outlived their agent"
        if how != signal.SIGKILL:  # stopped cleanly: the summary says so
            assert summary(folder / "job", 0)["status"] == "interrupted"
            assert "Traceback" not in output(folder / "job.yaml", 0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_during_the_rendezvous_is_an_interrupt(tmp_path: Path, ids_dataset: str,
                                                        sig: signal.Signals) -> None:
    """Before torch's agent has started workers (and installed its own handlers), a signal still stops
    the node cleanly: exit 128 + signal, summary "interrupted"."""
    config = ids_config(tmp_path, ids_dataset, nnodes="2")  # node 0 alone: it waits for node 1
    (agent,) = start_nodes(config, count=1)
    try:
        wait_until("node 0 in the rendezvous", lambda: "joining rendezvous" in output(config, 0), [agent])
        time.sleep(1.0)
        agent.send_signal(sig)
        assert agent.wait(30) == 128 + sig, output(config, 0)
    finally:
        proctree.kill([agent.pid])
    result = summary(tmp_path / "job", 0)
    assert result["status"] == "interrupted"
    assert result["attempts"] == []


# -- pieces ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def node_monitor(tmp_path: Path, *, workers: int = 1, echo: bool = True,
                 **fault_tolerance: float) -> Iterator[tuple[NodeMonitor, str, list[str]]]:
    """A started `NodeMonitor` of a job of ``workers`` workers (its node folder ``tmp_path/node``), the
    address its heartbeats go to, and the lines it says; the caller stops it."""
    from shardkit.cluster.engines.torchrun._agent import NodeMonitor
    from shardkit.cluster.monitor.heartbeats import HeartbeatReceiver

    config = JobConfig.from_dict({"name": "node", "entrypoint": str(IDS), "framework": "torch",
                                  "roles": {"worker": {"count": workers}}, "logdir": str(tmp_path / "job"),
                                  "fault_tolerance": fault_tolerance})
    lines: list[str] = []
    with HeartbeatReceiver() as receiver:
        monitor = NodeMonitor(config, parse_options({}), node_dir=tmp_path / "node", receiver=receiver,
                              say=lines.append, echo=echo, latest=lambda: None)
        monitor.start()
        yield monitor, receiver.addr, lines


def beating_worker(addr: str, node_dir: Path, rank: int, then: str) -> subprocess.Popen[bytes]:
    """Worker ``rank`` of attempt 0 (its own session, output in its log): one heartbeat at step 3 as
    ``b``, then the Python ``then``."""
    code = ("import os, signal, time; from shardkit.trainer._heartbeat import Beacon; "
            f"b = Beacon({addr!r}, role='worker', index={rank}, attempt=0); b.send('step', step=3); {then}")
    log = node_dir / "attempt-0" / f"worker-{rank}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out, start_new_session=True)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_the_node_monitor_survives_a_metric_beyond_float32(tmp_path: Path) -> None:
    """exp(100) as a metric: +inf in TensorBoard; the monitor thread (hang detection, logs, progress)
    goes on."""
    import math

    from shardkit.trainer._heartbeat import Beacon

    with node_monitor(tmp_path) as (monitor, addr, lines):
        beacon = Beacon(addr, role="worker", index=0, attempt=0)
        try:
            monitor.attempt_started(0, nodes=1, world=1, ranks=[0])
            beacon.send("step", step=1, metrics={"ppl": math.exp(100)})
            deadline = time.monotonic() + 10
            while monitor.attempts[-1].steps < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            beacon.send("step", step=2, metrics={"ppl": 2.5})
            while monitor.attempts[-1].steps < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert monitor.attempts[-1].steps == 2, lines
            assert monitor._thread.is_alive()
        finally:
            beacon.close()
            monitor.workers_succeeded()
            monitor.stop()
    assert not [line for line in lines if "warning" in line]
    assert monitor.result("succeeded").metrics == {"ppl": 2.5}
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(tmp_path / "job" / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("ppl")] == [(1, math.inf), (2, 2.5)]


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_silent_worker_is_killed_so_the_agent_restarts_the_group(tmp_path: Path) -> None:
    with node_monitor(tmp_path, heartbeat_interval=0.1, heartbeat_timeout=1.0) as (monitor, addr, lines):
        monitor.attempt_started(0, nodes=1, world=1, ranks=[0])
        hang = "print('hanging now', flush=True); time.sleep(600)"
        worker = beating_worker(addr, tmp_path / "node", 0, hang)
        monitor.workers_started({0: worker.pid})
        assert worker.wait(30) == -signal.SIGKILL
        monitor.workers_failed({0: -signal.SIGKILL})  # what torch's agent reports next
        monitor.stop()
    result = monitor.result("failed")
    assert len(result.failures) == 1
    assert result.failures[0].reason.startswith("silent for")
    assert result.failures[0].step == 3
    assert "[worker-0] hanging now" in lines


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_the_node_monitor_kills_the_stopped_worker_not_the_one_waiting_for_it(tmp_path: Path) -> None:
    """Worker 1 stops (SIGSTOP) a little after worker 0's last beat, as in DDP where worker 0 then waits
    for it in the next collective: worker 0 passes its limit first, but worker 1 is the one killed and
    named (the first silent one was, before)."""
    with node_monitor(tmp_path, workers=2, echo=False, heartbeat_interval=0.25,
                      heartbeat_timeout=1.0) as (monitor, addr, _):
        monitor.attempt_started(0, nodes=1, world=2, ranks=[0, 1])
        workers = [beating_worker(addr, tmp_path / "node", rank, then) for rank, then in (
            (0, "time.sleep(600)"),
            (1, "time.sleep(0.2); b.send('step', step=3); os.kill(os.getpid(), signal.SIGSTOP)"))]
        monitor.workers_started({rank: w.pid for rank, w in enumerate(workers)})
        try:
            assert workers[1].wait(30) == -signal.SIGKILL
            assert workers[0].poll() is None  # the one waiting is left to torch's agent
        finally:
            workers[0].kill()
            workers[0].wait()
        monitor.workers_failed({1: -signal.SIGKILL})  # what torch's agent reports (it then stops worker 0)
        monitor.stop()
    (failure,) = monitor.result("failed").failures
    assert failure.name == "worker-1", failure.reason
    assert "stopped (SIGSTOP or a debugger): state T; worker-0 (" in failure.reason
    assert failure.reason.endswith("silent too, waiting for it: killed so the group restarts")


def test_a_workers_progress_bar_and_long_line_are_echoed_with_bounded_work(tmp_path: Path) -> None:
    """What the node monitor echoes of a worker's log: a ``\\r`` bar as its newest finished redraw, and
    an unterminated line in 64 KiB pieces (not kept, and copied, whole on every poll)."""
    from shardkit.cluster.engines.torchrun._monitor import _Worker

    log = tmp_path / "worker-0.log"
    worker = _Worker(0, log, time.monotonic())
    log.write_bytes(b"epoch 1\n" + b"".join(b"\rstep %8d |%s|" % (i, b"#" * 80) for i in range(20000)))
    assert worker.new_lines() == ["epoch 1", f"step {19998:>8} |{'#' * 80}|"]
    with open(log, "ab") as f:
        f.write(b"\n" + b"x" * 200_000)
    assert worker.new_lines() == [f"step {19999:>8} |{'#' * 80}|", "x" * 65536, "x" * 65536, "x" * 65536]
    assert worker.new_lines(final=True) == ["x" * (200_000 - 3 * 65536)]


def test_options_are_validated_with_key_paths_and_hints(tmp_path: Path) -> None:
    opts = parse_options({"nnodes": "1:2", "rdzv_endpoint": "10.0.0.1:29400", "node_rank": 1,
                          "rdzv_conf": {"last_call_timeout": 5}})
    assert (opts.min_nodes, opts.max_nodes, opts.node_rank) == (1, 2, 1)
    assert opts.rdzv_conf == {"last_call_timeout": 5}
    assert not opts.endpoint_is_loopback
    assert parse_options({}).endpoint_is_loopback
    cases: dict[str, dict[str, Any]] = {
        "engine.nnode": {"nnode": 2},
        "did you mean 'nnodes'": {"nnode": 2},
        "quote it": {"nnodes": 62},  # what YAML makes of an unquoted 1:2
        "engine.nnodes = '2:1'": {"nnodes": "2:1"},
        "did you mean 'last_call_timeout'": {"rdzv_conf": {"last_call": 3}},
        "node 0 hosts the rendezvous store": {"rdzv_conf": {"is_host": True}},
        "at most 2 node(s)": {"nnodes": "1:2", "node_rank": 2},
        "not HOST:PORT": {"rdzv_endpoint": "localhost"},
        "engine.grace": {"grace": -1},
        "more than 10,000 processes on one node": {"nproc_per_node": 10**11},  # not minutes of spec
    }
    for expected, options in cases.items():
        with pytest.raises(ConfigError) as info:
            parse_options(options)
        assert expected in str(info.value), (options, str(info.value))
    assert isinstance(get_engine("torchrun", {"nnodes": 2}), TorchrunEngine)
    with pytest.raises(ConfigError, match="torch's elastic agent starts and restarts"):
        TorchrunEngine().start(None, log_dir=tmp_path)  # type: ignore[arg-type]


def test_an_unquoted_node_range_in_yaml_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: j\nentrypoint: {IDS}\nframework: torch\nroles: {{worker: {{count: 1}}}}\n"
                    "engine: {name: torchrun, nnodes: 1:2}\n")
    config = load_config(path)
    with pytest.raises(ConfigError, match=r"engine\.nnodes = 62.*quote it") as info:
        parse_options(config.engine.options, source=config.source)
    assert str(path) in str(info.value)
    assert parse_options(load_config(path, ['engine.nnodes="1:2"']).engine.options).max_nodes == 2


def test_only_torch_allreduce_jobs_run_on_torchrun(tmp_path: Path) -> None:
    base = {"name": "j", "entrypoint": str(IDS), "roles": {"worker": {"count": 2}}}
    check_job(JobConfig.from_dict({**base, "framework": "torch"}))
    for extra in ({"framework": "tensorflow"},
                  {"framework": "torch", "strategy": "parameter_server",
                   "roles": {"worker": {"count": 2}, "ps": {"count": 1}}}):
        with pytest.raises(ConfigError, match="engine: local"):
            check_job(JobConfig.from_dict({**base, **extra}))


@given(st.integers(1, 59), st.integers(0, 59))
def test_node_ranges_parse_for_all_quoted_ranges(low: int, extra: int) -> None:
    high = low + extra
    for text, expected in ((f"{low}:{high}", (low, high)), (str(low), (low, low)), (low, (low, low))):
        opts = parse_options({"nnodes": text})
        assert (opts.min_nodes, opts.max_nodes) == expected
    if extra:
        with pytest.raises(ConfigError):
            parse_options({"nnodes": f"{high}:{low}"})


@pytest.mark.timeout(60)
def test_a_node_whose_store_stops_answering_notices_within_the_bound() -> None:
    """The watch counts only once armed (the job started), then fires once, within lost_job_timeout and
    a probe, naming the store's address and what to do."""
    import socket
    import threading

    from shardkit.cluster.engines.torchrun._agent import LostJobWatch

    server = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{server.getsockname()[1]}"
    fired: list[tuple[float, str]] = []
    event = threading.Event()

    def on_lost(message: str) -> None:
        fired.append((time.monotonic(), message))
        event.set()

    watch = LostJobWatch(endpoint, timeout=3.0, on_lost=on_lost)
    watch.start()
    try:
        assert watch.probe() is None
        time.sleep(1.5)
        server.close()  # node 0's agent is gone: refused (a partition is silence: tests/multihost)
        time.sleep(4.0)
        assert not fired, "not armed: before the first attempt the rendezvous's join_timeout governs"
        armed = time.monotonic()
        watch.arm()
        assert event.wait(3.0 + 2 * watch.probe_timeout + 2 * watch.interval + 5.0)
    finally:
        watch.stop()
        server.close()
    (at, message), = fired
    assert at - armed >= 3.0
    assert message.startswith(f"lost the job: the rendezvous store at {endpoint} (node 0) did not answer")
    assert "Connection refused" in message
    assert "fault_tolerance.lost_job_timeout 3 s" in message
    assert "Fix:" in message
    assert watch.lost == message


def test_the_node_address_is_checked_before_anything_starts() -> None:
    from shardkit.cluster._addresses import local_addresses
    from shardkit.cluster.engines.torchrun import node_address

    assert node_address(parse_options({})) == "127.0.0.1"
    assert node_address(parse_options({"local_addr": "localhost"})) == "localhost"  # as given, as before
    mine = sorted(local_addresses())
    elsewhere = next(f"203.0.113.{i}" for i in range(1, 255) if f"203.0.113.{i}" not in mine)
    with pytest.raises(ConfigError) as info:
        node_address(parse_options({"local_addr": elsewhere}))
    message = str(info.value)
    assert f"engine.local_addr = '{elsewhere}' is not an address of this host" in message
    assert "127.0.0.1 (lo)" in message
    assert "--set engine.local_addr=127.0.0.1" in message


def test_lost_job_and_collective_timeouts_are_validated_and_reach_the_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import timedelta

    from shardkit.cluster._spec import build_spec
    from shardkit.job import protocol as p
    from shardkit.trainer._setup import collective_timeout

    base = {"name": "j", "entrypoint": str(IDS), "framework": "torch", "roles": {"worker": {"count": 2}}}
    ft = JobConfig.from_dict(base).fault_tolerance
    assert (ft.lost_job_timeout, ft.collective_timeout) == (45.0, 300.0)
    for key, value in (("lost_job_timeout", 1), ("collective_timeout", 0), ("lost_job_timeout", "10")):
        with pytest.raises(ConfigError, match=rf"fault_tolerance\.{key}"):
            JobConfig.from_dict({**base, "fault_tolerance": {key: value}})
    config = JobConfig.from_dict({**base, "fault_tolerance": {"collective_timeout": 45}})
    assert {proc.env[p.ENV_COLLECTIVE_TIMEOUT] for proc in build_spec(config).processes} == {"45"}

    monkeypatch.delenv(p.ENV_COLLECTIVE_TIMEOUT, raising=False)
    assert collective_timeout() is None  # a script started by hand: torch's default
    monkeypatch.setenv(p.ENV_COLLECTIVE_TIMEOUT, "45")
    assert collective_timeout() == timedelta(seconds=45)
    monkeypatch.setenv(p.ENV_COLLECTIVE_TIMEOUT, "soon")
    with pytest.raises(ConfigError, match=r"fault_tolerance\.collective_timeout"):
        collective_timeout()


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_node_that_lost_node_0_leaves_with_a_summary_saying_so(tmp_path: Path, ids_dataset: str) -> None:
    """Node 0 (it hosts the rendezvous store) is gone, its machine up: node 1 stops its worker and
    exits 1 within lost_job_timeout (here the store refuses at once; silence is tests/multihost's)."""
    config = ids_config(tmp_path, ids_dataset, nnodes="1:2", fault_tolerance={"lost_job_timeout": 5})
    job = tmp_path / "job"
    procs = start_nodes(config)
    wait_until("a 2-node attempt at step 6 after a checkpoint", lambda: max_step(job, world=2) >= 6, procs)
    tree = proctree.descendants(procs[0].pid) | {procs[0].pid}
    proctree.kill(tree)
    assert proctree.wait_gone(tree, 10) == set()
    assert procs[1].wait(5 + 30) == 1, output(config, 1)
    procs[0].wait(5)
    result = summary(job, 1)
    assert result["status"] == "failed"
    (note,) = [n for n in result["notes"] if "lost the job" in n]
    endpoint = yaml.safe_load(config.read_text())["engine"]["rdzv_endpoint"]
    assert f"node 1: lost the job: the rendezvous store at {endpoint} (node 0)" in note
    assert "Fix:" in note
    assert "shardkit train: job trun, node 1: lost the job" in output(config, 1)


# -- a rendezvous that cannot form ---------------------------------------------------------------------

STARTUP_S = 8.0  # the jobs' fault_tolerance.startup_timeout below
CPP_TRACE = ("c10d", "frame #", "Exception raised from", "Traceback", "socket.cpp", "TCPStore")


def start_node(config: Path, node: int) -> subprocess.Popen[bytes]:
    """Node ``node`` of the job alone, as `start_nodes` starts it (`shardkit train`, its own session, its
    output in ``node-<K>.out``), SIGINT left to its default (a test run in the background ignores it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with open(config.parent / f"node-{node}.out", "wb") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "shardkit.cli", "train", str(config), "--node-rank", str(node)],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, handler)


@contextlib.contextmanager
def silent_store(config: Path, silent: bool) -> Iterator[None]:
    """With ``silent``, a listener at the job's rendezvous endpoint that never answers (node 0's store
    hung, or a path that drops packets after the handshake): the kernel completes connections, torch's
    C++ client then waits for a reply for rdzv_conf.read_timeout (60 s)."""
    if not silent:
        yield
        return
    host, port = yaml.safe_load(config.read_text())["engine"]["rdzv_endpoint"].rsplit(":", 1)
    import socket

    with socket.create_server((host, int(port)), backlog=8):
        yield


def no_cpp_trace(text: str) -> None:
    found = [line for line in text.splitlines() if any(word in line for word in CPP_TRACE)]
    assert not found, text


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("node", "store", "join_timeout", "waited_for"), [
    (1, "none", None, "node 0, which hosts it, never came: its store did not answer (Connection refused)"),
    (0, "own", None, "for 2 nodes, 1 joined (this node); 1 never came"),
    (1, "silent", None, "node 0's store at {endpoint} accepted a connection but did not answer"),
    (0, "own", 5, "waited 5 s (engine.rdzv_conf.join_timeout) for 2 nodes, 1 joined (this node)"),
], ids=["node-1-no-store", "node-0-alone", "node-1-store-silent", "node-0-join-timeout-first"])
def test_a_node_whose_peers_never_come_ends_within_startup_timeout(
        tmp_path: Path, ids_dataset: str, node: int, store: str, join_timeout: int | None,
        waited_for: str) -> None:
    """The engines guide's two nodes after the demo: node 0 refused, node 1 waited in the rendezvous for
    ever, a c10d C++ stack trace every 60 s. Alone, each node ends startup_timeout after it began to
    join (the silent store: with main's thread stuck in torch's C++ client, the backstop ends it), or
    rdzv_conf.join_timeout after where that is shorter: exit 1, one line naming what it waited for, no
    C++ log line."""
    config = ids_config(tmp_path, ids_dataset, nnodes="2", fault_tolerance={"startup_timeout": STARTUP_S})
    if join_timeout is not None:
        job = yaml.safe_load(config.read_text())
        job["engine"]["rdzv_conf"]["join_timeout"] = join_timeout
        config.write_text(yaml.safe_dump(job))
    limit = f"{join_timeout} s (engine.rdzv_conf.join_timeout)" if join_timeout else \
        "8 s (fault_tolerance.startup_timeout)"
    endpoint = yaml.safe_load(config.read_text())["engine"]["rdzv_endpoint"]
    with silent_store(config, store == "silent"):
        agent = start_node(config, node)
        try:
            wait_until("the node joining", lambda: "joining rendezvous" in output(config, node), [agent])
            joined = time.monotonic()
            code = agent.wait(STARTUP_S + 60)  # the bound, with a generous slack for a loaded machine
            waited = time.monotonic() - joined
        finally:
            proctree.kill([agent.pid])
    text = output(config, node)
    assert code == 1, text
    (line,) = [line for line in text.splitlines() if "never formed" in line]
    assert line.startswith(f"shardkit train: job trun, node {node}: the rendezvous '{tmp_path.name}' at "
                           f"{endpoint} never formed: waited {limit}"), line
    assert waited_for.format(endpoint=endpoint) in line, line
    assert "Fix: " in line
    assert "start every node of the job (shardkit train JOB.yaml --node-rank K, K from 0 to 1)" in line
    assert waited >= (join_timeout or STARTUP_S) - 1.0, f"ended {waited:.1f} s after joining, too early"
    no_cpp_trace(text)
    assert "[shardkit node" in text.splitlines()[0]
    assert len(text.splitlines()) == 2, "the joining line and the one line, no summary of nothing"
    result = summary(tmp_path / "job", node)
    assert (result["status"], result["attempts"]) == ("failed", [])
    assert any("never formed" in note for note in result["notes"])


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("store", ["none", "silent"], ids=["no-store", "store-silent"])
def test_ctrl_c_ends_a_node_waiting_for_its_rendezvous_promptly(tmp_path: Path, ids_dataset: str,
                                                                store: str) -> None:
    """Ctrl-C on node 1 waiting for node 0 took 70 s and printed a 29-line C++ trace: torch's C++ client
    held the main thread. It ends within 5 s (the issue's bound; asserted with slack), exit 130, its
    summary "interrupted", no C++ log line; also with the main thread stuck in that client."""
    config = ids_config(tmp_path, ids_dataset, nnodes="2")  # startup_timeout 90: it would wait
    with silent_store(config, store == "silent"):
        agent = start_node(config, 1)
        try:
            wait_until("node 1 joining", lambda: "joining rendezvous" in output(config, 1), [agent])
            time.sleep(2.0)  # in its wait (the silent store: in torch's C++ client)
            agent.send_signal(signal.SIGINT)
            code = agent.wait(5 + 15)
        finally:
            proctree.kill([agent.pid])
    text = output(config, 1)
    assert code == 128 + signal.SIGINT, text
    no_cpp_trace(text)
    assert "job trun interrupted" in text
    assert summary(tmp_path / "job", 1)["status"] == "interrupted"
