"""A job's TensorBoard scalars (`shardkit.cluster.monitor.progress`), written by TensorBoard's own event-file
writer and read back with its EventAccumulator; without the tensorboard package the job goes on without
them and says so."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shardkit.cluster.monitor.progress import Progress, ScalarWriter


def _accumulate(logdir: Path) -> Any:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return acc


def test_scalars_read_back_by_tensorboard(tmp_path: Path) -> None:
    tb = ScalarWriter(tmp_path)
    for step in range(1, 6):
        tb.add_scalars({"loss": 1.0 / step, "samples_per_s": 100.0 * step, "ignored": "text", "flag": True},
                       step)
    tb.add_scalar("restarts", 1, step=3)
    tb.add_scalars({"big_step": 2.5}, step=2**40)

    acc = _accumulate(tmp_path)  # before close: every call was flushed

    assert set(acc.Tags()["scalars"]) == {"loss", "samples_per_s", "restarts", "big_step"}
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert all(math.isclose(e.value, 1.0 / e.step, rel_tol=1e-6) for e in loss)
    assert [(e.step, e.value) for e in acc.Scalars("restarts")] == [(3, 1.0)]
    assert acc.Scalars("big_step")[0].step == 2**40
    tb.close()


def test_a_write_after_close_is_ignored(tmp_path: Path) -> None:
    tb = ScalarWriter(tmp_path)
    tb.close()
    tb.add_scalar("x", 1.0, 1)
    assert _accumulate(tmp_path).Tags()["scalars"] == []


def test_finite_values_beyond_float32_are_written_as_infinity(tmp_path: Path) -> None:
    """TensorBoard stores float32: exp(100) (a perplexity early in training) is +inf there, not an error."""
    tb = ScalarWriter(tmp_path)
    tb.add_scalars({"ppl": math.exp(100), "neg": -1e300, "top": 3.4028234663852886e38, "nan": math.nan,
                    "inf": math.inf}, step=1)
    tb.add_scalars({"ppl": 2.5}, step=2)  # the writer goes on
    tb.close()
    acc = _accumulate(tmp_path)
    assert [e.value for e in acc.Scalars("ppl")] == [math.inf, 2.5]
    assert acc.Scalars("neg")[0].value == -math.inf
    assert math.isclose(acc.Scalars("top")[0].value, 3.4028234663852886e38)  # float32's largest: kept
    assert math.isnan(acc.Scalars("nan")[0].value)
    assert acc.Scalars("inf")[0].value == math.inf


def test_progress_writes_metrics_samples_per_s_and_restarts(tmp_path: Path) -> None:
    said: list[str] = []
    progress = Progress(tmp_path, said.append)
    progress.open()
    progress.scalars(1, 100, {"loss": 0.5})
    progress.scalars(2, 200, {"loss": 0.25})
    progress.restarted(attempt=1, step=1)
    progress.close()
    acc = _accumulate(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [e.step for e in acc.Scalars("samples_per_s")] == [2]
    assert [(e.step, e.value) for e in acc.Scalars("restarts")] == [(0, 0.0), (1, 1.0)]
    assert progress.errors == 0


def test_without_tensorboard_the_job_goes_on_without_scalars_and_says_how_to_have_them(
        tmp_path: Path) -> None:
    code = (  # a Python where `import tensorboard` fails, as where it is not installed
        "import sys; sys.modules['tensorboard'] = None\n"
        "from pathlib import Path\n"
        "from shardkit.cluster.monitor.progress import Progress\n"
        f"p = Progress(Path({str(tmp_path)!r}), print)\n"
        "p.open(); p.scalars(1, 10, {'loss': 1.0}); p.restarted(1, 1); p.close()\n"
        "print('errors', p.errors)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "TensorBoard scalars are off: the tensorboard package is not installed" in out
    assert "pip install 'shardkit[tensorboard]'" in out
    assert "errors 0" in out
    assert list(tmp_path.iterdir()) == []
