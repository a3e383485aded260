"""What ``shardkit bench`` measures: a reader (or an adapter over it) read for some seconds, as rows and
bytes per second and per CPU-second, with the peak memory (`measure`); and, before a run on a remote
store, what it will fetch, cache and cost (`plan_egress`, ``shardkit bench --plan``).

Example:
    >>> from shardkit.bench import measure
    >>> result = measure("file:///data/train", adapter="torch", seconds=10, batch_size=256)
    >>> result.rows_per_second, result.mb_per_second, result.peak_rss
"""

from shardkit.bench.plan import EgressPlan, StoreProbe, plan_egress
from shardkit.bench.throughput import ADAPTERS, Adapter, Throughput, measure

__all__ = ["ADAPTERS", "Adapter", "EgressPlan", "StoreProbe", "Throughput", "measure", "plan_egress"]
