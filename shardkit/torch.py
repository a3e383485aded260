"""PyTorch adapters, public as ``shardkit.torch`` (torch is imported only when this module is).

Example:
    >>> import shardkit.torch
    >>> loader = shardkit.torch.make_loader(url, batch_size=256, device="cuda")
"""

from shardkit.reader.adapters.collate import Collate
from shardkit.reader.adapters.torch import Loader, make_loader
from shardkit.reader.adapters.torch_map import MapDataset
from shardkit.reader.adapters.torch_workers import ShardkitIterableDataset, job_state

__all__ = ["Collate", "Loader", "MapDataset", "ShardkitIterableDataset", "job_state", "make_loader"]
