"""What the cluster engines (ray, spark) share: `place` (addresses once the nodes are known), the node runner
with real processes, and the trainer-side mirror that hands heartbeats on before exits."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.cluster._spec import ProcessSpec, build_spec
from shardkit.cluster.engines._remote import NodeRunner, Update, place
from shardkit.cluster.engines.mirror import MirrorGroup, MirrorProcess, Options
from shardkit.cluster.monitor.heartbeats import HeartbeatReceiver
from shardkit.errors import ConfigError
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig
from tests.trainer.scripts import proctree

HOSTS = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def job(framework: str, strategy: str, roles: dict[str, int]) -> JobConfig:
    counts = {role: {"count": n} for role, n in roles.items()}
    return JobConfig.from_dict({"name": "t", "entrypoint": __file__, "framework": framework,
                                "strategy": strategy, "roles": counts})


@st.composite
def jobs_and_places(draw: st.DrawFn) -> tuple[JobConfig, list[tuple[str, int]]]:
    kind = draw(st.sampled_from(["torch-allreduce", "torch-ps", "tf-allreduce", "tf-ps"]))
    workers = draw(st.integers(1, 5))
    roles = {"worker": workers}
    if kind.endswith("ps"):
        roles["ps"] = draw(st.integers(1, 2))
    if kind == "tf-allreduce" and draw(st.booleans()):
        roles["chief"] = 1
    framework, strategy = kind.split("-")
    config = job("torch" if framework == "torch" else "tensorflow",
                 "allreduce" if strategy == "allreduce" else "parameter_server", roles)
    n = sum(roles.values()) + (1 if kind == "tf-ps" else 0)  # tf-ps adds its chief
    where = [(draw(st.sampled_from(HOSTS)), draw(st.integers(1024, 65535))) for _ in range(n)]
    return config, where


@settings(max_examples=60, deadline=None)
@given(jobs_and_places(), st.booleans())
def test_place_points_every_process_at_where_the_others_run(case: tuple[JobConfig, list[tuple[str, int]]],
                                                           own_devices: bool) -> None:
    config, where = case
    procs = build_spec(config).processes
    envs = place(procs, where, [own_devices] * len(procs))
    ranked = {int(env[p.RANK]): i for i, env in enumerate(envs) if p.RANK in env}
    if ranked:
        master = where[ranked[0]]
        for i in ranked.values():
            assert (envs[i][p.MASTER_ADDR], envs[i][p.MASTER_PORT]) == (master[0], str(master[1]))
        for host in HOSTS:
            here = [envs[i] for i in ranked.values() if where[i][0] == host]
            local = sorted(int(env[p.LOCAL_RANK]) for env in here)
            if own_devices:
                assert all((env[p.LOCAL_RANK], env[p.LOCAL_WORLD_SIZE]) == ("0", "1") for env in here)
            else:
                assert local == list(range(len(here)))
                assert all(env[p.LOCAL_WORLD_SIZE] == str(len(here)) for env in here)
    addr = {(proc.role, proc.index): f"{h}:{port}" for proc, (h, port) in zip(procs, where, strict=True)}
    for proc, env in zip(procs, envs, strict=True):
        if p.TF_CONFIG in env:
            tf_config = json.loads(env[p.TF_CONFIG])
            assert tf_config["task"] == json.loads(proc.env[p.TF_CONFIG])["task"]
            for role, members in tf_config["cluster"].items():
                assert members == [addr[(role, i)] for i in range(len(members))]
        unchanged = {p.MASTER_ADDR, p.MASTER_PORT, p.LOCAL_RANK, p.LOCAL_WORLD_SIZE, p.TF_CONFIG}
        assert {k: v for k, v in env.items() if k not in unchanged} == {
            k: v for k, v in proc.env.items() if k not in unchanged}


@pytest.fixture
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


def runner_for(code: str, **env: str) -> NodeRunner:
    spec = ProcessSpec("worker", 0, [sys.executable, "-u", "-c", code],
                       {p.ENV_HEARTBEAT_ADDR: "203.0.113.9:9", **env})
    return NodeRunner(spec, grace=0.5)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_no_orphans")
def test_node_runner_relays_heartbeats_output_and_the_exit() -> None:
    code = ("import os, socket; from shardkit.job import protocol as p\n"
            "host, port = p.parse_addr(os.environ[p.ENV_HEARTBEAT_ADDR])\n"
            "beat = p.Heartbeat(role='worker', index=0, attempt=0, pid=os.getpid(), kind='step', step=7)\n"
            "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(beat.to_bytes(), (host, port))\n"
            "print('to', host, flush=True); print('last', end=''); raise SystemExit(3)")
    runner = runner_for(code)
    try:
        got = Update()
        while got.returncode is None:
            update = runner.collect()
            got = Update(got.beats + update.beats, got.lines + update.lines, update.returncode, update.pid)
        assert got.returncode == 3
        assert got.lines == ["to 127.0.0.1", "last"]  # the runner's own socket; the unterminated line too
        beats = [p.Heartbeat.from_bytes(b.encode()) for b in got.beats]
        assert [(b.kind, b.step) for b in beats] == [("step", 7)]
        assert runner.collect() == Update(returncode=3, pid=runner.pid)
    finally:
        runner.close()
    assert not runner.dir.exists()


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_no_orphans")
def test_node_runner_stop_ends_the_process_group() -> None:
    code = ("import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "c = subprocess.Popen(['sleep', '600']); print(c.pid, flush=True); time.sleep(600)")
    runner = runner_for(code)
    try:
        lines: list[str] = []
        while not lines:
            lines += runner.collect().lines
        final = runner.stop()
        assert final.returncode == -signal.SIGKILL  # SIGTERM was ignored: killed after the grace
        assert proctree.wait_gone([runner.pid, int(lines[0])], 5) == set()
    finally:
        runner.close()


def test_mirror_hands_heartbeats_on_before_the_exit(tmp_path: Path) -> None:
    spec = ProcessSpec("worker", 1, ["python"], {})
    with HeartbeatReceiver() as receiver:
        group = MirrorGroup([MirrorProcess(spec, tmp_path / "worker-1.log")], receiver.addr)
        beat = p.Heartbeat(role="worker", index=1, attempt=0, pid=5, kind="done", step=3)
        group.feed(0, Update([beat.to_bytes().decode()], ["bye"], 0, 5))
        assert [b.kind for b in receiver.receive(1.0)] == ["done"]  # already there when the exit shows
        assert [proc.name for proc in group.poll()] == ["worker-1"]
        assert group.poll() == []
        assert [(proc.name, line) for proc, line in group.output()] == [("worker-1", "bye")]
        group.lost(0, "ignored: it already exited")
        assert group.processes[0].returncode == 0
        group.close()
    assert (tmp_path / "worker-1.log").read_text() == "bye\n"
    assert group.processes[0].tail() == ["bye"]


def test_options_name_the_key_and_the_closest_option() -> None:
    with pytest.raises(ConfigError, match=r"engine\.gracee = 1: the x engine has no option 'gracee'.*"
                                          r"did you mean 'grace'"):
        Options("x", {"gracee": 1}, ("grace", "master"))
    opts = Options("x", {"grace": 2, "master": "local[2]", "conf": {"a": 1}}, ("grace", "master", "conf"))
    assert (opts.number("grace", 5.0), opts.text("master", "m"), opts.mapping("conf", "{}")) == (
        2.0, "local[2]", {"a": 1})
    for bad in ({"grace": True}, {"grace": "5"}, {"grace": -1}):
        with pytest.raises(ConfigError, match=r"engine\.grace = "):
            Options("x", bad, ("grace",)).number("grace", 5.0)
