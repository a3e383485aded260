"""The format on disk: schema and codecs, writing (from pandas, Arrow and PySpark), opening (shardkit
and Petastorm datasets, plain Parquet folders, and Delta Lake and Iceberg tables read in place:
`shardkit.dataset.tables`), checking page checksums, and converting files (`shardkit.dataset.convert`).
"""

from shardkit.dataset._dataset import SLICE_ROWS, Dataset
from shardkit.dataset._field import Field
from shardkit.dataset._footers import RowGroup
from shardkit.dataset._pages import PageChecks
from shardkit.dataset.codecs import ImageCodec, NdarrayCodec, ScalarCodec, TensorCodec
from shardkit.dataset.open import SummaryMissingWarning, UncommittedFilesWarning, open_dataset
from shardkit.dataset.schema import Schema
from shardkit.dataset.spark import write_spark
from shardkit.dataset.take import KeptRows, RowAccess, take
from shardkit.dataset.verify import verify_dataset
from shardkit.dataset.write import write_dataset, write_summary

__all__ = [
    "Dataset",
    "Field",
    "ImageCodec",
    "KeptRows",
    "NdarrayCodec",
    "PageChecks",
    "RowAccess",
    "RowGroup",
    "SLICE_ROWS",
    "ScalarCodec",
    "Schema",
    "SummaryMissingWarning",
    "TensorCodec",
    "UncommittedFilesWarning",
    "open_dataset",
    "take",
    "verify_dataset",
    "write_dataset",
    "write_spark",
    "write_summary",
]
