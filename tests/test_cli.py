"""The ``shardkit`` command: ``inspect`` (text and ``--json``) and ``index``, and its errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pytest

import shardkit
from shardkit.cli import main
from tests.reader import conftest as s3_fixtures

if TYPE_CHECKING:
    from tests.reader.conftest import S3Server

REPO = Path(__file__).resolve().parents[1]
no_internet = s3_fixtures.no_internet  # refuses any connection that is not to loopback
s3_server, s3_bucket = s3_fixtures.s3_server, s3_fixtures.s3_bucket


@pytest.fixture
def dataset(tmp_path: Path) -> shardkit.Dataset:
    schema = shardkit.Schema(
        [
            shardkit.Field("id", "int64"),
            shardkit.Field("image", "uint8", (8, 8), codec=shardkit.ImageCodec("png")),
            shardkit.Field("vec", "float32", (None,), nullable=True),
            shardkit.Field("label", "str"),
        ]
    )
    n = 40
    data = {
        "id": np.arange(n),
        "image": np.zeros((n, 8, 8), np.uint8),
        "vec": [np.ones(i % 3, np.float32) if i % 5 else None for i in range(n)],
        "label": [f"l{i % 4}" for i in range(n)],
    }
    return shardkit.write_dataset(data, tmp_path / "ds", schema=schema, row_group_size=6, file_size="1KiB")


@pytest.fixture
def plain_folder(tmp_path: Path) -> str:
    folder = tmp_path / "plain"
    folder.mkdir()
    pd.DataFrame({"a": np.arange(7), "b": list("abcdefg")}).to_parquet(folder / "x.parquet", row_group_size=3)
    return os.fspath(folder)


def test_inspect_json(dataset: shardkit.Dataset, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", dataset.url, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    info = json.loads(out)
    assert info["url"] == dataset.url
    assert info["kind"] == "shardkit"
    assert info["rows"] == 40
    assert info["row_groups"] == len(dataset.row_groups) == 7
    assert info["bytes"] == dataset.num_bytes == sum(f["bytes"] for f in info["files"])
    assert info["fields"] == [f.to_json() for f in dataset.schema]
    assert info["fields"][1] == {
        "name": "image",
        "dtype": "uint8",
        "shape": [8, 8],
        "codec": {"name": "image", "format": "png", "quality": 95},
        "nullable": False,
    }
    assert [f["file"] for f in info["files"]] == dataset.files
    assert len(info["files"]) > 1
    for entry in info["files"]:
        groups = [rg for rg in dataset.row_groups if rg.file == entry["file"]]
        assert entry["row_groups"] == len(groups)
        assert entry["rows"] == sum(rg.num_rows for rg in groups)
        assert entry["bytes"] == sum(rg.num_bytes for rg in groups)
    assert sum(f["rows"] for f in info["files"]) == 40


def test_inspect_text(dataset: shardkit.Dataset, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", dataset.url]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{dataset.url}  (shardkit dataset)"
    assert lines[1].startswith(f"40 rows in 7 row groups, {len(dataset.files)} files, ")
    rows = [line.split() for line in lines]
    assert ["image", "uint8", "(8,", "8)", "image(format=png,", "quality=95)", "no"] in rows
    assert ["vec", "float32", "(None)", "ndarray", "yes"] in rows
    assert ["field", "dtype", "shape", "codec", "nullable"] in rows
    for name in dataset.files:
        assert name in out


def test_inspect_plain_folder_prints_the_warning(
    plain_folder: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", plain_folder, "--json"]) == 0  # filterwarnings=error: no Python warning escapes
    out, err = capsys.readouterr()
    assert err.startswith("warning: ")
    assert "write_summary" in err
    assert "shardkit index" in err
    info = json.loads(out)
    assert info["kind"] == "parquet"
    assert info["rows"] == 7
    assert info["files"] == [{"file": "x.parquet", "row_groups": 3, "rows": 7, "bytes": info["bytes"]}]


def test_index_writes_the_summary(plain_folder: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["index", plain_folder]) == 0
    out, err = capsys.readouterr()
    assert out == f"wrote {plain_folder}/_metadata: 3 row groups in 1 files\n"
    assert err == ""
    assert os.path.exists(os.path.join(plain_folder, "_metadata"))
    assert main(["inspect", plain_folder]) == 0
    assert capsys.readouterr().err == ""  # no more warning
    shardkit.open_dataset(plain_folder)  # and none from Python either


def test_index_of_a_shardkit_dataset_names_the_parts_it_leaves_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The parts of a write that did not commit are not indexed; the CLI says so on stderr."""
    url = os.fspath(tmp_path / "ds")
    kept = shardkit.write_dataset({"x": np.arange(10)}, url)
    other = shardkit.write_dataset({"x": np.full(5, -1)}, os.fspath(tmp_path / "other"))
    stray = other.files[0]
    os.replace(os.path.join(other.url, stray), os.path.join(url, stray))  # as a killed overwrite leaves it
    assert main(["index", url]) == 0
    out, err = capsys.readouterr()
    assert out == f"wrote {url}/_metadata: 1 row groups in 1 files\n"
    assert err.startswith("warning: ")
    assert stray in err
    assert shardkit.open_dataset(url).files == kept.files


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["inspect", "{tmp}/missing"], ["shardkit inspect: error:", "no dataset at", "{tmp}/missing"]),
        (["inspect", "{tmp}/empty"], ["shardkit inspect: error:", "{tmp}/empty", "no Parquet data"]),
        (["inspect", "{tmp}/corrupt"], ["shardkit inspect: error:", "bad.parquet", "truncated or corrupt"]),
        (["index", "{tmp}/missing"], ["shardkit index: error:", "{tmp}/missing", "does not exist"]),
        (["index", "{tmp}/empty"], ["shardkit index: error:", "no Parquet data files to index"]),
    ],
)
def test_errors_exit_2_with_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "bad.parquet").write_bytes(b"PAR1 nothing here PAR1")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    for needle in needles:
        assert needle.format(tmp=tmp_path) in err
    assert not os.path.exists(tmp_path / "missing")
    assert os.listdir(tmp_path / "empty") == []


@pytest.mark.parametrize("argv", [[], ["inspect"], ["frobnicate", "x"], ["inspect", "x", "--yaml"]])
def test_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: shardkit" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["inspect", "ds", "--yaml"], ["index", "ds", "--yaml"],
                                  ["validate", "job.yaml", "--yaml"], ["train", "job.yaml", "--yaml"],
                                  ["render", "job.yaml", "--yaml"], ["write", "a.csv", "ds", "--yaml"],
                                  ["bench", "ds", "--yaml"]], ids=lambda argv: argv[0])
def test_an_unknown_flag_prints_the_usage_of_its_command(argv: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """inspect, index, validate and train printed the usage of ``shardkit`` itself (its list of commands)
    and ``shardkit: error:``, as if the flag were the top level's."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: shardkit {argv[0]} "), err
    assert err.endswith(f"shardkit {argv[0]}: error: unrecognized arguments: --yaml\n"), err


def test_the_interrupted_line_knows_every_command() -> None:
    """main names the command of a Ctrl-C before argparse has read it: from its own list of them."""
    from shardkit.cli import _main as cli

    commands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    assert commands is not None
    assert set(commands) == cli._COMMANDS
    assert cli._interrupted(["--quiet", "train", "job.yaml"]) == "shardkit train: interrupted"
    assert cli._interrupted(["inpsect", "ds"]) == "shardkit: interrupted"


@pytest.mark.parametrize("command", ["inspect", "index", "bench"])
def test_the_help_of_a_command_says_what_its_url_is(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``url`` was listed with no help."""
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    positionals = capsys.readouterr().out.split("positional arguments:")[1].split("options:")[0]
    assert "any fsspec URL" in positionals, positionals


@pytest.mark.timeout(60)
def test_runs_as_a_program(dataset: shardkit.Dataset, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "inspect", dataset.url, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == 40
    done = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "inspect", str(tmp_path / "nothing")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "no dataset at" in done.stderr


def _job_yaml(tmp_path: Path, **extra: object) -> Path:
    import yaml

    config = {"name": "cli-job", "entrypoint": str(REPO / "tests" / "trainer" / "scripts" / "behave.py"),
              "framework": "tensorflow", "roles": {"worker": {"count": 1}}, "logdir": str(tmp_path / "job"),
              "params": {"steps": 3, "sleep": 0.0}, **extra}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_validate_prints_the_description(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _job_yaml(tmp_path)
    assert main(["validate", str(path), "--set", "roles.worker.count=3", "--set", "params.steps=9"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job cli-job: tensorflow allreduce, 3 processes")
    assert "worker[2], data shard 2/3" in out
    assert not (tmp_path / "job").exists()  # validate starts nothing


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["roles.worker.count=0"], "roles.worker.count = 0"),
        (["fault_tolerance.max_restart=1"], "unknown key fault_tolerance.max_restart"),
        (["strategy=parameter_server"], "roles.ps"),
    ],
)
def test_validate_and_train_exit_2_on_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   overrides: list[str], needle: str) -> None:
    path = _job_yaml(tmp_path)
    for command in ("validate", "train"):
        argv = [command, str(path)] + [arg for o in overrides for arg in ("--set", o)]
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith(f"shardkit {command}: error: ")
        assert needle in err
    assert not (tmp_path / "job").exists()


# Configs `train` refuses before starting anything, for their engine: `validate` must refuse them too.
ENGINE_REFUSALS = {
    "torchrun-runs-torch-allreduce-only": ["engine=torchrun"],
    "ray-unknown-option": ["engine={name: ray, bogus: 1}"],
    "local-negative-grace": ["engine={name: local, grace: -3}"],
    "torchrun-unknown-option": ['engine={name: torchrun, nnodez: "2"}'],
    "kubernetes-is-rendered": ["engine={name: kubernetes}"],
    "spark-unknown-option": ['engine={name: spark, mastr: "local[2]"}'],
    "torchrun-node-rank-past-nnodes": ["engine={name: torchrun, nnodes: 2, node_rank: 2}"],
}


@pytest.mark.parametrize("overrides", ENGINE_REFUSALS.values(), ids=ENGINE_REFUSALS.keys())
def test_validate_refuses_what_train_refuses_for_the_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str]) -> None:
    """A TensorFlow parameter-server job (as /tmp/hunt-tf's digits_tf_ps.yaml) on engines that refuse it
    or with options they do not take: both commands exit 2 with the same message, and nothing is made."""
    roles = {"worker": {"count": 2}, "ps": {"count": 1}}
    path = _job_yaml(tmp_path, strategy="parameter_server", roles=roles)
    errors = {}
    for command in ("validate", "train"):
        assert main([command, str(path), *(arg for o in overrides for arg in ("--set", o))]) == 2, command
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith(f"shardkit {command}: error: "), err
        errors[command] = err.removeprefix(f"shardkit {command}: error: ")
    assert errors["validate"] == errors["train"]
    assert "Fix:" in errors["validate"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]  # no logdir, nothing else


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_config_validates(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    existed = sorted((REPO / "runs").glob("*"))  # the examples' logdirs are runs/<name>
    assert main(["validate", str(example)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("job digits")
    assert "  engine: local" in out
    assert sorted((REPO / "runs").glob("*")) == existed  # validate makes no logdir


def test_train_exits_2_when_the_logdir_cannot_be_created(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("x")
    logdir = tmp_path / "afile" / "job"
    assert main(["train", str(_job_yaml(tmp_path)), "--set", f"logdir={logdir}"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("shardkit train: error: ")
    for word in (f"logdir = '{logdir}'", "cannot create it or write in it", "Not a directory",
                 "Fix: give a folder this user can create and write"):
        assert word in err, (word, err)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_train_runs_the_job(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(_job_yaml(tmp_path)),
                           "--set", "params.steps=4"], cwd=REPO, capture_output=True, text=True, timeout=50,
                          start_new_session=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "[worker-0] worker-0 attempt 0 starts at step 0" in proc.stdout
    assert "job cli-job succeeded" in proc.stdout
    assert "4 steps" in proc.stdout
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["steps"] == 4


def test_render_writes_or_prints_the_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = str(REPO / "examples" / "digits.yaml")
    out = tmp_path / "deploy"
    assert main(["render", example, "--engine", "kubernetes", "--set", "engine.image=reg/digits:1",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {out}/digits-config.yaml",
                                                    f"wrote {out}/digits-pytorchjob.yaml"]
    assert "kind: PyTorchJob" in (out / "digits-pytorchjob.yaml").read_text()
    assert main(["render", example, "--engine", "yarn"]) == 0
    assert "# ---- digits-skein.yaml ----" in capsys.readouterr().out
    assert main(["render", example]) == 2  # engine: local has nothing to render
    assert "has nothing to render" in capsys.readouterr().err


# ---- user errors below the API (filesystems, credentials, permissions): one line, exit 2 -------------


def _one_line_error(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, err
    assert err.startswith(f"shardkit {command}: error: "), err
    return err


def test_a_url_no_filesystem_serves_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "foo://bucket/ds"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "'foo://bucket/ds': no filesystem serves the protocol 'foo'" in _one_line_error(err, "inspect")


def test_a_missing_filesystem_package_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    assert main(["inspect", "gs://some-bucket/ds"]) == 2
    err = _one_line_error(capsys.readouterr().err, "inspect")
    assert "'gs://some-bucket/ds' needs gcsfs" in err
    assert "pip install gcsfs" in err
    with pytest.raises(shardkit.errors.MissingDependencyError, match="pip install gcsfs"):
        shardkit.open_dataset("gs://some-bucket/ds")


@pytest.mark.skipif(bool(os.environ.get("HADOOP_HOME") or os.environ.get("ARROW_LIBHDFS_DIR")),
                    reason="HDFS's native client may load here: the URL would try to connect")
def test_hdfs_without_its_native_client_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "hdfs:///warehouse/ds"]) == 2
    err = _one_line_error(capsys.readouterr().err, "inspect")
    assert "'hdfs:///warehouse/ds' needs HDFS's native client" in err
    assert "ARROW_LIBHDFS_DIR" in err


def test_s3_without_credentials_exits_2_naming_the_url_and_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        no_internet: None) -> None:
    s3fs = pytest.importorskip("s3fs")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    s3fs.S3FileSystem.clear_instance_cache()  # one made earlier may hold credentials
    try:
        assert main(["inspect", "s3://some-bucket/ds"]) == 2
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    err = _one_line_error(capsys.readouterr().err, "inspect")
    assert "cannot reach 's3://some-bucket/ds': no credentials were found" in err
    assert "AWS_ACCESS_KEY_ID" in err
    assert "NoCredentialsError" in err


def test_storage_options_reach_every_dataset_command(s3_server: S3Server, s3_bucket: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """write, inspect (one dataset and a mixture), verify and index reach a custom S3 endpoint (moto on
    loopback) by --storage-options alone: its credentials are nowhere else."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    opts = json.dumps(s3_server.storage_options)
    csv = tmp_path / "rows.csv"
    csv.write_text("id,label\n" + "".join(f"{i},l{i % 3}\n" for i in range(50)))
    url = f"s3://{s3_bucket}/ds"
    assert main(["write", str(csv), url, "--storage-options", opts, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["inspect", url, "--json", "--storage-options", opts]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 50
    assert main(["inspect", f"a={url}", f"b={url}", "--storage-options", opts]) == 0
    assert "100 samples per epoch" in capsys.readouterr().out
    assert main(["verify", url, "--json", "--storage-options", opts]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    fs = s3fs.S3FileSystem(**s3_server.storage_options)
    with fs.open(f"{s3_bucket}/plain/part-0.parquet", "wb") as f:
        pq.write_table(pa.table({"x": list(range(7))}), f)
    assert main(["index", f"s3://{s3_bucket}/plain", "--storage-options", opts]) == 0
    assert "1 row groups in 1 files" in capsys.readouterr().out


def test_index_of_a_read_only_folder_exits_2_naming_it(plain_folder: str) -> None:
    import shutil
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="shardkit-cli-"))  # tmp_path's parents admit only us
    try:
        shared.chmod(0o755)
        folder = shared / "plain"
        shutil.copytree(plain_folder, folder)
        folder.chmod(0o555)
        cmd = [sys.executable, "-m", "shardkit.cli", "index", str(folder)]
        if os.geteuid() == 0:  # root may write anywhere: index as another user
            if shutil.which("setpriv") is None:
                pytest.skip("as root this needs setpriv to run as another user")
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "HOME": str(shared)})
    finally:
        (shared / "plain").chmod(0o755)
        shutil.rmtree(shared)
    assert done.returncode == 2, done.stderr
    err = _one_line_error(done.stderr, "index")
    assert f"permission denied: cannot write in '{folder}'" in err
    assert "mode dr-xr-xr-x" in err


def test_an_oserror_the_api_does_not_wrap_is_one_line_not_a_traceback(
        plain_folder: str, capsys: pytest.CaptureFixture[str]) -> None:
    os.mkdir(os.path.join(plain_folder, "_metadata"))  # where index writes its summary: a folder
    assert main(["index", plain_folder]) == 2
    err = _one_line_error(capsys.readouterr().err, "index")
    assert "IsADirectoryError: " in err
    assert "_metadata" in err


# ---- what the job commands refuse before anything starts ----------------------------------------------


def test_version_and_a_description_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"shardkit {shardkit.__version__}\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out  # it printed the module's docstring: "The ``shardkit`` command: parses ..."
    assert "training jobs" in out


def test_python_dash_m_shardkit_is_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "shardkit", "--version"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert (done.returncode, done.stdout) == (0, f"shardkit {shardkit.__version__}\n"), done.stderr


@pytest.mark.parametrize("engine", ["foo", "local", "KUBERNETES"])
def test_render_engine_is_checked_as_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   engine: str) -> None:
    """An engine that renders nothing is a usage error (exit 2 with the usage), before the config is read;
    it was reported as "foo jobs are started by `shardkit train`"."""
    with pytest.raises(SystemExit) as info:
        main(["render", str(tmp_path / "no-such.yaml"), "--engine", engine])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardkit render")
    assert f"argument --engine: invalid choice: {engine!r} (choose from 'kubernetes', 'yarn'" in err
    assert "started by `shardkit train`" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        ({"params": {"steps": 3, "blob": b"\xff"}}, ["params.blob = b'\\xff'", "binary data (!!binary)"]),
        ({"data": {"url": "foo://bucket/ds"}}, ["data.url = 'foo://bucket/ds'", "protocol 'foo'"]),  # ran
        ({"checkpoint": {"every_seconds": float("inf")}}, ["checkpoint.every_seconds = inf", "not a finite"]),
        ({"env": {"A": "x\0y"}}, ["env.A = 'x\\x00y'", "NUL character"]),  # was: embedded null byte
    ],
    ids=["binary-param", "unknown-protocol", "infinite-interval", "nul-in-env"],
)
def test_train_refuses_before_anything_starts_what_validate_passed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict[str, object],
        needles: list[str]) -> None:
    """Configs `validate` passed and `train` then failed on after taking the logdir (a traceback: the
    binary param's UnicodeDecodeError), or ran (a data.url no role could open, when the script reads
    none): both exit 2 now, and nothing is made."""
    path = _job_yaml(tmp_path, **extra)
    for command in ("validate", "train"):
        assert main([command, str(path)]) == 2, command
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith(f"shardkit {command}: error: invalid job config"), err
        for needle in needles:
            assert needle in err, (needle, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]  # no logdir, no lock


def test_a_value_containing_itself_fails_train_before_the_logdir(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: cli-job\nentrypoint: {REPO / 'tests' / 'trainer' / 'scripts' / 'behave.py'}\n"
                    f"framework: tensorflow\nroles: {{worker: {{}}}}\nlogdir: {tmp_path / 'job'}\n"
                    "params: {steps: &s [1, *s]}\n")
    assert main(["train", str(path)]) == 2  # was: ValueError: Circular reference detected, a traceback
    err = capsys.readouterr().err
    assert "params.steps.1 (line 6): it contains itself" in err
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        ("s3://bucket/job.yaml", ["job config 's3://bucket/job.yaml': a job config is read from a file on "
                                  "this machine, not a URL", "Fix: copy it here first"]),
        ("{tmp}", ["job config {tmp}: it is a folder, not a file. Fix: give the YAML file"]),
        ("", ["job config path '' is empty. Fix:"]),
    ],
)
def test_a_config_path_that_is_no_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   config: str, needles: list[str]) -> None:
    """It said "job config <cwd>/s3:/bucket/job.yaml: it does not exist", and "[Errno 21] Is a
    directory" for a folder or an empty path."""
    for command in ("validate", "train", "render"):
        assert main([command, config.format(tmp=tmp_path)]) == 2
        err = _one_line_error(capsys.readouterr().err, command)
        for needle in needles:
            assert needle.format(tmp=tmp_path) in err, (needle, err)
    assert list(tmp_path.iterdir()) == []


def test_an_engine_option_problem_names_the_file_and_where_the_key_was_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Engine options are checked when the engine is built, after the config loaded: their errors had no
    file, no line and no ``--set`` (``engine.bogus=1: ...``), and ``--node-rank -1`` read as a config key."""
    path = _job_yaml(tmp_path, framework="torch", engine={"name": "ray", "num_cpus": -1})
    line = 1 + path.read_text().splitlines().index("  num_cpus: -1")
    cases = [
        (["validate", str(path)], f"- engine.num_cpus = -1 (line {line}): not a number >= 0. Fix: "),
        (["validate", str(path), "--set", "engine={name: spark, mastr: x}"],
         "- engine.mastr = 'x' (from --set engine): the spark engine has no option 'mastr'. Fix: did you "),
        (["train", str(path), "--set", 'engine={name: torchrun, nnodes: "2"}', "--node-rank", "-1"],
         "- engine.node_rank = -1 (from --node-rank): not a whole number >= 0. Fix: "),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"shardkit {argv[0]}: error: invalid job config {path}: 1 problem\n"), err
        assert needle in err, err
    assert not (tmp_path / "job").exists()


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """``shardkit inspect URL | head -1``: the reader left before the output was written; it printed
    ``error: BrokenPipeError`` (or Python's "Exception ignored ... BrokenPipeError") and exited 2 (120)."""
    url = str(tmp_path / "ds")
    shardkit.write_dataset({"id": np.arange(10)}, url)
    proc = subprocess.Popen([sys.executable, "-m", "shardkit", "inspect", url], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stderr is not None
    proc.stdout.close()  # gone before the first line
    with proc.stderr:
        err = proc.stderr.read()
    assert proc.wait(60) == 128 + signal.SIGPIPE
    assert err == b""
