"""Secret values masked as ``***``: the masker and its stream, a real job whose role prints its secrets
(log files, console, summary, job error), the Ray and Spark node runner, rendered specs, and secrets too
short to mask."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from shardkit.cluster import run_job
from shardkit.cluster._spec import ProcessSpec
from shardkit.cluster.engines._remote import NodeRunner
from shardkit.cluster.render import render
from shardkit.errors import JobError, SecretInEnvWarning, SecretTooShortWarning
from shardkit.job.config import load_config
from shardkit.job.masking import MASK, Masker
from tests.trainer.scripts import proctree

REPO = Path(__file__).resolve().parents[2]
LEAK = REPO / "tests" / "cluster" / "scripts" / "leak.py"

ENV_SECRET = "s3cr3t-from-env-0123"
FILE_SECRET = "pa$$\"word\\with-üñí"  # quotes, a backslash and non-ASCII: escaped in JSON files


# -- the masker ---------------------------------------------------------------------------------------

def test_values_are_masked_longest_first_and_short_ones_not_at_all() -> None:
    masker = Masker(["hunter22", "hunter22-admin", "abc", ""])
    assert masker.text("a hunter22-admin and a hunter22, abc") == "a *** and a ***, abc"
    assert masker.data("ü hunter22".encode()) == "ü ***".encode()
    assert not Masker(["abc", ""])
    assert Masker(["abc"]).text("abc") == "abc"


def test_json_data_is_masked_before_its_escapes_hide_a_value() -> None:
    masker = Masker([FILE_SECRET])
    data = {"failures": [{"last_lines": [f"token {FILE_SECRET}"]}], FILE_SECRET: 1, "n": 3}
    assert FILE_SECRET not in masker.text(json.dumps(data))  # why: escaped, the text search misses it
    masked = json.dumps(masker.deep(data))
    assert json.loads(masked) == {"failures": [{"last_lines": ["token ***"]}], "***": 1, "n": 3}


def test_a_stream_masks_a_value_split_across_writes() -> None:
    stream = Masker(["hunter22"]).stream()
    assert stream.feed(b"pass hun") == b"pass "  # "hun" may begin the secret: held back
    assert stream.feed(b"ter22 and hu") == b"*** and "
    assert stream.feed(b"mble\n") == b"humble\n"  # it did not: written
    assert stream.feed(b"h") == b""
    assert stream.flush() == b"h"  # the end of the stream: nothing more can come
    assert stream.feed(b"stopped in hunte") == b"stopped in "
    assert stream.flush() == b"***"  # stopped midway through the secret: its start is not written


def whole(masker: Masker, data: bytes) -> bytes:
    """``data`` masked in one piece, with a start of a secret at its very end (4 bytes or more) masked as
    a stream's end masks it."""
    out = masker.data(data)
    last = out.rfind(MASK.encode())
    held = masker.held(out[last + len(MASK):] if last >= 0 else out)
    return out[:len(out) - held] + MASK.encode() if held >= 4 else out


@given(secret=st.text("abc", min_size=4, max_size=8),
       parts=st.lists(st.sampled_from(["a", "b", "c", "\n", "S"]), max_size=30),
       cuts=st.lists(st.integers(0, 200), max_size=8))
def test_streamed_in_any_chunks_the_output_is_the_whole_text_masked(secret: str, parts: list[str],
                                                                      cuts: list[int]) -> None:
    """For all texts holding a secret anywhere (over an alphabet that makes partial matches common) and
    all ways to cut them into chunks: the stream writes what masking the whole text gives."""
    data = "".join(secret if part == "S" else part for part in parts).encode()
    masker = Masker([secret])
    stream = masker.stream()
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    out = b"".join(stream.feed(data[a:b]) for a, b in itertools.pairwise(bounds)) + stream.flush()
    assert out == whole(masker, data)
    assert secret.encode() not in out


@given(secrets=st.lists(st.text("abc", min_size=4, max_size=6), min_size=2, max_size=3),
       parts=st.lists(st.sampled_from(["a", "b", "c", "S0", "S1"]), max_size=20),
       cuts=st.lists(st.integers(0, 120), max_size=8))
def test_streamed_no_secret_of_several_reaches_the_output(secrets: list[str], parts: list[str],
                                                          cuts: list[int]) -> None:
    data = "".join(secrets[int(part[1])] if part.startswith("S") else part for part in parts).encode()
    masker = Masker(secrets)
    stream = masker.stream()
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    out = b"".join(stream.feed(data[a:b]) for a, b in itertools.pairwise(bounds)) + stream.flush()
    for secret in secrets:
        assert secret.encode() not in out


# -- a real job ---------------------------------------------------------------------------------------

@pytest.fixture
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


def write_config(folder: Path, secrets: dict[str, Any], *, workers: int = 2, max_restarts: int = 1,
                 entrypoint: str = str(LEAK), env: dict[str, str] | None = None, **params: Any) -> Path:
    """A job of `LEAK`, which prints each of ``params.names`` (default: the secrets' names)."""
    params.setdefault("names", sorted(secrets))
    config = {
        "name": "leak", "entrypoint": entrypoint, "framework": "tensorflow",
        "roles": {"worker": {"count": workers}},
        "fault_tolerance": {"max_restarts": max_restarts, "heartbeat_interval": 0.2,
                            "heartbeat_timeout": 10.0, "startup_timeout": 60.0},
        "logdir": str(folder / "job"), "params": {"workers": workers, **params},
        "secrets": secrets, "env": env or {},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return path


def every_file(folder: Path) -> Iterator[tuple[Path, bytes]]:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            yield path, path.read_bytes()


def assert_nowhere(values: list[str], folder: Path, *texts: str) -> None:
    """No value, as UTF-8 or in JSON's escaped form, in any file under ``folder`` nor in ``texts``."""
    for value in values:
        forms = {value.encode(), json.dumps(value)[1:-1].encode()}
        for text in texts:
            assert value not in text
        for path, data in every_file(folder):
            for form in forms:
                assert form not in data, (path, value)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("_no_orphans")
def test_a_role_that_prints_its_secrets_shows_stars_in_logs_console_and_summary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEAK_TOKEN", ENV_SECRET)
    (tmp_path / "password").write_text(FILE_SECRET + "\n", encoding="utf-8")
    secrets = {"API_TOKEN": {"env": "LEAK_TOKEN"}, "PASSWORD": {"file": str(tmp_path / "password")}}
    console = io.StringIO()
    # attempt 0 fails after printing (its last lines go into the summary), attempt 1 succeeds
    result = run_job(load_config(write_config(tmp_path, secrets, fail_attempts=[0])), console=console)
    assert result.ok
    assert result.restarts == 1
    job = tmp_path / "job"
    out = console.getvalue()
    for attempt in (0, 1):
        for worker in (0, 1):
            log = (job / "logs" / f"attempt-{attempt}" / f"worker-{worker}.log").read_text(encoding="utf-8")
            for name in ("API_TOKEN", "PASSWORD"):
                for line in (f"stdout {name}=***", f"stderr {name}=***", f"split {name}=*** end"):
                    assert line in log.splitlines(), (line, log)
                    assert f"[worker-{worker}] {line}" in out  # echoed masked
            assert '{"config": {"API_TOKEN": "***"}}' in log
            assert f"done {attempt}" in log
    assert "last words ***" in (job / "logs" / "attempt-0" / "worker-0.log").read_text()  # unterminated
    failure = result.failures[0]
    assert "last words ***" in failure.last_lines
    summary = json.loads((job / "summary.json").read_text(encoding="utf-8"))
    assert "last words ***" in summary["failures"][0]["last_lines"]
    assert "stdout PASSWORD=***" in summary["failures"][0]["last_lines"]
    assert "last words ***" in out  # the printed summary
    processes = json.loads((job / "logs" / "attempt-0" / "processes.json").read_text())
    assert {p["env"]["API_TOKEN"] for p in processes} == {"<redacted>"}
    assert json.loads((job / "job.json").read_text())["secrets"] == ["API_TOKEN", "PASSWORD"]
    assert_nowhere([ENV_SECRET, FILE_SECRET], job, out)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("_no_orphans")
def test_a_failed_jobs_error_and_summary_hold_no_secret(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEAK_TOKEN", ENV_SECRET)
    console = io.StringIO()
    config = load_config(write_config(tmp_path, {"API_TOKEN": {"env": "LEAK_TOKEN"}}, workers=1,
                                      max_restarts=0, fail_attempts=[0]))
    with pytest.raises(JobError) as info:
        run_job(config, console=console)
    assert "last words ***" in str(info.value)
    assert_nowhere([ENV_SECRET], tmp_path / "job", console.getvalue(), str(info.value))


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("_no_orphans")
def test_secrets_too_short_to_mask_warn_naming_them_and_stay_unmasked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEAK_SHORT", "abc")
    monkeypatch.setenv("LEAK_EMPTY", "")
    secrets = {"SHORT": {"env": "LEAK_SHORT"}, "EMPTY": {"env": "LEAK_EMPTY"}}
    with pytest.warns(SecretTooShortWarning) as caught:
        result = run_job(load_config(write_config(tmp_path, secrets, workers=1)), console=io.StringIO())
    assert result.ok
    messages = [str(w.message) for w in caught if issubclass(w.category, SecretTooShortWarning)]
    assert len(messages) == 2, messages  # once each, not once per attempt or per read
    assert any("secrets.SHORT" in m and "3 character(s)" in m and "not masked" in m for m in messages)
    assert any("secrets.EMPTY" in m and "empty" in m for m in messages)
    assert not any("abc" in m.replace("secrets.", "") for m in messages)  # never the value
    log = (tmp_path / "job" / "logs" / "attempt-0" / "worker-0.log").read_text()
    assert "stdout SHORT=abc" in log.splitlines()  # not masked: "abc" would be masked everywhere
    assert "stdout EMPTY=" in log.splitlines()
    assert MASK not in log


# -- env: entries whose names look like credentials ---------------------------------------------------

ENV_TOKEN = "tok-in-env-9876"  # written in the config file under env:


def train(path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`shardkit train path` in a subprocess, as a user runs it."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    return subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(path)], cwd=REPO,
                          env={**environ, **env}, capture_output=True, text=True, encoding="utf-8",
                          timeout=200, check=False)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_no_orphans")
def test_an_env_value_named_like_a_credential_is_a_secret_in_every_file_and_output(tmp_path: Path) -> None:
    """`shardkit train` of a job whose env: holds API_TOKEN (and TOKENIZERS_PARALLELISM, which only looks
    close); attempt 0 fails after printing, attempt 1 succeeds. The script gets the value (it prints it,
    and the lines show the mask, which replaces only that value), no file or output holds it, and one
    warning names it."""
    env = {"API_TOKEN": ENV_TOKEN, "TOKENIZERS_PARALLELISM": "false"}
    path = write_config(tmp_path, {}, env=env, names=["API_TOKEN"], fail_attempts=[0])
    done = train(path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    warned = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1, warned  # once, for API_TOKEN only
    assert warned[0].startswith("warning: env.API_TOKEN looks like a credential")
    assert "move it under secrets:" in warned[0]
    job = tmp_path / "job"
    for attempt in (0, 1):
        for worker in (0, 1):
            log = (job / "logs" / f"attempt-{attempt}" / f"worker-{worker}.log").read_text(encoding="utf-8")
            for line in ("stdout API_TOKEN=***", "stderr API_TOKEN=***", "split API_TOKEN=*** end"):
                assert line in log.splitlines(), (line, log)
                assert f"[worker-{worker}] {line}" in out  # echoed masked
            assert '{"config": {"API_TOKEN": "***"}}' in log
    saved = json.loads((job / "job.json").read_text(encoding="utf-8"))
    assert saved["env"] == {"TOKENIZERS_PARALLELISM": "false"}
    assert saved["secrets"] == ["API_TOKEN"]
    for attempt in (0, 1):
        processes = json.loads((job / "logs" / f"attempt-{attempt}" / "processes.json").read_text())
        assert {p["env"]["API_TOKEN"] for p in processes} == {"<redacted>"}
        assert {p["env"]["TOKENIZERS_PARALLELISM"] for p in processes} == {"false"}
    summary = json.loads((job / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "succeeded"
    assert "last words ***" in summary["failures"][0]["last_lines"]
    assert_nowhere([ENV_TOKEN], job, out)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_no_orphans")
def test_torchrun_workers_mask_an_env_value_named_like_a_credential(tmp_path: Path) -> None:
    """The torchrun engine's workers mask by the names job.json lists: an env: credential is one."""
    from shardkit.job.layout import free_ports

    path = write_config(tmp_path, {}, env={"OMP_NUM_THREADS": "1", "DB_PASSWORD": ENV_TOKEN}, workers=1,
                        max_restarts=0, names=["DB_PASSWORD"])
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    config.update(framework="torch",
                  engine={"name": "torchrun", "nnodes": "1", "rdzv_endpoint": f"127.0.0.1:{free_ports(1)[0]}",
                          "rdzv_id": tmp_path.name, "grace": 2})
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    done = train(path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "warning: env.DB_PASSWORD looks like a credential" in done.stderr
    log = (tmp_path / "job" / "logs" / "node-0" / "attempt-0" / "worker-0.log").read_text(encoding="utf-8")
    assert "stdout DB_PASSWORD=***" in log.splitlines(), log
    assert_nowhere([ENV_TOKEN], tmp_path / "job", out)


# -- Ray and Spark: the node runner that starts a role on its node ------------------------------------

@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_no_orphans")
def test_the_node_runner_of_ray_and_spark_relays_masked_lines(tmp_path: Path) -> None:
    code = ("import os, sys, time; v = os.environ['API_TOKEN']; print('out', v, flush=True); "
            "sys.stderr.write('err ' + v[:5]); sys.stderr.flush(); time.sleep(0.3); "
            "sys.stderr.write(v[5:] + '\\n'); print('last', v, end='', flush=True)")
    proc = ProcessSpec("worker", 0, [sys.executable, "-u", "-c", code], {"API_TOKEN": ENV_SECRET},
                       frozenset({"API_TOKEN"}))
    runner = NodeRunner(proc, grace=1.0)
    lines: list[str] = []
    envs: list[dict[str, str]] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            update = runner.collect()
            lines += update.lines
            envs += [update.env] if update.env is not None else []
            if update.returncode is not None:
                break
            time.sleep(0.05)
        assert update.returncode == 0
        assert lines == ["out ***", "err ***", "last ***"]
        assert envs == [{"API_TOKEN": "<redacted>"}]  # once, for processes.json: the secret by name only
        assert ENV_SECRET.encode() not in (runner.dir / "worker-0.log").read_bytes()  # the node's own log
    finally:
        runner.close()


def test_processes_json_holds_the_addresses_a_node_gave_not_the_spec(tmp_path: Path) -> None:
    """The supervisor writes processes.json from the spec (built for one machine); on Ray and Spark the
    node places the addresses: until the runner's first report they read as not yet known, then as
    the process got them, with the node's host."""
    from shardkit.cluster.engines._remote import Update
    from shardkit.cluster.engines.mirror import MirrorGroup, MirrorProcess

    spec = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "API_TOKEN": "<redacted>"}
    path = tmp_path / "processes.json"
    path.write_text(json.dumps([{"name": "worker-0", "argv": ["python"], "env": spec}]))
    proc = ProcessSpec("worker", 0, ["python"], {}, frozenset())
    group = MirrorGroup([MirrorProcess(proc, tmp_path / "worker-0.log")], None)
    try:
        before = json.loads(path.read_text())[0]["env"]
        assert before["MASTER_ADDR"] == before["MASTER_PORT"] == "<set on its node as it starts>"
        assert before["RANK"] == "0"
        group.processes[0].host = "10.11.0.2"
        got = {**spec, "MASTER_ADDR": "10.11.0.2", "MASTER_PORT": "41234", "GLOO_SOCKET_IFNAME": "veth0"}
        group.feed(0, Update.from_json(Update(pid=7, env=got).to_json()))  # as a Spark task sends it
        assert json.loads(path.read_text()) == [{"name": "worker-0", "argv": ["python"], "env": got,
                                                 "host": "10.11.0.2"}]
    finally:
        group.close()


# -- rendered specs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["kubernetes", "yarn"])
def test_rendered_specs_hold_no_secret_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             engine: str) -> None:
    monkeypatch.setenv("LEAK_TOKEN", ENV_SECRET)
    (tmp_path / "password").write_text(FILE_SECRET, encoding="utf-8")
    secrets = {"API_TOKEN": {"env": "LEAK_TOKEN"}, "PASSWORD": {"file": str(tmp_path / "password")}}
    (tmp_path / "leak.py").write_bytes(LEAK.read_bytes())  # a rendered job's script lies beside its config
    env = {"HF_TOKEN": ENV_TOKEN, "LANG": "C.UTF-8"}
    path = write_config(tmp_path, secrets, entrypoint="leak.py", env=env)
    image = ["engine.image=registry.example.com/leak:1"] if engine == "kubernetes" else []
    with pytest.warns(SecretInEnvWarning, match="env.HF_TOKEN"):
        config = load_config(path, image)
    files = render(config, engine=engine, out_dir=tmp_path / "out")
    assert files
    assert_nowhere([ENV_SECRET, FILE_SECRET, ENV_TOKEN], tmp_path / "out", *files.values())
    text = "\n".join(files.values())
    assert "HF_TOKEN" in text  # named, as a secret
    assert "C.UTF-8" in text  # a plain variable as it is


# -- the torchrun engine: each worker writes its own log ------------------------------------------------

@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_no_orphans")
def test_torchrun_workers_logs_node_output_and_summary_show_stars(tmp_path: Path) -> None:
    """One node of two workers on 127.0.0.1; attempt 0 fails after printing, attempt 1 succeeds."""
    from shardkit.job.layout import free_ports

    (tmp_path / "password").write_text(FILE_SECRET + "\n", encoding="utf-8")
    secrets = {"API_TOKEN": {"env": "LEAK_TOKEN"}, "PASSWORD": {"file": str(tmp_path / "password")}}
    path = write_config(tmp_path, secrets, fail_attempts=[0])
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    config.update(framework="torch", env={"OMP_NUM_THREADS": "1"},
                  engine={"name": "torchrun", "nnodes": "1", "rdzv_endpoint": f"127.0.0.1:{free_ports(1)[0]}",
                          "rdzv_id": tmp_path.name, "grace": 2})
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    env["LEAK_TOKEN"] = ENV_SECRET
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, encoding="utf-8", timeout=200, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    job = tmp_path / "job"
    for attempt in (0, 1):
        for rank in (0, 1):
            log = (job / "logs" / "node-0" / f"attempt-{attempt}" / f"worker-{rank}.log").read_text(
                encoding="utf-8").splitlines()
            for name in ("API_TOKEN", "PASSWORD"):
                for line in (f"stdout {name}=***", f"stderr {name}=***", f"split {name}=*** end"):
                    assert line in log, (line, log)
            assert f"done {attempt}" in log
    assert "stdout PASSWORD=***" in out  # echoed by the node's agent
    summary = json.loads((job / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "succeeded"
    assert any("last words ***" in f["last_lines"] for f in summary["failures"]), summary["failures"]
    assert_nowhere([ENV_SECRET, FILE_SECRET], job, out)


# -- the Ray and Spark engines, end to end ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", [
    pytest.param({"name": "ray", "num_cpus": 2}, id="ray"),
    # the driver's JVM (local master: the executors' too) JITs at C1 only: it lives a minute, and the C2
    # compiler's threads would take a 2-core machine's CPU from the job
    pytest.param({"name": "spark", "conf": {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"}},
                 id="spark", marks=pytest.mark.spark),
])
def test_ray_and_spark_jobs_show_stars_in_logs_console_and_summary(tmp_path: Path,
                                                                   engine: dict[str, Any]) -> None:
    """`shardkit train` on a local Ray instance or Spark master (in a subprocess: the engine is the CLI's
    own to start and close); attempt 0 fails after printing, attempt 1 succeeds. A secret and an env:
    credential are masked; processes.json records the addresses the processes got on their nodes (the
    node places rank 0's port: the spec's, built on the trainer's machine, is another)."""
    pytest.importorskip("ray" if engine["name"] == "ray" else "pyspark")
    placed = ["MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"]
    path = write_config(tmp_path, {"API_TOKEN": {"env": "LEAK_TOKEN"}}, env={"HF_TOKEN": ENV_TOKEN},
                        names=["API_TOKEN", "HF_TOKEN"], show=placed, fail_attempts=[0])
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    config.update(engine=engine, framework="torch")
    config["fault_tolerance"]["startup_timeout"] = 180.0
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    env["LEAK_TOKEN"] = ENV_SECRET
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, encoding="utf-8", timeout=280, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    job = tmp_path / "job"
    for attempt in (0, 1):
        processes = {p["name"]: p for p in json.loads(
            (job / "logs" / f"attempt-{attempt}" / "processes.json").read_text(encoding="utf-8"))}
        for worker in (0, 1):
            log = (job / "logs" / f"attempt-{attempt}" / f"worker-{worker}.log").read_text(
                encoding="utf-8").splitlines()
            for name in ("API_TOKEN", "HF_TOKEN"):
                for line in (f"stdout {name}=***", f"stderr {name}=***", f"split {name}=*** end"):
                    assert line in log, (line, log)
                    assert f"[worker-{worker}] {line}" in out
            got = dict(line[len("env "):].split("=", 1) for line in log if line.startswith("env "))
            record = processes[f"worker-{worker}"]
            assert {k: record["env"][k] for k in placed} == got, (record, got)  # what the process got
            assert record["host"] == got["MASTER_ADDR"]  # one node here: rank 0's
            assert record["env"]["API_TOKEN"] == record["env"]["HF_TOKEN"] == "<redacted>"
    summary = json.loads((job / "summary.json").read_text(encoding="utf-8"))
    assert "last words ***" in summary["failures"][0]["last_lines"]
    assert_nowhere([ENV_SECRET, ENV_TOKEN], job, out)
