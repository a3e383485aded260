"""The decode stage: a batch's late-decoded fields, from their spilled encoded bytes to numpy.

A reader decodes an image field late (`shardkit.reader.reader.Reader`): its windows hold spill handles
(`shardkit.reader._pipeline.spill`), and `LateDecode` turns a batch's handles into what the field's
codec decodes them to (pixels), or into the encoded bytes themselves for a field read with
``decode=False``. It is picklable (it holds the spill's folder, not its open files), so the same
object runs in a transform worker process (`shardkit.reader._pipeline.transform`), where decoding
then happens in parallel with the reading process.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from shardkit.dataset import Field
from shardkit.dataset.codecs import _jpeg, headers
from shardkit.dataset.codecs.image import decode_image
from shardkit.dataset.schema import stored_null_error
from shardkit.errors import CorruptDatasetError, ImageShapeError
from shardkit.reader._pipeline.batching import Columns
from shardkit.reader._pipeline.spill import SpillReader, handles_to_bytes

__all__ = ["DecodeStage", "LateDecode", "late_fields"]


def late_fields(fields: Mapping[str, Field], decode: Mapping[str, bool]) -> dict[str, Field]:
    """The fields a reader decodes late: images, and fields delivered as their encoded bytes."""
    return {name: f for name, f in fields.items()
            if f.codec.name == "image" or not decode.get(name, True)}


@dataclasses.dataclass
class LateDecode:
    """Decode the late fields of a batch (the handles of ``spill``); ``raw``: fields left encoded."""

    fields: dict[str, Field]
    spill: SpillReader
    raw: frozenset[str] = frozenset()
    #: per sample, as a transform takes them (`LazyImages`): a decoded image lives while its sample is
    #: transformed, not the whole batch of them
    lazy: bool = False

    def __call__(self, batch: Columns) -> Columns:
        out = dict(batch)
        for name, field in self.fields.items():
            handles = batch[name]
            if name in self.raw:
                out[name] = handles_to_bytes(self.spill, handles)
                continue
            if self.lazy and field.fixed_shape and not (handles[:, 1] < 0).any():
                out[name] = LazyImages(field, *self.spill.read(handles))  # type: ignore[assignment]
                continue
            column = self._arrow(handles)
            if column.null_count and not field.nullable:
                raise stored_null_error(field, int(np.flatnonzero(handles[:, 1] < 0)[0]))
            out[name] = field.codec.decode(field, column)
        return out

    def _arrow(self, handles: np.ndarray) -> pa.Array:
        """The values of ``handles`` as an Arrow binary array (no copy of the bytes read)."""
        data, starts, ends = self.spill.read(handles)
        n = len(handles)
        nulls = ends < 0
        offsets = np.empty(n + 1, np.int64)
        offsets[:n] = starts
        offsets[n] = len(data)
        validity = None
        if nulls.any():
            validity = pa.array(~nulls).buffers()[1]
        buffers = [validity, pa.py_buffer(offsets), pa.py_buffer(data)]
        return pa.Array.from_buffers(pa.large_binary(), n, buffers, null_count=int(nulls.sum()))


class LazyImages:
    """A batch's images of one field, each decoded when it is indexed (``column[i]``): what a per-sample
    transform gets, so that a decoded image is held only while its sample is transformed. JPEGs go
    through `shardkit.dataset.codecs._jpeg` (simplejpeg where installed), PNGs through the codec's
    general path; headers are checked first, as every read checks them."""

    def __init__(self, field: Field, data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.field, self.data, self.starts, self.ends = field, data, starts, ends
        self.channels = headers.field_channels(field)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> np.ndarray:
        blob = self.data[int(self.starts[i]) : int(self.ends[i])]
        if len(blob) > 2 and blob[0] == 0xFF and blob[1] == 0xD8:  # a JPEG
            try:
                return _jpeg.decode_jpeg_one(blob, self.channels, field=self.field, row=i)
            except CorruptDatasetError:
                raise
            except Exception:  # a layout the fast path does not take: the general path says why
                pass
        pixels = decode_image(blob, self.field, i)
        if pixels.shape != self.field.dims:
            raise ImageShapeError(f"field {self.field.name!r}: row {i} decodes to an image of shape "
                                  f"{pixels.shape}, but the schema declares {self.field.shape}")
        return pixels


class DecodeStage:
    """Late fields decoded in threads, a batch per task, for a reader without a transform."""

    def __init__(self, prepare: LateDecode, threads: int) -> None:
        self.prepare = prepare
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardkit-decode")
        #: seconds decoding (summed over the threads), as `SampleStage.stats` names them
        self.stats: dict[str, float] = {"batches": 0, "seconds_busy": 0.0, "seconds_prepare": 0.0}
        self._lock = threading.Lock()

    def submit(self, batch: Columns, epoch: int, keys: np.ndarray) -> Future[Columns]:
        return self._pool.submit(self._timed, batch)

    def _timed(self, batch: Columns) -> Columns:
        start = time.perf_counter()
        out = self.prepare(batch)
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats["batches"] += 1
            self.stats["seconds_busy"] += seconds
            self.stats["seconds_prepare"] += seconds
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
