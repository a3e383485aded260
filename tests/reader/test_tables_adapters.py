"""The adapters take Delta and Iceberg tables unchanged: torch's DataLoader workers all read the snapshot
the dataset was made on, even when the table moves on before they start."""

from __future__ import annotations

from pathlib import Path

import deltalake  # noqa: F401  (installed by [dev]: a missing one is a broken install, not a skip)
import pytest
import torch

from tests.dataset.tables import make_history


def test_torch_workers_read_the_snapshot_the_dataset_was_made_on(tmp_path: Path) -> None:
    from shardkit.torch import ShardkitIterableDataset

    history = make_history("delta", tmp_path / "t", [("append", 120), ("overwrite", 90)])
    expected = history.ids()
    ds = ShardkitIterableDataset(history.url, rank=0, world_size=1, batch_size=16, seed=1,
                                 remainder="uneven")
    history.apply(("overwrite", 30))  # before any worker opens the table
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    ids = sorted(int(i) for batch in loader for i in batch["id"])
    assert ids == sorted(expected)


def test_spawned_torch_workers_open_the_same_snapshot_again(tmp_path: Path) -> None:
    from shardkit.torch import ShardkitIterableDataset

    history = make_history("delta", tmp_path / "t", [("append", 60), ("overwrite", 50)])
    expected = history.ids()
    ds = ShardkitIterableDataset(history.url, rank=0, world_size=1, batch_size=16, seed=1,
                                 remainder="uneven")
    history.apply(("append", 30))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    ids = sorted(int(i) for batch in loader for i in batch["id"])
    assert ids == sorted(expected)


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_forked_torch_workers_resume_on_the_saved_snapshot(tmp_path: Path, fmt: str) -> None:
    import shardkit
    from shardkit.torch import ShardkitIterableDataset

    history = make_history(fmt, tmp_path / "t", [("append", 100), ("overwrite", 80)])
    expected = history.ids()
    kw = {"batch_size": 10, "seed": 1, "remainder": "uneven"}
    with shardkit.make_reader(history.url, **kw) as reader:
        it = iter(reader)
        seen = [int(i) for _ in range(3) for i in next(it)["id"]]
        state = reader.state_dict()
    history.apply(("append", 25))  # the table moves on; the dataset opens the new snapshot
    ds = ShardkitIterableDataset(history.url, rank=0, world_size=1, **kw)
    ds.load_state_dict(state)  # in the main process: the saved snapshot is opened here, once
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    seen += [int(i) for batch in loader for i in batch["id"]]
    assert sorted(seen) == sorted(expected)
