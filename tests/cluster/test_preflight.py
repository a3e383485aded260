"""Before a job starts: the logdir lock (one run per logdir, torchrun nodes sharing one), an uncreatable
logdir, a local data.url that holds no dataset, GPUs asked for that this machine does not have, and a
roles' interpreter that cannot import shardkit or the job's framework."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import shardkit
from shardkit.cluster.monitor.preflight import (
    FRAMEWORKS,
    LogdirLock,
    check_local_data,
    check_local_framework,
    check_local_gpus,
    check_local_python,
    local_gpus,
    prepare_logdir,
)
from shardkit.errors import ConfigError, MissingDependencyError
from shardkit.job.config import JobConfig

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, **changes: Any) -> JobConfig:
    data = {"name": "pre", "entrypoint": str(REPO / "tests" / "trainer" / "scripts" / "behave.py"),
            "framework": "tensorflow", "roles": {"worker": {"count": 1}}, "logdir": str(tmp_path / "job"),
            **changes}
    return JobConfig.from_dict(data)


def test_one_run_per_logdir_and_the_message_names_the_holder(tmp_path: Path) -> None:
    job = config(tmp_path)
    first = prepare_logdir(job, clear=[])
    try:
        (tmp_path / "job" / "logs").mkdir()
        with pytest.raises(ConfigError) as info:
            prepare_logdir(job, clear=[tmp_path / "job" / "logs"])
        message = str(info.value)
        for word in ("logdir", str(tmp_path / "job"), f"pid {os.getpid()}", "wait until that run ends",
                     f"--set logdir={tmp_path / 'job'}-2"):
            assert word in message, (word, message)
        assert (tmp_path / "job" / "logs").is_dir()  # refused before clearing anything
    finally:
        first.release()
    prepare_logdir(job, clear=[tmp_path / "job" / "logs"]).release()  # free again once released
    assert not (tmp_path / "job" / "logs").exists()


def test_torchrun_nodes_share_a_logdir_but_not_a_node_rank_nor_with_a_local_run(tmp_path: Path) -> None:
    job = config(tmp_path)
    (tmp_path / "job").mkdir()
    nodes = [LogdirLock(job, node=0), LogdirLock(job, node=1)]
    try:
        with pytest.raises(ConfigError, match="another `shardkit train`"):
            LogdirLock(job, node=1)
        with pytest.raises(ConfigError, match="another `shardkit train`"):
            LogdirLock(job)  # a local run wants the logdir to itself
    finally:
        for lock in nodes:
            lock.release()
    local = LogdirLock(job)
    try:
        with pytest.raises(ConfigError, match="another `shardkit train`"):
            LogdirLock(job, node=0)
    finally:
        local.release()


@pytest.mark.parametrize("where", ["under_a_file", "job_json_unwritable"])
def test_a_logdir_that_cannot_be_created_or_written_is_a_config_error(tmp_path: Path, where: str) -> None:
    """A logdir under a file cannot be created; one where job.json cannot be written (a folder of that
    name: what a read-only folder does, also as root, which writes into read-only folders) fails after
    the lock was taken, and must let it go."""
    if where == "under_a_file":
        (tmp_path / "afile").write_text("x")
        logdir = tmp_path / "afile" / "job"
    else:
        logdir = tmp_path / "job"
        (logdir / "job.json").mkdir(parents=True)
    with pytest.raises(ConfigError) as info:
        prepare_logdir(config(tmp_path, logdir=str(logdir)), clear=[])
    message = str(info.value)
    for word in ("logdir", str(logdir), "cannot create it or write in it", "Fix:", "--set logdir="):
        assert word in message, (word, message)
    assert isinstance(info.value.__cause__, OSError)
    if where == "job_json_unwritable":  # the lock was released: the next run gets it
        (logdir / "job.json").rmdir()
        prepare_logdir(config(tmp_path, logdir=str(logdir)), clear=[]).release()


def test_a_local_data_url_must_hold_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    for url, why in [(tmp_path / "missing", "does not exist"), (tmp_path / "empty", "no Parquet data"),
                     (tmp_path / "afile", "is a file")]:
        with pytest.raises(ConfigError) as info:
            check_local_data(config(tmp_path, data={"url": str(url)}))
        message = str(info.value)
        for word in ("data.url", str(url), why, "Fix: point data.url at the dataset's folder"):
            assert word in message, (word, message)
    ds = shardkit.write_dataset({"x": np.arange(4)}, str(tmp_path / "ds"))
    check_local_data(config(tmp_path, data={"url": ds.url}))
    check_local_data(config(tmp_path, data={"url": f"file://{ds.url}"}))
    check_local_data(config(tmp_path, data={"url": "s3://bucket/nowhere"}))  # remote: the roles' business
    check_local_data(config(tmp_path))  # no data section


def test_local_gpus_counts_nvidia_devices_as_cuda_visible_devices_narrows_them(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm", "null"):
        (dev / name).touch()
    cases = {None: 3, "": 0, "-1": 0, "1": 1, "0,2": 2, "2,0,1": 3, "0,7,1": 1, "7": 0, "0,-1,1": 1,
             "GPU-8e1c2a": 1, "MIG-1,GPU-2": 2, " 1 , 2": 2, "0,1,2,GPU-x": 3}
    for visible, count in cases.items():
        env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        assert local_gpus(str(dev), env) == count, visible
    (dev / "dxg").touch()  # WSL2: CUDA through /dev/dxg, no /dev/nvidia<N>: cannot be told
    assert local_gpus(str(dev), {}) is None
    assert local_gpus(str(tmp_path / "nowhere"), {}) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert local_gpus(str(empty), {"CUDA_VISIBLE_DEVICES": "0"}) == 0  # no device: none, whatever it says


def test_gpus_asked_for_that_this_machine_lacks_are_refused_before_anything_starts(tmp_path: Path) -> None:
    job = config(tmp_path, framework="torch", roles={"worker": {"count": 2, "resources": {"gpus": 1}}})
    with pytest.raises(ConfigError) as info:
        check_local_gpus(job, gpus=lambda: 1)
    message = str(info.value)
    for word in ("roles.worker.resources.gpus = 1", "ask for 2 GPU(s) (worker 2 x 1) and it has 1",
                 "CUDA_VISIBLE_DEVICES", "Fix: set roles.worker.resources.gpus to 0",
                 "--set roles.worker.resources.gpus=0"):
        assert word in message, (word, message)
    check_local_gpus(job, gpus=lambda: 2)
    check_local_gpus(job, {"worker": 1}, gpus=lambda: 1)  # a torchrun node of one worker
    check_local_gpus(job, gpus=lambda: None)  # not told: not checked
    check_local_gpus(config(tmp_path), gpus=lambda: 0)  # no GPU asked for
    roles = {"chief": {"count": 1}, "ps": {"count": 2}, "worker": {"count": 3, "resources": {"gpus": 2}}}
    ps = config(tmp_path, strategy="parameter_server", roles=roles)
    with pytest.raises(ConfigError, match=r"ask for 6 GPU\(s\) \(worker 3 x 2\) and it has 4"):
        check_local_gpus(ps, gpus=lambda: 4)


@pytest.mark.parametrize("engine", ["local", "torchrun"])
def test_shardkit_train_refuses_gpus_this_machine_lacks_before_anything_starts(tmp_path: Path,
                                                                                engine: str) -> None:
    job = {"name": "gpus", "entrypoint": str(REPO / "tests" / "trainer" / "scripts" / "behave.py"),
           "framework": "torch", "roles": {"worker": {"count": 2, "resources": {"gpus": 1}}},
           "engine": {"name": engine}, "logdir": str(tmp_path / "job")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU visible, on any machine
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(tmp_path / "job.yaml")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    for word in ("roles.worker.resources.gpus = 1", "ask for 2 GPU(s) (worker 2 x 1) and it has 0",
                 "--set roles.worker.resources.gpus=0"):
        assert word in done.stderr, (word, done.stderr)
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "job").exists()  # nothing started, nothing written


def test_a_roles_interpreter_that_cannot_import_shardkit_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    """Every role would fail at its first line, and the job spend its restarts on it."""
    wrapper = tmp_path / "wrapped-python"  # another interpreter path that runs this one: it imports shardkit
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    check_local_python(config(tmp_path, python=str(wrapper)))
    check_local_python(config(tmp_path))  # the trainer's own interpreter: not run
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True,
                   timeout=120)
    for python, words in [("/bin/sh", ["python = '/bin/sh'", "not a Python 3 interpreter",
                                       "leave python out"]),
                          (str(tmp_path / "bare"), ["cannot import shardkit", "No module named",
                                                    "-m pip install shardkit"])]:
        job = config(tmp_path, python=python)
        with pytest.raises(ConfigError) as info:
            check_local_python(job)
        for word in words:
            assert word in str(info.value), (word, str(info.value))


def test_shardkit_train_refuses_a_python_that_is_not_one(tmp_path: Path) -> None:
    job = {"name": "sh", "entrypoint": str(REPO / "tests" / "trainer" / "scripts" / "behave.py"),
           "framework": "tensorflow", "roles": {"worker": {"count": 1}}, "python": "/bin/sh",
           "logdir": str(tmp_path / "job")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(tmp_path / "job.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "python = '/bin/sh': it is not a Python 3 interpreter" in done.stderr, done.stderr
    assert not (tmp_path / "job").exists()


# -- the job's framework ----------------------------------------------------------------------------

BLOCKER = '''\
"""Blocks the modules named in BLOCK_MODULES, as a Python without them installed: ``import`` raises
ModuleNotFoundError."""
import os
import sys

for name in os.environ.get("BLOCK_MODULES", "").split(","):
    if name:
        sys.modules[name] = None
'''
STARTS = "import os, pathlib; pathlib.Path(os.environ['SHARDKIT_JOB_DIR'], 'started').touch()\n"


def blocker(folder: Path) -> Path:
    """A folder whose ``sitecustomize`` (on PYTHONPATH) blocks ``BLOCK_MODULES`` in every Python started."""
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return folder


@pytest.mark.parametrize(("framework", "module", "extra"), [("torch", "torch", "torch"),
                                                             ("tensorflow", "tensorflow", "tf")])
def test_shardkit_train_refuses_a_framework_that_does_not_import_before_anything_starts(
        tmp_path: Path, framework: str, module: str, extra: str) -> None:
    """As measured from the wheel without torch: the workers started, then died with ModuleNotFoundError."""
    (tmp_path / "train.py").write_text(STARTS)
    job = {"name": "fw", "entrypoint": str(tmp_path / "train.py"), "framework": framework,
           "roles": {"worker": {"count": 2}}, "logdir": str(tmp_path / "job")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    env.update(PYTHONPATH=os.pathsep.join([str(blocker(tmp_path / "block")), str(REPO)]),
               BLOCK_MODULES=module)
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(tmp_path / "job.yaml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    for word in (str(tmp_path / "job.yaml"), f"framework: {framework}", f"package {module!r}",
                 f"pip install 'shardkit[{extra}]'"):
        assert word in done.stderr, (word, done.stderr)
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "job").exists()  # no worker started, nothing written
    # the same job where the framework imports runs its workers
    env.pop("BLOCK_MODULES")
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "train", str(tmp_path / "job.yaml"),
                           "--quiet"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "job" / "started").exists()


def test_the_framework_is_looked_up_where_the_roles_import_it(tmp_path: Path) -> None:
    """With the job's ``env`` changing the roles' import path, or another interpreter, it is looked up
    in that interpreter with that environment, not in the trainer."""
    block = str(blocker(tmp_path / "block"))
    check_local_framework(config(tmp_path, framework="torch", env={"PYTHONPATH": block}))  # blocks nothing
    job = config(tmp_path, framework="torch", env={"PYTHONPATH": block, "BLOCK_MODULES": "torch"})
    with pytest.raises(MissingDependencyError) as info:
        check_local_framework(job)
    assert "pip install 'shardkit[torch]'" in str(info.value)
    wrapper = tmp_path / "wrapped-python"  # another interpreter path: its own pip is named
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    job = config(tmp_path, framework="tensorflow", python=str(wrapper),
                 env={"PYTHONPATH": block, "BLOCK_MODULES": "tensorflow"})
    with pytest.raises(MissingDependencyError) as info:
        check_local_framework(job)
    assert f"{wrapper} -m pip install 'shardkit[tf]'" in str(info.value)
    check_local_framework(config(tmp_path, framework="tensorflow", python=str(wrapper)))


def test_a_folder_left_by_an_uninstall_is_not_a_framework(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An uninstall can leave the package's folder with no module in it: it imports as an empty namespace
    package, and the roles' first ``torch.nn`` fails."""
    (tmp_path / "site" / "leftover_fw" / "__pycache__").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(FRAMEWORKS, "torch", ("leftover_fw", "torch"))
    with pytest.raises(MissingDependencyError) as info:
        check_local_framework(config(tmp_path, framework="torch"))
    assert "only a folder without modules" in str(info.value)
    assert str(tmp_path / "site" / "leftover_fw") in str(info.value)


# -- a module:function entrypoint -------------------------------------------------------------------


def _entrypoint_job(tmp_path: Path, entrypoint: str, **changes: Any) -> Path:
    job = {"name": "ep", "entrypoint": entrypoint, "framework": "torch", "roles": {"worker": {"count": 2}},
           "logdir": str(tmp_path / "job"), **changes}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _shardkit(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("command", ["validate", "train"])
def test_an_entrypoint_module_that_cannot_import_is_refused_before_anything_starts(
        tmp_path: Path, command: str) -> None:
    path = _entrypoint_job(tmp_path, "nopkg.mod:main")
    done = _shardkit(command, str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "entrypoint = 'nopkg.mod:main'" in done.stderr
    assert "cannot import 'nopkg', the package of 'nopkg.mod'" in done.stderr
    assert sys.executable in done.stderr  # the Python it was looked up with
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "job").exists()  # no process, no logdir


def test_an_entrypoint_is_located_without_running_any_of_the_jobs_code(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('the package was imported')\n")
    (pkg / "train.py").write_text("def main():\n    raise SystemExit('the module was imported')\n")
    missing = _shardkit("validate", str(_entrypoint_job(tmp_path, "mypkg.nomod:main")), cwd=tmp_path)
    assert missing.returncode == 2
    assert "cannot import 'mypkg.nomod'" in missing.stderr
    assert "was imported" not in missing.stderr + missing.stdout
    module = _shardkit("validate", str(_entrypoint_job(tmp_path, "mypkg.train.main:f")), cwd=tmp_path)
    assert module.returncode == 2
    assert "'mypkg.train' is a module, not a package" in module.stderr
    found = _shardkit("validate", str(_entrypoint_job(tmp_path, "mypkg.train:main")), cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert "was imported" not in found.stderr + found.stdout
    # from another folder it is not found, unless the job's env puts the package's folder on the path
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert _shardkit("validate", str(_entrypoint_job(tmp_path, "mypkg.train:main")), cwd=elsewhere
                     ).returncode == 2
    with_path = _entrypoint_job(tmp_path, "mypkg.train:main", env={"PYTHONPATH": str(tmp_path)})
    assert _shardkit("validate", str(with_path), cwd=elsewhere).returncode == 0
