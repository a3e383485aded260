"""Keyword arguments `make_reader` does not take, explained before anything opens."""

from __future__ import annotations

import dataclasses
import inspect
import keyword
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.errors import DatasetNotFoundError, ReaderError, UnknownArgumentError
from shardkit.reader._arguments import PETASTORM, explained
from shardkit.reader._cache import CacheConfig

TAKES = set(inspect.signature(shardkit.make_reader).parameters)
# called untyped: type checkers refuse the wrong names at once (the signature is kept), users' code may not
make_reader: Any = shardkit.make_reader
MISSING = "/nonexistent/shardkit-test-dataset"  # an argument error must come before the dataset is opened


def test_the_signature_and_docstring_are_make_readers_own() -> None:
    assert shardkit.make_reader.__name__ == "make_reader"
    assert "Read one shard" in (shardkit.make_reader.__doc__ or "")
    assert {"shard", "num_shards", "storage_options"} <= TAKES


def test_petastorms_arguments_name_shardkits() -> None:
    with pytest.raises(UnknownArgumentError) as info:
        make_reader(MISSING, cur_shard=1, shard_count=4, schema_fields=["label"], workers_count=3)
    message = str(info.value)
    assert "cur_shard=1, shard_count=4, schema_fields=['label'], workers_count=3" in message
    for petastorm, ours in [("cur_shard", "shard="), ("shard_count", "num_shards="),
                            ("schema_fields", "columns="), ("workers_count", "workers=")]:
        assert f"{petastorm} is Petastorm's; shardkit's is {ours}" in message
    # still what Python raises for an unexpected keyword, and a reader-argument error
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, ReaderError)


def test_each_petastorm_counterpart_is_an_argument_that_exists() -> None:
    for name, instead in PETASTORM.items():
        assert name not in TAKES, name  # a name shardkit takes too must not be explained away
        if instead.startswith("nothing: "):
            continue
        target = re.match(r"(\w+)=", instead)
        assert target, (name, instead)
        assert target.group(1) in TAKES, (name, instead)
    cache = re.search(r"CacheConfig\(folder, (\w+)=", PETASTORM["cache_size_limit"])
    assert cache
    assert cache.group(1) in {f.name for f in dataclasses.fields(CacheConfig)}


def test_no_counterpart_says_why() -> None:
    with pytest.raises(UnknownArgumentError, match=r"cache_row_size_estimate is Petastorm's, with no "
                       r"counterpart here \(the cache keeps whole row groups\)"):
        make_reader(MISSING, cache_row_size_estimate=1024)
    with pytest.raises(UnknownArgumentError, match=r"reader_pool_type is Petastorm's; shardkit's is "
                       r"transform_workers= \(processes that decode images and run transform="):
        make_reader(MISSING, reader_pool_type="process")


def test_a_transform_spec_is_explained() -> None:
    with pytest.raises(UnknownArgumentError, match=r"transform_spec is Petastorm's; shardkit's is transform= "
                       r"\(a function per sample"):
        make_reader(MISSING, transform_spec=object())

    class TransformSpec:  # Petastorm's shape: a function and the fields it edits and removes
        def __init__(self) -> None:
            self.func, self.edit_fields, self.removed_fields = (lambda row: row), [], []

    with pytest.raises(ReaderError, match=r"transform= takes a function of one sample.*Petastorm "
                       r"TransformSpec.*transform=spec\.func"):
        make_reader(MISSING, transform=TransformSpec())


def test_a_typo_gets_the_closest_names() -> None:
    with pytest.raises(UnknownArgumentError, match=r"num_shard is not one of its arguments \(did you mean "
                       r"num_shards="):
        make_reader(MISSING, num_shard=2)
    with pytest.raises(UnknownArgumentError, match=r"batchsize=64\. batchsize .*did you mean batch_size=\)"):
        make_reader(MISSING, batchsize=64)


def test_the_adapters_pass_the_explanation_on() -> None:
    import shardkit.torch

    loader: Any = shardkit.torch.make_loader
    with pytest.raises(UnknownArgumentError, match="cur_shard is Petastorm's"):
        loader(MISSING, cur_shard=0)


def test_petastorms_make_batch_reader_points_at_make_reader() -> None:
    with pytest.raises(AttributeError, match=r"make_batch_reader.*shardkit\.make_reader yields batches"):
        shardkit.make_batch_reader  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        shardkit.no_such_thing  # type: ignore[attr-defined]  # noqa: B018


def test_known_arguments_still_reach_the_reader() -> None:
    with pytest.raises(DatasetNotFoundError):
        make_reader(MISSING, shard=0, num_shards=1, batch_size=8)


def _unknown_name() -> st.SearchStrategy[str]:
    return st.from_regex(r"[a-z_][a-z0-9_]{0,20}", fullmatch=True).filter(
        lambda n: n not in TAKES and not keyword.iskeyword(n))


@settings(max_examples=60, deadline=None)
@given(names=st.lists(_unknown_name(), min_size=1, max_size=4, unique=True))
def test_every_unknown_name_is_named_before_anything_opens(names: list[str]) -> None:
    with pytest.raises(UnknownArgumentError) as info:
        make_reader(MISSING, **{n: i for i, n in enumerate(names)})
    message = str(info.value)
    for i, name in enumerate(names):
        assert f"{name}={i}" in message
        assert re.search(rf"(^|[ ;.]){re.escape(name)} is ", message), (name, message)


def test_a_function_with_kwargs_cannot_be_explained() -> None:
    def anything(**kwargs: object) -> None:
        pass

    with pytest.raises(TypeError, match="takes \\*\\*kwargs"):
        explained(anything)
