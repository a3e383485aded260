"""`shardkit.torch.MapDataset`: a map-style torch dataset whose samples are the stream's rows, for any
sampler and DataLoader workers (fork and spawn), with batched ``__getitems__``."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, WeightedRandomSampler

import shardkit
import shardkit.torch
from shardkit.dataset import take
from shardkit.errors import ReaderError, RowIndexError, RowIndexTypeError
from shardkit.reader.adapters.collate import Collate
from tests.reader.datasets import write_all_codecs

if TYPE_CHECKING:
    from tests.reader.conftest import S3Server

Written = tuple[str, dict[str, Any]]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Written:
    return write_all_codecs(tmp_path_factory.mktemp("map") / "all", 90, row_group_size=7)


def _weighted(seed: int) -> WeightedRandomSampler:
    weights = torch.linspace(0.1, 3.0, 90)  # later rows drawn more often, many drawn twice
    return WeightedRandomSampler(weights, num_samples=70, generator=torch.Generator().manual_seed(seed))


def test_a_weighted_sampler_over_two_workers_gets_exactly_its_rows(written: Written) -> None:
    url, columns = written
    asked = list(_weighted(3))
    ds = shardkit.torch.MapDataset(url, columns=["id", "img", "var", "maybe", "name"])
    loader = DataLoader(ds, batch_size=16, sampler=_weighted(3), num_workers=2, collate_fn=list)
    samples = [s for batch in loader for s in batch]
    assert [int(s["id"]) for s in samples] == asked
    for i, s in zip(asked, samples, strict=True):
        np.testing.assert_array_equal(s["img"].numpy(), columns["img"][i])
        np.testing.assert_array_equal(s["var"].numpy(), columns["var"][i])
        assert bool(s["maybe__valid"]) == (columns["maybe"][i] is not None)
        assert s["name"] == columns["name"][i]


def test_samples_collate_to_the_streams_batch(written: Written) -> None:
    url, _ = written
    fixed = ["id", "score", "flag", "vec", "mat", "img", "gray", "maybe", "maybe_vec"]
    stream = next(iter(shardkit.torch.make_loader(url, columns=fixed, batch_size=90, shuffle=False,
                                                  remainder="uneven")))
    loader = DataLoader(shardkit.torch.MapDataset(url, columns=fixed), batch_size=90)  # default collate
    batch = next(iter(loader))
    assert list(batch) == list(stream)
    for key, value in stream.items():
        assert batch[key].dtype == value.dtype, key
        assert torch.equal(batch[key], value), key


def test_text_and_variable_rows_are_the_streams(written: Written) -> None:
    url, _ = written
    names = ["name", "blob", "note", "var", "var2"]
    stream = next(iter(shardkit.torch.make_loader(url, columns=names, batch_size=90, shuffle=False,
                                                  remainder="uneven")))
    ds = shardkit.torch.MapDataset(url, columns=names)
    samples = ds.__getitems__(list(range(90)))
    for key, rows in stream.items():
        got = [s[key] for s in samples]
        for g, w in zip(got, rows, strict=True):
            if isinstance(w, torch.Tensor):
                assert isinstance(g, torch.Tensor)
                assert torch.equal(g, w), key
            else:
                assert g == w, key


def test_one_sample_and_batched_lookups_read_each_row_group_once(written: Written) -> None:
    url, _ = written
    ds = shardkit.torch.MapDataset(url, columns=["id", "img"])
    assert len(ds) == 90
    assert int(ds[-1]["id"]) == 89
    assert int(ds[np.int32(4)]["id"]) == 4
    assert int(ds[torch.tensor(5)]["id"]) == 5
    got = ds.__getitems__([70, 8, 71, 9, 70])
    assert [int(s["id"]) for s in got] == [70, 8, 71, 9, 70]
    assert ds.rows().stats["row_groups_read"] == 4  # rows 84-89 (-1), 0-6 (4, 5), 7-13 (8, 9), 70-76 (70, 71)
    assert [int(s["id"]) for s in ds] == list(range(90))  # Python's sequence protocol ends at IndexError


def test_transform_gets_the_numpy_sample(written: Written) -> None:
    url, columns = written

    def fn(sample: dict[str, Any]) -> dict[str, Any]:
        assert isinstance(sample["img"], np.ndarray)
        return {"id": int(sample["id"]), "null": sample["maybe"] is None, "mean": float(sample["img"].mean())}

    ds = shardkit.torch.MapDataset(url, columns=["id", "img", "maybe"], transform=fn)
    assert ds[7] == {"id": 7, "null": True, "mean": float(columns["img"][7].mean())}
    assert ds[8]["null"] is False


def test_pickled_and_spawned_workers_open_their_own(tmp_path: Path, written: Written) -> None:
    url, _ = written
    ds = shardkit.torch.MapDataset(shardkit.open_dataset(url), columns=["id"])
    ds[0]  # opened and a row group kept here: none of it travels
    copy = pickle.loads(pickle.dumps(ds))
    assert int(copy[20]["id"]) == 20
    loader = DataLoader(ds, batch_size=10, sampler=[3, 2, 1, 60], num_workers=1,
                        multiprocessing_context="spawn")
    assert next(iter(loader))["id"].tolist() == [3, 2, 1, 60]


def test_a_table_keeps_its_deleted_rows_out_in_workers(tmp_path: Path) -> None:
    import deltalake  # noqa: F401  (installed by [dev]: a missing one is a broken install, not a skip)

    from tests.dataset.tables import DeltaHistory, add_deletion_vector, read_ids

    history = DeltaHistory(tmp_path / "t", deletion_vectors=True)
    history.apply(("append", 60))
    add_deletion_vector(history)
    stream = read_ids(history.url)
    ds = shardkit.torch.MapDataset(shardkit.open_dataset(history.url), columns=["id"])
    assert len(ds) == len(stream)
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    assert [int(i) for b in loader for i in b["id"]] == stream


def test_a_filter_keeps_the_readers_rows(written: Written) -> None:
    import pyarrow.compute as pc

    url, _ = written
    for filter in ([("label", "<", 2)], (pc.field("label") == 3) & (pc.field("id") > 40)):
        with shardkit.make_reader(url, columns=["id"], filter=filter, shuffle=False, batch_size=90,
                                  remainder="uneven") as reader:
            want = [int(i) for batch in reader for i in batch["id"]]
        ds = shardkit.torch.MapDataset(url, columns=["id"], filter=filter)
        assert len(ds) == len(want)
        assert [int(s["id"]) for s in ds.__getitems__(list(range(len(ds))))] == want
        assert int(ds[-1]["id"]) == want[-1]
        # positions: the dataset's rows behind the MapDataset's indices (for a sampler's weights)
        assert take(ds.rows().dataset, ds.positions, columns=["id"])["id"].tolist() == want
        copy = pickle.loads(pickle.dumps(ds))
        assert int(copy[0]["id"]) == want[0]
        with pytest.raises(RowIndexError, match=r"match filter .*label.* \(of its 90 rows\)"):
            ds[len(want)]
    assert "filter=" in repr(ds)
    assert shardkit.torch.MapDataset(url, columns=["id"]).positions.tolist() == list(range(90))
    nothing = shardkit.torch.MapDataset(url, columns=["id"], filter=[("label", ">", 100)])
    assert len(nothing) == 0
    with pytest.raises(ReaderError, match="does not apply"):
        shardkit.torch.MapDataset(url, filter=[("nope", "=", 1)])


@pytest.mark.parametrize(("index", "error", "words"), [
    (90, RowIndexError, "row index 90"),
    (-91, RowIndexError, "out of range"),
    (1.0, RowIndexTypeError, "MapDataset[1.0] (float)"),
    (True, RowIndexTypeError, "not an integer"),
    (torch.tensor(1.0), RowIndexTypeError, "not an integer"),
])
def test_bad_indices(written: Written, index: Any, error: type[Exception], words: str) -> None:
    ds = shardkit.torch.MapDataset(written[0], columns=["id"])
    with pytest.raises(error) as raised:
        ds[index]
    assert words in str(raised.value)
    assert repr(written[0]) in str(raised.value)


def test_bad_arguments(written: Written) -> None:
    url = written[0]
    with pytest.raises(ReaderError, match="unknown column"):
        shardkit.torch.MapDataset(url, columns=["nope"])
    with pytest.raises(ReaderError, match="variable='rows'"):
        shardkit.torch.MapDataset(url, collate=Collate(variable="pad"))
    with pytest.raises(ReaderError, match="not callable"):
        shardkit.torch.MapDataset(url, transform="resize")  # type: ignore[arg-type]
    with pytest.raises(ReaderError, match="open already"):
        shardkit.torch.MapDataset(shardkit.open_dataset(url), version=1)


def test_a_remote_dataset_is_looked_up_through_the_disk_cache(s3_server: S3Server, s3_bucket: str,
                                                              tmp_path: Path) -> None:
    """From an object store, a row group's asked columns are fetched once into the reader's disk cache:
    another MapDataset (another DataLoader worker, the next run) and a reader of the same columns find
    them there, with no request for the data files."""
    from shardkit.reader._cache import CacheConfig

    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    shardkit.write_dataset({"id": np.arange(200), "x": np.arange(200) * 0.5}, url, storage_options=opts,
                           row_group_size=50, progress=False)
    data_files = rf"/{s3_bucket}/ds/part-[^/?]*\.parquet"
    cache = CacheConfig(str(tmp_path / "cache"), 1 << 30)
    first = shardkit.torch.MapDataset(url, columns=["id"], storage_options=opts, cache=cache)
    assert [int(s["id"]) for s in first.__getitems__([150, 3, 77, 160])] == [150, 3, 77, 160]
    assert first.cache_stats["misses"] == 3  # row groups 0, 1 and 3, each fetched once
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 3

    start = s3_server.mark()
    again = shardkit.torch.MapDataset(url, columns=["id"], storage_options=opts, cache=cache)
    assert [int(s["id"]) for s in again.__getitems__([77, 3, 199 - 49])] == [77, 3, 150]
    assert again.cache_stats == {"hits": 3, "misses": 0, "evictions": 0, "corrupt": 0}
    assert s3_server.count_gets(data_files, since=start) == 0, s3_server.requests(since=start)

    with shardkit.make_reader(url, columns=["id"], shuffle=False, storage_options=opts, cache=cache,
                              batch_size=50) as reader:
        ids = [int(i) for batch in reader for i in batch["id"]]
    assert ids == list(range(200))
    # the reader found the MapDataset's 3 entries (the same keys) and added the fourth row group's only
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 4
    uncached = shardkit.torch.MapDataset(url, columns=["id"], storage_options=opts, cache=None)
    assert int(uncached[-1]["id"]) == 199
    assert uncached.cache_stats["misses"] == 0


def test_decode_false_gives_image_bytes_to_the_sampler_and_the_transform(written: Written) -> None:
    """``decode=False``: an image field's sample is its stored PNG bytes, what the stream with
    ``decode=False`` gives for that row; the default collate keeps them as a list."""
    url, _ = written
    with shardkit.make_reader(url, columns=["id", "img"], shuffle=False, batch_size=90, remainder="uneven",
                              decode=False) as reader:
        stream = next(iter(reader))
    ds = shardkit.torch.MapDataset(url, columns=["id", "img"], decode=False)
    batch = next(iter(DataLoader(ds, batch_size=5, sampler=[8, 3, 3, 60, 89], num_workers=2)))
    assert batch["id"].tolist() == [8, 3, 3, 60, 89]
    assert batch["img"] == [stream["img"][i] for i in (8, 3, 3, 60, 89)]
    assert batch["img"][0][:4] == b"\x89PNG"
    sizes = shardkit.torch.MapDataset(url, columns=["img"], decode={"img": False},
                                      transform=lambda sample: len(sample["img"]))
    assert sizes[8] == len(stream["img"][8])
    with pytest.raises(ReaderError, match=r"decode=\{'id': False\}: 'id' is a"):
        shardkit.torch.MapDataset(url, columns=["id"], decode={"id": False})


def test_a_remote_file_replaced_under_lookups_is_named_not_read(s3_server: S3Server, s3_bucket: str,
                                                                  tmp_path: Path) -> None:
    """A data file replaced (another ETag) after this process first read it: a lookup in a row group not
    cached yet raises `DatasetChangedError` naming the file and both versions; the row groups cached
    under the old version are still served (they are that version's rows)."""
    import s3fs

    from shardkit.errors import DatasetChangedError

    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options
    ds = shardkit.write_dataset({"id": np.arange(200)}, url, storage_options=opts, row_group_size=50,
                                progress=False)
    other = shardkit.write_dataset({"id": np.arange(1000, 1130)}, f"s3://{s3_bucket}/other",
                                   storage_options=opts, row_group_size=20, progress=False)
    src = shardkit.torch.MapDataset(url, columns=["id"], storage_options=opts, cache=tmp_path / "cache")
    assert int(src[3]["id"]) == 3  # the file's version is learned here
    fs = s3fs.S3FileSystem(**opts)
    fs.copy(f"{s3_bucket}/other/{other.row_groups[0].file}", f"{s3_bucket}/ds/{ds.row_groups[0].file}")
    assert int(src[7]["id"]) == 7  # row group 0: cached, the old version's rows
    assert ds.row_groups[2].file == ds.row_groups[0].file  # one file of 4 row groups
    words = (rf"data file .*{ds.row_groups[0].file}.* was replaced after this process first read it \(its "
             r"version was ETag=.*, it is now ETag=.*\).*Open the dataset again")
    with pytest.raises(DatasetChangedError, match=words):
        src[120]


def test_forked_workers_decode_images_after_the_main_process_did(written: Written) -> None:
    """Images decoded in the main process first (a peek at the samples) start the image decoder's threads
    there; forked workers decode in threads of their own: the parent's pool, copied into a child without
    its threads, would take their tasks and never run them."""
    url, columns = written
    ds = shardkit.torch.MapDataset(url, columns=["id", "img"])
    rows = list(range(90))
    peeked = ds.__getitems__(rows)  # 90 images: more than one slice of the decoder's pool
    loader = DataLoader(ds, batch_size=90, sampler=rows, num_workers=1, multiprocessing_context="fork",
                        timeout=60, collate_fn=list)
    samples = next(iter(loader))
    for got, seen, i in zip(samples, peeked, rows, strict=True):
        np.testing.assert_array_equal(got["img"].numpy(), columns["img"][i])
        np.testing.assert_array_equal(got["img"].numpy(), seen["img"].numpy())
