"""A process's output as the lines the supervisor echoes: ``\\n`` lines, progress bars redrawn with
``\\r``, and a bound on what an unterminated line may hold."""

from __future__ import annotations

import time

__all__ = ["MAX_LINE_BYTES", "LineSplitter"]

#: An unterminated line longer than this is shown in pieces of this size.
MAX_LINE_BYTES = 64 << 10
#: Seconds between two redraws of a ``\r`` progress bar shown on the console.
REDRAW_INTERVAL = 1.0


def _latest(segment: bytes) -> bytes:
    """What a terminal shows of ``a\\rb\\rc``: the last segment that is not blank (``c``)."""
    parts = segment.split(b"\r")
    return next((part for part in reversed(parts) if part.strip()), parts[-1])


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


class LineSplitter:
    """Bytes a process wrote, fed in as they come, out as lines to show.

    Example:
        >>> lines = LineSplitter()
        >>> lines.feed(b"epoch 1\\nloss 0.3\\r\\n\\rstep 1 |#  |\\rstep 2 |## |\\rstep 3 |###|")
        ['epoch 1', 'loss 0.3', 'step 2 |## |']
        >>> lines.feed(b"", final=True)
        ['step 3 |###|']

    Choices:
    - A line ended by ``\\n`` is shown as a terminal would leave it: its last non-blank ``\\r``
      segment (``"text\\r\\n"`` is ``text``; a finished tqdm bar is its final state).
    - An unterminated line with ``\\r`` in it is a progress bar being redrawn: the newest finished
      redraw (the segment before the last ``\\r``) is shown, at most once per ``redraw_interval``
      seconds, and the rest is dropped; only what follows the last ``\\r`` is kept. A ``\\r`` that
      ends the data fed so far may be half of a ``\\r\\n`` and waits for the next bytes.
    - The kept rest is at most ``max_line`` bytes: beyond that it is shown in pieces of that size.
      So each call costs what was fed plus at most ``max_line`` bytes, however long a line grows
      (copying the whole unterminated line on every poll made long tqdm output cost ever more CPU).
    """

    def __init__(self, *, max_line: int = MAX_LINE_BYTES, redraw_interval: float = REDRAW_INTERVAL) -> None:
        self.max_line, self.redraw_interval = max_line, redraw_interval
        self._rest = b""
        self._redrawn_at: float | None = None

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        """The lines completed by ``data`` (``final``: the process has ended, so its rest too)."""
        *lines, rest = (self._rest + data).split(b"\n")
        out = [_text(_latest(line)) for line in lines]
        if lines:
            self._redrawn_at = None  # the bar was finished: the next one starts shown at once
        cut = rest.rfind(b"\r", 0, len(rest) - 1)  # not a final \r: it may be the start of \r\n
        if cut >= 0:
            redraw = _latest(rest[:cut])
            now = time.monotonic()
            due = self._redrawn_at is None or now - self._redrawn_at >= self.redraw_interval
            if redraw.strip() and due:
                out.append(_text(redraw))
                self._redrawn_at = now
            rest = rest[cut + 1:]
        while len(rest) > self.max_line:
            out.append(_text(rest[: self.max_line]))
            rest = rest[self.max_line:]
        if final and rest:
            out.append(_text(_latest(rest)))
            rest = b""
        self._rest = rest
        return out
