"""DataLoader workers resume on any layout: what each worker delivered is skipped, the rest read once.

A job of ``world`` ranks with ``k`` DataLoader workers each reads shards ``rank * k + worker`` of
``world * k``; the DataLoader takes batches from its workers in turn, so at a checkpoint some workers
have delivered a batch more than others. `shardkit.torch.job_state` keeps what each one delivered, and a
job resumed on another world size or worker count reads every sample that none of them delivered, once.
``remainder="drop"`` (the default) leaves out fewer than ``num_shards`` samples of the last stage of an
epoch (each stage's left-out tail goes on to the next one), so the union of the two jobs is every sample
at most once, all but fewer than the new job's number of shards.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
import shardkit.torch as skt
from tests.reader.datasets import write_ids

N = 301  # no world x workers below divides it: "drop" leaves samples out of every stage
BATCH = 8
# torchdata 0.11 (its latest) calls torch.set_vital, which torch 2.13 deprecates: their warning, not ours
_TORCHDATA_WARNING = "ignore:'set_vital' is deprecated:UserWarning"
_MANY_WORKERS = "ignore:This DataLoader will create:UserWarning"  # more workers than CPUs: fine here
_SETTINGS = {"deadline": None, "derandomize": True,
             "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]}




@pytest.fixture(scope="module")
def ids_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", N, row_group_size=37)




def _dataset(url: str, rank: int, world: int, remainder: str = "drop") -> Any:
    return skt.ShardkitIterableDataset(url, rank=rank, world_size=world, batch_size=BATCH, columns=["id"],
                                       seed=3, workers=1, remainder=remainder)


def _check(stages: list[list[list[np.ndarray]]], shards_after: int, repeats_allowed: int,
           remainder: str = "drop") -> None:
    """``stages[i][rank]``: the valid rows each rank of the ``i``-th job read (the last one to the end)."""
    assert len({len(batches) for batches in stages[-1]}) == 1, "the resumed ranks step together"
    seen = Counter(int(i) for stage in stages for batches in stage for b in batches for i in b)
    assert set(seen) <= set(range(N))
    missing = N - len(seen)
    left_out = shards_after - 1 if remainder == "drop" else 0  # "mask" leaves nothing out
    assert missing <= left_out, f"{missing} samples left out; the last stage has {shards_after} shards"
    repeated = sum(c - 1 for c in seen.values())
    assert repeated == 0, f"{repeated} samples read twice"


def _round_robin(iters: list[Iterator[Any]], steps: int | None) -> list[np.ndarray]:
    """``steps`` batches (None: all) from ``iters`` in turn, an exhausted one left out (as a DataLoader
    takes batches from its workers)."""
    live, out, turn = list(range(len(iters))), [], 0
    while live and (steps is None or len(out) < steps):
        w = live[turn % len(live)]
        batch = next(iters[w], None)
        if batch is None:
            live.remove(w)
            continue
        ids = np.asarray(batch["id"])
        out.append(ids[np.asarray(batch["__valid__"])].copy() if "__valid__" in batch else ids.copy())
        turn += 1
    return out


def _job(url: str, world: int, workers: int, state: Any, cut: float | None, left: int, remainder: str
         ) -> tuple[list[list[np.ndarray]], list[dict[str, Any]]]:
    """One job of ``world`` ranks x ``workers`` workers, each worker a `ShardkitIterableDataset` in this
    process (worker ``w`` of rank ``r`` is shard ``r * workers + w``), resumed from ``state``: each rank
    steps ``cut`` of its batches (``left`` samples are left in the epoch; None: to the end). Returns each
    rank's batches and the workers' states, as DataLoader workers save them."""
    shards = world * workers
    per_worker = -(-(left // shards) // BATCH)  # "drop": every piece holds left // shards samples
    steps = None if cut is None else int(cut * workers * per_worker)
    read, states = [], []
    for rank in range(world):
        datasets = [_dataset(url, rank * workers + w, shards, remainder) for w in range(workers)]
        for ds in datasets:
            if state is not None:
                ds.load_state_dict(state)
        read.append(_round_robin([iter(ds) for ds in datasets], steps))
        states += [{**ds.state_dict(), "rank": rank, "world_size": world, "num_workers": workers, "worker": w}
                   for w, ds in enumerate(datasets)]
    return read, states


@pytest.mark.timeout(120)
@settings(max_examples=25, **_SETTINGS)
@given(layouts=st.lists(st.tuples(st.integers(1, 16), st.integers(1, 4)).filter(lambda x: x[0] * x[1] <= 24),
                        min_size=2, max_size=4),
       cuts=st.lists(st.floats(0, 1, exclude_max=True), min_size=3, max_size=3),
       remainder=st.sampled_from(["drop", "mask"]))
def test_job_state_skips_what_each_worker_delivered(ids_url: str, layouts: list[tuple[int, int]],
                                                    cuts: list[float], remainder: str) -> None:
    """Several resizes in one epoch, over world sizes 1..16 and 1..4 workers: the workers stepped in
    turn in this process (no DataLoader processes: many layouts quickly), each job resumed from the
    `job_state` of the workers' states of the one before."""
    stages: list[list[list[np.ndarray]]] = []
    state: Any = None
    allowed = 0
    for i, (world, workers) in enumerate(layouts):
        last = i == len(layouts) - 1
        left = N - len({int(x) for stage in stages for batches in stage for b in batches for x in b})
        read, states = _job(ids_url, world, workers, state, None if last else cuts[i], left, remainder)
        stages.append(read)
        state = skt.job_state(states if i % 2 else {"nested": {"workers": states}})
        allowed += world * (workers - 1) * BATCH
    _check(stages, layouts[-1][0] * layouts[-1][1], allowed, remainder)


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings(_TORCHDATA_WARNING)
@pytest.mark.filterwarnings(_MANY_WORKERS)
@pytest.mark.usefixtures("reap")
@settings(max_examples=6, **_SETTINGS)
@given(world=st.integers(1, 2), workers=st.integers(2, 3), world_after=st.integers(1, 3),
       workers_after=st.integers(0, 2), cut=st.floats(0, 1, exclude_max=True))
def test_stateful_dataloader_resumes_on_another_layout(ids_url: str, world: int, workers: int,
                                                       world_after: int, workers_after: int,
                                                       cut: float) -> None:
    """Real DataLoader workers: the old job's ranks read ``cut`` of their batches, rank 0's
    ``StatefulDataLoader`` state goes through `job_state` into the new job's datasets."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    with shardkit.make_reader(ids_url, shard=0, num_shards=world * workers, batch_size=BATCH) as probe:
        steps = max(1, int(cut * workers * len(probe)))  # every worker of every rank: as many batches
    old, saved = [], None
    for rank in range(world):
        dl = StatefulDataLoader(_dataset(ids_url, rank, world), batch_size=None, num_workers=workers)
        old.append([b["id"].numpy().copy() for b in itertools.islice(dl, steps)])
        saved = saved or dl.state_dict()  # rank 0's serves every rank: ranks step together
        del dl
    state = skt.job_state(saved)
    new = []
    for rank in range(world_after):
        ds = _dataset(ids_url, rank, world_after)
        ds.load_state_dict(state)
        dl = StatefulDataLoader(ds, batch_size=None, num_workers=workers_after)
        new.append([b["id"].numpy().copy() for b in dl])
        del dl
    _check([old, new], world_after * max(1, workers_after), world * (workers - 1) * BATCH)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(_TORCHDATA_WARNING)
@pytest.mark.usefixtures("reap")
def test_a_worker_that_finished_its_piece_is_not_read_again(ids_url: str) -> None:
    """At the checkpoint worker 0 has delivered its last batch (its state points at the next epoch) and
    worker 1 has one to go: the resumed job reads that one batch and nothing of worker 0's."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    with shardkit.make_reader(ids_url, shard=0, num_shards=2, batch_size=BATCH) as probe:
        steps = 2 * len(probe) - 1
    dl = StatefulDataLoader(_dataset(ids_url, 0, 1), batch_size=None, num_workers=2)
    old = [b["id"].numpy().copy() for b in itertools.islice(dl, steps)]
    state = skt.job_state(dl.state_dict())
    del dl
    assert [p["epoch"] for p in state["workers"]["positions"]] == [1, 0]
    ds = _dataset(ids_url, 0, 1)
    ds.load_state_dict(state)
    new = [b["id"].numpy().copy() for b in ds]  # no workers: the job's one shard
    _check([[old], [new]], 1, BATCH)
    assert len(new) == 1


def _keep(sample: dict[str, Any]) -> dict[str, Any]:
    return sample


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("reap")
@settings(max_examples=4, **_SETTINGS)
@given(world=st.integers(1, 3), world_after=st.integers(1, 4), cut=st.floats(0, 1, exclude_max=True))
def test_make_loader_with_threads_and_transform_processes_resumes_on_another_world_size(
        ids_url: str, world: int, world_after: int, cut: float) -> None:
    """`make_loader`'s own workers (reading threads, transform processes, batches read ahead) deliver in
    order and its state counts the batches handed out: a rank's state is the job's, on any world size."""
    kw = {"batch_size": BATCH, "columns": ["id"], "seed": 3, "workers": 3, "transform": _keep,
          "transform_workers": 2}
    old, saved = [], None
    for rank in range(world):
        with skt.make_loader(ids_url, shard=rank, num_shards=world, **kw) as loader:
            steps = int(cut * len(loader))
            old.append([b["id"].numpy().copy() for b in itertools.islice(loader, steps)])
            saved = saved or loader.state_dict()
    new = []
    for rank in range(world_after):
        with skt.make_loader(ids_url, shard=rank, num_shards=world_after, **kw) as loader:
            loader.load_state_dict(saved)
            new.append([b["id"].numpy().copy() for b in loader])
    _check([old, new], world_after, 0)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(_TORCHDATA_WARNING)
@pytest.mark.usefixtures("reap")
@pytest.mark.parametrize("steps", [1, 3, 4])
def test_a_mixture_read_by_workers_resumes_on_another_layout(tmp_path: Path, steps: int) -> None:
    """A mixture's worker states (their sources come back from the DataLoader in another key order) go
    through `job_state` into one shard: with the samples read before, the one-shard epoch's stream."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    sources = {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    shardkit.write_dataset({"id": np.arange(100)}, sources["a"], row_group_size=17)
    shardkit.write_dataset({"id": np.arange(1000, 1100)}, sources["b"], row_group_size=13)
    kw: dict[str, Any] = {"weights": {"a": 3, "b": 1}, "samples_per_epoch": 101, "batch_size": 4, "seed": 2,
                          "workers": 1}
    with shardkit.make_reader(sources, **kw) as reader:
        want = Counter(int(i) for b in reader for i in b["id"])
    dl = StatefulDataLoader(skt.ShardkitIterableDataset(sources, rank=0, world_size=1, **kw), batch_size=None,
                            num_workers=2)
    got = Counter(int(i) for b in itertools.islice(dl, steps) for i in b["id"])
    state = skt.job_state(dl.state_dict())
    del dl
    ds = skt.ShardkitIterableDataset(sources, rank=0, world_size=1, **kw)
    ds.load_state_dict(state)
    got.update(int(i) for b in ds for i in b["id"])
    assert not want - got  # nothing left out (the two shards' "drop" tail is read by the one shard)
    assert sum((got - want).values()) == 0
