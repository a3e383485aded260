"""`shardkit.dataset.convert` of JSON-lines sources: times with UTC offsets, and files of a folder that are
not its data (a ``schema.json``, a ``metadata.json``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.dataset.convert import _sources as convert_sources
from shardkit.dataset.convert import convert
from shardkit.errors import NotADatasetError, SchemaMismatchError, TimeZoneWarning
from tests.dataset.test_convert import read_rows


def lines(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def test_json_times_with_utc_offsets_warn_as_a_csvs_do_and_keep_each_instant(tmp_path: Path) -> None:
    """pyarrow's JSON parser turned ``+02:00`` into UTC without a word (its CSV parser types the column
    ``tz=UTC``, which warned): now the same `TimeZoneWarning` names the column and the offsets seen."""
    times = ["2024-05-01T10:00:00+02:00", "2024-05-01T10:00:00Z", "2024-05-01 10:00:00-0530", None,
             "2024-05-01T10:00:00+00:00"]
    (tmp_path / "t.jsonl").write_text(lines([{"id": i, "t": t} for i, t in enumerate(times)]))
    with pytest.warns(TimeZoneWarning) as caught:
        ds = convert(tmp_path / "t.jsonl", tmp_path / "out")
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(f"{str(tmp_path / 't.jsonl')!r}: column 't' holds times with the time zones "
                              "'+02:00' and 'UTC' and '-05:30': they are written as UTC wall times, "
                              "datetime64[s] without a zone")
    assert ds.schema["t"] == shardkit.Field("t", "datetime64[s]", nullable=True)
    got = ds.decode(ds.read_row_group(0))["t"]
    want = np.array(["2024-05-01T08:00:00", "2024-05-01T10:00:00", "2024-05-01T15:30:00", "NaT",
                     "2024-05-01T10:00:00"], "datetime64[s]")
    np.testing.assert_array_equal(np.ma.getdata(got)[[0, 1, 2, 4]], want[[0, 1, 2, 4]])
    assert np.ma.getmaskarray(got).tolist() == [False, False, False, True, False]


def test_json_times_without_offsets_are_kept_as_they_are_and_warn_nothing(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(lines([{"t": "2024-05-01T10:00:00"}, {"t": "2024-05-02"}]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = convert(tmp_path / "t.jsonl", tmp_path / "out", schema=[shardkit.Field("t", "datetime64[ms]")])
    assert ds.decode(ds.read_row_group(0))["t"].tolist() == np.array(
        ["2024-05-01T10:00:00", "2024-05-02T00:00:00"], "datetime64[ms]").tolist()


def test_json_offsets_first_seen_past_the_first_block_warn_when_seen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON file's times are parsed block by block, with and without offsets: one first seen further
    down is warned of then (a declared unit too, with a fraction of a second)."""
    monkeypatch.setattr(convert_sources, "BLOCK_BYTES", 256)
    rows = [{"id": i, "t": f"2024-05-01T10:00:{i:02}.5"} for i in range(20)]
    rows += [{"id": 20, "t": "2024-05-01T10:00:20.25+01:00"}, {"id": 21, "t": "2024-05-01T10:00:21Z"}]
    (tmp_path / "t.jsonl").write_text(lines(rows))
    declared = [shardkit.Field("t", "datetime64[ms]")]
    with pytest.warns(TimeZoneWarning, match=r"column 't' holds times with the time zones '\+01:00' and "
                                             r"'UTC'"):
        ds = convert(tmp_path / "t.jsonl", tmp_path / "out", schema=declared)
    got = read_rows(ds.url)[1]["t"]
    assert got[19] == np.datetime64("2024-05-01T10:00:19.500", "ms")
    assert got[20:] == [np.datetime64("2024-05-01T09:00:20.250", "ms"),
                        np.datetime64("2024-05-01T10:00:21", "ms")]


def test_a_json_time_that_is_no_time_names_the_row_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(lines([{"t": "2024-05-01T10:00:00+02:00"}, {"t": "soon"}]))
    with pytest.raises(SchemaMismatchError, match=r"cannot read it past source row 0 \(.*soon.*\); fix the "):
        convert(tmp_path / "t.jsonl", tmp_path / "out", schema=[shardkit.Field("t", "datetime64[s]")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("other", [
    '{"rows": 2, "source": "export"}\n',  # a metadata file: one row of other keys
    '{\n  "fields": [\n    {"name": "id", "dtype": "int64"}\n  ]\n}\n',  # a schema, as inspect --json prints
])
def test_a_json_file_of_other_columns_among_json_data_is_refused_naming_the_groups(tmp_path: Path,
                                                                                   other: str) -> None:
    """It was read as one more row, null in every data column (and made each data column nullable)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (src / f"part-{i}.json").write_text(lines([{"id": 2 * i + r, "x": "a"} for r in range(2)]))
    (src / "meta.json").write_text(other)
    with pytest.raises(SchemaMismatchError) as info:
        convert(src, tmp_path / "out")
    assert str(info.value).startswith(f"cannot convert {str(src)!r}: its files fall into 2 groups that share "
                                      "no column: 'meta.json' with the column(s) ")
    assert "; 'part-0.json', 'part-1.json' with the column(s) 'id', 'x'; " in str(info.value)
    assert "start its name with '_'" in str(info.value)
    assert not (tmp_path / "out").exists()
    (src / "meta.json").rename(src / "_meta.json")  # as the message says: left out, as Spark leaves it
    ds = convert(src, tmp_path / "out")
    assert ds.schema["id"] == shardkit.Field("id", "int64")
    assert read_rows(ds.url)[1] == {"id": [0, 1, 2, 3], "x": ["a"] * 4}


def test_a_folders_files_that_share_columns_through_others_are_one_dataset(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name, row in [("a", {"id": 0, "x": 1}), ("b", {"x": 2, "y": 3}), ("c", {"y": 4, "z": 5})]:
        (src / f"{name}.json").write_text(lines([row]))
    assert sorted(convert(src, tmp_path / "out").schema.names) == ["id", "x", "y", "z"]


def test_a_json_array_among_json_lines_names_the_file_and_how_to_leave_it_out(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "part-0.json").write_text(lines([{"id": 0}]))
    (src / "schema.json").write_text('[{"name": "id", "dtype": "int64"}]\n')
    with pytest.raises(NotADatasetError, match=r"schema\.json.*\); check that it holds data.*, or if it "
                                               r"holds none \(a schema, metadata\), move it out of the "
                                               r"folder or start its name with '_'"):
        convert(src, tmp_path / "out")
