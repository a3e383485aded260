"""What a job checks and prepares on this machine before its first process starts: that a local dataset
is there, and the logdir (locked for one run at a time, one run's outputs cleared, ``job.json``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

from shardkit.cluster import protocol
from shardkit.cluster.config import JobConfig
from shardkit.errors import ConfigError, ShardkitError

__all__ = ["LOCK_FILE", "LogdirLock", "check_local_data", "local_path", "prepare_logdir"]

LOCK_FILE = ".lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _error(config: JobConfig, key: tuple[str, ...], value: object, problem: str, fix: str) -> ConfigError:
    from shardkit.cluster.config_load import config_error

    return config_error(config.source, [(key, value, problem, fix)])


def local_path(url: str) -> str | None:
    """The path of a dataset URL on this machine's filesystem (a plain path or ``file://``), else None."""
    if url.startswith("file://"):
        return url.removeprefix("file://")
    return None if "://" in url else url


def check_local_data(config: JobConfig) -> None:
    """Fail before anything starts when ``data.url`` is a path on this machine that holds no dataset.

    Example:
        >>> check_local_data(config)     # only for engines whose roles run on this machine

    Choices: the check is the one every role's `make_reader` makes first, `shardkit.open_dataset`
    (with a summary, one small read; without, every file's footer, as each role would read them), so
    it fails exactly when the roles would, with the dataset layer's own reason. Warnings are left to
    the roles. Not in ``shardkit validate``: a config rendered for Kubernetes or YARN may name a path
    that exists only there; a remote URL (``s3://...``) is never checked here, as the roles may hold
    credentials this machine does not.

    Raises:
        ConfigError: naming ``data.url``, the path, why it does not open, and the fix.
    """
    if config.data is None:
        return
    path = local_path(config.data.url)
    if path is None:
        return
    from shardkit.dataset import open_dataset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            open_dataset(path)
    except (ShardkitError, OSError) as e:
        raise _error(config, ("data", "url"), config.data.url, f"there is no dataset to read there ({e})",
                     "point data.url at the dataset's folder (a relative path is relative to the config "
                     "file's folder), or write the dataset there first (shardkit.write_dataset, or "
                     "`shardkit index` for a plain Parquet folder)") from e


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
