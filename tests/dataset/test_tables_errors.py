"""Bad tables and bad versions: each refused with the value, the place and the fix; never read as a folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deltalake  # noqa: F401  (installed by [dev]: a missing one is a broken install, not a skip)
import pyiceberg  # noqa: F401
import pytest

import shardkit
from shardkit.errors import (
    CorruptDatasetError,
    MissingDependencyError,
    TableVersionError,
    UnsupportedTableError,
)
from tests.dataset.tables import History, make_history

OPS = [("append", 200), ("overwrite", 100), ("append", 50)]


@pytest.fixture(params=["delta", "iceberg"])
def history(request: pytest.FixtureRequest, tmp_path: Path) -> History:
    return make_history(request.param, tmp_path / request.param, OPS)


def test_a_missing_version_lists_the_tables_versions(history: History) -> None:
    with pytest.raises(TableVersionError) as e:
        shardkit.make_reader(history.url, version=123456)
    assert "123456" in str(e.value)
    for version in history.snapshots:
        assert str(version) in str(e.value)


def test_a_version_that_is_no_int_is_refused(history: History) -> None:
    with pytest.raises(TableVersionError, match="must be an int"):
        shardkit.open_dataset(history.url, version="3")  # type: ignore[arg-type]


def data_files(history: History) -> list[Path]:
    ds = shardkit.open_dataset(history.url)
    return [Path(history.url) / f for f in ds.files]


def test_a_vacuumed_file_is_named_with_the_version_and_the_fix(history: History) -> None:
    gone = data_files(history)[0]
    gone.unlink()
    from shardkit.dataset.tables import _files

    _files._cache.clear()  # footers read by the opening above: a fresh process has none
    with pytest.raises(CorruptDatasetError) as e:
        shardkit.open_dataset(history.url)
    text = str(e.value)
    assert gone.name in text
    assert str(history.current) in text
    assert "gone from storage" in text
    assert "restore the file" in text


def test_the_library_missing_names_the_extra_and_never_reads_the_folder(
        history: History, monkeypatch: pytest.MonkeyPatch) -> None:
    package, extra = (("deltalake", "delta") if (Path(history.url) / "_delta_log").exists()
                      else ("pyiceberg", "iceberg"))
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(MissingDependencyError, match=rf"pip install 'shardkit\[{extra}\]'"):
        shardkit.make_reader(history.url)


def test_a_corrupt_delta_log_is_refused(tmp_path: Path) -> None:
    history = make_history("delta", tmp_path / "t", OPS)
    last = sorted((Path(history.url) / "_delta_log").glob("*.json"))[-1]
    last.write_text("{not json")
    with pytest.raises(CorruptDatasetError, match="Delta log"):
        shardkit.open_dataset(history.url)


def test_a_delta_log_with_a_commit_missing_is_refused(tmp_path: Path) -> None:
    history = make_history("delta", tmp_path / "t", OPS)
    (Path(history.url) / "_delta_log" / "00000000000000000001.json").unlink()
    with pytest.raises(CorruptDatasetError, match="corrupt or partly missing"):
        shardkit.open_dataset(history.url)


def test_an_unknown_delta_reader_feature_is_refused_by_name(tmp_path: Path) -> None:
    history = make_history("delta", tmp_path / "t", OPS)
    log = Path(history.url) / "_delta_log"
    feature = ["someFutureFeature"]
    protocol = {"protocol": {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": feature,
                             "writerFeatures": feature}}
    commit = {"commitInfo": {"timestamp": 1, "operation": "SET TBLPROPERTIES"}}
    (log / f"{len(history.snapshots):020d}.json").write_text(json.dumps(protocol) + "\n" + json.dumps(commit))
    with pytest.raises(UnsupportedTableError, match="someFutureFeature"):
        shardkit.open_dataset(history.url)


def test_corrupt_iceberg_metadata_is_refused(tmp_path: Path) -> None:
    history = make_history("iceberg", tmp_path / "t", OPS)
    newest = sorted((Path(history.url) / "metadata").glob("*.metadata.json"))[-1]
    newest.write_text("{not json")
    with pytest.raises(CorruptDatasetError, match="Iceberg metadata"):
        shardkit.open_dataset(history.url)


def test_a_missing_iceberg_manifest_list_is_refused(tmp_path: Path) -> None:
    history = make_history("iceberg", tmp_path / "t", OPS)
    for manifest_list in (Path(history.url) / "metadata").glob(f"snap-{history.current}-*.avro"):
        manifest_list.unlink()
    with pytest.raises(CorruptDatasetError, match="manifests cannot be read"):
        shardkit.open_dataset(history.url)


def test_a_file_replaced_outside_the_table_is_refused(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    history = make_history("delta", tmp_path / "t", OPS)
    victim = data_files(history)[0]
    pq.write_table(pq.read_table(victim).slice(0, 3), victim)
    from shardkit.dataset.tables import _files

    _files._cache.clear()
    with pytest.raises(CorruptDatasetError, match="replaced outside the table"):
        shardkit.open_dataset(history.url)


def test_a_table_is_never_indexed_as_a_folder(history: History) -> None:
    with pytest.raises(shardkit.errors.NotADatasetError, match="open the table itself"):
        shardkit.write_summary(history.url)
    assert not (Path(history.url) / "_metadata").exists()
