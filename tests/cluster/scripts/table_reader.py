"""A role that reads the job's data (a Delta or Iceberg table) with ``ctx.reader()`` and writes the ids
of its shard to ``<logdir>/ids-<index>.json``. With ``params.move_on`` worker 0 first commits rows to the
table (the table moves on while the job starts)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import shardkit.trainer


def main() -> None:
    ctx = shardkit.trainer.init()
    params = ctx.params
    assert ctx.config is not None
    assert ctx.config.data is not None
    url = ctx.config.data.url
    if params.get("move_on") and ctx.role_index == 0:
        import pyarrow as pa
        from deltalake import write_deltalake

        write_deltalake(url, pa.table({"id": np.arange(10_000, 10_050), "x": np.zeros(50)}), mode="append")
    ids: list[int] = []
    with ctx:
        for batch in ctx.reader():
            ids.extend(int(i) for i in batch["id"])
            ctx.step(samples=len(batch["id"]))
    out = Path(ctx.config.logdir) / f"ids-{ctx.role_index}.json"
    out.write_text(json.dumps({"ids": ids, "version": ctx.reader_kwargs().get("version")}))


if __name__ == "__main__":
    main()
