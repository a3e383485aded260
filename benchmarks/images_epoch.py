"""One epoch (or its first batches) through a DataLoader-type loader, as every system's image case reads it.

Imported by `benchmarks.images` (shardkit's cases) and `benchmarks.images_peers` (LitData's and Mosaic's,
in their own venv): it needs nothing but the standard library.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def drain(loader: Any, started: float, stop_after: int | None,
          save: Callable[[], None] | None = None) -> dict[str, Any]:
    """Iterate ``loader`` (batches with an ``id`` column) and time it from ``started`` (``perf_counter``).

    Returns the seconds to the first batch, the ids of each batch, the images and the seconds. Stops after
    ``stop_after`` batches (None: the whole epoch); ``save()`` then runs while the iterator still lives
    (a loader's state), and the iterator ends here (a cut epoch's workers stop).
    """
    first = None
    ids: list[list[int]] = []
    images = 0
    it = iter(loader)
    for batch in it:
        if first is None:
            first = time.perf_counter() - started
        got = batch["id"].tolist()
        ids.append(got)
        images += len(got)
        if stop_after is not None and len(ids) >= stop_after:
            break
    seconds = time.perf_counter() - started
    if save is not None:
        save()
    del it
    return {"first_batch_seconds": first if first is not None else seconds, "ids": ids, "images": images,
            "seconds": seconds}
