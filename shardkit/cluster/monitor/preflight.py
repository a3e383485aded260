"""What a job checks and prepares on this machine before its first process starts: that a local dataset
is there and the GPUs its roles ask for are, and the logdir (locked for one run at a time, one run's
outputs cleared, ``job.json``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardkit.errors import ConfigError, MissingDependencyError, ShardkitError
from shardkit.job import protocol
from shardkit.job.config import JobConfig

__all__ = ["FRAMEWORKS", "LOCK_FILE", "LogdirLock", "check_entrypoint", "check_here", "check_local_data",
           "check_local_framework", "check_local_gpus", "check_local_python", "local_gpus", "local_path",
           "prepare_logdir"]

LOCK_FILE = ".lock"
#: ``framework:`` -> (the package its roles import, the shardkit extra that installs it)
FRAMEWORKS: dict[str, tuple[str, str]] = {"torch": ("torch", "torch"), "tensorflow": ("tensorflow", "tf")}
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _error(config: JobConfig, key: tuple[str, ...], value: object, problem: str, fix: str) -> ConfigError:
    from shardkit.job.config.messages import config_error

    return config_error(config.source, [(key, value, problem, fix)])


def local_path(url: str) -> str | None:
    """The path of a dataset URL on this machine's filesystem (a plain path or ``file://``), else None."""
    if url.startswith("file://"):
        return url.removeprefix("file://")
    return None if "://" in url else url


def check_local_data(config: JobConfig) -> JobConfig:
    """Fail before anything starts when ``data.url`` is a path on this machine that holds no dataset;
    the config the roles get: where ``data.url`` is a Delta or Iceberg table and ``data.options`` pins
    no ``version``, the one opened here is pinned (``data.options.version``), so that every role and
    every restart of this run reads one snapshot even if the table moves on while they start.

    Example:
        >>> check_local_data(config)     # only for engines whose roles run on this machine

    Choices: the check is the one every role's `make_reader` makes first, `shardkit.open_dataset`
    (with a summary, one small read; without, every file's footer, as each role would read them), so
    it fails exactly when the roles would, with the dataset layer's own reason. Warnings are left to
    the roles. Not in ``shardkit validate``: a config rendered for Kubernetes or YARN may name a path
    that exists only there; a remote URL (``s3://...``) is never checked here, as the roles may hold
    credentials this machine does not.

    A table at a remote URL is opened by each role (this machine may lack its credentials): give
    ``data.options.version`` to pin it; a resumed run is pinned by its checkpoint's reader state.

    Raises:
        ConfigError: naming ``data.url``, the path, why it does not open, and the fix.
    """
    if config.data is None:
        return config
    if config.data.sources is not None:  # a mixture: each local source, each table pinned in its entry
        sources = dict(config.data.sources)
        for name, source in config.data.sources.items():
            version = source.version if source.version is not None else config.data.options.get("version")
            snapshot = _local_snapshot(config, ("data", "sources", name, "url"), source.url, version)
            if snapshot is not None and version is None:
                sources[name] = source.model_copy(update={"version": snapshot.version})
        if sources == config.data.sources:
            return config
        return config.model_copy(update={"data": config.data.model_copy(update={"sources": sources})})
    assert config.data.url is not None  # DataConfig: url or sources
    version = config.data.options.get("version")
    snapshot = _local_snapshot(config, ("data", "url"), config.data.url, version)
    if snapshot is None or version is not None:
        return config
    data = config.data.model_copy(update={"options": {**config.data.options, "version": snapshot.version}})
    return config.model_copy(update={"data": data})


def _local_snapshot(config: JobConfig, key: tuple[str, ...], url: str, version: Any) -> Any:
    """Open the dataset at ``url`` if it is a path on this machine: its table snapshot (None: a folder, or
    a remote URL, not checked here); a `ConfigError` naming ``key`` when there is no dataset."""
    path = local_path(url)
    if path is None:
        return None
    from shardkit.dataset import open_dataset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return open_dataset(path, version=version).snapshot
    except (ShardkitError, OSError) as e:
        where = ".".join(key)
        raise _error(config, key, url, f"there is no dataset to read there ({e})",
                     f"point {where} at the dataset's folder (a relative path is relative to the config "
                     "file's folder), or write the dataset there first (shardkit.write_dataset, or "
                     "`shardkit index` for a plain Parquet folder)") from e


def check_here(config: JobConfig, processes: Mapping[str, int] | None = None) -> JobConfig:
    """What is checked on the machine where a job's roles run, before the first one starts: the local
    data (`check_local_data`), the GPUs ``processes`` ask for (`check_local_gpus`) and the roles'
    interpreter (`check_local_python`) with the job's framework in it (`check_local_framework`) and
    the entrypoint's module (`check_entrypoint`). The
    supervisor calls it for an engine whose roles run here, a torchrun node's agent for its own workers;
    the config it returns is the one they start the roles with (a local table's version pinned)."""
    pinned = check_local_data(config)
    check_local_gpus(config, processes)
    check_local_python(config)
    check_local_framework(config)
    check_entrypoint(config)
    return pinned


def local_gpus(dev: str = "/dev", env: Mapping[str, str] | None = None) -> int | None:
    """How many NVIDIA GPUs a process started here could use; None where this cannot be told.

    Example:
        >>> local_gpus()          # a machine without an NVIDIA GPU
        0

    Choices: nothing is imported (not torch, not TensorFlow: the supervisor of a TensorFlow job has no
    torch) and nothing is run. On Linux, CUDA reaches a GPU only through its device file, ``/dev/nvidia<N>``
    (a container sees only the devices it was given), and ``CUDA_VISIBLE_DEVICES`` (as the roles inherit
    it) narrows them as CUDA does: the entries up to the first that is not a GPU (``-1``, or an index
    past the last), ``""`` none, UUIDs (``GPU-...``, ``MIG-...``) counted as given. None (not told,
    so not checked) off Linux, and where CUDA may come another way: WSL2 (``/dev/dxg``) or ROCm
    (``/dev/kfd``).
    """
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return None
    try:
        names = os.listdir(dev)
    except OSError:
        return None
    if "dxg" in names or "kfd" in names:
        return None
    devices = sum(1 for name in names if re.fullmatch(r"nvidia\d+", name))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return devices
    count = 0
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < devices):
            count += 1
        else:
            break
    return min(count, devices)


def check_local_gpus(config: JobConfig, processes: Mapping[str, int] | None = None, *,
                     gpus: Callable[[], int | None] = local_gpus) -> None:
    """Fail before anything starts when the processes that run on this machine ask for more GPUs
    (``roles.<role>.resources.gpus``, per process) than it has (`local_gpus`).

    Example:
        >>> check_local_gpus(config)                       # engine: local, every process here
        >>> check_local_gpus(config, {"worker": 4})        # a torchrun node of 4 workers

    Choices: refused rather than run on the CPU, since nothing else would say so: the torch roles pick
    NCCL and ``cuda:<local_rank>`` only where every local process has its GPU, and fall back to gloo on
    the CPU otherwise. Where the count cannot be told (`local_gpus` is None), nothing is checked. Not in
    ``shardkit validate``: a config may be validated on a machine other than the one that runs it.

    Args:
        processes: role -> processes of it on this machine (default: every role's ``count``).
        gpus: tells the GPUs here (`local_gpus`).

    Raises:
        ConfigError: naming the role's ``resources.gpus``, what the processes ask for and what is here.
    """
    roles = config.roles
    processes = {role: spec.count for role, spec in roles.items()} if processes is None else processes
    asks = {role: n * roles[role].resources.gpus for role, n in processes.items() if role in roles}
    need = sum(asks.values())
    if need == 0:
        return
    have = gpus()
    if have is None or need <= have:
        return
    role = max(asks, key=lambda r: asks[r])
    per = config.roles[role].resources.gpus
    parts = ", ".join(f"{r} {processes[r]} x {asks[r] // processes[r]}" for r in asks if asks[r])
    raise _error(config, ("roles", role, "resources", "gpus"), per,
                 f"the processes on this machine ask for {need} GPU(s) ({parts}) and it has {have} "
                 "(NVIDIA devices /dev/nvidia<N>, narrowed by CUDA_VISIBLE_DEVICES)",
                 f"set roles.{role}.resources.gpus to 0 to train on the CPU (--set "
                 f"roles.{role}.resources.gpus=0), run fewer processes, or run where the GPUs are")


def check_local_python(config: JobConfig, *, timeout: float = 120.0) -> None:
    """Fail before anything starts when ``python`` (the roles' interpreter) is no Python that can import
    shardkit: every role would fail at its first line, and the job would spend its restarts on it.

    Example:
        >>> check_local_python(config)       # python: /opt/venv/bin/python

    Choices: the interpreter is run once (``import shardkit``, a fraction of a second); the trainer's own
    interpreter (the default) is not, since it imports shardkit already. Not in ``shardkit validate``,
    which may run where the job's interpreter is not.

    Raises:
        ConfigError: naming ``python``, the interpreter, what it said, and the fix.
    """
    python = os.fspath(config.python)
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # not realpath: a venv's python is a
        return  # link to its base interpreter, and the venv is told by the link's own folder
    # as a role imports: without the current folder first on sys.path (a script's own folder is), with
    # the job's env
    code = ("import sys; sys.path.pop(0); print('python', sys.version_info[0], flush=True); import shardkit; "
            "print('shardkit', shardkit.__version__)")
    env = {**os.environ, **config.env}
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout,
                              check=False, env=env, errors="replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        out, said = "", f"it could not be run ({e})"
    else:
        out = done.stdout
        said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:300]
    if "\nshardkit " in f"\n{out}":
        return
    if "python 3" not in out:
        raise _error(config, ("python",), python, f"it is not a Python 3 interpreter: {said}",
                     "give the roles' Python (/opt/venv/bin/python) or a virtual environment's folder, or "
                     f"leave python out to run them with {sys.executable}")
    raise _error(config, ("python",), python, f"it cannot import shardkit: {said}",
                 f"install shardkit into that environment ({python} -m pip install shardkit), or leave "
                 f"python out to run the roles with {sys.executable}")


_FIND = """\
import importlib.util, sys
sys.path.pop(0)
name = sys.argv[1]
try:
    spec = importlib.util.find_spec(name)
except (ImportError, ValueError):
    spec = None
if spec is None:
    print("missing")
elif spec.origin in (None, "namespace") and spec.submodule_search_locations is not None:
    print("folder", *spec.submodule_search_locations, sep="\\n")
else:
    print("found")
"""


def _find_here(module: str) -> tuple[str, list[str]]:
    """`_FIND` in this process: ``("found" | "missing" | "folder", [the folders of a namespace package])``."""
    if module in sys.modules:  # imported already, or blocked (``sys.modules[name] = None``)
        return ("found" if sys.modules[module] is not None else "missing"), []
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a meta path finder that refuses it
        return "missing", []
    if spec is None:
        return "missing", []
    if spec.origin in (None, "namespace") and spec.submodule_search_locations is not None:
        return "folder", list(spec.submodule_search_locations)
    return "found", []


def check_local_framework(config: JobConfig, *, timeout: float = 120.0) -> None:
    """Fail before anything starts when the roles' interpreter cannot import the job's ``framework``
    (torch, TensorFlow): every role would die at its first import, and the job would spend its
    restarts on it.

    Example:
        >>> check_local_framework(config)     # framework: torch, in a Python without torch

    Choices: the package is looked up (``importlib.util.find_spec``), not imported: importing TensorFlow
    takes seconds and memory the trainer has no use for. So a package that is missing (or blocked, or
    only a leftover folder without modules, as an uninstall can leave: a namespace package) is refused;
    one that is installed but fails at import (a missing shared library) is left to the roles, whose
    failure and log tail the summary shows. It is looked up where the roles would import it: in this
    process when they run this interpreter with the same import settings, else in the roles' ``python``
    with the job's ``env`` (``PYTHONPATH``, ...), run once. Not in ``shardkit validate``, which may run
    where the job's interpreter is not.

    Raises:
        MissingDependencyError: naming ``framework``, the config, the interpreter and the extra to
            install (``pip install 'shardkit[torch]'``, ``shardkit[tf]``).
    """
    module, extra = FRAMEWORKS[config.framework]
    python = os.fspath(config.python)
    here = os.path.abspath(python) == os.path.abspath(sys.executable)
    if here and not any(key.startswith("PYTHON") for key in config.env):
        found, folders = _find_here(module)
    else:
        try:
            done = subprocess.run([python, "-c", _FIND, module], capture_output=True, text=True, check=False,
                                  timeout=timeout, env={**os.environ, **config.env}, errors="replace")
        except (OSError, subprocess.TimeoutExpired):
            return  # not a Python that runs: `check_local_python` says so
        found, *folders = done.stdout.strip().splitlines() or ["?"]
        if found not in ("missing", "folder"):
            return
    if found == "found":
        return
    where = f"{config.source}: " if config.source is not None else ""
    purpose = f"{where}framework: {config.framework} (the roles run {python})"
    error = MissingDependencyError(module, extra, purpose)
    left = (f"; only a folder without modules is there ({', '.join(folders)}), left by an uninstall: "
            "remove it and reinstall") if found == "folder" else ""
    pip = "pip" if here else f"{python} -m pip"
    ImportError.__init__(error, f"{purpose} needs the package {module!r}, which it cannot import{left}. "
                                f"Fix: {pip} install 'shardkit[{extra}]' (or set framework: to the one "
                                "the entrypoint uses)")
    raise error


_LOCATE = """\
import importlib.machinery, importlib.util, sys
sys.path.pop(0)
sys.path.insert(0, "")  # as a role runs it (shardkit.trainer.run): the current folder first
parts = sys.argv[1].split(".")
search = None
for i in range(len(parts)):
    name = ".".join(parts[:i + 1])
    try:
        if i == 0:
            spec = importlib.util.find_spec(name)  # a top-level name: located, nothing executed
        else:  # a submodule: looked up in its package's folders, without importing the package
            spec = importlib.machinery.PathFinder.find_spec(name, search)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        print("missing", name)
        break
    search = spec.submodule_search_locations
    if search is None and i < len(parts) - 1:
        print("module", name)
        break
else:
    print("found")
"""


def check_entrypoint(config: JobConfig, *, timeout: float = 60.0) -> None:
    """Fail before anything starts when a ``module:function`` entrypoint's module cannot be found by the
    roles' Python: every role would fail at its first line, each attempt, ``max_restarts`` times.

    Example:
        >>> check_entrypoint(config)     # entrypoint: nopkg.mod:main
        ConfigError: ... entrypoint = 'nopkg.mod:main': the roles' Python (...) cannot import nopkg ...

    Choices: the module is located, not imported: each package on its dotted path is looked up in
    its parent's folders (``importlib.machinery.PathFinder``), so none of the job's code runs here (a
    module's import may start threads or read data). It is looked up as a role would: by the roles'
    ``python``, with the job's ``env`` and the current folder first on ``sys.path``. Whether the module
    defines the function is left to the role (the module would have to be run to know). A script
    entrypoint (``train.py``) is checked when the config loads. A ``python`` that does not run is
    `check_local_python`'s to name; here it is passed over. ``shardkit validate`` and ``shardkit
    train`` both call it.

    Raises:
        ConfigError: naming ``entrypoint``, the missing module (or the module that is no package), the
            interpreter and the fix.
    """
    if config.entrypoint_kind != "function":
        return
    module = config.entrypoint.partition(":")[0]
    python = os.fspath(config.python)
    try:
        done = subprocess.run([python, "-c", _LOCATE, module], capture_output=True, text=True, check=False,
                              timeout=timeout, env={**os.environ, **config.env}, errors="replace")
    except (OSError, subprocess.TimeoutExpired):
        return
    found, _, name = done.stdout.strip().partition(" ")
    if found == "missing":
        problem = (f"the roles' Python ({python}) cannot import {name!r}"
                   + (f", the package of {module!r}" if name != module else "")
                   + f", from {os.getcwd()} (the folder the roles start in)")
    elif found == "module":
        problem = (f"{name!r} is a module, not a package, so {module!r} cannot be imported (roles' "
                   f"Python: {python})")
    else:
        return
    raise _error(config, ("entrypoint",), config.entrypoint, problem,
                 f"install the package that holds {module!r} into {python} (pip install -e . in its "
                 "project), start from the folder that holds it, add that folder to env.PYTHONPATH, or "
                 "give a script: entrypoint: train.py")


class LogdirLock:
    """An exclusive ``flock`` on ``<logdir>/.lock``, held for a run's life: one run per logdir.

    Example:
        >>> lock = LogdirLock(config)            # raises ConfigError if another run holds it
        >>> ...; lock.release()

    Choices: ``flock`` (not a pid file), so that a run that dies, even by SIGKILL, frees it at once, and
    a second run is refused only while the first holds it. The holder's pid is written into the file,
    for the message. The nodes of a torchrun job may share a logdir: each holds ``.lock`` shared (so a
    local run, which wants it exclusive, is refused while any node runs, and no node starts while a
    local run does) and ``.lock-node-<K>`` exclusive (one agent per node rank). On a filesystem without
    locks (some network filesystems) the run goes on unlocked. The file descriptors are not inherited
    by any process the run starts.
    """

    def __init__(self, config: JobConfig, *, node: int | None = None) -> None:
        self.config = config
        self.logdir = Path(config.logdir)
        self._fds: list[int] = []
        try:
            self._take(self.logdir / LOCK_FILE, shared=node is not None)
            if node is not None:
                self._take(self.logdir / f"{LOCK_FILE}-node-{node}", shared=False)
        except BaseException:
            self.release()
            raise

    def _take(self, path: Path, *, shared: bool) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._fds.append(fd)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._held(path, fd) from None
        except OSError as e:
            if e.errno in _NO_LOCKS:
                return
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _held(self, path: Path, fd: int) -> ConfigError:
        first = os.pread(fd, 32, 0).decode(errors="replace").split("\n", 1)[0].strip()
        who = f"pid {first}" if first.isdigit() else "its pid not yet written"
        return _error(self.config, ("logdir",), str(self.logdir),
                      f"another `shardkit train` ({who}) is running with this logdir (it holds {path}); "
                      "a second run would clear its logs and write the same checkpoints and summary",
                      "wait until that run ends, or give this one its own logdir, e.g. "
                      f"--set logdir={self.logdir}-2")

    def release(self) -> None:
        """Let the next run have the logdir (closing the descriptors drops the locks)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def prepare_logdir(config: JobConfig, *, clear: Sequence[Path], node: int | None = None) -> LogdirLock:
    """Create and lock the logdir (`LogdirLock`), then remove ``clear`` (one run's outputs: logs,
    TensorBoard; never checkpoints, which a job started again resumes from) and write ``job.json``.

    Example:
        >>> lock = prepare_logdir(config, clear=[logdir / "logs", logdir / "tensorboard"])

    Raises:
        ConfigError: the logdir is in use by another run, or cannot be created or written (naming
            ``logdir``, the path and the system's reason); nothing was cleared then.
    """
    logdir = Path(config.logdir)
    lock: LogdirLock | None = None
    try:
        logdir.mkdir(parents=True, exist_ok=True)
        lock = LogdirLock(config, node=node)
        for path in clear:
            shutil.rmtree(path, ignore_errors=True)
        job_json = logdir / protocol.JOB_CONFIG_FILE
        tmp = job_json.with_name(f".{job_json.name}.{os.getpid()}")  # nodes sharing a logdir write it too
        tmp.write_text(json.dumps(config.redacted(), indent=2, default=str) + "\n")
        os.replace(tmp, job_json)
    except OSError as e:
        if lock is not None:
            lock.release()
        why = f"{e.strerror or type(e).__name__}: {e.filename}" if e.filename else str(e)
        raise _error(config, ("logdir",), str(logdir), f"cannot create it or write in it ({why})",
                     "give a folder this user can create and write (--set logdir=PATH), or fix the "
                     "permissions or the mount there") from e
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock
