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
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from shardkit.dataset import Field
from shardkit.errors import CorruptDatasetError
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

    def __call__(self, batch: Columns) -> Columns:
        out = dict(batch)
        for name, field in self.fields.items():
            handles = batch[name]
            if name in self.raw:
                out[name] = handles_to_bytes(self.spill, handles)
                continue
            column = self._arrow(handles)
            if column.null_count and not field.nullable:
                row = int(np.flatnonzero(handles[:, 1] < 0)[0])
                raise CorruptDatasetError(
                    f"field {field.name!r} is not nullable but a row of a batch (its row {row}) is null: the "
                    "file was written outside shardkit or for another schema; rewrite it with the field "
                    f"declared Field({field.name!r}, ..., nullable=True)")
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


class DecodeStage:
    """Late fields decoded in threads, a batch per task, for a reader without a transform."""

    def __init__(self, prepare: LateDecode, threads: int) -> None:
        self.prepare = prepare
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardkit-decode")

    def submit(self, batch: Columns, epoch: int, keys: np.ndarray) -> Future[Columns]:
        return self._pool.submit(self.prepare, batch)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
