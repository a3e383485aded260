"""What every read case does with a batch: copy its tensors into a preallocated buffer, as a collate does.

Readers that hand out zero-copy views of memory-mapped or cached data would otherwise be timed without
reading a byte of pixels, while readers that copy pay for it. Stdlib + numpy only: the Petastorm and HF
venvs import it too (``benchmarks.petastorm_side._consume`` or, from a script in this folder,
``_consume``).
"""

import time

import numpy as np

TENSORS = {"image": np.uint8, "features": np.float32}


class Consumer:
    """``consume(columns)`` copies the ``image`` and ``features`` of a batch (or of one row) once."""

    def __init__(self) -> None:
        self.buffers: dict = {}
        self.bytes = 0

    def consume(self, columns) -> None:
        for name, dtype in TENSORS.items():
            value = columns[name]
            a = np.asarray(value)
            if a.dtype == object:  # a reader that gives one array per row
                a = np.stack(list(a))
            n = a.shape[0]
            flat = a.reshape(n, -1)
            buf = self.buffers.get(name)
            if buf is None or buf.shape[0] < n or buf.shape[1] != flat.shape[1]:
                buf = self.buffers[name] = np.empty((max(n, 256), flat.shape[1]), dtype=dtype)
            np.copyto(buf[:n], flat, casting="unsafe")
            self.bytes += flat.nbytes


def drain(batches, started, cpu0, cpu_seconds, get=None) -> dict:
    """Iterate ``batches`` to the end, each consumed once (`Consumer`), and say what it took.

    ``started`` is the ``time.perf_counter()`` and ``cpu0`` the ``cpu_seconds()`` taken before the reader
    was made; ``get(batch, name)`` gives a column (default ``batch[name]``). Returns rows, the sum of
    ``id`` (an epoch that ends early shows), batches, seconds, first_batch_seconds (all the seconds
    when there was no batch) and cpu_seconds.
    """
    get = get or (lambda batch, name: batch[name])
    rows = id_sum = count = 0
    first = None
    consumer = Consumer()
    for batch in batches:
        consumer.consume({name: get(batch, name) for name in TENSORS})
        if first is None:
            first = time.perf_counter() - started
        ids = np.asarray(get(batch, "id"))
        rows += len(ids)
        id_sum += int(ids.sum())
        count += 1
    seconds = time.perf_counter() - started
    return {"rows": rows, "id_sum": id_sum, "batches": count, "seconds": seconds,
            "first_batch_seconds": seconds if first is None else first,
            "cpu_seconds": cpu_seconds() - cpu0}
