"""Keyword arguments a reader function does not take, explained: Petastorm's names, and typos.

A user moving a Petastorm loop over (``make_reader(url, cur_shard=rank, shard_count=world,
schema_fields=[...], workers_count=4)``) got Python's bare ``TypeError: make_reader() got an unexpected
keyword argument 'cur_shard'``, one name at a time. `explained` checks the names before the call and
raises one `UnknownArgumentError` for all of them: each of Petastorm's reader arguments with what
shardkit calls it (or why it has no counterpart), and any other name with the closest names the function
takes. The error is also a ``TypeError``, as Python's is.

Only keyword names are checked (the reader functions take their options by keyword only); a wrong
number of positional arguments stays Python's own ``TypeError``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from shardkit.errors import UnknownArgumentError

P = ParamSpec("P")
R = TypeVar("R")

#: the arguments of Petastorm 0.13's ``make_reader`` / ``make_batch_reader`` and what shardkit takes instead
PETASTORM: dict[str, str] = {
    "cur_shard": "shard=",
    "shard_count": "num_shards=",
    "shard_seed": "seed= (one seed orders the row groups, then shards them)",
    "schema_fields": "columns= (a list of field names)",
    "predicate": "filter= (a pyarrow.compute expression or DNF tuples, pushed down to row-group "
                 "statistics; a Python predicate has no counterpart)",
    "rowgroup_selector": "filter= (row groups are selected by their statistics)",
    "filters": "filter= (the same DNF tuples, e.g. [('label', '<', 5)])",
    "shuffle_row_groups": "shuffle= (row groups, then rows within a window)",
    "shuffle_rows": "shuffle=",
    "shuffle_row_drop_partitions": "shuffle_buffer= (rows shuffled together, in memory)",
    "workers_count": "workers= (decoding threads)",
    "reader_pool_type": "transform_workers= (processes that decode images and run transform=; "
                        "reading is in threads, since Arrow and numpy release the GIL), or "
                        "shardkit.torch.ShardkitIterableDataset with DataLoader(num_workers=k)",
    "results_queue_size": "prefetch= (row-group slices read ahead)",
    "cache_type": "cache= ('auto', None, a folder or a CacheConfig)",
    "cache_location": "cache= (a folder)",
    "cache_size_limit": "cache=CacheConfig(folder, size_limit=...), from shardkit.reader._cache",
    "cache_row_size_estimate": "nothing: the cache keeps whole row groups",
    "cache_extra_settings": "cache= (a CacheConfig)",
    "hdfs_driver": "storage_options= (passed to fsspec)",
    "filesystem": "storage_options= (passed to the URL's fsspec filesystem)",
    "transform_spec": "transform= (a function per sample, fn(sample) -> sample: TransformSpec's func "
                      "without its edit_fields/removed_fields, which shardkit learns from the samples it "
                      "returns; transform_workers= runs it in processes); see the images guide",
    "convert_early_to_numpy": "nothing: batches are numpy already",
    "zmq_copy_buffers": "nothing: transform workers hand batches back in shared memory",
    "pyarrow_serialize": "nothing: transform workers hand batches back in shared memory",
    "is_batched_reader": "nothing: every reader yields batches",
}


def explained(func: Callable[P, R]) -> Callable[P, R]:
    """``func`` refusing keyword arguments it does not take with `UnknownArgumentError`, before it runs.

    Example:
        >>> make_reader("runs/digits", cur_shard=0, shard_count=2)
        Traceback (most recent call last):
        shardkit.errors.UnknownArgumentError: make_reader() got arguments it does not take: cur_shard=0,
        shard_count=2. cur_shard is Petastorm's; shardkit's is shard=; shard_count is Petastorm's; ...
    """
    takes = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values()):
        raise TypeError(f"{func.__qualname__} takes **kwargs: every name is known to it")
    names = [n for n, p in takes.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]

    @functools.wraps(func)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        unknown = [k for k in kwargs if k not in takes]
        if unknown:
            raise UnknownArgumentError(_message(func.__name__, unknown, kwargs, names))
        return func(*args, **kwargs)

    return checked


def _message(function: str, unknown: list[str], given: dict[str, object], names: list[str]) -> str:
    said = ", ".join(f"{k}={_short(given[k])}" for k in unknown)
    lines = []
    for name in unknown:
        instead = PETASTORM.get(name)
        if instead is not None and instead.startswith("nothing: "):
            lines.append(f"{name} is Petastorm's, with no counterpart here ({instead[9:]})")
        elif instead is not None:
            lines.append(f"{name} is Petastorm's; shardkit's is {instead}")
        elif close := difflib.get_close_matches(name, names, n=3, cutoff=0.6):
            names_close = " or ".join(c + "=" for c in close)
            lines.append(f"{name} is not one of its arguments (did you mean {names_close})")
        else:
            lines.append(f"{name} is not one of its arguments")
    return (f"{function}() got arguments it does not take: {said}. " + "; ".join(lines)
            + f". It takes: {', '.join(names)}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
