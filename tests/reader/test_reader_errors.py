"""Bad input to the reader: each raises a `ReaderError` (or a dataset error) that names what is wrong."""

from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.errors import CorruptDatasetError, DatasetNotFoundError, ReaderError, StorageOptionsError
from shardkit.reader._plan import Remainder
from tests.reader.datasets import ids_of, substitutes, with_substitutes, write_ids, write_layout


@pytest.fixture(scope="module")
def ids_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", 200, row_group_size=23)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"shard": 2, "num_shards": 2}, ["shard=2", "num_shards=2", "rank"]),
        ({"shard": 5, "num_shards": 3}, ["shard=5", "[0, num_shards=3)"]),
        ({"shard": -1, "num_shards": 3}, ["shard=-1"]),
        ({"shard": 0, "num_shards": 0}, ["num_shards=0", "positive"]),
        ({"shard": 0, "num_shards": -2}, ["num_shards=-2"]),
        ({"shard": 1.0, "num_shards": 2}, ["shard=1.0", "int"]),
        ({"batch_size": -4}, ["batch_size=-4", ">= 1"]),
        ({"batch_size": 0}, ["batch_size=0"]),
        ({"seed": -1}, ["seed=-1", ">= 0"]),
        ({"workers": -1}, ["workers=-1"]),
        ({"workers": 0}, ["workers=0"]),
        ({"prefetch": -1}, ["prefetch=-1", ">= 0"]),
        ({"num_epochs": 0}, ["num_epochs=0"]),
        ({"shuffle_buffer": 0}, ["shuffle_buffer=0"]),
        ({"remainder": "even"}, ["remainder='even'", "'drop'", "'uneven'"]),
        ({"on_error": "ignore"}, ["on_error='ignore'", "'skip'"]),
        ({"shard": 0, "num_shards": 201}, ["num_shards=201", "200 samples", "fewer shards"]),
        ({"shard": 1, "num_shards": 4, "batch_size": 51, "drop_last": True},
         ["shard 1 of 4", "50 samples", "batch_size=51", "drop_last=True"]),
        ({"shard": 0, "num_shards": 3, "filter": pc.field("id") < 0},
         ["no samples matching the filter (id < 0)", "none of its 200 rows match", "check the filter"]),
        ({"shard": 0, "num_shards": 21, "filter": pc.field("id") < 20},
         ["num_shards=21", "20 samples", "matching the filter (id < 20)", "fewer shards"]),
        ({"columns": ["id", "nope"]}, ["unknown column", "'nope'", "'label'"]),
        ({"columns": "id"}, ["columns='id'", "list"]),
        ({"columns": []}, ["columns=[]"]),
        ({"columns": ["id", "label", "id"]}, ["columns=['id', 'label', 'id']", "['id'] more than once"]),
        ({"shuffle": "no"}, ["shuffle='no'", "True or False"]),
        ({"drop_last": 1}, ["drop_last=1", "True or False"]),
        ({"quick_start": "yes"}, ["quick_start='yes'", "True or False"]),
        ({"filter": pc.field("nope") > 1}, ["nope", "does not apply", "'label'"]),
        ({"filter": [("nope", "=", 1)]}, ["nope"]),
        ({"filter": pc.field("label") == "three"}, ["label", "does not apply", "type"]),
        ({"filter": [("group", ">", 3)]}, ["group", "does not apply"]),
        ({"filter": 5}, ["filter=5", "tuples"]),
        ({"filter": [("label", "<")]}, ["tuples"]),
    ],
)
def test_bad_arguments(ids_ds: str, kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ReaderError) as info:
        shardkit.make_reader(ids_ds, **kwargs)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"filter": pc.field("id") < 5}, {"shard": 1, "num_shards": 4}, {"columns": ["label"]}],
)
def test_an_empty_dataset_says_it_has_0_rows(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    """Writing 0 rows succeeds; reading them is a `ReaderError` (as in Petastorm: training on nothing is a
    bug upstream) that says the dataset is empty, whatever the filter or the shards, and not that a
    filter matched nothing or that there are more shards than samples."""
    url = str(tmp_path / "empty")
    schema = shardkit.Schema([shardkit.Field("id", "int64"), shardkit.Field("label", "str")])
    written = shardkit.write_dataset({"id": np.zeros(0, np.int64), "label": []}, url, schema=schema)
    assert written.num_rows == 0
    with pytest.raises(ReaderError) as info:
        shardkit.make_reader(url, **kwargs)
    message = str(info.value)
    for needle in [repr(url), "has 0 rows", "dataset itself is empty", "write it again with rows"]:
        assert needle in message, (needle, message)
    for wrong in ["matching", "num_shards", "samples"]:
        assert wrong not in message, (wrong, message)


def test_numpy_integers_are_ints(ids_ds: str) -> None:
    """A rank or size computed with numpy is taken as the int it is."""
    plain = {"shard": 1, "num_shards": 3, "batch_size": 16, "seed": 5, "num_epochs": 2, "shuffle_buffer": 40,
             "workers": 2}
    with shardkit.make_reader(ids_ds, **plain) as a, shardkit.make_reader(
            ids_ds, **{k: np.int32(v) if k == "batch_size" else np.int64(v) for k, v in plain.items()}) as b:
        assert ids_of(a).tolist() == ids_of(b).tolist()
        assert a.state_dict() == b.state_dict()


def test_arguments_are_checked_before_the_dataset_is_opened(tmp_path: Path) -> None:
    with pytest.raises(ReaderError, match="batch_size=0"):
        shardkit.make_reader(tmp_path / "nothing-here", batch_size=0)


def test_nonexistent_url(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="no dataset at") as info:
        shardkit.make_reader(tmp_path / "nothing-here")
    assert "nothing-here" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize(
    "state",
    [
        None,
        "epoch 3",
        [],
        {},
        {"version": 99},
        {"version": 1},
        {"version": 1, "history": "abc"},
    ],
)
def test_load_state_dict_of_garbage(ids_ds: str, state: Any) -> None:
    reader = shardkit.make_reader(ids_ds, batch_size=10)
    with pytest.raises(ReaderError, match="state"):
        reader.load_state_dict(state)


@pytest.mark.parametrize(
    "change",
    [
        {"history": "abc"},
        {"history": [[2]]},
        {"history": [["2", "x"]]},
        {"history": [[2, -1]]},
        {"history": [[0, 3]]},
        {"history": [[2, 1.5]]},
        {"epoch": -1},
        {"epoch": "1"},
        {"epoch": None},
    ],
)
def test_load_state_dict_of_a_damaged_state(ids_ds: str, change: dict[str, Any]) -> None:
    reader = shardkit.make_reader(ids_ds, batch_size=10)
    state = {**reader.state_dict(), **change}
    with pytest.raises(ReaderError):
        reader.load_state_dict(state)
    # the failed load left the reader as it was
    assert reader.epoch == 0
    assert len(ids_of(reader)) == 200


# ---- corrupt data found mid-epoch -------------------------------------------------------------------
def corrupt_column_chunk(url: str, file: str, row_group: int) -> None:
    """Overwrite the first page header of ``row_group``'s first column chunk with garbage (mid-file)."""
    path = os.path.join(url, file)
    chunk = pq.read_metadata(path).row_group(row_group).column(0)
    offset = chunk.dictionary_page_offset or chunk.data_page_offset
    assert 4 < offset < os.path.getsize(path) - 100  # in the middle of the file
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 32)


@pytest.fixture
def corrupt_ds(tmp_path: Path) -> tuple[str, str, int, int]:
    """A 4-file dataset whose second file has a corrupt row group 1: (url, file, its rows, the ids in it)."""
    url = write_ids(tmp_path / "ds", 500, row_group_size=23)
    ds = shardkit.open_dataset(url)
    assert len(ds.files) >= 3
    file = ds.files[1]
    corrupt_column_chunk(url, file, 1)
    i = next(k for k, rg in enumerate(ds.row_groups) if rg.file == file and rg.index == 1)
    return url, file, ds.row_groups[i].num_rows, i


def test_corrupt_row_group_raises_naming_file_and_row_group(corrupt_ds: tuple[str, str, int, int]) -> None:
    url, file, _, _ = corrupt_ds
    delivered: list[int] = []

    def read_all(reader: shardkit.Reader) -> None:
        for batch in reader:
            delivered.append(len(batch["id"]))

    reader = shardkit.make_reader(url, batch_size=10, shuffle=False)  # opens: the index is fine
    with reader, pytest.raises(CorruptDatasetError) as info:
        read_all(reader)
    assert sum(delivered) > 0, "the error should come mid-epoch, after rows were delivered"
    message = str(info.value)
    assert file in message
    assert "row group 1" in message
    assert "on_error='skip'" in message
    assert message.isprintable(), message  # one line (Arrow's Thrift error held a newline and a raw byte)
    assert isinstance(info.value, OSError)


def test_corrupt_row_group_skipped(corrupt_ds: tuple[str, str, int, int]) -> None:
    url, file, rows, index = corrupt_ds
    first = int(sum(shardkit.open_dataset(url).rows_per_group[:index]))
    lost = set(range(first, first + rows))
    readers = [shardkit.make_reader(url, shard=s, num_shards=2, batch_size=10, on_error="skip",
                                    remainder="uneven", shuffle_buffer=40) for s in range(2)]
    with pytest.warns(UserWarning, match=r"skipped 1 corrupt row group.*row group 1 of") as record:
        ids = np.concatenate([ids_of(r) for r in readers])
    assert file in str(record[0].message)
    # every other row once, and as many rows again as were lost (the shards keep their sizes)
    assert set(ids.tolist()) == set(range(500)) - lost
    assert len(ids) == 500
    assert sum(r.stats["repeated_rows"] for r in readers) == rows
    assert sum(r.stats["skipped_row_groups"] for r in readers) >= 1
    assert all(r.epoch == 1 for r in readers)  # the epochs completed

    with shardkit.make_reader(url, batch_size=10, on_error="skip", num_epochs=2, shuffle_buffer=40) as reader:
        for epoch in range(2):
            with pytest.warns(UserWarning, match=f"epoch {epoch}: skipped 1 corrupt"):
                batches = list(reader.iter_epoch())
            assert len(batches) == len(reader)
            ids = ids_of(batches)
            assert set(ids.tolist()) == set(range(500)) - lost
            assert len(ids) == 500
            assert reader.stats["skipped_row_groups"] == epoch + 1  # once per epoch it was met


def test_a_reader_resumed_past_a_skip_yields_what_the_uninterrupted_one_yields(
        corrupt_ds: tuple[str, str, int, int]) -> None:
    """Resumed two batches past the corrupt row group (rows 184..206): the rest is the uninterrupted
    reader's rest, batch for batch (the old reader, unaware of the skip, yielded 16 rows fewer)."""
    url, _, _, _ = corrupt_ds
    kw: dict[str, Any] = {"batch_size": 10, "shuffle": False, "on_error": "skip"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "skipped 1 corrupt row group"
        with shardkit.make_reader(url, **kw) as reader:
            whole = [b["id"].tolist() for b in reader]
    reader = shardkit.make_reader(url, **kw)
    it = iter(reader)
    for _ in range(20):
        next(it)
    state = reader.state_dict()
    assert state["history"] == [[1, 200]]  # positions, as on intact data
    resumed = shardkit.make_reader(url, **kw)
    resumed.load_state_dict(state)
    reader.close()
    assert list(it) == []  # the closed reader's iteration ends (before the end of the epoch: no warning)
    with pytest.warns(UserWarning, match="skipped 1 corrupt row group"):
        rest = [b["id"].tolist() for b in resumed]
    assert rest == whole[20:]
    assert len(whole) == 50
    assert resumed.stats["repeated_rows"] == 7  # the lost rows 200..206 it met itself


@pytest.fixture(scope="module")
def skip_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, set[int]]:
    """The same 3,000 ids twice, in row groups of 400-750 rows (several 256-row slices each): intact,
    and with one row group corrupt. Returns (intact url, corrupt url, the ids of the corrupt group)."""
    base = tmp_path_factory.mktemp("skip")
    sizes = [500, 700, 400, 650, 750]
    intact, broken = write_layout(base / "intact", sizes), write_layout(base / "broken", sizes)
    ds = shardkit.open_dataset(broken)
    k = 3  # the second row group of the second file (mid-file: corrupt_column_chunk's requirement)
    rg = ds.row_groups[k]
    corrupt_column_chunk(broken, rg.file, rg.index)
    first = int(ds.rows_per_group[:k].sum())
    return intact, broken, set(range(first, first + rg.num_rows))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_shards=st.integers(1, 4), shuffle=st.booleans(),
       remainder=st.sampled_from(["drop", "pad", "uneven"]), batch_size=st.sampled_from([64, 100, 333]),
       drop_last=st.booleans(), seed=st.integers(0, 3), shuffle_buffer=st.sampled_from([300, 1000, 5000]))
def test_skipping_a_corrupt_row_group_keeps_every_shard_in_step(
        skip_pair: tuple[str, str, set[int]], num_shards: int, shuffle: bool, remainder: Remainder,
        batch_size: int, drop_last: bool, seed: int, shuffle_buffer: int) -> None:
    """Every shard yields the batches (and sizes) it yields on the intact data, each lost row replaced in
    place by its substitute (`tests.reader.datasets.substitutes`)."""
    intact, broken, lost = skip_pair
    kw: dict[str, Any] = {"num_shards": num_shards, "shuffle": shuffle, "remainder": remainder,
                          "batch_size": batch_size, "drop_last": drop_last, "seed": seed,
                          "shuffle_buffer": shuffle_buffer, "quick_start": False}
    # substitutes are placed by pi: the one-shard reader's pi is the shards' without leads
    order = {k: kw[k] for k in ("shuffle", "seed", "shuffle_buffer", "quick_start")}
    with shardkit.make_reader(intact, **order) as reader:
        table = substitutes(ids_of(reader), lost)
    for shard in range(num_shards):
        with shardkit.make_reader(intact, shard=shard, **kw) as reader:
            want = list(reader)
            assert len(want) == len(reader)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "skipped 1 corrupt row group", when it is met
            with shardkit.make_reader(broken, shard=shard, on_error="skip", **kw) as reader:
                got = list(reader)
                repeated = reader.stats["repeated_rows"]
        assert [len(b["id"]) for b in got] == [len(b["id"]) for b in want]
        wanted = ids_of(want)
        assert repeated == int(np.isin(wanted, list(lost)).sum())
        assert ids_of(got).tolist() == with_substitutes(wanted, table)


def test_a_filter_skips_a_row_group_it_cannot_read(skip_pair: tuple[str, str, set[int]]) -> None:
    """The filter's rows are counted when the reader is made: a row group whose filter column is corrupt
    raises there, naming it, or with on_error="skip" holds no sample (and is counted as skipped)."""
    _, broken, lost = skip_pair
    with pytest.raises(CorruptDatasetError, match=r"row group 1 of .*part-00002\.parquet"):
        shardkit.make_reader(broken, filter=[("id", ">=", 100)])
    with pytest.warns(UserWarning, match="skipped 1 corrupt row group.*counting the rows that match"):
        reader = shardkit.make_reader(broken, filter=[("id", ">=", 100)], on_error="skip", batch_size=64)
    with reader:
        assert reader.stats["skipped_row_groups"] == 1
        assert reader.num_samples == 2900 - len(lost)
        ids = ids_of(reader)
    assert sorted(ids.tolist()) == sorted(set(range(100, 3000)) - lost)
    assert reader.stats["repeated_rows"] == 0


def test_a_shard_that_can_read_none_of_its_rows_still_steps(tmp_path: Path) -> None:
    """A shard whose rows are all lost yields its batches of readable samples of the epoch (there are
    some); only when no sample at all can be read does the reader raise, naming the row group."""
    url = write_layout(tmp_path / "ds", [300, 300, 300], files=1)
    ds = shardkit.open_dataset(url)
    for rg in ds.row_groups[1:]:
        corrupt_column_chunk(url, rg.file, rg.index)
    with shardkit.make_reader(url, shard=0, num_shards=3, shuffle=False, on_error="skip") as reader:
        assert ids_of(reader).tolist() == list(range(300))
    with shardkit.make_reader(url, shard=1, num_shards=3, shuffle=False, on_error="skip",
                              batch_size=64) as reader:
        with pytest.warns(UserWarning, match="skipped 2 corrupt row group"):
            ids = ids_of(reader)
        assert reader.stats["repeated_rows"] == 300
    # positions 300..599 are lost; 750..899 and 0..149 half an epoch on: 750..899 lost too, so those
    # take hashed places (they took row 0, 150 times over)
    assert ids.tolist() == with_substitutes(range(300, 600), substitutes(range(900), range(300, 900)))
    assert ids[150:].tolist() == list(range(150))
    assert max(Counter(ids[:150].tolist()).values()) <= 4  # 150 places over 300 readable rows
    broken = write_layout(tmp_path / "all", [300, 300, 300], files=1)
    with open(os.path.join(broken, "part-00000.parquet"), "r+b") as f:  # every page header
        for k in range(3):
            chunk = pq.read_metadata(f.name).row_group(k).column(0)
            f.seek(chunk.dictionary_page_offset or chunk.data_page_offset)
            f.write(b"\xff" * 32)
    reader = shardkit.make_reader(broken, shard=1, num_shards=3, shuffle=False, on_error="skip")
    with reader, pytest.raises(CorruptDatasetError, match=r"shard 1 of 3.*no sample.*can be read.*row group"):
        list(reader)


def test_truncated_file_raises_naming_file_and_row_group(tmp_path: Path) -> None:
    """A data file cut in the middle of its pages: the row groups still whole in it are read (the
    ``_metadata`` summary says where they are), the first one that is not raises naming the file and row
    group; skipping loses exactly the row groups the cut reached (their place is taken by rows read
    again)."""
    url = write_ids(tmp_path / "ds", 500, row_group_size=23)
    ds = shardkit.open_dataset(url)
    path = os.path.join(url, ds.files[2])
    assert ds.metadata is not None
    ends = {}  # global index of each row group -> where its last column chunk ends
    for k in range(len(ds.row_groups)):
        meta = ds.metadata.row_group(k)
        chunks = [meta.column(j) for j in range(meta.num_columns)]
        ends[k] = max((c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size
                      for c in chunks)
    # half of the pages (what follows them, the page index and the footer, may be most of a small file)
    size = max(end for k, end in ends.items() if ds.row_groups[k].file == ds.files[2]) // 2
    with open(path, "r+b") as f:
        f.truncate(size)
    cut = [(k, rg.index) for k, rg in enumerate(ds.row_groups) if rg.file == ds.files[2] and ends[k] > size]
    assert cut  # (global index, index in the file) of the row groups that reach past the cut
    reader = shardkit.make_reader(url, batch_size=10, shuffle=False)
    with reader, pytest.raises(CorruptDatasetError) as info:
        list(reader)
    assert ds.files[2] in str(info.value)
    assert f"row group {cut[0][1]} of" in str(info.value)
    with shardkit.make_reader(url, batch_size=10, shuffle=False, on_error="skip") as reader:
        with pytest.warns(UserWarning, match="skipped"):
            ids = ids_of(reader)
        lost = sum(ds.row_groups[k].num_rows for k, _ in cut)
        readable = len(set(ids.tolist()))
        assert readable == 500 - lost
        gone = {int(i) for k, _ in cut for i in range(int(ds.rows_per_group[:k].sum()),
                                                        int(ds.rows_per_group[: k + 1].sum()))}
        # the lost rows' places: readable rows half an epoch on
        assert ids.tolist() == with_substitutes(range(500), substitutes(range(500), gone))
        assert reader.stats["repeated_rows"] == lost
        assert reader.stats["skipped_row_groups"] == len(cut)


@pytest.mark.parametrize("name", ["x", "s", "v"])
def test_a_null_in_a_field_that_is_not_nullable_is_corruption(tmp_path: Path, name: str) -> None:
    """A file rewritten outside shardkit with a null in a non-nullable number, text or tensor field: it
    was read as a masked value (None for text; 0 under TensorFlow), unsaid. Now it is a corrupt row,
    which on_error="skip" loses alone."""
    url = os.fspath(tmp_path / "ds")
    shardkit.write_dataset({"id": np.arange(12), "x": np.arange(12, dtype=np.float32),
                            "s": [str(i) for i in range(12)], "v": np.ones((12, 3), np.float32)}, url,
                           row_group_size=6)
    (file,) = shardkit.open_dataset(url).files
    path = os.path.join(url, file)
    table = pq.read_table(path)
    values = table.column(name).to_pylist()
    values[8] = None  # row 2 of row group 1
    column = pa.array(values, type=table.schema.field(name).type)
    table = table.set_column(table.schema.get_field_index(name), name, column)
    pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), path, row_group_size=6)
    os.remove(os.path.join(url, "_metadata"))  # the summary holds the old file's offsets
    shardkit.write_summary(url)

    with pytest.raises(CorruptDatasetError, match=rf"row group 1 of '.*{file}': field '{name}' is not "
                                                  r"nullable but row 2 is null: .*nullable=True\), or read "
                                                  "with on_error='skip'"):
        list(shardkit.make_reader(url, shuffle=False, cache=None, batch_size=4))
    with pytest.warns(UserWarning, match="skipped 1 corrupt row group"):
        batches = list(shardkit.make_reader(url, shuffle=False, cache=None, batch_size=1, on_error="skip"))
    assert 8 not in {int(b["id"][0]) for b in batches}
    assert all(not isinstance(b[name], np.ma.MaskedArray) for b in batches)


@pytest.mark.parametrize("options", ["anon=true", ["anon"], 987654])
def test_storage_options_that_are_not_a_dict_are_named_and_not_shown(ids_ds: str, options: Any) -> None:
    """``storage_options="anon=true"`` raised ``AttributeError: 'str' object has no attribute 'get'``; it is
    a `StorageOptionsError` naming the URL and the type, without the value (it may hold a secret)."""
    for call in (shardkit.open_dataset, shardkit.make_reader):
        with pytest.raises(StorageOptionsError, match=f"is a {type(options).__name__}, not a dict") as e:
            call(ids_ds, storage_options=options)
        assert repr(ids_ds) in str(e.value)
        assert str(options) not in str(e.value)
