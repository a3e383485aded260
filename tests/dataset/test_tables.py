"""Delta Lake and Iceberg tables read in place: the snapshot's rows only, time travel, shards, objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deltalake  # noqa: F401  (installed by [dev]: a missing one is a broken install, not a skip)
import numpy as np
import pyarrow.compute as pc
import pyiceberg  # noqa: F401
import pytest

import shardkit
from shardkit.dataset.tables import Snapshot
from shardkit.errors import NotADatasetError, ReaderError
from tests.dataset.tables import History, make_history, read_ids

FORMATS = ["delta", "iceberg"]
#: 1,000 rows, overwritten by 500, 100 appended, the lowest 20 deleted, a column added with 50 rows
HISTORY = [("append", 1000), ("overwrite", 500), ("append", 100), ("delete", 20), ("add_column", 50)]


@pytest.fixture(scope="module", params=FORMATS)
def history(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> History:
    return make_history(request.param, tmp_path_factory.mktemp(request.param), HISTORY)


def test_a_table_reads_its_current_snapshot_only(history: History) -> None:
    ids = read_ids(history.url)
    assert sorted(ids) == sorted(history.ids())
    assert len(ids) == 500 + 100 - 20 + 50
    ds = shardkit.open_dataset(history.url)
    assert ds.kind == ("delta" if "_delta_log" in str(list(Path(history.url).iterdir())) else "iceberg")
    assert isinstance(ds.snapshot, Snapshot)
    assert ds.snapshot.version == history.current
    assert ds.snapshot.versions[-1] == history.current
    assert ds.snapshot.time is not None
    assert ds.num_rows == len(history.ids())


@pytest.mark.parametrize("index", range(len(HISTORY)))
def test_time_travel_reads_each_version_as_it_was(history: History, index: int) -> None:
    version = list(history.snapshots)[index]
    assert sorted(read_ids(history.url, version=version)) == sorted(history.ids(version))
    assert shardkit.open_dataset(history.url, version=version).snapshot.version == version  # type: ignore[union-attr]


def test_a_column_added_later_reads_as_nulls_in_older_files(history: History) -> None:
    with shardkit.make_reader(history.url, shuffle=False, batch_size=1000, remainder="uneven") as reader:
        batch = next(iter(reader))
    ids, extra = batch["id"], batch["extra"]
    null = np.ma.getmaskarray(extra)
    added = ids >= ids.max() - 49  # the 50 rows appended with the column
    assert not null[added].any()
    assert (np.asarray(extra)[added] == ids[added] * 10).all()
    assert null[~added].all()


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_shards_are_orthogonal_and_complete(history: History, num_shards: int) -> None:
    seen: list[int] = []
    for shard in range(num_shards):
        seen += read_ids(history.url, shard=shard, num_shards=num_shards, shuffle=True, seed=5)
    assert sorted(seen) == sorted(history.ids())
    assert len(set(seen)) == len(seen)


def test_the_table_object_itself_is_a_url(history: History) -> None:
    if Path(history.url, "_delta_log").exists():
        from deltalake import DeltaTable

        table: Any = DeltaTable(history.url)
    else:
        from pyiceberg.catalog.sql import SqlCatalog

        root = Path(history.url).parents[2]
        table = SqlCatalog("test", uri=f"sqlite:///{root}/catalog.db",
                           warehouse=f"file://{root}/wh").load_table("ns.t")
    assert sorted(read_ids(table)) == sorted(history.ids())
    first = next(iter(history.snapshots))
    assert sorted(read_ids(table, version=first)) == sorted(history.ids(first))


def test_an_opened_table_dataset_and_another_version_are_refused_together(history: History) -> None:
    ds = shardkit.open_dataset(history.url)
    with pytest.raises(ReaderError, match="version="):
        shardkit.make_reader(ds, version=next(iter(history.snapshots)))


def test_a_version_for_a_folder_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    shardkit.write_dataset({"id": np.arange(10)}, url)
    with pytest.raises(shardkit.errors.TableVersionError, match="not a Delta or Iceberg table"):
        shardkit.open_dataset(url, version=1)


def test_iceberg_opens_from_a_metadata_file_url_and_refuses_its_data_folder(tmp_path: Path) -> None:
    history = make_history("iceberg", tmp_path, [("append", 300), ("overwrite", 200)])
    metadata = sorted((Path(history.url) / "metadata").glob("*.metadata.json"))[-1]
    assert sorted(read_ids(str(metadata))) == sorted(history.ids())
    with pytest.raises(NotADatasetError, match="iceberg table"):
        shardkit.open_dataset(str(Path(history.url) / "data"))


def test_iceberg_version_hint_picks_the_metadata_file(tmp_path: Path) -> None:
    history = make_history("iceberg", tmp_path, [("append", 300), ("overwrite", 200)])
    folder = Path(history.url) / "metadata"
    files = sorted(folder.glob("*.metadata.json"))
    # a Hadoop catalog's hint naming an older metadata file: that one is the table's current state
    (folder / "version-hint.text").write_text(files[1].name.split("-", 1)[0].lstrip("0") or "0")
    first = next(iter(history.snapshots))
    assert sorted(read_ids(history.url)) == sorted(history.ids(first))


def test_delta_partition_columns_come_from_the_log_and_prune_files(tmp_path: Path) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    from tests.dataset.tables import rows

    parts = [None if i % 4 == 3 else f"p{i % 4}" for i in range(300)]
    t = rows(range(300)).append_column("part", pa.array(parts, pa.string()))
    url = str(tmp_path / "t")
    write_deltalake(url, t, partition_by=["part"])
    ds = shardkit.open_dataset(url)  # no PartitionColumnsWarning: the column is read from the log
    assert ds.num_rows == 300
    assert "part" in ds.schema.names
    with shardkit.make_reader(url, shuffle=False, batch_size=300, remainder="uneven") as reader:
        batch = next(iter(reader))
    got = dict(zip(batch["id"].tolist(), batch["part"].tolist(), strict=True))
    assert got == {i: parts[i] for i in range(300)}
    with shardkit.make_reader(url, filter=[("part", "=", "p1")], shuffle=False, remainder="uneven") as reader:
        ids = sorted(int(i) for b in reader for i in b["id"])
        assert len(reader.dataset.files) == 1  # the files of p0, p2 and null: pruned by the log, not opened
    assert ids == [i for i in range(300) if i % 4 == 1]
    with shardkit.make_reader(url, filter=pc.field("part").is_null(), shuffle=False, remainder="uneven") as r:
        assert sorted(int(i) for b in r for i in b["id"]) == [i for i in range(300) if i % 4 == 3]
    with pytest.raises(NotADatasetError, match="delta table"):
        shardkit.open_dataset(str(tmp_path / "t" / "part=p1"))


def test_every_row_once_per_epoch_with_shuffle(history: History) -> None:
    ids = read_ids(history.url, shuffle=True, seed=1, num_epochs=2)
    half = len(ids) // 2
    assert sorted(ids[:half]) == sorted(ids[half:]) == sorted(history.ids())


def test_inspect_shows_the_format_version_and_time(history: History,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from shardkit.cli import main

    first = next(iter(history.snapshots))
    assert main(["inspect", history.url, "--json", "--table-version", str(first)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["snapshot"]["version"] == first
    assert info["snapshot"]["time"]
    assert info["rows"] == len(history.ids(first))
    assert main(["inspect", history.url]) == 0
    text = capsys.readouterr().out
    assert f" {history.current} of " in text
    assert "table, " in text


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_version_the_table_lacks_is_named_as_the_flag(history: History, command: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from shardkit.cli import main

    missing = max(history.snapshots) + 1
    assert main([command, history.url, "--table-version", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"has no version {missing}" in err or f"has no snapshot id {missing}" in err, err
    assert "Pass one of them as --table-version, or leave --table-version out" in err, err
    assert "version=" not in err, err


def test_iceberg_partitions_filter_and_prune(tmp_path: Path) -> None:
    import pyarrow as pa
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.transforms import IdentityTransform

    from tests.dataset.tables import rows

    data = rows(range(300)).append_column("part", pa.array([i % 3 for i in range(300)], pa.int64()))
    catalog = SqlCatalog("p", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/wh")
    catalog.create_namespace("ns")
    table = catalog.create_table("ns.t", schema=data.schema)
    part_id = table.schema().find_field("part").field_id
    with table.update_spec() as spec:
        spec.add_field("part", IdentityTransform(), "part")
    table = catalog.load_table("ns.t")
    assert isinstance(table.spec(), PartitionSpec)
    assert any(isinstance(f, PartitionField) and f.source_id == part_id for f in table.spec().fields)
    table.append(data)
    url = str(tmp_path / "wh" / "ns" / "t")
    ds = shardkit.open_dataset(url)
    assert len(ds.files) == 3
    assert "part" in ds.schema.names  # Iceberg keeps partition columns in the data files
    with shardkit.make_reader(url, filter=[("part", "=", 1)], shuffle=False, remainder="uneven") as reader:
        ids = sorted(int(i) for batch in reader for i in batch["id"])
        assert len(reader.dataset.files) == 1  # the other partitions' files: pruned by their bounds
    assert ids == [i for i in range(300) if i % 3 == 1]
