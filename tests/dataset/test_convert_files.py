"""`shardkit.dataset.convert` of files that hold no rows, though they are not 0 bytes (`convert_files`):
a newline, whitespace, a compressed empty file, a CSV's header without a newline; and JSON objects
without keys."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import pytest

import shardkit
from shardkit.dataset.convert import convert
from shardkit.errors import NotADatasetError
from tests.dataset.test_convert import read_rows

NO_ROWS = {"newline": b"\n", "newlines": b"\n\r\n\n", "gzip-of-nothing": gzip.compress(b""),
           "gzip-of-a-newline": gzip.compress(b"\n")}  # (a CSV's line of spaces is a header: a column " ")


def data(path: Path, ids: list[int]) -> None:
    if path.name.endswith(".csv"):
        path.write_text("id,x\n" + "".join(f"{i},{i / 2}\n" for i in ids))
    else:
        path.write_text("".join(json.dumps({"id": i, "x": i / 2}) + "\n" for i in ids))


@pytest.mark.parametrize("fmt", ["csv", "json"])
@pytest.mark.parametrize("kind", list(NO_ROWS))
def test_a_part_file_of_no_rows_in_a_folder_is_left_out_as_an_empty_one_is(tmp_path: Path, fmt: str,
                                                                           kind: str) -> None:
    """pyarrow refused them ("Empty JSON stream", "Empty CSV file"), failing the whole folder, where a
    0-byte file was left out: so are these, without a word (they hold no data)."""
    src = tmp_path / "src"
    src.mkdir()
    data(src / f"part-0.{fmt}", [0, 1])
    (src / (f"part-1.{fmt}" + (".gz" if kind.startswith("gzip") else ""))).write_bytes(NO_ROWS[kind])
    data(src / f"part-2.{fmt}", [2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = convert(src, tmp_path / "out")
    assert read_rows(ds.url)[1] == {"id": [0, 1, 2], "x": [0.0, 0.5, 1.0]}


def test_a_csv_header_without_a_newline_in_a_folder_holds_no_rows_and_is_left_out(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    data(src / "part-0.csv", [0])
    (src / "part-1.csv").write_text("id,x")  # a task that wrote its header and no rows, nor a newline
    ds = convert(f"{src}/part-*.csv", tmp_path / "out")  # (a glob pattern's files: the same)
    assert ds.schema["x"] == shardkit.Field("x", "float64")
    assert read_rows(ds.url)[1] == {"id": [0], "x": [0.0]}


def test_a_csv_header_without_a_newline_is_read_as_the_header_it_is(tmp_path: Path) -> None:
    """``a,b`` is what ``a,b\\n`` is: no rows, so its types must be declared; then the dataset is empty."""
    fields = [shardkit.Field("a", "int64"), shardkit.Field("b", "str", nullable=True)]
    for name, text in [("newline", "a,b\n"), ("none", "a,b")]:
        (tmp_path / f"{name}.csv").write_text(text)
        ds = convert(tmp_path / f"{name}.csv", tmp_path / name, schema=fields)
        assert (list(ds.schema), ds.num_rows) == (fields, 0)


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_a_folder_whose_files_hold_no_rows_is_refused_naming_them(tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / f"a.{fmt}").write_bytes(b"\n")
    (src / f"b.{fmt}").write_bytes(b"id" if fmt == "csv" else b"  \n")
    with pytest.raises(NotADatasetError) as info:
        convert(src, tmp_path / "out")
    assert str(info.value).startswith(f"cannot convert {str(src)!r}: its files hold no rows (only "
                                      f"whitespace, or a CSV's header): 'a.{fmt}', 'b.{fmt}'; point at data")
    assert not (tmp_path / "out").exists()


def test_json_objects_without_keys_are_refused_as_no_columns_not_written_as_no_rows(tmp_path: Path) -> None:
    """``{}`` lines were written as a dataset of "0 rows" and no fields, without a word."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a", "b"):
        (src / f"{name}.jsonl").write_text("{}\n{}\n")
    with pytest.raises(NotADatasetError, match=r"it has no columns \(every JSON object in it is \{\}\), so "
                                               r"there is nothing to write; point at data with columns"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
