"""What ``shardkit train`` does with the run a logdir holds, before any process starts: refuse a completed
run, continue it (``--resume``), or move it aside for a new one (``--fresh``).

The model is `shardkit.trainer.rerun`'s. Here the supervisor (a torchrun job: node 0; the other nodes
follow, since no worker starts before node 0 has joined the rendezvous) decides once per ``shardkit
train``; the processes it starts then resume whatever it left in the checkpoint folder, restarts
included.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shardkit.cluster.monitor.preflight import LOCK_FILE, LogdirLock
from shardkit.errors import CheckpointError, ShardkitError
from shardkit.job.config import JobConfig
from shardkit.trainer.rerun import (
    PREVIOUS,
    Rerun,
    aside_dir,
    changes,
    check_rerun,
    checkpoints_aside,
    previous_job,
    refusal,
    when,
)

if TYPE_CHECKING:
    from shardkit.trainer.checkpoint import Completion

__all__ = ["move_aside", "prepare_rerun"]


def prepare_rerun(config: JobConfig, rerun: Rerun, *, say: Callable[[str], None],
                  node: int | None = None) -> None:
    """Decide what this run does with the run ``config``'s logdir holds, before anything starts.

    Example:
        >>> prepare_rerun(config, "refuse", say=print)    # CompletedRunError if the run there completed

    ``rerun``: ``"refuse"`` (the default of ``shardkit train``: a completed run is refused, an
    interrupted or failed one resumes), ``"resume"`` (a completed run goes on: its ``COMPLETED`` marker
    is removed, so its processes resume its last checkpoint), ``"fresh"`` (the earlier run's
    checkpoints, logs, TensorBoard and summary are moved to ``<logdir>/previous/<time>/``, `move_aside`).
    ``node``: a torchrun node's rank; only node 0 decides. The logdir is locked meanwhile (a run that
    holds it is never moved from under it). Overrides that change what a resumed run trains (params,
    data, roles' counts, against the earlier run's ``job.json``) are named: in the refusal, or on the
    console when a run resumes.

    Raises:
        CompletedRunError: a completed run and ``"refuse"``.
        ConfigError: another run holds the logdir.
        CheckpointError: ``"fresh"`` could not move the checkpoints (nothing was deleted).
    """
    rerun = check_rerun(rerun)
    if node not in (None, 0):
        return
    logdir = Path(config.logdir)
    lock = LogdirLock(config, node=node) if logdir.is_dir() else None
    try:
        _decide(config, rerun, say, node)
    finally:
        if lock is not None:
            lock.release()


def _decide(config: JobConfig, rerun: Rerun, say: Callable[[str], None], node: int | None) -> None:
    from shardkit.trainer.checkpoint import CheckpointManager

    if rerun == "fresh":
        moved = move_aside(config, node=node)
        if moved is not None:
            say(f"[shardkit] --fresh: a new run from step 0; the earlier run's checkpoints and logs are in "
                f"{moved}")
        return
    manager = CheckpointManager(config.checkpoint_dir, keep=None)
    try:
        done = manager.completed()
        latest = manager.latest() if done is None else None
    except (ShardkitError, OSError):  # the roles may hold credentials this machine lacks: they decide
        return
    if done is None and latest is not None:
        done = _completed_before_markers(config, latest.step, latest.url)
    changed = changes(previous_job(config.logdir), config.redacted())
    what = f"; changed since: {'; '.join(changed)}" if changed else ""
    if done is None:
        if latest is not None and changed:
            say(f"[shardkit] resuming the unfinished run from checkpoint step {latest.step}{what}")
        elif rerun == "resume" and latest is None:
            say(f"[shardkit] --resume: no checkpoint under {config.checkpoint_dir}; starting from step 0")
        return
    if rerun == "refuse":
        raise refusal(config, done, changed, by_hand=False)
    manager.forget_completed()
    say(f"[shardkit] --resume: continuing the run that completed at step {done.step} on {when(done)} "
        f"from its last checkpoint{what}")


def _completed_before_markers(config: JobConfig, step: int, url: str) -> Completion | None:
    """A run that completed before runs recorded it (no ``COMPLETED``, from an earlier shardkit): its
    ``summary.json`` says ``succeeded`` at the newest checkpoint's step."""
    from shardkit.trainer.checkpoint import Completion

    path = Path(config.logdir) / "summary.json"
    try:
        doc = json.loads(path.read_text())
        ended = path.stat().st_mtime
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("status") != "succeeded" or doc.get("steps") != step:
        return None
    return Completion(step, ended, url)


def move_aside(config: JobConfig, *, node: int | None = None) -> Path | None:
    """Move what an earlier run left in the logdir (checkpoints, logs, TensorBoard, summary, job.json)
    to a new ``<logdir>/previous/<time>/``, and a checkpoint folder outside the logdir to
    ``<checkpoint dir>/previous/<time>/``; returns where, or None when nothing was there.

    Everything is renamed, nothing copied or deleted. The lock files stay, and so does ``previous/``.
    ``node``: a torchrun node (0) moves its own logs (``logs/node-0``) only: the other nodes' logs may
    be in use already, and each node clears its own when it starts.
    """
    from shardkit.trainer.checkpoint import CheckpointManager

    logdir = Path(config.logdir)
    aside = aside_dir(config)
    names = sorted(os.listdir(logdir)) if logdir.is_dir() else []
    entries = [logdir / n for n in names if n != PREVIOUS and not n.startswith(LOCK_FILE)]
    if node is not None:
        entries = [e for e in entries if e.name != "logs"] + [logdir / "logs" / f"node-{node}"]
    entries = [e for e in entries if e.exists()]
    moved = False
    try:
        for entry in entries:
            target = aside / entry.relative_to(logdir)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(entry, target)
            moved = True
    except OSError as e:
        raise CheckpointError(f"--fresh: could not move {entry} to {aside} ({e}); check that the logdir is "
                              "writable (nothing was deleted)") from e
    dest = checkpoints_aside(config, aside)
    if not dest.startswith(str(aside)):  # a checkpoint folder outside the logdir: moved on its filesystem
        moved = bool(CheckpointManager(config.checkpoint_dir, keep=None).move_aside(dest)) or moved
    return aside if moved else None
