"""`MapDataset`: a map-style torch dataset (``len`` and ``dataset[i]``) over a shardkit dataset's rows, for
any sampler (weighted, class-balanced, hard-example mining) and any number of DataLoader workers.

The rows, their indices, filters, workers and the disk cache are `shardkit.reader.adapters.rows.MapSource`'s;
this adds torch's values. A sample is what the stream's batch holds for that row (`Collate`: a tensor per
number field, ``str``/``bytes`` for text, a tensor or None per variable-shape row, ``<name>__valid`` for a
nullable field), so torch's default collate stacks samples into the batch ``shardkit.torch.make_loader``
would give. torch's DataLoader (2.1 and later) calls ``__getitems__`` with a whole batch of indices: the
batch's rows are read with one lookup.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardkit.dataset import Dataset, Schema
from shardkit.dataset.take import CACHE_BYTES, encoded_schema
from shardkit.errors import ReaderError, require
from shardkit.reader._cache import CacheConfig
from shardkit.reader._filter import Filter
from shardkit.reader.adapters.collate import Collate, plan_fields, prepare
from shardkit.reader.adapters.rows import MapSource

require("torch", extra="torch", purpose="shardkit.torch (PyTorch tensors and DataLoader workers)")

import torch  # noqa: E402
import torch.utils.data  # noqa: E402

from shardkit.reader.adapters.torch import to_torch  # noqa: E402

__all__ = ["MapDataset"]


class MapDataset(MapSource, torch.utils.data.Dataset[Any]):
    """A map-style torch dataset over a shardkit dataset: ``len(ds)`` rows, ``ds[i]`` one sample.

    Example:
        >>> ds = shardkit.torch.MapDataset(url, columns=["image", "label"])
        >>> sampler = torch.utils.data.WeightedRandomSampler(weights, num_samples=10_000)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=256, sampler=sampler, num_workers=4)

    Args: `MapSource`'s, and
        transform: ``fn(sample) -> anything``, run on each sample in the process that looks it up (a
            DataLoader worker), on the numpy sample (`MapSource`); what it returns is the sample (torch's
            default collate turns numpy arrays into tensors). Seeding is torch's: each DataLoader worker
            seeds ``torch`` and ``random`` itself (``worker_init_fn`` for numpy).
        collate: how fields become torch values without a ``transform`` (`Collate`; its ``variable``
            must be "rows": padding is a batch's, done by the DataLoader's ``collate_fn``).
    """

    def __init__(self, url_or_dataset: str | os.PathLike[str] | Dataset, columns: Sequence[str] | None = None,
                 transform: Callable[[dict[str, Any]], Any] | None = None, *, filter: Filter | None = None,
                 collate: Collate | None = None,
                 storage_options: dict[str, Any] | None = None, version: int | None = None,
                 cache_bytes: int = CACHE_BYTES, cache: str | os.PathLike[str] | CacheConfig | None = "auto",
                 decode: bool | Mapping[str, bool] = True) -> None:
        self.collate = Collate() if collate is None else collate
        if not isinstance(self.collate, Collate) or self.collate.variable != "rows":
            raise ReaderError(f"MapDataset(collate={collate!r}): a sample is one row, so pass a "
                              "Collate(variable='rows') (the default); pad a batch's rows in the "
                              "DataLoader's collate_fn")
        super().__init__(url_or_dataset, columns, transform, filter=filter, storage_options=storage_options,
                         version=version, cache_bytes=cache_bytes, cache=cache, decode=decode)
        schema = self.rows().dataset.schema
        self._plans = plan_fields(encoded_schema(Schema([schema[c] for c in self.columns]), self.raw),
                                  self.collate, "torch")

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices`` (what torch's DataLoader asks for a batch), each row group read once."""
        if self.transform is not None:
            return super().__getitems__(indices)
        batch = self.lookup(indices)
        n = len(next(iter(batch.values())))
        values = to_torch(prepare(self._plans, batch, self.collate), self.collate.writable)
        return [{key: _row(value, j) for key, value in values.items()} for j in range(n)]

    @staticmethod
    def _integer(value: Any) -> bool:
        """Whether ``value`` is an integer index other than a Python int: a numpy integer, a 0-d integer
        tensor (what samplers built on torch.randint yield)."""
        return MapSource._integer(value) or (
            isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point()
            and value.dtype != torch.bool)


def _row(value: Any, j: int) -> Any:
    """Row ``j`` of a batch value from `to_torch`: a tensor's row (a view), a list's item."""
    if isinstance(value, torch.Tensor):
        return value[j]
    if isinstance(value, Mapping):
        return {k: _row(v, j) for k, v in value.items()}
    return value[j]
