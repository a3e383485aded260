"""`Snapshot`: which version of a Delta or Iceberg table an opened `Dataset` is (what a resume pins)."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from shardkit.dataset._dataset import Dataset

TableFormat = Literal["delta", "iceberg"]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The snapshot a table `Dataset` lists the files of.

    ``version`` is the Delta version or the Iceberg snapshot id; ``timestamp_ms`` its commit time;
    ``versions`` every version the table had when it was opened (oldest first), for messages. ``reopen``
    opens the same table at another version (with the same storage options, or the same table object),
    as a reader resumed from a state saved on an older snapshot does.
    """

    format: TableFormat
    version: int
    timestamp_ms: int | None
    versions: tuple[int, ...]
    table_url: str
    reopen: Callable[[int], Dataset] = dataclasses.field(repr=False, compare=False)

    @property
    def time(self) -> datetime.datetime | None:
        """The snapshot's commit time (UTC), when the table records it."""
        if self.timestamp_ms is None:
            return None
        return datetime.datetime.fromtimestamp(self.timestamp_ms / 1000, tz=datetime.UTC)

    def state(self) -> dict[str, Any]:
        """What a reader's `state_dict` holds of it (JSON-able)."""
        return {"format": self.format, "version": self.version, "table": self.table_url}
