"""Integers that `shardkit.dataset.convert` reads exactly: a CSV or JSON column of integers past int64,
which pyarrow types float64, is uint64 where every value fits (as pandas reads it), else refused; integers
of a file widened to floats by the other files' column are checked for every digit.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
from collections.abc import Callable, Collection
from typing import TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pj

from shardkit._storage.location import Location
from shardkit.errors import SchemaMismatchError

__all__ = ["INT64", "UINT64_MAX", "integer_columns", "integer_columns_each", "keep_digits", "rounds",
           "to_floats"]

INT64 = (-(2**63), 2**63 - 1)
UINT64_MAX = 2**64 - 1
#: A number token past int64 in a file's bytes: 19 digits from a 9 (int64 ends at 9223372036854775807) or
#: 20 and more, in no float (no ``.`` or exponent next to it) and no word. Searched by pyarrow's RE2:
#: much cheaper than parsing a file's first block once more as text. Snowflake IDs (19 digits from a 1)
#: do not match.
_PAST_INT64 = r"(?:^|[^0-9A-Za-z_.])(?:9[0-9]{18}|[0-9]{20,})(?:[^0-9A-Za-z_.]|$)"
_CSV_INTEGER = r"^\s*-?[0-9]+\s*$"  # what pyarrow's CSV parser takes as an integer (no "+")
_JSON_FLOAT = re.compile(r"couldn't parse:\S*[.eE]")  # pyarrow's words for a JSON float read as an integer
#: A column of a file's first block: uint64 (every value fits it), its integers (row, value), or None (a
#: value that is no integer: a float column).
Values: TypeAlias = pa.DataType | list[tuple[int, int]] | None
_MANTISSA = {16: 11, 32: 24, 64: 53}  # bits of a float's integers: float64 holds each up to 2**53


def integer_columns(loc: Location, path: str, fmt: str, names: list[str], *, block_bytes: int,
                    csv_nulls: list[str], place: Callable[[int], str]) -> dict[str, pa.DataType]:
    """Of the columns ``names`` that pyarrow typed float64 by the first block of the CSV or JSON file at
    ``path``, those that hold only integers there, one of them past int64: uint64, where every value fits.

    pyarrow types such a column float64, and every integer in it past 2**53 then loses digits
    (9007199254740993 becomes 9007199254740992) without a word. pandas reads it as uint64 where every
    value fits (else as Python objects, which a Parquet column cannot be): so does shardkit; a column that
    also holds a fraction or an exponent (``1.5``, ``1e3``) is a float column, left as it is. A file whose
    first block holds no number past int64 (`_PAST_INT64`, which tells it from the bytes) is not parsed
    again; one that does is parsed again, as text (CSV) or as uint64 (JSON: `_json_values`).

    Raises:
        SchemaMismatchError: a column of integers that no 64-bit integer type holds (one past uint64, or
            negatives and values past int64), naming the first that does not fit and its row (``place``:
            the file's row -> where it is in the source), with the fix.
    """
    with loc.arrow_fs.open_input_stream(path, compression="detect") as stream:
        head = stream.read_buffer(block_bytes)
    offsets = pa.py_buffer(np.array([0, head.size], np.int64))  # (one value, no copy, unlike pa.array)
    text = pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, head])
    if not pc.match_substring_regex(text, _PAST_INT64)[0].as_py():
        return {}
    values = _csv_values(loc, path, names, block_bytes, csv_nulls) if fmt == "csv" else _json_values(
        head.to_pybytes(), names, whole=head.size < block_bytes)
    found = {}
    for name, column in values.items():
        if isinstance(column, pa.DataType):
            found[name] = column
        elif column:
            found[name] = _fitting(loc.url, name, column, place, keep_digits(name, fmt))
    return found


def integer_columns_each(loc: Location, files: list[tuple[str, list[str]]], fmt: str, *, block_bytes: int,
                         csv_nulls: list[str], place: Callable[[int, int], str]
                         ) -> list[dict[str, pa.DataType]]:
    """`integer_columns` of each file (path, its float64 columns), read 8 at a time: one more request each,
    which a folder of many small files on an object store would wait for one after the other. The error
    raised is the first file's (``place``: the file's index and row -> where it is in the source)."""
    def one(i: int) -> dict[str, pa.DataType]:
        path, names = files[i]
        return integer_columns(loc, path, fmt, names, block_bytes=block_bytes, csv_nulls=csv_nulls,
                               place=functools.partial(place, i)) if names else {}

    if sum(1 for _, names in files if names) < 2:
        return [one(i) for i in range(len(files))]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(len(files))))


def keep_digits(name: str, fmt: str) -> str:
    """The fix for an integer of column ``name`` of a ``fmt`` source that its type would lose digits of."""
    keep = (f"Field({name!r}, 'str') to keep every digit as text" if fmt != "json" else
            f"Field({name!r}, 'str') for the values written as JSON strings (\"123\"; pyarrow reads no JSON "
            "number as text)")
    return f"declare the column's type in schema= (shardkit write --schema): {keep}, or 'float64' to round"


def rounds(integers: pa.DataType, floats: pa.DataType) -> bool:
    """Whether a float of type ``floats`` may round an integer of type ``integers`` (int64 to float64)."""
    return bool(pa.types.is_integer(integers) and pa.types.is_floating(floats)
                and integers.bit_width > _MANTISSA[floats.bit_width])


def to_floats(batch: pa.RecordBatch, schema: pa.Schema, *, url: str, fmt: str, place: Callable[[int], str],
              declared: Collection[str]) -> pa.RecordBatch:
    """``batch`` with its integer columns cast to the float types ``schema`` gives them (a file's integers
    in a column that other files make float64), refusing an integer the float type would round (but in
    the columns ``declared`` float: their rounding is asked for)."""
    columns = []
    for name, values in zip(batch.schema.names, batch.columns, strict=True):
        t = schema.field(name).type
        if not rounds(values.type, t):
            columns.append(values)
            continue
        limit = 2 ** _MANTISSA[t.bit_width]  # (below it, every integer is exact: only the others are tried)
        low, high = (pc.min_max(values)[k].as_py() for k in ("min", "max"))
        if high is not None and (high > limit or low < -limit) and name not in declared:
            beyond = pc.greater(values, pa.scalar(limit, values.type))  # (of its type: uint64 is no int64)
            if not pa.types.is_unsigned_integer(values.type):
                beyond = pc.or_(beyond, pc.less(values, pa.scalar(-limit, values.type)))
            for i in np.flatnonzero(beyond.to_numpy(zero_copy_only=False)):
                v = values[int(i)].as_py()
                if (rounded := int(np.array(v).astype(dtype := np.dtype(t.to_pandas_dtype())))) != v:
                    raise SchemaMismatchError(
                        f"{url!r}: column {name!r} is {dtype} in the other files, but holds integers here; "
                        f"{dtype} cannot hold {v} ({place(int(i))}) exactly, it would be {rounded}; "
                        + keep_digits(name, fmt))
        columns.append(values.cast(t, safe=False))
    return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)


def _csv_values(loc: Location, path: str, names: list[str], block_bytes: int, nulls: list[str]
                ) -> dict[str, Values]:
    """Each column ``names`` of a CSV file's first block, as pyarrow cuts it: uint64 where its values are
    integers that fit it, else its integers (row, value); None for a column with a value that is none."""
    convert = pcsv.ConvertOptions(include_columns=names, column_types=dict.fromkeys(names, pa.string()),
                                  null_values=nulls, strings_can_be_null=True)
    with loc.arrow_fs.open_input_stream(path, compression="detect") as stream:
        reader = pcsv.open_csv(stream, read_options=pcsv.ReadOptions(block_size=block_bytes),
                               parse_options=pcsv.ParseOptions(newlines_in_values=True),
                               convert_options=convert)
        try:
            block = reader.read_next_batch()
        except StopIteration:
            return dict.fromkeys(names)
    found: dict[str, Values] = {}
    for name in names:
        text = block.column(name)
        if not pc.all(pc.match_substring_regex(text, _CSV_INTEGER)).as_py():
            found[name] = None  # (a fraction, an exponent, a nan: a float column)
            continue
        try:
            found[name] = text.cast(pa.uint64()).type
        except pa.ArrowInvalid:  # (a negative, one past uint64, or spaces that a cast does not trim)
            found[name] = [(i, int(v)) for i, v in enumerate(text.to_pylist()) if v is not None]
    return found


def _json_values(head: bytes, names: list[str], *, whole: bool) -> dict[str, Values]:
    """As `_csv_values`, of a JSON-lines file whose first bytes are ``head`` (the file itself if
    ``whole``, else cut at its last line's end, as pyarrow cuts its first block). pyarrow reads no JSON
    number as text: each column is read as uint64 (fast), and one that fails on a value with no
    fraction nor exponent (-1, 99999999999999999999) by Python's json (slower, so only then), which
    keeps every digit of an integer and tells ``1.0`` and ``1e3`` as floats, as pyarrow does."""
    block = head if whole else head[:head.rfind(b"\n") + 1]
    found: dict[str, Values] = {}
    for name in names:
        options = pj.ParseOptions(explicit_schema=pa.schema([(name, pa.uint64())]),
                                  unexpected_field_behavior="ignore")
        try:
            pj.read_json(pa.BufferReader(block), pj.ReadOptions(block_size=max(len(block), 1)), options)
            found[name] = pa.uint64()
        except pa.ArrowInvalid as e:
            if _JSON_FLOAT.search(str(e)):
                found[name] = None
    if rest := [name for name in names if name not in found]:
        try:
            rows = [json.loads(line) for line in block.splitlines() if line.strip()]
        except ValueError:  # (what pyarrow reads and Python does not: left to pyarrow, as float64)
            return {**found, **dict.fromkeys(rest)}
        for name in rest:
            values = [(i, row.get(name)) for i, row in enumerate(rows) if isinstance(row, dict)]
            found[name] = None if any(v is not None and type(v) is not int for _, v in values) else [
                (i, v) for i, v in values if v is not None]
    return found


def _fitting(url: str, name: str, values: list[tuple[int, int]], place: Callable[[int], str], fix: str
             ) -> pa.DataType:
    """The integer type that holds every value (row, value) of the column ``name``: uint64 (int64 where
    they all fit it, which pyarrow would have inferred); else the error naming the first that does not."""
    if all(INT64[0] <= v <= INT64[1] for _, v in values):
        return pa.int64()
    if all(0 <= v <= UINT64_MAX for _, v in values):
        return pa.uint64()
    row, v = next(((r, v) for r, v in values if not INT64[0] <= v <= UINT64_MAX), (-1, 0))
    if row >= 0:
        raise SchemaMismatchError(
            f"{url!r}: column {name!r} holds the integer {v} ({place(row)}), which no 64-bit integer type "
            f"holds (int64 ends at {INT64[1]}, uint64 at {UINT64_MAX}), and float64 rounds integers past "
            "2**53; " + fix)
    r1, big = next((r, v) for r, v in values if v > INT64[1])
    r2, negative = next((r, v) for r, v in values if v < 0)
    raise SchemaMismatchError(
        f"{url!r}: column {name!r} holds the integer {big} ({place(r1)}), past int64 (which ends at "
        f"{INT64[1]}), and {negative} ({place(r2)}), which uint64 cannot hold: no 64-bit integer type holds "
        "both, and float64 rounds integers past 2**53; " + fix)
