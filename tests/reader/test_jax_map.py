"""`shardkit.jax.MapSource`: a dataset's rows by index as numpy samples, a Grain data source: the rows of
`take`, through ``grain.MapDataset`` (shuffled, batched) and a ``grain.DataLoader`` with 2 worker
processes, each row once per epoch."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
import shardkit.jax
from shardkit.dataset import take
from shardkit.errors import RowIndexError, RowIndexTypeError
from tests.reader.datasets import write_all_codecs

Written = tuple[str, dict[str, Any]]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Written:
    return write_all_codecs(tmp_path_factory.mktemp("jaxmap") / "all", 90, row_group_size=7)


def test_samples_are_the_rows_take_gives(written: Written) -> None:
    url, _ = written
    ds = shardkit.open_dataset(url)
    src = shardkit.jax.MapSource(url, columns=["id", "img", "var", "maybe", "name"])
    assert len(src) == 90
    want = take(ds, [4, 89, 4], columns=src.columns)
    got = src.__getitems__([4, -1, np.int64(4)])
    for j, sample in enumerate(got):
        assert list(sample) == src.columns
        for name in src.columns:
            w = want[name][j]
            if isinstance(want[name], np.ma.MaskedArray) and np.ma.getmaskarray(want[name])[j].all():
                assert sample[name] is None
            else:
                np.testing.assert_array_equal(np.asarray(sample[name]), np.asarray(w), err_msg=name)
    assert int(src[-90]["id"]) == 0
    copy = pickle.loads(pickle.dumps(src))  # what a worker process gets: it opens its own files
    assert int(copy[17]["id"]) == 17
    with pytest.raises(RowIndexError, match="out of range"):
        src[90]
    with pytest.raises(RowIndexTypeError, match="is not an integer"):
        src[1.0]  # type: ignore[index]
    filtered = shardkit.jax.MapSource(url, columns=["id", "label"], filter=[("label", "=", 3)])
    assert all(int(filtered[i]["label"]) == 3 for i in range(len(filtered)))
    assert filtered.positions.tolist() == [int(filtered[i]["id"]) for i in range(len(filtered))]
    raw = shardkit.jax.MapSource(url, columns=["img"], decode=False)
    assert raw[0]["img"][:4] == b"\x89PNG"


def test_a_grain_map_dataset_shuffles_and_batches_every_row_once(written: Written) -> None:
    import grain  # a dev dependency
    url, _ = written
    src = shardkit.jax.MapSource(url, columns=["id", "vec"])
    ds = grain.MapDataset.source(src).shuffle(seed=3).batch(16)
    batches = [ds[i] for i in range(len(ds))]
    ids = np.concatenate([b["id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(90))
    assert ids.tolist() != list(range(90))  # shuffled
    whole = take(shardkit.open_dataset(url), ids, columns=["vec"])["vec"]
    np.testing.assert_array_equal(np.concatenate([b["vec"] for b in batches]), whole)


GRAIN_SCRIPT = """
import sys
import grain
import numpy as np
from absl import flags
import shardkit.jax

def main():
    flags.FLAGS.mark_as_parsed()  # grain's DataLoader reads absl flags: parsed, as absl.app would
    src = shardkit.jax.MapSource(sys.argv[1], columns=["id", "label"])
    sampler = grain.samplers.IndexSampler(len(src), shuffle=True, seed=0, num_epochs=1)
    loader = grain.DataLoader(data_source=src, sampler=sampler, worker_count=2,
                              operations=[grain.transforms.Batch(32)])
    ids = np.concatenate([b["id"] for b in loader])
    print("IDS", " ".join(map(str, ids.tolist())))

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_grain_data_loader_with_two_worker_processes_reads_every_row_once(written: Written,
                                                                            tmp_path: Path) -> None:
    """Grain's workers are spawned processes: the source is pickled to each, which opens its own files."""
    import subprocess
    url, _ = written
    script = tmp_path / "grain_loader.py"
    script.write_text(GRAIN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), url], capture_output=True, text=True, timeout=170,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = [int(i) for i in next(line for line in proc.stdout.splitlines() if line.startswith("IDS"))
           .split()[1:]]
    assert sorted(ids) == list(range(90))
