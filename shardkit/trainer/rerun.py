"""Starting a job again where a run was: what makes a run completed, the choices, and moving one aside.

The model (as Lightning, Ray Train and TonY users expect it; the README's "Running a job again"):

- A run is *completed* when its chief ended it (``ctx.finish``, the end of ``with ctx``): after its last
  save it writes ``<checkpoint dir>/COMPLETED`` (`CheckpointManager.mark_completed`). The marker lives
  beside the checkpoints, not in the supervisor's ``summary.json``, so a script started by hand (no
  supervisor) and every engine (local, torchrun, Ray, Spark) see the same thing, on any filesystem.
- Started again, a completed run is refused before anything starts (`CompletedRunError`) unless the
  run says what it wants: ``resume`` (continue it from its last checkpoint: more epochs, a longer
  schedule; the marker is removed, so until it ends again it resumes as an interrupted run does),
  ``fresh`` (a new run from step 0: the old run's checkpoints and logs are moved to
  ``<logdir>/previous/<time>/``, never deleted), or another logdir.
- An interrupted or failed run (checkpoints, no marker) resumes by default: that is fault tolerance.
- ``shardkit train --resume`` / ``--fresh`` (``run_job(config, rerun=...)``) choose for a job; the
  supervisor (a torchrun job: node 0) decides before any process starts, and the processes it starts
  resume whatever it left. A script started by hand (``python train.py``, ``torchrun train.py``) decides
  in ``ctx.checkpoint.restore``, with ``SHARDKIT_RERUN=resume`` or ``fresh`` in its environment.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from shardkit.errors import CompletedRunError, ConfigError

if TYPE_CHECKING:
    from shardkit.job.config import JobConfig
    from shardkit.trainer.checkpoint import CheckpointManager, Completion

__all__ = ["PREVIOUS", "RERUN_ENV", "Rerun", "aside_dir", "changes", "check_rerun", "checkpoints_aside",
           "completed_run", "describe", "previous_job", "refusal", "rerun_from_env", "when"]

Rerun = Literal["refuse", "resume", "fresh"]
#: what a script started by hand does with a completed run: ``resume`` or ``fresh`` (unset: refuse)
RERUN_ENV = "SHARDKIT_RERUN"
#: where ``fresh`` moves an earlier run: ``<logdir>/previous/<time>/``
PREVIOUS = "previous"
_TRAINING = ("params", "roles", "data")


def rerun_from_env(env: Mapping[str, str] | None = None) -> Rerun:
    """``$SHARDKIT_RERUN`` (``resume``, ``fresh``; unset or empty: ``refuse``).

    Raises:
        ConfigError: another value, naming the variable and the values it takes.
    """
    value = (os.environ if env is None else env).get(RERUN_ENV, "").strip()
    if not value:
        return "refuse"
    if value not in ("resume", "fresh"):
        raise ConfigError(f"{RERUN_ENV}={value!r} (from the environment): not a choice. Fix: set it to "
                          "'resume' (continue the completed run) or 'fresh' (start a new one), or unset it")
    return value  # type: ignore[return-value]


def check_rerun(rerun: str) -> Rerun:
    """``rerun`` when it is one of `Rerun`; `ConfigError` naming the choices otherwise."""
    if rerun not in get_args(Rerun):
        raise ConfigError(f"rerun={rerun!r}: use one of {', '.join(map(repr, get_args(Rerun)))}")
    return rerun  # type: ignore[return-value]


def completed_run(config: JobConfig, manager: CheckpointManager | None = None) -> Completion | None:
    """The completed run in ``config``'s checkpoint folder (`CheckpointManager.completed`), or None."""
    if manager is None:
        from shardkit.trainer.checkpoint import CheckpointManager

        manager = CheckpointManager(config.checkpoint_dir, keep=None)
    return manager.completed()


def previous_job(logdir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``job.json`` an earlier run left in ``logdir`` (None when there is none, or it does not parse)."""
    try:
        doc = json.loads((Path(logdir) / "job.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _flat(value: Any, path: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{path}.{key}"))
        return out or {path: {}}
    return {path: value}


def _training(job: Mapping[str, Any]) -> dict[str, Any]:
    """What decides what a resumed run trains: params, data, and each role's process count."""
    out: dict[str, Any] = {}
    for section in _TRAINING:
        value = job.get(section)
        if section == "roles" and isinstance(value, Mapping):
            value = {role: spec.get("count") if isinstance(spec, Mapping) else spec
                     for role, spec in value.items()}
            out.update({f"roles.{role}.count": count for role, count in value.items()})
            continue
        if value is not None:
            out.update(_flat(value, section))
    return out


def changes(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> list[str]:
    """What differs between two jobs (``job.json`` documents) in what a resumed run trains: params,
    data, roles' counts, as ``"params.lr 0.05 -> 0.1"`` (``(none)`` for a key one of them lacks)."""
    if before is None:
        return []
    old, new = _training(before), _training(after)
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key, _NONE) != new.get(key, _NONE):
            out.append(f"{key} {_show(old.get(key, _NONE))} -> {_show(new.get(key, _NONE))}")
    return out


_NONE = object()


def _show(value: Any) -> str:
    return "(none)" if value is _NONE else json.dumps(value)


def aside_dir(config: JobConfig, *, now: float | None = None) -> Path:
    """A new ``<logdir>/previous/<time>/`` (the local time, ``20261128-064012``; ``-2``... when taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    base = Path(config.logdir) / PREVIOUS / stamp
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{stamp}-{n}")
    return path


def checkpoints_aside(config: JobConfig, aside: Path) -> str:
    """Where ``fresh`` moves the checkpoints: under ``aside`` as under the logdir when the checkpoint
    folder is inside the logdir (the default ``<logdir>/checkpoints``), else ``<checkpoint dir>/previous/
    <time>`` on the checkpoints' own filesystem (an ``s3://`` folder stays in its bucket)."""
    folder = config.checkpoint_dir
    logdir = Path(config.logdir).resolve()
    if "://" not in folder or folder.startswith("file://"):
        local = Path(folder.removeprefix("file://")).resolve()
        if local.is_relative_to(logdir) and local != logdir:
            return str(aside / local.relative_to(logdir))
    return f"{folder.rstrip('/')}/{PREVIOUS}/{aside.name}"


def when(done: Completion) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(done.time))


def describe(config: JobConfig, done: Completion) -> str:
    """``logdir X holds a run that completed at step N on <time> (its last checkpoint: URL)``."""
    return (f"logdir {config.logdir} holds a run of job {config.name} that completed at step {done.step} on "
            f"{when(done)} (its last checkpoint: {done.checkpoint})")


def refusal(config: JobConfig, done: Completion, changed: list[str], *, by_hand: bool) -> CompletedRunError:
    """The error for a completed run started again without a choice: what is there, when it ended, the
    overrides that would change what a resumed run trains, and the choices (``shardkit train``'s flags,
    or ``$SHARDKIT_RERUN`` for a script started by hand)."""
    changed_text = (f" This run changes what it would train: {'; '.join(changed)}; resumed, those apply from "
                    f"step {done.step} on." if changed else "")
    aside = Path(config.logdir) / PREVIOUS / "<time>"
    if by_hand:
        choices = (f"  {RERUN_ENV}=resume   continue it from step {done.step} (give it more to train: more "
                   "data.num_epochs, a longer schedule)\n"
                   f"  {RERUN_ENV}=fresh    start a new run from step 0; the old run's checkpoints are moved "
                   f"to {aside}/ (nothing is deleted)\n"
                   "  or give this run its own logdir (logdir: in the config), or run it with "
                   "`shardkit train CONFIG --resume` / `--fresh`")
    else:
        choices = (f"  --resume            continue it from step {done.step} (give it more to train: e.g. "
                   "--set data.num_epochs=40, a longer schedule)\n"
                   "  --fresh             start a new run from step 0; the old run's checkpoints and logs "
                   f"are moved to {aside}/ (nothing is deleted)\n"
                   f"  --set logdir=PATH   start a new run in another logdir (e.g. {config.logdir}-2)\n"
                   "  (Python: shardkit.cluster.run_job(config, rerun='resume' or 'fresh'))")
    return CompletedRunError(
        f"{describe(config, done)}. Started again as it is, it would resume that checkpoint and train "
        f"nothing.{changed_text} Fix: choose one:\n{choices}")
