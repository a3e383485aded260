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


# -- every public package ------------------------------------------------------------------------------
# A package is public unless a part of its name starts with "_"; its __init__ is its surface.

import importlib  # noqa: E402
import pkgutil  # noqa: E402
import re  # noqa: E402
import types  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

PACKAGE_ROOT = Path(shardkit.__file__).parent


def _public_packages() -> list[str]:
    found = [info.name for info in pkgutil.walk_packages(shardkit.__path__, "shardkit.")
             if info.ispkg and not any(part.startswith("_") for part in info.name.split(".")[1:])]
    return sorted(found)


PUBLIC_PACKAGES = _public_packages()
PUBLIC_MODULES = ["shardkit.errors", "shardkit.jax", "shardkit.tf", "shardkit.torch"]  # top-level surfaces


def test_the_public_packages_are_the_layout_of_the_design() -> None:
    assert {"shardkit.bench", "shardkit.cli", "shardkit.cluster", "shardkit.cluster.engines",
            "shardkit.cluster.monitor", "shardkit.cluster.render", "shardkit.cluster.supervisor",
            "shardkit.dataset", "shardkit.dataset.convert", "shardkit.dataset.petastorm",
            "shardkit.dataset.spark", "shardkit.dataset.tables", "shardkit.dataset.write", "shardkit.job",
            "shardkit.reader", "shardkit.reader.adapters", "shardkit.trainer", "shardkit.trainer.checkpoint",
            "shardkit.trainer.strategies"} <= set(PUBLIC_PACKAGES)


@pytest.mark.parametrize("name", PUBLIC_PACKAGES + PUBLIC_MODULES)
def test_every_public_surface_has_a_sorted_all_whose_names_resolve(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} says what it is"
    exported = module.__dict__.get("__all__")
    assert isinstance(exported, list), f"{name} has an __all__"
    assert exported == sorted(exported), name
    assert len(exported) == len(set(exported)), name
    for member in exported:
        obj = getattr(module, member)
        assert obj is not None, (name, member)
        if isinstance(obj, type | types.FunctionType) and name not in PUBLIC_MODULES:
            owner = obj.__module__  # defined in this package, not borrowed from another
            assert owner == name or owner.startswith(name + "."), (name, member, owner)
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(exported), name


def test_no_module_re_exports_a_siblings_names() -> None:
    """A module's __all__ names what it defines; a package's __init__ gathers its modules' names."""
    borrowed = []
    for info in pkgutil.walk_packages(shardkit.__path__, "shardkit."):
        if info.ispkg or info.name.endswith(".__main__") or info.name in PUBLIC_MODULES:
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # a framework this machine lacks (the suite installs them all)
            continue
        for member in module.__dict__.get("__all__", []):
            obj = getattr(module, member)
            if isinstance(obj, type | types.FunctionType) and obj.__module__ != info.name:
                borrowed.append(f"{info.name}.{member} is {obj.__module__}'s")
    assert borrowed == []


def test_no_folder_is_a_family_of_prefixed_modules() -> None:
    """Three or more siblings named <word>_*.py are a concept that wants its own folder."""
    families = {}
    for folder in [PACKAGE_ROOT, *(p for p in PACKAGE_ROOT.rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        words = Counter(m.group(1) for f in folder.glob("*.py") if (m := re.match(r"([a-z0-9]+)_", f.name)))
        crowded = {word: n for word, n in words.items() if n >= 3}
        if crowded:
            families[str(folder.relative_to(PACKAGE_ROOT))] = crowded
    assert families == {}
