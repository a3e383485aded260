"""shardkit: schema-extended Parquet datasets, sharded resumable readers, and a thin trainer.

Example:
    >>> import shardkit
    >>> shardkit.write_dataset(df, "file:///data/train", mode="overwrite")
    >>> ds = shardkit.open_dataset("file:///data/train")

The names below are imported when first used (PEP 562), not with the package: ``import shardkit.cli``,
the ``shardkit`` command's module, then costs milliseconds rather than pyarrow's and pandas' import, and
the command handles Ctrl-C from its start (`shardkit.cli.main`).
"""

import typing as _typing

from shardkit import errors
from shardkit.errors import ShardkitError

if _typing.TYPE_CHECKING:
    from shardkit.dataset import (
        Dataset,
        Field,
        ImageCodec,
        NdarrayCodec,
        RowGroup,
        ScalarCodec,
        Schema,
        SummaryMissingWarning,
        TensorCodec,
        open_dataset,
        write_dataset,
        write_summary,
    )
    from shardkit.reader import Reader, make_reader

__version__ = "0.1.0"

__all__ = [
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
]

_LAZY = {  # an exported name -> the module that defines it
    **dict.fromkeys(["Dataset", "Field", "ImageCodec", "NdarrayCodec", "RowGroup", "ScalarCodec", "Schema",
                     "SummaryMissingWarning", "TensorCodec", "open_dataset", "write_dataset",
                     "write_summary"], "shardkit.dataset"),
    **dict.fromkeys(["Reader", "make_reader"], "shardkit.reader"),
}


#: subpackages and modules reached as attributes (``shardkit.dataset.spark``), imported on first use
_SUBMODULES = frozenset({"cli", "cluster", "dataset", "jax", "reader", "tf", "torch", "trainer"})


def __getattr__(name: str) -> object:
    """An exported name or a subpackage, imported on first use and kept; Petastorm's
    ``make_batch_reader`` points at `make_reader`."""
    import importlib

    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"shardkit.{name}")
    elif name == "make_batch_reader":
        raise AttributeError("module 'shardkit' has no attribute 'make_batch_reader': shardkit.make_reader "
                             "yields batches (dicts of numpy columns), as Petastorm's make_batch_reader did, "
                             "from shardkit, Petastorm and plain Parquet datasets alike")
    else:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
