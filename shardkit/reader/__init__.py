"""Readers: a dataset URL plus a shard -> batches of numpy arrays (see DESIGN.md, the reader contracts); a
dict of them -> a weighted mixture read as one (`MixedReader`, `shardkit.reader.mixture`)."""

from shardkit.reader._cache import CacheConfig
from shardkit.reader.api import make_reader
from shardkit.reader.mixture import SOURCE, MixedReader, Mixture, WeightSchedule
from shardkit.reader.reader import Reader

__all__ = ["CacheConfig", "MixedReader", "Mixture", "Reader", "SOURCE", "WeightSchedule", "make_reader"]
