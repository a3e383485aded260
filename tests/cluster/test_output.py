"""Process output as echoed lines: ``\\n`` lines, ``\\r`` progress bars, and the bound on a long line."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shardkit.cluster.monitor.output import LineSplitter


def test_lines_crlf_and_a_finished_bar_show_what_a_terminal_leaves() -> None:
    lines = LineSplitter()
    assert lines.feed(b"epoch 1\nloss 0.3\r\n\rbar 1\rbar 2\rbar 3\n") == ["epoch 1", "loss 0.3", "bar 3"]
    assert lines.feed(b"   \n\n") == ["   ", ""]  # blank lines stay lines


def test_a_bar_being_redrawn_shows_its_newest_finished_redraw_at_most_once_per_interval() -> None:
    lines = LineSplitter(redraw_interval=3600.0)
    assert lines.feed(b"\rstep 1 |#  |\rstep 2 |## |\rstep 3 |###|") == ["step 2 |## |"]
    assert lines.feed(b"\rstep 4 |###|\rstep 5 |###|") == []  # within the interval: dropped
    assert lines.feed(b"\rstep 6 |###| done\n") == ["step 6 |###| done"]  # a finished line always shows
    assert lines.feed(b"\rnext 1\rnext 2") == ["next 1"]  # a new bar shows at once
    assert lines.feed(b"", final=True) == ["next 2"]


def test_a_cr_at_the_end_may_be_half_of_crlf() -> None:
    lines = LineSplitter(redraw_interval=0.0)
    assert lines.feed(b"text\r") == []
    assert lines.feed(b"\nmore") == ["text"]  # one line, no empty one after it
    assert lines.feed(b"", final=True) == ["more"]


def test_an_unterminated_line_is_shown_in_pieces_and_kept_small() -> None:
    lines = LineSplitter(max_line=10)
    assert lines.feed(b"a" * 25) == ["a" * 10, "a" * 10]
    assert lines.feed(b"b\n") == ["aaaaab"]
    assert lines.feed(b"c" * 9) == []
    assert lines.feed(b"", final=True) == ["c" * 9]


def test_a_long_bar_costs_only_what_is_fed() -> None:
    """60 MB of redraws with no newline: the kept rest stays one redraw long (the old code copied all
    of it on every poll)."""
    lines = LineSplitter(redraw_interval=0.0)
    redraw = b"\rstep 12345678 |" + b"#" * 80 + b"| loss 0.1234"
    for _ in range(60):
        shown = lines.feed(redraw * 10_000)
        assert shown == [redraw[1:].decode()]
        assert len(lines._rest) < len(redraw)


@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")), max_size=8),
       st.lists(st.integers(min_value=0, max_value=60), max_size=6))
def test_plain_lines_come_out_whole_however_the_bytes_are_cut(lines: list[bytes], cuts: list[int]) -> None:
    data = b"".join(line + b"\n" for line in lines)
    splitter = LineSplitter(max_line=1 << 20)
    out: list[str] = []
    start = 0
    for cut in sorted(cuts):
        out += splitter.feed(data[start:cut])
        start = max(start, cut)
    out += splitter.feed(data[start:], final=True)
    assert out == [line.decode("utf-8", "replace") for line in lines]
