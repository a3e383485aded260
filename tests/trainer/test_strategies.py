"""The strategies besides torch allreduce, end to end through `shardkit train` (the local engine) with the
example scripts: TensorFlow allreduce, TensorFlow parameter server and torch parameter server; plus the
torch parameter server's pieces (placement, optimizer specs, shard state) in process.

The jobs run ``tests/trainer/strategy_scripts/inject.py``, which runs an example script unchanged while
recording each step's loss and crashing the chief at a given step (fault injection), on the digits
dataset written by ``examples/make_digits.py`` (1,797 rows; 3 epochs keep each job to seconds).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.cluster import run_job
from shardkit.cluster.monitor.report import JobResult
from shardkit.errors import ConfigError
from shardkit.job.config import load_config
from shardkit.trainer.strategies import torch_ps
from shardkit.trainer.strategies.torch_ps import _optimizer as ps_optimizer
from shardkit.trainer.strategies.torch_ps import _server as torch_ps_server
from tests.trainer.scripts import proctree

REPO = Path(__file__).resolve().parents[2]
INJECT = REPO / "tests" / "trainer" / "strategy_scripts" / "inject.py"
SLOW_WORKER = REPO / "tests" / "trainer" / "strategy_scripts" / "slow_worker_ps.py"
EXAMPLES = REPO / "examples"
TRAIN_ROWS = 1500  # make_digits: the last 297 of the 1,797 rows are the test split
EPOCHS = 3
pytestmark = [pytest.mark.distributed]


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


def run_example(folder: Path, example: str, data_url: str, *, fail_at_step: int = 0,
                every_steps: int | None = 1000, every_seconds: float | None = None,
                roles: dict[str, int] | None = None) -> tuple[JobResult, str, Path]:
    """Run ``examples/<example>.yaml`` with its script wrapped by inject.py, on ``data_url``, for EPOCHS
    (``roles``: other process counts)."""
    config = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    for role, count in (roles or {}).items():
        config["roles"][role]["count"] = count
    script = str(EXAMPLES / config["entrypoint"])
    config.update(entrypoint=str(INJECT), logdir=str(folder / "job"))
    config["data"].update(url=data_url, num_epochs=EPOCHS)
    config["checkpoint"] = {"every_steps": every_steps, "every_seconds": every_seconds, "keep": 2}
    config["fault_tolerance"].update(max_restarts=1, heartbeat_timeout=30.0, startup_timeout=90.0)
    config["params"]["test"] = {"script": script, "fail_at_step": fail_at_step}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    console = io.StringIO()
    result = run_job(load_config(path), console=console)
    return result, console.getvalue(), folder / "job"


def records(job_dir: Path, role: str, index: int = 0) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (job_dir / f"record-{role}-{index}.jsonl").read_text().splitlines()]


def losses(recs: list[dict[str, Any]]) -> list[float]:
    return [r["loss"] for r in recs if r.get("loss") is not None]


def assert_loss_falls(values: list[float], first: float | None = None) -> None:
    """The model starts untrained (``first``: by default the mean of the first 5 losses) and the mean of
    the last 5 losses is under half of it."""
    assert len(values) >= 20, values
    first = float(np.mean(values[:5])) if first is None else first
    last = float(np.mean(values[-5:]))
    assert first > 1.5, f"an untrained 10-class model starts near ln(10)=2.3, got {first}"
    assert last < 0.5 * first, f"loss did not fall: first steps {first:.3f}, last steps {last:.3f}"


def batches_per_epoch(data_url: str, batch_size: int, shard: int, num_shards: int) -> int:
    with shardkit.make_reader(data_url, shard=shard, num_shards=num_shards, batch_size=batch_size,
                              filter=[("split", "=", "train")], columns=["id"]) as reader:
        return len(reader)


def test_examples_point_at_their_scripts() -> None:
    for example in ("digits_tf", "digits_tf_ps", "digits_torch_ps"):
        config = load_config(EXAMPLES / f"{example}.yaml")
        assert Path(config.entrypoint).name == f"train_{example}.py"
    assert load_config(EXAMPLES / "digits_tf_ps.yaml").roles["ps"].count == 1


# ---------------------------------------------------------------------------------------------- TensorFlow


@pytest.mark.tf
@pytest.mark.timeout(150)
def test_tf_allreduce_job_trains_on_both_workers(digits: str, tmp_path: Path) -> None:
    result, console, job = run_example(tmp_path, "digits_tf", digits)
    assert result.ok, console
    assert result.restarts == 0
    steps = EPOCHS * batches_per_epoch(digits, 32, 0, 2)
    worker0, worker1 = records(job, "worker", 0), records(job, "worker", 1)
    assert [r["step"] for r in worker0 if "step" in r] == list(range(1, steps + 1))
    # MultiWorkerMirrored: the reported loss is the global batch's, so both workers see the same numbers.
    np.testing.assert_allclose(losses(worker0), losses(worker1), rtol=1e-5)
    assert_loss_falls(losses(worker0))
    assert "test accuracy:" in console
    assert [c.step for c in result.checkpoints][-1:] == [steps]


@pytest.mark.tf
@pytest.mark.timeout(150)
def test_tf_allreduce_every_seconds_saves_at_the_same_step_on_both_workers(digits: str,
                                                                           tmp_path: Path) -> None:
    """``checkpoint.every_seconds`` with two MultiWorkerMirrored workers: the chief's clock decides and an
    all-reduce tells the other worker every few steps, so both take part in the same saves (a save one
    worker skipped would leave the other waiting in its collectives). The chief crashes in step 40, after
    its ``ctx.step``; the job resumes at the last save before it (a save made in step 40's ``ctx.step``
    is committed only when step 41 is counted, so the crash leaves it uncommitted: the rest of step 40
    never ran)."""
    result, console, job = run_example(tmp_path, "digits_tf", digits, fail_at_step=40, every_steps=None,
                                       every_seconds=0.3)
    assert result.ok, console
    assert result.restarts == 1
    steps = EPOCHS * batches_per_epoch(digits, 32, 0, 2)
    worker0, worker1 = records(job, "worker", 0), records(job, "worker", 1)
    saves0 = [(r["attempt"], r["save"]) for r in worker0 if "save" in r]
    assert saves0 == [(r["attempt"], r["save"]) for r in worker1 if "save" in r]
    first = [s for a, s in saves0 if a == 0 and s < 40]
    assert first, f"no save in 39 steps at every_seconds=0.3: {saves0}"
    assert [r["start"] for r in worker0 if "start" in r] == [0, first[-1]]
    assert saves0[-1] == (1, steps)  # and the final one
    assert [r["step"] for r in worker0 if r["attempt"] == 1 and "step" in r] == list(range(first[-1] + 1,
                                                                                        steps + 1))


@pytest.mark.tf
@pytest.mark.timeout(170)
def test_tf_parameter_server_job_trains_and_resumes_from_its_checkpoint(digits: str, tmp_path: Path) -> None:
    """The chief crashes at step 60 (checkpoints every 25): the job restarts and the chief resumes at 50,
    with the variables on the new ps restored, and trains to the end."""
    result, console, job = run_example(tmp_path, "digits_tf_ps", digits, fail_at_step=60, every_steps=25)
    assert result.ok, console
    assert result.restarts == 1
    steps = EPOCHS * batches_per_epoch(digits, 64, 0, 1)
    chief = records(job, "chief")
    assert [r["start"] for r in chief if "start" in r] == [0, 50]
    # Before each save the chief waited for every scheduled step: all of them were applied, no fewer.
    saves = [(r["attempt"], r["save"], r["applied"]) for r in chief if "save" in r]
    after = [*range(75, steps + 1, 25), *([steps] if steps % 25 else [])]  # every 25, and the final one
    assert [(a, s) for a, s, _ in saves] == [(0, 25), (0, 50), *((1, s) for s in after)]
    assert all(applied == step - (0, 50)[attempt] for attempt, step, applied in saves), saves
    attempt1 = [r for r in chief if r["attempt"] == 1 and "step" in r]
    assert [r["step"] for r in attempt1] == list(range(51, steps + 1))
    assert result.steps == steps
    # Restored weights: the loss right after the restart is that of a trained model, not ln(10).
    resumed = losses(attempt1)
    assert resumed
    assert np.mean(resumed[:5]) < 1.0, resumed[:5]
    assert_loss_falls(losses([r for r in chief if r["attempt"] == 0]) + resumed)
    assert "test accuracy:" in console


# ------------------------------------------------------------------------------------- torch parameter server


@pytest.mark.timeout(150)
def test_torch_parameter_server_job_trains_and_restores_the_ps_state(digits: str, tmp_path: Path) -> None:
    """Two ps share the parameters. Worker 0 crashes at step 30 (checkpoints every 20): on the restart it
    puts the saved ps state (weights and Adam moments) back on fresh ps processes, which return it bit for
    bit, and training goes on."""
    result, console, job = run_example(tmp_path, "digits_torch_ps", digits, fail_at_step=30, every_steps=20,
                                       roles={"ps": 2})
    assert result.ok, console
    assert result.restarts == 1
    worker0 = records(job, "worker", 0)
    assert [r["start"] for r in worker0 if "start" in r] == [0, 20]
    [check] = [r for r in worker0 if "roundtrip" in r]
    assert check["attempt"] == 1
    assert check["roundtrip"], check
    assert check["updates"] == check["saved_updates"] >= 20  # both workers' pushes up to the save
    steps = EPOCHS * batches_per_epoch(digits, 32, 0, 2)
    assert result.steps == steps
    # Updates are asynchronous: one worker's early steps may come after many of the other's (worker 0's
    # second loss was 0.83 in 2 of 8 runs here, worker 1 having trained meanwhile). No push precedes the
    # first pull, so the worker that pulled first saw the untrained weights: the larger step-1 loss is
    # an untrained model's.
    worker1 = records(job, "worker", 1)
    untrained = max(next(r["loss"] for r in w if r.get("step") == 1) for w in (worker0, worker1))
    assert_loss_falls(losses(worker0) + losses(worker1), first=untrained)
    # The checkpoint holds the ps state as plain tensors by parameter name, loadable with weights_only.
    state = torch.load(Path(result.checkpoints[-1].url) / "optimizer.pt", weights_only=True)
    assert state["version"] == 1
    example = yaml.safe_load((EXAMPLES / "digits_torch_ps.yaml").read_text())
    assert state["spec"] == example["params"]["optimizer"]
    assert set(state["params"]) == {"1.weight", "1.bias", "3.weight", "3.bias"} == set(state["state"])
    assert set(state["state"]["1.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    # Both ps served their part: the merged state holds every parameter (1.weight alone is on ps 0).
    assert torch_ps.assign([(k, v.numel()) for k, v in state["params"].items()], 2) == {
        "1.weight": 0, "3.weight": 1, "1.bias": 1, "3.bias": 1}


def write_ps_job(folder: Path, *, slow: float, every_steps: int) -> Path:
    """A torch ps job of 1 ps and 2 workers over 400 rows (200 per worker, 20 steps of 10) running
    ``strategy_scripts/slow_worker_ps.py``, whose worker 1 sleeps ``slow`` s per step."""
    rng = np.random.default_rng(0)
    frame = {"x": list(rng.normal(size=(400, 4)).astype(np.float32)), "y": np.arange(400) % 2}
    shardkit.write_dataset(pd.DataFrame(frame), str(folder / "data"), row_group_size=50,
                           schema=shardkit.Schema([shardkit.Field("x", "float32", (4,)),
                                                   shardkit.Field("y", "int64")]))
    config = {"name": "ps-slow", "entrypoint": str(SLOW_WORKER), "framework": "torch",
              "strategy": "parameter_server", "roles": {"ps": {"count": 1}, "worker": {"count": 2}},
              "data": {"url": str(folder / "data"), "batch_size": 10, "num_epochs": 1, "shuffle": False},
              "checkpoint": {"every_steps": every_steps},
              "fault_tolerance": {"max_restarts": 0, "startup_timeout": 90.0},
              "params": {"optimizer": {"name": "sgd", "lr": 0.1}, "test": {"slow": slow}},
              "env": {"OMP_NUM_THREADS": "1"}, "logdir": str(folder / "job")}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(150)
def test_torch_ps_final_checkpoint_holds_the_slower_workers_last_updates(tmp_path: Path) -> None:
    """Worker 1 is slower: worker 0 ends first, and its final save waits until worker 1 has pushed its
    last gradient, so the final checkpoint holds all 40 updates (20 steps x 2 workers), not worker 0's
    20 and part of worker 1's. Worker 0's last step (20) was saved on schedule already (every 10), with
    worker 1 behind: the final save writes step 20 again."""
    console = io.StringIO()
    result = run_job(load_config(write_ps_job(tmp_path, slow=0.1, every_steps=10)), console=console)
    assert result.ok, console.getvalue()
    assert [c.step for c in result.checkpoints][-1:] == [20]
    state = torch.load(Path(result.checkpoints[-1].url) / "optimizer.pt", weights_only=True)
    assert state["updates"] == 40, console.getvalue()


def test_ps_0_tells_which_workers_have_not_finished_and_stops_waiting_at_the_timeout() -> None:
    finished = torch_ps_server.Finished()
    finished.add(1)
    finished.add(1)
    assert finished.wait(3, timeout=0.05) == [0, 2]
    finished.add(0)
    finished.add(2)
    assert finished.wait(3, timeout=60.0) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=40), st.integers(1, 6))
def test_every_parameter_lives_on_exactly_one_ps_and_loads_stay_balanced(sizes: list[int],
                                                                          num_ps: int) -> None:
    named = [(f"p{i}", size) for i, size in enumerate(sizes)]
    placement = torch_ps.assign(named, num_ps)
    assert set(placement) == {name for name, _ in named}
    assert all(0 <= ps < num_ps for ps in placement.values())
    load = [sum(size for name, size in named if placement[name] == ps) for ps in range(num_ps)]
    # Greedy largest-first: no ps exceeds another by more than the largest parameter.
    assert max(load) - min(load) <= max(sizes)
    assert torch_ps.assign(named, num_ps) == placement  # the same on every worker


@pytest.mark.parametrize(("spec", "fragment"), [
    ({"name": "rmsprop", "lr": 0.1}, "params.optimizer.name='rmsprop'"),
    ({"lr": 0.1}, "must be a mapping with a 'name'"),
    ({"name": "sgd", "lr": 0.1, "betas": [0.9, 0.99]}, "option(s) ['betas']"),
    ({"name": "adam", "lr": -1}, "params.optimizer.lr=-1"),
    ({"name": "adam", "lr": 0.1, "betas": [0.9, 2.0]}, "not a valid adam optimizer"),
])
def test_bad_optimizer_specs_fail_on_the_worker_naming_the_key(spec: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        ps_optimizer.validate_optimizer(spec, "params.optimizer")
    assert fragment in str(info.value)


def test_a_shard_applies_its_optimizer_and_its_state_reloads_elsewhere() -> None:
    """A ps shard's update equals torch's own optimizer on the same parameters, and its state (by name)
    loaded into a fresh shard continues identically: what a checkpoint round trip relies on."""
    torch.manual_seed(0)
    params = {"a": torch.randn(3, 4), "b": torch.randn(4)}
    spec = ps_optimizer.validate_optimizer({"name": "adam", "lr": 0.01, "betas": [0.8, 0.9]}, "spec")
    shard = torch_ps_server.Shard()
    shard.load(params, spec, state=None)
    reference = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    adam = torch.optim.Adam(reference.values(), lr=0.01, betas=(0.8, 0.9))
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(3)]
    for g in grads[:2]:
        shard.apply(g)
        for k, p in reference.items():
            p.grad = g[k]
        adam.step()
    for k in params:
        assert torch.equal(shard.weights()[k], reference[k].detach())
    state = shard.state()
    copy = torch_ps_server.Shard()
    copy.load(state["params"], state["spec"], state["state"], state["updates"])
    shard.apply(grads[2])
    copy.apply(grads[2])
    assert copy.updates == shard.updates == 3
    for k in params:
        assert torch.equal(copy.weights()[k], shard.weights()[k])
    with pytest.raises(KeyError, match="does not hold"):
        shard.apply({"c": torch.zeros(1)})


def test_a_shard_without_gradients_for_a_parameter_leaves_it_alone() -> None:
    shard = torch_ps_server.Shard()
    shard.load({"a": torch.ones(2), "b": torch.ones(2)}, {"name": "sgd", "lr": 0.5}, state=None)
    shard.apply({"a": torch.ones(2)})
    assert torch.equal(shard.weights()["a"], torch.full((2,), 0.5))
    assert torch.equal(shard.weights()["b"], torch.ones(2))


# ---------------------------------------------------------------------------------------------- misuse


class _Role:
    def __init__(self, role: str, index: int = 0, params: dict[str, Any] | None = None) -> None:
        self.role, self.role_index, self.params = role, index, params or {}

    def heartbeat(self, kind: str = "alive") -> None:
        pass


@pytest.mark.parametrize("value", [None, "", "not json", "[]", '{"cluster": {}}',
                                   '{"cluster": {"worker": []}, "task": {"type": "worker"}}'])
def test_a_missing_or_malformed_tf_config_names_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                            value: str | None) -> None:
    from shardkit.trainer.strategies import tf as shardkit_tf

    if value is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", value)
    with pytest.raises(ConfigError, match="TF_CONFIG"):
        shardkit_tf.cluster()


def test_tf_parameter_server_roles_are_told_what_they_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.trainer.strategies import tf as shardkit_tf

    cluster = {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ConfigError, match="only the chief runs the script"):
        shardkit_tf.strategy(_Role("worker"))
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    with pytest.raises(ConfigError, match="serve\\(\\) is for the ps and worker roles"):
        shardkit_tf.serve(_Role("chief"))


def test_torch_ps_connect_needs_a_worker_in_a_ps_job(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="for worker roles, not 'ps'"):
        torch_ps.connect(_Role("ps"), model)
    with pytest.raises(ConfigError, match=r"params\.optimizer"):
        torch_ps.connect(_Role("worker", params={"optimizer": {"name": "lbfgs"}}), model)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"roles\.ps\.count >= 1"):  # worker 0 at rank 0: no ps before it
        torch_ps.connect(_Role("worker"), model)
    monkeypatch.delenv("RANK")
    with pytest.raises(ConfigError, match="RANK/WORLD_SIZE"):
        torch_ps.connect(_Role("worker"), model)


def test_a_ps_state_of_another_model_is_refused_before_anything_is_sent() -> None:
    """Checked on worker 0 before any rpc: such a client needs no rpc group to raise."""
    spec = {"name": "sgd", "lr": 0.1}
    client = torch_ps.ParameterServerClient(torch.nn.Linear(3, 2), num_ps=1, worker=0, optimizer=spec)
    other = {"version": 1, "params": {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}, "state": {},
             "spec": spec, "updates": 3}
    with pytest.raises(ConfigError, match=r"does not fit this model \(parameters \['weight'\]"):
        client.load_state_dict(other)
    with pytest.raises(ConfigError, match="not a torch_ps state_dict"):
        client.load_state_dict({"state": {}})
    torch_ps.ParameterServerClient(torch.nn.Linear(3, 2), num_ps=1, worker=1,
                                   optimizer=spec).load_state_dict(other)  # not worker 0: not its to load
    client._closed = True  # as after close(), without an rpc group to shut down
    with pytest.raises(RuntimeError, match="connection is closed"):
        client.pull()
