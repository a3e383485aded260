"""Which data files of a snapshot a filter can match, from what the table's log or manifests say of each
file (its partition values, its columns' minimum and maximum), before any footer is read.

A filter given as DNF tuples (``[("day", "=", 3), ("score", ">", 0.5)]``, or a list of such lists: an
``or`` of ``and``s) leaves out the files that cannot hold a matching row; the reader then applies the
filter to the rows of the files left, as for any dataset. A pyarrow expression prunes nothing here (its
row groups are still pruned by their statistics once the footers are read).

Pruning is conservative: a file is left out only when its statistics prove no row matches. Minimum and
maximum are used for numbers, booleans, dates and times only: tables truncate the statistics of strings
(Delta to 32 characters, Iceberg to 16), which then bound nothing exactly. ``!=`` and ``not in`` prune
on partition values only (a float column's NaN, which no statistic counts, is ``!=`` every value).
"""

from __future__ import annotations

import datetime
import decimal
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["dnf_of", "files_to_read", "may_match"]

Conjunction = list[tuple[str, str, Any]]
_ORDERED = (int, float, bool, datetime.date, datetime.datetime, datetime.time, decimal.Decimal)
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "=": operator.eq, "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
    ">": operator.gt, ">=": operator.ge,
}


def dnf_of(filter: Any) -> list[Conjunction] | None:
    """``filter`` as an ``or`` of ``and``s of ``(column, op, value)``; None when it is not DNF tuples (a
    pyarrow expression) or holds an operator pruning does not know."""
    if filter is None or not isinstance(filter, list | tuple) or not filter:
        return None
    groups = [filter] if isinstance(filter[0], tuple) else filter
    out: list[Conjunction] = []
    for group in groups:
        if not isinstance(group, list | tuple) or not group:
            return None
        conjunction: Conjunction = []
        for term in group:
            if not isinstance(term, tuple) or len(term) != 3 or not isinstance(term[0], str):
                return None
            column, op, value = term
            if op not in _COMPARE and op not in ("in", "not in"):
                return None
            conjunction.append((column, op, value))
        out.append(conjunction)
    return out


def may_match(dnf: list[Conjunction], count: int, partitions: Mapping[str, Sequence[Any]],
              lows: Mapping[str, Sequence[Any]], highs: Mapping[str, Sequence[Any]]) -> np.ndarray:
    """For each of ``count`` files, whether a row of it may match ``dnf``: ``partitions`` (column -> each
    file's value), ``lows`` and ``highs`` (column -> each file's minimum and maximum, None: unknown)."""
    keep = np.zeros(count, dtype=bool)
    for conjunction in dnf:
        match = np.ones(count, dtype=bool)
        for column, op, value in conjunction:
            if column in partitions:
                values = partitions[column]
                match &= np.fromiter((_exact(v, op, value) for v in values), dtype=bool, count=count)
            elif column in lows and column in highs:
                pairs = zip(lows[column], highs[column], strict=True)
                match &= np.fromiter((_within(lo, hi, op, value) for lo, hi in pairs), dtype=bool,
                                     count=count)
        keep |= match
    return keep


def files_to_read(dnf: list[Conjunction], count: int, partitions: Mapping[str, Sequence[Any]],
                  lows: Mapping[str, Sequence[Any]], highs: Mapping[str, Sequence[Any]]) -> np.ndarray:
    """`may_match`, but never no file: when none may, the first is kept, so that the dataset has its
    schema and the reader says that the filter matches no row."""
    keep = may_match(dnf, count, partitions, lows, highs)
    if count and not keep.any():
        keep[0] = True
    return keep


def _exact(x: Any, op: str, value: Any) -> bool:
    """Whether a partition value ``x`` satisfies the term (True when it cannot be told)."""
    try:
        if x is None:  # a null partition value matches no comparison (as pyarrow's filter reads it)
            return False
        if op == "in":
            return x in set(value)
        if op == "not in":
            return x not in set(value)
        return bool(_COMPARE[op](x, value))
    except TypeError:  # a value of another type than the column's (the reader will say so)
        return True


def _within(lo: Any, hi: Any, op: str, value: Any) -> bool:
    """Whether a file whose column lies in [lo, hi] may hold a row satisfying the term."""
    if lo is None or hi is None or not isinstance(lo, _ORDERED) or not isinstance(hi, _ORDERED):
        return True
    try:
        if op in ("in",):
            return any(_within(lo, hi, "=", v) for v in value)
        if isinstance(value, float) and math.isnan(value):
            return True
        if op in ("=", "=="):
            return bool(lo <= value <= hi)
        if op == "<":
            return bool(lo < value)
        if op == "<=":
            return bool(lo <= value)
        if op == ">":
            return bool(hi > value)
        if op == ">=":
            return bool(hi >= value)
    except TypeError:
        return True
    return True  # != and not in: see the module docstring
