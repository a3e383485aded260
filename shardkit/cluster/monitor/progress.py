"""What a running job shows: progress lines on the console and TensorBoard scalars in the logdir.

The scalars are TensorBoard's own ``Event`` messages (the ``tensorboard`` package, extra
``shardkit[tensorboard]``) in TFRecord framing written here (`shardkit.cluster.monitor._tfrecord`), so
that neither torch nor TensorFlow is imported: TensorBoard's ``EventFileWriter`` imports TensorFlow
wherever it is installed, seconds before a torch job's first process could start. Where the package is
not installed the job runs without scalars and says so once, as Lightning falls back from its
TensorBoard logger.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from shardkit.cluster.monitor._tfrecord import frame

__all__ = ["Progress", "ScalarWriter"]


class ScalarWriter:
    """Scalars into a new TensorBoard event file in ``logdir``, flushed at every call (a live TensorBoard
    sees them at once).

    Example:
        >>> tb = ScalarWriter("runs/digits/tensorboard")
        >>> tb.add_scalars({"loss": 0.3, "samples_per_s": 2100.0}, step=17)

    Values that are not numbers are skipped; finite values beyond float32's range (a diverging loss)
    are stored as +-inf, since TensorBoard stores float32. After `close`, writes are ignored.

    Raises:
        ImportError: the ``tensorboard`` package is not installed.
    """

    def __init__(self, logdir: str | Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        folder = Path(logdir)
        folder.mkdir(parents=True, exist_ok=True)
        # TensorBoard's name for an event file (it reads the files named events.out.tfevents.*)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_FILE_IDS)}")
        self.path = folder / name
        self._file: IO[bytes] | None = open(self.path, "xb")  # noqa: SIM115 (open until `close`)
        try:
            self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        except BaseException:
            self.close()
            raise

    def _write(self, event: Any) -> None:
        if self._file is None:
            return
        self._file.write(frame(event.SerializeToString()))
        self._file.flush()

    def add_scalars(self, scalars: Mapping[str, object], step: int, wall_time: float | None = None) -> None:
        """Write one event with every numeric value of ``scalars`` (tag -> value) at ``step``."""
        values = [self._summary.Value(tag=tag, simple_value=float(v))  # type: ignore[arg-type]
                  for tag, v in scalars.items() if isinstance(v, int | float) and not isinstance(v, bool)]
        if values:
            self._write(self._event(wall_time=time.time() if wall_time is None else wall_time,
                                    step=step, summary=self._summary(value=values)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.add_scalars({tag: value}, step)

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()


_FILE_IDS = itertools.count()  # two writers of one process in one second: two files


def data_wait_text(metrics: Mapping[str, float]) -> str | None:
    """``data wait 41% (transform 38%, read 2%)`` from the ``data_wait`` metrics (the share of step time
    a rank waited for batches, and what for: `shardkit.trainer.TrainContext.data_wait`); None without."""
    total = metrics.get("data_wait")
    if total is None:
        return None
    parts = sorted(((v, k.split("/", 1)[1]) for k, v in metrics.items()
                    if k.startswith("data_wait/") and v >= 0.005), reverse=True)
    detail = f" ({', '.join(f'{name} {v:.0%}' for v, name in parts)})" if parts and total >= 0.1 else ""
    return f"data wait {total:.0%}{detail}"


def _metrics(metrics: Mapping[str, float]) -> str:
    """`` | name value`` per metric; the ``data_wait`` ones as one ``data wait 41% (transform 38%)``."""
    wait = data_wait_text(metrics)
    return (f" | {wait}" if wait else "") + "".join(
        f" | {k} {v:.4g}" for k, v in sorted(metrics.items()) if not k.startswith("data_wait"))


class Progress:
    """Console progress (a line every ``interval`` seconds) and TensorBoard scalars of the lead process.

    TensorBoard gets, at the lead's step: every metric it reports (``loss``, ...), ``samples_per_s`` (all
    processes' samples per second since the previous point) and ``restarts``. After a restart the steps
    go back to the checkpoint's, and TensorBoard drops the points of the lost steps.

    Showing progress never stops a job: an error in any method (a metric TensorBoard cannot store, a
    full disk under the event file, ...) is reported once, as a ``[shardkit] warning:`` line, and the
    call returns; later calls go on (a later value may well be fine). The supervisor and a torchrun
    node's monitor thread both call only these methods, so this is the one place that guards them.
    """

    def __init__(self, tb_dir: Path, say: Callable[[str], None], interval: float = 5.0) -> None:
        self.tb_dir, self.say, self.interval = tb_dir, say, interval
        self.tb: ScalarWriter | None = None
        self.restarts = 0
        self.checkpoint_step: int | None = None
        self.errors = 0  # errors caught by `_guard`; the first one was shown
        self._tb_last: tuple[float, int] | None = None
        self._tick_last: tuple[float, int] = (time.monotonic(), 0)

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            self.errors += 1
            if self.errors == 1:
                with suppress(Exception):  # the console itself may be what failed
                    self.say(f"[shardkit] warning: {what} failed ({type(e).__name__}: {e}); the job goes on "
                             "(later such errors are not shown)")

    def open(self) -> None:
        with self._guard(f"opening TensorBoard's event file in {self.tb_dir}"):
            try:
                self.tb = ScalarWriter(self.tb_dir)
            except ImportError:
                self.say("[shardkit] TensorBoard scalars are off: the tensorboard package is not installed "
                         "(pip install 'shardkit[tensorboard]')")
                return
            self.tb.add_scalar("restarts", 0, 0)

    def first_step(self, attempt: int, seconds: float) -> None:
        with self._guard("progress output"):
            self.say(f"[shardkit] attempt {attempt}: first step {seconds:.1f} s after it started")
            self._tick_last = (time.monotonic(), self._tick_last[1])

    def scalars(self, step: int, samples: int, metrics: Mapping[str, float]) -> None:
        with self._guard(f"writing TensorBoard scalars at step {step}"):
            now = time.monotonic()
            values: dict[str, object] = dict(metrics)
            if self._tb_last is not None and now > self._tb_last[0] and samples >= self._tb_last[1]:
                values["samples_per_s"] = (samples - self._tb_last[1]) / (now - self._tb_last[0])
            self._tb_last = (now, samples)
            if self.tb is not None:
                self.tb.add_scalars(values, step)

    def tick(self, step: int, samples: int, metrics: Mapping[str, float]) -> None:
        with self._guard("the progress line"):
            now = time.monotonic()
            last_time, last_samples = self._tick_last
            if now - last_time < self.interval or step == 0:
                return
            rate = max(0, samples - last_samples) / (now - last_time)
            self._tick_last = (now, samples)
            ckpt = f" | checkpoint step {self.checkpoint_step}" if self.checkpoint_step is not None else ""
            self.say(f"[shardkit] step {step} | {rate:,.0f} samples/s{_metrics(metrics)} | "
                     f"restarts {self.restarts}{ckpt}")

    def checkpoint(self, step: int, url: str | None) -> None:
        with self._guard("progress output"):
            self.checkpoint_step = step
            self.say(f"[shardkit] checkpoint step {step}" + (f": {url}" if url else ""))

    def restarted(self, attempt: int, step: int) -> None:
        with self._guard("writing the restart to TensorBoard"):
            self.restarts += 1
            self._tb_last = None
            if self.tb is not None:
                self.tb.add_scalar("restarts", self.restarts, step)
            self.say(f"[shardkit] restart {self.restarts}: starting attempt {attempt}")

    def close(self) -> None:
        with self._guard("closing TensorBoard's event file"):
            if self.tb is not None:
                self.tb.close()
