"""Checkpoint folders on an fsspec filesystem: step names, atomic file writes, the ``COMMIT`` marker, checks.

Crash safety, by filesystem. Local: every file is written under a temporary name, fsynced and moved
into place with ``os.replace``; the folder is fsynced before ``COMMIT`` is written the same way, so a
power cut cannot leave a ``COMMIT`` whose files are not on disk. Object stores: each file is one PUT
(whole or absent), and ``COMMIT`` is PUT last, which is the atomic point; no folder is made there (keys
need none, and s3fs's ``makedirs`` would create a missing bucket), and a missing bucket is a
`CheckpointError`, for a restore as for a save (the save that follows could not succeed).

What the store refuses or cannot answer is never taken for "no checkpoint" nor for a damaged one, so a
restore does not skip to an older checkpoint, nor start from scratch, for it (`Store._access`): a refused
permission or credentials the store rejects (S3's AccessDenied, InvalidAccessKeyId) raise
`DatasetPermissionError` naming the path and what the credentials must allow; no credentials, or a store
that cannot be reached (refused connection, timeout) raise `CheckpointError` naming the URL and what to
check. Before the first save (`Store.begin`) and where a listing finds nothing, the folder is listed once
with the errors let out: s3fs's bucket probe answers "no bucket" for all of these.

Saves that overlap in one folder: locally they take turns under an exclusive ``fcntl.flock`` on
``_save.lock`` in the folder (`Store.lock`; ``flock`` coordinates the processes of one machine, on
network mounts such as NFS it may not). Object stores have no lock: one writer per folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from shardkit._storage import lockfile
from shardkit._storage.access import is_denied, permission_error, storage_errors
from shardkit._storage.location import Location
from shardkit.errors import CheckpointError, CorruptCheckpointError, ShardkitError

COMMIT = "COMMIT"
LOCK = "_save.lock"  # a file, never a step folder: `Store.steps` lists only folders named step-<n>
COMMIT_VERSION = 1
CHUNK = 4 << 20  # large tensors go out in pieces: bounded syscalls, and a kill can land mid-file
_STEP = re.compile(r"^step-(\d+)$")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as listed: ``COMMIT`` parsed, file sizes checked (sha256 only on restore)."""

    step: int
    url: str
    time: float
    framework: str
    files: Mapping[str, Mapping[str, Any]]


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def digest(chunks: Iterator[bytes] | bytes) -> dict[str, Any]:
    """``{"size", "sha256"}`` of bytes or of a stream of chunks."""
    h, size = hashlib.sha256(), 0
    for chunk in [chunks] if isinstance(chunks, bytes) else chunks:
        h.update(chunk)
        size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


class Store:
    """The checkpoint root ``loc``: ``Store(Location.of("s3://bucket/ckpt"))``."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self._bucket_checked = False

    def url(self, step: int, name: str = "") -> str:
        base = f"{self.loc.url.rstrip('/')}/{step_name(step)}"
        return f"{base}/{name}" if name else base

    def path(self, step: int, name: str = "") -> str:
        return self.loc.join(step_name(step), name) if name else self.loc.join(step_name(step))

    def steps(self) -> list[int]:
        """Steps that have a folder, committed or not, ascending; none when the folder does not exist.

        Raises `CheckpointError` when the folder is in a bucket that does not exist, or the store cannot
        be reached; `DatasetPermissionError` when these credentials may not list it.
        """
        self.loc.fs.invalidate_cache(self.loc.root)  # another process may have saved since: s3fs caches lists
        with self._access("list", self.loc.root):
            try:
                entries = self.loc.fs.ls(self.loc.root, detail=True)
            except FileNotFoundError:
                self._refuse_missing_bucket()  # a missing bucket is no fresh start: no save could follow
                return []
        self._bucket_checked = True
        found = []
        for entry in entries:
            match = _STEP.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
            if match and entry.get("type") == "directory":
                found.append(int(match.group(1)))
        return sorted(found)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the folder's save lock (local folders; elsewhere a no-op): a save that starts meanwhile in
        another process waits for this one to end, so two saves never mix their files or delete each
        other's. The lock file is removed at the end, while still held (a waiter that opened it sees it
        gone and locks the next one); a killed saver leaves it behind, unlocked, and the next save uses it.
        """
        if not lockfile.SUPPORTED or not self.loc.is_local:
            yield
            return
        path = self.loc.join(LOCK)
        try:
            os.makedirs(self.loc.root, exist_ok=True)
            fd = lockfile.acquire(path, block=True)
        except OSError as e:
            raise CheckpointError(f"could not open the lock file {path} of checkpoint folder "
                                  f"{self.loc.url} ({e}); check that the folder is writable") from e
        try:
            yield
        finally:
            lockfile.release(path, fd)

    def begin(self, step: int) -> None:
        """Make the step's folder empty and uncommitted: ``COMMIT`` goes first, so a crash from here on
        leaves an uncommitted folder, never an old commit that lists new files."""
        self._check_bucket()
        path = self.path(step)
        fs = self.loc.fs
        with self._access("write in", path):
            fs.invalidate_cache(self.loc.root)
            if fs.exists(path):
                self.remove(step)
            self.loc.makedirs(path)  # none on object stores: s3fs's makedirs would create a missing bucket
            self.sync_dir(self.loc.root)

    def _check_bucket(self) -> None:
        """Raise `CheckpointError` when the folder is on an object store whose bucket does not exist
        (asked once per `Store`): a save never creates a bucket, where a typo in the URL would make one.

        The folder is listed (`steps`) before the bucket is probed (`Location.missing_bucket`), as the
        listing lets out what s3fs's probe answers with "no bucket": a server that is down, credentials
        that the store rejects, and credentials that may list the folder but not ``HEAD`` the bucket
        (which need not stop a save).
        """
        if not self._bucket_checked and self.loc.is_object_store:
            self.steps()

    def _refuse_missing_bucket(self) -> None:
        """The bucket probe of `_check_bucket`, once the folder was listed and found empty or missing."""
        if self._bucket_checked:
            return
        with self._access("list", self.loc.root):
            bucket = self.loc.missing_bucket()
        if bucket is not None:
            example = f" (e.g. `aws s3 mb {bucket}`)" if bucket.startswith(("s3://", "s3a://")) else ""
            raise CheckpointError(
                f"no checkpoint can be saved under or restored from {self.loc.url}: the bucket {bucket} "
                "does not exist, or these credentials cannot see it. shardkit does not create buckets: fix "
                f"the URL, or create the bucket first{example}"
            )
        self._bucket_checked = True

    @contextmanager
    def _access(self, action: str, path: str) -> Iterator[None]:
        """Raise what the store refuses or cannot answer about ``path`` as a shardkit error with the fix.

        ``action`` is what was tried (``"read"``, ``"list"``, ``"write in"``): a refused permission is a
        `DatasetPermissionError` (`permission_error`: the owner and mode locally, the credentials on an
        object store); missing credentials and a store that cannot be reached are a `CheckpointError`
        (`storage_errors`). Neither is a `CorruptCheckpointError`: a restore stops on them, where it would
        skip a damaged checkpoint for an older one. Other errors (a missing file) go through as they are.
        """
        try:
            with storage_errors(self.loc.url, error=self._unreachable):
                yield
        except OSError as e:
            if isinstance(e, ShardkitError) or not is_denied(e):
                raise
            raise permission_error(self.loc, path, e, action=action) from e

    def _unreachable(self, message: str) -> CheckpointError:
        """`storage_errors`' message, and what it means for the checkpoints (none skipped, none changed)."""
        return CheckpointError(f"checkpoint folder: {message}. The checkpoints committed there are intact, "
                               "and none was skipped: fix this and run again")

    def write(self, step: int, name: str, data: bytes) -> dict[str, Any]:
        """Write one file of the step atomically; returns its ``{"size", "sha256"}``."""
        path = self.path(step, name)
        with self._access("write in", self.path(step)):
            self._write(path, data)
        return digest(data)

    def _write(self, path: str, data: bytes) -> None:
        if not self.loc.is_local:
            self.loc.fs.pipe_file(path, data)
            return
        folder, base = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{base}.tmp-{uuid.uuid4().hex[:8]}")
        view = memoryview(data)
        with open(tmp, "wb") as f:
            for start in range(0, len(view), CHUNK):
                f.write(view[start:start + CHUNK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def commit(self, step: int, files: Mapping[str, Mapping[str, Any]], framework: str) -> None:
        """Write ``COMMIT`` after every file (and, locally, every folder entry) is durable."""
        with self._access("write in", self.path(step)):
            if self.loc.is_local:
                for folder in {os.path.dirname(self.path(step, name)) for name in files}:
                    self.sync_dir(folder)
            doc = {"version": COMMIT_VERSION, "step": step, "time": time.time(), "framework": framework,
                   "files": {name: dict(meta) for name, meta in sorted(files.items())}}
            self.write(step, COMMIT, json.dumps(doc, indent=1).encode())
            self.sync_dir(self.path(step))

    def info(self, step: int) -> CheckpointInfo:
        """The step's `CheckpointInfo`; raises `CorruptCheckpointError` when it is not committed or broken."""
        doc = self.read_commit(step)
        time_ = doc.get("time")
        return CheckpointInfo(step, self.url(step), float(time_) if isinstance(time_, int | float) else 0.0,
                              str(doc.get("framework", "")), doc["files"])

    def read_commit(self, step: int) -> dict[str, Any]:
        """The step's ``COMMIT``, checked against the sizes of its files (not their sha256)."""
        where = self.url(step, COMMIT)
        try:
            with self._access("read", self.path(step, COMMIT)):
                raw = self.loc.fs.cat_file(self.path(step, COMMIT))
            doc = json.loads(raw.decode())
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{where} is missing: the save of step {step} did not finish") from e
        except (UnicodeDecodeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where} is not JSON ({e})") from e
        files = doc.get("files") if isinstance(doc, dict) else None
        if (not isinstance(doc, dict) or doc.get("version") != COMMIT_VERSION or doc.get("step") != step
                or not isinstance(files, dict) or not all(_file_meta(m) for m in files.values())):
            raise CorruptCheckpointError(
                f"{where} is not a version-{COMMIT_VERSION} commit of step {step} with a files table")
        sizes = self._sizes(step)
        for name, meta in files.items():
            if name not in sizes:
                raise CorruptCheckpointError(f"{self.url(step, name)} is listed in {where} but missing")
            if sizes[name] != meta["size"]:
                raise CorruptCheckpointError(f"{self.url(step, name)} has {sizes[name]} bytes, {where} "
                                             f"says {meta['size']} (truncated?)")
        return doc

    def read(self, step: int, name: str, meta: Mapping[str, Any]) -> bytes:
        """A file's bytes, verified against its size and sha256 in ``COMMIT``."""
        try:
            with self._access("read", self.path(step, name)):
                data = self.loc.fs.cat_file(self.path(step, name))
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{self.url(step, name)} is listed in its COMMIT but missing") from e
        self._check(step, name, digest(data), meta)
        return bytes(data)

    def verify_file(self, step: int, name: str, meta: Mapping[str, Any], local_path: str) -> None:
        """Check a local copy (or the local original) of a step's file against ``COMMIT``."""
        with open(local_path, "rb") as f:
            self._check(step, name, digest(iter(lambda: f.read(CHUNK), b"")), meta)

    def remove(self, step: int) -> None:
        """Delete a step's folder, ``COMMIT`` first: a crash midway leaves an uncommitted folder, not a
        commit with missing files (which would be reported as damaged)."""
        with self._access("write in", self.path(step)):
            if self.loc.fs.exists(self.path(step, COMMIT)):
                self.loc.fs.rm_file(self.path(step, COMMIT))
                self.sync_dir(self.path(step))
            self.loc.fs.rm(self.path(step), recursive=True)

    def read_marker(self, name: str) -> bytes | None:
        """The bytes of the file ``name`` at the root (a marker such as ``COMPLETED``); None when absent."""
        path = self.loc.join(name)
        try:
            with self._access("read", path):
                return bytes(self.loc.fs.cat_file(path))
        except FileNotFoundError:
            return None

    def write_marker(self, name: str, data: bytes) -> None:
        """Write the file ``name`` at the root atomically (locally: a temporary file renamed over it)."""
        with self._access("write in", self.loc.root):
            if self.loc.is_local:
                os.makedirs(self.loc.root, exist_ok=True)
            self._write(self.loc.join(name), data)

    def remove_marker(self, name: str) -> None:
        """Delete the file ``name`` at the root, if it is there."""
        path = self.loc.join(name)
        with self._access("write in", self.loc.root):
            if self.loc.fs.exists(path):
                self.loc.fs.rm_file(path)

    def move_to(self, dest: str, names: list[str]) -> list[str]:
        """Move every step folder and each of ``names`` (markers) found at the root into the folder
        ``dest`` (a path on the same filesystem); returns what was moved. Nothing is copied locally: each
        entry is renamed, so a crash midway leaves every checkpoint whole, in one place or the other."""
        moved = []
        markers = [n for n in names if self.loc.fs.exists(self.loc.join(n))]
        entries = [step_name(s) for s in self.steps()] + markers
        with self._access("write in", self.loc.root):
            if entries and self.loc.is_local:
                os.makedirs(dest, exist_ok=True)
            for entry in entries:
                target = f"{dest.rstrip('/')}/{entry}"
                if self.loc.is_local:
                    os.replace(self.loc.join(entry), target)
                else:
                    self.loc.fs.mv(self.loc.join(entry), target, recursive=True)
                moved.append(entry)
        return moved

    def sync_dir(self, path: str) -> None:
        """fsync a local folder so the names moved into it survive a power cut (no-op elsewhere)."""
        if not self.loc.is_local:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _sizes(self, step: int) -> dict[str, int]:
        base = self.path(step).rstrip("/") + "/"
        self.loc.fs.invalidate_cache(self.path(step))
        with self._access("list", self.path(step)):
            found = self.loc.fs.find(self.path(step), detail=True)
        return {name[len(base):]: int(info["size"]) for name, info in found.items() if name.startswith(base)}

    def _check(self, step: int, name: str, got: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        if got["size"] != meta["size"] or got["sha256"] != meta["sha256"]:
            raise CorruptCheckpointError(
                f"{self.url(step, name)} does not match its COMMIT ({got['size']} bytes, sha256 "
                f"{got['sha256'][:12]}..; expected {meta['size']} bytes, {str(meta['sha256'])[:12]}..): "
                "the file was changed or damaged after the save")


def _file_meta(meta: Any) -> bool:
    return (isinstance(meta, dict) and isinstance(meta.get("size"), int)
            and isinstance(meta.get("sha256"), str) and len(meta["sha256"]) == 64)
