"""The public surface: `shardkit.__all__` is exactly these names, sorted, and every one resolves."""

from __future__ import annotations

import shardkit

EXPECTED = {
    "Dataset",
    "Field",
    "ImageCodec",
    "NdarrayCodec",
    "Reader",
    "RowGroup",
    "ScalarCodec",
    "Schema",
    "ShardkitError",
    "SummaryMissingWarning",
    "TensorCodec",
    "__version__",
    "errors",
    "make_reader",
    "open_dataset",
    "write_dataset",
    "write_summary",
}


def test_all_is_sorted_and_exact() -> None:
    assert shardkit.__all__ == sorted(shardkit.__all__)
    assert len(shardkit.__all__) == len(set(shardkit.__all__))
    assert set(shardkit.__all__) == EXPECTED


def test_every_exported_name_resolves() -> None:
    for name in shardkit.__all__:
        assert getattr(shardkit, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from shardkit import *", namespace)
    assert set(namespace) - {"__builtins__"} == EXPECTED


def test_public_names_are_not_private_modules() -> None:
    public = {name for name in dir(shardkit) if not name.startswith("_")}
    # modules Python attaches on import (shardkit.dataset, shardkit.reader, ...) are not part of the API
    import types

    extra = {name for name in public - EXPECTED if not isinstance(getattr(shardkit, name), types.ModuleType)}
    assert extra == set()


def test_exported_classes_say_they_belong_to_shardkit() -> None:
    for name in shardkit.__all__:
        obj = getattr(shardkit, name)
        if isinstance(obj, type):
            assert obj.__module__.startswith("shardkit."), (name, obj.__module__)
