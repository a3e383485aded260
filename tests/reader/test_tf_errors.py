"""shardkit.tf, real TensorFlow: a read error under tf.data, iterated and in ``model.fit``, is tf.data's
``OpError`` holding the shardkit message on one line, and the shardkit exception is ``ds.read_error``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.errors import CorruptDatasetError, SchemaMismatchError
from tests.reader.datasets import write_ids
from tests.reader.test_reader_errors import corrupt_column_chunk

pytestmark = pytest.mark.tf

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import shardkit.tf as stf  # noqa: E402
from shardkit.reader.adapters.tf import READ_ERROR_NOTE  # noqa: E402


@pytest.fixture
def corrupt(tmp_path: Path) -> tuple[str, str, bytes]:
    """Features ``x`` and a label ``y`` over 3 files; row group 1 of the second file has a corrupt ``x``
    chunk. Returns (url, that file's path, its intact bytes)."""
    rng = np.random.default_rng(0)
    x = rng.random((400, 8)).astype(np.float32)
    url = os.fspath(tmp_path / "ds")
    ds = shardkit.write_dataset({"x": x, "y": (x.sum(axis=1) > 4).astype(np.int64)}, url, row_group_size=40,
                                file_size=6000)
    assert len(ds.files) == 3
    path = os.path.join(url, ds.files[1])
    intact = Path(path).read_bytes()
    corrupt_column_chunk(url, ds.files[1], 1)
    return url, path, intact


def _assert_shardkits_message(message: str, error: BaseException) -> None:
    """tf.data's ``message`` holds shardkit's ``error`` as one line, and none of what is under it."""
    name = type(error).__name__
    lines = [line for line in message.splitlines() if f"{name}: " in line]
    assert lines, message
    assert lines[0].endswith(f"{name}: {error}"), message  # the whole message, on this one line
    assert READ_ERROR_NOTE in message
    # neither the Arrow error under it (several lines) nor the frames of the reader's threads
    assert "The above exception was the direct cause" not in message, message
    assert "shardkit/reader/reader.py" not in message, message
    assert "concurrent/futures" not in message, message


def _assert_corrupt(error: Any, path: str) -> None:
    assert isinstance(error, CorruptDatasetError)
    assert f"row group 1 of {path!r} cannot be read" in str(error)
    assert "on_error='skip'" in str(error)
    assert str(error).isprintable()  # one line
    assert isinstance(error.__cause__, OSError)  # Arrow's error, kept under the reader's own


def test_iterating_over_a_corrupt_row_group(corrupt: tuple[str, str, bytes]) -> None:
    url, path, intact = corrupt
    ds = stf.make_dataset(url, batch_size=16, shuffle=False)
    assert ds.read_error is None
    rows: list[int] = []

    def read_all() -> None:
        for batch in ds:
            rows.append(len(batch["x"]))

    with pytest.raises(tf.errors.UnknownError) as info:  # CorruptDatasetError is no ValueError
        read_all()
    assert sum(rows) > 0, "the error should come mid-epoch, after rows were delivered"
    _assert_corrupt(ds.read_error, path)
    _assert_shardkits_message(info.value.message, ds.read_error)
    assert path in info.value.message.splitlines()[0]
    with open(path, "wb") as f:  # repaired: the next iteration reads and forgets the error
        f.write(intact)
    assert sum(len(b["x"]) for b in ds) == 400
    assert ds.read_error is None


def test_model_fit_over_a_corrupt_row_group(corrupt: tuple[str, str, bytes]) -> None:
    url, path, _ = corrupt
    ds = stf.make_dataset(url, batch_size=16, features="x", label="y", shuffle=False)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(tf.errors.UnknownError) as info:
        model.fit(ds, epochs=2, verbose=0, shuffle=False)
    _assert_corrupt(ds.read_error, path)
    _assert_shardkits_message(str(info.value), ds.read_error)

    def fit_raising_the_readers_own() -> None:  # as make_dataset's docstring shows
        try:
            model.fit(ds, epochs=1, verbose=0, shuffle=False)
        except tf.errors.OpError:
            if ds.read_error is None:
                raise
            raise ds.read_error  # noqa: B904 (its own cause, Arrow's error, stays)

    with pytest.raises(CorruptDatasetError) as own:
        fit_raising_the_readers_own()
    _assert_corrupt(own.value, path)


@pytest.mark.parametrize(("error", "tf_error"), [
    (SchemaMismatchError("field 'x' of 'part-00001.parquet' is float64, not float32; rewrite it"),
     tf.errors.InvalidArgumentError),  # a ValueError
    (KeyError("a bug"), tf.errors.UnknownError),
])
def test_the_error_class_tf_data_gives(tmp_path: Path, error: Exception, tf_error: type) -> None:
    """tf.data's class for the reader's error (no reader error here is a ValueError mid-epoch: the
    reader raises this one itself); a non-shardkit error goes to tf.data as it is, its frames kept."""
    url = write_ids(tmp_path / "ds", 100, row_group_size=10)
    reader = shardkit.make_reader(url, batch_size=10, shuffle=False)
    epoch = reader.iter_epoch

    def failing() -> Iterator[Any]:
        for i, batch in enumerate(epoch()):
            if i == 2:
                raise error
            yield batch

    reader.iter_epoch = failing  # type: ignore[method-assign]
    with reader:
        ds = stf.make_dataset(reader)
        with pytest.raises(tf_error) as info:
            list(ds)
    assert ds.read_error is error
    if isinstance(error, SchemaMismatchError):
        _assert_shardkits_message(info.value.message, error)
    else:
        assert READ_ERROR_NOTE not in info.value.message
        assert "in failing" in info.value.message  # where the bug is
