"""Readers: a dataset URL plus a shard -> batches of numpy arrays (see DESIGN.md, the reader contracts)."""

from shardkit.reader._cache import CacheConfig
from shardkit.reader.api import make_reader
from shardkit.reader.reader import Reader

__all__ = ["CacheConfig", "Reader", "make_reader"]
