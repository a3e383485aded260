"""``shardkit write SRC DEST``: converts data (`shardkit.dataset.convert`) and says what it wrote."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.cli import main
from tests.dataset.test_petastorm import FIXTURES

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", "write", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.timeout(120)
def test_write_runs_as_a_program_and_refuses_an_existing_dataset_in_one_line(tmp_path: Path) -> None:
    dest = tmp_path / "images"
    done = run(str(FIXTURES / "images"), str(dest), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"wrote {dest}: 240 rows in 1 row groups, 1 files, ")
    assert lines[0].endswith(" rows/s)")
    assert ["rgb_jpeg", "uint8", "(16,", "16,", "3)", "image(format=jpeg,", "quality=90)", "no"] in [
        line.split() for line in lines]
    assert shardkit.open_dataset(dest).num_rows == 240
    again = run(str(FIXTURES / "tensors"), str(dest))
    assert again.returncode == 2
    assert again.stdout == ""
    assert again.stderr.count("\n") == 1
    assert again.stderr == (f"shardkit write: error: a dataset already exists at '{dest}'; pass --mode "
                            "overwrite to replace it or --mode append to add rows to it\n")
    assert shardkit.open_dataset(dest).schema.names == ["id", "rgb_png", "gray_png", "rgb_jpeg"]


def test_write_with_a_schema_file_columns_and_row_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """The fields `shardkit inspect --json` printed declare a list column a fixed tensor; --columns picks."""
    src = tmp_path / "emb.jsonl"
    vecs = np.arange(30 * 4, dtype=np.float32).reshape(30, 4) / 8
    src.write_text("".join(json.dumps({"id": i, "vec": v.tolist(), "note": "x"}) + "\n"
                           for i, v in enumerate(vecs)))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"fields": [shardkit.Field("vec", "float32", (4,)).to_json()]}))
    dest = tmp_path / "out"
    assert main(["write", str(src), str(dest), "--schema", str(schema), "--columns", "id, vec",
                 "--row-group-size", "10", "--compression", "zstd", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith(f"wrote {dest}: 30 rows in 3 row groups, 1 files, ")
    rows = [line.split() for line in out.splitlines()]
    assert ["vec", "float32", "(4)", "tensor(storage=bytes)", "no"] in rows
    ds = shardkit.open_dataset(dest)
    assert ds.schema.names == ["id", "vec"]
    np.testing.assert_array_equal(np.concatenate([ds.decode(ds.read_row_group(i))["vec"] for i in range(3)]),
                                  vecs)
    assert main(["write", str(src), str(dest), "--mode", "append", "--columns", "id,vec",
                 "--no-progress"]) == 0  # appending takes the dataset's schema
    assert shardkit.open_dataset(dest).num_rows == 60
    out, _ = capsys.readouterr()  # the rows written (and their rows/s), and the dataset's
    assert out.startswith(f"wrote {dest}: 30 rows appended (now 60 rows in 4 row groups, 2 files, ")


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["{tmp}/missing", "{tmp}/out"], ["'{tmp}/missing'", "does not exist"]),
        (["{tmp}/notes.txt", "{tmp}/out"], ["does not say a format", ".parquet"]),
        (["{tmp}/a.csv", "{tmp}/out", "--columns", "a, zz"],
         ["--columns a,zz names ['zz'], but '{tmp}/a.csv' has no such column(s) (its columns: ['a', 'b'])"]),
        (["{tmp}/a.csv", "{tmp}/out", "--schema", "{tmp}/a.csv"], ["cannot read the schema file"]),
        (["{tmp}/a.csv", "{tmp}/out", "--file-size", "big"], ["--file-size big is not a size"]),
        (["{tmp}/huge.csv", "{tmp}/out"], ["'{tmp}/huge.csv': column 'id' holds the integer "
                                           "99999999999999999999 (source row 1), which no 64-bit integer "
                                           "type holds", "Field('id', 'str') to keep every digit"]),
        (["{tmp}/blank.jsonl", "{tmp}/out"], ["'{tmp}/blank.jsonl': the file holds no data"]),
    ],
    ids=["missing", "unknown-type", "unknown-column", "schema-not-json", "bad-size", "integer-past-uint64",
         "newline-only-json"],
)
def test_write_errors_exit_2_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                         needles: list[str]) -> None:
    (tmp_path / "notes.txt").write_text("hi\n")
    (tmp_path / "a.csv").write_text("a,b\n1,2\n")
    (tmp_path / "huge.csv").write_text("id\n1\n99999999999999999999\n")
    (tmp_path / "blank.jsonl").write_text("\n")
    assert main(["write", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("shardkit write: error: "), err
    for needle in needles:
        assert needle.format(tmp=tmp_path) in err, (needle, err)
    assert not os.path.exists(tmp_path / "out")


# an argument of convert's as Python names it (`row_group_size=0`): `shardkit write` says the flag typed
PYTHON_NAME = re.compile(r"(?<![\w.-])(?:(?:mode|schema|columns|row_group_size|file_size|compression|"
                         r"progress)=|row_group_size\b|file_size\b|write_summary\b)")


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, err
    assert err.startswith("shardkit write: error: "), err
    assert not PYTHON_NAME.search(err), err
    return err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--row-group-size", "0"], "--row-group-size 0 must be positive"),
        (["--row-group-size", "abc"], "--row-group-size abc is not a size; use a positive number of bytes"),
        (["--row-group-size", "-5"], "--row-group-size -5 is not a size"),
        (["--row-group-size", "\u00b2"], "--row-group-size '\u00b2' is not a size"),  # a digit int() refuses
        (["--file-size", "abc"], "--file-size abc is not a size"),
        (["--file-size", "0"], "--file-size 0 is not a size"),
        (["--compression", "bogus"], "--compression bogus is not a Parquet codec available here; use 'auto'"),
        (["--compression", "no such"], "--compression 'no such' is not a Parquet codec"),
        (["--columns", "a,zz"], "--columns a,zz names ['zz'], but "),
    ],
)
def test_an_error_about_a_flag_names_the_flag_as_typed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       flags: list[str], needle: str) -> None:
    """The messages are convert's and write_dataset's, which name the Python arguments
    (``row_group_size=0``, test_writer); here each is the flag and the value typed."""
    (tmp_path / "a.csv").write_text("a,b\n1,2\n")
    assert main(["write", str(tmp_path / "a.csv"), str(tmp_path / "out"), "--no-progress", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert needle in _one_line_error(err), (needle, err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("src", "flags", "needle"),
    [
        ("a.csv", ["--mode", "append", "--columns", "a"],
         "--columns a leaves out ['b'], fields of the dataset appended to, '{tmp}/ds'; an append writes all"),
        ("abc.csv", ["--mode", "append"],
         "'{tmp}/abc.csv' has the column(s) ['c'], which the dataset appended to, '{tmp}/ds', has not (its "
         "fields: ['a', 'b']); pick its fields with --columns, or write a new dataset"),
        ("a.csv", ["--mode", "append", "--schema", "{tmp}/schema.json"],
         "append with the dataset's schema (leave --schema out), write to a new URL, or use --mode "
         "overwrite"),
        ("a.csv", ["--mode", "append", "--row-group-size", "0"], "--row-group-size 0 must be positive"),
    ],
    ids=["columns-leave-out-a-field", "a-column-the-dataset-lacks", "another-schema", "row-group-size"],
)
def test_an_append_that_does_not_fit_names_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     src: str, flags: list[str], needle: str) -> None:
    (tmp_path / "a.csv").write_text("a,b\n1,2\n")
    (tmp_path / "abc.csv").write_text("a,b,c\n1,2,3\n")
    (tmp_path / "schema.json").write_text(json.dumps([shardkit.Field("a", "int32").to_json()]))
    assert main(["write", str(tmp_path / "a.csv"), str(tmp_path / "ds"), "--no-progress"]) == 0
    capsys.readouterr()
    argv = [str(tmp_path / src), str(tmp_path / "ds"), "--no-progress", *flags]
    assert main(["write", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    assert needle.format(tmp=tmp_path) in _one_line_error(capsys.readouterr().err)
    assert shardkit.open_dataset(tmp_path / "ds").num_rows == 1


def test_appending_to_a_plain_parquet_folder_names_the_command_that_indexes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pandas as pd

    (tmp_path / "a.csv").write_text("a\n1\n")
    (tmp_path / "plain").mkdir()
    pd.DataFrame({"a": [0]}).to_parquet(tmp_path / "plain" / "x.parquet")
    assert main(["write", str(tmp_path / "a.csv"), str(tmp_path / "plain"), "--mode", "append"]) == 2
    err = _one_line_error(capsys.readouterr().err)
    assert err.endswith(f"cannot append to '{tmp_path / 'plain'}': it is not a shardkit dataset (no "
                        "_metadata). Index it first with `shardkit index URL`, or write to a new URL\n"), err


@pytest.mark.parametrize(
    ("typed", "needle"),
    [
        (",", "argument --columns: ',' names no column; name each column to write once, comma-separated "
              "(--columns a,b), or leave --columns out to write them all"),
        ("", "argument --columns: '' names no column; "),
        ("a,,a", "argument --columns: 'a,,a' names ['a'] more than once; name each column to write once"),
        (" b, a ,b,a", "argument --columns: ' b, a ,b,a' names ['a', 'b'] more than once; "),
    ],
)
def test_columns_that_name_no_column_or_one_twice_are_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], typed: str, needle: str) -> None:
    """As for ``shardkit bench --columns ,``: the flag's own text, said before anything is read."""
    (tmp_path / "a.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit) as info:
        main(["write", str(tmp_path / "a.csv"), str(tmp_path / "out"), "--columns", typed])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardkit write")
    assert f"shardkit write: error: {needle}" in err, err
    assert not (tmp_path / "out").exists()


def test_write_keeps_every_digit_of_integers_past_int64(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """pyarrow typed the column float64: 9007199254740993 was written as 9007199254740992, without a word."""
    (tmp_path / "ids.csv").write_text("id,n\n9007199254740993,1\n18446744073709551615,2\n")
    assert main(["write", str(tmp_path / "ids.csv"), str(tmp_path / "out"), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert ["id", "uint64", "()", "scalar", "no"] in [line.split() for line in out.splitlines()]
    ds = shardkit.open_dataset(tmp_path / "out")
    assert ds.decode(ds.read_row_group(0))["id"].tolist() == [9007199254740993, 18446744073709551615]


def test_write_of_a_folder_with_a_stray_file_and_zoned_times_warns_on_stderr(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Zone-aware times (which failed the write) are written as UTC; a README beside the data (which made
    the folder "mixed formats" when it was a .json) is left out: each said in one line after the write."""
    import pandas as pd

    src = tmp_path / "src"
    src.mkdir()
    when = pd.to_datetime(["2021-03-01 08:00", "2021-03-02 09:30"]).tz_localize("America/New_York")
    pd.DataFrame({"id": [1, 2], "when": when}).to_parquet(src / "part-0.parquet")
    (src / "notes.json").write_text('{"from": "the export of March"}\n')
    assert main(["write", str(src), str(tmp_path / "out"), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"wrote {tmp_path / 'out'}: 2 rows in 1 row groups, 1 files, ")
    assert ["when", "datetime64[us]", "()", "scalar", "no"] in [line.split() for line in out.splitlines()]
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert all(line.startswith("warning: ") for line in lines), err
    assert "left out 1 file(s) that are not parquet" in err
    assert "'notes.json'" in err
    assert "column 'when' holds times with the time zone 'America/New_York'" in err
    ds = shardkit.open_dataset(tmp_path / "out")
    utc = when.tz_convert("UTC").tz_localize(None)
    assert ds.decode(ds.read_row_group(0))["when"].tolist() == utc.tolist()


def test_write_takes_a_quoted_glob_pattern(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "data").mkdir()
    for i in range(3):
        (tmp_path / "data" / f"day-{i}.csv").write_text(f"id,x\n{i},nan\n")
    (tmp_path / "data" / "day-0.json").write_text('{"id": 9, "x": 1.5}\n')  # not matched: not read
    assert main(["write", f"{tmp_path}/data/day-*.csv", str(tmp_path / "out"), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith(f"wrote {tmp_path / 'out'}: 3 rows in ")
    ds = shardkit.open_dataset(tmp_path / "out")
    assert ds.schema["x"] == shardkit.Field("x", "float64")  # a CSV's nan: a float's NaN, not a null
    assert np.isnan(ds.decode(ds.read_row_group(0))["x"]).all()


def test_a_pattern_the_shell_expanded_is_a_usage_error_saying_to_quote_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = [str(tmp_path / f"day-{i}.csv") for i in range(3)]  # `shardkit write data/day-*.csv out`
    with pytest.raises(SystemExit) as info:
        main(["write", *files, str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"shardkit write: error: unrecognized arguments: {files[2]} {tmp_path / 'out'}; write takes one " \
           "SRC and one DEST: if SRC is a glob pattern, quote it" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path), "--bogus"])  # other commands: argparse's own words
    assert capsys.readouterr().err.endswith("error: unrecognized arguments: --bogus\n")


def test_write_mode_is_checked_as_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["write", str(tmp_path / "a.csv"), str(tmp_path / "out"), "--mode", "replace"])
    assert info.value.code == 2
    assert "invalid choice: 'replace'" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_write_killed_midway_leaves_nothing_readable_and_runs_again(tmp_path: Path, sig: signal.Signals
                                                                      ) -> None:
    """A real ``python -m shardkit write`` stopped while it writes parts: DEST holds no dataset (Ctrl-C: one
    line on stderr, exit 130, no traceback), and the same command then succeeds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "big.parquet"
    n = 2_000_000
    pq.write_table(pa.table({"id": np.arange(n), "x": np.random.default_rng(0).normal(size=n)}), src)
    dest = tmp_path / "out"
    argv = [sys.executable, "-m", "shardkit", "write", str(src), str(dest), "--no-progress"]
    # (a test run started in the background ignores SIGINT, and its children would inherit that)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([*argv, "--row-group-size", "2000", "--file-size", "64KiB"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, handler)
    try:
        deadline = time.monotonic() + 30
        while len(list(dest.glob("_staging/*/part-*"))) < 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "no part was staged in 30 s"
            time.sleep(0.01)
        assert proc.poll() is None, "the write finished before it could be stopped: make the source bigger"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in (130, -sig), (proc.returncode, err)
    assert out == ""
    if sig == signal.SIGINT:
        assert proc.returncode == 130
        assert err.count("\n") == 1, err
        assert err.startswith("shardkit write: interrupted; nothing was committed to "), err
    assert not (dest / "_metadata").exists()
    with pytest.raises(shardkit.errors.ShardkitError):
        shardkit.open_dataset(dest)
    again = run(*argv[4:])
    assert again.returncode == 0, again.stderr
    assert shardkit.open_dataset(dest).num_rows == n
