"""What the framework loaders share: passes over a reader, batches read ahead, resume at a batch handed out.

`shardkit.torch.make_loader` and `shardkit.jax.make_loader` convert a reader's batches and hand them out,
some batches behind the reader (a copy to the device overlaps the compute on the batch before).
`LoaderBase` keeps the bookkeeping of both in one place, so a fix to resume is made once: the passes over
the reader (`Passes`), the pass a position belongs to, a ``state_dict`` that counts the batches handed
out rather than those read, and putting the reader back when a pass stops with batches read ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Self, TypeVar

import numpy as np

from shardkit.dataset import Dataset, Schema
from shardkit.errors import AdapterError
from shardkit.reader.adapters.collate import Passes
from shardkit.reader.api import make_reader
from shardkit.reader.reader import Reader

Batch = dict[str, Any]
_L = TypeVar("_L", bound="LoaderBase")


class LoaderBase:
    """A `Reader` handed out in passes, whose state counts the batches handed out; the adapters' ``Loader``
    classes add what a batch becomes and where it goes.

    A pass (``for batch in loader``) is the reader's next ``num_epochs`` epochs (`Passes`). A new pass,
    `load_state_dict` and `close` end the pass in progress: each bumps ``_generation``, and a pass touches
    the shared state only while the generation is its own. While the reader is ahead of the user,
    ``_seen`` holds the reader's state after the last batch handed out: `state_dict` returns it, and a
    pass that stops early loads it back into the reader (`_rewind`), so no batch read ahead is lost.
    """

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self._passes = Passes(reader)
        self._seen: dict[str, Any] | None = None  # the position the user has seen, while the reader is ahead
        self._generation = 0
        # the pass the position belongs to: {"pass": its start epoch, "pass_done": whether it ended}; a
        # loaded one stands until the next pass starts (see `state_dict`)
        self._loaded_pass: dict[str, Any] | None = None
        self._pass_done = False

    @property
    def schema(self) -> Schema:
        return self.reader.schema

    def __len__(self) -> int:
        """Batches per epoch for this shard (the reader's ``len``)."""
        return len(self.reader)

    def _look_ahead(self, put: Callable[[dict[str, np.ndarray]], Batch], depth: int) -> Iterator[Batch]:
        """One pass: batch k is handed out once batches k+1 .. k+``depth`` were read and ``put`` (converted
        and sent off; jax's ``device_put`` returns at once, so their transfers run while batch k is computed
        on). The reader is then ahead of the user: the position the user has seen is kept for `state_dict`,
        and a pass that stops early puts the reader back there (no batch is lost between passes).
        ``depth=0`` hands each batch out as soon as it is put, and keeps no position."""
        self._rewind()
        self._generation += 1
        generation = self._generation
        self._seen = self.reader.state_dict() if depth else None
        ahead: deque[tuple[Batch, dict[str, Any] | None]] = deque()
        try:
            for i, batch in enumerate(self._passes()):
                if i == 0:
                    self._started(generation)
                ahead.append((put(batch), self.reader.state_dict() if depth else None))
                if len(ahead) > depth:
                    out, self._seen = ahead.popleft()
                    yield out
            # the passes end when this pass is over, or when a newer pass or a load_state_dict took the
            # reader: then the batches read ahead are not this pass's to hand out, nor their positions
            while ahead and generation == self._generation:
                out, self._seen = ahead.popleft()
                yield out
            if not ahead:
                self._ended(generation)
        finally:
            if generation == self._generation:
                if ahead:
                    self._rewind()
                self._seen = None

    def _started(self, generation: int) -> None:
        if generation == self._generation:
            self._loaded_pass, self._pass_done = None, False

    def _ended(self, generation: int) -> None:
        """The pass of ``generation`` ran to its end (not stopped, nor taken over by a newer one)."""
        if generation == self._generation:
            self._loaded_pass, self._pass_done = None, True

    def _rewind(self) -> None:
        if self._seen is not None:
            seen, self._seen = self._seen, None
            self.reader.load_state_dict(seen)

    def state_dict(self) -> dict[str, Any]:
        """The reader's state after the last batch handed out, not those read ahead (see
        `Reader.state_dict`), with the pass it belongs to: ``"pass"``, the epoch that pass started at,
        and ``"pass_done"``, whether it had ended (see `load_state_dict`). A `Reader` takes it too (it
        ignores those two keys)."""
        state = dict(self._seen) if self._seen is not None else self.reader.state_dict()
        if self._loaded_pass is not None:
            state.update(self._loaded_pass)
        elif self._passes.start is not None:
            state.update({"pass": self._passes.start, "pass_done": self._pass_done})
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (see `Reader.load_state_dict`); a pass in progress ends.

        The next pass is the rest of the pass the state was saved in: what is left of its ``num_epochs``
        epochs (nothing, when it was saved at that pass's last batch). A state saved after its pass had
        ended (after the ``for batch in loader`` loop) starts a new pass: ``num_epochs`` more epochs,
        as `torchdata`'s ``StatefulDataLoader`` starts the next epoch. A plain reader state (no
        ``"pass"``) counts epochs from 0, as a `Reader` does: the epochs left of ``num_epochs``.
        """
        started = state.get("pass") if isinstance(state, Mapping) else None
        if not isinstance(started, int) or isinstance(started, bool) or started < 0:
            started = None
        done = bool(state.get("pass_done")) if started is not None else False
        self._generation += 1
        self._passes.stop()
        self._seen = None
        self.reader.load_state_dict(state)
        self._passes.resumed(None if done else 0 if started is None else started)
        self._pass_done = False
        self._loaded_pass = None if started is None else {"pass": started, "pass_done": done}

    def close(self) -> None:
        self._generation += 1
        self._passes.stop()
        self._seen = None
        self.reader.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_loader(reader_or_url: Any, make_reader_kwargs: Mapping[str, Any],
                build: Callable[[Reader], _L]) -> _L:
    """``build(reader)`` on the `Reader` given, or on one `make_reader` opens on a dataset URL with
    ``make_reader_kwargs`` (closed again if ``build`` fails, so a refused field leaves no file open);
    `AdapterError` for reader options along with a `Reader`, or for neither a `Reader` nor a URL."""
    if isinstance(reader_or_url, Reader):
        if make_reader_kwargs:
            raise AdapterError(f"make_loader got a Reader and reader options {sorted(make_reader_kwargs)}; "
                               "pass the options to make_reader, or pass a URL instead of a Reader")
        return build(reader_or_url)
    if not isinstance(reader_or_url, str | Dataset) and not hasattr(reader_or_url, "__fspath__"):
        raise AdapterError(f"make_loader needs a Reader or a dataset URL, got {type(reader_or_url).__name__}")
    reader = make_reader(reader_or_url, **make_reader_kwargs)
    try:
        return build(reader)
    except BaseException:
        reader.close()
        raise


__all__ = ["LoaderBase", "open_loader"]
