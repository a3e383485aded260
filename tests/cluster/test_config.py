"""Job config: every bad input fails with the key path, the bad value and the fix; secrets never leak."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from shardkit.cluster._spec import build_spec
from shardkit.errors import ConfigError
from shardkit.job.config import JobConfig, describe, load_config

REPO = Path(__file__).resolve().parents[2]

SECRET = "s3cr3t-Q7vX9-never-print-me"  # distinctive: searched for in every output below


def base(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": "digits",
        "entrypoint": "train.py",
        "framework": "torch",
        "strategy": "allreduce",
        "roles": {"worker": {"count": 2}},
    }
    config.update(changes)
    return config


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


def write(job_dir: Path, config: dict[str, Any] | str, name: str = "job.yaml") -> Path:
    path = job_dir / name
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    return path


def fails(job_dir: Path, config: dict[str, Any] | str, overrides: tuple[str, ...] = ()) -> str:
    path = write(job_dir, config)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert str(path) in message, message
    return message


def problem_line(message: str, key: str) -> str:
    """The message's line about ``key``; it must carry a fix."""
    lines = [line for line in message.splitlines() if line.strip().startswith(f"- {key} ")
             or line.strip().startswith(f"- {key}:")]
    assert lines, f"no problem about {key!r} in:\n{message}"
    assert "Fix: " in lines[0], lines[0]
    return lines[0]


# -- valid configs ---------------------------------------------------------------------------------


def test_minimal_config_resolves_paths_and_defaults(job_dir: Path) -> None:
    config = load_config(write(job_dir, base()))
    assert config.entrypoint == str(job_dir / "train.py")
    assert config.entrypoint_kind == "script"
    assert config.logdir == job_dir / "runs" / "digits"
    assert config.checkpoint.dir == str(job_dir / "runs" / "digits" / "checkpoints")
    assert config.checkpoint_dir == config.checkpoint.dir
    assert config.python == Path(sys.executable)
    assert config.engine.name == "local"
    assert config.engine.options == {}
    assert config.data is None
    assert config.source == job_dir / "job.yaml"
    assert config.fault_tolerance.heartbeat_timeout > config.fault_tolerance.heartbeat_interval


def test_design_doc_example_loads(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (job_dir / "cfg").mkdir()
    (job_dir / "cfg" / "train_digits.py").write_text("")
    (job_dir / "token").write_text(SECRET + "\n")
    text = f"""\
name: digits
entrypoint: train_digits.py
framework: torch
strategy: allreduce
roles:
  worker: {{count: 2, resources: {{cpus: 1, gpus: 0, memory: 2G}}}}
data:
  url: ../runs/digits
  batch_size: 64
  seed: 0
  shuffle: true
  num_epochs: 1
  options: {{columns: [pixels, label], filter: [[label, "<", 5]]}}
checkpoint: {{dir: null, every_steps: 50, every_seconds: null, keep: 3}}
fault_tolerance: {{max_restarts: 3, heartbeat_interval: 1.0, heartbeat_timeout: 30.0, startup_timeout: 120.0}}
engine: local
logdir: ../runs/digits-job
python: null
params: {{epochs: 5, lr: 0.05}}
env: {{OMP_NUM_THREADS: "1"}}
secrets: {{AWS_SECRET_ACCESS_KEY: {{env: MY_SECRET}}, TOKEN: {{file: {job_dir / "token"}}}}}
"""
    monkeypatch.setenv("MY_SECRET", SECRET)
    config = load_config(write(job_dir / "cfg", text))
    assert config.roles["worker"].resources.memory == 2 * 2**30
    assert config.data is not None
    assert config.data.url == str(job_dir / "runs" / "digits")
    assert config.logdir == job_dir / "runs" / "digits-job"
    assert config.checkpoint_dir == str(job_dir / "runs" / "digits-job" / "checkpoints")
    assert config.params == {"epochs": 5, "lr": 0.05}
    assert config.secret_values() == {"AWS_SECRET_ACCESS_KEY": SECRET, "TOKEN": SECRET}


def test_module_function_entrypoint(job_dir: Path) -> None:
    config = load_config(write(job_dir, base(entrypoint="mypkg.train:main")))
    assert config.entrypoint == "mypkg.train:main"
    assert config.entrypoint_kind == "function"


def test_tensorflow_parameter_server_gets_one_chief_implicitly(job_dir: Path) -> None:
    config = load_config(write(job_dir, base(framework="tensorflow", strategy="parameter_server",
                                             roles={"worker": {"count": 2}, "ps": {"count": 1}})))
    assert config.roles["chief"].count == 1
    assert config.redacted()["roles"]["chief"]["count"] == 1


@pytest.mark.parametrize(
    ("memory", "expected"),
    [("2G", 2 * 2**30), ("512M", 512 * 2**20), ("1.5Gi", 3 * 2**29), ("2GB", 2 * 2**30), ("64k", 65536),
     ("100", 100), (4096, 4096), (None, None)],
)
def test_memory_sizes(job_dir: Path, memory: Any, expected: int | None) -> None:
    config = load_config(write(job_dir, base(roles={"worker": {"resources": {"memory": memory}}})))
    assert config.roles["worker"].resources.memory == expected


def test_engine_as_name_or_mapping(job_dir: Path) -> None:
    assert load_config(write(job_dir, base(engine="ray"))).engine.name == "ray"
    config = load_config(write(job_dir, base(engine={"name": "spark", "master": "local[2]"})))
    assert (config.engine.name, config.engine.options) == ("spark", {"master": "local[2]"})
    config = load_config(write(job_dir, base(engine="local")), ["engine.workers=2", "engine.name=torchrun"])
    assert (config.engine.name, config.engine.options) == ("torchrun", {"workers": 2})


def test_python_as_venv_folder_or_relative_path(job_dir: Path) -> None:
    venv = Path(sys.prefix)  # the test's own virtual environment
    config = load_config(write(job_dir, base(python=str(venv))))
    assert config.python.parent == venv / "bin"
    assert config.python.name.startswith("python")
    (job_dir / "env" / "bin").mkdir(parents=True)
    fake = job_dir / "env" / "bin" / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert load_config(write(job_dir, base(python="env"))).python == fake
    assert load_config(write(job_dir, base(python="env/bin/python"))).python == fake


def test_data_url_with_scheme_is_kept_and_env_numbers_become_strings(job_dir: Path) -> None:
    config = load_config(write(job_dir, base(data={"url": "s3://bucket/ds"}, env={"OMP_NUM_THREADS": 1})))
    assert config.data is not None
    assert config.data.url == "s3://bucket/ds"
    assert config.env == {"OMP_NUM_THREADS": "1"}


def test_overrides_apply_yaml_values(job_dir: Path) -> None:
    config = load_config(write(job_dir, base(params={"lr": 0.1})), [
        "roles.worker.count=4", "params.lr=0.5", "params.layers=[64, 32]", "roles.evaluator={count: 1}",
        "data.url=ds", "data.options.columns=[x]", "checkpoint.every_seconds=30", "logdir=out",
    ])
    assert config.roles["worker"].count == 4
    assert config.params == {"lr": 0.5, "layers": [64, 32]}
    assert config.roles["evaluator"].count == 1
    assert config.data is not None
    assert config.data.options == {"columns": ["x"]}
    assert config.checkpoint.every_seconds == 30
    # the default checkpoint dir follows the overridden logdir
    assert config.checkpoint_dir == str(job_dir / "out" / "checkpoints")


def test_redacted_is_json_and_round_trips(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SECRET", SECRET)
    config = load_config(write(job_dir, base(data={"url": "ds"}, secrets={"TOKEN": {"env": "MY_SECRET"}},
                                             engine={"name": "local", "x": 1})))
    data = json.loads(json.dumps(config.redacted()))
    assert data["secrets"] == ["TOKEN"]
    again = JobConfig.from_redacted(data)
    assert again.redacted() == data
    assert again.secrets["TOKEN"].env == "TOKEN"  # inside a role the value is in its own variable
    assert again.engine == config.engine


def test_config_is_frozen_and_direct_construction_raises_config_error(job_dir: Path) -> None:
    config = JobConfig.from_dict(base(), base_dir=job_dir)
    with pytest.raises(ValidationError, match="frozen"):
        config.name = "other"  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"roles\.worker\.count = 0"):
        JobConfig.from_dict(base(roles={"worker": {"count": 0}}), base_dir=job_dir)
    with pytest.raises(ConfigError, match="entrypoint"):
        JobConfig(name="x", entrypoint=str(job_dir / "missing.py"), framework="torch", roles={"worker": {}})


def test_describe_summarizes_the_job(job_dir: Path) -> None:
    config = load_config(write(job_dir, base(
        framework="tensorflow", strategy="parameter_server", data={"url": "ds", "batch_size": 32},
        roles={"worker": {"count": 2}, "ps": {"count": 1}, "evaluator": {}},
        checkpoint={"every_steps": 10, "every_seconds": 60}, engine={"name": "ray", "address": "auto"})))
    text = describe(config)
    for expected in ["tensorflow parameter_server", "5 processes", "worker x2", "ps x1", "chief x1",
                     "evaluator x1", "chief[0], data shard 0/1", "worker[1]", "batch 32",
                     "every 10 steps and every 60 s", "keep 3", "engine: ray", "auto", str(job_dir)]:
        assert expected in text, (expected, text)


# -- every bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        ({"colour": "red"}, "colour", ["unknown key", "remove it"]),
        ({"roles": {"worker": {"count": 2, "cpus": 2}}}, "roles.worker.cpus", ["unknown key", "resources"]),
        ({"checkpoint": {"evry_steps": 5}}, "checkpoint.evry_steps", ["did you mean 'every_steps'"]),
        ({"roles": {"worker": {"count": "two"}}}, "roles.worker.count", ["'two'", "string where"]),
        ({"roles": {"worker": {"count": "2"}}}, "roles.worker.count", ["'2'", "without quotes"]),
        ({"roles": {"worker": {"count": 0}}}, "roles.worker.count", ["= 0", "at least 1", "1 or more"]),
        ({"roles": {"worker": {"count": 1.5}}}, "roles.worker.count", ["1.5", "integer"]),
        ({"roles": {"workers": {"count": 2}}}, "roles.workers", ["unknown role", "worker, ps, chief"]),
        ({"roles": []}, "roles", ["mapping of keys"]),
        ({"framework": "pytorch"}, "framework", ["'pytorch'", "'torch' or 'tensorflow'"]),
        ({"strategy": "ps"}, "strategy", ["'allreduce' or 'parameter_server'"]),
        ({"entrypoint": "missing.py"}, "entrypoint", ["'missing.py'", "does not exist", "module:function"]),
        ({"entrypoint": "pkg.mod:fn:x"}, "entrypoint", ["does not exist"]),
        ({"name": "my job/1"}, "name", ["'my job/1'", "rename"]),
        ({"strategy": "parameter_server"}, "roles.ps", ["needs parameter servers", "ps: {count: 1}"]),
        ({"roles": {"worker": {}, "ps": {}}}, "roles.ps", ["no parameter servers", "remove roles.ps"]),
        ({"roles": {"ps": {}}, "strategy": "parameter_server"}, "roles.worker", ["needs workers"]),
        ({"roles": {"worker": {}, "chief": {}}}, "roles.chief", ["torch jobs have no chief", "rank 0"]),
        ({"roles": {"worker": {}, "evaluator": {"count": 2}}}, "roles.evaluator.count", ["exactly one"]),
        ({"framework": "tensorflow", "strategy": "parameter_server",
          "roles": {"worker": {}, "ps": {}, "chief": {"count": 2}}},
         "roles.chief.count", ["set roles.chief"]),
        ({"roles": {"worker": {"resources": {"memory": "2X"}}}}, "roles.worker.resources.memory",
         ["'2X'", "memory size", "512M"]),
        ({"roles": {"worker": {"resources": {"memory": "-1G"}}}}, "roles.worker.resources.memory", ["'-1G'"]),
        ({"roles": {"worker": {"resources": {"memory": 0}}}}, "roles.worker.resources.memory", ["greater"]),
        ({"roles": {"worker": {"resources": {"cpus": 0}}}}, "roles.worker.resources.cpus", ["greater"]),
        ({"roles": {"worker": {"resources": {"gpus": -1}}}}, "roles.worker.resources.gpus", ["-1"]),
        ({"engine": "mesos"}, "engine.name", ["'mesos'", "'local'", "'kubernetes'"]),
        ({"engine": {"name": "slurm", "nodes": 2}}, "engine.name", ["'slurm'"]),
        ({"python": "/nonexistent/bin/python"}, "python", ["not an executable", "virtual environment"]),
        ({"python": "train.py"}, "python", ["not an executable"]),  # a file, not executable
        ({"python": "."}, "python", ["bin/python"]),  # a folder with no interpreter
        ({"data": {"url": "ds", "batch_size": 0}}, "data.batch_size", ["greater than or equal to 1"]),
        ({"data": {"batch_size": 8}}, "data.url", ["missing", "add url:"]),
        ({"data": {"url": "ds", "options": {"colums": ["a"]}}}, "data.options.colums",
         ["make_reader has no argument", "did you mean 'columns'"]),
        ({"data": {"url": "ds", "options": {"num_shards": 4}}}, "data.options.num_shards", ["trainer sets"]),
        ({"data": {"url": "ds", "options": {"seed": 4}}}, "data.options.seed", ["use data.seed"]),
        ({"checkpoint": {"keep": 0}}, "checkpoint.keep", ["= 0", "greater than or equal to 1"]),
        ({"checkpoint": {"every_steps": -5}}, "checkpoint.every_steps", ["-5"]),
        ({"fault_tolerance": {"max_restarts": -1}}, "fault_tolerance.max_restarts", ["-1"]),
        ({"fault_tolerance": {"heartbeat_interval": 0}}, "fault_tolerance.heartbeat_interval", ["greater"]),
        ({"fault_tolerance": {"heartbeat_interval": 5, "heartbeat_timeout": 5}},
         "fault_tolerance.heartbeat_timeout", ["not longer than heartbeat_interval"]),
        ({"env": {"OK": True}}, "env.OK", ["quote it", "booleans"]),
        ({"env": {"RANK": "3"}}, "env.RANK", ["trainer sets", "remove it"]),
        ({"env": {"TF_CONFIG": "{}"}}, "env.TF_CONFIG", ["trainer sets"]),
        ({"env": {"1BAD": "x"}}, "env.1BAD", ["not an environment variable name"]),
        ({"env": {"A": "1"}, "secrets": {"A": {"env": "B"}}}, "secrets.A", ["also in env"]),
        ({"secrets": {"T": {"env": "A", "file": "b"}}}, "secrets.T", ["exactly one source"]),
        ({"secrets": {"T": {}}}, "secrets.T", ["exactly one source"]),
        ({"secrets": {"T": "plain"}}, "secrets.T", ["mapping of keys"]),
        ({"secrets": {"SHARDKIT_ROLE": {"env": "X"}}}, "secrets.SHARDKIT_ROLE", ["trainer sets"]),
        ({"params": [1, 2]}, "params", ["mapping of keys"]),
        ({"logdir": 5}, "logdir", ["= 5"]),
    ],
)
def test_bad_value_names_key_value_and_fix(job_dir: Path, changes: dict[str, Any], key: str,
                                           words: list[str]) -> None:
    line = problem_line(fails(job_dir, base(**changes)), key)
    for word in words:
        assert word in line, (word, line)


def test_credentials_in_storage_options_are_refused_without_showing_them(job_dir: Path) -> None:
    """They would be copied in plain text into job.json, the logs and rendered specs; secrets: are not.
    Storage options that are not credentials (an endpoint, gcsfs's token modes) are fine."""
    options = {"endpoint_url": "http://127.0.0.1:9000", "key": "AKIAEXAMPLE", "secret": "s3cr3t-value"}
    err = fails(job_dir, base(data={"url": "s3://b/ds", "options": {"storage_options": options}}))
    for key in ("key", "secret"):
        line = problem_line(err, f"data.options.storage_options.{key}")
        assert "plain text" in line, line
        assert "secrets: {AWS_SECRET_ACCESS_KEY" in line, line
    assert "s3cr3t-value" not in str(err)
    assert "AKIAEXAMPLE" not in str(err)
    assert "endpoint_url" not in str(err)
    fine = {"endpoint_url": "http://127.0.0.1:9000", "anon": True}
    (job_dir / "ok.yaml").write_text(yaml.safe_dump(base(data={"url": "s3://b/ds", "options": {
        "storage_options": fine}})))
    assert load_config(job_dir / "ok.yaml").data.options["storage_options"] == fine
    (job_dir / "gcs.yaml").write_text(yaml.safe_dump(base(data={"url": "gs://b/ds", "options": {
        "storage_options": {"token": "anon"}}})))
    assert load_config(job_dir / "gcs.yaml").data.options["storage_options"] == {"token": "anon"}


@pytest.mark.parametrize("key", ["name", "entrypoint", "framework", "roles"])
def test_missing_required_key(job_dir: Path, key: str) -> None:
    config = base()
    del config[key]
    line = problem_line(fails(job_dir, config), key)
    assert "missing" in line
    assert f"add {key}:" in line


def test_all_problems_at_once_with_line_numbers(job_dir: Path) -> None:
    text = """\
name: digits
entrypoint: train.py
framework: torch
roles:
  worker: {count: 0}
engine: mesos
colour: red
"""
    message = fails(job_dir, text)
    assert "3 problems" in message
    assert "(line 5)" in problem_line(message, "roles.worker.count")
    assert "(line 6)" in problem_line(message, "engine.name")
    assert "(line 7)" in problem_line(message, "colour")


def test_yaml_syntax_error_names_line_and_column(job_dir: Path) -> None:
    message = fails(job_dir, "name: digits\nroles:\n  worker: {count: 2\nframework: torch\n")
    assert "YAML syntax error at line 4, column" in message
    assert "Fix:" in message
    message = fails(job_dir, "name: 'digits\n")
    assert "YAML syntax error at line" in message


def test_duplicate_key_is_an_error(job_dir: Path) -> None:
    text = "name: a\nentrypoint: train.py\nframework: torch\nname: b\nroles: {worker: {}}\n"
    message = fails(job_dir, text)
    assert "name is written twice (lines 1 and 4)" in message
    assert "Fix: keep one" in message


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_file_that_is_not_a_mapping(job_dir: Path, text: str) -> None:
    assert "not a mapping of keys" in fails(job_dir, text)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: it does not exist\. Fix:"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("roles.worker.count", ["not KEY.PATH=VALUE", "--set roles.worker.count=4"]),
        ("=3", ["not KEY.PATH=VALUE"]),
        ("roles..count=3", ["not KEY.PATH=VALUE"]),
        ("colour=red", ["unknown key colour", "under the top level"]),
        ("roles.wroker.count=2", ["unknown key roles.wroker", "did you mean 'worker'"]),
        ("roles.worker.cont=2", ["unknown key roles.worker.cont", "did you mean 'count'"]),
        ("checkpoint.every.steps=2", ["unknown key checkpoint.every"]),
        ("name.first=x", ["name is a single value", "--set name=VALUE"]),
        ("name=[1, 2", ["the value is not YAML", "quote it"]),
        ("data.url.x=1", ["data.url is a single value"]),
    ],
)
def test_bad_override(job_dir: Path, override: str, words: list[str]) -> None:
    message = fails(job_dir, base(), (override,))
    assert repr(override) in message
    assert "Fix:" in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        ("fault_tolerance.heartbeat_timeout=1e3", "fault_tolerance.heartbeat_timeout",
         ["'1e3'", "YAML reads 1e3 as a string", "write 1000 or 1.0e+3"]),
        ("fault_tolerance.heartbeat_timeout=2.5e1", "fault_tolerance.heartbeat_timeout",
         ["write 25 or 2.5e+1"]),
        ("checkpoint.every_seconds=1e-1", "checkpoint.every_seconds", ["write 1.0e-1"]),
        ("checkpoint.keep=1e1", "checkpoint.keep", ["YAML reads 1e1 as a string: write 10"]),
        ("checkpoint.keep='3'", "checkpoint.keep", ["'3'", "(write it without quotes)"]),
    ],
)
def test_a_number_yaml_reads_as_a_string_gets_the_fix_that_works(job_dir: Path, override: str, key: str,
                                                                  words: list[str]) -> None:
    """YAML 1.1 (PyYAML) reads 1e3 and 1.0e3 as strings: "write it without quotes" would not help."""
    line = problem_line(fails(job_dir, base(), (override,)), key)
    for word in words:
        assert word in line, (word, line)
    if "without quotes" in line:  # it was quoted: that fix is right
        return
    key_path = override.partition("=")[0]
    for text in line.rsplit("write ", 1)[1].split(")")[0].split(" or "):  # each suggestion loads
        assert isinstance(load_config(write(job_dir, base()), (f"{key_path}={text}",)), JobConfig)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("roles", "key", "words"),
    [
        ({"worker": {"count": 100_000_000_000}}, "roles.worker.count",
         ["= 100000000000", "more than 10,000 processes in one role", "10000 or less"]),
        ({"worker": {"count": 10_001}}, "roles.worker.count", ["10,000"]),
        ({"worker": {"count": 6000}, "ps": {"count": 5000}}, "roles",
         ["11,001 processes in all", "worker 6,000", "ps 5,000", "chief 1", "limit of 10,000"]),
    ],
)
def test_role_counts_have_an_upper_bound(job_dir: Path, roles: dict[str, Any], key: str,
                                         words: list[str]) -> None:
    """A slip such as count: 100000000000 fails at once, instead of building the processes' slots."""
    strategy = "parameter_server" if "ps" in roles else "allreduce"
    line = problem_line(fails(job_dir, base(framework="tensorflow", strategy=strategy, roles=roles)), key)
    for word in words:
        assert word in line, (word, line)


def test_override_value_failing_validation_points_at_the_override(job_dir: Path) -> None:
    line = problem_line(fails(job_dir, base(), ("roles.worker.count=0",)), "roles.worker.count")
    assert "from --set roles.worker.count" in line


def test_override_into_a_scalar_set_in_the_file(job_dir: Path) -> None:
    message = fails(job_dir, base(params={"lr": 0.1}), ("params.lr.x=1",))
    assert "params.lr is 0.1, not a mapping" in message


# -- secrets -----------------------------------------------------------------------------------------


def test_secret_from_missing_env_var(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDKIT_TEST_NO_SUCH_VAR", raising=False)
    config = load_config(write(job_dir, base(secrets={"TOKEN": {"env": "SHARDKIT_TEST_NO_SUCH_VAR"}})))
    assert "NOT SET" in describe(config)
    with pytest.raises(ConfigError) as info:
        config.secret_values()
    line = problem_line(str(info.value), "secrets.TOKEN.env")
    assert "SHARDKIT_TEST_NO_SUCH_VAR is not set" in line
    assert "export SHARDKIT_TEST_NO_SUCH_VAR=" in line
    with pytest.raises(ConfigError, match="SHARDKIT_TEST_NO_SUCH_VAR"):
        build_spec(config)  # before any process could start


def test_secret_from_missing_file(job_dir: Path) -> None:
    config = load_config(write(job_dir, base(secrets={"TOKEN": {"file": "no/such/token"}})))
    assert config.secrets["TOKEN"].file == job_dir / "no" / "such" / "token"
    assert "MISSING" in describe(config)
    with pytest.raises(ConfigError) as info:
        config.secret_values()
    line = problem_line(str(info.value), "secrets.TOKEN.file")
    assert str(job_dir / "no" / "such" / "token") in line
    assert "FileNotFoundError" in line


def test_a_long_path_is_named_whole_and_a_longer_value_keeps_its_ends(job_dir: Path) -> None:
    """An error cut a value at 80 characters: a long path (a deep temporary folder, say) lost the
    part that tells where it is. Up to 400 characters a value is shown whole; past that, its middle goes."""
    deep = job_dir.joinpath(*[f"level-{i:02d}" for i in range(20)]) / "token"
    assert len(str(deep)) > 200
    config = load_config(write(job_dir, base(secrets={"TOKEN": {"file": str(deep)}})))
    with pytest.raises(ConfigError) as info:
        config.secret_values()
    assert f"= '{deep}'" in problem_line(str(info.value), "secrets.TOKEN.file")

    words = " ".join(f"w{i}" for i in range(300))
    with pytest.raises(ConfigError) as info:
        load_config(write(job_dir, base(name=words)))
    line = problem_line(str(info.value), "name")
    shown = line.split(" = ", 1)[1].split(" (line", 1)[0].split(": ", 1)[0]
    assert shown.startswith("'w0 w1 "), shown
    assert shown.endswith(" w298 w299'"), shown
    assert "..." in shown, shown
    assert len(shown) <= 400, len(shown)


def test_every_missing_secret_is_listed_at_once(job_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    for var in ("SHARDKIT_TEST_NO_A", "SHARDKIT_TEST_NO_B"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SHARDKIT_TEST_SET", "a-value-that-is-set")
    secrets = {"A": {"env": "SHARDKIT_TEST_NO_A"}, "OK": {"env": "SHARDKIT_TEST_SET"},
               "B": {"env": "SHARDKIT_TEST_NO_B"}, "C": {"file": "no/such/token"}}
    config = load_config(write(job_dir, base(secrets=secrets)))
    with pytest.raises(ConfigError) as info:
        config.secret_values()
    message = str(info.value)
    assert "3 problems" in message
    assert "SHARDKIT_TEST_NO_A is not set" in problem_line(message, "secrets.A.env")
    assert "SHARDKIT_TEST_NO_B is not set" in problem_line(message, "secrets.B.env")
    assert "FileNotFoundError" in problem_line(message, "secrets.C.file")
    assert "secrets.OK" not in message
    assert "a-value-that-is-set" not in message
    run = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(job_dir / "job.yaml")],
                         capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    for key in ("secrets.A.env", "secrets.B.env", "secrets.C.file"):  # one run lists them all
        assert key in run.stderr


def test_secret_file_unreadable(job_dir: Path) -> None:
    (job_dir / "token").mkdir()  # unreadable as a file for every user, root included
    config = load_config(write(job_dir, base(secrets={"TOKEN": {"file": "token"}})))
    with pytest.raises(ConfigError, match=r"secrets\.TOKEN\.file .*IsADirectoryError"):
        config.secret_values()


def test_secret_values_never_leak(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SECRET", SECRET)
    (job_dir / "token").write_text(SECRET + "-file\n")
    (job_dir / "nul").write_text(SECRET + "\0")
    secrets = {"AWS_SECRET_ACCESS_KEY": {"env": "MY_SECRET"}, "TOKEN": {"file": "token"}}
    config = load_config(write(job_dir, base(secrets=secrets, data={"url": "ds"})))
    assert config.secret_values() == {"AWS_SECRET_ACCESS_KEY": SECRET, "TOKEN": SECRET + "-file"}
    spec = build_spec(config, heartbeat_addr="127.0.0.1:9")
    assert all(proc.env["AWS_SECRET_ACCESS_KEY"] == SECRET for proc in spec.processes)

    outputs = [repr(config), str(config), json.dumps(config.redacted()), describe(config), repr(spec),
               str(spec), *(json.dumps(proc.redacted_env()) for proc in spec.processes),
               *(repr(proc) for proc in spec.processes)]
    # errors raised while secrets are set: another secret missing, a NUL in a value, a bad key elsewhere
    broken = [
        base(secrets={**secrets, "OTHER": {"env": "SHARDKIT_TEST_NO_SUCH_VAR"}}),
        base(secrets={**secrets, "NUL": {"file": "nul"}}),
        base(secrets=secrets, roles={"worker": {"count": 0}}),
    ]
    for changes in broken:
        try:
            load_config(write(job_dir, changes)).secret_values()
        except ConfigError as e:
            outputs.append(str(e))
        else:
            pytest.fail(f"no error for {changes}")
    assert "holds a NUL" in outputs[-2]
    for text in outputs:
        assert SECRET not in text, text


PS = {"framework": "torch", "strategy": "parameter_server",
      "roles": {"ps": {"count": 1}, "worker": {"count": 2}}}


@pytest.mark.parametrize(("optimizer", "key", "words"), [
    ({"name": "adamw", "lr": 0.01}, "params.optimizer.name", ["'adamw'", "not a parameter-server optimizer",
                                                              "['adam', 'sgd']"]),
    ({"lr": 0.01}, "params.optimizer", ["must be a mapping with a 'name'", "{name: sgd, lr: 0.05}"]),
    ("sgd", "params.optimizer", ["must be a mapping with a 'name'"]),
    ({"name": "sgd", "lr": 0.1, "betas": [0.9, 0.99]}, "params.optimizer", ["option(s) ['betas']",
                                                                            "sgd takes"]),
    ({"name": "adam", "lr": 0}, "params.optimizer.lr", ["= 0", "must be a number > 0"]),
])
def test_a_torch_ps_optimizer_is_checked_when_the_config_loads(job_dir: Path, optimizer: Any, key: str,
                                                               words: list[str]) -> None:
    """The check the workers make (torch_ps_server), at load time: `shardkit validate` and `shardkit
    train` stop before any process starts, instead of every attempt failing in the workers."""
    line = problem_line(fails(job_dir, base(**PS, params={"optimizer": optimizer})), key)
    for word in words:
        assert word in line, line


def test_only_a_torch_ps_job_reads_params_optimizer(job_dir: Path) -> None:
    assert load_config(write(job_dir, base(**PS, params={"optimizer": {"name": "Adam", "lr": 0.01}})))
    assert load_config(write(job_dir, base(**PS, params={"lr": 0.1})))
    assert load_config(write(job_dir, base(params={"optimizer": {"name": "adamw"}})))  # the script's own
    tf_ps = base(framework="tensorflow", strategy="parameter_server", roles={"ps": {"count": 1},
                 "worker": {"count": 1}}, params={"optimizer": "adamw"})
    assert load_config(write(job_dir, tf_ps))


def test_shardkit_validate_refuses_a_bad_ps_optimizer_without_importing_torch(job_dir: Path) -> None:
    import subprocess

    path = write(job_dir, base(**PS, params={"optimizer": {"name": "adamw", "lr": 0.01}}))
    result = subprocess.run([sys.executable, "-m", "shardkit.cli", "validate", str(path)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "params.optimizer.name = 'adamw'" in result.stderr + result.stdout
    good = write(job_dir, base(**PS, params={"optimizer": {"name": "adam", "lr": 0.01}}), "good.yaml")
    code = ("import sys; from shardkit.job.config import load_config; "
            f"load_config({str(good)!r}); print('torch' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            check=True)
    assert loaded.stdout.strip() == "False", loaded.stderr


# -- what YAML makes of a value, and values the processes would not get as written --------------------

HEAD = "name: digits\nentrypoint: train.py\nframework: torch\nroles: {worker: {count: 2}}\n"


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        # non-string keys: pydantic's "Keys should be strings" and a key True shown as 1
        ({"roles": {"worker": {"resources": {1: 2}}}}, "roles.worker.resources.1",
         ["a key that is not a string (integer 1)", "quote the key"]),
        ({"roles": {"worker": {}, True: {}}}, "roles.True", ["boolean True", "yes/no/on/off", "worker, ps"]),
        ({"env": {True: "x"}}, "env.True", ["boolean True", "yes/no/on/off", "quote the key"]),
        # the fix says what YAML made of the value
        ({"roles": {"worker": {"count": True}}}, "roles.worker.count", ["a boolean", "yes/no/on/off"]),
        ({"data": {"url": "ds", "shuffle": 1}}, "data.shuffle", ["an integer where", "write true or false"]),
        ({"name": 123}, "name", ["an integer where", "quote it ('123')"]),
        ({"entrypoint": None}, "entrypoint", ["a null where", "write entrypoint: train.py"]),
        ({"checkpoint": {"every_seconds": 0}}, "checkpoint.every_seconds",
         ["= 0", "it must be greater than 0", "set it to a number greater than 0"]),
        ({"roles": {"ps": {}}}, "roles.worker", ["an allreduce job needs workers"]),
        # .inf and .nan are no timeout, interval or CPU count
        ({"fault_tolerance": {"heartbeat_timeout": float("inf")}}, "fault_tolerance.heartbeat_timeout",
         ["= inf", "not a finite number"]),
        ({"fault_tolerance": {"startup_timeout": float("nan")}}, "fault_tolerance.startup_timeout",
         ["not a finite number"]),
        ({"checkpoint": {"every_seconds": float("inf")}}, "checkpoint.every_seconds",
         ["not a finite number"]),
        ({"roles": {"worker": {"resources": {"cpus": float("inf")}}}}, "roles.worker.resources.cpus",
         ["not a finite number"]),
        # memory: the value as written, and sizes no 64-bit count holds
        ({"roles": {"worker": {"resources": {"memory": "0.4"}}}}, "roles.worker.resources.memory",
         ["= '0.4'", "less than 1 byte", "512M"]),
        ({"roles": {"worker": {"resources": {"memory": 1.5}}}}, "roles.worker.resources.memory",
         ["= 1.5", "1.5G"]),
        ({"roles": {"worker": {"resources": {"memory": "99999999999P"}}}}, "roles.worker.resources.memory",
         ["8 EiB or more"]),
        ({"roles": {"worker": {"resources": {"memory": 2**63}}}}, "roles.worker.resources.memory", ["8 EiB"]),
        # an empty path would be the config file's folder itself
        ({"logdir": ""}, "logdir", ["the logdir is empty"]),
        ({"checkpoint": {"dir": " "}}, "checkpoint.dir", ["the checkpoint folder is empty"]),
        ({"secrets": {"T": {"file": ""}}}, "secrets.T.file", ["the file name is empty"]),
        # a protocol no filesystem serves fails here, not in every role
        ({"data": {"url": "foo://bucket/ds"}}, "data.url", ["= 'foo://bucket/ds'", "protocol 'foo'"]),
        ({"checkpoint": {"dir": "s4://bucket/ck"}}, "checkpoint.dir", ["protocol 's4'", "s3://"]),
        ({"data": {"url": "simplecache::foo://b/ds"}}, "data.url", ["protocol 'foo'"]),
        # a NUL (YAML's "\0") ended in "ValueError: embedded null byte" when train made the logdir or
        # started a process
        ({"logdir": "lo\0g"}, "logdir", ["'lo\\x00g'", "NUL character", "remove the \\0"]),
        ({"data": {"url": "s3://bucket/d\0s"}}, "data.url", ["NUL character"]),
        ({"checkpoint": {"dir": "c\0k"}}, "checkpoint.dir", ["NUL character"]),
        ({"env": {"A": "x\0y"}}, "env.A", ["NUL character"]),
        # environment variables are not expanded: `$SCRATCH/runs` made a folder named "$SCRATCH"
        ({"logdir": "$SCRATCH/runs"}, "logdir", ["$SCRATCH", "do not expand variables",
                                                  '--set <this key>="$SCRATCH/..."']),
        ({"entrypoint": "${CODE}/train.py"}, "entrypoint", ["${CODE}", "do not expand"]),
        ({"checkpoint": {"dir": "ck/$RUN"}}, "checkpoint.dir", ["$RUN"]),
        # a secret from a variable no environment can have would only ever be "not set"
        ({"secrets": {"S": {"env": "MY SECRET"}}}, "secrets.S.env", ["not an environment variable name"]),
        # more than any machine has, or beats no one can use: slips that passed
        ({"roles": {"worker": {"count": 1, "resources": {"gpus": 10**30}}}}, "roles.worker.resources.gpus",
         ["less than or equal to 256"]),
        ({"roles": {"worker": {"count": 1, "resources": {"cpus": 1e6}}}}, "roles.worker.resources.cpus",
         ["less than or equal to 4096"]),
        ({"fault_tolerance": {"heartbeat_interval": 1e-300}}, "fault_tolerance.heartbeat_interval",
         ["greater than or equal to 0.01"]),
    ],
)
def test_what_yaml_made_of_a_value_is_in_the_fix(job_dir: Path, changes: dict[str, Any], key: str,
                                                 words: list[str]) -> None:
    line = problem_line(fails(job_dir, base(**changes)), key)
    for word in words:
        assert word in line, (word, line)


@pytest.mark.parametrize(
    ("section", "key", "words"),
    [
        ("params: {lr: .inf}", "params.lr", ["= inf", "not a finite number", "becomes null"]),
        ("params: {lr: .nan}", "params.lr", ["not a finite number"]),
        ("params: {classes: {1: cat, 2: dog}}", "params.classes.1", ["not a string (integer 1)", "'1': ..."]),
        ("params: {yes: 1}", "params.True", ["boolean True", "yes/no/on/off"]),
        ("params: {start: 2024-01-01}", "params.start", ["a date", "quote it ('2024-01-01')"]),
        ("params: {blob: !!binary /w==}", "params.blob", ["binary data", "JSON cannot hold"]),
        ("params: {tags: !!set {a, b}}", "params.tags", ["a set", "write a list"]),
        ("params: {a: &a [1, *a]}", "params.a.1", ["contains itself"]),
        ("engine: {name: local, grace: .nan}", "engine.grace", ["= nan", "not a finite number"]),
        ("data: {url: ds, options: {filter: [[day, '>=', 2024-01-01]]}}", "data.options.filter.0.2",
         ["a date", "quote it"]),
    ],
)
def test_free_form_values_reach_the_processes_as_written_or_fail(job_dir: Path, section: str, key: str,
                                                                 words: list[str]) -> None:
    """``params``, ``data.options`` and engine options travel to the roles as JSON (job.json): a value
    JSON would change (a .inf becomes null, a key 1 becomes "1", a date a string) or cannot hold (bytes,
    a value containing itself, which crashed `shardkit train` after `validate` passed) fails here."""
    line = problem_line(fails(job_dir, HEAD + section + "\n"), key)
    for word in words:
        assert word in line, (word, line)


def test_plain_free_form_values_and_small_aliases_load_and_round_trip(job_dir: Path) -> None:
    text = """\
name: digits
entrypoint: train.py
framework: torch
roles: {worker: {count: 2}}
params:
  layers: &layers [64, 32]
  encoder: {layers: *layers, dropout: 0.1, act: relu, norm: null, frozen: false}
  decoder: {layers: *layers}
  classes: {'1': cat, '2': dog}
  start: '2024-01-01'
data: {url: s3://bucket/ds, options: {filter: [[day, '>=', '2024-01-01']]}}
"""
    config = load_config(write(job_dir, text))
    assert config.params["decoder"] == {"layers": [64, 32]}
    assert JobConfig.from_redacted(json.loads(json.dumps(config.redacted()))).params == config.params


def test_yaml_aliases_that_expand_past_the_limit_fail_at_once(job_dir: Path) -> None:
    """A "billion laughs": 9 lines that mean 1.2 billion values. `validate` passed it and `train` then
    spent all memory writing job.json; now it fails at load, counting each shared value once."""
    lines = ["params:", "  a: &a [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  {b}: &{b} [{', '.join([f'*{a}'] * 10)}]" for a, b in zip("abcdefgh", "bcdefghi",
                                                                          strict=True)]
    line = problem_line(fails(job_dir, HEAD + "\n".join(lines) + "\n"), "params")
    assert "1,234,567,900 values" in line
    assert "limit of 1,000,000" in line
    assert "(line 5)" in line


@pytest.mark.parametrize(
    ("make", "entrypoint", "words"),
    [
        ("notes.txt", "notes.txt", ["notes.txt is not a Python script (.py)", "package.module:function"]),
        ("pkg/", "pkg", ["pkg is a folder, not a script", ".py file"]),
        (None, "train.py --lr 3", ["without command-line arguments", "entrypoint: train.py", "params"]),
    ],
)
def test_an_entrypoint_must_be_a_python_script(job_dir: Path, make: str | None, entrypoint: str,
                                               words: list[str]) -> None:
    if make is not None and make.endswith("/"):
        (job_dir / make).mkdir()
    elif make is not None:
        (job_dir / make).write_text("not python\n")
    line = problem_line(fails(job_dir, base(entrypoint=entrypoint)), "entrypoint")
    assert f"= '{entrypoint}'" in line
    for word in words:
        assert word in line, (word, line)


def test_urls_keep_their_protocols(job_dir: Path) -> None:
    """fsspec's chained URLs were taken for relative paths (``<folder>/simplecache::s3:/bucket/ds``); a
    known protocol whose package is not installed here is kept: the job's machines may have it."""
    config = load_config(write(job_dir, base(data={"url": "simplecache::s3://bucket/ds"},
                                             checkpoint={"dir": "gs://bucket/ck"})))
    assert config.data is not None
    assert config.data.url == "simplecache::s3://bucket/ds"
    assert config.checkpoint_dir == "gs://bucket/ck"


@pytest.mark.parametrize(
    ("text", "where", "tag"),
    [
        ('params: !!python/object/apply:os.system ["echo pwned"]\n', "line 5, column 9",
         "!!python/object/apply:os.system"),
        ("params: {f: !!python/name:os.system }\n", "line 5, column 13", "!!python/name:os.system"),
        ("params: {x: !custom 1}\n", "line 5, column 13", "!custom"),
    ],
)
def test_yaml_tags_that_build_objects_are_refused_as_such(job_dir: Path, text: str, where: str,
                                                          tag: str) -> None:
    """Safe loading refuses them; the message says why and what to do (it said "YAML syntax error ... Fix:
    correct the indentation, a missing ':' ...")."""
    message = fails(job_dir, HEAD + text)
    assert f"at {where}: the tag {tag} is not allowed" in message
    assert "Fix: remove the tag" in message
    assert "syntax error" not in message
    message = fails(job_dir, base(), (f"params.x={text.partition(': ')[2].strip()}",))
    assert "is not allowed" in message
    assert "Fix: remove the tag" in message


# -- the config file itself ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("s3://bucket/job.yaml", ["job config 's3://bucket/job.yaml'", "not a URL", "copy it here first"]),
        ("https://example.com/job.yaml", ["'https://example.com/job.yaml'", "not a URL"]),
        ("", ["job config path '' is empty", "Fix: give the path of a YAML job config"]),
    ],
)
def test_a_config_path_that_is_no_local_file(path: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_config_path_that_is_a_folder_names_the_yaml_files_in_it(job_dir: Path) -> None:
    write(job_dir, base(), "digits.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(job_dir)
    assert f"job config {job_dir}: it is a folder, not a file; it holds digits.yaml" in str(info.value)
    assert f"Fix: give the YAML file, e.g. {job_dir / 'digits.yaml'}" in str(info.value)


def test_a_file_url_is_a_local_path(job_dir: Path) -> None:
    assert load_config(f"file://{write(job_dir, base())}").name == "digits"


def test_an_unreadable_or_binary_config_file(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(job_dir, base())
    if os.geteuid() != 0:
        path.chmod(0)
    else:  # root reads any file: refuse this one as the kernel would refuse another user
        read_text = Path.read_text

        def refuse(self: Path, *args: Any, **kwargs: Any) -> str:
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return read_text(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"job config {path}: this user (uid {os.geteuid()}) may not read it (Permission denied)" in str(
        info.value)
    assert "Fix: make it readable (chmod a+r)" in str(info.value)
    monkeypatch.undo()
    path.chmod(0o644)
    path.write_bytes(b"name: \xff\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xff at offset 6\)\. Fix: give the YAML"):
        load_config(path)


@pytest.mark.parametrize(("text", "holds"), [("", "is empty"), ("# nothing\n", "is empty"),
                                             ("- a\n", "holds a list"), ("3\n", "holds an integer")])
def test_a_file_that_is_not_a_mapping_says_what_it_holds(job_dir: Path, text: str, holds: str) -> None:
    assert f"the file {holds}, not a mapping of keys" in fails(job_dir, text)


def test_collections_nested_too_deep_are_a_config_error_not_a_recursion_error(job_dir: Path) -> None:
    """PyYAML parses nesting recursively: a few hundred levels ended in a RecursionError traceback."""
    deep = "[" * 3000 + "]" * 3000
    message = fails(job_dir, HEAD + f"params: {{x: {deep}}}\n")
    assert "nest too deep for the YAML parser" in message
    assert "Fix: nest them less" in message
    assert "nest too deep" in fails(job_dir, base(), (f"params.x={deep}",))
    nested: list[Any] = []
    for _ in range(5000):  # built in Python: refused before anything walks it recursively
        nested = [nested]
    with pytest.raises(ConfigError, match=r"params\.x\.0\.0.*: it nests more than 200 levels deep"):
        JobConfig.from_dict(base(params={"x": nested}), base_dir=job_dir)


def test_an_override_value_with_a_key_written_twice_is_refused_as_in_the_file(job_dir: Path) -> None:
    """The file refuses a key written twice; an override's value kept the last one silently."""
    message = fails(job_dir, base(), ("params={lr: 0.1, lr: 0.5}",))
    assert "override 'params={lr: 0.1, lr: 0.5}': params.lr is written twice. Fix: keep one" in message


def test_a_problem_in_an_overridden_section_points_at_the_override_not_the_file(job_dir: Path) -> None:
    """``--set roles=...`` replaces the file's roles: a problem inside it was put on the file's line."""
    line = problem_line(fails(job_dir, base(), ("roles={worker: {count: 0}}",)), "roles.worker.count")
    assert "(from --set roles)" in line
    assert "line" not in line.partition(":")[0]


def test_a_logdir_problem_is_told_once_not_again_for_the_checkpoint_dir_made_from_it(job_dir: Path) -> None:
    for logdir in ("$SCRATCH/runs", "lo\0g"):
        message = fails(job_dir, base(logdir=logdir))
        assert "1 problem" in message, message
        assert "checkpoint.dir" not in message, message
    assert load_config(write(job_dir, base(logdir="runs/$5"))).logdir.name == "$5"  # not a variable name


# -- env: entries whose names look like credentials ------------------------------------------------

@pytest.mark.parametrize(("name", "word"), [
    ("API_TOKEN", "TOKEN"), ("HF_TOKEN", "TOKEN"), ("GITHUB_TOKENS", "TOKEN"), ("HFTOKEN", "TOKEN"),
    ("hfToken", "TOKEN"), ("AWS_SECRET_ACCESS_KEY", "SECRET"), ("AWS_ACCESS_KEY_ID", "KEY"),
    ("OPENAI_API_KEY", "KEY"), ("WANDB_APIKEY2", "KEY"), ("apiKey", "KEY"), ("DB_PASSWORD", "PASSWORD"),
    ("PGPASSWORD", "PASSWORD"), ("SMTP_PASSWD", "PASSWD"), ("SMTP_PASS", "PASS"), ("MYSQL_PWD", "PWD"),
    ("GOOGLE_APPLICATION_CREDENTIALS", "CREDENTIAL"), ("GCP_CREDS", "CRED"), ("OAUTH_CLIENT", "AUTH"),
    ("HTTP_AUTHORIZATION", "AUTHORIZATION"), ("GITHUB_PAT", "PAT"), ("GPG_PASSPHRASE", "PASSPHRASE"),
    ("SORT_KEY", "KEY"), ("SSH_AUTH_SOCK", "AUTH"),  # look like credentials and are not: masked all the same
    ("TOKENIZERS_PARALLELISM", None), ("KEYBOARD_LAYOUT", None), ("GIT_AUTHOR_NAME", None), ("PWD", None),
    ("OLDPWD", None), ("PATH", None), ("OMP_NUM_THREADS", None), ("NCCL_SOCKET_IFNAME", None),
    ("ACCESS_LOG", None), ("PASSES", None), ("MONKEYPATCH", None),
])
def test_which_env_names_look_like_credentials(name: str, word: str | None) -> None:
    from shardkit.job.config.values import secret_word

    assert secret_word(name) == word


@given(prefix=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
       word=st.sampled_from(["TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIALS", "AUTH", "PASS",
                             "PWD", "api_key", "Token"]))
def test_a_credential_word_as_a_part_of_its_own_makes_any_name_a_credential(prefix: str, word: str) -> None:
    from shardkit.job.config.values import secret_word

    assert secret_word(f"{prefix}_{word}") is not None
    assert secret_word(f"{word}_{prefix}") is not None


def test_an_env_credential_warns_once_per_name_and_is_a_secret_by_name_only(
        job_dir: Path, recwarn: pytest.WarningsRecorder) -> None:
    from shardkit.errors import SecretInEnvWarning

    env = {"API_TOKEN": SECRET, "DB_PASSWORD": "pw", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": 1}
    config = load_config(write(job_dir, base(env=env, secrets={"PASSWORD": {"file": "train.py"}})))
    messages = sorted(str(w.message) for w in recwarn if w.category is SecretInEnvWarning)
    assert len(messages) == 2, messages  # one per credential-named variable, none for the others
    assert len(recwarn) == 2
    token, password = messages  # sorted: env.API_TOKEN, env.DB_PASSWORD
    assert token.startswith("env.API_TOKEN looks like a credential (its name has TOKEN)")
    assert "Fix: move it under secrets:, e.g. secrets: {API_TOKEN: {env: MY_API_TOKEN}}" in token
    assert "a value under 4 characters is not masked" in password  # "pw" is too short to mask
    assert "a value under" not in token
    assert recwarn[0].filename == __file__  # where the config was loaded, not pydantic's insides
    assert SECRET not in " ".join(messages)

    # a warning, not a refusal: the value reaches the processes, and files name it only
    assert config.env["API_TOKEN"] == SECRET
    assert config.env_secrets == ["API_TOKEN", "DB_PASSWORD"]
    assert config.secret_names == ["API_TOKEN", "DB_PASSWORD", "PASSWORD"]
    assert config.plain_env == {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    values = config.secret_values()
    assert values["API_TOKEN"] == SECRET
    assert values["DB_PASSWORD"] == "pw"
    data = json.loads(json.dumps(config.redacted()))
    assert data["env"] == {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    assert data["secrets"] == ["API_TOKEN", "DB_PASSWORD", "PASSWORD"]
    again = JobConfig.from_redacted(data)  # inside a role: every secret from its own variable, no warning
    assert again.redacted() == data
    assert again.secrets["API_TOKEN"].env == "API_TOKEN"
    assert len(recwarn) == 2

    spec = build_spec(config, heartbeat_addr="127.0.0.1:9")
    for proc in spec.processes:
        assert proc.env["API_TOKEN"] == SECRET
        assert proc.redacted_env()["API_TOKEN"] == "<redacted>"
        assert proc.redacted_env()["TOKENIZERS_PARALLELISM"] == "false"
    text = describe(config)
    assert "env: OMP_NUM_THREADS, TOKENIZERS_PARALLELISM" in text
    assert "secret API_TOKEN: from env: in the config" in text
    for output in (text, json.dumps(data), repr(config), str(config),
                   *(json.dumps(p.redacted_env()) for p in spec.processes)):
        assert SECRET not in output


def test_validate_warns_once_about_an_env_credential(job_dir: Path) -> None:
    path = write(job_dir, base(env={"WANDB_API_KEY": SECRET}))
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "validate", str(path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("warning: env.WANDB_API_KEY looks like a credential") == 1, done.stderr
    assert "secret WANDB_API_KEY: from env: in the config" in done.stdout
    assert SECRET not in done.stdout + done.stderr


def test_the_reader_arguments_a_config_may_name_are_make_readers() -> None:
    """data.options are checked against a list of make_reader's arguments kept beside the config (so that
    loading a config does not import the reader); it must be make_reader's signature."""
    import inspect

    from shardkit.job.config.sections import READER_ARGUMENTS
    from shardkit.reader.api import make_reader

    assert tuple(inspect.signature(make_reader).parameters) == READER_ARGUMENTS


def test_loading_a_config_does_not_import_the_reader(tmp_path: Path) -> None:
    """The supervisor loads the config first: the reader's pyarrow.dataset and pandas there were most of
    the time before a job's first process started."""
    code = ("import sys; from shardkit.job.config import load_config; "
            f"load_config({str(REPO / 'examples' / 'digits.yaml')!r}, []); "
            "print(sorted(m for m in ('shardkit.reader', 'pandas', 'pyarrow.dataset') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
