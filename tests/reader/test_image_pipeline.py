"""Images shuffled as encoded bytes and decoded per batch (`shardkit.reader._pipeline.spill`, `decode`), with
per-sample transforms: every sample exactly once per epoch, the same pixels as decoding before the shuffle,
the same transformed sample on resume and on another number of shards, and nothing left on disk."""

from __future__ import annotations

import atexit
import io
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import shardkit
from shardkit import Field, ImageCodec, Schema
from shardkit.errors import CorruptDatasetError, ReaderError

N = 240
_DATASETS: dict[tuple[str, int, str], tuple[str, list[bytes]]] = {}
_ROOT = tempfile.mkdtemp(prefix="shardkit-test-images-")  # the datasets the tests share (hypothesis)
atexit.register(shutil.rmtree, _ROOT, True)


def jpeg_dataset(fmt: str, row_group_size: int, compression: str = "auto") -> tuple[str, list[bytes]]:
    """``N`` rows of id, label and a 16x16 image written as its encoded bytes; the bytes by id. Images
    stored as they are (uncompressed: ``"auto"`` leaves JPEGs so when snappy barely shrinks them) are read
    in place, compressed ones through the spill."""
    key = (fmt, row_group_size, compression)
    if key not in _DATASETS:
        rng = np.random.default_rng(row_group_size)
        blobs = []
        for _ in range(N):
            pixels = rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, fmt.upper())
            blobs.append(out.getvalue())
        url = os.path.join(_ROOT, f"{fmt}-{row_group_size}-{compression}")
        schema = Schema([Field("id", "int64"), Field("label", "int64"),
                         Field("image", "uint8", (16, 16, 3), codec=ImageCodec(fmt))])  # type: ignore[arg-type]
        shardkit.write_dataset({"id": np.arange(N), "label": np.arange(N) % 7, "image": blobs}, url,
                               schema=schema, row_group_size=row_group_size, compression=compression)
        _DATASETS[key] = (url, blobs)
    return _DATASETS[key]


def pixels_of(blob: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(blob)) as im:
        return np.asarray(im.convert("RGB"))


def crop_and_flip(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """A random 8x8 crop, flipped half the time, and a random number: a seeded augmentation."""
    y, x = rng.integers(0, 9, 2)
    image = sample["image"][y : y + 8, x : x + 8]
    if rng.random() < 0.5:
        image = image[:, ::-1]
    return {"id": sample["id"], "image": np.ascontiguousarray(image), "noise": rng.random()}


def read_all(url: str, **kw: Any) -> list[dict[str, np.ndarray]]:
    with shardkit.make_reader(url, **kw) as reader:
        return list(reader)


def by_id(batches: list[dict[str, np.ndarray]]) -> dict[int, tuple[np.ndarray, ...]]:
    out: dict[int, tuple[np.ndarray, ...]] = {}
    for b in batches:
        for i, sample_id in enumerate(b["id"].tolist()):
            assert sample_id not in out, f"sample {sample_id} read twice"
            out[sample_id] = tuple(b[k][i] for k in sorted(b) if k != "id")
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(["jpeg", "png"]), row_group_size=st.sampled_from([17, 60, 240]),
       num_shards=st.integers(1, 4), batch_size=st.integers(1, 50),
       window=st.sampled_from([None, 1, 37, 500]), seed=st.integers(0, 3), shuffle=st.booleans(),
       compression=st.sampled_from(["auto", "none", "zstd"]))
def test_late_decoding_reads_every_sample_once_with_its_own_pixels(
        fmt: str, row_group_size: int, num_shards: int, batch_size: int, window: int | None, seed: int,
        shuffle: bool, compression: str) -> None:
    url, blobs = jpeg_dataset(fmt, row_group_size, compression)
    seen: list[int] = []
    for shard in range(num_shards):
        batches = read_all(url, shard=shard, num_shards=num_shards, batch_size=batch_size, seed=seed,
                           shuffle=shuffle, shuffle_buffer=window, remainder="pad")
        for b in batches:
            assert b["image"].dtype == np.uint8
            assert b["image"].shape[1:] == (16, 16, 3)
            for sample_id, image in zip(b["id"].tolist(), b["image"], strict=True):
                assert np.array_equal(image, pixels_of(blobs[sample_id])), sample_id
            seen.extend(b["id"].tolist())
    # pad repeats fewer than num_shards samples; every sample comes, and only the padding twice
    assert set(seen) == set(range(N))
    assert len(seen) - N < num_shards


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row_group_size=st.sampled_from([17, 60]), shards_before=st.integers(1, 3),
       shards_after=st.integers(1, 4), cut=st.integers(0, 6), batch_size=st.integers(4, 30),
       seed=st.integers(0, 2))
def test_a_transformed_epoch_resumes_on_any_number_of_shards_with_the_same_samples(
        row_group_size: int, shards_before: int, shards_after: int, cut: int, batch_size: int, seed: int
) -> None:
    url, _ = jpeg_dataset("jpeg", row_group_size)
    kw: dict[str, Any] = {"batch_size": batch_size, "seed": seed, "transform": crop_and_flip}
    whole = by_id(read_all(url, **kw))  # one shard, uninterrupted: each sample's transformed values
    assert len(whole) == N
    got: list[dict[str, np.ndarray]] = []
    states = []
    for shard in range(shards_before):
        with shardkit.make_reader(url, shard=shard, num_shards=shards_before, **kw) as reader:
            it = iter(reader)
            for _ in range(cut):
                batch = next(it, None)
                if batch is None:
                    break
                got.append(batch)
            states.append(reader.state_dict())
    for shard in range(shards_after if states[0]["epoch"] == 0 else 0):  # else: the cut ended the epoch
        with shardkit.make_reader(url, shard=shard, num_shards=shards_after, **kw) as reader:
            reader.load_state_dict(states[0])
            got.extend(reader.iter_epoch())
    resumed = by_id(got)  # raises on a sample read twice
    # remainder="drop" leaves out fewer than num_shards samples per stage
    assert N - len(resumed) < shards_before + shards_after
    for sample_id, values in resumed.items():
        for a, b in zip(values, whole[sample_id], strict=True):
            assert np.array_equal(a, b), f"sample {sample_id} transformed differently"


@pytest.mark.timeout(120)
def test_encoded_bytes_come_as_written(tmp_path: Path) -> None:
    url, blobs = jpeg_dataset("jpeg", 60)
    batches = read_all(url, batch_size=32, decode=False, seed=1)
    for b in batches:
        assert b["image"].dtype == object
        assert all(b["image"][i] == blobs[k] for i, k in enumerate(b["id"].tolist()))
    assert sorted(k for b in batches for k in b["id"].tolist()) == list(range(N))
    # through DataLoader workers (the bytes cross in each batch's shared-memory block): the same bytes
    torch = pytest.importorskip("torch")
    from shardkit.torch import ShardkitIterableDataset

    loader = torch.utils.data.DataLoader(ShardkitIterableDataset(url, batch_size=32, decode=False, seed=1),
                                         batch_size=None, num_workers=2)
    got = {k: image for b in loader for k, image in zip(b["id"].tolist(), b["image"], strict=True)}
    assert N - len(got) < 2  # two workers: remainder="drop" leaves out at most one sample
    assert all(image == blobs[k] for k, image in got.items())
    with pytest.raises(ReaderError, match=r"decode=\{'label': False\}: 'label' is a scalar field"):
        shardkit.make_reader(url, decode={"label": False})
    with pytest.raises(ReaderError, match=r"decode= names 'nope', which is not a column read"):
        shardkit.make_reader(url, decode={"nope": False})


def test_the_shuffle_reaches_the_whole_dataset_and_leaves_nothing_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", os.fspath(tmp_path))
    tempfile.tempdir = None  # read TMPDIR again
    try:
        url, _ = jpeg_dataset("jpeg", 17, "zstd")  # compressed: its images go through the spill
        with shardkit.make_reader(url, batch_size=24, seed=0) as reader:
            reach = reader.shuffle_reach
            assert reach["window_rows"] == N
            assert reach["late_fields"] == ["image"]
            assert reach["window_memory_bytes"] == N * (8 + 8 + 16)
            batches = list(reader)
            assert reader.shuffle_reach["spilled_bytes"] > 0
            groups = [len(set((b["id"] // 17).tolist())) for b in batches]
            assert np.mean(groups) > 8  # 15 row groups, 24 rows a batch: uniformly ~12.5
            assert os.listdir(tmp_path)  # the spill folder, while the reader is open
        assert not os.listdir(tmp_path)
    finally:
        tempfile.tempdir = None


def test_an_image_that_does_not_decode_is_named(tmp_path: Path) -> None:
    schema = Schema([Field("id", "int64"), Field("image", "uint8", (16, 16, 3), codec=ImageCodec("jpeg"))])
    _, blobs = jpeg_dataset("jpeg", 60)
    url = os.fspath(tmp_path / "broken")
    shardkit.write_dataset({"id": np.arange(50), "image": blobs[:50]}, url, schema=schema, row_group_size=20,
                           file_size=10**9)
    (file,) = shardkit.open_dataset(url).files
    table = pq.read_table(os.path.join(url, file))
    images = table.column("image").to_pylist()
    images[33] = images[33][: len(images[33]) // 2]  # truncated, as a bad copy leaves it: its header whole
    table = table.set_column(1, table.schema.field(1), pa.array(images, table.schema.field(1).type))
    pq.write_table(table, os.path.join(url, file), row_group_size=20)
    os.remove(os.path.join(url, "_metadata"))
    shardkit.write_summary(url)
    with pytest.raises(CorruptDatasetError, match=r"row group 1 of .*, row 13: field 'image'"), \
            shardkit.make_reader(url, batch_size=10, seed=0) as reader:
        list(reader)


@pytest.mark.timeout(120)
def test_transform_workers_give_what_the_reading_process_gives() -> None:
    url, _ = jpeg_dataset("jpeg", 60)
    kw: dict[str, Any] = {"batch_size": 32, "seed": 5, "transform": crop_and_flip}
    here = read_all(url, **kw)
    there = read_all(url, transform_workers=2, **kw)
    assert [b["id"].tolist() for b in here] == [b["id"].tolist() for b in there]
    for a, b in zip(here, there, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert np.array_equal(a[k], b[k]), k


@pytest.mark.timeout(180)
def test_dataloader_workers_transform_each_sample_as_one_reader_does() -> None:
    torch = pytest.importorskip("torch")
    from shardkit.torch import ShardkitIterableDataset

    url, _ = jpeg_dataset("jpeg", 17)
    kw: dict[str, Any] = {"batch_size": 16, "seed": 3, "transform": crop_and_flip}
    whole = by_id(read_all(url, **kw))
    loader = torch.utils.data.DataLoader(ShardkitIterableDataset(url, **kw), batch_size=None, num_workers=2)
    got = by_id([{k: v.numpy() for k, v in b.items()} for b in loader])
    assert len(whole) - len(got) < 2  # two workers: remainder="drop" leaves out at most one sample
    for sample_id, values in got.items():
        for a, b in zip(values, whole[sample_id], strict=True):
            assert np.array_equal(a, b), sample_id


@pytest.mark.timeout(180)
def test_worker_batches_kept_past_the_shared_segments_keep_their_own_pixels() -> None:
    """Every batch held (more than a worker's segments): those made in a segment stay as they were, the
    rest are made and sent another way, and every sample is the one a reader gives."""
    torch = pytest.importorskip("torch")
    from shardkit.reader.adapters.torch_workers import _Segments
    from shardkit.torch import ShardkitIterableDataset

    url, _ = jpeg_dataset("jpeg", 40)
    kw: dict[str, Any] = {"batch_size": 2, "seed": 5, "transform": crop_and_flip}
    whole = by_id(read_all(url, **kw))
    loader = torch.utils.data.DataLoader(ShardkitIterableDataset(url, **kw), batch_size=None, num_workers=2)
    held = list(loader)
    assert len(held) > 2 * _Segments.MAX_SEGMENTS
    got = by_id([{k: v.numpy() for k, v in b.items()} for b in held])
    assert got.keys() == whole.keys()
    for sample_id, values in got.items():
        for a, b in zip(values, whole[sample_id], strict=True):
            assert np.array_equal(a, b), sample_id


def test_a_transformed_batch_made_in_a_worker_segment_crosses_without_a_copy() -> None:
    """In a DataLoader worker the transform writes each batch into one of the worker's shared-memory
    segments, and the batch goes to the main process from there: no second segment, no copy."""
    torch = pytest.importorskip("torch")
    from multiprocessing.reduction import ForkingPickler

    from shardkit.reader.adapters import torch_workers
    from shardkit.reader.adapters.torch_workers import _own_segments, _WorkerBatch

    url, _ = jpeg_dataset("jpeg", 17)
    own = _own_segments()
    try:
        _sent_where_made(url, own, ForkingPickler, _WorkerBatch, torch)
    finally:  # this process played the worker and the main process: let go of both sides' segments
        with torch_workers._MAPPED_LOCK:
            for key in [k for k in torch_workers._MAPPED if k[0] == own.token]:
                del torch_workers._MAPPED[key]
        torch_workers._OWN.pop(os.getpid(), None)


def _sent_where_made(url: str, own: Any, pickler: Any, worker_batch: Any, torch: Any) -> None:
    with shardkit.make_reader(url, batch_size=8, seed=3, transform=crop_and_flip) as reader:
        reader._set_output_memory(own.batch_memory)
        for batch in reader:
            tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
            at = tensors["image"].data_ptr()
            (serial,) = [n for n, (start, size, free) in own.made.items()
                         if free.alive and start <= at < start + size]
            out = pickle.loads(pickler.dumps(worker_batch(tensors)))
            assert serial not in own.made  # sent from where it was made: the main process frees it
            for key, value in tensors.items():
                assert torch.equal(out[key], value)
            assert out["image"].data_ptr() != tensors["image"].data_ptr()  # the main process's mapping
            del out, tensors, batch
    assert len(own.segments) <= 3  # the batch out, the one the reader made ahead, and one more


def test_images_stored_as_they_are_are_read_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncompressed images of a local file: the handles point into the file, nothing is spilled; a file
    with the values compressed is spilled."""
    plain, _ = jpeg_dataset("jpeg", 60, "none")
    packed, _ = jpeg_dataset("jpeg", 60, "zstd")
    for url, spilled in ((plain, False), (packed, True)):
        with shardkit.make_reader(url, batch_size=32, seed=0) as reader:
            assert len(list(reader)) == -(-N // 32)
            assert (reader.shuffle_reach["spilled_bytes"] > 0) is spilled


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.arrow"))


@pytest.mark.parametrize("linked", [True, False])
def test_images_read_from_the_cache_are_not_copied_into_the_spill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linked: bool) -> None:
    """A warm cache's entries are memory-mapped Arrow files: a window's images stay in them (each entry
    hard-linked into the spill's folder) instead of being copied there, and a batch still gets its bytes
    after the entries were evicted (by another process) meanwhile. Where a link cannot be made (the
    cache on another filesystem), they are copied as before."""
    import errno

    url, blobs = jpeg_dataset("jpeg", 60, "zstd")  # compressed: not read in place, but through the cache
    cache = tmp_path / "cache"
    read_all(url, batch_size=32, seed=0, cache=str(cache))  # fills it
    assert len(_entries(cache)) == 4
    if not linked:
        def no_link(src: str, dst: str) -> None:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(os, "link", no_link)
    # no quick start: the first batch waits for the whole window, all four entries linked by then
    with shardkit.make_reader(url, batch_size=32, seed=0, cache=str(cache), quick_start=False) as reader:
        it = iter(reader)
        batches = [next(it)]
        assert reader._spill is not None
        links = [f for f in Path(reader._spill.folder).glob("*.bin") if f.stat().st_nlink == 2]
        assert len(links) == (4 if linked else 0)  # the window's four entries
        for entry in _entries(cache):
            entry.unlink()
        batches += list(it)
        assert (reader.shuffle_reach["spilled_bytes"] == 0) is linked
        assert reader._source.cache is not None
        assert reader._source.cache.stats["hits"] == 4
    got = by_id(batches)
    assert sorted(got) == list(range(N))
    for i, (image, _label) in got.items():
        np.testing.assert_array_equal(image, pixels_of(blobs[i]))


def test_a_cache_entry_replaced_since_it_was_mapped_is_copied_not_linked(tmp_path: Path) -> None:
    """The spill links an entry only if the file at its path is still the one mapped (its inode): bytes
    of another version are never taken for the mapped ones."""
    from shardkit.reader._cache import CacheConfig, RowGroupCache
    from shardkit.reader._pipeline.spill import Spill, handles_to_bytes

    cache = RowGroupCache(CacheConfig(str(tmp_path / "cache"), 1 << 30))
    cache.put("k", pa.table({"image": pa.array([b"one", b"two", None, b"three"], pa.binary())}))
    table = cache.get("k")
    assert table is not None
    mapped = cache.entry_of(table)
    assert mapped is not None
    assert mapped.offset_of(table.column("image").chunks[0].buffers()[2]) is not None
    spill = Spill(str(tmp_path))
    try:
        handles = spill.put(table.column("image"), spill.segment, mapped=mapped)
        assert spill.bytes_written == 0
        assert handles_to_bytes(spill.reader, handles).tolist() == [b"one", b"two", None, b"three"]
        cache.put("k", pa.table({"image": pa.array([b"uno", b"dos", b"", b"tres"], pa.binary())}))  # replaced
        window = spill.next_segment()
        again = spill.put(table.column("image"), window, rows=np.array([0, 3]), mapped=mapped)
        assert spill.bytes_written == len(b"one") + len(b"three")  # copied from the mapping, not linked
        assert handles_to_bytes(spill.reader, again).tolist() == [b"one", b"three"]
        assert cache.entry_of(pa.table({"x": [1]})) is None
    finally:
        spill.close()


def _varying_crop(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    side = int(rng.integers(4, 17))
    return {"id": sample["id"], "image": sample["image"][:side, :side]}


def test_a_transform_must_give_one_shape_unless_the_field_is_variable() -> None:
    from shardkit.errors import TransformError

    url, _ = jpeg_dataset("jpeg", 60)
    with pytest.raises(TransformError, match=r"'image'.*variable=\{'image'\}"), \
            shardkit.make_reader(url, batch_size=32, seed=0, transform=_varying_crop) as reader:
        list(reader)
    kw: dict[str, Any] = {"batch_size": 32, "seed": 0, "transform": _varying_crop}
    with shardkit.make_reader(url, variable=["image"], **kw) as reader:
        assert reader.schema["image"].shape == (None, None, None)
        batches = list(reader)
    sides = {im.shape[0] for b in batches for im in b["image"]}
    assert len(sides) > 1
    assert all(b["image"].dtype == object for b in batches)


def test_a_transform_for_worker_processes_must_pickle() -> None:
    url, _ = jpeg_dataset("jpeg", 60)
    with pytest.raises(ReaderError, match=r"transform=.*cannot be sent to transform worker processes.*top "
                                          r"level of a module"):
        shardkit.make_reader(url, transform=lambda sample: sample, transform_workers=2)


@pytest.mark.timeout(180)
def test_a_reader_with_transform_workers_resumes_on_another_number_of_them() -> None:
    url, _ = jpeg_dataset("jpeg", 60)
    kw: dict[str, Any] = {"batch_size": 16, "seed": 4, "transform": crop_and_flip}
    whole = by_id(read_all(url, **kw))
    with shardkit.make_reader(url, transform_workers=2, **kw) as reader:
        it = iter(reader)
        first = [next(it) for _ in range(5)]
        state = reader.state_dict()  # batches the stage made ahead are not counted: they were not delivered
    with shardkit.make_reader(url, transform_workers=1, **kw) as reader:
        reader.load_state_dict(state)
        rest = list(reader.iter_epoch())
    got = by_id(first + rest)  # raises on a sample read twice
    assert got.keys() == whole.keys()
    for sample_id, values in got.items():
        for a, b in zip(values, whole[sample_id], strict=True):
            assert np.array_equal(a, b), sample_id


def test_a_spill_folder_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    from shardkit.reader._pipeline.spill import Spill

    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    with pytest.raises(ReaderError, match=r"under '.*a-file'.*point TMPDIR at a writable local folder"):
        Spill(os.fspath(not_a_folder))


def test_the_spill_lets_go_of_windows_as_their_batches_go_out() -> None:
    url, _ = jpeg_dataset("jpeg", 17, "zstd")  # compressed: spilled
    with shardkit.make_reader(url, batch_size=8, seed=0, shuffle_buffer=20, prefetch=2) as reader:
        held = []
        for _ in reader:
            assert reader._spill is not None
            held.append(len(os.listdir(reader._spill.folder)))
        # 12 windows of 20 rows, 2 tasks read ahead: the files of a few windows at a time
        assert max(held) <= 4
        assert len(os.listdir(reader._spill.folder)) == 0  # the pass is over


def test_a_window_whose_file_segment_was_numbered_late_keeps_the_next_windows_segments(
        tmp_path: Path) -> None:
    """A local file read in place becomes a segment when a reading thread first gets to it, which may be
    after the next window took its number: letting go of the first window's segments must not take
    the next window's, whose number is lower (a race seen in CI: a later batch's file was gone)."""
    from shardkit.reader._pipeline.spill import SEGMENT_BITS, Spill, handles_to_bytes

    source = tmp_path / "values.bin"
    source.write_bytes(b"first window's bytes")
    spill = Spill(str(tmp_path))
    try:
        first = spill.next_segment()
        second = spill.next_segment()  # read ahead: the next window numbered before the first's file
        later = spill.put(pa.array([b"second window's bytes"], pa.binary()), second)
        k = spill.external(os.fspath(source), first)
        assert k > second
        earlier = np.array([[(k << SEGMENT_BITS) + 0, 5]], np.int64)  # "first" in the file
        assert spill.oldest_window(earlier) == first
        assert spill.oldest_window(later) == second
        spill.release_before(spill.oldest_window(earlier))  # the first window's batch goes out
        assert handles_to_bytes(spill.reader, later).tolist() == [b"second window's bytes"]
        assert handles_to_bytes(spill.reader, earlier).tolist() == [b"first"]
        spill.release_before(spill.oldest_window(later))  # the second's: the first window's go
        assert sorted(os.listdir(spill.folder)) == [f"{second}.bin"]
        assert handles_to_bytes(spill.reader, later).tolist() == [b"second window's bytes"]
    finally:
        spill.close()


def _one_image_a_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: int | None = None,
                      row_group_size: int = N) -> str:
    """The 240 JPEGs written uncompressed (read in place) with a page per image, and the image of row
    ``damaged`` with a byte changed in the file (its page's checksum no longer matches)."""
    import shardkit.dataset.write as writing

    monkeypatch.setattr(writing, "PAGE_BYTES", 1)
    _, blobs = jpeg_dataset("jpeg", 240, "none")
    url = os.fspath(tmp_path / "paged")
    schema = Schema([Field("id", "int64"), Field("image", "uint8", (16, 16, 3), codec=ImageCodec("jpeg"))])
    shardkit.write_dataset({"id": np.arange(N), "image": blobs}, url, schema=schema,
                           row_group_size=row_group_size, compression="none", file_size=10**9)
    if damaged is not None:
        ds = shardkit.open_dataset(url)
        path, layout = ds.value_pages(damaged // row_group_size, "image")
        assert len(layout.crcs) == row_group_size
        damaged %= row_group_size
        with open(path, "r+b") as f:
            at = int(layout.starts[damaged]) + len(blobs[damaged]) // 2
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    return url


def test_pages_read_in_place_are_checked_as_their_batches_are_read(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A page of images read in place is checked when a batch first reads one of its values: the first
    batch does not wait for the pages of every row group its shuffle window draws from, and over the
    epoch each page is checked once."""
    from shardkit.dataset import PageChecks

    url = _one_image_a_page(tmp_path, monkeypatch)
    checked: list[int] = []
    check = PageChecks.check

    def counted(self: PageChecks, read: Any, offsets: np.ndarray) -> int:
        checked.append(check(self, read, offsets))
        return checked[-1]

    monkeypatch.setattr(PageChecks, "check", counted)
    with shardkit.make_reader(url, batch_size=8, seed=1, prefetch=2) as reader:
        batches = iter(reader)
        first = next(batches)
        assert 8 <= sum(checked) < N / 2, sum(checked)  # this batch's pages and those read ahead
        ids = first["id"].tolist() + [i for b in batches for i in b["id"].tolist()]
    assert sorted(ids) == list(range(N))
    assert sum(checked) == N  # every page once


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transform_workers", [0, 2])
def test_a_damaged_page_read_in_place_stops_the_read_before_its_image_is_decoded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transform_workers: int) -> None:
    """A byte changed in one image's page: the batches before it come whole, and the batch that reads it
    fails naming the row group, the column and the page, in the reading process or in a transform worker
    (which checks the pages from the copy of their checksums beside the spill)."""
    url = _one_image_a_page(tmp_path, monkeypatch, damaged=100)
    kw: dict[str, Any] = {"batch_size": 8, "seed": 2}
    if transform_workers:
        kw.update(transform=crop_and_flip, transform_workers=transform_workers)
    seen: list[int] = []

    def read() -> None:
        with shardkit.make_reader(url, **kw) as reader:
            for batch in reader:
                seen.extend(batch["id"].tolist())

    with pytest.raises(CorruptDatasetError, match=r"row group 0 of .* fails its page checksums: column "
                                                  r"'image': the page at byte \d+ does not match"):
        read()
    assert 100 not in seen
    assert len(seen) < N


def test_with_on_error_skip_a_damaged_page_leaves_its_row_group_out_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_error="skip"`` with the images read in place as their bytes: a row group's pages are all checked
    at its first rows, so a damaged page leaves out the whole row group (the rows in place of lost ones
    are chosen from whole row groups), whichever batch meets it first."""
    url = _one_image_a_page(tmp_path, monkeypatch, damaged=100, row_group_size=60)
    ids: list[int] = []
    with shardkit.make_reader(url, batch_size=8, seed=4, decode=False, on_error="skip") as reader:
        with pytest.warns(UserWarning, match=r"skipped 1 corrupt row group.*'image': the page at byte"):
            ids.extend(i for b in reader for i in b["id"].tolist())
        assert reader.stats["skipped_row_groups"] == 1
        assert reader.shuffle_reach["late_fields"] == ["image"]  # read in place, late
    assert not set(ids) & set(range(60, 120))
    assert set(ids) == set(range(60)) | set(range(120, N))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.one_of(st.none(), st.integers(0, 9000)), min_size=1, max_size=24),
       picks=st.one_of(st.none(), st.lists(st.integers(0, 10**6), max_size=30)),
       each_bytes=st.sampled_from([0, 4096, 1 << 30]))
def test_values_read_from_the_spill_are_the_values_put_however_they_are_read(
        sizes: list[int | None], picks: list[int] | None, each_bytes: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Any values (nulls, empty ones, small and large) put in the spill come back as they were, in any
    order and with repeats (or none: no rows; or all, in order: one run), whether runs of them are read at
    once and sliced or each by a read of its own (`SpillReader.read_each`), and as `read`'s one buffer."""
    from shardkit.reader._pipeline import spill as spilling

    monkeypatch.setattr(spilling, "EACH_BYTES", each_bytes)
    values = [None if n is None else bytes((i * 31 + k) % 251 for k in range(n)) for i, n in enumerate(sizes)]
    rows = list(range(len(values))) if picks is None else [p % len(values) for p in picks]
    with tempfile.TemporaryDirectory() as folder:
        spill = spilling.Spill(folder)
        try:
            handles = spill.put(pa.array(values, pa.binary()), spill.segment)[rows]
            want = [values[r] for r in rows]
            assert spill.reader.read_each(handles) == want
            assert spilling.handles_to_bytes(spill.reader, handles).tolist() == want
            data, starts, ends = spill.reader.read(handles)
            got = [None if b < 0 else data[a:b].tobytes() for a, b in zip(starts, ends, strict=True)]
            assert got == want
        finally:
            spill.close()


@pytest.mark.parametrize("each_bytes", [0, 1 << 30])
def test_a_damaged_page_stops_a_read_of_encoded_bytes_before_its_value_is_handed_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, each_bytes: int) -> None:
    """``decode=False`` reads the values of a page in place as they are, each by a read of its own or
    sliced from a run: either way the page is checked first, and its batch fails naming it."""
    from shardkit.reader._pipeline import spill as spilling

    monkeypatch.setattr(spilling, "EACH_BYTES", each_bytes)
    url = _one_image_a_page(tmp_path, monkeypatch, damaged=100)
    seen: list[int] = []

    def read() -> None:
        with shardkit.make_reader(url, batch_size=8, seed=2, decode=False) as reader:
            for batch in reader:
                seen.extend(batch["id"].tolist())

    with pytest.raises(CorruptDatasetError, match=r"fails its page checksums: column 'image'"):
        read()
    assert 100 not in seen
    assert len(seen) < N
