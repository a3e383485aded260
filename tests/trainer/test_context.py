"""`shardkit.trainer.init` and `TrainContext`: by hand, inside a job (real UDP heartbeats), checkpoints."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import shardkit
from shardkit.cluster.monitor.heartbeats import HeartbeatReceiver
from shardkit.errors import ConfigError
from shardkit.job import protocol as p
from shardkit.job.config import load_config
from shardkit.trainer import TrainContext, init
from shardkit.trainer._heartbeat import Beacon
from tests.trainer.helpers import Counter

REPO = Path(__file__).resolve().parents[2]
_JOB_ENV = [*p.ALL_ENV, "SHARDKIT_CONFIG", "TORCHELASTIC_RESTART_COUNT"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _JOB_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    url = str(tmp_path / "ds")
    shardkit.write_dataset({"id": np.arange(40), "split": ["train"] * 30 + ["test"] * 10}, url,
                           row_group_size=10)
    return url


def write_yaml(folder: Path, framework: str = "tensorflow", **extra: Any) -> Path:
    config = {"name": "ctx", "entrypoint": str(REPO / "tests" / "trainer" / "scripts" / "behave.py"),
              "framework": framework, "roles": {"worker": {"count": 2}}, "logdir": str(folder / "job"),
              "params": {"lr": 0.5}, **extra}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_defaults_outside_a_job() -> None:
    ctx = init()
    assert (ctx.role, ctx.role_index, ctx.rank, ctx.world_size, ctx.attempt) == ("worker", 0, 0, 1, 0)
    assert ctx.is_chief
    assert ctx.config is None
    assert dict(ctx.params) == {}
    assert not ctx._beacon.enabled
    assert ctx.checkpoint.restore(reader=Counter()) == 0
    assert ctx.checkpoint.url is None
    assert [ctx.step({"loss": 1.0}) for _ in range(3)] == [1, 2, 3]
    ctx.step(samples=4)
    ctx.step(samples={"x": np.zeros(5), "__valid__": np.array([True, True, False, True, False])})  # masked
    ctx.step(samples={"x": np.zeros(6)})  # no mask: every row
    assert ctx.samples == 4 + 3 + 6
    with pytest.raises(ConfigError, match="no data section"):
        ctx.reader()
    ctx.finish()


def test_by_hand_with_a_config_reads_the_ranks_shard(tmp_path: Path, dataset: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = write_yaml(tmp_path, data={"url": dataset, "batch_size": 5, "seed": 7,
                                      "options": {"filter": [["split", "=", "train"]]}})
    with init(config=path) as ctx:
        assert (ctx.rank, ctx.world_size, ctx.data_shard, ctx.num_data_shards) == (1, 2, 1, 2)
        assert not ctx.is_chief
        assert ctx.params["lr"] == 0.5
        reader = ctx.reader()
        assert (reader.shard, reader.num_shards, reader.batch_size, reader.seed) == (1, 2, 5, 7)
        ids = np.concatenate([b["id"] for b in reader])
        assert len(ids) == 15
        assert ids.max() < 30
        whole = ctx.reader(shard=0, num_shards=1, filter=None, shuffle=False, batch_size=40)
        assert next(iter(whole))["id"].tolist() == list(range(40))


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "1"}, r"RANK=1 and WORLD_SIZE unset \(1 process\) do not fit: a rank is >= 0 and < WORLD_SIZE; "
                    r"set both as torchrun"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK=-1 and WORLD_SIZE=2 do not fit"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 and WORLD_SIZE=2 do not fit"),
    ({"WORLD_SIZE": "0"}, r"WORLD_SIZE=0 is not a number of processes \(>= 1\)"),
    ({p.ENV_DATA_SHARD: "2", p.ENV_DATA_NUM_SHARDS: "2"},
     r"SHARDKIT_DATA_SHARD=2 and SHARDKIT_DATA_NUM_SHARDS=2 do not fit: a shard is >= 0 and <"),
    ({p.ENV_DATA_SHARD: "1"}, r"SHARDKIT_DATA_SHARD=1 and SHARDKIT_DATA_NUM_SHARDS=unset do not fit"),
])
def test_a_rank_or_shard_outside_its_job_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      env: dict[str, str], message: str) -> None:
    """Such a process would run as the only one of its group yet not as the chief: no checkpoint, ever."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        init(config=write_yaml(tmp_path, framework="torch"))


def test_rank_zero_alone_is_the_chief(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")  # torchrun's variables without WORLD_SIZE: one process
    ctx = init()
    assert (ctx.rank, ctx.world_size, ctx.is_chief) == (0, 1, True)
    ctx.finish()


def test_config_from_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_CONFIG", str(write_yaml(tmp_path)))
    with init() as ctx:
        assert ctx.config is not None
        assert ctx.config.name == "ctx"
        assert ctx.checkpoint.url == str(tmp_path / "job" / "checkpoints")


def _in_job(monkeypatch: pytest.MonkeyPatch, folder: Path, addr: str, role: str = "worker", index: int = 0,
            **config: Any) -> Path:
    cfg = load_config(write_yaml(folder, **config))
    job = folder / "job"
    job.mkdir(parents=True, exist_ok=True)
    (job / "job.json").write_text(json.dumps(cfg.redacted()))
    env = {p.ENV_JOB_CONFIG: str(job / "job.json"), p.ENV_JOB_DIR: str(job), p.ENV_ROLE: role,
           p.ENV_ROLE_INDEX: str(index), p.ENV_ATTEMPT: "2", p.ENV_HEARTBEAT_ADDR: addr,
           p.ENV_DATA_SHARD: str(index), p.ENV_DATA_NUM_SHARDS: "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return job


def _beats(receiver: HeartbeatReceiver, until: str, timeout: float = 5.0) -> list[p.Heartbeat]:
    beats: list[p.Heartbeat] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(b.kind == until for b in beats):
        beats += receiver.receive(0.05)
    return beats


def test_in_a_job_heartbeats_and_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    with HeartbeatReceiver() as receiver:
        _in_job(monkeypatch, tmp_path, receiver.addr, checkpoint={"every_steps": 4, "keep": 5},
                fault_tolerance={"heartbeat_interval": 30.0, "heartbeat_timeout": 60.0})
        (tmp_path / "other").mkdir()
        ctx = init(config=write_yaml(tmp_path / "other", framework="torch"))  # ignored: the job's wins
        assert ctx.framework == "tensorflow"
        assert ctx.attempt == 2
        assert ctx.is_chief
        counter = Counter()
        assert ctx.checkpoint.restore(reader=counter) == 0
        for _ in range(6):
            counter.value += 1
            ctx.step({"loss": torch.tensor(0.25), "acc": np.float32(0.5), "text": "not a number"}, samples=3)
        ctx.finish()
        beats = _beats(receiver, "done")
    kinds = [(b.kind, b.step) for b in beats]
    # heartbeats: start; after the restore, which checkpoint it restored (none); the first step (then
    # rate-limited to 30 s); around the save of step 4: a step beat first (a save may be slow), then the
    # checkpoint; at finish the last step's save, then done
    assert kinds == [("start", 0), ("alive", 0), ("step", 1), ("step", 4), ("checkpoint", 4),
                     ("checkpoint", 6), ("done", 6)]
    assert beats[1].checkpoint == ""  # restored none
    assert all((b.role, b.index, b.attempt, b.pid) == ("worker", 0, 2, os.getpid()) for b in beats)
    assert beats[-1].samples == 18
    assert beats[-1].metrics == {"loss": 0.25, "acc": 0.5}
    assert beats[4].checkpoint is not None
    assert beats[4].checkpoint.endswith("step-000000004")
    again = init()
    restored = Counter()
    assert again.checkpoint.restore(reader=restored) == 6
    assert restored.value == 6
    assert again.step_count == 6
    assert again.step() == 7
    again.finish(save=False)


@pytest.mark.parametrize("where", ["loop", "final save", "before a step"])
def test_a_failing_process_reports_the_steps_and_samples_it_trained(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Step heartbeats are rate-limited (here to one a minute): the last one said step 1. On its way out
    of ``with ctx``, whether the loop or ``finish``'s save raised, the process sends the count it
    trained, so the supervisor does not under-count a crashed attempt; and no "done". A process that
    fails before its first step sends nothing (it would look like a first step)."""
    with HeartbeatReceiver() as receiver:
        _in_job(monkeypatch, tmp_path, receiver.addr, checkpoint={"every_steps": 100},
                fault_tolerance={"heartbeat_interval": 60.0, "heartbeat_timeout": 120.0})
        ctx = init()
        counter = Counter()
        ctx.checkpoint.restore(reader=counter)
        if where == "final save":
            def refuse(step: int | None = None) -> str | None:
                raise OSError("disk full")

            monkeypatch.setattr(ctx.checkpoint, "save", refuse)

        def train() -> None:
            with ctx:
                if where == "before a step":
                    raise RuntimeError("the model does not fit")
                for _ in range(7):
                    ctx.step({"loss": 0.5}, samples=3)
                if where == "loop":
                    raise RuntimeError("a worker fails after 7 steps")

        with pytest.raises((RuntimeError, OSError)):
            train()
        ctx._beacon.close()  # a failed finish leaves it open, as before: the process is ending
        beats = [b for b in receiver.receive(1.0) if b.kind != "start"]  # all sent already
    # after the restore: which checkpoint it restored (none), then the steps
    expected = [("alive", 0, 0)] + ([] if where == "before a step" else [("step", 1, 3), ("step", 7, 21)])
    assert [(b.kind, b.step, b.samples) for b in beats] == expected


@pytest.mark.parametrize("alone", [True, False])
def test_a_failing_process_commits_its_last_save_only_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            alone: bool) -> None:
    """``ctx.step``'s save of step 4 is committed when the script is done with step 4. An error out of
    ``with ctx`` after it: a process alone commits it (the error came after ``ctx.step``); one of several
    leaves it uncommitted, as another may still be in step 4 (the job resumes from step 2)."""
    with HeartbeatReceiver() as receiver:
        if alone:
            ctx = init(config=write_yaml(tmp_path, checkpoint={"every_steps": 2}))
        else:
            _in_job(monkeypatch, tmp_path, receiver.addr, checkpoint={"every_steps": 2})
            ctx = init()
        counter = Counter()
        ctx.checkpoint.restore(reader=counter)

        def train() -> None:
            with ctx:
                for _ in range(4):
                    counter.value += 1
                    ctx.step()
                raise RuntimeError("step 5 fails")

        with pytest.raises(RuntimeError):
            train()
    manager = ctx.checkpoint.manager
    assert manager is not None
    assert [c.step for c in manager.list()] == ([2, 4] if alone else [2])


@pytest.mark.parametrize("num_epochs", [1, 2])
def test_a_job_restarted_from_its_final_checkpoint_reads_nothing_more(
        tmp_path: Path, dataset: str, monkeypatch: pytest.MonkeyPatch, num_epochs: int) -> None:
    """The final checkpoint (``ctx.finish``, after ``for batch in loader`` ended) resumes the rest of the
    job, which is nothing: a loader state saved after its pass ended would start a new pass (what an
    epoch loop of its own wants), so the trainer saves it as inside the pass."""
    pytest.importorskip("torch")
    with HeartbeatReceiver() as receiver:
        _in_job(monkeypatch, tmp_path, receiver.addr, checkpoint={"every_steps": 1000},
                data={"url": dataset, "batch_size": 4, "seed": 3, "num_epochs": num_epochs})
        ctx = init()
        loader = ctx.torch_loader(columns=["id"])
        assert ctx.checkpoint.restore(reader=loader) == 0
        with ctx:
            ids = [int(i) for batch in loader for i in batch["id"] for _ in [ctx.step()]]
        assert len(ids) == 20 * num_epochs  # shard 0 of 2, every epoch
        again = init()
        loader = again.torch_loader(columns=["id"])
        assert again.checkpoint.restore(reader=loader) == again.step_count > 0
        with again:
            assert list(loader) == []  # the job is over: nothing more to train
        resumed_state = loader.state_dict()
    assert resumed_state["epoch"] == num_epochs


def test_only_the_chief_writes_and_failures_send_no_done(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with HeartbeatReceiver() as receiver:
        _in_job(monkeypatch, tmp_path, receiver.addr, index=1, checkpoint={"every_steps": 2})
        ctx = init()
        assert not ctx.is_chief
        assert ctx.data_shard == 1
        ctx.checkpoint.restore(reader=Counter())
        def fail() -> None:
            with ctx:
                ctx.step()
                ctx.step()
                raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            fail()
        beats = _beats(receiver, "done", timeout=1.0)
    # no checkpoint beat, no done; the last step beat is the count it trained, sent on its way out
    assert [(b.kind, b.step) for b in beats] == [("start", 0), ("alive", 0), ("step", 1), ("step", 2),
                                                 ("step", 2)]
    assert not (tmp_path / "job" / "checkpoints").exists()


def test_every_seconds_in_tensorflow_allreduce_needs_the_strategy_to_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two workers must save at the same step; their clocks disagree, so the chief's answer goes to the
    others through the job's strategy. Without one, the first step says how to give it (nothing saved).
    The agreement itself runs in a real two-worker job: tests/trainer/test_strategies.py."""
    with HeartbeatReceiver() as receiver:
        job = _in_job(monkeypatch, tmp_path, receiver.addr, checkpoint={"every_seconds": 5})
        ctx = init()
        assert ctx.checkpoint.manager is not None
        assert ctx.checkpoint.manager.schedule.every_seconds == 5
        ctx.checkpoint.track(reader=Counter())
        with pytest.raises(ConfigError,
                           match=r"shardkit\.trainer\.strategies\.tf\.strategy\(ctx\).*share_decisions"):
            ctx.step()
        ctx.finish(save=False)
    assert not (job / "checkpoints").exists()


def test_beacon_never_raises() -> None:
    for addr in (None, "", "nonsense", "127.0.0.1:1"):
        beacon = Beacon(addr, role="worker", index=0, attempt=0)
        beacon.send("step", step=1, metrics={"loss": float("nan")})
        beacon.close()
        beacon.send("step")  # after close: still nothing raised
    with HeartbeatReceiver() as receiver:
        beacon = Beacon(receiver.addr, role="worker", index=0, attempt=0)
        beacon.send("step", step=2, metrics={f"metric_{i}_{'x' * 40}": i for i in range(2000)})  # too big
        beats = _beats(receiver, "step")
        beacon.close()
    assert [(b.step, b.metrics) for b in beats] == [(2, {})]  # sent without its metrics


@pytest.mark.timeout(120)
def test_torch_allreduce_alone_gets_a_one_process_group(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    ctx = init(config=write_yaml(tmp_path, framework="torch"))
    try:
        assert dist.is_initialized()
        assert dist.get_world_size() == 1
        assert ctx.device == torch.device("cpu")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        model(torch.ones(3, 2)).sum().backward()
        # DDP's reducer holds the gloo group: released before the group is destroyed, as torch's own
        # tests do (once, freed after finish, its ~ProcessGroupGloo hung joining its threads)
        del model
        gc.collect()
    finally:
        ctx.finish()
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_module_function_entrypoint(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in _JOB_ENV}
    env.update({"ENTRY_OUT": str(out), "SHARDKIT_CONFIG": str(write_yaml(tmp_path))})
    proc = subprocess.run([sys.executable, "-m", "shardkit.trainer.run", "tests.trainer.scripts.entry:main"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == {"role": "worker", "rank": 0, "world": 1, "params": {"lr": 0.5}}
    proc = subprocess.run([sys.executable, "-m", "shardkit.trainer.run", "tests.trainer.scripts.entry:nope"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode != 0
    assert "has no function 'nope'" in proc.stderr


def test_context_repr() -> None:
    ctx = TrainContext(config=None, role="worker", role_index=3, attempt=1, rank=3, world_size=4,
                       local_rank=1, data_shard=3, num_data_shards=4, heartbeat_addr=None)
    assert repr(ctx) == "TrainContext(role='worker', index=3, rank=3/4, attempt=1, step=0)"



@pytest.mark.tf
@pytest.mark.timeout(120)
def test_adapters_read_this_processs_shard(tmp_path: Path, dataset: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    pytest.importorskip("tensorflow")
    pytest.importorskip("torch")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with init(config=write_yaml(tmp_path, data={"url": dataset, "batch_size": 4, "shuffle": False})) as ctx:
        ids = [int(i) for batch in ctx.tf_dataset(columns=["id"]) for i in batch["id"].numpy()]
        assert ids == list(range(20, 40))  # shard 1 of 2, in order
        loader = ctx.torch_loader(columns=["id"], pin_memory=False)
        assert [int(i) for batch in loader for i in batch["id"]] == list(range(20, 40))
