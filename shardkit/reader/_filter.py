"""Row filters: validated up front, pushed down to row-group statistics, then counted exactly.

A filter changes how many samples there are, and equal shards need that number before reading. So
`select_rows` first drops the row groups whose Parquet statistics rule the filter out (via
``pyarrow.dataset``'s row-group pruning), then reads only the filter's columns of the others and keeps
the indices of matching rows. The plan then works on those rows as if they were the dataset. A row
group whose filter columns cannot be read raises `CorruptDatasetError`, or with ``on_error="skip"``
counts as having no matching rows (and is reported as skipped).

Hive partition keys. A dataset whose files sit in folders like ``year=2024/split=train/`` has columns
that live only in the folder names (`Dataset.partition_keys`; shardkit does not read them into batches).
A filter may still name them: `Partitions` gives each file its values, with the types
``pyarrow.dataset.dataset(url, partitioning="hive")`` gives them (int32 when every value of a key is
one, else string; ``__HIVE_DEFAULT_PARTITION__`` is null), so a filter keeps the rows pyarrow's own
filtered read keeps. A file whose folders rule the filter out is pruned unread, and a filter on
partition keys alone reads no data at all to count its rows.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from shardkit.dataset import Dataset
from shardkit.errors import CorruptDatasetError, ReaderError

Filter: TypeAlias = pc.Expression | Sequence[Any]


HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # a Hive partition folder's value for null
_INT32 = re.compile(r"-?[0-9]+")


@dataclasses.dataclass(frozen=True)
class Partitions:
    """The Hive partition keys of a dataset's files that are not columns (``year`` of ``year=2024/``):
    their Arrow ``schema`` and, per file, its partition expression and values. Create with `of`."""

    schema: pa.Schema
    expressions: dict[str, pc.Expression]
    values: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, ds: Dataset) -> Partitions | None:
        """The partitions of ``ds`` (None when its files are not in Hive partition folders).

        The types are those ``pyarrow.dataset``'s Hive partitioning infers from the folder names (its
        discovery without dictionaries): int32 when every value of a key is an int32, else string (null
        when a key has no value but ``__HIVE_DEFAULT_PARTITION__``); values are URL-decoded.
        """
        keys = ds.partition_keys
        if not keys:
            return None
        folders = {file: file.rsplit("/", 1)[0] + "/" if "/" in file else "" for file in ds.files}
        seen: dict[str, set[str]] = {k: set() for k in keys}
        for folder in set(folders.values()):
            for part in folder.split("/"):
                key, eq, value = part.partition("=")
                if eq and key in seen:
                    seen[key].add(value)
        schema = pa.schema([(k, _hive_type(seen[k])) for k in keys])
        hive = pads.HivePartitioning(schema)
        expressions = {file: hive.parse(folder) for file, folder in folders.items()}
        values = {file: {k: pads.get_partition_keys(e).get(k) for k in keys}
                  for file, e in expressions.items()}
        return cls(schema, expressions, values)

    def columns(self, file: str, num_rows: int, names: Sequence[str]) -> dict[str, pa.Array]:
        """The partition columns ``names`` of ``file``'s rows: its values, ``num_rows`` times."""
        return {name: pa.repeat(pa.scalar(self.values[file][name], type=self.schema.field(name).type),
                                num_rows) for name in names}


def _hive_type(values: set[str]) -> pa.DataType:
    present = [urllib.parse.unquote(v) for v in values if v != HIVE_NULL]
    if not present:
        return pa.null()
    if all(_INT32.fullmatch(v) and -(2**31) <= int(v) < 2**31 for v in present):
        return pa.int32()
    return pa.string()


def to_expression(filter: Filter, arrow_schema: pa.Schema, partitions: Partitions | None = None
                  ) -> pc.Expression:
    """Turn a filter (an Arrow expression, or pyarrow's DNF tuples) into a checked expression.

    Example:
        >>> to_expression(pc.field("label") < 5, schema)
        >>> to_expression([("label", "<", 5), ("split", "=", "train")], schema)   # AND of tuples
        >>> to_expression(pc.field("year") == 2024, schema, Partitions.of(ds))     # a partition key

    With ``partitions``, the filter may also name the Hive partition keys (see the module docstring).
    """
    if isinstance(filter, pc.Expression):
        expr = filter
    else:
        try:
            expr = pq.filters_to_expression(list(filter))
        except (TypeError, ValueError) as e:
            raise ReaderError(
                f"filter={filter!r} is not a pyarrow expression nor a list of (column, op, value) "
                f"tuples: {e}. Example: pyarrow.compute.field('label') < 5"
            ) from e
    try:
        _empty(_with(arrow_schema, partitions)).filter(expr)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, KeyError) as e:
        keys = "" if partitions is None else (
            f", and its Hive partition keys (from the folder names, typed as pyarrow.dataset types "
            f"them) are {', '.join(f'{f.name}: {f.type}' for f in partitions.schema)}")
        raise ReaderError(
            f"filter {expr} does not apply to this dataset: {str(e).replace(chr(10), ', ')}. Its columns are "
            f"{arrow_schema.names}{keys}; compare each column with a value of its type"
        ) from e
    return expr


def _with(arrow_schema: pa.Schema, partitions: Partitions | None) -> pa.Schema:
    """The dataset's schema with the partition keys as further columns."""
    return arrow_schema if partitions is None else pa.schema([*arrow_schema, *partitions.schema])


def filter_columns(expr: pc.Expression, arrow_schema: pa.Schema) -> list[str]:
    """The columns an expression reads (by name, in schema order).

    Arrow does not list an expression's fields, so: every column whose name appears in its text is a
    candidate, and a candidate is needed when the expression no longer evaluates without it (a name
    that only occurs inside another name or a string literal is not read).
    """
    text = str(expr)
    candidates = [name for name in arrow_schema.names if name in text]
    needed = []
    for name in candidates:
        rest = pa.schema([f for f in arrow_schema if f.name != name])
        try:
            _empty(rest).filter(expr)
        except (pa.ArrowException, KeyError):
            needed.append(name)
    return needed


def _empty(arrow_schema: pa.Schema) -> pa.Table:
    return pa.table({f.name: pa.array([], type=f.type) for f in arrow_schema})


def select_rows(ds: Dataset, expr: pc.Expression, on_error: Literal["raise", "skip"] = "raise",
                partitions: Partitions | None = None
                ) -> tuple[np.ndarray, dict[int, np.ndarray], int, dict[int, str]]:
    """Matching rows per row group: (counts, {row group: indices where not all match}, pruned groups,
    {row group: error} of those skipped as corrupt with ``on_error="skip"``, which match no row).

    A filter on ``partitions`` keys sees each file's values (as constant columns); a filter on them
    alone reads no row group."""
    may_match = _prunable(ds, expr, partitions)
    columns = filter_columns(expr, _with(ds.arrow_schema, partitions))
    stored = [c for c in columns if c in ds.arrow_schema.names]
    keys = [c for c in columns if c not in stored]
    counts = np.zeros(len(ds.row_groups), dtype=np.int64)
    selection: dict[int, np.ndarray] = {}
    skipped: dict[int, str] = {}
    for i, rg in enumerate(ds.row_groups):
        if not may_match[i]:
            continue
        if stored:
            try:
                table = ds.read_row_group(i, stored)
            except CorruptDatasetError as e:
                if on_error == "raise":
                    raise
                skipped[i] = str(e)
                continue
        else:  # no column of the data: the row group's rows are known without reading it
            table = pa.table({"__shardkit_rows": pa.nulls(rg.num_rows)}).select([])
        if keys and partitions is not None:
            for name, values in partitions.columns(rg.file, table.num_rows, keys).items():
                table = table.append_column(name, values)
        keep = _matches(table, expr)
        counts[i] = int(keep.sum())
        if counts[i] != rg.num_rows:
            selection[i] = np.flatnonzero(keep)
    return counts, selection, int((~may_match).sum()), skipped


def _matches(table: pa.Table, expr: pc.Expression) -> np.ndarray:
    indexed = table.append_column("__shardkit_row", pa.array(np.arange(table.num_rows)))
    rows = indexed.filter(expr).column("__shardkit_row").to_numpy()
    keep = np.zeros(table.num_rows, dtype=bool)
    keep[rows] = True
    return keep


def _prunable(ds: Dataset, expr: pc.Expression, partitions: Partitions | None = None) -> np.ndarray:
    """Which row groups may match, by their min/max statistics and their file's partition values
    (True when unknown)."""
    may = np.ones(len(ds.row_groups), dtype=bool)
    by_file: dict[str, list[int]] = {}
    for i, rg in enumerate(ds.row_groups):
        by_file.setdefault(rg.file, []).append(i)
    fmt = pads.ParquetFileFormat()
    schema = _with(ds.arrow_schema, partitions)
    for file, idxs in by_file.items():
        path = ds.location.join(file)
        guarantee = pc.scalar(True) if partitions is None else partitions.expressions[file]
        for key, value in ds.constants.get(file, {}).items():  # a table's partition values, from its log
            guarantee = guarantee & (pc.field(key).is_null() if value is None else pc.field(key) == value)
        try:
            frag = fmt.make_fragment(path, filesystem=ds.location.arrow_fs, partition_expression=guarantee,
                                     row_groups=[ds.row_groups[i].index for i in idxs])
            kept = {rg.id for rg in frag.subset(filter=expr, schema=schema).row_groups}
        except (pa.ArrowException, OSError):
            continue  # statistics unusable: every row group stays a candidate
        for i in idxs:
            may[i] = ds.row_groups[i].index in kept
    return may
