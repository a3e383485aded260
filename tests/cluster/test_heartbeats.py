"""What the supervisor makes of heartbeats: `apply_beat` on a watched process, and the `SampleLedger`'s
count of the samples in each checkpoint and of those a restart trains again (in process, no sockets)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from shardkit.cluster.monitor.heartbeats import SampleLedger, apply_beat
from shardkit.job.protocol import Heartbeat, HeartbeatKind


@dataclass
class Watched:
    last_beat: float | None = None
    done_at: float | None = None
    step: int = 0
    samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def beat(kind: HeartbeatKind, step: int, samples: int) -> Heartbeat:
    return Heartbeat(role="worker", index=0, attempt=0, pid=os.getpid(), kind=kind, step=step,
                     samples=samples)


def test_every_beat_but_start_carries_the_count() -> None:
    """An "alive" beat (``ctx.heartbeat()`` during an evaluation) carries the steps trained since the last
    rate-limited step beat; "start" is sent before the restore (step 0)."""
    w = Watched()
    assert apply_beat(w, beat("step", 1, 4), 1.0)
    assert not apply_beat(w, beat("alive", 9, 36), 2.0)
    assert (w.step, w.samples, w.last_beat) == (9, 36, 2.0)
    apply_beat(w, beat("start", 0, 0), 3.0)
    assert (w.step, w.samples, w.last_beat) == (9, 36, 2.0)


def test_the_restores_report_does_not_end_the_startup_window() -> None:
    """The "alive" beat that names the checkpoint restored comes before the first step: the process is
    still starting (``startup_timeout``, not ``heartbeat_timeout``), but its step is the restored one."""
    w = Watched()
    report = Heartbeat(role="worker", index=0, attempt=1, pid=os.getpid(), kind="alive", step=5,
                       checkpoint="/ckpt/step-000000005")
    assert not apply_beat(w, report, 1.0)
    assert (w.step, w.samples, w.last_beat) == (5, 0, None)
    assert apply_beat(w, beat("step", 6, 4), 2.0)
    assert w.last_beat == 2.0


def test_a_restart_loses_what_was_trained_after_the_checkpoint_it_resumes() -> None:
    ledger = SampleLedger()
    assert ledger.restart(0, None) == (0, 0)  # attempt 0, from scratch
    for step in range(1, 8):  # two workers of 4 and 5 samples a step; a checkpoint at 5
        ledger.beat("worker-0", step, 4 * step)
        ledger.beat("worker-1", step, 5 * step)
        if step == 5:
            ledger.checkpoint(5)
    assert ledger.restart(7 * 9, 5) == (2 * 9, 5 * 9)  # attempt 1 resumes from step 5
    ledger.beat("worker-0", 10, 5 * 4)
    ledger.checkpoint(10)
    ledger.beat("worker-1", 10, 5 * 5)  # after the chief's checkpoint beat: counted all the same
    ledger.beat("worker-0", 12, 7 * 4)
    ledger.beat("worker-1", 12, 7 * 5)
    assert ledger.restart(7 * 9, 10) == (2 * 9, 10 * 9)
    assert ledger.in_checkpoint == {5: 45, 10: 90}


def test_a_restart_from_an_older_checkpoint_loses_more() -> None:
    """Checkpoint 10 is broken (a crash in its save): the restart takes 5, written one attempt earlier."""
    ledger = SampleLedger()
    ledger.restart(0, None)
    ledger.beat("worker-0", 5, 20)
    ledger.checkpoint(5)
    ledger.beat("worker-0", 6, 24)
    assert ledger.restart(24, 5) == (4, 20)
    ledger.beat("worker-0", 10, 20)
    ledger.checkpoint(10)
    ledger.beat("worker-0", 11, 24)
    assert ledger.restart(24, 5) == (20 + 24 - 20, 20)


def test_a_checkpoint_of_an_earlier_run_holds_no_sample_of_this_one() -> None:
    ledger = SampleLedger()
    assert ledger.restart(0, 40) == (0, 0)  # the job started again, from its checkpoint of step 40
    ledger.beat("worker-0", 43, 12)
    assert ledger.restart(12, 40) == (12, 0)  # it failed before its first checkpoint: all 12 again


def test_a_process_without_a_beat_at_the_checkpoint_counts_at_its_last_beat_before_it() -> None:
    """A torch parameter-server worker runs at its own pace: its heartbeats need not hit the step worker
    0 saved at; its count at its last heartbeat before it stands in (documented as approximate)."""
    ledger = SampleLedger()
    ledger.restart(0, None)
    ledger.beat("worker-0", 20, 80)
    ledger.beat("worker-1", 17, 68)
    ledger.checkpoint(20)
    ledger.beat("worker-1", 23, 92)
    ledger.beat("worker-0", 24, 96)
    assert ledger.restart(96 + 92, 20) == (96 + 92 - 80 - 68, 80 + 68)
