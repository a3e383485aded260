"""A job's TensorBoard scalars (`shardkit.cluster.monitor.progress`): TensorBoard's own event messages in
TFRecord framing, read back with its EventAccumulator (through TensorFlow's record reader, and through
TensorBoard's own where TensorFlow is absent); a torch job's supervisor and workers never import
TensorFlow; without the tensorboard package the job goes on without them and says so."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import shardkit
from shardkit.cluster.monitor._tfrecord import crc32c, masked_crc32c
from shardkit.cluster.monitor.progress import Progress, ScalarWriter
from tests.trainer.scripts import proctree

REPO = Path(__file__).resolve().parents[2]
DDP_IDS = REPO / "tests" / "trainer" / "scripts" / "ddp_ids.py"  # torch DDP, a shardkit reader, checkpoints


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


def test_crc32c_is_castagnolis_and_masked_as_tfrecord_does() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    assert crc32c(b"") == 0
    crc = crc32c(b"shardkit")
    rotated = ((crc >> 15) | (crc << 17)) & 0xFFFFFFFF
    assert masked_crc32c(b"shardkit") == (rotated + 0xA282EAD8) & 0xFFFFFFFF


def test_tensorboards_own_reader_checks_the_records_without_tensorflow(tmp_path: Path) -> None:
    """Where TensorFlow is absent, TensorBoard reads event files with its own reader, which checks every
    record's CRCs: the files must pass it as they pass TensorFlow's."""
    tb = ScalarWriter(tmp_path)
    tb.add_scalars({"loss": 0.5, "samples_per_s": 12.0}, step=1)
    tb.add_scalars({"loss": 0.25}, step=2)
    tb.close()
    code = (
        "import sys; sys.modules['tensorflow'] = None\n"  # as where it is not installed
        "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
        f"acc = EventAccumulator({str(tmp_path)!r}); acc.Reload()\n"
        "print(sorted(acc.Tags()['scalars']), [(e.step, e.value) for e in acc.Scalars('loss')])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    assert out.strip() == "['loss', 'samples_per_s'] [(1, 0.5), (2, 0.25)]"
    damaged = tb.path.read_bytes()
    tb.path.write_bytes(damaged[:-5] + bytes([damaged[-5] ^ 1]) + damaged[-4:])  # the last record's data
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    assert out.strip() == "['loss', 'samples_per_s'] [(1, 0.5)]"  # the damaged record is dropped


_TENSORFLOW = "sorted(m for m in sys.modules if m.partition('.')[0] in ('tensorflow', 'keras', 'tf_keras'))"


@pytest.fixture
def _no_orphans() -> Iterator[None]:
    with proctree.reaped():
        yield


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_no_orphans")
def test_a_torch_job_imports_no_tensorflow_in_its_supervisor_or_workers(tmp_path: Path) -> None:
    """TensorFlow is installed here (extra ``tf``); a torch job must not import it: TensorBoard's
    ``EventFileWriter`` did, in the supervisor, seconds before the workers could start."""
    rows = 64
    x = np.random.default_rng(0).normal(size=(rows, 4)).astype(np.float32)
    schema = shardkit.Schema([shardkit.Field("id", "int64"), shardkit.Field("x", "float32", (4,)),
                              shardkit.Field("y", "float32")])
    data = tmp_path / "ids"
    shardkit.write_dataset({"id": np.arange(rows), "x": list(x), "y": x.sum(axis=1)}, str(data),
                           schema=schema, row_group_size=8)
    worker = tmp_path / "worker.py"  # the DDP script, then what it imported
    worker.write_text(
        "import json, os, runpy, sys\n"
        f"runpy.run_path({str(DDP_IDS)!r}, run_name='__main__')\n"
        "path = os.path.join(os.environ['SHARDKIT_JOB_DIR'], f\"modules-{os.environ['RANK']}.json\")\n"
        f"open(path, 'w').write(json.dumps({_TENSORFLOW}))\n"
    )
    config = {
        "name": "no-tf", "entrypoint": str(worker), "framework": "torch", "strategy": "allreduce",
        "roles": {"worker": {"count": 2}},
        "data": {"url": str(data), "batch_size": 4, "num_epochs": 1, "options": {"workers": 1}},
        "checkpoint": {"every_steps": 4, "keep": 2},
        "fault_tolerance": {"max_restarts": 0, "heartbeat_interval": 0.2, "startup_timeout": 120},
        "logdir": str(tmp_path / "job"), "env": {"OMP_NUM_THREADS": "1"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    supervisor = (  # `shardkit train`, then what it imported
        "import json, sys\n"
        "from shardkit.cli import main\n"
        f"code = main(['train', {str(tmp_path / 'job.yaml')!r}])\n"
        f"print('SUPERVISOR_TENSORFLOW', json.dumps({_TENSORFLOW}))\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", supervisor], cwd=REPO, capture_output=True, text=True,
                          timeout=200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    acc = _accumulate(tmp_path / "job" / "tensorboard")
    assert len(acc.Scalars("loss")) >= 1  # the supervisor wrote its scalars
    line = next(x for x in done.stdout.splitlines() if x.startswith("SUPERVISOR_TENSORFLOW"))
    assert json.loads(line.split(" ", 1)[1]) == [], "the supervisor imported TensorFlow"
    for rank in range(2):
        modules = json.loads((tmp_path / "job" / f"modules-{rank}.json").read_text())
        assert modules == [], f"torch worker {rank} imported TensorFlow"
    assert "oneDNN" not in done.stdout + done.stderr  # nor do TensorFlow's log lines reach the console
