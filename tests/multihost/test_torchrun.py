"""The torchrun engine across real hosts: each node's agent in its own network namespace (`Network`), with
its own address and interface name, the host name resolving to 127.0.0.1 and no ``GLOO_SOCKET_IFNAME``
given. A clean job; node 1's machine lost (every process SIGKILLed); node 1 cut off (a partition:
silence, no reset); and addresses that cannot work. Sample-by-sample checks as in
tests/cluster/test_torchrun.py (`tests.cluster.torchrun_tools`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.cluster.torchrun_tools import (
    EVERY,
    REPO,
    ROWS,
    effective_ids,
    finish,
    ids_config,
    max_step,
    output,
    records,
    summary,
    wait_until,
    write_ids_dataset,
)
from tests.multihost.netns import Host, Network

PORT = 29500  # node 0's rendezvous store: a fresh namespace has every port free
# Small bounds, so that the file runs in well under 3 minutes: a node cut off leaves after 10 s of
# silence; a worker blocked in an allreduce with a vanished peer fails after 15 s (and is killed as
# silent after 8 s).
FAULT_TOLERANCE = {"lost_job_timeout": 10, "collective_timeout": 15}
HEARTBEAT_TIMEOUT = 8.0
# What "exits within the bound" allows beyond lost_job_timeout: stopping the workers (grace 2 s, twice),
# waiting for torch's agent, writing the summary, on a loaded 2-core machine.
SLACK_S = 30.0
TRAIN = [sys.executable, "-m", "shardkit.cli", "train"]


@pytest.fixture(scope="module")
def ids_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(autouse=True)
def _no_ifname(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes start with the test's environment (`Host.popen`): none of the collectives' variables."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)


def job(tmp_path: Path, data: str, net: Network, nnodes: str) -> Path:
    return ids_config(tmp_path, data, nnodes, endpoint=f"{net.hosts[0].addr}:{PORT}",
                      fault_tolerance=FAULT_TOLERANCE, heartbeat_timeout=HEARTBEAT_TIMEOUT)


def start_node(host: Host, config: Path, node: int, *extra: str) -> subprocess.Popen[bytes]:
    """``shardkit train config --node-rank node`` on ``host``, its output in ``node-<node>.out``."""
    with open(config.parent / f"node-{node}.out", "wb") as out:
        return host.popen([*TRAIN, str(config), "--node-rank", str(node), *extra], cwd=REPO, stdout=out,
                          stderr=subprocess.STDOUT)


def both(config: Path) -> str:
    return "\n".join(f"---- node {n} ----\n{output(config, n)}" for n in (0, 1))


@pytest.mark.timeout(150)
def test_two_hosts_train_every_id_once_each_bound_to_its_own_address(net2: Network, tmp_path: Path,
                                                                      ids_dataset: str) -> None:
    config = job(tmp_path, ids_dataset, net2, "2")
    procs = [start_node(host, config, node) for node, host in enumerate(net2.hosts)]
    assert finish(procs, 120) == [0, 0], both(config)

    folder = tmp_path / "job"
    ids, attempts = effective_ids(folder)
    assert ids == Counter(range(ROWS)), "every sample of the epoch exactly once"
    assert [world for _, world, _ in attempts] == [2]
    starts = [lines[0]["env"] for lines in records(folder).values()]
    addrs = {host.addr for host in net2.hosts}
    assert {env["MASTER_ADDR"] for env in starts} <= addrs, "rank 0's address, not the host name's 127.0.0.1"
    assert sorted(env["GLOO_SOCKET_IFNAME"] for env in starts) == sorted(h.ifname for h in net2.hosts), \
        "each worker's gloo bound to its own host's interface"
    assert {env["SHARDKIT_COLLECTIVE_TIMEOUT"] for env in starts} == {"15"}
    for node, host in enumerate(net2.hosts):
        result = summary(folder, node)
        assert (result["status"], result["restarts"], result["failures"]) == ("succeeded", 0, [])
        assert f"bind their collectives to {host.addr}: GLOO_SOCKET_IFNAME={host.ifname}" in \
            " ".join(result["notes"])
    assert f"as {net2.hosts[1].addr}" in output(config, 1), "the address it joined the rendezvous as"


@pytest.mark.timeout(150)
def test_a_lost_machine_leaves_the_other_to_finish_every_id_once(net2: Network, tmp_path: Path,
                                                                  ids_dataset: str) -> None:
    config = job(tmp_path, ids_dataset, net2, "1:2")
    folder = tmp_path / "job"
    procs = [start_node(host, config, node) for node, host in enumerate(net2.hosts)]
    wait_until("a 2-node attempt at step 6 after a checkpoint", lambda: max_step(folder, world=2) >= 6, procs)
    net2.hosts[1].kill_all()  # the machine is gone: its agent and its worker, SIGKILLed together
    assert finish(procs[:1], 120) == [0], both(config)
    assert procs[1].wait(10) == -9

    ids, attempts = effective_ids(folder)
    assert ids == Counter(range(ROWS)), "every sample of the epoch exactly once across the resize"
    *_, (_, world, start) = attempts
    assert world == 1, f"the last attempt ran alone: {attempts}"
    assert start >= EVERY, "the remaining node resumed from the checkpoint"
    result = summary(folder, 0)
    assert result["status"] == "succeeded"
    assert result["restarts"] >= 1


@pytest.mark.timeout(170)
def test_a_partitioned_node_leaves_within_the_bound_and_the_other_finishes(net2: Network, tmp_path: Path,
                                                                           ids_dataset: str) -> None:
    config = job(tmp_path, ids_dataset, net2, "1:2")
    folder = tmp_path / "job"
    h0, h1 = net2.hosts
    procs = [start_node(host, config, node) for node, host in enumerate(net2.hosts)]
    wait_until("a 2-node attempt at step 6 after a checkpoint", lambda: max_step(folder, world=2) >= 6, procs)
    h1.cut()
    cut_at = time.monotonic()
    bound = FAULT_TOLERANCE["lost_job_timeout"] + SLACK_S
    try:
        code = procs[1].wait(bound)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"node 1 still runs {bound} s after the partition\n{both(config)}") from None
    left_after = time.monotonic() - cut_at
    assert code == 1, both(config)
    assert finish(procs[:1], 120) == [0], both(config)

    ids, attempts = effective_ids(folder)
    assert ids == Counter(range(ROWS)), "every sample of the epoch exactly once, node 0 alone at the end"
    assert attempts[-1][1] == 1, attempts
    assert summary(folder, 0)["status"] == "succeeded"

    result = summary(folder, 1)
    assert result["status"] == "failed"
    lost = [n for n in result["notes"] if "lost the job" in n]
    assert lost, result["notes"]
    assert f"the rendezvous store at {h0.addr}:{PORT} (node 0) did not answer" in lost[0]
    assert "partition" in lost[0]
    assert "Fix:" in lost[0]
    text = output(config, 1)
    assert "lost the job" in text, text  # on the console too, and as the error `shardkit train` ends with
    assert "shardkit train: job trun, node 1: lost the job" in text
    deadline = time.monotonic() + 10
    while h1.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert h1.pids() == [], "no worker of node 1 is left holding its devices"
    print(f"node 1 left {left_after:.1f} s after the partition (lost_job_timeout "
          f"{FAULT_TOLERANCE['lost_job_timeout']} s)")


@pytest.mark.timeout(150)
def test_addresses_that_cannot_work_fail_before_any_worker_starts(net2: Network, tmp_path: Path,
                                                                  ids_dataset: str) -> None:
    h0, h1 = net2.hosts
    cases = {
        "no route": ("10.78.0.1", [], ["engine.rdzv_endpoint = '10.78.0.1:29500': no interface of this host "
                                        "routes to 10.78.0.1", f"{h1.addr} ({h1.ifname})"]),
        "not here": (h0.addr, ["--set", f"engine.local_addr={h0.addr}"],
                     [f"engine.local_addr = '{h0.addr}' is not an address of this host",
                      f"{h1.addr} ({h1.ifname})", f"engine.local_addr={h1.addr}"]),
        "loopback": (h0.addr, ["--set", "engine.local_addr=127.0.0.1"],
                     ["engine.local_addr = '127.0.0.1' (127.0.0.1, a loopback address) cannot reach",
                      f"this host reaches it from {h1.addr} through interface {h1.ifname}",
                      f"engine.local_addr={h1.addr}"]),
    }
    for name, (endpoint, extra, expected) in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        config = ids_config(folder, ids_dataset, "2", endpoint=f"{endpoint}:{PORT}")
        done = h1.run([*TRAIN, str(config), "--node-rank", "1", *extra], timeout=60, cwd=REPO)
        message = " ".join(done.stderr.split())
        assert done.returncode == 2, (name, done.stdout, done.stderr)  # a config error: nothing started
        for part in expected:
            assert part in message, (name, part, message)
        assert not list((folder / "job").glob("logs/node-1/attempt-*")), f"{name}: a worker started"


@pytest.mark.timeout(150)
def test_a_host_cut_while_the_job_starts_ends_each_node_within_startup_timeout(net2: Network, tmp_path: Path,
                                                                               ids_dataset: str) -> None:
    """A rendezvous that cannot form: a 3-node job on two hosts, node 1's host cut once it joined node
    0's store (silence: node 1 stuck in torch's C++ store client, node 0 waiting for the others). Each
    ends within startup_timeout: exit 1, one line saying that the rendezvous never formed, no C++ log
    line; no process left on either host."""
    startup = 12.0
    h0, h1 = net2.hosts
    config = ids_config(tmp_path, ids_dataset, "3", endpoint=f"{h0.addr}:{PORT}",
                        fault_tolerance={**FAULT_TOLERANCE, "startup_timeout": startup})
    procs = [start_node(host, config, node) for node, host in enumerate(net2.hosts)]

    def connected() -> bool:  # node 1 holds a connection to node 0's store: it joined
        ss = h1.run(["ss", "-Htn", "state", "established", "dst", f"{h0.addr}:{PORT}"], timeout=30)
        return bool(ss.stdout.strip())

    wait_until("node 1 connected to node 0's store", connected, procs)
    h1.cut()
    for node, proc in enumerate(procs):
        try:
            code = proc.wait(startup + SLACK_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {node} still waits {startup + SLACK_S} s after the cut\n"
                                 f"{both(config)}") from None
        text = output(config, node)
        assert code == 1, both(config)
        (line,) = [line for line in text.splitlines() if "never formed" in line]
        assert line.startswith(f"shardkit train: job trun, node {node}: the rendezvous '{tmp_path.name}' at "
                               f"{h0.addr}:{PORT} never formed: waited 12 s"), line
        assert "Fix:" in line
        assert not [x for x in text.splitlines() if "c10d" in x or "frame #" in x or "Traceback" in x], text
        assert summary(tmp_path / "job", node)["status"] == "failed"
    assert h0.pids() == [], "no process left on node 0's host"
    assert h1.pids() == [], "no process left on node 1's host"
