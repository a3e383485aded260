"""What a job run leaves behind: its failures, the `JobResult`, ``summary.json`` and the printed summary."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from shardkit.cluster.monitor.progress import data_wait_text
from shardkit.job.masking import Masker

__all__ = ["NO_STEP", "AttemptRecord", "CheckpointRecord", "Failure", "JobResult", "Status",
           "exit_reason", "newest_checkpoint", "reached_step", "scrub"]

Status = Literal["succeeded", "failed", "interrupted"]
#: Said of a process that never reported a step: what ends the startup window, and what to look at.
NO_STEP = ("; it never reported a training step: a script's heartbeat starts with its first ctx.step() "
           "(`with shardkit.trainer.init() as ctx: ... ctx.step(loss=...)`), so a script that never calls "
           "it, or one stuck before it (imports, a rendezvous, loading data), ends here")


def exit_reason(returncode: int) -> str:
    """``-9`` -> ``"killed by SIGKILL"``, ``3`` -> ``"exit code 3"``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def scrub(text: str, secrets: Iterable[str] | Masker) -> str:
    """``text`` with every secret value (of 4 characters or more) replaced by ``***``
    (`shardkit.job.masking.Masker`; pass one to reuse it)."""
    masker = secrets if isinstance(secrets, Masker) else Masker(secrets)
    return masker.text(text)


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why an attempt ended: the first process that died or fell silent, with the end of its log."""

    attempt: int
    role: str
    index: int
    reason: str  # "killed by SIGKILL", "exit code 1", "silent for 12.0 s (heartbeat_timeout 10 s)"
    returncode: int | None  # None: it was alive (silent) and was stopped
    silent_s: float | None
    step: int  # the last step it reported
    log: str
    last_lines: list[str]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def describe(self, lines: int = 10) -> str:
        head = (f"attempt {self.attempt}: {self.name} {self.reason} (last reported step {self.step}); "
                f"log {self.log}")
        tail = "".join(f"\n      | {line}" for line in self.last_lines[-lines:])
        return f"  - {head}{tail}"


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint a role reported writing."""

    attempt: int
    step: int
    url: str | None


@dataclasses.dataclass
class AttemptRecord:
    """One start of the job's processes."""

    attempt: int
    started_s: float  # seconds since the job started
    ended_s: float | None = None
    first_step_s: float | None = None  # seconds since the job started, at the first step heartbeat
    last_step_s: float | None = None  # ... at the lead's last step heartbeat
    resumed_from: int | None = None  # the newest complete checkpoint's step when the attempt started
    steps: int = 0  # the last step the lead role reported
    samples: int = 0  # trained by every process of this attempt (see `JobResult.samples`)
    outcome: str = "running"
    samples_resumed: int = 0  # samples of this run in the checkpoint it resumed from (`SampleLedger`)
    samples_lost: int = 0  # samples it trained past the checkpoint the next attempt resumed from
    # processes whose count may stop at their last heartbeat, as "worker-1 (killed by SIGKILL)"
    unreported: list[str] = dataclasses.field(default_factory=list)


def newest_checkpoint(checkpoints: Iterable[CheckpointRecord],
                      attempts: Iterable[AttemptRecord]) -> int | None:
    """The step of the newest checkpoint a job wrote or its attempts resumed from (None: there is none)."""
    steps = [c.step for c in checkpoints] + [a.resumed_from for a in attempts if a.resumed_from is not None]
    return max(steps, default=None)


def reached_step(attempts: Iterable[AttemptRecord]) -> int:
    """The highest step a job reached: the last step an attempt's lead reported, or the checkpoint an
    attempt resumed from, if that is higher (an attempt that fails before its first step has
    reported none, but it started at its checkpoint)."""
    return max((max(a.steps, a.resumed_from or 0) for a in attempts), default=0)


@dataclasses.dataclass
class JobResult:
    """How a job ended: returned by `shardkit.cluster.run_job` (failed: carried by its `JobError`).

    Samples are what the scripts pass to ``ctx.step(samples=)``, counted from their heartbeats:

    - ``samples``: trained, by every process in every attempt; what a failed attempt trained after the
      checkpoint the restart resumed from is trained again, and counted again.
    - ``samples_lost``: those trained again (lost to restarts), ``samples_kept`` the others: the
      samples in the final model (the last attempt's, and those of this run in the checkpoint it
      resumed from; see `shardkit.cluster.monitor.heartbeats.SampleLedger` for where that is exact).
      A job that did not succeed has no final model but its newest checkpoint, which a new run
      resumes: what its last attempt trained after that checkpoint is lost too, and ``samples_kept``
      is what the newest checkpoint holds of this run.
    - ``samples_unreported``: the processes whose count may stop at their last heartbeat. Heartbeats go
      out at most every ``heartbeat_interval``; a process that ends by itself reports its count on the
      way out (``done``, or a last ``step`` beat as an exception leaves ``with ctx``), but one killed by
      a signal (SIGKILL, the OOM killer, or stopped by the supervisor after another process failed)
      may not have, and what it trained after its last heartbeat is then missing: ``samples`` and
      ``samples_lost`` are lower bounds (``samples_exact`` False). The exit tells only how a process
      ended: one that sent its count and then hung (tearing down a broken torch process group) until it
      was stopped is listed too, and one that left without ``with ctx`` (``os._exit``) is not.
      ``samples_kept`` stays exact while the last attempt's processes all reported.

    ``samples_lost`` and ``samples_unreported`` are None where they were not measured (the summary of a
    torchrun node).
    """

    name: str
    status: Status
    logdir: Path
    steps: int
    restarts: int
    failures: list[Failure]
    checkpoints: list[CheckpointRecord]
    attempts: list[AttemptRecord]
    samples: int
    wall_s: float
    train_s: float  # summed over attempts: from the lead's first step heartbeat to its last
    metrics: dict[str, float]
    notes: list[str] = dataclasses.field(default_factory=list)
    samples_lost: int | None = None
    samples_unreported: list[str] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    @property
    def samples_per_s(self) -> float:
        """Samples trained by every process (``samples``) per second of training (see ``train_s``)."""
        return self.samples / self.train_s if self.train_s > 0 else 0.0

    @property
    def samples_kept(self) -> int | None:
        """The samples in the final model: ``samples`` less ``samples_lost`` (None where not measured)."""
        return None if self.samples_lost is None else self.samples - self.samples_lost

    @property
    def samples_exact(self) -> bool | None:
        """Whether every process reported its count at its end (None where not measured)."""
        return None if self.samples_unreported is None else not self.samples_unreported

    @property
    def first_step_s(self) -> float | None:
        """Seconds from the start of the job to its first step heartbeat."""
        return self.attempts[0].first_step_s if self.attempts else None

    @property
    def summary_path(self) -> Path:
        return self.logdir / "summary.json"

    @property
    def newest_checkpoint(self) -> int | None:
        """The step of the newest checkpoint the job wrote or resumed from (None: there is none)."""
        return newest_checkpoint(self.checkpoints, self.attempts)

    @property
    def nothing_left(self) -> bool:
        """The job succeeded without training: every attempt resumed from a checkpoint and its lead ended
        at that checkpoint's step without a training step (``shardkit train --resume`` of a run that had
        trained all it trains)."""
        return self.ok and self.samples == 0 and bool(self.attempts) and all(
            a.resumed_from is not None and a.first_step_s is None and a.steps <= a.resumed_from
            for a in self.attempts)

    @property
    def warnings(self) -> list[str]:
        """What a finished job should not have done without a word (printed and in ``summary.json``)."""
        out = []
        if self.ok and self.steps == 0:
            out.append("the job succeeded without reporting a training step: its scripts exited 0 but never "
                       "called ctx.step() (`with shardkit.trainer.init() as ctx: ... ctx.step(loss=...)`), "
                       "so nothing says that they trained; check that the script reaches its training loop "
                       "and reports each step")
        return out

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["logdir"] = os.fspath(self.logdir)
        data["samples_per_s"] = self.samples_per_s
        data["samples_kept"] = self.samples_kept
        data["samples_exact"] = self.samples_exact
        data["first_step_s"] = self.first_step_s
        data["newest_checkpoint"] = self.newest_checkpoint
        data["nothing_left"] = self.nothing_left
        data["warnings"] = self.warnings
        data["version"] = 1
        return data

    def write(self, masker: Masker | None = None) -> Path:
        """Write ``<logdir>/summary.json`` atomically (a temporary file renamed over it); with ``masker``,
        any secret value in it (a role's output in a failure's last lines) masked."""
        tmp = self.summary_path.with_suffix(".json.tmp")
        data = self.to_json() if masker is None else masker.deep(self.to_json())
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(tmp, self.summary_path)
        return self.summary_path

    def history(self) -> str:
        """Every failure, one per restart, with the end of the failing process's log."""
        return "\n".join(f.describe() for f in self.failures)

    def format(self) -> str:
        """The summary printed at the end of a job."""
        if self.nothing_left:
            return (f"job {self.name}: nothing left to train ({self.wall_s:.1f} s): it resumed from "
                    f"checkpoint step {self.steps}, and its scripts ended there without a training step. To "
                    "train further, raise what the script trains (its steps or epochs: params, "
                    "data.num_epochs) and run with --resume again; --fresh starts over from step 0\n"
                    + "\n".join([f"  note: {n}" for n in self.notes] + [self._paths()]))
        why = "; ".join(f"attempt {f.attempt}: {f.name} {f.reason}" for f in self.failures)
        last_ckpt = max((c.step for c in self.checkpoints), default=None)
        wait = data_wait_text(self.metrics)
        others = [f"{k} {v:.4g}" for k, v in sorted(self.metrics.items()) if not k.startswith("data_wait")]
        metrics = ", ".join(([wait] if wait else []) + others)
        at_least = "at least " if self.samples_exact is False else ""
        if self.ok:
            reached = f"{self.steps} steps"
        else:  # where it got to, and where a new run would resume from
            newest = self.newest_checkpoint
            reached = (f"reached step {self.steps}, newest checkpoint "
                       + (f"step {newest}" if newest is not None else "none"))
        lines = [
            f"job {self.name} {self.status} in {self.wall_s:.1f} s: {reached}, "
            f"{at_least}{self.samples:,} samples trained, {self.samples_per_s:,.0f} samples/s",
            f"  restarts: {self.restarts}" + (f" ({why})" if why else ""),
        ]
        if self.samples_lost is not None and self.ok and self.restarts:
            lines.append(f"  samples: {self.samples - self.samples_lost:,} in the final model; "
                         f"{at_least}{self.samples_lost:,} trained again after restarts (trained after the "
                         "checkpoint the next attempt resumed from)")
        elif self.samples_lost is not None and not self.ok and (self.restarts or self.samples_lost):
            newest = self.newest_checkpoint
            held = (f"in the newest checkpoint (step {newest}), where a new run resumes" if newest is not None
                    else "in a checkpoint (none was written)")
            lines.append(f"  samples: {self.samples - self.samples_lost:,} {held}; {at_least}"
                         f"{self.samples_lost:,} trained but not in it (after the checkpoint a restart, or "
                         "that new run, resumes from)")
        if self.samples_unreported:
            lines.append("  samples may be missing: what these processes trained after their last heartbeat "
                         "(ended by a signal, they may not have reported it): "
                         + "; ".join(self.samples_unreported))
        lines += [
            f"  checkpoints: {len(self.checkpoints)} written"
            + (f", newest step {last_ckpt}" if last_ckpt is not None else ""),
        ]
        if self.first_step_s is not None:
            lines.append(f"  first step {self.first_step_s:.1f} s after the start")
        if metrics:
            lines.append(f"  last metrics: {metrics}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines.append(self._paths())
        return "\n".join(lines)

    def _paths(self) -> str:
        return (f"  logs: {self.logdir / 'logs'}, TensorBoard: {self.logdir / 'tensorboard'}, "
                f"summary: {self.summary_path}")
