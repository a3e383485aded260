"""The ``ray`` engine on a real Ray cluster of two hosts: the head on h0, a worker node on h1 (each in its
own network namespace, the host name resolving to 127.0.0.1 on both), ``shardkit train`` on h0.

- the digits jobs (torch, TensorFlow) with one worker per node: each worker's collectives bind to its
  node's address (``MASTER_ADDR``, ``TF_CONFIG`` and the interface variables);
- h1 lost mid-job (every process of its namespace SIGKILLed, the raylet too): the group restarts from
  the checkpoint on h0, every sample trained exactly once along the checkpointed lineage; then a job
  that needs a node per worker fails at once, naming the alive and the lost node;
- an address where no Ray answers: an error naming it and ``engine.address`` within seconds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.torchrun_tools import BATCH, EVERY, ROWS, effective_ids, records, write_ids_dataset
from tests.multihost import partition
from tests.multihost.netns import Host, Network
from tests.multihost.partition import CUT_HOST_CLEAR_S, when_seen, with_partition_bounds
from tests.multihost.raycluster import QUICK_HEALTH, RayCluster, ray_cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
IDS = REPO / "tests" / "cluster" / "torchrun_scripts" / "ids.py"  # logs the ids each rank trained, per step


@pytest.fixture(scope="module")
def ids_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids_dataset(tmp_path_factory.mktemp("data"))


def write_config(folder: Path, config: dict[str, Any], engine: dict[str, Any], name: str = "job") -> Path:
    config = {**config, "engine": engine, "logdir": str(folder / name)}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def digits_config(folder: Path, data_url: str, engine: dict[str, Any], example: str = "digits.yaml") -> Path:
    """``examples/digits.yaml`` (2 DDP workers; or another example) for 2 epochs on ``data_url``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((EXAMPLES / example).read_text())
    config["entrypoint"] = str(EXAMPLES / config["entrypoint"])
    config["data"].update(url=data_url, num_epochs=2)
    config["checkpoint"] = {"every_steps": 20, "keep": 2}
    config["fault_tolerance"].update(max_restarts=0, startup_timeout=90.0)
    return write_config(folder, config, engine)


def ids_config(folder: Path, data_url: str, engine: dict[str, Any], name: str = "job") -> Path:
    config = {
        "name": "ids", "entrypoint": str(IDS), "framework": "torch", "roles": {"worker": {"count": 2}},
        "data": {"url": data_url, "batch_size": BATCH, "seed": 3, "num_epochs": 1,
                 "options": {"shuffle_buffer": 24, "workers": 1}},
        "checkpoint": {"every_steps": EVERY, "keep": 3},
        "fault_tolerance": {"max_restarts": 2, "heartbeat_interval": 0.5, "heartbeat_timeout": 20.0,
                            "startup_timeout": 60.0},
        # 20 steps of 0.25 s: ~4 s from the first checkpoint (step 4) to the end, for a test to act in
        "params": {"sleep": 0.25}, "env": {"OMP_NUM_THREADS": "1"},
    }
    return write_config(folder, config, engine, name)


def train(host: Host, config: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``shardkit train config`` on ``host``, its output in ``<config>.out``."""
    with open(config.with_suffix(".out"), "wb") as out:
        return host.popen([sys.executable, "-m", "shardkit.cli", "train", str(config)], env=env, cwd=REPO,
                          stdout=out, stderr=subprocess.STDOUT)


def output(config: Path) -> str:
    return config.with_suffix(".out").read_text(errors="replace")


def finish(proc: subprocess.Popen[bytes], config: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"shardkit train ran past {timeout} s:\n{output(config)[-5000:]}") from None


def role_envs(host: Host, job_dir: Path) -> dict[str, dict[str, str]]:
    """``{"worker-1": its environment}`` for the role processes of the job running in ``host``."""
    found: dict[str, dict[str, str]] = {}
    for pid in host.pids():
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        env = dict(item.partition("=")[::2] for item in raw.split("\0") if "=" in item)
        if env.get("SHARDKIT_JOB_DIR") == str(job_dir) and "SHARDKIT_ROLE" in env:
            found[f"{env['SHARDKIT_ROLE']}-{env['SHARDKIT_ROLE_INDEX']}"] = env
    return found


def watch(condition: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Poll ``condition`` until it holds (True), or the job ends or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def max_step(job_dir: Path) -> int:
    return max((rec.get("step", 0) for lines in records(job_dir).values() for rec in lines), default=0)


def run_on_both(hosts: list[Host], config: Path, cluster: RayCluster) -> dict[str, dict[str, dict[str, str]]]:
    """Run the job from ``hosts[0]`` to its end; ``{host name: {role process: its environment}}`` as seen
    while every host ran one."""
    proc = train(hosts[0], config, cluster.env)
    seen: dict[str, dict[str, dict[str, str]]] = {}

    def everywhere() -> bool:
        seen.update({h.name: role_envs(h, config.parent / "job") for h in hosts})
        return all(seen.values())

    spread = watch(everywhere, proc, 120)
    assert finish(proc, config, 120) == 0, output(config)[-5000:]
    assert spread, f"the workers did not run one on each node: {seen}\n{output(config)[-3000:]}"
    return seen


@pytest.mark.timeout(200)
def test_digits_jobs_run_one_worker_per_node_bound_to_its_address(tmp_path: Path, digits: str,
                                                                  net2: Network) -> None:
    """The torch (DDP, gloo) and the TensorFlow (MultiWorkerMirroredStrategy) digits jobs."""
    h0, h1 = net2.hosts
    with ray_cluster(net2, cpus=(2, 2)) as cluster:
        engine = {"name": "ray", "address": cluster.address, "grace": 2}
        torch_job = digits_config(tmp_path / "torch", digits, engine)
        torch_seen = run_on_both(net2.hosts, torch_job, cluster)
        tf_job = digits_config(tmp_path / "tf", digits, engine, example="digits_tf.yaml")
        tf_seen = run_on_both(net2.hosts, tf_job, cluster)

    (name0, env0), = torch_seen["h0"].items()
    (name1, env1), = torch_seen["h1"].items()
    assert {name0, name1} == {"worker-0", "worker-1"}
    master = h0.addr if env0["RANK"] == "0" else h1.addr
    for host, env in ((h0, env0), (h1, env1)):
        assert env["MASTER_ADDR"] == master  # rank 0's node address, as Ray knows it: not loopback
        assert env["GLOO_SOCKET_IFNAME"] == host.ifname  # the collectives bind to the node's own link
        assert env["NCCL_SOCKET_IFNAME"] == host.ifname
    records = json.loads((tmp_path / "torch" / "job" / "logs" / "attempt-0" / "processes.json").read_text())
    for host, name, env in ((h0, name0, env0), (h1, name1, env1)):
        record = next(r for r in records if r["name"] == name)
        assert record["host"] == host.addr
        for key in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
            assert record["env"][key] == env[key], record  # as the process got it, not the spec's loopback
    summary = json.loads((tmp_path / "torch" / "job" / "summary.json").read_text())
    assert (summary["status"], summary["restarts"], summary["steps"]) == ("succeeded", 0, 48), summary
    assert summary["metrics"]["test_accuracy"] > 0.5
    assert "[worker-0] test accuracy:" in output(torch_job)  # output relayed from the nodes

    where = {name: host.addr for host in (h0, h1) for name in tf_seen[host.name]}
    assert sorted(where) == ["worker-0", "worker-1"]
    for host in (h0, h1):
        (name, env), = tf_seen[host.name].items()
        tf_config = json.loads(env["TF_CONFIG"])
        hosts = [member.rpartition(":")[0] for member in tf_config["cluster"]["worker"]]
        assert hosts == [where["worker-0"], where["worker-1"]], tf_config  # node addresses, not loopback
        assert tf_config["task"] == {"type": "worker", "index": int(name[-1])}
        assert env["GLOO_SOCKET_IFNAME"] == host.ifname
    summary = json.loads((tmp_path / "tf" / "job" / "summary.json").read_text())
    assert (summary["status"], summary["restarts"]) == ("succeeded", 0), summary
    assert summary["metrics"]["test_accuracy"] > 0.5


@pytest.mark.timeout(200)
def test_a_lost_node_restarts_the_group_on_the_node_left_then_too_few_nodes_fail_at_once(
        tmp_path: Path, ids_dataset: str, net2: Network) -> None:
    h0, h1 = net2.hosts
    with ray_cluster(net2, cpus=(2, 2), head_env=QUICK_HEALTH) as cluster:
        config = ids_config(tmp_path, ids_dataset, {"name": "ray", "address": cluster.address, "grace": 2})
        job_dir = tmp_path / "job"
        proc = train(h0, config, cluster.env)
        on_h1 = watch(lambda: bool(role_envs(h1, job_dir)) and max_step(job_dir) > EVERY + 1
                      and any((job_dir / "checkpoints").glob("step-*/COMMIT")), proc, 120)
        assert on_h1, f"no worker ran on h1 past the first checkpoint:\n{output(config)[-5000:]}"
        h1.kill_all()  # the machine is gone: raylet, actor, role process
        assert finish(proc, config, 120) == 0, output(config)[-5000:]

        ids, attempts = effective_ids(job_dir)
        assert ids == Counter(range(ROWS)), "every sample of the epoch exactly once across the restart"
        assert len(attempts) >= 2
        *_, (_, world, start) = attempts
        assert world == 2, attempts  # the group keeps its size, both workers now on h0
        assert start >= EVERY, "the last attempt resumed from a checkpoint, not from the start"
        summary = json.loads((job_dir / "summary.json").read_text())
        assert summary["status"] == "succeeded"
        assert summary["restarts"] >= 1

        # the cluster is now h0 alone: a node per worker cannot be had, and the job says so at once
        strict = ids_config(tmp_path, ids_dataset, {"name": "ray", "address": cluster.address,
                                                    "placement": "strict_spread"}, name="strict")
        began = time.monotonic()
        code = finish(train(h0, strict, cluster.env), strict, 90)
        took = time.monotonic() - began
    text = output(strict)
    assert code == 1, text
    assert f"1 alive node(s) ({h0.addr} (2 CPU" in text, text
    assert f"1 lost ({h1.addr})" in text, text
    assert "engine.placement=strict_spread" in text, text
    assert "a node per process: 2 needed, 1 can hold one" in text, text
    assert not (tmp_path / "strict" / "ids").exists(), "no process of the job started"
    assert took < 60, f"too few nodes took {took:.0f} s to be reported"


@pytest.mark.timeout(90)
def test_an_address_where_no_ray_answers_fails_within_seconds_naming_it(tmp_path: Path, ids_dataset: str,
                                                                      net2: Network) -> None:
    h0, h1 = net2.hosts
    address = f"{h1.addr}:6379"
    for case, why in (("refused", "Connection refused"), ("cut", "No route to host|no answer")):
        if case == "cut":
            h1.cut()  # silence: no RST, no ARP reply; a connection attempt just waits
        config = ids_config(tmp_path, ids_dataset, {"name": "ray", "address": address}, name=case)
        began = time.monotonic()
        code = finish(train(h0, config, {}), config, 40)
        took = time.monotonic() - began
        text = output(config)
        assert code == 2, text
        assert re.search(rf"engine\.address='{address}': no Ray cluster answers at {address} \(({why}), "
                         r"after \d+\.\d s\)\. Fix: start the cluster's head there", text), text
        assert took < 30, f"{case}: an unreachable address took {took:.0f} s to be reported"
        assert not list(tmp_path.glob(f"{case}/logs/*/worker-*.log")), "no process of the job started"


def job_processes(host: Host, job_dir: Path) -> list[str]:
    """What of the job runs on ``host``: its role processes and its Ray actors (``ray::_RoleActor...``)."""
    return partition.job_processes(host, job_dir, ("ray::_RoleActor",))


def first_step(job_dir: Path, attempt: int) -> bool:
    return any(len(lines) > 1 for (a, _), lines in records(job_dir).items() if a == attempt)


@pytest.mark.full  # SHARDKIT_FULL=1 (tests/conftest.py): a minute or more each
@pytest.mark.timeout(240)
def test_a_partitioned_node_is_given_up_its_processes_end_and_the_group_resumes_on_the_node_left(
        tmp_path: Path, ids_dataset: str, net2: Network) -> None:
    """h1 cut off mid-job (silence, no reset): the supervisor notices the silence, gives the unreachable
    actor up naming its node, restarts the group on h0 from the checkpoint, off h1, which Ray (with its
    default health checks) still counts alive; on h1 the actor's watchdog ends the role process and the
    actor within lost_job_timeout."""
    h0, h1 = net2.hosts
    with ray_cluster(net2, cpus=(2, 2)) as cluster:
        config = with_partition_bounds(
            ids_config(tmp_path, ids_dataset, {"name": "ray", "address": cluster.address, "grace": 2}))
        job_dir = tmp_path / "job"
        proc = train(h0, config, cluster.env)
        on_h1 = watch(lambda: bool(role_envs(h1, job_dir)) and max_step(job_dir) > EVERY + 1
                      and any((job_dir / "checkpoints").glob("step-*/COMMIT")), proc, 120)
        assert on_h1, f"no worker ran on h1 past the first checkpoint:\n{output(config)[-5000:]}"
        assert job_processes(h1, job_dir), "the role process and its actor run on h1"
        h1.cut()
        cut_at = time.monotonic()
        events = {"notice": lambda: "attempt 0 failed" in output(config),
                  "resume": lambda: first_step(job_dir, 1),
                  "h1 clear": lambda: not job_processes(h1, job_dir)}
        seen = when_seen(events, cut_at, proc, 150)
        left = job_processes(h1, job_dir)
        code = finish(proc, config, 120)
    text = output(config)
    print(f"after the cut: {', '.join(f'{k} {v:.1f} s' for k, v in seen.items())}")
    assert code == 0, text[-5000:]
    assert "h1 clear" in seen, f"still on h1 {time.monotonic() - cut_at:.0f} s after the cut: {left}"
    assert seen["h1 clear"] < CUT_HOST_CLEAR_S, seen
    node = re.escape(h1.addr)
    assert re.search(rf"the Ray actor of worker-\d (is lost: Ray marked its node {node} dead|\(node {node}\) "
                     r"did not answer the request to stop it).*partition", text), text
    assert "did not stop it in time; the actor was killed" not in text
    ids, attempts = effective_ids(job_dir)
    assert ids == Counter(range(ROWS)), "every sample of the epoch exactly once across the restart"
    *_, (_, world, start) = attempts
    assert (world, start >= EVERY) == (2, True), attempts
    summary = json.loads((job_dir / "summary.json").read_text())
    assert (summary["status"], summary["restarts"]) == ("succeeded", 1), summary


@pytest.mark.full  # SHARDKIT_FULL=1 (tests/conftest.py): a minute or more each
@pytest.mark.timeout(200)
def test_a_node_cut_off_while_the_job_starts_is_given_up_and_the_group_starts_on_the_node_left(
        tmp_path: Path, ids_dataset: str, net2: Network) -> None:
    """h1 cut off once its actor exists, before its process trains: the actor that does not answer is a
    lost process named with its node (not a job that fails for want of placement), the group starts
    again on h0, and the actor on h1, hearing nothing, ends."""
    h1 = net2.hosts[1]
    with ray_cluster(net2, cpus=(2, 2)) as cluster:
        config = with_partition_bounds(
            ids_config(tmp_path, ids_dataset, {"name": "ray", "address": cluster.address, "grace": 2}))
        job_dir = tmp_path / "job"
        proc = train(net2.hosts[0], config, cluster.env)
        assert watch(lambda: bool(job_processes(h1, job_dir)), proc, 120), output(config)[-5000:]
        h1.cut()
        cut_at = time.monotonic()
        clear = watch(lambda: not job_processes(h1, job_dir), proc, CUT_HOST_CLEAR_S)
        cleared_after = time.monotonic() - cut_at
        left = job_processes(h1, job_dir)
        code = finish(proc, config, 150)
    text = output(config)
    print(f"h1 clear {cleared_after:.1f} s after the cut")
    assert code == 0, text[-5000:]
    assert clear or not left, f"still on h1 {CUT_HOST_CLEAR_S:g} s after the cut: {left}"
    node = re.escape(h1.addr)
    assert re.search(rf"the Ray actor of worker-\d (is lost: Ray marked its node {node} dead|\(node {node}\) "
                     r"did not answer).*partition", text), text
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded", summary
    assert effective_ids(job_dir)[0] == Counter(range(ROWS)), "every sample of the epoch exactly once"


@pytest.mark.full  # SHARDKIT_FULL=1 (tests/conftest.py): a minute or more each
@pytest.mark.timeout(150)
def test_a_head_cut_off_mid_job_fails_the_job_naming_the_address_before_ray_ends_the_trainer(
        tmp_path: Path, ids_dataset: str, net2: Network) -> None:
    """``shardkit train`` on h1 (a worker node), the head on h0, h0 cut off mid-job: no group can be
    placed without the head, so the trainer fails the job once the head has been silent for
    lost_job_timeout, naming engine.address and the partition, and writes the summary (status failed,
    the samples of the newest checkpoint) well before Ray's core worker would end it (60 s without its
    GCS); the actor on h1 ends with its process, the one on h0 by its watchdog."""
    h0, h1 = net2.hosts
    with ray_cluster(net2, cpus=(2, 2)) as cluster:
        config = with_partition_bounds(
            ids_config(tmp_path, ids_dataset, {"name": "ray", "address": cluster.address, "grace": 2}))
        settings = yaml.safe_load(config.read_text())
        settings["fault_tolerance"]["heartbeat_timeout"] = 15.0  # after the head's limit, as by default
        config.write_text(yaml.safe_dump(settings))
        job_dir = tmp_path / "job"
        proc = train(h1, config, cluster.env)
        on_both = watch(lambda: bool(role_envs(h0, job_dir)) and bool(role_envs(h1, job_dir))
                        and max_step(job_dir) > EVERY + 1
                        and any((job_dir / "checkpoints").glob("step-*/COMMIT")), proc, 120)
        assert on_both, f"no worker on each node past a checkpoint:\n{output(config)[-5000:]}"
        h0.cut()
        cut_at = time.monotonic()
        seen: dict[str, float] = {}
        events = {"line": lambda: "stopped answering" in output(config),
                  "exit": lambda: proc.poll() is not None,
                  "h0 clear": lambda: not job_processes(h0, job_dir),
                  "h1 clear": lambda: not job_processes(h1, job_dir)}
        while len(seen) < len(events) and time.monotonic() - cut_at < 90:
            for name, happened in events.items():
                if name not in seen and happened():
                    seen[name] = time.monotonic() - cut_at
            time.sleep(0.1)
        left = {h.name: job_processes(h, job_dir) for h in (h0, h1)}
        code = finish(proc, config, 30)
    text = output(config)
    print(f"after the cut: {', '.join(f'{k} {v:.1f} s' for k, v in seen.items())}")
    assert code == 1, text[-5000:]
    address = re.escape(cluster.address)
    assert re.search(rf"engine\.address='{address}': the Ray cluster's head \({address}\) stopped answering: "
                     r"no connection from this trainer for \d+ s .*It is unreachable: a network partition",
                     text), text[-5000:]
    assert "Failed to connect to GCS" not in text, "Ray's end came first"
    assert seen.get("exit", 90) < 55, f"the trainer ended after the cut ({seen}): Ray's end comes at 60 s"
    assert "h0 clear" in seen, f"still running after the cut: {left}"
    assert "h1 clear" in seen, f"still running after the cut: {left}"
    assert seen["h0 clear"] < CUT_HOST_CLEAR_S, seen
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    newest = max(int(p.parent.name.split("-")[1]) for p in (job_dir / "checkpoints").glob("step-*/COMMIT"))
    assert summary["samples_kept"] == newest * BATCH * 2, (newest, summary)
