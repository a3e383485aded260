"""``shardkit bench``: text and ``--json`` output on a real dataset, the options, and one-line errors."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
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
N = 50
# the moto S3 server on loopback and a fresh bucket per test (tests/reader/conftest.py)
s3_server, s3_bucket, no_internet = s3_fixtures.s3_server, s3_fixtures.s3_bucket, s3_fixtures.no_internet
# an argument of measure or make_reader as Python writes it (``warmup_batches=``, a bare ``num_shards``)
PYTHON_NAME = re.compile(r"(?<![\w.-])(?:(?:adapter|batch_size|columns|shard|num_shards|workers|prefetch|"
                         r"shuffle|seed|warmup_batches|batches|seconds|epochs|cache|storage_options)=|"
                         r"num_shards\b|batch_size\b|warmup_batches\b|storage_options\b)")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    data = {"id": np.arange(N), "x": np.ones((N, 3), np.float32), "label": [f"c{i % 3}" for i in range(N)]}
    return shardkit.write_dataset(data, tmp_path_factory.mktemp("bench") / "ds", row_group_size=8).url


@pytest.fixture(autouse=True)
def _no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_reader takes num_shards from a job's WORLD_SIZE/RANK: these tests run outside one."""
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, err
    assert err.startswith("shardkit bench: error: "), err
    return err


def test_json_has_the_counts_and_rates(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", url, "--batch-size", "4", "--warmup", "3", "--num-shards", "2", "--shard", "1",
            "--epochs", "2", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    info = json.loads(out)
    assert (info["url"], info["adapter"], info["shard"], info["num_shards"]) == (url, "numpy", 1, 2)
    assert (info["batch_size"], info["warmup_batches"], info["batches_per_epoch"]) == (4, 3, 7)
    assert (info["rows"], info["batches"], info["stopped_by"]) == (50, 14, "epochs")  # 25 rows per epoch
    assert info["decoded_bytes"] == 50 * (8 + 12 + 2)
    for key in ("seconds", "rows_per_second", "batches_per_second", "mb_per_second", "first_batch_seconds",
                "cpu_percent", "peak_rss"):
        assert math.isfinite(info[key])
        assert info[key] > 0, key
    assert info["cpu_seconds"] >= 0
    assert info["stats"] == {"pruned_row_groups": 0, "skipped_row_groups": 0, "repeated_rows": 0,
                             "skipped_samples": 0}


def test_text_output_and_options(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", url, "--batch-size", "5", "--columns", "id, label", "--batches", "3", "--no-shuffle",
            "--seed", "7", "--workers", "1", "--prefetch", "1", "--warmup", "0", "--no-cache"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == f"{url}  (numpy, shard 0 of 1, batch_size 5, 10 batches per epoch)"
    assert lines[1].startswith("measured     3 batches, 15 rows in ")
    assert "stopped after 3 batches; 0 warm-up batches" in lines[1]
    assert lines[2].startswith("throughput   ")
    assert "rows/s" in lines[2]
    assert "MB/s decoded" in lines[2]
    assert [line.split()[0] for line in lines[3:]] == ["first", "cpu", "peak", "reader"]


def test_seconds_bound(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", url, "--seconds", "0.05", "--batch-size", "16", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["stopped_by"] == "seconds"
    assert info["seconds"] >= 0.05


def test_torch_adapter(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    importlib.import_module("torch")
    assert main(["bench", url, "--adapter", "torch", "--batch-size", "10", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["adapter"], info["rows"], info["batches"]) == ("torch", N, 5)


@pytest.mark.tf
def test_tf_adapter(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    importlib.import_module("tensorflow")
    level = os.environ["TF_CPP_MIN_LOG_LEVEL"]
    assert main(["bench", url, "--adapter", "tf", "--batch-size", "10", "--warmup", "2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["adapter"], info["rows"], info["batches"]) == ("tf", N, 5)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == level  # the user's level stands


def _bench_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m shardkit bench ARGS`` without TF_CPP_MIN_LOG_LEVEL in its environment."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-m", "shardkit", "bench", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.tf
def test_tf_adapter_writes_no_tensorflow_log_lines(url: str, tmp_path: Path) -> None:
    """TensorFlow's import wrote absl's "All log messages before absl::InitializeLog()" line and the oneDNN
    notice, and its first ops info lines (cpu_feature_guard, generator_dataset_op), on stderr."""
    importlib.import_module("tensorflow")
    done = _bench_process(url, "--adapter", "tf", "--batch-size", "10", "--warmup", "2", "--json")
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout)["rows"] == N
    ds = shardkit.write_dataset({"id": np.arange(40)}, tmp_path / "ds", row_group_size=5, file_size=200)
    (tmp_path / "ds" / ds.files[1]).unlink()  # a read error in tf.data's threads: its own line only
    done = _bench_process(ds.url, "--adapter", "tf", "--batch-size", "4", "--warmup", "0")
    assert (done.returncode, done.stdout) == (2, "")
    assert "is missing; the dataset was changed outside shardkit" in _one_line_error(done.stderr)


@pytest.mark.tf
def test_tf_adapter_leaves_the_environment_as_it_was(url: str) -> None:
    """TF_CPP_MIN_LOG_LEVEL=2, set to quiet TensorFlow's import, stayed set in os.environ after it: every
    process started later inherited it."""
    code = ("import os, subprocess, sys\n"
            "from shardkit.cli import main\n"
            f"code = main(['bench', {url!r}, '--adapter', 'tf', '--batch-size', '10', '--warmup', '0'])\n"
            "print(code, os.environ.get('TF_CPP_MIN_LOG_LEVEL'), 'tensorflow' in sys.modules)\n"
            "sys.stdout.flush()\n"
            "child = 'import os; print(os.environ.get(\"TF_CPP_MIN_LOG_LEVEL\"))'\n"
            "subprocess.run([sys.executable, '-c', child], check=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[-2:] == ["0 None True", "None"]


def test_a_tensorflow_that_cannot_load_says_why(url: str, tmp_path: Path) -> None:
    """An installed TensorFlow whose import fails (here a stand-in for a broken install: a missing shared
    library) was reported as not installed ("pip install 'shardkit[tf]'"), and what its import wrote on
    stderr was dropped: now that text and the import's error are shown."""
    broken = tmp_path / "site" / "tensorflow"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "import os\n"
        "os.write(2, b\"E0000 dso_loader.cc:1] Could not load dynamic library 'libtf_fake.so.2'\\n\")\n"
        "raise ImportError('libtf_fake.so.2: cannot open shared object file: No such file or directory')\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "shardkit", "bench", url, "--adapter", "tf"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        "E0000 dso_loader.cc:1] Could not load dynamic library 'libtf_fake.so.2'",
        "shardkit bench: error: ImportError: libtf_fake.so.2: cannot open shared object file: No such file "
        "or directory"]


def test_the_default_cache_warning_names_the_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The default cache (remote data: here memory://) in a folder that cannot be made warns and reads
    without it; the warning's fix named make_reader's cache=CacheConfig(...) and cache=None."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SHARDKIT_CACHE_DIR", str(tmp_path / "file" / "cache"))
    url = shardkit.write_dataset({"id": np.arange(20)}, f"memory://{tmp_path.name}/ds", row_group_size=5).url
    assert main(["bench", url, "--batch-size", "5", "--warmup", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"] == 20
    folder = tmp_path / "file" / "cache"
    assert err == (f"warning: the cache folder '{folder}' cannot be created ([Errno 20] Not a directory: "
                   f"'{folder}'); pass a writable folder with --cache DIR or set SHARDKIT_CACHE_DIR, or "
                   f"--no-cache; reading '{url}' without the default row-group cache\n")
    assert not PYTHON_NAME.search(err), err


def test_a_plain_parquet_folder_prints_the_warning(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    pd.DataFrame({"a": np.arange(9)}).to_parquet(folder / "x.parquet", row_group_size=4)
    assert main(["bench", str(folder), "--batch-size", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("warning: ")
    assert "shardkit index" in err
    assert json.loads(out)["rows"] == 9


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--batch-size", "0"], ["--batch-size 0 must be an int >= 1"]),
        (["--shard", "2", "--num-shards", "2"], ["--shard 2 must be an int in [0, --num-shards 2)"]),
        (["--shard", "-1", "--num-shards", "2"], ["--shard -1 must be an int in [0, --num-shards 2)"]),
        (["--shard", "1"], ["--shard 1 was given without --num-shards,",
                            "pass --num-shards <number of workers>"]),
        (["--num-shards", "2"], ["--num-shards 2 was given without --shard;"]),
        (["--columns", "id,nope"], ["unknown column(s) ['nope']", "its fields are ['id', 'x', 'label']"]),
        (["--columns", "id, label,id"], ["--columns id,label,id names ['id'] more than once"]),
        (["--batches", "0"], ["--batches 0 must be an int >= 1 (batches to measure)"]),
        (["--epochs", "0"], ["--epochs 0 must be an int >= 1 (whole epochs to measure)"]),
        (["--warmup", "-1"], ["--warmup -1 must be an int >= 0 (batches read before the clock starts)"]),
        (["--seconds", "0"], ["--seconds 0.0 must be a finite number > 0 (how long to measure)"]),
        (["--seconds", "nan"], ["--seconds nan must be a finite number > 0"]),
        (["--workers", "0"], ["--workers 0 must be an int >= 1"]),
        (["--prefetch", "-1"], ["--prefetch -1 must be an int >= 0"]),
        (["--seed", "-1"], ["--seed -1 must be an int >= 0"]),
    ],
)
def test_bad_values_exit_2_with_one_line_naming_the_flags(url: str, capsys: pytest.CaptureFixture[str],
                                                          args: list[str], needles: list[str]) -> None:
    """The messages are measure's and make_reader's, with each argument written as the flag typed
    (``--warmup -1``, not ``warmup_batches=-1``); from Python they name the arguments (test_throughput)."""
    assert main(["bench", url, *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    for needle in needles:
        assert needle in _one_line_error(err), (needle, err)
    assert not PYTHON_NAME.search(err), err


def test_a_job_world_error_names_the_flags(url: str, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["bench", url]) == 2
    err = _one_line_error(capsys.readouterr().err)
    assert "so this worker's shard is unknown; pass --shard <rank> (every worker" in err
    assert main(["bench", url, "--shard", "3"]) == 2  # num_shards from WORLD_SIZE
    assert "--shard 3 must be an int in [0, --num-shards 2)" in _one_line_error(capsys.readouterr().err)


def test_a_cache_folder_that_cannot_be_made_names_the_flags(url: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    assert main(["bench", url, "--cache", str(tmp_path / "file" / "cache")]) == 2
    err = _one_line_error(capsys.readouterr().err)
    assert f"the cache folder '{tmp_path / 'file' / 'cache'}' cannot be created (" in err
    assert err.endswith("; pass a writable folder with --cache DIR or set SHARDKIT_CACHE_DIR, "
                        "or --no-cache\n")
    assert not PYTHON_NAME.search(err), err


def test_cache_folder(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--cache DIR caches local data too (make_reader's cache=DIR); `auto` is the default, a folder of that
    name is ./auto."""
    argv = ["bench", url, "--batch-size", "10", "--warmup", "0", "--no-shuffle", "--json"]
    assert main([*argv, "--cache", str(tmp_path / "cache")]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert (stats["cache_misses"], stats["cache_hits"]) == (7, 0)  # 50 rows in row groups of 8
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 7
    assert main([*argv, "--cache", str(tmp_path / "cache")]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["cache_hits"] == 7
    for flags in (["--cache", "auto"], ["--no-cache"], []):
        assert main([*argv, *flags]) == 0
        assert "cache_misses" not in json.loads(capsys.readouterr().out)["stats"], flags  # local: no cache


def test_storage_options_and_cache_on_s3(s3_server: S3Server, s3_bucket: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    shardkit.write_dataset({"id": np.arange(40), "t": [f"é{i}" for i in range(40)]}, url,
                           storage_options=opts, row_group_size=10)
    argv = ["bench", url, "--storage-options", json.dumps(opts), "--batch-size", "10", "--warmup", "0",
            "--json"]
    assert main([*argv, "--cache", str(tmp_path / "cache")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["url"], info["rows"], info["stats"]["cache_misses"]) == (url, 40, 4)
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 4
    assert main([*argv, "--no-cache"]) == 0
    assert "cache_misses" not in json.loads(capsys.readouterr().out)["stats"]


def test_storage_options_in_a_message_are_json_for_the_flag(s3_server: S3Server, s3_bucket: str,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """No credentials: access.py's fix names storage_options={...} (Python), here the flag and its JSON."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    client = {"client_kwargs": s3_server.storage_options["client_kwargs"]}
    assert main(["bench", f"s3://{s3_bucket}/ds", "--storage-options", json.dumps(client)]) == 2
    err = _one_line_error(capsys.readouterr().err)
    assert "no credentials were found for it" in err
    assert """or pass --storage-options '{"key": ..., "secret": ...}', or""" in err
    assert not PYTHON_NAME.search(err), err


def test_a_url_that_is_not_a_dataset_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(tmp_path / "missing")]) == 2
    assert f"no dataset at '{tmp_path / 'missing'}'" in _one_line_error(capsys.readouterr().err)
    (tmp_path / "empty").mkdir()
    assert main(["bench", str(tmp_path / "empty")]) == 2
    assert "holds no Parquet data files" in _one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize(("args", "needle"), [
    (["--batch-size", "x"], "argument --batch-size: invalid int value: 'x'"),
    (["--seconds", "soon"], "argument --seconds: invalid float value: 'soon'"),
    (["--adapter", "jax"], "argument --adapter: invalid choice: 'jax'"),
    (["--columns", ","], "argument --columns: ',' names no field; name some, comma-separated "
                         "(--columns a,b), or leave --columns out to read them all"),
    (["--cache", " "], "argument --cache: ' ' is no folder; give one, e.g. --cache /mnt/nvme/shardkit-cache"),
    (["--cache", "c", "--no-cache"], "argument --no-cache: not allowed with argument --cache"),
    (["--storage-options", "{anon: true}"],
     "argument --storage-options: '{anon: true}' is not JSON (Expecting property name enclosed in double "
     """quotes: line 1 column 2 (char 1)); write an object, e.g. '{"anon": true}'"""),
    (["--storage-options", "[1]"], "argument --storage-options: '[1]' is JSON but not an object"),
])
def test_malformed_values_are_usage_errors(url: str, capsys: pytest.CaptureFixture[str], args: list[str],
                                            needle: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", url, *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardkit bench")
    assert needle in err


def test_as_a_process_an_error_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "shardkit", "bench", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert "holds no Parquet data files" in _one_line_error(done.stderr)


def test_a_missing_torch_names_the_extra(url: str) -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from shardkit.cli import main\n"
            f"sys.exit(main(['bench', {url!r}, '--adapter', 'torch']))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert (done.returncode, done.stdout) == (2, "")
    err = _one_line_error(done.stderr)
    assert "needs the package 'torch'" in err
    assert "pip install 'shardkit[torch]'" in err


@pytest.mark.parametrize("adapter", ["numpy", pytest.param("tf", marks=pytest.mark.tf)])
def test_a_read_error_is_one_line_whatever_the_adapter(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       adapter: str) -> None:
    """A data file deleted after the dataset was written: tf.data used to turn the reader's error into a
    tf.errors.UnknownError, a traceback and exit 1."""
    if adapter == "tf":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        importlib.import_module("tensorflow")
    ds = shardkit.write_dataset({"id": np.arange(40)}, tmp_path / "ds", row_group_size=5, file_size=200)
    (tmp_path / "ds" / ds.files[1]).unlink()
    assert main(["bench", ds.url, "--adapter", adapter, "--batch-size", "4", "--warmup", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "is missing; the dataset was changed outside shardkit" in _one_line_error(err)
