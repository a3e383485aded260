"""A filter on a table lists only the files its log or manifests say may hold a matching row (Delta:
partition values and column statistics; Iceberg: column bounds): fewer files opened, the same rows read,
and resume on a pruned snapshot exactly once."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.dataset.tables._prune import dnf_of
from tests.dataset.tables import History, make_history, read_ids

OPS = [("append", 100), ("append", 100), ("append", 100), ("delete", 30), ("append", 100)]


@pytest.fixture(scope="module", params=["delta", "iceberg"])
def history(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> History:
    return make_history(request.param, tmp_path_factory.mktemp(request.param) / "t", OPS)


def _ids(history: History, filter: Any) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sorted(read_ids(history.url, filter=filter))


def _expected(history: History, terms: list[tuple[str, str, Any]]) -> list[int]:
    ops = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "=": np.equal,
           "!=": np.not_equal}
    ids = np.array(sorted(history.ids()))
    keep = np.ones(len(ids), dtype=bool)
    for _, op, value in terms:
        keep &= np.isin(ids, value) if op == "in" else ops[op](ids, value)
    return ids[keep].tolist()


def test_a_range_filter_opens_only_the_files_that_hold_it(history: History) -> None:
    whole = shardkit.open_dataset(history.url)
    pruned = shardkit.open_dataset(history.url, filter=[("id", ">=", 110), ("id", "<", 190)])
    assert len(pruned.files) == 1 < len(whole.files)  # the second append's file alone
    assert _ids(history, [("id", ">=", 110), ("id", "<", 190)]) == list(range(110, 190))


def test_a_filter_no_file_can_match_reads_no_row(history: History) -> None:
    ds = shardkit.open_dataset(history.url, filter=[("id", ">", 10_000)])
    assert len(ds.files) == 1  # one file kept for the schema
    with pytest.raises(shardkit.errors.ReaderError, match="filter"):
        read_ids(history.url, filter=[("id", ">", 10_000)])


def test_an_expression_or_a_string_prunes_nothing(history: History) -> None:
    import pyarrow.compute as pc

    whole = len(shardkit.open_dataset(history.url).files)
    assert len(shardkit.open_dataset(history.url, filter=pc.field("id") > 350).files) == whole
    assert dnf_of(pc.field("id") > 350) is None
    assert dnf_of([("id", "like", 3)]) is None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lo=st.integers(-10, 450), width=st.integers(0, 300),
       op=st.sampled_from(["<", "<=", ">", ">=", "=", "!="]), picks=st.lists(st.integers(0, 420), max_size=4))
def test_pruned_reads_are_the_filter_applied_to_every_row(history: History, lo: int, width: int, op: str,
                                                           picks: list[int]) -> None:
    terms: list[tuple[str, str, Any]] = [("id", ">=", lo), ("id", "<", lo + width),
                                         ("id", op, lo + width // 2)]
    if picks:
        terms.append(("id", "in", picks))
    expected = _expected(history, terms)
    if not expected:
        return  # a reader refuses a filter that matches no row (tested above)
    assert _ids(history, terms) == expected


def test_resume_on_a_pruned_snapshot_after_the_table_moved_on(tmp_path: Path) -> None:
    history = make_history("delta", tmp_path / "t", OPS)
    terms = [("id", ">=", 50), ("id", "<", 250)]
    expected = _expected(history, terms)
    kw: dict[str, Any] = {"batch_size": 16, "seed": 2, "remainder": "uneven", "filter": terms}
    seen: list[int] = []
    states = []
    for shard in range(2):
        with shardkit.make_reader(history.url, shard=shard, num_shards=2, **kw) as r:
            seen += [int(i) for i in next(iter(r))["id"]]
            states.append(r.state_dict())
    history.apply(("delete", 120))  # the table moves on: rows of the filter's range deleted
    for state in states:
        with shardkit.make_reader(history.url, shard=0, num_shards=1, **kw) as r:
            r.load_state_dict(state)
            assert r.dataset.snapshot is not None
            version = r.dataset.snapshot.version
            assert len(r.dataset.files) < len(shardkit.open_dataset(history.url, version=version).files)
            seen += [int(i) for b in r for i in b["id"]]
    assert sorted(set(seen)) == expected


def test_delta_partition_values_prune(tmp_path: Path) -> None:
    from deltalake import write_deltalake

    url = str(tmp_path / "t")
    ids = np.arange(400)
    write_deltalake(url, pa.table({"id": ids, "day": ids // 100}), partition_by=["day"])
    ds = shardkit.open_dataset(url, filter=[("day", "in", [1, 3])])
    assert len(ds.files) == 2
    assert sorted(read_ids(url, filter=[("day", "in", [1, 3])])) == [*range(100, 200), *range(300, 400)]
    assert len(shardkit.open_dataset(url, filter=[("day", "!=", 2)]).files) == 3
