"""The format on disk: schema and codecs, the writer, opening (Petastorm datasets, plain Parquet folders,
and Delta Lake and Iceberg tables read in place: `shardkit.dataset.tables`)."""

from shardkit.dataset._footers import RowGroup
from shardkit.dataset.codecs import ImageCodec, NdarrayCodec, ScalarCodec, TensorCodec
from shardkit.dataset.open import (
    Dataset,
    SummaryMissingWarning,
    UncommittedFilesWarning,
    open_dataset,
)
from shardkit.dataset.schema import Field, Schema
from shardkit.dataset.write import write_dataset, write_summary

__all__ = [
    "Dataset",
    "Field",
    "ImageCodec",
    "NdarrayCodec",
    "RowGroup",
    "ScalarCodec",
    "Schema",
    "SummaryMissingWarning",
    "TensorCodec",
    "UncommittedFilesWarning",
    "open_dataset",
    "write_dataset",
    "write_summary",
]
