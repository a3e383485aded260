"""`shardkit.dataset.convert` keeps every digit of a CSV's or JSON file's integers (`convert_integers`):
a column with one past int64 is uint64 where every value fits, else refused; a file's integers in a column
the other files make float are checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.dataset.convert import _sources as convert_sources
from shardkit.dataset.convert import convert
from shardkit.errors import SchemaMismatchError
from tests.dataset.test_convert import read_rows

BIG = 18446744073709551615  # uint64's last value: past int64, so pyarrow typed the column float64
EXACT = 9007199254740993  # 2**53 + 1: the first integer float64 rounds (to 9007199254740992)


def write(rows: list[dict[str, Any]], path: Path) -> Path:
    """``rows`` as a CSV (None: an empty value) or JSON-lines file, as its suffix says, with every digit."""
    if path.suffix == ".csv":
        names = list(rows[0])
        path.write_text(",".join(names) + "\n" + "".join(
            ",".join("" if row[n] is None else str(row[n]) for n in names) + "\n" for row in rows))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_integers_past_int64_are_uint64_with_every_digit_and_other_columns_as_they_were(
        tmp_path: Path, suffix: str) -> None:
    """The column was float64: 9007199254740993 became 9007199254740992 without a word. Now it is uint64,
    as pandas reads it; int64 columns (19-digit IDs too) stay int64, floats with fractions float64."""
    rows = [{"id": i, "big": big, "small": small, "score": score, "snowflake": 1234567890123456789 + i}
            for i, (big, small, score) in enumerate([(EXACT, EXACT, 0.1), (BIG, -5, 1.5), (None, 7, 1e20),
                                                     (0, 0, -2.25)])]
    ds = convert(write(rows, tmp_path / f"big{suffix}"), tmp_path / "out")
    assert list(ds.schema) == [shardkit.Field("id", "int64"), shardkit.Field("big", "uint64", nullable=True),
                               shardkit.Field("small", "int64"), shardkit.Field("score", "float64"),
                               shardkit.Field("snowflake", "int64")]
    got = read_rows(ds.url)[1]
    assert got["big"] == [EXACT, BIG, None, 0]
    assert got["small"] == [EXACT, -5, 7, 0]
    assert got["score"] == [0.1, 1.5, 1e20, -2.25]
    assert got["snowflake"] == [1234567890123456789 + i for i in range(4)]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
@pytest.mark.parametrize(("values", "said"), [
    ([1, 99999999999999999999], "column 'big' holds the integer 99999999999999999999 (source row 1), which "
                                "no 64-bit integer type holds (int64 ends at 9223372036854775807, uint64 at "
                                f"{BIG}), and float64 rounds integers past 2**53; "),
    ([-1, EXACT, BIG], f"column 'big' holds the integer {BIG} (source row 2), past int64 (which ends at "
                       "9223372036854775807), and -1 (source row 0), which uint64 cannot hold: no 64-bit "
                       "integer type holds both, and float64 rounds integers past 2**53; "),
], ids=["past-uint64", "negative-and-past-int64"])
def test_integers_no_64_bit_type_holds_are_refused_naming_the_column_value_row_and_fix(
        tmp_path: Path, suffix: str, values: list[int], said: str) -> None:
    src = write([{"id": i, "big": v} for i, v in enumerate(values)], tmp_path / f"big{suffix}")
    with pytest.raises(SchemaMismatchError) as info:
        convert(src, tmp_path / "out")
    assert str(info.value).startswith(f"{str(src)!r}: {said}declare the column's type in schema= (shardkit "
                                      "write --schema): Field('big', 'str')")
    assert str(info.value).endswith(", or 'float64' to round")
    assert not (tmp_path / "out").exists()
    if suffix == ".csv":  # as the message says: every digit kept as text
        ds = convert(src, tmp_path / "out", schema=[shardkit.Field("big", "str")])
        assert read_rows(ds.url)[1]["big"] == [str(v) for v in values]
    else:  # (pyarrow reads no JSON number as text: the message says to write them as strings)
        assert "values written as JSON strings" in str(info.value)
        ds = convert(src, tmp_path / "out", schema=[shardkit.Field("big", "float64")])
        assert read_rows(ds.url)[1]["big"] == [float(v) for v in values]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_folders_int64_file_and_uint64_file_make_one_uint64_column(tmp_path: Path, suffix: str) -> None:
    (tmp_path / "src").mkdir()
    write([{"id": 0, "n": EXACT}, {"id": 1, "n": 3}], tmp_path / "src" / f"a{suffix}")
    write([{"id": 2, "n": BIG}], tmp_path / "src" / f"b{suffix}")
    ds = convert(tmp_path / "src", tmp_path / "out")
    assert ds.schema["n"] == shardkit.Field("n", "uint64")
    assert read_rows(ds.url)[1]["n"] == [EXACT, 3, BIG]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_value_past_uint64_in_a_later_file_names_the_file_its_row_and_the_source_row(
        tmp_path: Path, suffix: str) -> None:
    (tmp_path / "src").mkdir()
    write([{"id": i, "n": i} for i in range(3)], tmp_path / "src" / f"a{suffix}")
    write([{"id": 3, "n": 1}, {"id": 4, "n": 10**20}], tmp_path / "src" / f"b{suffix}")
    with pytest.raises(SchemaMismatchError, match=rf"column 'n' holds the integer {10**20} \(row 1 of "
                                                  rf"'b{suffix}' \(source row 4\)\), which no 64-bit"):
        convert(tmp_path / "src", tmp_path / "out")


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_files_integers_that_other_files_make_float_keep_every_digit_or_are_refused(
        tmp_path: Path, suffix: str) -> None:
    """A CSV's or JSON file's int64 column, widened to float64 by another file's fractions, was parsed as
    float64 at once (9007199254740993 became 9007199254740992); Parquet's failed with Arrow's words."""
    (tmp_path / "src").mkdir()

    def put(rows: list[dict[str, Any]], name: str) -> None:
        if suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(rows), tmp_path / "src" / f"{name}.parquet")
        else:
            write(rows, tmp_path / "src" / f"{name}{suffix}")

    put([{"id": 0, "x": 1.5}], "a")
    put([{"id": 1, "x": 2**53}, {"id": 2, "x": -(2**60)}, {"id": 3, "x": 3}], "b")  # float64 holds these
    ds = convert(tmp_path / "src", tmp_path / "out")
    assert ds.schema["x"] == shardkit.Field("x", "float64")
    assert read_rows(ds.url)[1]["x"] == [1.5, 2.0**53, -(2.0**60), 3.0]
    put([{"id": 4, "x": 5}, {"id": 5, "x": EXACT}], "c")
    with pytest.raises(SchemaMismatchError) as info:
        convert(tmp_path / "src", tmp_path / "out2")
    assert str(info.value).startswith(
        f"{str(tmp_path / 'src')!r}: column 'x' is float64 in the other files, but holds integers here; "
        f"float64 cannot hold {EXACT} (row 1 of 'c{suffix}' (source row 5)) exactly, it would be "
        f"{EXACT - 1}; declare the column's type in schema= (shardkit write --schema): Field('x', 'str')")
    assert not (tmp_path / "out2").exists()
    ds = convert(tmp_path / "src", tmp_path / "out2", schema=[shardkit.Field("x", "float64")])  # as it says
    assert read_rows(ds.url)[1]["x"][-1] == float(EXACT)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_files_uint64_column_that_other_files_make_float_is_refused(tmp_path: Path, suffix: str) -> None:
    (tmp_path / "src").mkdir()
    write([{"id": 0, "n": 1.5}], tmp_path / "src" / f"a{suffix}")
    write([{"id": 1, "n": 7}, {"id": 2, "n": BIG}], tmp_path / "src" / f"b{suffix}")
    with pytest.raises(SchemaMismatchError, match=rf"column 'n' is float64 in the other files, but holds "
                                                  rf"integers here; float64 cannot hold {BIG} \(row 1 of "
                                                  rf"'b{suffix}' \(source row 2\)\) exactly, it would be "
                                                  rf"{BIG + 1}; declare"):
        convert(tmp_path / "src", tmp_path / "out")


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_file_whose_integers_turn_to_fractions_past_its_first_block_is_read_as_floats(
        tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its integers are read as such (to check each digit), its fractions further down as the other files'
    floats, from the row they start at, as it was read before."""
    monkeypatch.setattr(convert_sources, "BLOCK_BYTES", 256)
    (tmp_path / "src").mkdir()
    write([{"id": 0, "x": 0.5}], tmp_path / "src" / f"a{suffix}")
    rows = [{"id": i, "x": i} for i in range(1, 100)] + [{"id": 100, "x": 2.25}]
    write(rows, tmp_path / "src" / f"b{suffix}")
    ds = convert(tmp_path / "src", tmp_path / "out")
    assert read_rows(ds.url)[1]["x"] == [0.5, *map(float, range(1, 100)), 2.25]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_an_integer_past_int64_after_the_first_block_names_the_fix(tmp_path: Path, suffix: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The first block types the column int64: a later value past it fails, saying to declare uint64."""
    monkeypatch.setattr(convert_sources, "BLOCK_BYTES", 256)
    rows = [{"id": i, "n": i} for i in range(100)] + [{"id": 100, "n": BIG}]
    src = write(rows, tmp_path / f"late{suffix}")
    with pytest.raises(SchemaMismatchError, match=rf"the column is int64 \(as its file's first rows, or the "
                                                  rf"schema, say\), which cannot hold {BIG}: declare it "
                                                  r"uint64 or str in schema= \(shardkit write --schema\)"):
        convert(src, tmp_path / "out")
    ds = convert(src, tmp_path / "out", schema=[shardkit.Field("n", "uint64")])
    assert read_rows(ds.url)[1]["n"][-2:] == [99, BIG]
