"""Row filters: validated up front, pushed down to row-group statistics, then counted exactly.

A filter changes how many samples there are, and equal shards need that number before reading. So
`select_rows` first drops the row groups whose Parquet statistics rule the filter out (via
``pyarrow.dataset``'s row-group pruning), then reads only the filter's columns of the others and keeps
the indices of matching rows. The plan then works on those rows as if they were the dataset. A row
group whose filter columns cannot be read raises `CorruptDatasetError`, or with ``on_error="skip"``
counts as having no matching rows (and is reported as skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from shardkit.dataset.index import Dataset
from shardkit.errors import CorruptDatasetError, ReaderError

Filter: TypeAlias = pc.Expression | Sequence[Any]


def to_expression(filter: Filter, arrow_schema: pa.Schema) -> pc.Expression:
    """Turn a filter (an Arrow expression, or pyarrow's DNF tuples) into a checked expression.

    Example:
        >>> to_expression(pc.field("label") < 5, schema)
        >>> to_expression([("label", "<", 5), ("split", "=", "train")], schema)   # AND of tuples
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
        _empty(arrow_schema).filter(expr)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, KeyError) as e:
        raise ReaderError(
            f"filter {expr} does not apply to this dataset: {e}. Its columns are "
            f"{arrow_schema.names}; compare each column with a value of its type"
        ) from e
    return expr


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


def select_rows(ds: Dataset, expr: pc.Expression, on_error: Literal["raise", "skip"] = "raise"
                ) -> tuple[np.ndarray, dict[int, np.ndarray], int, dict[int, str]]:
    """Matching rows per row group: (counts, {row group: indices where not all match}, pruned groups,
    {row group: error} of those skipped as corrupt with ``on_error="skip"``, which match no row)."""
    may_match = _prunable(ds, expr)
    columns = filter_columns(expr, ds.arrow_schema)
    counts = np.zeros(len(ds.row_groups), dtype=np.int64)
    selection: dict[int, np.ndarray] = {}
    skipped: dict[int, str] = {}
    for i, rg in enumerate(ds.row_groups):
        if not may_match[i]:
            continue
        try:
            table = ds.read_row_group(i, columns)
        except CorruptDatasetError as e:
            if on_error == "raise":
                raise
            skipped[i] = str(e)
            continue
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


def _prunable(ds: Dataset, expr: pc.Expression) -> np.ndarray:
    """Which row groups may match, by their min/max statistics (True when unknown)."""
    may = np.ones(len(ds.row_groups), dtype=bool)
    by_file: dict[str, list[int]] = {}
    for i, rg in enumerate(ds.row_groups):
        by_file.setdefault(rg.file, []).append(i)
    fmt = pads.ParquetFileFormat()
    for file, idxs in by_file.items():
        path = ds.location.join(file)
        try:
            frag = fmt.make_fragment(path, filesystem=ds.location.arrow_fs,
                                     row_groups=[ds.row_groups[i].index for i in idxs])
            kept = {rg.id for rg in frag.subset(filter=expr, schema=ds.arrow_schema).row_groups}
        except (pa.ArrowException, OSError):
            continue  # statistics unusable: every row group stays a candidate
        for i in idxs:
            may[i] = ds.row_groups[i].index in kept
    return may
