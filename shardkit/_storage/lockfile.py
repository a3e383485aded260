"""An exclusive lock on a file that the holder removes when it lets go, for a folder's writers.

Shared by the dataset writer (``_write.lock``, `shardkit.dataset.write.commit.write_lock`) and checkpoint
saves (``_save.lock``, `shardkit.trainer.checkpoint._store.Store.lock`). POSIX only: where there are no
advisory
locks (`SUPPORTED` is False) the callers go on unlocked.
"""

from __future__ import annotations

import contextlib
import os

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks
    fcntl = None  # type: ignore[assignment]

__all__ = ["SUPPORTED", "acquire", "release"]

SUPPORTED = fcntl is not None


def acquire(path: str, *, block: bool) -> int:
    """Open (creating it) and ``flock`` ``path`` exclusively; the file descriptor that holds the lock.

    The holder removes the file as it lets go (`release`), so a process that opened it meanwhile and
    then gets the lock holds it on a file no longer there: it sees that (another inode at ``path``, or
    none) and locks the file there now. ``block=False``: `BlockingIOError` while another holds it.
    Errors of ``open`` and ``flock`` are raised as they are, for the caller to name its folder.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)  # the holder removed this file as it let go: lock the one there now


def release(path: str, fd: int) -> None:
    """Remove ``path`` while still holding its lock (see `acquire`), then let go. A file that cannot be
    removed stays, unlocked: the next `acquire` uses it."""
    with contextlib.suppress(OSError):
        os.remove(path)
    os.close(fd)
