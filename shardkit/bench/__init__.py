"""What ``shardkit bench`` measures: a reader (or an adapter over it) read for some seconds, as rows and
bytes per second and per CPU-second, with the peak memory (`measure`).

Example:
    >>> from shardkit.bench import measure
    >>> result = measure("file:///data/train", adapter="torch", seconds=10, batch_size=256)
    >>> result.rows_per_second, result.mb_per_second, result.peak_rss
"""

from shardkit.bench.throughput import ADAPTERS, Adapter, Throughput, measure

__all__ = ["ADAPTERS", "Adapter", "Throughput", "measure"]
