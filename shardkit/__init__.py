"""shardkit: schema-extended Parquet datasets, sharded resumable readers, and a thin trainer.

Example:
    >>> import shardkit
    >>> shardkit.write_dataset(df, "file:///data/train", mode="overwrite")
    >>> ds = shardkit.open_dataset("file:///data/train")
"""

from shardkit import errors
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
from shardkit.errors import ShardkitError
from shardkit.reader import Reader, make_reader

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """Petastorm's ``make_batch_reader``, asked for here, points at `make_reader`."""
    if name == "make_batch_reader":
        raise AttributeError("module 'shardkit' has no attribute 'make_batch_reader': shardkit.make_reader "
                             "yields batches (dicts of numpy columns), as Petastorm's make_batch_reader did, "
                             "from shardkit, Petastorm and plain Parquet datasets alike")
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")

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
