"""JAX adapter, public as ``shardkit.jax`` (jax is imported only when this module is).

Example:
    >>> import shardkit.jax
    >>> loader = shardkit.jax.make_loader(url, batch_size=256, device="gpu", prefetch=2)
"""

from shardkit.reader.adapters.collate import Collate
from shardkit.reader.adapters.jax import Loader, make_loader

__all__ = ["Collate", "Loader", "make_loader"]
