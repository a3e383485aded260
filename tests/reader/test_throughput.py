"""shardkit.bench.throughput.measure on real datasets: exact counts per bound, warm-up, shards, adapters."""

from __future__ import annotations

import _thread
import gc
import importlib
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.bench import Throughput, measure
from shardkit.bench._sizes import nbytes, peak_rss, size_of_batch
from shardkit.errors import CorruptDatasetError, ReaderError

N = 60
ROW_BYTES = 8 + 4 * 4 + 2  # id int64, a 4x4 uint8 image, a 2-character label


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    schema = shardkit.Schema([
        shardkit.Field("id", "int64"),
        shardkit.Field("image", "uint8", (4, 4), codec=shardkit.ImageCodec("png")),
        shardkit.Field("label", "str"),
    ])
    data = {"id": np.arange(N), "image": np.arange(N * 16).reshape(N, 4, 4).astype(np.uint8),
            "label": [f"l{i % 4}" for i in range(N)]}
    return shardkit.write_dataset(data, tmp_path_factory.mktemp("bench") / "ds", schema=schema,
                                  row_group_size=7).url


def _sane(r: Throughput) -> None:
    """Rates are positive and finite; the counts agree with each other."""
    for value in (r.seconds, r.rows_per_second, r.batches_per_second, r.mb_per_second, r.first_batch_seconds):
        assert math.isfinite(value)
        assert value > 0
    assert math.isfinite(r.cpu_percent)
    assert r.cpu_seconds >= 0
    assert r.peak_rss is not None
    assert r.peak_rss > 0
    assert r.decoded_bytes > 0


def test_a_batch_bound_measures_exactly_that_many_full_batches(url: str) -> None:
    r = measure(url, batch_size=8, warmup_batches=3, batches=4)
    assert (r.batches, r.rows, r.stopped_by, r.warmup_batches) == (4, 32, "batches", 3)
    assert r.decoded_bytes == 32 * ROW_BYTES
    assert r.batches_per_epoch == 8  # 60 rows: 7 batches of 8 and one of 4
    assert (r.url, r.adapter, r.shard, r.num_shards, r.batch_size) == (url, "numpy", 0, 1, 8)
    _sane(r)


@pytest.mark.parametrize("warmup", [0, 3, 8, 11])
def test_an_epoch_bound_reads_exactly_the_shards_rows_whatever_the_warmup(url: str, warmup: int) -> None:
    """The warm-up is not counted: the measured epochs start at an epoch's beginning (the warm-up's
    partial epoch is skipped), so each measured epoch is all of the shard's rows."""
    r = measure(url, batch_size=8, warmup_batches=warmup, epochs=2)
    assert (r.batches, r.rows, r.stopped_by) == (16, 2 * N, "epochs")
    assert r.decoded_bytes == 2 * N * ROW_BYTES
    _sane(r)


def test_without_a_bound_it_measures_one_epoch(url: str) -> None:
    r = measure(url, batch_size=16, warmup_batches=2)
    assert (r.batches, r.rows, r.stopped_by) == (4, N, "epochs")


@pytest.mark.parametrize(("num_shards", "batch_size", "per_shard", "per_epoch"),
                         [(4, 4, 15, 4), (7, 3, 8, 3), (60, 1, 1, 1)])
def test_each_shard_reads_its_share(url: str, num_shards: int, batch_size: int, per_shard: int,
                                    per_epoch: int) -> None:
    """remainder="drop": every shard reads N // num_shards rows per epoch."""
    for shard in {0, num_shards // 2, num_shards - 1}:
        r = measure(url, shard=shard, num_shards=num_shards, batch_size=batch_size, warmup_batches=1)
        assert (r.shard, r.num_shards) == (shard, num_shards)
        assert (r.rows, r.batches, r.batches_per_epoch) == (per_shard, per_epoch, per_epoch)


def test_the_first_bound_reached_stops_it(url: str) -> None:
    r = measure(url, batch_size=8, warmup_batches=0, batches=3, epochs=1)
    assert (r.batches, r.stopped_by) == (3, "batches")
    r = measure(url, batch_size=8, warmup_batches=0, batches=100, epochs=1)
    assert (r.batches, r.rows, r.stopped_by) == (8, N, "epochs")
    r = measure(url, batch_size=8, warmup_batches=0, batches=2, seconds=600)
    assert (r.batches, r.stopped_by) == (2, "batches")


def test_a_seconds_bound_runs_across_epochs(url: str) -> None:
    r = measure(url, batch_size=32, warmup_batches=0, seconds=0.05, shuffle=False)
    assert r.stopped_by == "seconds"
    assert r.seconds >= 0.05
    assert r.batches >= 1
    assert r.decoded_bytes == r.rows * ROW_BYTES
    _sane(r)


def test_columns_and_reader_options_go_to_make_reader(url: str, tmp_path: Path) -> None:
    r = measure(url, columns=["id"], batch_size=10, workers=1, prefetch=0, shuffle=False, seed=3,
                warmup_batches=1, batches=2)
    assert (r.rows, r.decoded_bytes) == (20, 20 * 8)
    r = measure(url, cache=os.fspath(tmp_path / "cache"), batch_size=10, warmup_batches=0)
    assert r.stats["cache_misses"] > 0  # row groups went through the cache
    assert {"pruned_row_groups", "skipped_row_groups", "repeated_rows", "cache_hits"} <= set(r.stats)


def test_to_json_and_summary(url: str) -> None:
    r = measure(url, batch_size=8, warmup_batches=1, batches=2)
    info = r.to_json()
    for key in ("rows", "batches", "seconds", "rows_per_second", "batches_per_second", "mb_per_second",
                "first_batch_seconds", "cpu_seconds", "cpu_percent", "peak_rss", "stats", "stopped_by"):
        assert key in info, key
    assert info["rows_per_second"] == r.rows_per_second
    text = r.summary()
    assert text.splitlines()[0].startswith(f"{url}  (numpy, shard 0 of 1, batch_size 8")
    assert "16 rows" in text
    assert "rows/s" in text


def test_progress_line_on_stderr(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    measure(url, batch_size=8, warmup_batches=0, progress=True)
    err = capsys.readouterr().err
    assert "shardkit bench" in err
    assert "rows/s" in err
    measure(url, batch_size=8, warmup_batches=0, progress=None)  # stderr is no terminal here: no line
    assert capsys.readouterr().err == ""


def test_torch_adapter_counts_the_same(url: str) -> None:
    importlib.import_module("torch")
    r = measure(url, adapter="torch", batch_size=8, warmup_batches=3, epochs=1)
    assert (r.adapter, r.batches, r.rows, r.decoded_bytes) == ("torch", 8, N, N * ROW_BYTES)
    r = measure(url, adapter="torch", batch_size=8, warmup_batches=2, batches=5)  # full batches
    assert (r.batches, r.rows) == (5, 40)
    _sane(r)


@pytest.mark.tf
def test_tf_adapter_counts_the_same(url: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    importlib.import_module("tensorflow")
    r = measure(url, adapter="tf", batch_size=8, warmup_batches=3, epochs=2, shard=1, num_shards=2)
    assert (r.adapter, r.batches, r.rows, r.decoded_bytes) == ("tf", 8, N, N * ROW_BYTES)
    r = measure(url, adapter="tf", batch_size=8, warmup_batches=2, batches=5)  # full batches
    assert (r.batches, r.rows) == (5, 40)
    _sane(r)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"adapter": "jax"}, "adapter='jax' is not one of 'numpy', 'torch', 'tf'"),
        ({"warmup_batches": -1}, "warmup_batches=-1 must be an int >= 0"),
        ({"batches": 0}, "batches=0 must be an int >= 1"),
        ({"batches": 2.5}, "batches=2.5 must be an int >= 1"),
        ({"epochs": 0}, "epochs=0 must be an int >= 1"),
        ({"seconds": 0}, "seconds=0 must be a finite number > 0"),
        ({"seconds": float("inf")}, "seconds=inf must be a finite number > 0"),
        ({"seconds": "5"}, "seconds='5' must be a finite number > 0"),
        ({"batch_size": 0}, "batch_size=0 must be an int >= 1"),
        ({"columns": ["id", "nope"]}, "unknown column(s) ['nope']"),
        ({"shard": 2, "num_shards": 2}, "shard=2 must be an int in [0, num_shards=2)"),
        ({"shard": 1}, "shard=1 was given without num_shards"),
        ({"seed": -1}, "seed=-1 must be an int >= 0"),
        ({"prefetch": -1}, "prefetch=-1 must be an int >= 0"),
        ({"cache": " "}, "cache=' ' is not a cache setting; pass None (no cache)"),
    ],
)
def test_bad_arguments_raise_reader_error(url: str, kwargs: dict[str, Any], needle: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """From Python the messages name the arguments (``shardkit bench`` writes its flags instead)."""
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ReaderError) as info:
        measure(url, **kwargs)
    assert needle in str(info.value)


def test_nbytes_of_each_kind_of_value() -> None:
    torch = importlib.import_module("torch")
    assert nbytes(np.zeros((3, 4), np.float32)) == 48
    assert nbytes(np.array(["ab", "cde", None], dtype=object)) == 5
    assert nbytes(np.array(["é€", "a", None], dtype=object)) == 2 + 3 + 1  # UTF-8 bytes, not characters
    assert nbytes(["é", None, "ab"]) == nbytes(np.array(["é", "ab"])) == nbytes("éab") == 4
    assert nbytes(["\ud800"]) == 3  # a lone surrogate (no valid UTF-8) counts as encoded, not an error
    assert nbytes(np.ma.masked_array(np.zeros(3, np.int32), mask=[True, False, True])) == 12  # not the mask
    assert nbytes(np.array([b"ab", b"c"], dtype=object)) == 3
    rows = np.empty(3, dtype=object)
    rows[:] = [np.zeros(2, np.int16), None, np.zeros((2, 2), np.int16)]
    assert nbytes(rows) == 12
    assert nbytes(torch.zeros(5, dtype=torch.int64)) == 40
    assert nbytes([torch.zeros(2), None, "xy"]) == 10
    assert nbytes({"a": np.zeros(2, np.uint8), "b": ["x"]}) == 3
    assert isinstance(peak_rss(), int)
    batch = {"x": np.zeros(4, np.int64), "x__valid": np.ones(4, bool), "t": ["é", "b", None, "c"]}
    assert size_of_batch(batch) == (4, 32 + 4 + 4)
    assert size_of_batch(batch, ["x", "t"]) == (4, 32 + 4)  # an adapter's masks are not the data read


def _python_calls(fn: Any, *args: Any) -> int:
    """Python-level calls (and generator resumptions) made while ``fn(*args)`` runs; the garbage collector
    is off meanwhile: a collection runs the Python callbacks in ``gc.callbacks`` (hypothesis registers
    one), which counted as calls of ``fn`` whenever a collection fell inside it."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return calls


def _ragged(n: int) -> np.ndarray:
    rows = np.empty(n, dtype=object)
    rows[:] = [None if i == 3 else np.zeros(i % 5, np.int32) for i in range(n)]
    return rows


def test_sizing_a_batch_makes_no_python_call_per_row() -> None:
    """The sizes are read on the clock: one Python call per text or variable-shape value took half the
    measured time of such batches (numpy adapter), so it is a few calls per column, whatever its rows."""
    torch = importlib.import_module("torch")
    text = [(f"t{i}" if i % 2 else f"é{i}") if i != 3 else None for i in range(2000)]
    for make in (_ragged, lambda n: np.array(text[:n], dtype=object), lambda n: text[:n],
                 lambda n: [None if i == 3 else torch.zeros(i % 5) for i in range(n)]):
        nbytes(make(10))  # once first: a first call's one-off work (a codec's lookup) is no call per row
        assert _python_calls(nbytes, make(2000)) == _python_calls(nbytes, make(10))
    assert nbytes(_ragged(10)) == 4 * (0 + 1 + 2 + 4 + 0 + 1 + 2 + 3 + 4)
    assert nbytes([None, torch.zeros(3, dtype=torch.int16)]) == 6
    assert nbytes(np.array([None, None], dtype=object)) == 0
    assert nbytes(text) == sum(len(t.encode()) for t in text if t is not None)


NULLABLE_ROWS = 30


@pytest.fixture(scope="module")
def nullable(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """A dataset with nullable number, text (some of it not ASCII), bytes and variable-shape fields, and
    its decoded bytes as `Throughput.decoded_bytes` defines them (from the values written)."""
    n = NULLABLE_ROWS
    schema = shardkit.Schema([
        shardkit.Field("id", "int64"),
        shardkit.Field("score", "float32", nullable=True),
        shardkit.Field("text", "str", nullable=True),
        shardkit.Field("blob", "bytes", nullable=True),
        shardkit.Field("seq", "int16", (None,), nullable=True),
    ])
    data = {"id": np.arange(n), "score": [None if i % 3 == 0 else float(i) for i in range(n)],
            "text": [None if i % 4 == 0 else "é€"[: i % 3] + "ab" for i in range(n)],
            "blob": [None if i % 5 == 0 else b"xyz"[: i % 4] for i in range(n)],
            "seq": [None if i % 6 == 0 else np.arange(i % 4, dtype=np.int16) for i in range(n)]}
    expected = (8 * n + 4 * n  # a null number's slot holds 0 (torch, tf) or a masked value (numpy)
                + sum(len(t.encode()) for t in data["text"] if t is not None)
                + sum(len(b) for b in data["blob"] if b is not None)
                + sum(s.nbytes for s in data["seq"] if s is not None))
    url = shardkit.write_dataset(data, tmp_path_factory.mktemp("nullable") / "ds", schema=schema,
                                 row_group_size=7).url
    return url, expected


@pytest.mark.parametrize("adapter", ["numpy", "torch", pytest.param("tf", marks=pytest.mark.tf)])
def test_every_adapter_counts_the_same_decoded_bytes(nullable: tuple[str, int], adapter: str) -> None:
    """torch and tf counted the ``<field>__valid`` masks they add, and numpy counted text in characters
    where tf (tf.string) counts UTF-8 bytes: decoded MB/s differed by adapter on the same data."""
    _import_adapter(adapter)
    url, expected = nullable
    r = measure(url, adapter=adapter, batch_size=8, warmup_batches=1, epochs=1)
    assert (r.rows, r.decoded_bytes) == (NULLABLE_ROWS, expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10**500), 10**500), st.floats(),
                 st.complex_numbers(), st.text(max_size=2),
                 st.sampled_from([np.float32(0.5), np.int64(-1), np.complex128(1), np.bool_(True), np.nan])))
def test_any_seconds_is_measured_or_a_reader_error(url: str, seconds: Any) -> None:
    """10**400 (OverflowError) and numpy complex numbers (TypeError) got through the check."""
    try:
        r = measure(url, seconds=seconds, batches=1, warmup_batches=0, batch_size=30)
    except ReaderError as e:
        message = str(e)
    else:
        assert r.batches == 1
        return
    assert f"seconds={seconds!r} must be a finite number > 0" in message


@pytest.fixture
def gone(tmp_path: Path) -> str:
    """A dataset of three files, one deleted after it was written: its reads fail mid-epoch."""
    ds = shardkit.write_dataset({"id": np.arange(40), "t": [str(i) for i in range(40)]}, tmp_path / "gone",
                                row_group_size=5, file_size=200)
    assert len(ds.files) == 3
    (tmp_path / "gone" / ds.files[1]).unlink()
    return ds.url


def _import_adapter(adapter: str) -> None:
    if adapter != "numpy":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        importlib.import_module({"torch": "torch", "tf": "tensorflow"}[adapter])
        importlib.import_module(f"shardkit.{adapter}")


@pytest.mark.parametrize("adapter", ["numpy", "torch", pytest.param("tf", marks=pytest.mark.tf)])
def test_a_read_error_is_the_readers_own_whatever_the_adapter(gone: str, adapter: str) -> None:
    """tf.data runs the reader on its threads and turns its exception into an UnknownError that names it
    in text only: measure raises the reader's own (the CLI prints it as one line, exit 2), with its own
    cause (it was tf.data's UnknownError), as every adapter does."""
    _import_adapter(adapter)
    missing = "is missing; the dataset was changed outside shardkit"
    with pytest.raises(CorruptDatasetError, match=missing) as info:
        measure(gone, adapter=adapter, batch_size=4, warmup_batches=0)
    causes = []
    cause = info.value.__cause__
    while cause is not None:
        causes.append(cause)
        cause = cause.__cause__
    assert not [c for c in causes if type(c).__module__.startswith("tensorflow")], causes
    assert [c for c in causes if type(c) is FileNotFoundError], causes  # the deleted file's


@pytest.mark.tf
def test_an_interrupted_tf_measure_leaves_no_iterator(tmp_path: Path) -> None:
    """A KeyboardInterrupt's traceback held the tf.data iterator: it read on, starting the closed reader's
    threads again, and a script interrupted so hung at exit (the iterator freed by then waits for a
    generator call that can no longer take the GIL)."""
    _import_adapter("tf")
    tf = importlib.import_module("tensorflow")
    url = shardkit.write_dataset({"id": np.arange(60), "seq": [np.arange(i % 4) for i in range(60)]},
                                 tmp_path / "ds", row_group_size=7).url  # batches go one by one

    def iterators() -> set[int]:
        gc.collect()  # type(o), not isinstance: that reads attributes of every object (deprecated ones warn)
        return {id(o) for o in gc.get_objects() if issubclass(type(o), tf.data.Iterator)}

    before, threads = iterators(), set(threading.enumerate())
    timer = threading.Timer(0.5, _thread.interrupt_main)  # while it reads (started after ~0.1 s)
    timer.start()
    with pytest.raises(KeyboardInterrupt) as info:
        measure(url, adapter="tf", batch_size=4, warmup_batches=0, seconds=60)
    timer.join()
    assert iterators() - before == set()
    time.sleep(0.2)
    assert [t.name for t in set(threading.enumerate()) - threads if t.name.startswith("shardkit-read")] == []
    del info
