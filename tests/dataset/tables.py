"""Delta Lake and Iceberg tables with known histories, written by their own libraries (deltalake, pyiceberg
with a SQL catalog on sqlite), and the ids each version holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import shardkit


def rows(ids: Iterable[int], *, extra: bool = False) -> pa.Table:
    a = np.fromiter(ids, dtype=np.int64)
    columns: dict[str, Any] = {"id": a, "x": a * 0.5}
    if extra:
        columns["extra"] = a * 10
    return pa.table(columns)


@dataclasses.dataclass
class History:
    """A table and the ids of each of its versions (``snapshots``: version -> ids, in commit order)."""

    url: str
    snapshots: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    next_id: int = 0
    extra: bool = False

    @property
    def current(self) -> int:
        return list(self.snapshots)[-1]

    def ids(self, version: int | None = None) -> set[int]:
        return self.snapshots[self.current if version is None else version]

    def _new(self, n: int) -> pa.Table:
        table = rows(range(self.next_id, self.next_id + n), extra=self.extra)
        self.next_id += n
        return table

    def apply(self, op: tuple[str, int]) -> None:
        kind, n = op
        before = self.ids() if self.snapshots else set()
        if kind == "append":
            t = self._new(n)
            self._append(t)
            self._record(before | set(t.column("id").to_pylist()))
        elif kind == "overwrite":
            t = self._new(n)
            self._overwrite(t)
            self._record(set(t.column("id").to_pylist()))
        elif kind == "delete":  # the lowest n ids of the current version, at least one, not all
            n = min(max(n, 1), len(before) - 1)
            if n < 1:  # nothing that can be deleted and leave a row: append instead
                self.apply(("append", 1))
                return
            below = sorted(before)[n]
            self._delete(below)
            self._record({i for i in before if i >= below})
        elif kind == "add_column":
            self.extra = True
            t = self._new(n)
            self._add_column(t)
            self._record(before | set(t.column("id").to_pylist()))
        else:
            raise ValueError(kind)

    def _record(self, ids: set[int]) -> None:
        self.snapshots[self.version()] = ids

    # per format
    def version(self) -> int:
        raise NotImplementedError

    def _append(self, t: pa.Table) -> None:
        raise NotImplementedError

    def _overwrite(self, t: pa.Table) -> None:
        raise NotImplementedError

    def _delete(self, below: int) -> None:
        raise NotImplementedError

    def _add_column(self, t: pa.Table) -> None:
        raise NotImplementedError


class DeltaHistory(History):
    def __init__(self, path: Path, *, deletion_vectors: bool = False) -> None:
        super().__init__(str(path))
        self.deletion_vectors = deletion_vectors

    @property
    def options(self) -> dict[str, Any]:
        """The table's configuration, on the write that creates it."""
        if not self.deletion_vectors or (Path(self.url) / "_delta_log").exists():
            return {}
        return {"configuration": {"delta.enableDeletionVectors": "true"}}

    def version(self) -> int:
        from deltalake import DeltaTable

        return int(DeltaTable(self.url).version())

    def _append(self, t: pa.Table) -> None:
        from deltalake import write_deltalake

        write_deltalake(self.url, t, mode="append", **self.options)

    def _overwrite(self, t: pa.Table) -> None:
        from deltalake import write_deltalake

        write_deltalake(self.url, t, mode="overwrite", **self.options)

    def _delete(self, below: int) -> None:
        from deltalake import DeltaTable

        DeltaTable(self.url).delete(f"id < {below}")

    def _add_column(self, t: pa.Table) -> None:
        from deltalake import write_deltalake

        write_deltalake(self.url, t, mode="append", schema_mode="merge")


class IcebergHistory(History):
    def __init__(self, path: Path, *, partition_by_x: bool = False) -> None:
        from pyiceberg.catalog.sql import SqlCatalog

        path.mkdir(parents=True, exist_ok=True)
        self.catalog = SqlCatalog("test", uri=f"sqlite:///{path}/catalog.db", warehouse=f"file://{path}/wh")
        self.catalog.create_namespace("ns")
        self.table = self.catalog.create_table("ns.t", schema=rows([]).schema)
        super().__init__(str(path / "wh" / "ns" / "t"))

    def version(self) -> int:
        self.table = self.catalog.load_table("ns.t")
        snapshot = self.table.current_snapshot()
        assert snapshot is not None
        return int(snapshot.snapshot_id)

    def _append(self, t: pa.Table) -> None:
        self.table.append(t)

    def _overwrite(self, t: pa.Table) -> None:
        self.table.overwrite(t)

    def _delete(self, below: int) -> None:
        self.table.delete(f"id < {below}")

    def _add_column(self, t: pa.Table) -> None:
        from pyiceberg.types import LongType

        with self.table.update_schema() as update:
            update.add_column("extra", LongType())
        self.table = self.catalog.load_table("ns.t")
        self.table.append(t)


def make_history(fmt: str, path: Path, ops: Iterable[tuple[str, int]]) -> History:
    history: History = DeltaHistory(path) if fmt == "delta" else IcebergHistory(path)
    for op in ops:
        history.apply(op)
    return history


def read_ids(url: Any, **kw: Any) -> list[int]:
    """Every id a one-shard, unshuffled reader of ``url`` yields, in order."""
    kw = {"shuffle": False, "remainder": "uneven", "batch_size": 64, "workers": 1, **kw}
    with shardkit.make_reader(url, **kw) as reader:
        return [int(i) for batch in reader for i in batch["id"]]


#: Delta's inline deletion vector (``storageType: "i"``: a Z85-encoded RoaringBitmapArray, as the Delta
#: protocol specifies) deleting the rows 3, 4, 7, 11, 18 and 29 of a file. deltalake reads deletion
#: vectors but writes none (its deletes rewrite files), so a test table gets one written into its log
#: by hand: a commit that removes a file and adds it again with this vector.
INLINE_DV = {"storageType": "i", "pathOrInlineDv": "^Bg9^0rr910000000000iXQKl0rr91000f55c8Xg0@@D72lkbi5=-{L",
             "sizeInBytes": 44, "cardinality": 6}
INLINE_DV_ROWS = (3, 4, 7, 11, 18, 29)


def add_deletion_vector(history: DeltaHistory) -> set[int]:
    """Commit the `INLINE_DV` on the table's first file of 30 rows or more; returns the ids it deletes."""
    import json

    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    dt = DeltaTable(history.url)
    log = Path(history.url) / "_delta_log"
    adds = {}
    for commit in sorted(log.glob("*.json")):
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                adds[action["add"]["path"]] = action["add"]
    path = None
    for uri in dt.file_uris():
        name = uri.rsplit("/", 1)[-1]
        if name in adds and pq.read_metadata(uri).num_rows >= 30:
            path = name
            break
    assert path is not None, "no file of 30 rows or more"
    add = adds[path]
    ids = pq.read_table(Path(history.url) / path, columns=["id"]).column("id").to_pylist()
    deleted = {ids[i] for i in INLINE_DV_ROWS}
    version = dt.version() + 1
    now = int(add["modificationTime"]) + 1
    actions = [
        {"commitInfo": {"timestamp": now, "operation": "DELETE"}},
        {"remove": {"path": path, "deletionTimestamp": now, "dataChange": True, "size": add["size"]}},
        {"add": {**add, "dataChange": True, "deletionVector": INLINE_DV}},
    ]
    (log / f"{version:020d}.json").write_text("\n".join(json.dumps(a) for a in actions) + "\n")
    history.snapshots[version] = history.ids() - deleted
    return deleted


#: the rows of a data file that `add_iceberg_deletes` deletes (positions in the file)
ICEBERG_DELETED_ROWS = (1, 5, 7, 20, 29)


def add_iceberg_deletes(history: IcebergHistory, *, equality: bool = False,
                        rows: tuple[int, ...] = ICEBERG_DELETED_ROWS) -> set[int]:
    """Commit a delete file on the table's first data file of 30 rows or more, as a merge-on-read
    ``DELETE`` by Spark leaves it: a position delete file (``file_path, pos``) deleting ``rows`` of that
    file, or (``equality``) an equality delete file on ``id``. Returns the ids it deletes.

    pyiceberg reads delete files but writes none (its deletes rewrite data files), so the commit is made
    with pyiceberg's own writers: a Parquet file with the spec's field ids, a manifest of content
    ``deletes`` (its ``ManifestWriterV2`` with that content) and a snapshot that adds it to the table's
    manifests (its fast-append producer). pyiceberg's own scan applies the position deletes (checked).
    """
    import os
    import uuid

    import pyarrow.parquet as pq
    from pyiceberg.manifest import (
        DataFile,
        DataFileContent,
        FileFormat,
        ManifestContent,
        ManifestEntry,
        ManifestEntryStatus,
        ManifestWriterV2,
    )
    from pyiceberg.table.snapshots import Operation
    from pyiceberg.table.update.snapshot import _FastAppendFiles
    from pyiceberg.typedef import Record

    class DeleteManifestWriter(ManifestWriterV2):
        def content(self) -> ManifestContent:
            return ManifestContent.DELETES

        @property
        def _meta(self) -> dict[str, str]:
            return {**super()._meta, "content": "deletes"}

    class AddDeletes(_FastAppendFiles):
        files: tuple[Any, ...] = ()

        def _manifests(self) -> list[Any]:
            meta = self._transaction.table_metadata
            with DeleteManifestWriter(meta.spec(), meta.schema(), self.new_manifest_output(),
                                      self._snapshot_id, self._compression) as writer:
                for f in self.files:
                    writer.add(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED,
                                                       snapshot_id=self._snapshot_id, data_file=f))
            return [*super()._manifests(), writer.to_manifest_file()]

    table = history.catalog.load_table("ns.t")
    target = next(t.file for t in table.scan().plan_files() if t.file.record_count >= 30)
    ids = pq.read_table(target.file_path.removeprefix("file://"), columns=["id"]).column("id").to_pylist()
    deleted = {ids[i] for i in rows if i < len(ids)}
    path = f"{history.url}/data/deletes-{uuid.uuid4().hex[:8]}.parquet"
    if equality:
        data = pa.table({"id": pa.array(sorted(deleted), pa.int64())})
        field_id = next(f.field_id for f in table.schema().fields if f.name == "id")
        data = data.cast(pa.schema([pa.field("id", pa.int64(), False, {"PARQUET:field_id": str(field_id)})]))
        content, extra = DataFileContent.EQUALITY_DELETES, {"equality_ids": [field_id]}
    else:
        data = pa.table({"file_path": pa.array([target.file_path] * len(rows)),
                         "pos": pa.array(sorted(rows), pa.int64())})
        data = data.cast(pa.schema([
            pa.field("file_path", pa.string(), False, {"PARQUET:field_id": "2147483546"}),  # the spec's ids
            pa.field("pos", pa.int64(), False, {"PARQUET:field_id": "2147483545"})]))
        content, extra = DataFileContent.POSITION_DELETES, {}
    pq.write_table(data, path)
    delete = DataFile.from_args(content=content, file_path=f"file://{path}", file_format=FileFormat.PARQUET,
                                partition=Record(), record_count=data.num_rows,
                                file_size_in_bytes=os.path.getsize(path), **extra)
    delete.spec_id = table.spec().spec_id
    transaction = table.transaction()
    producer = AddDeletes(operation=Operation.DELETE, transaction=transaction, io=table.io)
    producer.files = (delete,)
    producer.commit()
    transaction.commit_transaction()
    history.snapshots[history.version()] = history.ids() - deleted
    return deleted
