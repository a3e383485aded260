"""Readers: a dataset URL plus a shard -> batches of numpy arrays (see DESIGN.md, the reader contracts)."""

from shardkit.reader.api import make_reader
from shardkit.reader.reader import Reader

__all__ = ["Reader", "make_reader"]
