"""JAX adapter, public as ``shardkit.jax`` (jax is imported only when this module is).

Example:
    >>> import shardkit.jax
    >>> loader = shardkit.jax.make_loader(url, batch_size=256, device="gpu", prefetch=2)
    >>> source = shardkit.jax.MapSource(url, columns=["image", "label"])   # rows by index, for Grain
"""

from shardkit.reader.adapters.collate import Collate
from shardkit.reader.adapters.jax import Loader, make_loader
from shardkit.reader.adapters.rows import MapSource

__all__ = ["Collate", "Loader", "MapSource", "make_loader"]
