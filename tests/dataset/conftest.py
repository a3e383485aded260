"""Fixtures shared by the dataset tests: dataset URLs (local and ``memory://``), reading back, comparing."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest

import shardkit
from shardkit.dataset import Field
from shardkit.dataset.codecs.tensor import STORAGES, TensorCodec


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh ``memory://`` dataset URL; the in-memory filesystem is cleaned afterwards."""
    root = f"/shardkit-test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{root}/ds"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory"])
def any_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A dataset URL that does not exist yet, on the local disk and on ``memory://``."""
    if request.param == "local":
        yield str(tmp_path / "ds")
    else:
        yield request.getfixturevalue("memory_url")


def files_under(url: str) -> set[str]:
    """Every file under ``url``, relative to it (hidden ones too); empty if nothing is there."""
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if not fs.exists(root):
        return set()
    return {p[len(root) + 1 :] for p in fs.find(root, withdirs=False)}


def exists(url: str) -> bool:
    fs, root = fsspec.core.url_to_fs(url)
    return bool(fs.exists(root))


def assert_nothing_written(url: str) -> None:
    """A failed first write left nothing: no folder, no ``_staging``, no file."""
    assert files_under(url) == set()
    assert not exists(url), f"a failed write left the folder {url}"


def read_all(ds: shardkit.Dataset) -> dict[str, list[Any]]:
    """Every row of ``ds`` through `Dataset.read_row_group` + `Dataset.decode`, as per-column row lists.

    A null row is ``None``; a decoded MaskedArray row whose mask is set counts as null.
    """
    out: dict[str, list[Any]] = {name: [] for name in ds.schema.names}
    for i in range(len(ds.row_groups)):
        decoded = ds.decode(ds.read_row_group(i))
        assert set(decoded) == set(ds.schema.names)
        for name, column in decoded.items():
            assert len(column) == ds.row_groups[i].num_rows
            out[name].extend(column_rows(column))
    return out


def column_rows(column: np.ndarray) -> list[Any]:
    """The rows of a decoded column, nulls as ``None``."""
    if isinstance(column, np.ma.MaskedArray):
        mask = np.ma.getmaskarray(column)
        data = column.data
        return [None if mask[i].all() else data[i] for i in range(len(column))]
    return list(column)


def values_equal(field: Field, expected: Any, got: Any) -> bool:
    """Whether one row read back equals the row written (NaN equals NaN; dtype must be the field's)."""
    if expected is None or got is None:
        return expected is None and got is None
    if field.dtype.kind in "US":
        return type(got) is type(expected) and bool(got == expected)
    got_arr, exp_arr = np.asarray(got), np.asarray(expected)
    if got_arr.dtype != field.dtype or got_arr.shape != exp_arr.shape:
        return False
    if field.dtype.kind == "f":
        return bool(np.array_equal(got_arr, exp_arr.astype(field.dtype), equal_nan=True))
    return bool(np.array_equal(got_arr, exp_arr.astype(field.dtype)))


def assert_rows_equal(
    schema: shardkit.Schema, expected: dict[str, list[Any]], got: dict[str, list[Any]]
) -> None:
    assert set(got) == set(expected)
    for field in schema:
        exp, out = expected[field.name], got[field.name]
        assert len(out) == len(exp), field.name
        bad = [i for i, (e, g) in enumerate(zip(exp, out, strict=True)) if not values_equal(field, e, g)]
        assert not bad, (
            f"field {field.name!r} differs at rows {bad[:5]}: wrote {exp[bad[0]]!r}, read {out[bad[0]]!r}"
        )


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """The helpers above, for tests: ``files_under``, ``exists``, ``assert_nothing_written``,
    ``read_all``, ``column_rows``, ``values_equal``, ``assert_rows_equal``."""
    return SimpleNamespace(
        files_under=files_under,
        exists=exists,
        assert_nothing_written=assert_nothing_written,
        read_all=read_all,
        column_rows=column_rows,
        values_equal=values_equal,
        assert_rows_equal=assert_rows_equal,
    )


@pytest.fixture
def plain_parquet_folder(tmp_path: Path) -> Callable[..., str]:
    """``plain_parquet_folder(frames, row_group_size=...)``: a folder of pandas-written Parquet files."""

    def make(frames: list[Any], *, row_group_size: int = 3, name: str = "plain") -> str:
        folder = tmp_path / name
        folder.mkdir()
        for i, df in enumerate(frames):
            df.to_parquet(folder / f"part-{i}.parquet", row_group_size=row_group_size, index=False)
        return os.fspath(folder)

    return make


# ---------------------------------------------------------------------------------------------------
# hypothesis strategies, handed to tests as a session fixture (draw them with ``st.data()``)

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
NUMBERS = [*INTS, "float16", "float32", "float64", "bool"]
TIMES = [
    "datetime64[s]",
    "datetime64[ms]",
    "datetime64[us]",
    "datetime64[ns]",
    "datetime64[D]",
    "timedelta64[s]",
    "timedelta64[ms]",
    "timedelta64[us]",
    "timedelta64[ns]",
]
SCALAR_DTYPES = [*NUMBERS, *TIMES, "str", "bytes"]


@st.composite
def field_strategy(draw: st.DrawFn, name: str, *, multi_dim_variable: bool = True) -> Field:
    """Any storable field: every dtype as a scalar, numbers as fixed and variable tensors, maybe nullable."""
    kind = draw(st.sampled_from(["scalar", "tensor", "ndarray"]))
    if kind == "scalar":
        dtype, shape = draw(st.sampled_from(SCALAR_DTYPES)), ()
    elif kind == "tensor":  # both stored layouts (see TensorCodec)
        dtype = draw(st.sampled_from(NUMBERS))
        shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
        codec = TensorCodec(storage=draw(st.sampled_from(STORAGES)))
        return Field(name, dtype, shape, codec=codec, nullable=draw(st.booleans()))
    else:
        dtype = draw(st.sampled_from(NUMBERS))
        ndim = draw(st.integers(1, 3 if multi_dim_variable else 1))
        dims: list[int | None] = draw(
            st.lists(st.one_of(st.none(), st.integers(1, 3)), min_size=ndim, max_size=ndim)
        )
        dims[draw(st.integers(0, ndim - 1))] = None  # at least one variable dimension
        shape = tuple(dims)
    return Field(name, dtype, shape, nullable=draw(st.booleans()))


@st.composite
def value_strategy(draw: st.DrawFn, field: Field) -> Any:
    """One non-null row of ``field``: a numpy scalar, a numpy array, a str or bytes."""
    if field.dtype.kind == "U":
        return draw(st.text(max_size=6))
    if field.dtype.kind == "S":
        return draw(st.binary(max_size=6))
    shape = tuple(draw(st.integers(0, 3)) if d is None else d for d in field.shape)
    if field.dtype.kind in "mM":
        # whole units well inside every unit's range (seconds are stored as milliseconds)
        ints = draw(hnp.arrays(np.int64, shape, elements=st.integers(-(10**6), 10**6)))
        arr = ints.astype(field.dtype)
    else:
        arr = draw(hnp.arrays(field.dtype, shape))
    return arr[()] if field.shape == () else arr


@st.composite
def column_strategy(draw: st.DrawFn, field: Field, num_rows: int) -> list[Any]:
    """``num_rows`` rows of ``field``; ``None`` for a null (only when the field is nullable)."""
    rows = []
    for _ in range(num_rows):
        null = field.nullable and draw(st.integers(0, 3)) == 0
        rows.append(None if null else draw(value_strategy(field)))
    return rows


@st.composite
def schema_strategy(
    draw: st.DrawFn, *, max_fields: int = 3, multi_dim_variable: bool = True
) -> shardkit.Schema:
    count = draw(st.integers(1, max_fields))
    return shardkit.Schema(
        [draw(field_strategy(f"f{i}", multi_dim_variable=multi_dim_variable)) for i in range(count)]
    )


@pytest.fixture(scope="session")
def strategies() -> SimpleNamespace:
    """Hypothesis strategies: ``field(name)``, ``value(field)``, ``column(field, n)``, ``schema()``."""
    return SimpleNamespace(
        field=field_strategy, value=value_strategy, column=column_strategy, schema=schema_strategy
    )
