"""Cluster spec (env per framework and strategy, free ports, real rendezvous) and the heartbeat protocol."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.cluster._spec import ClusterSpec, build_spec
from shardkit.errors import ConfigError
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig
from shardkit.job.layout import free_ports, layout

ENTRY = Path(__file__).with_name("test_spec.py")  # any existing file serves as the script


def make(framework: str, strategy: str, **counts: int) -> JobConfig:
    roles = {role: {"count": n} for role, n in counts.items() if n}
    return JobConfig.from_dict({"name": "job", "entrypoint": str(ENTRY), "framework": framework,
                                "strategy": strategy, "roles": roles, "data": {"url": "ds"}},
                               base_dir=ENTRY.parent)


def envs(spec: ClusterSpec) -> dict[tuple[str, int], dict[str, str]]:
    return {(proc.role, proc.index): proc.env for proc in spec.processes}


# -- torch -----------------------------------------------------------------------------------------


def test_torch_allreduce_env() -> None:
    config = make("torch", "allreduce", worker=3, evaluator=1)
    spec = build_spec(config, attempt=2, heartbeat_addr="127.0.0.1:4000", job_dir="/jobs/a")
    assert [proc.name for proc in spec.processes] == ["worker-0", "worker-1", "worker-2", "evaluator-0"]
    port = spec.processes[0].env[p.MASTER_PORT]
    assert spec.ports == [int(port)]
    for i in range(3):
        env = spec.process("worker", i).env
        assert env[p.MASTER_ADDR] == "127.0.0.1"
        assert env[p.MASTER_PORT] == port
        assert (env[p.RANK], env[p.WORLD_SIZE]) == (str(i), "3")
        assert (env[p.LOCAL_RANK], env[p.LOCAL_WORLD_SIZE]) == (str(i), "3")
        assert (env[p.ENV_DATA_SHARD], env[p.ENV_DATA_NUM_SHARDS]) == (str(i), "3")
        assert env[p.ENV_ROLE] == "worker"
        assert env[p.ENV_ROLE_INDEX] == str(i)
        assert env[p.ENV_ATTEMPT] == "2"
        assert env[p.ENV_HEARTBEAT_ADDR] == "127.0.0.1:4000"
        assert env[p.ENV_JOB_DIR] == "/jobs/a"
        assert env[p.ENV_JOB_CONFIG] == "/jobs/a/job.json"
        assert p.TF_CONFIG not in env
    evaluator = spec.process("evaluator").env
    assert not {p.RANK, p.MASTER_PORT, p.ENV_DATA_SHARD} & evaluator.keys()
    assert evaluator[p.ENV_ROLE] == "evaluator"


def test_torch_parameter_server_env_puts_ps_first() -> None:
    spec = build_spec(make("torch", "parameter_server", worker=3, ps=2))
    assert [proc.name for proc in spec.processes] == ["ps-0", "ps-1", "worker-0", "worker-1", "worker-2"]
    got = {proc.name: (proc.env[p.RANK], proc.env[p.WORLD_SIZE], proc.env.get(p.ENV_DATA_SHARD),
                       proc.env.get(p.ENV_DATA_NUM_SHARDS)) for proc in spec.processes}
    assert got == {"ps-0": ("0", "5", None, None), "ps-1": ("1", "5", None, None),
                   "worker-0": ("2", "5", "0", "3"), "worker-1": ("3", "5", "1", "3"),
                   "worker-2": ("4", "5", "2", "3")}
    assert len({proc.env[p.MASTER_PORT] for proc in spec.processes}) == 1


def test_argv_for_script_and_function_and_env_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_TEST_SECRET", "value-1")
    config = JobConfig.from_dict({"name": "j", "entrypoint": "pkg.mod:main", "framework": "torch",
                                  "roles": {"worker": {}}, "env": {"OMP_NUM_THREADS": 1},
                                  "secrets": {"TOKEN": {"env": "SHARDKIT_TEST_SECRET"}}}, base_dir=tmp_path)
    proc = build_spec(config).processes[0]
    assert proc.argv == [sys.executable, "-u", "-m", "shardkit.trainer.run", "pkg.mod:main"]
    assert list(proc.env)[-2:] == ["OMP_NUM_THREADS", "TOKEN"]  # config.env, then the secrets
    assert proc.env["TOKEN"] == "value-1"
    assert proc.redacted_env()["TOKEN"] == "<redacted>"
    assert proc.redacted_env()["OMP_NUM_THREADS"] == "1"
    script = build_spec(make("torch", "allreduce", worker=1)).processes[0]
    assert script.argv == [sys.executable, "-u", str(ENTRY)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"attempt": -1}, "attempt -1"), ({"attempt": True}, "attempt True"),
     ({"heartbeat_addr": "localhost"}, "HOST:PORT"), ({"heartbeat_addr": "h:99999"}, "HOST:PORT")],
)
def test_bad_build_spec_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_spec(make("torch", "allreduce", worker=1), **kwargs)


def test_ports_are_distinct_and_free() -> None:
    spec = build_spec(make("tensorflow", "parameter_server", worker=4, ps=3))
    assert len(spec.ports) == 8  # chief + 4 workers + 3 ps
    assert len(set(spec.ports)) == 8
    sockets = []
    try:
        for port in spec.ports:  # the roles can bind every one of them
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", port))
            sock.listen()
    finally:
        for sock in sockets:
            sock.close()
    assert len(set(free_ports(20))) == 20


# -- tensorflow ------------------------------------------------------------------------------------


TF_CASES = [
    (("allreduce", {"worker": 2}), {"worker": 2}),
    (("allreduce", {"worker": 3, "chief": 1, "evaluator": 1}), {"chief": 1, "worker": 3}),
    (("parameter_server", {"worker": 2, "ps": 2, "evaluator": 1}), {"chief": 1, "worker": 2, "ps": 2}),
]


@pytest.mark.tf
def test_tf_config_round_trips_through_tensorflow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    tf = pytest.importorskip("tensorflow")
    from tensorflow.python.distribute import multi_worker_util  # the numbering MWMS uses

    for (strategy, counts), cluster_sizes in TF_CASES:
        spec = build_spec(make("tensorflow", strategy, **counts))
        clusters = set()
        for proc in spec.processes:
            assert not {p.RANK, p.MASTER_PORT} & proc.env.keys()
            monkeypatch.setenv("TF_CONFIG", proc.env[p.TF_CONFIG])
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            assert (resolver.task_type, resolver.task_id) == (proc.role, proc.index)
            cluster = resolver.cluster_spec().as_dict()
            clusters.add(json.dumps(cluster, sort_keys=True))
            assert {job: len(addrs) for job, addrs in cluster.items()} == cluster_sizes  # no evaluator
            if proc.role != "evaluator":
                assert resolver.master() == cluster[proc.role][proc.index]
            if strategy == "allreduce" and proc.role != "evaluator":
                # each collective member reads the shard of its place in MultiWorkerMirroredStrategy
                place = multi_worker_util.id_in_cluster(resolver.cluster_spec(), proc.role, proc.index)
                assert proc.env[p.ENV_DATA_SHARD] == str(place)
                assert proc.env[p.ENV_DATA_NUM_SHARDS] == str(multi_worker_util.worker_count(
                    resolver.cluster_spec(), "chief" if "chief" in cluster else "worker"))
            elif strategy == "parameter_server":
                reads = proc.role == "chief"
                assert (proc.env.get(p.ENV_DATA_SHARD), proc.env.get(p.ENV_DATA_NUM_SHARDS)) == (
                    ("0", "1") if reads else (None, None))
        assert len(clusters) == 1  # every process sees the same cluster
        addresses = [a for addrs in json.loads(clusters.pop()).values() for a in addrs]
        assert sorted(int(a.rsplit(":", 1)[1]) for a in addresses) == sorted(spec.ports)


# -- invariants over role counts -------------------------------------------------------------------


@st.composite
def jobs(draw: st.DrawFn) -> tuple[str, str, dict[str, int]]:
    framework = draw(st.sampled_from(["torch", "tensorflow"]))
    strategy = draw(st.sampled_from(["allreduce", "parameter_server"]))
    counts = {"worker": draw(st.integers(1, 9)), "evaluator": draw(st.integers(0, 1))}
    if strategy == "parameter_server":
        counts["ps"] = draw(st.integers(1, 4))
    if framework == "tensorflow":
        counts["chief"] = 1 if strategy == "parameter_server" else draw(st.integers(0, 1))
    return framework, strategy, counts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_spec_invariants(job: tuple[str, str, dict[str, int]]) -> None:
    framework, strategy, counts = job
    spec = build_spec(make(framework, strategy, **counts))
    procs = spec.processes
    # every process present exactly once, servers first
    assert sorted((q.role, q.index) for q in procs) == sorted(
        (role, i) for role, n in counts.items() for i in range(n))
    assert [q.role for q in procs] == sorted((q.role for q in procs), key=["ps", "chief", "worker",
                                                                           "evaluator"].index)
    assert [q.slot for q in procs] == layout(make(framework, strategy, **counts))
    # ranks: 0..world-1, unique, one world, one master port (torch); none for tensorflow
    ranked = [q for q in procs if p.RANK in q.env]
    if framework == "torch":
        world = counts["worker"] + counts.get("ps", 0)
        assert sorted(int(q.env[p.RANK]) for q in ranked) == list(range(world))
        assert {q.env[p.WORLD_SIZE] for q in ranked} == {str(world)}
        assert len({q.env[p.MASTER_PORT] for q in ranked}) == 1
        assert all(q.env[p.LOCAL_RANK] == q.env[p.RANK] for q in ranked)
    else:
        assert ranked == []
        assert len(spec.ports) == len(set(spec.ports)) == sum(counts.values()) - counts["evaluator"]
    # data shards cover 0..num_shards-1 exactly once
    readers = [q for q in procs if p.ENV_DATA_SHARD in q.env]
    assert readers
    assert len({q.env[p.ENV_DATA_NUM_SHARDS] for q in readers}) == 1
    assert sorted(int(q.env[p.ENV_DATA_SHARD]) for q in readers) == list(
        range(int(readers[0].env[p.ENV_DATA_NUM_SHARDS])))
    assert all(q.role != "evaluator" and q.role != "ps" for q in readers)
    for q in procs:
        assert (q.env[p.ENV_ROLE], q.env[p.ENV_ROLE_INDEX]) == (q.role, str(q.index))


# -- real rendezvous with the spec's env -----------------------------------------------------------


GLOO = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("OK", dist.get_rank(), dist.get_world_size(), int(t.item()), flush=True)
dist.destroy_process_group()
"""

RPC = """
import operator, os
import torch.distributed.rpc as rpc
role, index = os.environ["SHARDKIT_ROLE"], os.environ["SHARDKIT_ROLE_INDEX"]
rank = int(os.environ["RANK"])
rpc.init_rpc(f"{role}{index}", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
# a worker calls the first ps by name: the ps-first rank order is what the names map to
answer = rpc.rpc_sync("ps0", operator.add, args=(rank, 100)) if role == "worker" else None
rpc.shutdown()
print("OK", role, rank, answer, flush=True)
"""


def run_all(procs_specs: list[ClusterSpec], timeout: float) -> list[str]:
    """Start every process of the specs in its own session; kill every group if anything goes wrong."""
    procs = [subprocess.Popen(q.argv, env={**os.environ, **q.env}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for spec in procs_specs for q in spec.processes]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
        for proc, out in zip(procs, outputs, strict=True):
            assert proc.returncode == 0, out
        return [out.strip().splitlines()[-1] for out in outputs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_torch_processes_meet_through_the_spec_env(tmp_path: Path) -> None:
    """Real gloo allreduce (2 workers) and real torch.distributed.rpc (1 ps + 2 workers), concurrently."""
    (tmp_path / "gloo.py").write_text(GLOO)
    (tmp_path / "rpc.py").write_text(RPC)
    specs = [build_spec(JobConfig.from_dict(
        {"name": name, "entrypoint": f"{name}.py", "framework": "torch", "strategy": strategy,
         "roles": roles, "env": {"OMP_NUM_THREADS": "1"}}, base_dir=tmp_path))
        for name, strategy, roles in [("gloo", "allreduce", {"worker": {"count": 2}}),
                                      ("rpc", "parameter_server", {"ps": {}, "worker": {"count": 2}})]]
    assert specs[0].ports != specs[1].ports
    assert run_all(specs, timeout=75) == ["OK 0 2 3", "OK 1 2 3", "OK ps 0 None", "OK worker 1 101",
                                          "OK worker 2 102"]


# -- heartbeat protocol ----------------------------------------------------------------------------


def beat(**changes: Any) -> p.Heartbeat:
    fields: dict[str, Any] = {"role": "worker", "index": 1, "attempt": 0, "pid": 123, "kind": "step",
                              "step": 17, "time": 1.7e9, "samples": 1088, "metrics": {"loss": 0.3}}
    fields.update(changes)
    return p.Heartbeat(**fields)


def test_heartbeat_wire_format_round_trips() -> None:
    hb = beat(checkpoint="file:///ck/step-000000050")
    wire = json.loads(hb.to_bytes())
    assert wire == {"v": 1, "role": "worker", "index": 1, "attempt": 0, "pid": 123, "kind": "step",
                    "step": 17, "time": 1.7e9, "samples": 1088, "metrics": {"loss": 0.3},
                    "checkpoint": "file:///ck/step-000000050"}
    assert p.Heartbeat.from_bytes(hb.to_bytes()) == hb
    nan = p.Heartbeat.decode(beat(metrics={"loss": float("nan")}).to_bytes())
    assert nan is not None
    assert np.isnan(nan.metrics["loss"])
    # unknown extra keys from a newer sender are ignored
    assert p.Heartbeat.decode(json.dumps({**wire, "future": 1}).encode()) == hb


class Scalar:
    """Stands for a 0-d torch tensor or any number-like value: it has ``__float__``."""

    def __float__(self) -> float:
        return 0.25


def test_heartbeat_accepts_numpy_and_number_like_scalars() -> None:
    hb = beat(step=np.int64(5), samples=np.int32(64), time=np.float64(2.0),
              metrics={"loss": np.float32(0.5), "acc": Scalar()})
    assert (hb.step, hb.samples, hb.metrics) == (5, 64, {"loss": 0.5, "acc": 0.25})
    assert type(hb.step) is int
    assert p.Heartbeat.from_bytes(hb.to_bytes()) == hb


@pytest.mark.parametrize(
    "changes",
    [{"role": "boss"}, {"kind": "sleeping"}, {"index": -1}, {"pid": 0}, {"step": 1.5}, {"v": 2},
     {"metrics": {"loss": "low"}}, {"checkpoint": 3}],
)
def test_invalid_heartbeat_cannot_be_built(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="heartbeat"):
        beat(**changes)


def test_oversized_heartbeat_is_refused_by_the_sender() -> None:
    with pytest.raises(ValueError, match="fewer or shorter metrics"):
        beat(metrics={f"m{i:05d}": 1.0 for i in range(5000)}).to_bytes()


GOOD = json.loads(beat().to_bytes())


@pytest.mark.parametrize(
    "datagram",
    [b"", b"\xff\xfe", b"null", b"[1, 2]", b"{", b'"text"', b"[" * 100_000 + b"]" * 100_000,
     json.dumps({**GOOD, "v": 2}).encode(), json.dumps({**GOOD, "v": True}).encode(),
     json.dumps({k: v for k, v in GOOD.items() if k != "pid"}).encode(),
     json.dumps({**GOOD, "index": "0"}).encode(), json.dumps({**GOOD, "step": True}).encode(),
     json.dumps({**GOOD, "time": "now"}).encode(), json.dumps({**GOOD, "metrics": [1]}).encode(),
     json.dumps({**GOOD, "metrics": {"a": None}}).encode(), json.dumps({**GOOD, "role": None}).encode(),
     json.dumps({**GOOD, "time": float("inf")}).encode(), b"x" * (p.MAX_DATAGRAM_BYTES + 1)],
)
def test_malformed_datagram_is_ignored(datagram: bytes) -> None:
    assert p.Heartbeat.decode(datagram) is None
    with pytest.raises(ValueError):  # noqa: PT011 - the named reason differs per datagram
        p.Heartbeat.from_bytes(datagram)


VALUES = st.none() | st.integers() | st.floats() | st.text(max_size=5) | st.booleans()
MUTATED = st.dictionaries(st.sampled_from(sorted(GOOD)), VALUES).map(
    lambda changes: json.dumps({**GOOD, **changes}).encode())


@given(st.binary(max_size=300) | MUTATED)
def test_from_bytes_raises_only_value_error_and_decode_agrees(datagram: bytes) -> None:
    try:
        hb = p.Heartbeat.from_bytes(datagram)
    except ValueError:
        assert p.Heartbeat.decode(datagram) is None
    else:
        assert p.Heartbeat.decode(datagram) == hb
        assert p.Heartbeat.from_bytes(hb.to_bytes()) == hb


def test_heartbeat_over_real_udp() -> None:
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        receiver.bind(("127.0.0.1", 0))
        receiver.settimeout(5)
        addr = p.format_addr(*receiver.getsockname())
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"garbage", p.parse_addr(addr))
            sender.sendto(beat(kind="done").to_bytes(), p.parse_addr(addr))
        received = [p.Heartbeat.decode(receiver.recv(65536)) for _ in range(2)]
    finally:
        receiver.close()
    assert received[0] is None
    assert received[1] == beat(kind="done")


def test_addresses() -> None:
    assert p.parse_addr("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert p.parse_addr("[::1]:5000") == ("::1", 5000)
    assert p.format_addr("::1", 5000) == "[::1]:5000"
    for bad in ["127.0.0.1", ":5000", "h:0", "h:70000", "h:x"]:
        with pytest.raises(ValueError, match="HOST:PORT"):
            p.parse_addr(bad)
