"""shardkit.tf, real TensorFlow: element specs from the schema, values vs the reader, fit, tf.distribute."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.errors import AdapterError, MissingDependencyError, require
from tests.reader.datasets import ALL_CODECS, assert_exactly_once, write_all_codecs, write_ids

pytestmark = pytest.mark.tf

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import shardkit.tf as stf  # noqa: E402

N_IDS = 480


@pytest.fixture(scope="module")
def codecs_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_all_codecs(tmp_path_factory.mktemp("codecs") / "ds")[0]


@pytest.fixture(scope="module")
def ids_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", N_IDS, row_group_size=37)


def test_element_spec_comes_from_the_schema() -> None:
    spec = stf.element_spec(ALL_CODECS)
    assert spec["id"] == tf.TensorSpec((None,), tf.int64)
    assert spec["mat"] == tf.TensorSpec((None, 2, 3), tf.int16)
    assert spec["img"] == tf.TensorSpec((None, 8, 8, 3), tf.uint8)
    assert spec["name"].dtype == tf.string
    assert spec["blob"].dtype == tf.string
    assert spec["var"] == tf.RaggedTensorSpec((None, None), tf.float32, ragged_rank=1,
                                              row_splits_dtype=tf.int64)
    assert spec["var2"] == tf.RaggedTensorSpec((None, None, 2), tf.int32, ragged_rank=1,
                                               row_splits_dtype=tf.int64)
    assert spec["maybe__valid"] == tf.TensorSpec((None,), tf.bool)
    padded = stf.element_spec(ALL_CODECS, stf.Collate(variable="pad"))
    assert padded["var2"] == tf.TensorSpec((None, None, 2), tf.int32)
    assert padded["var2__mask"] == tf.TensorSpec((None, None), tf.bool)


def _text(values: Any) -> list[Any]:
    return [b"" if v is None else v.encode() if isinstance(v, str) else v for v in values]


@pytest.mark.parametrize("shuffle", [False, True])
def test_values_and_dtypes_equal_the_readers_for_every_codec(codecs_ds: str, shuffle: bool) -> None:
    kw = {"batch_size": 16, "shuffle": shuffle, "seed": 2}
    with shardkit.make_reader(codecs_ds, **kw) as reader:
        want = list(reader)
    ds = stf.make_dataset(codecs_ds, **kw)
    assert ds.element_spec == stf.element_spec(ALL_CODECS)
    got = list(ds)
    assert len(got) == len(want)
    for w, g in zip(want, got, strict=True):
        for name, expected in w.items():
            value = g[name]
            if isinstance(expected, np.ma.MaskedArray):
                valid = ~np.ma.getmaskarray(expected).reshape(len(expected), -1).any(axis=1)
                np.testing.assert_array_equal(g[name + "__valid"].numpy(), valid)
                np.testing.assert_array_equal(value.numpy()[valid], expected.data[valid])
                assert value.numpy().dtype == expected.dtype
            elif name in ("var", "var2"):
                assert value.dtype.as_numpy_dtype == ALL_CODECS[name].dtype
                for row, exp in zip(value.to_list(), expected, strict=True):
                    np.testing.assert_array_equal(np.array(row, dtype=exp.dtype).reshape(exp.shape), exp)
            elif expected.dtype == object:
                assert value.numpy().tolist() == _text(expected)
            else:
                assert value.numpy().dtype == expected.dtype
                np.testing.assert_array_equal(value.numpy(), expected)
        assert g["note__valid"].numpy().tolist() == [v is not None for v in w["note"]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_runs_of_batches_reach_tf_in_one_call_and_come_back_as_the_readers_batches(
        tmp_path: Path, shuffle: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.reader._pipeline import batching

    url = write_all_codecs(tmp_path / "ds", 300, row_group_size=100)[0]

    sizes: list[int] = []

    def runs(*args: Any, **kwargs: Any) -> Any:  # the real one, watched: how many rows each call takes
        for run in batching_runs(*args, **kwargs):
            sizes.append(len(run["id"]))
            yield run

    batching_runs = batching.runs
    monkeypatch.setattr(batching, "runs", runs)
    kw = {"batch_size": 8, "shuffle": shuffle, "seed": 3, "num_epochs": 2,
          "columns": ["id", "label", "score", "flag", "name", "blob", "vec", "mat", "img", "gray"]}
    with shardkit.make_reader(url, **kw) as reader:
        want = list(reader)
    got = list(stf.make_dataset(url, **kw))
    # batches were joined; shuffled images are decoded per batch (after the shuffle), each into its own
    # arrays, so those batches reach tf one at a time
    assert max(sizes) > 8 if not shuffle else max(sizes) == 8
    assert sum(sizes) == 2 * 300  # and every row went through
    assert [len(g["id"]) for g in got] == [len(w["id"]) for w in want]  # 300 = 37 x 8 + 4, twice
    for w, g in zip(want, got, strict=True):
        for name, expected in w.items():
            if expected.dtype == object:
                assert g[name].numpy().tolist() == _text(expected)
            else:
                assert g[name].numpy().dtype == expected.dtype
                np.testing.assert_array_equal(g[name].numpy(), expected)


def test_pad_policy(codecs_ds: str) -> None:
    kw = {"batch_size": 32, "shuffle": False, "columns": ["var2"]}
    with shardkit.make_reader(codecs_ds, **kw) as reader:
        rows = next(iter(reader))["var2"]
    got = next(iter(stf.make_dataset(codecs_ds, collate=stf.Collate(variable="pad"), **kw)))
    longest = max(r.shape[0] for r in rows)
    assert got["var2"].shape == (32, longest, 2)
    np.testing.assert_array_equal(got["var2__mask"].numpy().sum(axis=1), [r.shape[0] for r in rows])


def test_each_iteration_is_the_next_epoch(ids_ds: str) -> None:
    ds = stf.make_dataset(ids_ds, batch_size=64, seed=1, columns=["id"])
    epochs = [np.concatenate([b["id"].numpy() for b in ds]) for _ in range(2)]
    for ids in epochs:
        assert_exactly_once(ids, N_IDS)
    assert not np.array_equal(epochs[0], epochs[1])


def test_an_iteration_stopped_or_dropped_early_never_shortens_the_next(ids_ds: str) -> None:
    ds = stf.make_dataset(ids_ds, batch_size=64, columns=["id"])
    assert int(ds.cardinality()) == -(-N_IDS // 64)
    assert len(list(ds.take(2))) == 2
    dropped = iter(ds)  # as Keras makes one ahead at each epoch end; prefetching starts reading
    next(dropped)
    for _ in range(2):
        assert_exactly_once(np.concatenate([b["id"].numpy() for b in ds]), N_IDS)
    del dropped


def test_autotuning_is_off_and_can_be_turned_back_on(ids_ds: str) -> None:
    """With tf.data's autotuner on, deleting an iterator (every epoch's end) waited, now and then, for
    the autotuner's next round: up to 60 s (9.4 s measured after an 11 s pass; TensorFlow 2.21)."""
    ds = stf.make_dataset(ids_ds, batch_size=64, columns=["id"])
    assert ds.options().autotune.enabled is False
    mapped = ds.map(lambda b: b["id"] * 2, num_parallel_calls=tf.data.AUTOTUNE)
    assert mapped.options().autotune.enabled is False
    opts = tf.data.Options()
    opts.autotune.enabled = True
    tuned = mapped.with_options(opts)
    assert tuned.options().autotune.enabled is True
    assert_exactly_once(np.concatenate([b.numpy() for b in tuned]) // 2, N_IDS)


def test_model_fit_runs_epochs_from_make_dataset(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.random((256, 8)).astype(np.float32)
    shardkit.write_dataset({"x": x, "y": (x.sum(axis=1) > 4).astype(np.int64)}, os.fspath(tmp_path / "d"),
                           row_group_size=64)
    ds = stf.make_dataset(os.fspath(tmp_path / "d"), batch_size=32, features="x", label="y")
    assert ds.element_spec == (tf.TensorSpec((None, 8), tf.float32),
                               tf.TensorSpec((None,), tf.int64))
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    steps: list[int] = []

    class Count(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            steps.append(0)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            steps[-1] += 1

    # shardkit shuffles (Keras warns about shuffle=True on a dataset); any warning fails this test
    history = model.fit(ds, epochs=3, verbose=0, shuffle=False, callbacks=[Count()])
    assert steps == [8, 8, 8]  # 256 rows / 32: every epoch whole
    assert len(history.history["loss"]) == 3
    assert all(np.isfinite(history.history["loss"]))


def test_input_pipelines_read_orthogonal_shards(ids_ds: str) -> None:
    fn = stf.dataset_fn(ids_ds, batch_size=32, columns=["id"])
    ids = []
    for pipeline in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline,
                                         num_replicas_in_sync=4)
        batches = [b["id"].numpy() for b in fn(ctx)]
        assert {len(b) for b in batches} == {8}  # the global batch of 32 over 4 replicas
        ids.append(np.concatenate(batches))
    assert_exactly_once(np.concatenate(ids), N_IDS)
    with pytest.raises(AdapterError, match="batch_size=30"):
        stf.dataset_fn(ids_ds, batch_size=30)(tf.distribute.InputContext(1, 0, 4))
    with pytest.raises(AdapterError, match="InputContext"):
        stf.dataset_fn(ids_ds, batch_size=30, shard=0)


@pytest.mark.timeout(120)
def test_distribute_dataset_feeds_two_replicas(ids_ds: str) -> None:
    """A real MirroredStrategy over two logical CPUs (configured before TF starts: a fresh process)."""
    code = textwrap.dedent(f"""
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import shardkit.tf
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        dist = shardkit.tf.distribute_dataset(strategy, {ids_ds!r}, batch_size=32, columns=["id"])
        ids, sizes = [], set()
        for batch in dist:
            for part in strategy.experimental_local_results(batch["id"]):
                ids.extend(part.numpy().tolist())
                sizes.add(len(part))
        print("RESULT", strategy.num_replicas_in_sync, sorted(sizes), len(ids), len(set(ids)))
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110, env=env,
                         check=False, start_new_session=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, out.stderr[-3000:]
    # one input pipeline feeds both replicas 16 rows each: the whole dataset once
    assert line.split(maxsplit=1)[1] == f"2 [16] {N_IDS} {N_IDS}"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [int(sock.getsockname()[1]) for sock in socks]
    for sock in socks:
        sock.close()
    return ports


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_sharded_dataset_trains_under_multi_worker_mirrored_strategy(tmp_path: Path) -> None:
    """Two real MultiWorkerMirroredStrategy processes, each training on its own shard through
    ``experimental_distribute_dataset``. A regression: TensorFlow sharded the already sharded dataset
    again, by file, and failed on the first batch."""
    url = str(tmp_path / "ds")
    n = 203
    shardkit.write_dataset({"id": np.arange(n), "x": np.arange(n, dtype=np.float32) / n,
                            "label": (np.arange(n) % 2).astype(np.int64)}, url, row_group_size=50)
    script = Path(__file__).with_name("scripts") / "mwms_fit.py"
    ports = _free_ports(2)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(i), *map(str, ports), url,
                               str(tmp_path / f"out{i}.json")], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    results = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert results[0]["weight"] == results[1]["weight"] != 0  # trained, in step (allreduced gradients)
    ids = results[0]["ids"] + results[1]["ids"]
    # each worker its own shard, not sharded again: together every id once, but for the one row the
    # default remainder ("drop") leaves out of 203 on 2 shards
    assert len(ids) == len(set(ids)) == n - 1
    assert not set(results[0]["ids"]) & set(results[1]["ids"])


def test_fields_and_options_tf_cannot_take(tmp_path: Path, ids_ds: str) -> None:
    url = os.fspath(tmp_path / "odd")
    columns = {"when": np.arange(20).astype("datetime64[s]"), "depth": np.arange(20, dtype=np.uint16)}
    shardkit.write_dataset(columns, url, row_group_size=10)
    with pytest.raises(AdapterError, match=r"field 'when' is datetime64.*cast=.*columns="):
        stf.make_dataset(url)
    ds = stf.make_dataset(url, collate=stf.Collate(cast={"when": "int64"}), shuffle=False)
    batch = next(iter(ds))
    assert batch["depth"].dtype == tf.uint16  # TensorFlow has uint16 tensors
    np.testing.assert_array_equal(batch["when"].numpy(), np.arange(20))
    with pytest.raises(AdapterError, match="nope"):
        stf.make_dataset(ids_ds, label="nope")
    with shardkit.make_reader(ids_ds) as reader, pytest.raises(AdapterError, match=r"\[''\] are not fields"):
        stf.make_dataset(reader, label="")  # a regression: a raw KeyError: ''
    with shardkit.make_reader(ids_ds) as reader, pytest.raises(AdapterError, match="batch_size"):
        stf.make_dataset(reader, batch_size=3)


def test_missing_tensorflow_names_the_extra() -> None:
    with pytest.raises(MissingDependencyError, match=r"pip install 'shardkit\[tf\]'"):
        require("shardkit_no_such_module", extra="tf", purpose="shardkit.tf")
    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "try:\n    import shardkit.tf\nexcept ImportError as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "MissingDependencyError" in out.stdout
    assert "shardkit[tf]" in out.stdout


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_a_lakehouse_table_feeds_tf_data_at_its_snapshot(tmp_path: Path, fmt: str) -> None:
    """make_dataset takes a Delta or Iceberg table unchanged: the rows of the version it opened, once,
    even when the table moves on while the dataset is read (and a pinned old version by version=)."""
    from tests.dataset.tables import make_history

    history = make_history(fmt, tmp_path / "t", [("append", 70), ("overwrite", 50)])
    first_version = next(iter(history.snapshots))
    want = sorted(history.ids())
    ds = stf.make_dataset(history.url, batch_size=16, seed=2, remainder="uneven")
    history.apply(("append", 30))
    got = sorted(int(i) for batch in ds for i in batch["id"].numpy())
    assert got == want
    old = stf.make_dataset(history.url, batch_size=16, version=first_version, remainder="uneven")
    assert sorted(int(i) for batch in old for i in batch["id"].numpy()) == list(range(70))
