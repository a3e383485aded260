"""The local-disk row-group cache: hits, values, LRU size limit, corruption, config, and many processes."""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pytest
import xxhash

import shardkit.reader._cache as cache_mod
from shardkit.errors import ReaderError
from shardkit.reader._cache import CacheConfig, RowGroupCache

if TYPE_CHECKING:
    from tests.reader.conftest import S3Server

GiB = 1 << 30


def _table(seed: int, rows: int = 50) -> pa.Table:
    """A table of every kind of column the reader caches, different for each ``seed``."""
    rng = np.random.default_rng(seed)
    ids = pa.array([None if i % 7 == 3 else seed * 1000 + i for i in range(rows)], pa.int64())
    text = pa.array([None if i % 5 == 1 else f"row {seed}-{i} é" for i in range(rows)], pa.string())
    tensor = pa.FixedShapeTensorArray.from_numpy_ndarray(rng.standard_normal((rows, 4, 3)).astype(np.float32))
    ragged = pa.array([list(range(i % 4)) for i in range(rows)], pa.list_(pa.int32()))
    fields = [("id", pa.int64()), ("text", pa.string()), ("tensor", tensor.type), ("ragged", ragged.type)]
    schema = pa.schema(fields, metadata={b"shardkit.schema": b'{"version": 1}'})
    return pa.Table.from_arrays([ids, text, tensor, ragged], schema=schema)


class Fetcher:
    """A ``fetch`` callable that counts its calls."""

    def __init__(self, table: pa.Table) -> None:
        self.table, self.calls = table, 0

    def __call__(self) -> pa.Table:
        self.calls += 1
        return self.table


def _entries(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.glob("*.arrow")}


def _entry_size(tmp_path: Path, table: pa.Table) -> int:
    cache = RowGroupCache(CacheConfig(str(tmp_path / "probe"), GiB))
    cache.get_or_fetch("probe", lambda: table)
    return os.path.getsize(cache.path_of("probe"))


@pytest.fixture
def new_process(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Forget which entries this process has verified, as a freshly started process would."""
    return lambda: monkeypatch.setattr(cache_mod, "_verified", {})


def test_miss_then_hits(tmp_path: Path) -> None:
    cache = RowGroupCache(CacheConfig(str(tmp_path), GiB))
    fetch = Fetcher(_table(1))
    for _ in range(3):
        assert cache.get_or_fetch("s3://b/ds|part-0.parquet|0", fetch).equals(fetch.table)
    assert fetch.calls == 1
    assert cache.stats == {"hits": 2, "misses": 1, "evictions": 0, "corrupt": 0}

    other = Fetcher(_table(2))
    assert cache.get_or_fetch("s3://b/ds|part-0.parquet|1", other).equals(other.table)
    assert cache.stats["misses"] == 2
    assert len(_entries(tmp_path)) == 2
    # another cache over the same folder (another process, a later run) hits what this one wrote
    again = RowGroupCache(CacheConfig(str(tmp_path), GiB))
    again.get_or_fetch("s3://b/ds|part-0.parquet|1", Fetcher(_table(99)))
    assert again.stats == {"hits": 1, "misses": 0, "evictions": 0, "corrupt": 0}


def test_values_survive_the_round_trip_memory_mapped(tmp_path: Path, new_process: Callable[[], None]) -> None:
    original = pa.concat_tables([_table(3), _table(4)])  # two chunks
    RowGroupCache(CacheConfig(str(tmp_path), GiB)).get_or_fetch("k", lambda: original)
    new_process()
    cache = RowGroupCache(CacheConfig(str(tmp_path), GiB))
    before = pa.total_allocated_bytes()
    cached = cache.get_or_fetch("k", Fetcher(_table(0)))
    assert pa.total_allocated_bytes() - before < original.nbytes // 10  # buffers point into the mapping
    assert cache.stats["hits"] == 1

    assert cached.equals(original)
    # one record batch, however many the table had: cached reads cut their batches as views of it
    assert {c.num_chunks for c in cached.columns} == {1}
    assert cached.schema.equals(original.schema, check_metadata=True)
    assert isinstance(cached.schema.field("tensor").type, pa.FixedShapeTensorType)
    assert cached.column("id").null_count == original.column("id").null_count > 0
    assert cached.column("text").to_pylist() == original.column("text").to_pylist()
    tensors = [chunk.to_numpy_ndarray() for chunk in cached.column("tensor").chunks]
    np.testing.assert_array_equal(np.concatenate(tensors), np.concatenate(
        [chunk.to_numpy_ndarray() for chunk in original.column("tensor").chunks]))
    del cached, tensors
    gc.collect()


def test_lru_eviction_keeps_the_folder_under_the_limit(tmp_path: Path) -> None:
    size = _entry_size(tmp_path, _table(0))
    limit = 3 * size + size // 2  # room for three entries
    directory = tmp_path / "cache"
    cache = RowGroupCache(CacheConfig(str(directory), limit))
    names = {k: Path(cache.path_of(k)).name for k in "abcdef"}

    def get(key: str) -> None:
        cache.get_or_fetch(key, lambda: _table(ord(key)))
        assert sum(_entries(directory).values()) <= limit

    for key in "abc":
        get(key)
    assert set(_entries(directory)) == {names[k] for k in "abc"}
    get("a")  # a is now the most recently used: b is the oldest
    get("d")
    assert set(_entries(directory)) == {names[k] for k in "acd"}
    get("e")
    assert set(_entries(directory)) == {names[k] for k in "ade"}
    get("c")  # evicted before: fetched again, evicting a
    assert set(_entries(directory)) == {names[k] for k in "dec"}
    assert cache.stats == {"hits": 1, "misses": 6, "evictions": 3, "corrupt": 0}
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]


def test_eviction_never_takes_the_entry_just_written(tmp_path: Path) -> None:
    size = _entry_size(tmp_path, _table(0))
    directory = tmp_path / "cache"
    cache = RowGroupCache(CacheConfig(str(directory), 3 * size + size // 2))
    for key in "abc":
        cache.get_or_fetch(key, lambda: _table(0))
    # other processes hit a, b, c after this one wrote d: d is then the least recently used
    future = time.time_ns() + 3600 * 10**9
    for i, key in enumerate("abc"):
        os.utime(cache.path_of(key), ns=(future + i, os.stat(cache.path_of(key)).st_mtime_ns))
    cache.get_or_fetch("d", lambda: _table(0))
    assert set(_entries(directory)) == {Path(cache.path_of(k)).name for k in "bcd"}


def test_entry_larger_than_the_limit_is_returned_not_kept(tmp_path: Path) -> None:
    big, small = _table(1, rows=2000), _table(2, rows=10)
    cache = RowGroupCache(CacheConfig(str(tmp_path), _entry_size(tmp_path / "p", big) - 1))
    cache.get_or_fetch("small", lambda: small)
    fetch = Fetcher(big)
    assert cache.get_or_fetch("big", fetch).equals(big)
    assert cache.get_or_fetch("big", fetch).equals(big)
    assert fetch.calls == 2
    assert set(_entries(tmp_path)) == {Path(cache.path_of("small")).name}  # and nothing was evicted for it
    assert cache.stats == {"hits": 0, "misses": 3, "evictions": 0, "corrupt": 0}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]

    tiny = RowGroupCache(CacheConfig(str(tmp_path / "tiny"), 100))  # smaller than the data: nothing written
    assert tiny.get_or_fetch("small", lambda: small).equals(small)
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == []


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 100)


def _garbage(path: str) -> None:
    Path(path).write_bytes(os.urandom(os.path.getsize(path)))


def _zeros(path: str) -> None:
    """What a power loss can leave of a file written, renamed and never fsynced: its length, all zeros."""
    Path(path).write_bytes(bytes(os.path.getsize(path)))


def _empty(path: str) -> None:
    Path(path).write_bytes(b"")


def _valid_checksum_bad_ipc(path: str) -> None:
    payload = os.urandom(1000)
    Path(path).write_bytes(payload + struct.pack("<4sQQ", b"SKC2", xxhash.xxh3_64_intdigest(payload),
                                                 len(payload)))


@pytest.mark.parametrize("corrupt", [_flip, _truncate, _garbage, _zeros, _empty, _valid_checksum_bad_ipc])
def test_corrupt_entry_is_refetched(tmp_path: Path, new_process: Callable[[], None],
                                    corrupt: Callable[[str], None], caplog: pytest.LogCaptureFixture) -> None:
    table = _table(5)
    RowGroupCache(CacheConfig(str(tmp_path), GiB)).get_or_fetch("k", lambda: table)
    cache = RowGroupCache(CacheConfig(str(tmp_path), GiB))
    corrupt(cache.path_of("k"))
    new_process()
    fetch = Fetcher(table)
    assert cache.get_or_fetch("k", fetch).equals(table)
    assert fetch.calls == 1
    assert cache.stats == {"hits": 0, "misses": 1, "evictions": 0, "corrupt": 1}
    assert "is corrupt" in caplog.text
    # the refetched entry replaced the corrupt one
    new_process()
    assert cache.get_or_fetch("k", fetch).equals(table)
    assert cache.stats["hits"] == 1
    assert fetch.calls == 1


def test_entry_of_the_earlier_format_is_refetched_quietly(tmp_path: Path, new_process: Callable[[], None],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A crc32 entry (trailer ``SKC1``, 16 bytes) left by an earlier shardkit: a miss, not corruption."""
    table = _table(5)
    cache = RowGroupCache(CacheConfig(str(tmp_path), GiB))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    payload = sink.getvalue().to_pybytes()
    Path(cache.path_of("k")).write_bytes(payload + struct.pack("<4sIQ", b"SKC1", zlib.crc32(payload),
                                                                len(payload)))
    new_process()
    fetch = Fetcher(table)
    assert cache.get_or_fetch("k", fetch).equals(table)
    assert fetch.calls == 1
    assert cache.stats == {"hits": 0, "misses": 1, "evictions": 0, "corrupt": 0}
    assert "corrupt" not in caplog.text
    assert Path(cache.path_of("k")).read_bytes()[-20:-16] == b"SKC2"  # replaced in the current format


def test_entry_is_verified_once_per_process(tmp_path: Path, new_process: Callable[[], None],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    table = _table(6)
    cache = RowGroupCache(CacheConfig(str(tmp_path), GiB))
    cache.get_or_fetch("k", lambda: table)
    new_process()
    calls = []
    digest = cache_mod._digest

    def counting(data: Any) -> int:
        calls.append(len(memoryview(data)))
        return digest(data)

    monkeypatch.setattr(cache_mod, "_digest", counting)
    for _ in range(3):
        assert cache.get_or_fetch("k", Fetcher(table)).equals(table)
    assert len(calls) == 1
    assert calls[0] > table.nbytes  # the whole entry was read

    # an entry changed after its check (new mtime) is checked again, and found corrupt
    path = cache.path_of("k")
    mtime = os.stat(path).st_mtime_ns
    _flip(path)
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    assert cache.get_or_fetch("k", Fetcher(table)).equals(table)
    assert cache.stats["corrupt"] == 1
    # ...and so is one changed in place with its size, atime and mtime put back (bit rot, a stray tool):
    # only the ctime, which no one can set back, tells (a regression: this process returned it as is)
    assert cache.get_or_fetch("k", Fetcher(table)).equals(table)  # the refetched entry, checked
    before = os.stat(path)
    _flip(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size
    assert cache.get_or_fetch("k", Fetcher(table)).equals(table)
    assert cache.stats["corrupt"] == 2


def test_an_entry_this_process_wrote_or_checked_is_not_checked_again(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The ctime in the identity must not cost a cached epoch its speed: the rename of a new entry and
    the atime of every hit set it, and neither makes this process verify the entry again."""
    table = _table(6)
    cache = RowGroupCache(CacheConfig(str(tmp_path), GiB))
    calls = []
    digest = cache_mod._digest

    def counting(data: Any) -> int:
        calls.append(1)
        return digest(data)

    cache.get_or_fetch("k", lambda: table)  # written here: its checksum computed once, from the file
    monkeypatch.setattr(cache_mod, "_digest", counting)
    for _ in range(3):
        assert cache.get_or_fetch("k", Fetcher(table)).equals(table)
    assert calls == []


def test_fetch_error_propagates_and_caches_nothing(tmp_path: Path) -> None:
    cache = RowGroupCache(CacheConfig(str(tmp_path), GiB))

    def fail() -> pa.Table:
        raise OSError("connection reset")

    with pytest.raises(OSError, match="connection reset"):
        cache.get_or_fetch("k", fail)
    assert not list(tmp_path.iterdir())


def test_threads_share_one_cache(tmp_path: Path) -> None:
    cache = RowGroupCache(CacheConfig(str(tmp_path), 5 * _entry_size(tmp_path / "p", _table(0))))
    expected = {i: _table(i) for i in range(12)}

    def work(worker: int) -> None:
        for i in list(range(12)) * 3:
            key = (i + worker) % 12
            assert cache.get_or_fetch(str(key), lambda key=key: expected[key]).equals(expected[key])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert cache.stats["hits"] + cache.stats["misses"] == 8 * 36
    assert cache.stats["corrupt"] == 0


# --- CacheConfig ---------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("SHARDKIT_CACHE_DIR", raising=False)
    monkeypatch.delenv("SHARDKIT_CACHE_SIZE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_resolve_none_config_and_local_auto(clean_env: Path, tmp_path: Path) -> None:
    config = CacheConfig(str(tmp_path), 123)
    assert CacheConfig.resolve(None, remote=True) is None
    assert CacheConfig.resolve(config, remote=False) is config
    assert CacheConfig.resolve("auto", remote=False) is None


def test_resolve_auto_defaults_and_environment(clean_env: Path, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    default = CacheConfig(str(clean_env / ".cache" / "shardkit"), 10 * GiB)
    assert CacheConfig.resolve("auto", remote=True) == default
    monkeypatch.setenv("SHARDKIT_CACHE_DIR", str(tmp_path / "nvme"))
    monkeypatch.setenv("SHARDKIT_CACHE_SIZE", "2.5GiB")
    assert CacheConfig.resolve("auto", remote=True) == CacheConfig(str(tmp_path / "nvme"), int(2.5 * GiB))


def test_resolve_path(clean_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert CacheConfig.resolve(str(tmp_path), remote=False) == CacheConfig(str(tmp_path), 10 * GiB)
    assert CacheConfig.resolve(tmp_path / "x", remote=True) == CacheConfig(str(tmp_path / "x"), 10 * GiB)
    assert CacheConfig.resolve("~/c", remote=True) == CacheConfig(str(clean_env / "c"), 10 * GiB)
    monkeypatch.setenv("SHARDKIT_CACHE_SIZE", "500MB")
    assert CacheConfig.resolve(str(tmp_path), remote=True) == CacheConfig(str(tmp_path), 500 * 10**6)


@pytest.mark.parametrize("bad", [42, True, b"/tmp/c", "", "   ", ["/tmp/c"], 1.5])
def test_resolve_rejects_what_is_not_a_cache(clean_env: Path, bad: Any) -> None:
    with pytest.raises(ReaderError, match=r"cache=.*'auto', a local folder"):
        CacheConfig.resolve(bad, remote=True)


@pytest.mark.parametrize("size", ["lots", "0", "-1GiB", "10 parsecs"])
def test_resolve_rejects_a_bad_size_in_the_environment(clean_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                       size: str) -> None:
    monkeypatch.setenv("SHARDKIT_CACHE_SIZE", size)
    with pytest.raises(ReaderError, match=rf"SHARDKIT_CACHE_SIZE={size!r} is not a size; set it"):
        CacheConfig.resolve("auto", remote=True)
    assert CacheConfig.resolve("auto", remote=False) is None  # not read when there is no cache


def test_config_validates_and_parses(tmp_path: Path) -> None:
    assert CacheConfig(str(tmp_path), "1MiB").size_limit == 1 << 20  # type: ignore[arg-type]
    assert CacheConfig(tmp_path, 5).directory == str(tmp_path)  # type: ignore[arg-type]
    for size in (0, -5, True, "big", None):
        with pytest.raises(ReaderError, match=r"CacheConfig.size_limit=.* is not a size"):
            CacheConfig(str(tmp_path), size)  # type: ignore[arg-type]
    for directory in ("", None, 3):
        with pytest.raises(ReaderError, match=r"CacheConfig.directory=.* is not a folder path"):
            CacheConfig(directory, 5)  # type: ignore[arg-type]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ReaderError, match=r"cache folder .*file.* cannot be created"):
        RowGroupCache(CacheConfig(str(tmp_path / "file"), 5))


# --- many processes ------------------------------------------------------------------------------

KEYS = [f"s3://bucket/ds|part-{i // 4}.parquet|{i % 4}" for i in range(16)]


def _hammer(directory: str, limit: int, worker: int, barrier: Any, results: Any) -> None:
    try:
        cache = RowGroupCache(CacheConfig(directory, limit))
        order = list(range(len(KEYS)))
        rng = np.random.default_rng(worker)
        barrier.wait(60)
        for round_ in range(4):
            if worker % 2 and round_ % 2:
                rng.shuffle(order)  # half the time half the workers wander; the rest race on each key
            for i in order:
                table = cache.get_or_fetch(KEYS[i], lambda i=i: _table(i, rows=300))
                if not table.equals(_table(i, rows=300)):
                    raise AssertionError(f"worker {worker}: wrong values for {KEYS[i]}")
        results.put((worker, "ok", cache.stats))
    except BaseException as e:
        results.put((worker, f"{type(e).__name__}: {e}", {}))


@contextlib.contextmanager
def _running(procs: list[Any]) -> Iterator[None]:
    """``procs`` started; when the block ends, joined (30 s each) and any still alive killed (at once
    when the block raised)."""
    done = False
    try:
        for p in procs:
            p.start()
        yield
        done = True
    finally:
        for p in procs:
            if done:
                p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_processes_share_one_folder(tmp_path: Path, new_process: Callable[[], None]) -> None:
    size = _entry_size(tmp_path, _table(0, rows=300))
    limit = 6 * size  # 16 keys, room for 6: entries are evicted while others read them
    directory = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(directory, limit, w, barrier, results)) for w in range(n)]
    with _running(procs):
        outcomes = [results.get(timeout=90) for _ in procs]
    assert [o for o in outcomes if o[1] != "ok"] == []
    assert [p.exitcode for p in procs] == [0] * n
    stats = [o[2] for o in outcomes]
    assert sum(s["corrupt"] for s in stats) == 0
    assert sum(s["evictions"] for s in stats) > 0
    assert sum(s["hits"] for s in stats) > 0
    assert sum(_entries(Path(directory)).values()) <= limit
    assert not [p for p in os.listdir(directory) if p.startswith(".tmp-")]
    # what is left is valid for a fresh process
    new_process()
    cache = RowGroupCache(CacheConfig(directory, limit))
    for i, key in enumerate(KEYS):
        assert cache.get_or_fetch(key, lambda i=i: _table(i, rows=300)).equals(_table(i, rows=300))
    assert cache.stats["corrupt"] == 0


# --- file versions in the reader's keys ------------------------------------------------------------


def _write_values(path: Path, offset: float) -> None:
    """400 float64 rows in 4 row groups: same rows and bytes for every ``offset``, other values."""
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"v": np.arange(400, dtype=np.float64) + offset}), str(path), row_group_size=100,
                   compression="none", use_dictionary=False, write_statistics=False)


@pytest.mark.filterwarnings("ignore::shardkit.SummaryMissingWarning")
def test_a_file_rewritten_in_place_is_fetched_again_not_served_stale(tmp_path: Path) -> None:
    import shardkit

    data, directory = tmp_path / "ds", tmp_path / "cache"
    data.mkdir()
    config = CacheConfig(str(directory), GiB)

    def read() -> np.ndarray:
        with shardkit.make_reader(str(data), shuffle=False, batch_size=1000, cache=config) as reader:
            return np.concatenate([b["v"] for b in reader])

    _write_values(data / "data.parquet", 0)
    np.testing.assert_array_equal(read(), np.arange(400))
    first = set(_entries(directory))
    assert len(first) == 4
    size, mtime = (data / "data.parquet").stat().st_size, (data / "data.parquet").stat().st_mtime_ns
    _write_values(data / "data.parquet", 0.5)  # a nightly refresh: same name, rows and size
    os.utime(data / "data.parquet", ns=(mtime + 10**9, mtime + 10**9))  # a coarse clock could tie
    assert (data / "data.parquet").stat().st_size == size
    np.testing.assert_array_equal(read(), np.arange(400) + 0.5)
    assert len(set(_entries(directory)) - first) == 4  # new entries, under the new version
    entries = set(_entries(directory))
    np.testing.assert_array_equal(read(), np.arange(400) + 0.5)  # unchanged file: served by the cache
    assert set(_entries(directory)) == entries


# --- one fetch per entry across the processes of a machine (claims) ---------------------------------


def _fetch_logged(log: str, key: str, table: pa.Table) -> pa.Table:
    with open(log, "a") as f:
        f.write(f"{os.getpid()} {key}\n")
    time.sleep(0.3)  # a slow store: the other process asks for the key while this one fetches it
    return table


def _get_keys(directory: str, log: str, barrier: Any, results: Any, keys: list[str],
              asking: str = "") -> None:
    try:
        cache = RowGroupCache(CacheConfig(directory, GiB))
        barrier.wait(60)
        if asking:
            Path(asking).touch()
        for i, key in enumerate(keys):
            table = cache.get_or_fetch(key, lambda i=i, key=key: _fetch_logged(log, key, _table(i)))
            if not table.equals(_table(i)):
                raise AssertionError(f"wrong values for {key}")
        results.put(("ok", cache.stats))
    except BaseException as e:
        results.put((f"{type(e).__name__}: {e}", {}))


def _fetch_forever(directory: str, key: str, started: str) -> None:
    def fetch() -> pa.Table:
        Path(started).touch()
        time.sleep(3600)  # killed mid-fetch
        return _table(0)

    RowGroupCache(CacheConfig(directory, GiB)).get_or_fetch(key, fetch)


def _log_lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _wait_for(path: Path, proc: Any) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.is_alive(), f"{path} never appeared"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_processes_getting_the_same_keys_fetch_each_once(tmp_path: Path) -> None:
    directory, log = str(tmp_path / "cache"), tmp_path / "fetches.log"
    keys = [f"s3://bucket/ds|part-0.parquet|{i}" for i in range(6)]
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_get_keys, args=(directory, str(log), barrier, results, keys))
             for _ in range(2)]
    with _running(procs):
        outcomes = [results.get(timeout=90) for _ in procs]
    assert [o[0] for o in outcomes] == ["ok", "ok"]
    fetched = [line.split()[1] for line in _log_lines(log)]
    assert sorted(fetched) == sorted(keys)  # each key fetched once, by one of the two
    assert sum(o[1]["misses"] for o in outcomes) == len(keys)
    assert sum(o[1]["hits"] for o in outcomes) == len(keys)
    assert not list(Path(directory).glob("*.claim"))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_claimer_killed_mid_fetch_does_not_block_the_others(tmp_path: Path) -> None:
    directory, log = str(tmp_path / "cache"), tmp_path / "fetches.log"
    started, asking = tmp_path / "started", tmp_path / "asking"
    key = "s3://bucket/ds|part-0.parquet|0"
    ctx = multiprocessing.get_context("spawn")
    claimer = ctx.Process(target=_fetch_forever, args=(directory, key, str(started)))
    barrier, results = ctx.Barrier(1), ctx.Queue()
    waiter = ctx.Process(target=_get_keys, args=(directory, str(log), barrier, results, [key], str(asking)))
    try:
        claimer.start()
        _wait_for(started, claimer)
        assert RowGroupCache(CacheConfig(directory, GiB)).claimed(key)
        waiter.start()
        _wait_for(asking, waiter)
        time.sleep(0.5)
        assert _log_lines(log) == []  # waiting for the live claimer's entry, not fetching
        os.kill(claimer.pid, 9)  # SIGKILL, not reaped yet: a zombie, whose claim is stale all the same
        outcome = results.get(timeout=60)
        waiter.join(30)
    finally:
        for p in (claimer, waiter):
            if p.is_alive():
                p.kill()
            p.join(5)
    assert outcome[0] == "ok"
    assert [line.split()[1] for line in _log_lines(log)] == [key]  # the waiter fetched it, once
    cache = RowGroupCache(CacheConfig(directory, GiB))
    assert cache.get(key) is not None
    assert not cache.claimed(key)
    assert not list(Path(directory).glob("*.claim"))


def test_a_folder_that_takes_no_claim_degrades_to_fetching(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A cache folder deleted under a running job (a folder root cannot write to is not to be had in
    the tests, which run as root)."""
    directory = tmp_path / "cache"
    cache = RowGroupCache(CacheConfig(str(directory), GiB))
    directory.rmdir()
    fetch = Fetcher(_table(1))
    with caplog.at_level(logging.WARNING, logger="shardkit.reader._cache"):
        for _ in range(2):
            assert cache.get_or_fetch("k", fetch).equals(_table(1))
    assert fetch.calls == 2  # nothing could be cached: fetched each time, never waiting
    assert "cannot claim cache entries" in caplog.text
    assert "cannot write the cache entry" in caplog.text
    assert not cache.claimed("k")


def _read_ids(url: str, options: dict[str, Any], directory: str, seed: int, barrier: Any,
              results: Any) -> None:
    try:
        import shardkit

        barrier.wait(60)
        with shardkit.make_reader(url, storage_options=options, cache=directory, seed=seed,
                                  batch_size=100) as reader:
            ids = np.concatenate([b["id"] for b in reader])
        results.put(("ok", sorted(ids.tolist())))
    except BaseException as e:
        results.put((f"{type(e).__name__}: {e}", []))


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_readers_sharing_a_cache_folder_fetch_each_row_group_once(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    """Two processes reading one remote dataset through one cache folder, as the workers of a
    DataLoader do: each row group is one request between them, not one each (through a relay that
    holds each response back, as a far store does, so that both ask for the same row groups at once)."""
    import pandas as pd

    import shardkit
    from benchmarks.relay import Relay

    url, options = f"s3://{s3_bucket}/ds", s3_server.storage_options
    frame = pd.DataFrame({"id": np.arange(4000, dtype=np.int64),
                          "x": list(np.random.default_rng(0).standard_normal((4000, 32)).astype(np.float32))})
    ds = shardkit.write_dataset(frame, url, storage_options=options, row_group_size=250)
    mark = s3_server.mark()
    directory = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    with Relay(s3_server.endpoint_url, delay=0.05) as relay:
        slow = {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": relay.url}}
        procs = [ctx.Process(target=_read_ids, args=(url, slow, directory, seed, barrier, results))
                 for seed in (1, 2)]
        with _running(procs):
            outcomes = [results.get(timeout=150) for _ in procs]
    assert [o[0] for o in outcomes] == ["ok", "ok"]
    assert all(o[1] == list(range(4000)) for o in outcomes)
    assert s3_server.count_gets(r"/ds/part-[^/?]*\.parquet", since=mark) == len(ds.row_groups) == 16
    assert len(list(Path(directory).glob("*.arrow"))) == 16
    assert not list(Path(directory).glob("*.claim"))


def test_a_claim_left_with_this_process_s_pid_is_stale(tmp_path: Path) -> None:
    """A claim file naming this process that it does not hold: left by an earlier process that had the
    same pid (the first process of a container, run again). It does not make this process wait."""
    import json
    import socket

    cache = RowGroupCache(CacheConfig(str(tmp_path), GiB))
    claim = Path(cache.path_of("k")).with_suffix(".claim")
    claim.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}))
    assert not cache.claimed("k")
    fetch = Fetcher(_table(1))
    assert cache.get_or_fetch("k", fetch).equals(_table(1))
    assert fetch.calls == 1
    assert not claim.exists()


def test_a_live_claim_that_never_ends_is_waited_for_a_bounded_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A claimer alive but stuck (its claims refreshed, its fetch never ending) blocks the others only
    for CLAIM_WAIT_S: then they fetch, unclaimed."""
    monkeypatch.setattr(cache_mod, "CLAIM_WAIT_S", 0.2)
    cache = RowGroupCache(CacheConfig(str(tmp_path), GiB))
    stuck = cache.claim("k")  # held by this process, never released in the test: live
    assert stuck is not None
    assert stuck.path is not None
    assert cache.claimed("k")
    fetch = Fetcher(_table(1))
    with caplog.at_level(logging.WARNING, logger="shardkit.reader._cache"):
        assert cache.get_or_fetch("k", fetch).equals(_table(1))
    assert fetch.calls == 1
    assert "fetching it too" in caplog.text
    assert cache.claimed("k")  # the stuck claim is left to its holder
    cache.release(stuck)
    assert not cache.claimed("k")
