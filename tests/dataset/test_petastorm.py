"""Datasets written by the real Petastorm 0.13.1 open and decode identically, and their pickle never runs."""

from __future__ import annotations

import decimal
import io
import os
import pickle
import shutil
import sys
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.cli import main
from shardkit.dataset import Field, Schema
from shardkit.dataset.codecs import codec_from_json
from shardkit.dataset.petastorm import _safe_pickle as safe_pickle
from shardkit.dataset.petastorm.codecs import (
    PetastormCompressedNdarrayCodec,
    PetastormNdarrayCodec,
    PetastormPng16Codec,
    PetastormScalarCodec,
)
from shardkit.errors import (
    CorruptDatasetError,
    PartitionColumnsWarning,
    ReaderError,
    SchemaError,
    UnsafePickleError,
)

# A copy of ../shared/fixtures/petastorm (written by the real Petastorm 0.13.1), kept in the repo so the
# suite never depends on what sits beside the checkout.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "petastorm"
# Written by the real Petastorm 0.13.1 too, by petastorm_extra/make_fixtures.py (its docstring says what)
EXTRA = FIXTURES.parent / "petastorm_extra"
KEY = b"dataset-toolkit.unischema.v1"

SC, ND, ZND = {"name": "scalar"}, {"name": "petastorm.ndarray"}, {"name": "petastorm.compressed_ndarray"}
PNG = {"name": "image", "format": "png", "quality": 80}
JPEG = {"name": "image", "format": "jpeg", "quality": 90}
SCHEMAS = {  # name -> [(field, dtype, shape, codec, nullable)]
    "tensors": [("id", "int64", [], SC, False), ("label", "int32", [], SC, False),
                ("score", "float64", [], SC, False), ("name", "str", [], SC, False),
                ("vec", "float32", [16], ND, False), ("mat", "int16", [4, 5], ZND, False),
                ("maybe", "float32", [3], ND, True)],
    "images": [("id", "int64", [], SC, False), ("rgb_png", "uint8", [16, 16, 3], PNG, False),
               ("gray_png", "uint8", [16, 16], PNG, False), ("rgb_jpeg", "uint8", [16, 16, 3], JPEG, False)],
    "varshape": [("id", "int64", [], SC, False), ("flag", "bool", [], SC, False),
                 ("points", "float32", [None, 3], ND, False), ("counts", "uint16", [None], ZND, False),
                 ("note", "str", [], SC, True)],
}


PSC, PNG16 = {"name": "petastorm.scalar"}, {"name": "petastorm.png16"}
EXTRA_SCHEMAS = {
    "dtypes": [("id", "int64", [], SC, False), ("date", "datetime64[D]", [], SC, False),
               ("n_date", "datetime64[D]", [], SC, True), ("ts", "datetime64[us]", [], SC, False),
               ("dec", "str", [], PSC, False), ("n_dec", "str", [], PSC, True),
               ("py_int", "int64", [], SC, False), ("py_float", "float64", [], SC, False),
               ("py_bool", "bool", [], SC, False), ("py_str", "str", [], SC, False),
               ("vec", "float32", [3], ND, False), ("ll", "int64", [], SC, False),
               ("ull", "uint64", [], SC, False)],
    "text_bytes": [("id", "int64", [], SC, False), ("text_as_bytes", "bytes", [], PSC, False),
                   ("no_codec_bytes", "bytes", [], PSC, True), ("n_f64", "float64", [], SC, True)],
    "png16": [("id", "int64", [], SC, False), ("grey16", "uint16", [4, 5], PNG16, False),
              ("rgb16", "uint16", [3, 4, 3], PNG16, True), ("var16", "uint16", [None, 2], PNG16, False)],
}


def open_fixture(path: Path | str) -> shardkit.Dataset:
    with pytest.warns(shardkit.SummaryMissingWarning):
        return shardkit.open_dataset(path)


def read_sorted(ds: shardkit.Dataset) -> dict[str, np.ndarray]:
    parts = [ds.decode(ds.read_row_group(i)) for i in range(len(ds.row_groups))]
    order = np.argsort(np.concatenate([p["id"] for p in parts]), kind="stable")
    return {name: np.ma.concatenate([p[name] for p in parts])[order]
            if any(isinstance(p[name], np.ma.MaskedArray) for p in parts)
            else np.concatenate([p[name] for p in parts])[order] for name in parts[0]}


def read_fixture(folder: Path, name: str, schema: list[tuple[Any, ...]]
                 ) -> tuple[shardkit.Dataset, dict[str, np.ndarray], Any]:
    """Fixture ``name`` of ``folder`` opened as a Petastorm dataset of ``schema`` (each field's JSON values):
    the dataset, its rows in id order (`read_sorted`), and what Petastorm read (``<name>.expected.npz``)."""
    ds = open_fixture(folder / name)
    assert ds.kind == "petastorm"
    assert [tuple(f.to_json().values()) for f in ds.schema] == schema
    return ds, read_sorted(ds), np.load(folder / f"{name}.expected.npz", allow_pickle=False)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_fixture_opens_and_decodes_like_petastorm(name: str) -> None:
    ds, got, expected = read_fixture(FIXTURES, name, SCHEMAS[name])
    for field in ds.schema:
        values = got[field.name]
        if not field.fixed_shape:
            assert values.dtype == object
            assert f"{field.name}__{len(values)}" not in expected.files
            for i, row in enumerate(values):
                want = expected[f"{field.name}__{i}"]
                assert row.dtype == want.dtype
                assert row.shape == want.shape
                np.testing.assert_array_equal(row, want, err_msg=f"{field.name} row {i}")
            continue
        want = expected[field.name]
        if field.nullable:
            isnull = expected[f"{field.name}__isnull"]
            assert isnull.any()
            if field.dtype.kind == "U":
                assert [v is None for v in values] == isnull.tolist()
                values = np.array(["" if v is None else v for v in values])
            else:
                row_mask = np.ma.getmaskarray(values).reshape(len(values), -1).all(axis=1)
                np.testing.assert_array_equal(row_mask, isnull)
                values = np.ma.getdata(values)
        if field.dtype.kind == "U":
            np.testing.assert_array_equal(values.astype(str), want)
        elif field.name.endswith("jpeg"):
            assert values.dtype == want.dtype
            assert values.shape == want.shape
            assert np.abs(values.astype(int) - want.astype(int)).mean() <= 1
        else:
            assert values.dtype == want.dtype, field.name
            np.testing.assert_array_equal(values, want, err_msg=field.name)


@pytest.mark.parametrize("name", sorted(EXTRA_SCHEMAS))
def test_extra_fixture_opens_and_decodes_like_petastorm(name: str) -> None:
    """Unischemas whose dtypes pickle as np.datetime64, decimal.Decimal, Python types, np.dtype objects or
    np.longlong; np.bytes_ fields over Spark string columns; 16-bit PNGs: all read as Petastorm read them
    (they were refused as unsafe pickles, or read as str, or the dataset was refused)."""
    ds, got, expected = read_fixture(EXTRA, name, EXTRA_SCHEMAS[name])
    for field in ds.schema:
        values = got[field.name]
        if not field.fixed_shape:
            for i, row in enumerate(values):
                want = expected[f"{field.name}__{i}"]
                assert (row.dtype, row.shape) == (want.dtype, want.shape)
                np.testing.assert_array_equal(row, want, err_msg=f"{field.name} row {i}")
            continue
        want = expected[field.name]
        isnull = expected[f"{field.name}__isnull"] if field.nullable else np.zeros(len(want), bool)
        if field.dtype.kind == "f" and field.shape == ():  # Petastorm's null floats: NaN (module docstring)
            isnull = isnull | np.isnan(want)
        if field.dtype.kind in "US":
            kind = bytes if field.dtype.kind == "S" else str
            assert all(isinstance(v, kind) for v in values if v is not None)
            assert [v is None for v in values] == isnull.tolist(), field.name
            filler = b"" if field.dtype.kind == "S" else ""
            assert [filler if v is None else v for v in values] == want.tolist(), field.name
            continue
        assert isinstance(values, np.ma.MaskedArray) == bool(isnull.any()), field.name
        row_mask = np.ma.getmaskarray(values).reshape(len(values), -1).all(axis=1)
        np.testing.assert_array_equal(row_mask, isnull, err_msg=field.name)
        assert np.ma.getdata(values).dtype == want.dtype, field.name
        np.testing.assert_array_equal(np.ma.getdata(values)[~isnull], want[~isnull], err_msg=field.name)


def test_null_floats_are_masked_where_petastorm_gave_nan() -> None:
    got = read_sorted(open_fixture(EXTRA / "text_bytes"))["n_f64"]
    want = np.load(EXTRA / "text_bytes.expected.npz", allow_pickle=False)["n_f64"]
    assert np.isnan(want).sum() == 3  # the rows written as None
    np.testing.assert_array_equal(np.ma.getmaskarray(got), np.isnan(want))
    np.testing.assert_array_equal(got.compressed(), want[~np.isnan(want)])


def test_a_partition_key_of_a_petastorm_schema_is_not_a_silent_empty_field() -> None:
    """Spark's partitionBy keeps a Unischema field's values in folder names only (``part=1/``); Petastorm
    read them back as a column. shardkit does not read partition keys into batches, so the field must
    not be in the schema: then opening warns and ``columns=['part']`` names the key, as for any
    Hive-partitioned folder. It was in the schema: no warning came, ``columns=['part']`` yielded no
    batch at all and ``columns=['id', 'part']`` batches without 'part'."""
    with pytest.warns(PartitionColumnsWarning, match="part"), pytest.warns(shardkit.SummaryMissingWarning):
        ds = shardkit.open_dataset(EXTRA / "partitioned")
    assert ds.schema.names == ["id", "vec"]
    assert ds.partition_keys == ["part"]
    with pytest.raises(ReaderError, match="Hive partition keys"):
        shardkit.make_reader(ds, columns=["id", "part"])


def test_unreadable_unischema_dtypes_are_schema_errors(tmp_path: Path, fake_petastorm: Any) -> None:
    """Data types (numpy's, Python's, Decimal) are never called, so they pass the allowlist; those without a
    shardkit dtype are refused as unreadable fields, naming the field and the fix."""
    ok = fake_petastorm.Field("id", np.int64, (), None, False)
    for dtype, match in [(np.datetime64, "no unit"), (np.complex64, "complex64"), (np.object_, "object_"),
                         (decimal.Decimal, "DecimalType")]:
        bad = fake_petastorm.Field("x", dtype, (3,), fake_petastorm.NdarrayCodec(), False)
        blob = pickle.dumps(fake_petastorm.Unischema("S", [ok, bad]), protocol=4)
        with pytest.raises(SchemaError, match=f"Petastorm field 'x' cannot be read: .*{match}") as info:
            open_fixture(plant(tmp_path / dtype.__name__, blob))
        assert not isinstance(info.value, UnsafePickleError)


def test_cli_inspect_lists_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(FIXTURES / "tensors")]) == 0
    out = capsys.readouterr().out
    assert "petastorm dataset" in out
    assert "240 rows" in out
    for field in ("id", "label", "score", "name", "vec", "mat", "maybe"):
        assert f"\n{field} " in out
    assert "petastorm.compressed_ndarray" in out


# --- planted pickles: the dataset's pickle must never run ------------------------------------------


class Payload:
    """Creates ``path`` when unpickled, through ``func`` (``builtins.open`` or ``os.system``)."""

    def __init__(self, func: Any, path: Path) -> None:
        self.func, self.path = func, path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.func is os.system:
            return os.system, (f"touch {self.path}",)
        return open, (str(self.path), "w")


def plant(tmp_path: Path, blob: bytes) -> Path:
    """A copy of the tensors fixture whose ``_common_metadata`` holds ``blob`` as the Unischema."""
    root = tmp_path / "planted"
    shutil.copytree(FIXTURES / "tensors", root, copy_function=shutil.copyfile)
    root.chmod(0o755)
    md_path = root / "_common_metadata"
    schema = pq.read_schema(md_path)
    pq.write_metadata(schema.with_metadata({**(schema.metadata or {}), KEY: blob}), md_path)
    return root


@pytest.fixture
def fake_petastorm(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Stand-ins registered as petastorm.unischema / .codecs, so pickle names them as Petastorm does."""
    unischema, codecs = types.ModuleType("petastorm.unischema"), types.ModuleType("petastorm.codecs")

    class Unischema:
        def __init__(self, name: str, fields: list[Any]) -> None:
            self._name, self._fields = name, OrderedDict((f[0], f) for f in fields)

    class UnischemaField(tuple):
        def __new__(cls, *args: Any) -> UnischemaField:
            return super().__new__(cls, args)

        def __getnewargs__(self) -> tuple[Any, ...]:
            return tuple(self)

    class NdarrayCodec:
        pass

    for module, cls in ((unischema, Unischema), (unischema, UnischemaField), (codecs, NdarrayCodec)):
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "petastorm", types.ModuleType("petastorm"))
    monkeypatch.setitem(sys.modules, "petastorm.unischema", unischema)
    monkeypatch.setitem(sys.modules, "petastorm.codecs", codecs)
    return types.SimpleNamespace(Unischema=Unischema, Field=UnischemaField, NdarrayCodec=NdarrayCodec)


@pytest.mark.parametrize(("func", "qualname"), [(os.system, "posix.system"), (open, "io.open")])
def test_planted_payload_is_refused_and_never_runs(tmp_path: Path, func: Any, qualname: str) -> None:
    marker = tmp_path / "pwned"
    root = plant(tmp_path, pickle.dumps(Payload(func, marker), protocol=4))
    with pytest.raises(UnsafePickleError, match=qualname) as info:
        open_fixture(root)
    assert str(root / "_common_metadata") in str(info.value)
    assert "rewrite it with shardkit" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("callable_", [b"os\nsystem", b"posix\nsystem", b"builtins\neval", b"shutil\nrmtree"])
def test_a_handwritten_reduce_pickle_is_refused(tmp_path: Path, callable_: bytes) -> None:
    """``GLOBAL mod name; (cmd,) REDUCE`` written opcode by opcode (no class of ours in between)."""
    marker = tmp_path / "pwned"
    command = f"touch {marker}".encode()
    blob = b"\x80\x02c" + callable_ + b"\nX" + len(command).to_bytes(4, "little") + command + b"\x85R."
    module, name = callable_.decode().split("\n")
    with pytest.raises(UnsafePickleError, match=f"references {module}.{name}, which is not among"):
        open_fixture(plant(tmp_path, blob))
    assert not marker.exists()


def test_allowed_data_types_called_with_a_command_run_nothing(tmp_path: Path, fake_petastorm: Any) -> None:
    """``builtins.bytes`` and ``numpy.dtype`` are allowed (Unischemas name them), but only as data: a pickle
    that calls them is read as an inert call, and a dtype built that way is refused."""
    marker = tmp_path / "pwned"
    for name, func in [("bytes", b"cbuiltins\nbytes\n"), ("dtype", b"cnumpy\ndtype\n")]:
        command = f"touch {marker}".encode()
        call = func + b"X" + len(command).to_bytes(4, "little") + command + b"\x85R"
        entry = (b"cpetastorm.unischema\nUnischemaField\n(X\x01\x00\x00\x00x" + call + b")NI00\ntR")
        with pytest.raises(SchemaError, match="has no shardkit dtype"):
            open_fixture(plant(tmp_path / name, _unischema_with(entry)))
    assert not marker.exists()


def test_planted_payload_is_live(tmp_path: Path) -> None:
    """Control: the payload used above really creates its file when unpickled the normal way."""
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps(Payload(open, marker), protocol=4)).close()
    assert marker.exists()


def test_allowed_classes_around_a_foreign_callable_are_refused(tmp_path: Path, fake_petastorm: Any) -> None:
    marker = tmp_path / "pwned"
    ok = fake_petastorm.Field("id", np.int64, (), fake_petastorm.NdarrayCodec(), False)
    bad = fake_petastorm.Field("x", np.float32, (3,), Payload(os.system, marker), False)
    blob = pickle.dumps(fake_petastorm.Unischema("Evil", [ok, bad]), protocol=4)
    assert b"petastorm.unischema" in blob
    assert b"UnischemaField" in blob
    with pytest.raises(UnsafePickleError, match=r"posix\.system"):
        open_fixture(plant(tmp_path, blob))
    assert not marker.exists()


@pytest.mark.parametrize("blob", [b"", b"\x80\x04\xff.", b"garbage", pickle.dumps({"a": 1}, protocol=4)[:-3]])
def test_malformed_pickles_are_refused(tmp_path: Path, blob: bytes) -> None:
    with pytest.raises(UnsafePickleError, match=r"malformed|truncated|opcode"):
        open_fixture(plant(tmp_path, blob))


def test_a_pickle_that_is_not_a_unischema_is_a_schema_error(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="Unischema"):
        open_fixture(plant(tmp_path, pickle.dumps({"_fields": [1, 2]}, protocol=4)))


# --- safe_pickle on hand-made pickles ---------------------------------------------------------------


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


class KwOnly:
    def __new__(cls, *, size: int) -> KwOnly:
        return super().__new__(cls)

    def __init__(self, *, size: int) -> None:
        self.size = size

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (), {"size": self.size}


PLAIN: Any = {"a": [1, -2, 2**70, 2.5, None, True, False], "t": (1, (2, 3), ()), "s": "é" * 300,
              "e": {}, "n": [[1]]}


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_safe_pickle_reads_plain_data(protocol: int) -> None:
    shared = [1, 2]
    data = {**PLAIN, "shared": (shared, shared)}
    out = safe_pickle.load(pickle.dumps(data, protocol=protocol), allowed=(), where="test")
    assert out == data
    assert out["shared"][0] is out["shared"][1]  # the memo keeps shared references shared


@pytest.mark.parametrize("protocol", [4, 5])
def test_safe_pickle_reads_bytes_sets_and_bytearrays(protocol: int) -> None:
    data: list[Any] = [b"x" * 300, b"", {1, 2}, frozenset({"a"})]
    data += [bytearray(b"ab")] if protocol == 5 else []  # protocol 4 pickles bytearray as a call
    assert safe_pickle.load(pickle.dumps(data, protocol=protocol), allowed=(), where="test") == data


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_safe_pickle_builds_inert_calls(protocol: int) -> None:
    qual = f"{Point.__module__}.Point"
    out = safe_pickle.load(pickle.dumps([Point(3), OrderedDict(a=1, b=2)], protocol=protocol),
                           allowed={qual, "collections.OrderedDict"}, where="test")
    point, odict = out
    assert isinstance(point, safe_pickle.Call)
    assert point.func == safe_pickle.Global(Point.__module__, "Point")
    assert point.func.qualname == qual
    assert point.state == {"x": 3}
    assert odict.func.qualname == "collections.OrderedDict"
    assert odict.items == [("a", 1), ("b", 2)]


def test_safe_pickle_reads_newobj_ex_and_never_imports() -> None:
    out = safe_pickle.load(pickle.dumps(KwOnly(size=4), protocol=4), allowed={f"{KwOnly.__module__}.KwOnly"},
                           where="test")
    assert out.kwargs == {"size": 4}
    assert out.state == {"size": 4}
    blob = b"\x80\x04\x8c\x14shardkit_no_such_mod\x8c\x03Foo\x93)\x81."
    out = safe_pickle.load(blob, allowed={"shardkit_no_such_mod.Foo"}, where="test")
    assert out.func == safe_pickle.Global("shardkit_no_such_mod", "Foo")
    assert "shardkit_no_such_mod" not in sys.modules


@pytest.mark.parametrize(("blob", "match"), [
    (pickle.dumps(b"ab", protocol=2), r"_codecs\.encode"),  # protocol 2 pickles bytes with a call
    (pickle.dumps(Point(1), protocol=2), r"test_petastorm\.Point"),
    (b"\x80\x02\x82\x01.", "EXT1"),
    (b"\x80\x02K\x01Q.", "BINPERSID"),
    (pickle.dumps(pickle.PickleBuffer(b"abc"), protocol=5, buffer_callback=lambda b: False), "NEXT_BUFFER"),
    (b"\x80\x04))R.", "malformed"),  # REDUCE with a tuple as the callable
    (b"\x80\x04K\x01K\x02.", "malformed"),  # two objects left at STOP
    (b"\x80\x04h\x05.", "malformed"),  # BINGET of a memo entry never written
])
def test_safe_pickle_refuses(blob: bytes, match: str) -> None:
    with pytest.raises(UnsafePickleError, match=match) as info:
        safe_pickle.load(blob, allowed=(), where="/data/x", advice="Do this.")
    assert str(info.value).startswith("/data/x: ")
    assert str(info.value).endswith("Do this.")


# --- the read-only codecs on synthetic columns -----------------------------------------------------


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def npz(a: np.ndarray, *, compressed: bool = True) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, arr=a)
    return buf.getvalue()


def test_ndarray_codec_decodes_every_layout() -> None:
    field = Field("x", "float32", (2, 3), codec=PetastormNdarrayCodec(), nullable=True)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    rows = [npy(a), None, npy(np.asfortranarray(a + 1)), npy((a + 2).astype(">f4"))]
    got = field.codec.decode(field, pa.array(rows, pa.binary()).slice(0))
    assert isinstance(got, np.ma.MaskedArray)
    assert got.mask[:, 0, 0].tolist() == [False, True, False, False]
    np.testing.assert_array_equal(np.ma.getdata(got)[[0, 2, 3]], [a, a + 1, a + 2])
    assert got.dtype == np.float32
    fast = field.codec.decode(field, pa.array([npy(a), npy(a + 1)] * 3, pa.large_binary()).slice(1, 4))
    np.testing.assert_array_equal(fast, [a + 1, a, a + 1, a])


def test_compressed_codec_reads_deflated_and_stored_archives() -> None:
    field = Field("c", "uint16", (None,), codec=PetastormCompressedNdarrayCodec(), nullable=True)
    rows = [npz(np.arange(5, dtype=np.uint16)), None, npz(np.arange(2, dtype=np.uint16), compressed=False)]
    got = field.codec.decode(field, pa.array(rows, pa.binary()))
    assert got[1] is None
    assert got[0].tolist() == [0, 1, 2, 3, 4]
    assert got[2].tolist() == [0, 1]


@pytest.mark.parametrize("blob", [
    npy(np.zeros(3, np.float32))[:-1],  # truncated
    npy(np.zeros(3, np.int32)),  # wrong dtype
    npy(np.zeros(4, np.float32)),  # wrong shape
    b"not npy data at all",
])
def test_ndarray_codec_corrupt_rows_name_the_field(blob: bytes) -> None:
    field = Field("vec", "float32", (3,), codec="petastorm.ndarray")
    with pytest.raises(CorruptDatasetError, match="field 'vec', row 1"):
        field.codec.decode(field, pa.array([npy(np.zeros(3, np.float32)), blob]))


def test_object_arrays_are_refused_without_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    blob = npy(np.array([Payload(open, marker)], dtype=object))
    field = Field("vec", "float32", (None,), codec="petastorm.ndarray")
    with pytest.raises(CorruptDatasetError, match="object array"):
        field.codec.decode(field, pa.array([blob]))
    zfield = Field("z", "float32", (None,), codec="petastorm.compressed_ndarray")
    good = npz(np.zeros(2, np.float32))
    bad_crc = good[:14] + bytes([good[14] ^ 1]) + good[15:]
    with pytest.raises(CorruptDatasetError, match="CRC"):
        zfield.codec.decode(zfield, pa.array([bad_crc]))
    assert not marker.exists()


def test_petastorm_codecs_are_read_only_json_codecs() -> None:
    schema = Schema([Field("x", "float32", (None,), codec="petastorm.ndarray"),
                     Field("y", "int16", (4, 5), codec={"name": "petastorm.compressed_ndarray"}),
                     Field("s", "bytes", (), codec="petastorm.scalar"),
                     Field("p", "uint16", (None, None, 3), codec="petastorm.png16")])
    assert Schema.from_json(schema.to_json()) == schema
    assert codec_from_json("petastorm.ndarray") == PetastormNdarrayCodec()
    assert codec_from_json("petastorm.scalar") == PetastormScalarCodec()
    assert codec_from_json("petastorm.png16") == PetastormPng16Codec()
    for cls in (PetastormNdarrayCodec, PetastormScalarCodec, PetastormPng16Codec):
        assert not cls.writable
    with pytest.raises(SchemaError, match="read-only") as info:
        schema.encode({"x": [np.zeros(2, np.float32)], "y": [np.zeros((4, 5), np.int16)], "s": [b""],
                       "p": [np.zeros((1, 1, 3), np.uint16)]}, 1)
    assert "codec='ndarray'" in str(info.value)
    for field, suggested in [(schema["s"], "scalar"), (schema["p"], "ndarray"), (schema["y"], "tensor")]:
        with pytest.raises(SchemaError, match=f"codec='{suggested}'"):
            field.codec.encode(field, [])
    with pytest.raises(SchemaError, match=r"uint16 images of shape \(H, W\) or \(H, W, 3\)"):
        Field("p", "uint16", (4, 4, 4), codec="petastorm.png16")


def test_scalar_codec_converts_text_and_decimals_as_petastorm_did() -> None:
    text = pa.array(["é", None, "ab"]).dictionary_encode()
    field = Field("b", "bytes", (), codec="petastorm.scalar", nullable=True)
    assert field.codec.decode(field, text).tolist() == ["é".encode(), None, b"ab"]
    dec = pa.array([decimal.Decimal("-1.50"), None], pa.decimal128(5, 2))
    field = Field("d", "str", (), codec="petastorm.scalar", nullable=True)
    assert field.codec.decode(field, dec).tolist() == ["-1.50", None]
    field = Field("d", "float64", (), codec="petastorm.scalar", nullable=True)
    got = field.codec.decode(field, dec)
    assert got.mask.tolist() == [False, True]
    assert got[0] == -1.5
    field = Field("b", "bytes", (), codec="petastorm.scalar")
    assert field.codec.decode(field, pa.array([b"\x00\xff"])).tolist() == [b"\x00\xff"]


def test_png16_rows_that_are_not_16_bit_pngs_name_the_row() -> None:
    import cv2  # a test dependency (pyproject: dev), as shardkit[image] installs it
    field = Field("p", "uint16", (2, 2), codec="petastorm.png16")
    eight_bit = cv2.imencode(".png", np.zeros((2, 2), np.uint8))[1].tobytes()
    for blob, match in [(b"not a png", "not a PNG"), (eight_bit, "uint8 image")]:
        with pytest.raises(CorruptDatasetError, match=f"field 'p', row 0.*{match}"):
            field.codec.decode(field, pa.array([blob]))


# --- crafted nesting: refused, and bounded in messages ----------------------------------------------


def _unischema_with(entry: bytes) -> bytes:
    """A Unischema pickle whose one ``_fields`` entry is the value the opcodes ``entry`` push."""
    return (b"\x80\x02cpetastorm.unischema\nUnischema\n)\x81}X\x07\x00\x00\x00_fieldsccollections\n"
            b"OrderedDict\n)RX\x01\x00\x00\x00a" + entry + b"ssb.")


def _nested_lists(depth: int, inner: bytes = b"") -> bytes:
    """Opcodes pushing ``depth`` lists, each inside the previous one (``inner`` pushed into the last)."""
    return b"]" * depth + (inner + b"a" if inner else b"") + b"a" * (depth - 1)


def test_a_deeply_nested_pickle_is_refused_not_a_recursion_error(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root = plant(tmp_path, _unischema_with(_nested_lists(100_000)))
    with pytest.raises(UnsafePickleError, match=r"_common_metadata: the pickle nests containers more than "
                                                r"100 deep") as info:
        open_fixture(root)
    assert len(str(info.value)) < 600
    assert main(["inspect", str(root)]) == 2  # one line, no traceback
    assert "nests containers more than 100 deep" in capsys.readouterr().err


def test_nesting_up_to_the_limit_is_read_and_beyond_it_refused() -> None:
    limit = safe_pickle.MAX_DEPTH
    out = safe_pickle.load(b"\x80\x04" + _nested_lists(limit) + b".", allowed=(), where="test")
    for _ in range(limit - 1):
        out = out[0]
    assert out == []
    with pytest.raises(UnsafePickleError, match=f"more than {limit} deep"):
        safe_pickle.load(b"\x80\x04" + _nested_lists(limit + 1) + b".", allowed=(), where="test")


def test_a_deeply_nested_tuple_key_is_refused_before_it_is_hashed() -> None:
    key = b")" + b"\x85" * 5_000  # () wrapped in 5,000 one-tuples
    with pytest.raises(UnsafePickleError, match="more than 100 deep"):
        safe_pickle.load(b"\x80\x04}" + key + b"K\x01s.", allowed=(), where="test")


def _shared_tuples(steps: int) -> bytes:
    """Opcodes pushing ``t`` after ``steps`` rounds of ``t = (t, t)``: 2 bytes a round, 2**steps leaves."""
    return b")" + b"2\x86" * steps  # EMPTY_TUPLE, then DUP, TUPLE2 a round


def test_a_shared_reference_bomb_is_refused_at_once(tmp_path: Path) -> None:
    """A dict key of 2**21 leaves from a 90-byte pickle: hashing it takes twice as long each round, so 64
    rounds (under 200 bytes) hung opening the dataset (or `shardkit inspect`) for good. Now refused as
    the tuple is built."""
    blob = b"\x80\x02cpetastorm.unischema\nUnischema\n)\x81}" + _shared_tuples(21) + b"K\x01sb."
    with pytest.raises(UnsafePickleError, match="more than 1,000,000 values once its shared references"):
        open_fixture(plant(tmp_path, blob))


def test_expanded_sizes_are_bounded() -> None:
    limit = safe_pickle.MAX_NODES
    fits = (limit + 1).bit_length() - 2  # the most rounds within the limit: 2**(fits + 1) - 1 values
    out = safe_pickle.load(b"\x80\x04" + _shared_tuples(fits) + b".", allowed=(), where="test")
    assert len(out) == 2
    with pytest.raises(UnsafePickleError, match=f"more than {limit:,} values"):
        safe_pickle.load(b"\x80\x04" + _shared_tuples(fits + 1) + b".", allowed=(), where="test")


@pytest.mark.parametrize("container", [b"}%sK\x01s", b"\x8f(%s\x90", b"(%s\x91"])  # dict key, set, frozenset
def test_dict_keys_and_set_members_are_bounded_before_hashing(container: bytes) -> None:
    fits = (safe_pickle.MAX_KEY_NODES + 1).bit_length() - 2
    small, big = _shared_tuples(fits), _shared_tuples(fits + 1)
    safe_pickle.load(b"\x80\x04" + container.replace(b"%s", small) + b".", allowed=(), where="test")
    with pytest.raises(UnsafePickleError, match="as a dict key or set member"):
        safe_pickle.load(b"\x80\x04" + container.replace(b"%s", big) + b".", allowed=(), where="test")


def test_containers_filled_after_use_are_refused() -> None:
    """5,000 lists, each appended into the next from the last one down: counted two deep each when filled,
    they nest 5,000 deep (a walk of the result ended in a RecursionError); a list holding itself nests
    without end."""
    n = 5_000
    get = [b"j" + i.to_bytes(4, "little") for i in range(n)]  # LONG_BINGET i
    lists = b"]\x94" + b"0]\x94" * (n - 1) + b"0"  # n empty lists, memo 0 .. n-1
    fill = b"".join(get[i] + get[i - 1] + b"a0" for i in range(n - 1, 0, -1))  # L[i].append(L[i-1])
    with pytest.raises(UnsafePickleError, match="fills a list after putting it into another container"):
        safe_pickle.load(b"\x80\x04" + lists + fill + get[n - 1] + b".", allowed=(), where="test")
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(UnsafePickleError, match="a reference cycle"):
        safe_pickle.load(pickle.dumps(cycle, protocol=4), allowed=(), where="test")


def test_short_repr_bounds_calls_without_walking_them() -> None:
    shared: Any = ()
    for _ in range(20):  # 2**20 leaves: a dataclass repr walks them all before reprlib cuts it short
        shared = (shared, shared)
    func = safe_pickle.Global("collections", "OrderedDict")
    call = safe_pickle.Call(func, (shared,), state={"a": [shared]})
    text = safe_pickle.short_repr(call)
    assert text.startswith("collections.OrderedDict((((")
    assert text.endswith(", state={'a': [(...)]})")
    assert len(text) < 200


def test_pickle_values_in_messages_are_bounded(tmp_path: Path) -> None:
    huge = b"X" + (200_000).to_bytes(4, "little") + b"x" * 200_000
    with pytest.raises(SchemaError, match="is not a UnischemaField") as info:
        open_fixture(plant(tmp_path, _unischema_with(_nested_lists(60, huge))))
    assert len(str(info.value)) < 1000, len(str(info.value))
