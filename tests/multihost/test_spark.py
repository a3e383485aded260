"""The ``spark`` engine on a Spark standalone cluster across hosts (`tests.multihost.netns` namespaces).

The cluster is started with PySpark's own launcher (`tests.multihost.spark_cluster`): a master in h0 and
one worker of one core per host, each bound to its host's address, each with its own work folder under
the test's ``tmp_path``. ``shardkit train`` is the driver,
run in h0: the engine must give Spark the driver's own address (the host name resolves to 127.0.0.1 in
every namespace, which no executor could reach), and every barrier task must bind its process's
collectives to its own host's address (gloo's ``connectFullMesh`` fails across hosts otherwise).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.torchrun_tools import BATCH, ROWS, effective_ids, write_ids_dataset
from tests.multihost import partition
from tests.multihost.netns import Host, Network
from tests.multihost.partition import CUT_HOST_CLEAR_S, when_seen, with_partition_bounds
from tests.multihost.spark_cluster import (
    PORT,
    QUICK_JVM,
    role_processes,
    start_cluster,
    start_daemon,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
IDS = REPO / "tests" / "cluster" / "torchrun_scripts" / "ids.py"

pytestmark = pytest.mark.spark  # -m 'not spark' deselects every test that starts Spark


def engine(master: str, **options: Any) -> dict[str, Any]:
    return {"name": "spark", "master": master, "grace": 2, "slots_timeout": 30,
            "conf": {"spark.executor.memory": "512m", "spark.driver.extraJavaOptions": QUICK_JVM,
                     "spark.executor.extraJavaOptions": QUICK_JVM}, **options}


def digits_job(folder: Path, data_url: str, master: str) -> Path:
    """``examples/digits.yaml`` (2 DDP workers) for 3 epochs on the cluster at ``master``."""
    config = yaml.safe_load((REPO / "examples" / "digits.yaml").read_text())
    config.update(entrypoint=str(REPO / "examples" / config["entrypoint"]), logdir=str(folder / "job"),
                  engine=engine(master))
    config["data"].update(url=data_url, num_epochs=3)
    config["checkpoint"] = {"every_steps": 30, "keep": 2}
    config["fault_tolerance"].update(max_restarts=0, startup_timeout=120.0)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def ids_job(folder: Path, data_url: str, master: str) -> Path:
    """``ids.py`` (each process logs the ids it trained per step) for 2 epochs, a checkpoint every 4 steps."""
    config = {
        "name": "sparkids", "entrypoint": str(IDS), "framework": "torch", "roles": {"worker": {"count": 2}},
        "data": {"url": data_url, "batch_size": BATCH, "seed": 3, "num_epochs": 2,
                 "options": {"shuffle_buffer": 24, "workers": 1}},
        "checkpoint": {"every_steps": 4, "keep": 3},
        "fault_tolerance": {"max_restarts": 2, "heartbeat_interval": 0.5, "heartbeat_timeout": 30.0,
                            "startup_timeout": 120.0},
        "engine": engine(master), "logdir": str(folder / "job"), "params": {"sleep": 0.2},
        "env": {"OMP_NUM_THREADS": "1"},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def ids_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids_dataset(tmp_path_factory.mktemp("data"))


def train(host: Host, config: Path, **env_vars: str) -> subprocess.Popen[bytes]:
    """``shardkit train config`` on ``host`` (the Spark driver), with none of this process's Spark
    settings (a local session of earlier tests sets ``SPARK_LOCAL_IP=127.0.0.1``) but ``env_vars``; its
    output to ``train.out`` beside it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDKIT_", "SPARK_", "PYSPARK_"))}
    env.update(env_vars)
    with open(config.parent / "train.out", "wb") as out:
        return host.popen([sys.executable, "-m", "shardkit.cli", "train", str(config)], env=env, cwd=REPO,
                          clean_env=True, stdout=out, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[bytes], config: Path, timeout: float) -> tuple[int, str]:
    """The exit code of `train`'s ``proc`` (-1: still running after ``timeout`` s) and its output."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = -1
    out = (config.parent / "train.out").read_text(errors="replace")
    return code, out


def check_bound_to_own_hosts(found: dict[int, tuple[Host, dict[str, str]]]) -> None:
    """Each process advertises its own host's address: rank 0's address as MASTER_ADDR, its own interface
    for gloo and NCCL, and the two ran on different hosts."""
    (h0, env0), (h1, env1) = found[0], found[1]
    assert h0 is not h1, "the barrier stage ran both tasks on one host"
    for host, env in (found[0], found[1]):
        assert env["MASTER_ADDR"] == h0.addr, env["MASTER_ADDR"]
        assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == (host.ifname, host.ifname)
    assert env0["WORLD_SIZE"] == env1["WORLD_SIZE"] == "2"


def test_digits_on_a_standalone_cluster_across_two_hosts(net2: Network, tmp_path: Path, digits: str) -> None:
    h0, h1 = net2.hosts
    url = start_cluster(h0, [h0, h1], tmp_path / "spark")
    config = digits_job(tmp_path, digits, url)
    driver = train(h0, config)
    found: dict[int, tuple[Host, dict[str, str]]] = {}

    def both() -> bool:
        found.update(role_processes(net2, tmp_path / "job", 0))
        return len(found) == 2 or driver.poll() is not None

    wait_for("both role processes", both, 120)
    code, out = finish(driver, config, 120)
    assert code == 0, out[-4000:]
    check_bound_to_own_hosts(found)
    records = {r["name"]: r for r in json.loads(
        (tmp_path / "job" / "logs" / "attempt-0" / "processes.json").read_text())}
    for index, (host, env) in found.items():
        record = records[f"worker-{index}"]
        assert record["host"] == host.addr
        for key in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
            assert record["env"][key] == env[key], record  # as the process got it, not the spec's loopback
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert (summary["status"], summary["restarts"], summary["steps"]) == ("succeeded", 0, 72), summary
    stats = json.loads(re.findall(r"TRAIN_STATS (\{.*\})", out)[-1])
    assert stats["world"] == 2
    assert stats["test_accuracy"] > 0.5  # chance is 0.1


def past_the_first_checkpoint(net: Network, job: Path, driver: subprocess.Popen[bytes], config: Path
                              ) -> dict[int, tuple[Host, dict[str, str]]]:
    """Wait until both role processes of attempt 0 run and the first checkpoint is committed; where each
    runs (its host and environment), by rank. The driver still runs then (its output if not)."""
    found: dict[int, tuple[Host, dict[str, str]]] = {}

    def checkpointed() -> bool:
        found.update(role_processes(net, job, 0))
        done = len(found) == 2 and any((job / "checkpoints").glob("step-*/COMMIT"))
        return done or driver.poll() is not None

    wait_for("the first checkpoint", checkpointed, 150)
    assert driver.poll() is None, finish(driver, config, 1)[1][-4000:]
    return found


@pytest.mark.timeout(240)
def test_a_lost_worker_host_restarts_the_stage_from_the_checkpoint_on_what_remains(
        net3: Network, tmp_path: Path, ids_dataset: str) -> None:
    h0 = net3.hosts[0]
    url = start_cluster(h0, net3.hosts, tmp_path / "spark")  # three one-core workers for two processes
    config = ids_job(tmp_path, ids_dataset, url)
    job = tmp_path / "job"
    driver = train(h0, config)
    found = past_the_first_checkpoint(net3, job, driver, config)
    check_bound_to_own_hosts(found)
    # a worker host loses power: its Spark worker, executor, Python workers and role process, all at once
    lost = next(host for host, _ in (found[1], found[0]) if host is not h0)  # not the master's and driver's
    lost.kill_all()
    restarted: dict[int, tuple[Host, dict[str, str]]] = {}

    def again() -> bool:
        restarted.update(role_processes(net3, job, 1))
        return len(restarted) == 2 or driver.poll() is not None

    wait_for("the restarted stage's processes", again, 120)
    code, out = finish(driver, config, 150)
    assert code == 0, out[-4000:]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "succeeded", summary
    assert summary["restarts"] >= 1, summary
    ids, attempts = effective_ids(job)
    assert ids == Counter(dict.fromkeys(range(ROWS), 2)), "every sample of both epochs exactly once"
    starts = {attempt: (world, start) for attempt, world, start in attempts}
    assert starts[0] == (2, 0)
    assert starts[1][0] == 2
    assert starts[1][1] >= 4, "the restarted stage resumed from a checkpoint"
    assert re.search("Spark task ended without reporting|Spark job of this attempt ended", out), out[-4000:]
    check_bound_to_own_hosts(restarted)  # on the two hosts that remain
    assert lost.name not in {host.name for host, _ in restarted.values()}


@pytest.mark.full  # SHARDKIT_FULL=1 (tests/conftest.py): a minute or more each
@pytest.mark.timeout(180)
def test_too_few_workers_left_for_the_barrier_stage_is_an_error_naming_the_slots(
        net2: Network, tmp_path: Path, ids_dataset: str) -> None:
    h0, h1 = net2.hosts
    url = start_cluster(h0, [h0, h1], tmp_path / "spark")
    config = ids_job(tmp_path, ids_dataset, url)
    settings = yaml.safe_load(config.read_text())
    settings["engine"]["slots_timeout"] = 6
    settings["fault_tolerance"]["max_restarts"] = 1
    config.write_text(yaml.safe_dump(settings))
    job = tmp_path / "job"
    driver = train(h0, config)
    wait_for("the first checkpoint", lambda: any((job / "checkpoints").glob("step-*/COMMIT"))
             or driver.poll() is not None, 150)
    h1.kill_all()  # one one-core worker remains for a stage of two tasks
    code, out = finish(driver, config, 120)
    assert code == 1, out[-4000:]
    assert f"the cluster ({url}) did not have the 2 task slots" in out, out[-4000:]
    assert "within 6 s (engine.slots_timeout): too few workers remain" in out
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["status"], summary["restarts"]) == ("failed", 1), summary


@pytest.mark.timeout(90)
def test_a_master_that_does_not_answer_is_an_error_naming_it_within_seconds(net2: Network,
                                                                              tmp_path: Path) -> None:
    h0, h1 = net2.hosts
    h1.cut()  # silence: connecting would wait for ever without a timeout
    for name, master in (("cut", f"spark://{h1.addr}:{PORT}"), ("refused", f"spark://{h0.addr}:{PORT}")):
        folder = tmp_path / name
        folder.mkdir()
        config = ids_job(folder, str(folder / "no-data"), master)
        started = time.monotonic()
        code, out = finish(train(h0, config), config, 60)
        took = time.monotonic() - started
        assert code == 2, out[-3000:]
        assert f"engine.master={master!r}: no Spark master answers there" in out, out[-3000:]
        assert "engine.connect_timeout" in out
        assert took < 45, f"{took:.0f} s"  # the 5 s connect timeout, and the CLI's start, with slack
    cut = (tmp_path / "cut" / "train.out").read_text()
    assert re.search(r"timed out|No route to host", cut), cut  # silence, or ARP gave up first
    assert "Connection refused" in (tmp_path / "refused" / "train.out").read_text()


@pytest.mark.timeout(120)
def test_a_driver_told_to_listen_on_loopback_for_a_remote_master_is_refused_naming_it(
        net2: Network, tmp_path: Path) -> None:
    """SPARK_LOCAL_IP=127.0.0.1 (common in a laptop's shell profile) with a master on another host: the
    executors could never connect back, and the stage would wait slots_timeout for them."""
    h0, h1 = net2.hosts
    log = start_daemon(h1, "Master", tmp_path / "spark", "--port", str(PORT), "--webui-port", "0")
    wait_for("the Spark master", lambda: "I have been elected leader" in log.read_text(errors="replace"), 90)
    config = ids_job(tmp_path, str(tmp_path / "no-data"), f"spark://{h1.addr}:{PORT}")
    started = time.monotonic()
    code, out = finish(train(h0, config, SPARK_LOCAL_IP="127.0.0.1"), config, 90)
    assert code == 2, out[-3000:]
    assert "the environment's SPARK_LOCAL_IP = '127.0.0.1' puts the driver on loopback" in out, out[-3000:]
    assert f"uses {h0.addr}" in out
    assert time.monotonic() - started < 60


def job_processes(host: Host, job_dir: Path) -> list[str]:
    """What of the job runs on ``host``: its role processes, the application's executor and its Python
    workers (the Spark worker daemon is the cluster's)."""
    return partition.job_processes(host, job_dir, ("CoarseGrainedExecutorBackend", "pyspark.daemon",
                                                   "pyspark.worker"))


@pytest.mark.full  # SHARDKIT_FULL=1 (tests/conftest.py): a minute or more each
@pytest.mark.timeout(300)
def test_a_partitioned_worker_host_is_given_up_its_processes_end_and_the_stage_resumes_on_the_others(
        net3: Network, tmp_path: Path, ids_dataset: str) -> None:
    """A worker host cut off mid-job (silence, no reset): the supervisor notices the silence, gives up the
    unreachable task naming its host, and runs the stage again on the two hosts left from the checkpoint;
    on the cut host the task ends the role process, and the executor (its Python workers with it) gives up
    on the driver."""
    h0 = net3.hosts[0]
    url = start_cluster(h0, net3.hosts, tmp_path / "spark")  # three one-core workers for two processes
    config = with_partition_bounds(ids_job(tmp_path, ids_dataset, url))
    job = tmp_path / "job"
    driver = train(h0, config)
    found = past_the_first_checkpoint(net3, job, driver, config)
    cut = next(host for host, _ in (found[1], found[0]) if host is not h0)  # not the master's and driver's
    assert job_processes(cut, job)
    cut.cut()
    cut_at = time.monotonic()
    out = config.parent / "train.out"
    events = {"notice": lambda: "attempt 0 failed" in out.read_text(errors="replace"),
              "resume": lambda: len(role_processes(net3, job, 1)) == 2 and any(
                  len(p.read_text().splitlines()) > 1 for p in (job / "ids").glob("attempt1-*.jsonl")),
              "cut host clear": lambda: not job_processes(cut, job)}
    seen = when_seen(events, cut_at, driver, 200)
    left = job_processes(cut, job)
    code, text = finish(driver, config, 150)
    print(f"after the cut: {', '.join(f'{k} {v:.1f} s' for k, v in seen.items())}")
    assert code == 0, text[-4000:]
    assert "cut host clear" in seen, f"on {cut.name} {time.monotonic() - cut_at:.0f} s after the cut: {left}"
    assert seen["cut host clear"] < CUT_HOST_CLEAR_S, seen
    assert f"its Spark task on {cut.addr} did not answer the request to stop it" in text, text[-4000:]
    assert "network partition" in text
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["status"], summary["restarts"]) == ("succeeded", 1), summary
    ids, attempts = effective_ids(job)
    assert ids == Counter(dict.fromkeys(range(ROWS), 2)), "every sample of both epochs exactly once"
    *_, (_, world, start) = attempts
    assert (world, start >= 4) == (2, True), attempts


@pytest.mark.full  # SHARDKIT_FULL=1 (tests/conftest.py): a minute or more each
@pytest.mark.timeout(240)
def test_a_master_cut_off_mid_job_leaves_the_application_running_to_its_end(
        net3: Network, tmp_path: Path, ids_dataset: str) -> None:
    """The standalone master alone on h0, a one-core worker on h1 and on h2, ``shardkit train`` (the driver)
    on h1; h0 cut off after the first checkpoint. A standalone application does not need its master once
    its executors run (they talk to the driver): the stage goes on, the job ends as usual with every sample
    trained once, and what it started (driver, executors, their Python workers, role processes) ends with
    it, though the master never hears that the application ended."""
    h0, h1, h2 = net3.hosts
    url = start_cluster(h0, [h1, h2], tmp_path / "spark")
    config = with_partition_bounds(ids_job(tmp_path, ids_dataset, url))
    settings = yaml.safe_load(config.read_text())
    # 40 steps: ~20 s of training after the cut, twice the job's own partition bounds (PARTITION: 8 s of
    # silence stops a group, 10 s without the trainer ends a node's processes)
    settings["params"]["sleep"] = 0.55
    config.write_text(yaml.safe_dump(settings))
    job = tmp_path / "job"
    driver = train(h1, config)
    found = past_the_first_checkpoint(net3, job, driver, config)
    assert {host.name for host, _ in found.values()} == {"h1", "h2"}, found
    h0.cut()
    cut_at = time.monotonic()
    code, out = finish(driver, config, 150)
    ended = time.monotonic() - cut_at

    def left() -> list[str]:
        return [f"{host.name}: {p}" for host in (h1, h2) for p in partition.job_processes(
            host, job, ("SparkSubmit", "CoarseGrainedExecutorBackend", "pyspark.daemon", "pyspark.worker"))]

    remaining = left()
    while remaining and time.monotonic() - cut_at - ended < 90:
        time.sleep(0.5)
        remaining = left()
    clear = time.monotonic() - cut_at - ended
    print(f"after the cut: job ended {ended:.1f} s (exit {code}), its processes clear {clear:.1f} s later")
    assert code == 0, out[-4000:]
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["status"], summary["restarts"]) == ("succeeded", 0), summary
    ids, _ = effective_ids(job)
    assert ids == Counter(dict.fromkeys(range(ROWS), 2)), "every sample of both epochs exactly once"
    assert not remaining, f"{clear:.0f} s after the job's end: {remaining}"
    assert clear < CUT_HOST_CLEAR_S, f"{clear:.0f} s"
