"""Random access (`shardkit.dataset.take`, `RowAccess`): the rows asked for are exactly the rows of a full
read at those places (every codec, row-group size, a table's deleted rows), and bad indices raise errors
that name the index, the dataset and the fix."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
import shardkit.dataset.write as write_module
from shardkit import Field, ImageCodec, Schema
from shardkit.dataset import RowAccess, take
from shardkit.errors import CorruptDatasetError, ReaderError, RowIndexError, RowIndexTypeError
from tests.dataset.conftest import column_rows
from tests.reader.datasets import write_all_codecs


@pytest.fixture(scope="module")
def codecs(tmp_path_factory: pytest.TempPathFactory) -> tuple[shardkit.Dataset, dict[str, Any]]:
    url, columns = write_all_codecs(tmp_path_factory.mktemp("take") / "all", 90, row_group_size=7)
    return shardkit.open_dataset(url), columns


def _rows(batch: dict[str, Any]) -> dict[str, list[Any]]:
    return {name: column_rows(column) for name, column in batch.items()}


def _assert_same_rows(schema: Schema, helpers: SimpleNamespace, got: dict[str, Any],
                      full: dict[str, list[Any]], positions: list[int]) -> None:
    expected = {name: [full[name][p] for p in positions] for name in got}
    helpers.assert_rows_equal(Schema([schema[n] for n in got]), expected, _rows(got))


IMAGES = [Field("im", "uint8", (3, 4, 3), codec=ImageCodec("png")),
          Field("vim", "uint8", (None, None, 3), codec=ImageCodec("png"), nullable=True)]


@st.composite
def _image(draw: st.DrawFn, field: Field) -> Any:
    if field.nullable and draw(st.integers(0, 3)) == 0:
        return None
    shape = tuple(draw(st.integers(1, 5)) if d is None else d for d in field.shape)
    return np.full(shape, draw(st.integers(0, 255)), dtype=np.uint8)


@given(data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_take_is_the_same_rows_of_a_full_read(tmp_path: Path, strategies: SimpleNamespace,
                                               helpers: SimpleNamespace, data: st.DataObject) -> None:
    drawn = data.draw(strategies.schema(max_fields=3))
    images = data.draw(st.lists(st.sampled_from(IMAGES), max_size=2, unique_by=lambda f: f.name))
    schema = Schema([*drawn, *images])
    n = data.draw(st.integers(1, 30))
    columns = {f.name: data.draw(strategies.column(f, n)) for f in drawn}
    columns |= {f.name: [data.draw(_image(f)) for _ in range(n)] for f in images}
    url = str(tmp_path / f"ds-{uuid.uuid4().hex[:8]}")
    # pages of a few rows, or one per column chunk: a lookup reads the pages that hold its rows (not
    # pages of 1 byte: pyarrow then writes a page of no values before a list's first, and its own
    # read_row_group reads no row of it)
    with mock.patch.object(write_module, "PAGE_BYTES", data.draw(st.sampled_from([64, 512, 1 << 20]))):
        shardkit.write_dataset(columns, url, schema=schema, row_group_size=data.draw(st.integers(1, 12)),
                               progress=False)
    ds = shardkit.open_dataset(url)
    full = helpers.read_all(ds)

    indices = data.draw(st.lists(st.integers(-n, n - 1), max_size=25))
    names = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(schema.names), min_size=1, unique=True)))
    got = take(ds, indices, names)
    assert list(got) == (names or schema.names)
    _assert_same_rows(schema, helpers, got, full, [i % n for i in indices])

    mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    _assert_same_rows(schema, helpers, take(ds, mask), full, [i for i in range(n) if mask[i]])
    bounds = st.one_of(st.none(), st.integers(-n - 2, n + 2))
    cut = slice(data.draw(bounds), data.draw(bounds), data.draw(st.sampled_from([None, 1, 2, -1, -3])))
    _assert_same_rows(schema, helpers, take(ds, cut), full, list(range(n))[cut])


def test_take_gives_what_a_reader_batch_gives(codecs: tuple[shardkit.Dataset, dict[str, Any]]) -> None:
    ds, _ = codecs
    with shardkit.make_reader(ds.url, shuffle=False, batch_size=ds.num_rows, remainder="uneven") as reader:
        stream = next(iter(reader))
    indices = [89, 0, 0, 44, -1, 13, 7, 6]
    got = take(ds, indices)
    assert list(got) == list(stream)
    positions = [i % ds.num_rows for i in indices]
    for name, column in got.items():
        want = stream[name][positions]
        assert type(column) is type(want), name
        assert column.dtype == want.dtype, name
        assert column.shape == want.shape, name
        for g, w in zip(column_rows(column), column_rows(want), strict=True):
            if g is None or w is None:
                assert g is None, name
                assert w is None, name
            else:
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_row_access_reads_each_row_group_once(codecs: tuple[shardkit.Dataset, dict[str, Any]]) -> None:
    ds, columns = codecs
    rows = RowAccess(ds, ["id", "img", "maybe"])
    assert len(rows) == 90
    for i in range(7, 14):  # the second row group, row by row
        sample = rows.row(i)
        assert sample["id"] == i
        np.testing.assert_array_equal(sample["img"], columns["img"][i])
        assert sample["maybe"] is None if i % 7 == 0 else sample["maybe"] == i
    assert rows.in_place == []  # the codecs' images are small and alike: snappy shrinks them
    # (a 7-row group's chunks are a page each: the first lookup's pages are the row group, read and kept)
    assert {k: rows.stats[k] for k in ("row_groups_read", "row_groups_kept_hits", "page_reads")} == \
        {"row_groups_read": 1, "row_groups_kept_hits": 6, "page_reads": 1}
    assert rows.row(-1)["id"] == 89
    unkept = RowAccess(ds, ["id"], cache_bytes=0)  # nothing kept: each lookup reads its pages again
    assert [int(unkept.row(i)["id"]) for i in (1, 2)] == [1, 2]
    assert (unkept.stats["page_reads"], unkept.stats["row_groups_kept_hits"], unkept.kept.nbytes) == (2, 0, 0)


def test_indices_of_every_kind(codecs: tuple[shardkit.Dataset, dict[str, Any]]) -> None:
    import torch

    ds, _ = codecs
    ids = lambda value: take(ds, value, ["id"])["id"].tolist()  # noqa: E731
    assert ids(np.array([3, -2], dtype=np.int8)) == [3, 88]
    assert ids(np.array([5], dtype=np.uint64)) == [5]
    assert ids(torch.tensor([4, 4, 0])) == [4, 4, 0]
    assert ids(range(85, 90, 2)) == [85, 87, 89]
    assert ids(np.int64(-90)) == [0]
    assert ids(7) == [7]
    assert ids([]) == []
    assert ids(np.array([], dtype=np.float64)) == []
    assert ids(slice(None, None, -30)) == [89, 59, 29]
    empty = take(ds, [], ["img", "name"])
    assert empty["img"].shape == (0, 8, 8, 3)
    assert len(empty["name"]) == 0


@pytest.mark.parametrize(("indices", "error", "words"), [
    ([0, 90], RowIndexError, ["row index 90 (indices[1])", "90 rows", "0 to 89", "-90 to -1"]),
    (-91, RowIndexError, ["row index -91", "out of range"]),
    ([1.5], RowIndexTypeError, ["indices[0] = 1.5", "float64", "ints"]),
    ([2.0, 3.0], RowIndexTypeError, ["indices[0]", "astype(np.int64)"]),
    (1.0, RowIndexTypeError, ["row index 1.0 (float)"]),
    (True, RowIndexTypeError, ["is a bool", "90 bools"]),
    ([1, None], RowIndexTypeError, ["indices[1] = None"]),
    ([1, True], RowIndexTypeError, ["indices[1] = True"]),
    ("3", RowIndexTypeError, ["'3' (str)"]),
    ([[1, 2], [3]], RowIndexTypeError, ["ragged or nested"]),
    ([[1, 2], [3, 4]], RowIndexTypeError, ["shape (2, 2)", "flatten"]),
    ([True] * 89, RowIndexError, ["boolean mask of 89 values", "90 rows", "np.flatnonzero(mask)"]),
    (slice(0, 1.5), RowIndexTypeError, ["slice(0, 1.5, None)"]),
])
def test_bad_indices_say_what_and_how(codecs: tuple[shardkit.Dataset, dict[str, Any]], indices: Any,
                                      error: type[Exception], words: list[str]) -> None:
    ds, _ = codecs
    with pytest.raises(error) as raised:
        take(ds, indices)
    message = str(raised.value)
    assert repr(ds.url) in message
    for word in words:
        assert word in message
    assert isinstance(raised.value, IndexError)  # Python's own kind of error, for `except IndexError`
    if error is RowIndexTypeError:
        assert isinstance(raised.value, TypeError)


def test_a_row_is_one_integer(codecs: tuple[shardkit.Dataset, dict[str, Any]]) -> None:
    rows = RowAccess(codecs[0], ["id"])
    for bad in (1.0, True, [1], "1"):
        with pytest.raises(RowIndexTypeError, match="not an integer"):
            rows.row(bad)
    with pytest.raises(RowIndexError, match="out of range"):
        rows.row(90)


@pytest.mark.parametrize(("columns", "words"), [
    (["nope"], "unknown column(s) ['nope']"),
    (["id", "id"], "more than once"),
    ([], "reads nothing"),
    ("id", "columns=['id']"),
])
def test_bad_columns(codecs: tuple[shardkit.Dataset, dict[str, Any]], columns: Any, words: str) -> None:
    with pytest.raises(ReaderError) as raised:
        take(codecs[0], [0], columns)
    assert words in str(raised.value)


def test_an_empty_dataset_has_no_row(tmp_path: Path) -> None:
    url = str(tmp_path / "empty")
    shardkit.write_dataset({"id": np.zeros(0, np.int64)}, url, progress=False)
    ds = shardkit.open_dataset(url)
    assert take(ds, [])["id"].tolist() == []
    with pytest.raises(RowIndexError, match="has no rows"):
        take(ds, [0])


def test_a_delta_table_with_deleted_rows(tmp_path: Path) -> None:
    import deltalake  # noqa: F401  (installed by [dev]: a missing one is a broken install, not a skip)

    from tests.dataset.tables import DeltaHistory, add_deletion_vector, read_ids

    history = DeltaHistory(tmp_path / "t", deletion_vectors=True)
    history.apply(("append", 100))
    history.apply(("append", 40))
    deleted = add_deletion_vector(history)
    history.apply(("append", 10))
    ds = shardkit.open_dataset(history.url)
    assert ds.kept, "the table's log deletes rows of a file"
    stream = read_ids(history.url)
    assert len(stream) == ds.num_rows == 150 - len(deleted)
    assert take(ds, slice(None), ["id"])["id"].tolist() == stream
    rng = np.random.default_rng(0)
    picks = rng.integers(-len(stream), len(stream), 60)
    assert take(ds, picks, ["id"])["id"].tolist() == [stream[i] for i in picks]
    assert not deleted & set(take(ds, np.ones(ds.num_rows, bool), ["id"])["id"].tolist())



def test_a_dataset_is_a_sequence_of_its_rows(codecs: tuple[shardkit.Dataset, dict[str, Any]]) -> None:
    """``len(ds)``, ``ds[i]`` (one sample), ``ds[indices]`` / ``ds[a:b]`` and ``ds.take`` (batches): the
    same rows as `take`; ``for row in ds`` ends at the last row, as a sequence's loop does."""
    ds, _ = codecs
    assert len(ds) == ds.num_rows == 90
    whole = take(ds, [7, -1])
    for i, index in enumerate((7, -1)):
        sample = ds[index]
        assert sample.keys() == whole.keys()
        for name, values in whole.items():
            if sample[name] is None:  # a null: masked in a batch
                assert np.ma.is_masked(values[i]), name
            else:
                assert np.array_equal(np.asarray(sample[name]), np.asarray(values[i])), name
    assert ds[[3, 3, 0]]["id"].tolist() == [3, 3, 0]
    assert ds[80:83]["id"].tolist() == [80, 81, 82]
    assert list(ds.take([5], ["id"])) == ["id"]
    assert ds.take([5], ["id"])["id"].tolist() == [5]
    assert [int(row["id"]) for row in ds] == list(range(90))
    with pytest.raises(RowIndexError, match="out of range"):
        ds[90]
    with pytest.raises(RowIndexTypeError):
        ds[1.5]


@pytest.fixture(scope="module")
def noise(tmp_path_factory: pytest.TempPathFactory) -> tuple[shardkit.Dataset, dict[str, Any]]:
    """JPEGs of noise (stored as they are: snappy would not shrink them), 7 rows a row group."""
    rng = np.random.default_rng(5)
    n = 40
    images = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(n)]
    columns = {"id": np.arange(n), "im": images, "label": rng.integers(0, 10, n)}
    schema = Schema([Field("id", "int64", ()), Field("im", "uint8", (64, 64, 3), codec=ImageCodec("jpeg")),
                     Field("label", "int64", ())])
    url = str(tmp_path_factory.mktemp("take-noise") / "noise")
    shardkit.write_dataset(columns, url, schema=schema, row_group_size=7, progress=False)
    ds = shardkit.open_dataset(url)
    with shardkit.make_reader(url, shuffle=False, batch_size=n, remainder="uneven") as reader:
        return ds, next(iter(reader))


@given(indices=st.lists(st.integers(-40, 39), max_size=30), names=st.sampled_from(
    [["im"], ["id", "im"], ["im", "label", "id"], None]))
@settings(max_examples=40, deadline=None)
def test_images_stored_as_they_are_are_read_in_place(noise: tuple[shardkit.Dataset, dict[str, Any]],
                                                     indices: list[int], names: list[str] | None) -> None:
    """An image column stored as it is: a lookup copies only its rows' bytes from the file (and checks
    their pages' checksums), the same values a full read decodes; the other columns' row groups are
    read whole."""
    ds, stream = noise
    rows = RowAccess(ds, names)
    assert rows.in_place == ["im"]
    got = rows.take(indices)
    assert list(got) == (names or ds.schema.names)
    for name, column in got.items():
        np.testing.assert_array_equal(column, stream[name][[i % 40 for i in indices]], err_msg=name)
    groups = {(i % 40) // 7 for i in indices}
    assert rows.stats["values_read_in_place"] == sum(len({i % 40 for i in indices if (i % 40) // 7 == g})
                                                      for g in groups)
    assert rows.stats["row_groups_read"] == (len(groups) if len(names or ds.schema.names) > 1 else 0)
    assert 0 < rows.stats["pages_checked"] <= len(groups) if indices else rows.stats["pages_checked"] == 0


def test_a_damaged_image_page_fails_only_the_lookups_of_its_rows(tmp_path: Path) -> None:
    """A byte changed in one image's page: a lookup of a row on that page raises, naming the row group,
    the column and the page; rows of the other row groups are still read (their pages check out)."""
    rng = np.random.default_rng(2)
    url = str(tmp_path / "ds")
    schema = Schema([Field("id", "int64", ()), Field("im", "uint8", (64, 64, 3), codec=ImageCodec("jpeg"))])
    shardkit.write_dataset({"id": np.arange(21), "im": [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
                                                        for _ in range(21)]},
                           url, schema=schema, row_group_size=7, progress=False)
    ds = shardkit.open_dataset(url)
    path, layout = ds.value_pages(1, "im")  # type: ignore[misc]
    with open(path, "r+b") as f:  # a byte in the middle of row 9's JPEG (row 2 of row group 1)
        f.seek(int(layout.starts[2] + layout.lengths[2] // 2))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    rows = RowAccess(shardkit.open_dataset(url), ["id", "im"])
    assert rows.take([0, 20])["id"].tolist() == [0, 20]
    with pytest.raises(CorruptDatasetError, match=r"row group 1 of .* fails its page checksums: column 'im': "
                       r"the page at byte \d+ does not match its checksum"):
        rows.take([9])


@pytest.mark.parametrize("fixture", ["noise", "codecs"])
def test_decode_false_gives_the_stored_bytes_a_reader_gives(request: pytest.FixtureRequest,
                                                            fixture: str) -> None:
    """``decode=False`` (or per field) leaves image fields as their JPEG/PNG bytes: those a reader with
    ``decode=False`` gives, read in place (noise) or through Parquet (codecs); other fields decoded."""
    ds, _ = request.getfixturevalue(fixture)
    images = [f.name for f in ds.schema if f.codec.name == "image"]
    with shardkit.make_reader(ds.url, shuffle=False, batch_size=ds.num_rows, remainder="uneven",
                              decode=False) as reader:
        stream = next(iter(reader))
    indices = [5, -1, 0, 5, 13]
    positions = [i % ds.num_rows for i in indices]
    for decode in (False, dict.fromkeys(images, False)):
        got = take(ds, indices, decode=decode)
        assert list(got) == ds.schema.names
        for name in images:
            assert got[name].dtype == object
            assert list(got[name]) == [stream[name][p] for p in positions]
            assert all(v is None or v[:2] in (b"\xff\xd8", b"\x89P") for v in got[name])
        for name in set(ds.schema.names) - set(images):
            for g, w in zip(column_rows(got[name]), column_rows(stream[name][positions]), strict=True):
                assert (g is None) == (w is None), name
                if g is not None:
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    assert ds.take([0], decode=False)[images[0]][0] == stream[images[0]][0]
    with pytest.raises(ReaderError, match=r"decode=\{'id': False\}: 'id' is a .* field, and only image"):
        take(ds, [0], decode={"id": False})
    with pytest.raises(ReaderError, match="decode= names 'nope', which is not a column read"):
        take(ds, [0], decode={"nope": False})
