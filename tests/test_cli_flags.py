"""`shardkit.cli._flags.in_flags`: the Python API's messages with each argument written as its flag."""

from __future__ import annotations

import argparse

import pytest

from shardkit.cli import _bench as cli_bench
from shardkit.cli import _write as cli_write
from shardkit.cli._flags import in_flags


def _parser(command: str) -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser(prog="shardkit").add_subparsers()
    (cli_write if command == "write" else cli_bench).add_parser(sub)
    return sub.choices[command]


@pytest.mark.parametrize(
    ("message", "given", "expected"),
    [
        ("pass mode='overwrite' to replace it or mode='append' to add rows to it", {"mode": "error"},
         "pass --mode overwrite to replace it or --mode append to add rows to it"),
        ("compression='no such' is not a codec", {"compression": "auto"},
         "--compression 'no such' is not a codec"),
        ("row_group_size='abc' is not a size; use e.g. '64MiB'", {"row_group_size": "abc"},
         "--row-group-size abc is not a size; use e.g. '64MiB'"),
        ("row_group_size=0 must be positive", {"row_group_size": 0}, "--row-group-size 0 must be positive"),
        ("compression=b'zstd' is bytes", {}, "--compression b'zstd' is bytes"),  # no text the flag types
        ("the file 'mode=overwrite' holds schema='x'", {}, "the file 'mode=overwrite' holds --schema x"),
        ("(leave schema= out)", {"schema": None}, "(leave --schema out)"),
        ("progress=False, or file_size", {}, "--no-progress, or --file-size"),
    ],
)
def test_a_quoted_value_after_an_argument_is_the_flag_and_its_text(message: str, given: dict[str, object],
                                                                    expected: str) -> None:
    """``mode='overwrite'`` (a fix naming a value other than the one passed) was ``--mode 'overwrite'``."""
    assert in_flags(message, _parser("write"), given) == expected


def test_bench_flags_keep_their_words() -> None:
    parser = _parser("bench")
    assert in_flags("warmup_batches=-1 must be an int >= 0", parser, {"warmup_batches": -1}) == (
        "--warmup -1 must be an int >= 0")
    assert in_flags("pass cache=None or storage_options={'anon': True}", parser, {}) == (
        """pass --no-cache or --storage-options '{"anon": true}'""")
    assert in_flags("pass adapter='tf'", parser, {"adapter": "numpy"}) == "pass --adapter tf"
