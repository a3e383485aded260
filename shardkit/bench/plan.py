"""`plan_egress`: what reading a remote dataset will cost before a job starts (``shardkit bench --plan``):
the GET requests, bytes fetched from the store and cached on each host's disk, and the time at the
store's rate, measured by a short probe, for a world size and an epoch count.

How the reader fetches, and so how the plan counts (`shardkit.reader._pipeline.source`,
`shardkit.dataset.fetch`):

- **Which row groups.** Each rank reads its shard's piece of the epoch's order (`shard_ranges`), in
  shuffle windows (`shard_windows`); it fetches every row group a window of its piece touches, whole
  (a row group split between two ranks is fetched by both). The plan walks the same functions the
  reader plans with, rank by rank and epoch by epoch (a shuffled epoch's row-group order, and so the
  row groups at the ends of each piece, change with the epoch).
- **Requests per row group.** The column chunks of the columns read (`Dataset.chunk_ranges`) are
  merged where they lie less than `GAP` apart (`coalesce`: the bytes between them are fetched too),
  and each merged range is cut into requests of at most `PART` bytes. That is the count and the bytes.
- **Cache.** With a row-group cache (the default for remote data, ``cache="auto"``) the ranks of a host
  share one folder: each row group is fetched once per host (the cache's claims), and later epochs read
  the cache. Without one (``cache=None``), every rank fetches its row groups again every epoch. The
  cache holds the row groups uncompressed (Arrow IPC); their size is estimated from the footers'
  uncompressed sizes of the column chunks read, plus each entry's IPC schema and footer
  (``cached_bytes_per_host``: an estimate, not a count; within 25% on the tests' data, less where a
  column is dictionary-encoded in Parquet and decoded in Arrow).
  A cache smaller than what a host reads evicts, and later epochs then fetch again: the plan warns.
- **Opening** (``open_requests``, ``open_bytes``), by every rank: a dataset with a summary is one GET
  of its ``_metadata`` (its size counted); one without is a GET of each data file's footer (at least
  one; their bytes not counted) and a few small listings. With a cache, the files' versions are one
  listing per 1,000 files. The few HEAD and listing requests of finding a summary-less dataset's kind
  are not counted.

The probe reads a few real row groups, as the reader would (their coalesced ranges), one request at a
time, and a few small ranges for the latency; the time is then given as a range: from the bytes at the
measured rate (requests overlapped, as the reader keeps 4 to 32 of them in flight) to one request at a
time (each request's latency added). Opening and the probe run under a deadline (``timeout``): a store
that cannot be reached, or that never answers, is a `DatasetError` within about that time, not a hang.

Example:
    >>> from shardkit.bench.plan import plan_egress
    >>> plan = plan_egress("s3://bucket/train", world_size=8, epochs=3, price_per_gb=0.09)
    >>> plan.requests, plan.bytes_fetched, plan.cost
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pyarrow as pa

from shardkit.dataset import Dataset, open_dataset
from shardkit.dataset.fetch import GAP, PART, coalesce
from shardkit.errors import DatasetError, ReaderError
from shardkit.reader import CacheConfig, make_reader
from shardkit.reader._plan import EpochOrder, shard_ranges, shard_windows

__all__ = ["EgressPlan", "StoreProbe", "plan_egress"]

DEFAULT_TIMEOUT = 60.0  # seconds for opening the dataset and the probe, together
PROBE_READS = 3  # row groups the probe fetches (and as many small reads for the latency)
_LATENCY_BYTES = 4096  # the small reads' size: their time is the round trip, not the bandwidth
_CACHE_TRAILER = 20  # bytes after each cache entry's IPC file (`shardkit.reader._cache`)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StoreProbe:
    """What the probe measured: ``reads`` row groups' ranges (``requests`` GETs, ``bytes``) fetched one
    request at a time in ``seconds``, and the least time of a small range read (``latency_s``)."""

    reads: int
    requests: int
    bytes: int
    seconds: float
    latency_s: float

    @property
    def mb_per_second(self) -> float:
        """Megabytes (10**6 bytes) per second of one request at a time."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class EgressPlan:
    """What `plan_egress` estimated (see the module docstring for what is counted and how).

    ``requests`` and ``bytes_fetched`` are the data GETs and bytes of all ranks over all ``epochs``;
    ``open_requests`` and ``open_bytes`` what the ranks' opening of the dataset adds (see the module
    docstring; ``open_bytes`` counts the summary file, not footers);
    ``busiest_requests`` / ``busiest_bytes`` those of the rank (without cache) or host (with one) that
    fetches the most, which sets the time. ``cached_bytes_per_host`` is the most any host's cache holds
    (0 without cache). ``cost`` is None unless a price was given.
    """

    url: str
    local: bool
    world_size: int
    ranks_per_host: int
    epochs: int
    cache: bool
    cache_limit: int | None
    columns: tuple[str, ...]
    shuffle: bool
    row_groups: int
    requests_per_row_group: float
    requests: int
    bytes_fetched: int
    busiest_requests: int
    busiest_bytes: int
    cached_bytes_per_host: int
    probe: StoreProbe | None
    open_requests: int = 0
    open_bytes: int = 0
    price_per_gb: float | None = None
    price_per_1k_requests: float | None = None

    @property
    def hosts(self) -> int:
        return -(-self.world_size // self.ranks_per_host)

    @property
    def seconds(self) -> tuple[float, float] | None:
        """The busiest fetcher's time: (its bytes at the measured rate, that plus each request's latency);
        None without a probe."""
        if self.probe is None or self.probe.bytes == 0:
            return None
        rate = self.probe.bytes / self.probe.seconds if self.probe.seconds > 0 else math.inf
        low = self.busiest_bytes / rate
        return low, low + self.busiest_requests * self.probe.latency_s

    @property
    def cost(self) -> float | None:
        """The egress price of the whole run: GB (10**9 bytes) x ``price_per_gb`` + requests / 1,000 x
        ``price_per_1k_requests`` (either alone where one is given), opening included; None when
        neither is."""
        if self.price_per_gb is None and self.price_per_1k_requests is None:
            return None
        return ((self.price_per_gb or 0.0) * (self.bytes_fetched + self.open_bytes) / 1e9
                + (self.price_per_1k_requests or 0.0) * (self.requests + self.open_requests) / 1000)

    @property
    def cache_too_small(self) -> bool:
        return self.cache and self.cache_limit is not None and self.cached_bytes_per_host > self.cache_limit

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict: the fields, the probe's rate and the derived figures (``--plan --json``)."""
        out = dataclasses.asdict(self)
        out["columns"] = list(self.columns)
        if self.probe is not None:
            out["probe"]["mb_per_second"] = self.probe.mb_per_second
        seconds = self.seconds
        out.update(hosts=self.hosts, cost=self.cost, cache_too_small=self.cache_too_small,
                   seconds_low=None if seconds is None else seconds[0],
                   seconds_high=None if seconds is None else seconds[1])
        return out

    def summary(self) -> str:
        """A few lines for people (what ``shardkit bench --plan`` prints)."""
        columns = ", ".join(self.columns) if len(self.columns) <= 6 else (
            ", ".join(self.columns[:6]) + f", ... ({len(self.columns)} fields)")
        hosts = f"{self.hosts} host(s) of {self.ranks_per_host} rank(s)"
        lines = [f"{self.url}  (plan: {self.world_size} rank(s) on {hosts}, {self.epochs} epoch(s), "
                 f"{'shuffled' if self.shuffle else 'in order'})",
                 f"columns      {columns}"]
        if self.local:
            lines.append("store        local files: no requests, nothing fetched (read in place, "
                         "memory-mapped)")
            return "\n".join(lines)
        if self.cache:
            limit = "" if self.cache_limit is None else f" (cache limit {_size(self.cache_limit)})"
            lines.append("cache        on: each row group fetched once per host, later epochs read the "
                         f"cache{limit}")
        else:
            lines.append("cache        off: every rank fetches its row groups again every epoch")
        lines += [
            f"row groups   {self.row_groups:,}, {self.requests_per_row_group:.3g} request(s) each "
            f"(column chunks less than {_size(GAP)} apart merged, requests of at most {_size(PART)})",
            f"requests     {self.requests:,} GETs in all; the busiest {'host' if self.cache else 'rank'} "
            f"{self.busiest_requests:,}; opening the dataset {self.open_requests:,} more "
            f"({_size(self.open_bytes)}), {self.open_requests // self.world_size:,} a rank",
            f"fetched      {_size(self.bytes_fetched)} from the store in all; the busiest "
            f"{'host' if self.cache else 'rank'} {_size(self.busiest_bytes)}",
            "cached       " + (f"about {_size(self.cached_bytes_per_host)} on local disk per host "
                                 "(uncompressed)" if self.cache else "nothing (no cache)"),
        ]
        if self.cache_too_small:
            limit = _size(self.cache_limit or 0)
            lines.append(f"warning      a host reads more than its cache holds ({limit}): evicted row "
                         "groups are fetched again, so these counts are a floor; give a larger cache "
                         "(SHARDKIT_CACHE_SIZE, or a CacheConfig) or fewer epochs")
        if self.probe is not None:
            p = self.probe
            lines.append(f"store rate   {p.mb_per_second:,.1f} MB/s one request at a time, latency "
                         f"{p.latency_s * 1e3:,.1f} ms (probe: {p.reads} row group(s), {p.requests} "
                         f"GET(s), {_size(p.bytes)} in {p.seconds:.2f} s)")
        seconds = self.seconds
        if seconds is not None:
            lines.append(f"fetch time   {_duration(seconds[0])} (requests overlapped) to "
                         f"{_duration(seconds[1])} (one at a time), for the busiest "
                         f"{'host' if self.cache else 'rank'}")
        cost = self.cost
        if cost is not None:
            parts = []
            if self.price_per_gb is not None:
                gb = (self.bytes_fetched + self.open_bytes) / 1e9
                parts.append(f"{gb:,.3f} GB x {self.price_per_gb:g}")
            if self.price_per_1k_requests is not None:
                thousands = (self.requests + self.open_requests) / 1000
                parts.append(f"{thousands:,.3f}k requests x {self.price_per_1k_requests:g}")
            lines.append(f"cost         {cost:,.4f} ({' + '.join(parts)}; opening included)")
        return "\n".join(lines)


def plan_egress(
    url: str | os.PathLike[str] | Dataset,
    *,
    world_size: int = 1,
    epochs: int = 1,
    ranks_per_host: int = 1,
    columns: Sequence[str] | None = None,
    cache: Any = "auto",
    shuffle: bool = True,
    seed: int = 0,
    batch_size: int = 256,
    probe_reads: int = PROBE_READS,
    timeout: float = DEFAULT_TIMEOUT,
    price_per_gb: float | None = None,
    price_per_1k_requests: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> EgressPlan:
    """Estimate the requests, bytes fetched and cached, and the time of reading ``url`` with
    ``world_size`` ranks for ``epochs`` epochs (see the module docstring).

    Example:
        >>> plan = plan_egress("s3://bucket/train", world_size=8, epochs=3, cache=None)
        >>> print(plan.summary())

    ``cache`` is make_reader's: ``"auto"`` or a folder (or a ``CacheConfig``) plans with a cache, None
    without. ``ranks_per_host`` ranks share a host's cache. ``probe_reads=0`` measures nothing (no
    time). ``timeout`` bounds opening the dataset and the probe together.

    Raises:
        DatasetError: the store cannot be reached or does not answer within ``timeout`` seconds (the
            message names the URL and what to check), or the dataset cannot be opened.
        ReaderError: an argument out of range (``world_size``, ``epochs``, ``ranks_per_host``, columns).
    """
    for name, value in (("world_size", world_size), ("epochs", epochs), ("ranks_per_host", ranks_per_host)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ReaderError(f"{name}={value!r} is not a count; pass a whole number >= 1")
    if isinstance(probe_reads, bool) or not isinstance(probe_reads, int) or probe_reads < 0:
        raise ReaderError(f"probe_reads={probe_reads!r} is not a count; pass a whole number >= 0")
    if not timeout > 0:
        raise ReaderError(f"timeout={timeout!r} is no time; pass seconds > 0")
    for name, price in (("price_per_gb", price_per_gb), ("price_per_1k_requests", price_per_1k_requests)):
        if price is not None and not (isinstance(price, int | float) and price >= 0 and math.isfinite(price)):
            raise ReaderError(f"{name}={price!r} is not a price; pass a number >= 0, or leave it out")
    deadline = time.monotonic() + timeout
    where = url.url if isinstance(url, Dataset) else os.fspath(url)
    options = None if storage_options is None else dict(storage_options)
    _check_endpoint(where, options, timeout)
    ds = url if isinstance(url, Dataset) else _within(
        deadline, timeout, where, "opening the dataset",
        lambda: open_dataset(url, storage_options=options))  # type: ignore[arg-type]
    with make_reader(ds, columns=None if columns is None else list(columns), shuffle=shuffle, seed=seed,
                     batch_size=batch_size, cache=None, num_epochs=1) as reader:
        names = tuple(reader.schema.names)
        rows_per_group, num_samples = reader.rows_per_group, reader.num_samples
        window, remainder, drop_last = reader.shuffle_buffer, reader.remainder, reader.drop_last
    if world_size > num_samples:
        raise ReaderError(f"world_size={world_size} is more than the {num_samples} samples of {ds.url!r}, "
                          "and every rank needs one; plan for fewer ranks")
    local = ds.location.is_local
    config = CacheConfig.resolve(cache, remote=not local)
    cached = config is not None
    sizes = [_row_group_cost(ds, g, names) for g in range(len(ds.row_groups))]

    # the row groups each rank fetches in each epoch (as `Reader._epoch_of` plans them)
    touched: list[list[set[int]]] = []  # [rank][epoch]
    pieces = [shard_ranges(num_samples, shard=k, num_shards=world_size, remainder=remainder,
                           batch_size=batch_size, drop_last=drop_last) for k in range(world_size)]
    walked = epochs if shuffle else 1  # in order, every epoch reads the same row groups
    orders = [EpochOrder(rows_per_group, seed, epoch, shuffle, window) for epoch in range(walked)]
    for k in range(world_size):
        per_epoch = [{t.row_group for w in shard_windows(order, pieces[k]) for t in w.tasks}
                     for order in orders]
        touched.append(per_epoch if shuffle else per_epoch * epochs)
    groups_of_hosts = [set().union(*(e for k in range(h, min(h + ranks_per_host, world_size))
                                     for e in touched[k])) for h in range(0, world_size, ranks_per_host)]

    def total(groups: Any, what: int) -> int:
        return sum(sizes[g][what] for g in groups)

    if local:
        fetchers: list[tuple[int, int]] = [(0, 0)]
    elif cached:  # one fetch per row group per host, whatever the epochs
        fetchers = [(total(g, 0), total(g, 1)) for g in groups_of_hosts]
    else:  # every rank, every epoch
        fetchers = [(sum(total(e, 0) for e in per_epoch), sum(total(e, 1) for e in per_epoch))
                    for per_epoch in touched]
    cached_per_host = 0
    if cached:
        overhead = _entry_overhead(ds, names)
        cached_per_host = max(total(g, 2) + overhead * len(g) for g in groups_of_hosts)

    open_requests = open_bytes = 0
    if not local:
        files = len({rg.file for rg in ds.row_groups})
        if ds.metadata is not None:  # one GET of the summary a rank
            size = _within(deadline, timeout, where, "the summary's size", lambda: _summary_size(ds))
            open_requests, open_bytes = world_size, world_size * size
        else:  # each file's footer, and a listing of the files a rank
            open_requests = world_size * (files + -(-files // 1000))
        if cached:  # the files' versions: a listing a rank
            open_requests += world_size * -(-(files + 2) // 1000)

    probe = None
    if not local and probe_reads:
        probe = _within(deadline, timeout, where, "the probe's range reads",
                        lambda: _probe(ds, names, probe_reads))
    n = max(len(sizes), 1)
    return EgressPlan(
        url=ds.url, local=local, world_size=world_size, ranks_per_host=ranks_per_host, epochs=epochs,
        cache=cached, cache_limit=None if config is None else config.size_limit, columns=names,
        shuffle=shuffle, row_groups=len(sizes), requests_per_row_group=sum(s[0] for s in sizes) / n,
        requests=sum(f[0] for f in fetchers), bytes_fetched=sum(f[1] for f in fetchers),
        busiest_requests=max(f[0] for f in fetchers), busiest_bytes=max(f[1] for f in fetchers),
        cached_bytes_per_host=cached_per_host, probe=probe, open_requests=open_requests,
        open_bytes=open_bytes, price_per_gb=price_per_gb,
        price_per_1k_requests=price_per_1k_requests)


def _ranges(ds: Dataset, g: int, names: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
    """Row group ``g``'s file and the byte ranges the reader fetches of it: its column chunks of ``names``
    coalesced (`coalesce`) and cut into requests of at most `PART` bytes."""
    where = ds.chunk_ranges(g, names)
    if where is None:  # no footer at hand (no summary): the row group's bytes, as one range
        rg = ds.row_groups[g]
        return ds.location.join(rg.file), [(0, rg.num_bytes)] if rg.num_bytes else []
    path, ranges = where
    return path, [(a, min(a + PART, b)) for start, b in coalesce(ranges) for a in range(start, b, PART)]


def _row_group_cost(ds: Dataset, g: int, names: Sequence[str]) -> tuple[int, int, int]:
    """(requests, bytes fetched, bytes cached uncompressed) of reading row group ``g``'s ``names``."""
    _, parts = _ranges(ds, g, names)
    return len(parts), sum(b - a for a, b in parts), _uncompressed(ds, g, names)


def _uncompressed(ds: Dataset, g: int, names: Sequence[str]) -> int:
    """The footer's uncompressed bytes of row group ``g``'s column chunks of ``names`` (what the cache
    holds, about); the row group's bytes where no footer is at hand."""
    footer = ds.metadata
    if footer is None:
        return int(ds.row_groups[g].num_bytes)
    group = footer.row_group(ds.row_group_index(g))
    wanted = set(names)
    return sum(group.column(j).total_uncompressed_size for j in range(group.num_columns)
               if group.column(j).path_in_schema.split(".", 1)[0] in wanted)


def _entry_overhead(ds: Dataset, names: Sequence[str]) -> int:
    """The bytes a cache entry holds besides its values: an Arrow IPC file of no rows of the columns read
    (its schema, twice, and its footer) and the cache's 20-byte trailer. Small row groups' entries are
    much larger than their values for it."""
    schema = ds.arrow_schema
    fields = [schema.field(n) for n in names if schema.get_field_index(n) >= 0]
    empty = pa.schema(fields, metadata=schema.metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, empty) as writer:
        writer.write_table(empty.empty_table())
    return int(sink.getvalue().size) + _CACHE_TRAILER


def _summary_size(ds: Dataset) -> int:
    """Bytes of the dataset's ``_metadata`` summary file (each rank's open fetches it whole)."""
    try:
        return int(ds.location.fs.size(ds.location.join("_metadata")))
    except Exception as e:
        raise DatasetError(f"{ds.url!r}: the size of its _metadata summary could not be read ({e}); check "
                           "the store's endpoint and credentials (storage options)") from e


def _probe(ds: Dataset, names: Sequence[str], reads: int) -> StoreProbe:
    """Fetch up to ``reads`` row groups (first, last and between, by their ranges), one request at a time,
    and as many small ranges of them for the latency."""
    fs, n = ds.location.fs, len(ds.row_groups)
    picks = sorted({round(i * (n - 1) / max(reads - 1, 1)) for i in range(min(reads, n))})
    requests = nbytes = 0
    seconds, latency = 0.0, math.inf
    for g in picks:
        path, parts = _ranges(ds, g, names)
        if not parts:
            continue
        began = time.monotonic()
        _get(ds, fs, path, parts[0][0], min(parts[0][1], parts[0][0] + _LATENCY_BYTES))
        latency = min(latency, time.monotonic() - began)
        began = time.monotonic()
        for a, b in parts:
            nbytes += len(_get(ds, fs, path, a, b))
            requests += 1
        seconds += time.monotonic() - began
    return StoreProbe(reads=len(picks), requests=requests, bytes=nbytes, seconds=seconds,
                      latency_s=0.0 if latency == math.inf else latency)


def _get(ds: Dataset, fs: Any, path: str, start: int, end: int) -> bytes:
    try:
        data: bytes = fs.cat_file(path, start=start, end=end)
    except Exception as e:
        raise DatasetError(f"{ds.url!r}: the probe could not read bytes {start}..{end} of {path!r} ({e}); "
                           "check the store's endpoint and credentials (storage options), or plan "
                           "without the probe (--probe-reads 0)") from e
    return data


def _check_endpoint(url: str, options: Mapping[str, Any] | None, timeout: float) -> None:
    """An endpoint named in the storage options (``client_kwargs.endpoint_url``) where nothing listens is
    named at once: a store's client retries a refused connection with backoff, which would only end at
    the deadline, as "did not answer". Anything else (no endpoint given, a name that does not resolve
    here) is left to the open."""
    endpoint = ((options or {}).get("client_kwargs") or {}).get("endpoint_url")
    if not isinstance(endpoint, str):
        return
    parts = urllib.parse.urlsplit(endpoint)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    try:
        socket.create_connection((parts.hostname, port), timeout=min(timeout, 10.0)).close()
    except ConnectionRefusedError as e:
        raise DatasetError(
            f"{url!r}: nothing listens at the store's endpoint {endpoint!r} (connection refused); check the "
            "endpoint (storage options: client_kwargs.endpoint_url) and that the store is running") from e
    except OSError:  # a timeout, an unknown name: the open says more, under the deadline
        return


def _within(deadline: float, timeout: float, url: str, what: str, work: Callable[[], T]) -> T:
    """``work()`` run in a thread of its own, waited for until ``deadline``: a store that never answers
    (a connection taken and never served, retries backing off) is a `DatasetError` then, not a hang.
    The thread is a daemon: left running when given up on, it never keeps the process from ending."""
    result: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as e:  # handed to the caller's thread
            failed.append(e)

    thread = threading.Thread(target=run, name="shardkit-plan", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise DatasetError(
            f"{url!r}: the store did not answer within {timeout:g} s ({what}); check that its endpoint is "
            "right and reachable from here (storage options: client_kwargs.endpoint_url, the network, a "
            "proxy), or give it longer (timeout=, --timeout S)")
    if failed:
        raise failed[0]
    return result[0]  # type: ignore[no-any-return]


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,} B"


def _duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:,.1f} h"
    if s >= 60:
        return f"{s / 60:,.1f} min"
    return f"{s:.2f} s"
