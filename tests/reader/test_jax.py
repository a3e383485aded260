"""shardkit.jax on CPU (real jax, two host devices): values vs the reader, 64 bits, shardings, resume."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

with contextlib.suppress(RuntimeError):  # before jax's backends start: two CPU devices for the shardings
    jax.config.update("jax_num_cpu_devices", 2)

import shardkit
import shardkit.jax as skj
from shardkit.errors import AdapterError, MissingDependencyError
from shardkit.reader.adapters import jax as reader_jax
from tests.reader.datasets import assert_exactly_once, ids_of, write_all_codecs, write_ids

N_IDS = 480  # divisible by every world below: "drop" leaves nothing out
IDS32 = skj.Collate(cast={"id": "int32"})  # jax's default is 32-bit: the ids fit


@pytest.fixture(scope="module")
def codecs_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_all_codecs(tmp_path_factory.mktemp("codecs") / "ds")[0]


@pytest.fixture(scope="module")
def ids_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids") / "ds", N_IDS, row_group_size=37)


def two_devices() -> list[Any]:
    devices = jax.devices("cpu")
    assert len(devices) >= 2, "jax's backends started before this module could ask for two CPU devices"
    return devices[:2]


def assert_same(want: dict[str, Any], got: dict[str, Any], cast: dict[str, str] | None = None) -> None:
    """A loader batch holds the reader batch's values under the default `Collate` policy; numbers are
    jax arrays of the field's dtype (or of its ``cast``), text stays a list."""
    cast = cast or {}
    for name, value in want.items():
        out = got[name]
        if isinstance(value, np.ma.MaskedArray):
            valid = ~np.ma.getmaskarray(value).reshape(len(value), -1).any(axis=1)
            np.testing.assert_array_equal(np.asarray(got[name + "__valid"]), valid)
            np.testing.assert_array_equal(np.asarray(out)[valid], value.data[valid])
            assert out.dtype == value.dtype
        elif value.dtype == object and isinstance(next((v for v in value if v is not None), ""), np.ndarray):
            assert isinstance(out, list)
            assert len(out) == len(value)
            for g, w in zip(out, value, strict=True):
                assert (g is None) == (w is None)
                if w is not None:
                    assert isinstance(g, jax.Array)
                    assert g.dtype == w.dtype
                    np.testing.assert_array_equal(np.asarray(g), w)
        elif value.dtype == object:
            assert out == list(value)
            if name + "__valid" in got:
                assert np.asarray(got[name + "__valid"]).tolist() == [v is not None for v in value]
        else:
            assert isinstance(out, jax.Array)
            dtype = np.dtype(cast.get(name, value.dtype))
            assert out.dtype == dtype
            np.testing.assert_array_equal(np.asarray(out), value.astype(dtype))


@pytest.mark.parametrize(("shuffle", "x64"), [(False, True), (True, True), (True, False)])
def test_values_and_dtypes_equal_the_readers_for_every_codec(codecs_ds: str, shuffle: bool,
                                                             x64: bool) -> None:
    """With x64 on every field keeps its dtype; off, the 64-bit ones are cast knowingly (see below)."""
    cast = {} if x64 else {"id": "int32", "score": "float32"}
    kw = {"batch_size": 16, "shuffle": shuffle, "seed": 5}
    with jax.enable_x64(x64), shardkit.make_reader(codecs_ds, **kw) as reader, \
            skj.make_loader(codecs_ds, collate=skj.Collate(cast=cast), **kw) as loader:
        want = list(reader)
        got = list(loader)  # every batch kept: none was overwritten by a later one
        assert len(loader) == len(reader) == len(got) == len(want)
    for w, g in zip(want, got, strict=True):
        assert [k for k in g if not k.endswith("__valid")] == list(w)  # the reader's keys, in order
        assert_same(w, g, cast)
        assert g["img"].devices() == {jax.devices()[0]}


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5, 100])
def test_prefetch_keeps_the_order_and_every_batch(ids_ds: str, prefetch: int) -> None:
    kw = {"batch_size": 48, "seed": 2, "columns": ["id", "label"], "num_epochs": 2}
    with shardkit.make_reader(ids_ds, **kw) as reader:
        want = [b["id"] for b in reader]
    with skj.make_loader(ids_ds, prefetch=prefetch, collate=IDS32, **kw) as loader:
        got = [np.asarray(b["id"]) for b in loader]
    assert len(got) == len(want) == 2 * N_IDS // 48
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_the_reader_is_prefetch_batches_ahead_of_the_state(ids_ds: str) -> None:
    """Batch 1 is handed out once batches 2 and 3 were put: the reader is there, the state at batch 1."""
    kw = {"batch_size": 16, "shuffle": False, "columns": ["id"]}
    with skj.make_loader(ids_ds, prefetch=2, collate=IDS32, **kw) as loader, \
            shardkit.make_reader(ids_ds, **kw) as plain:
        it, epoch = iter(loader), iter(plain)
        first = next(it)
        np.testing.assert_array_equal(np.asarray(first["id"]), next(epoch)["id"])
        assert loader.state_dict()["history"] == plain.state_dict()["history"]  # after one batch
        next(epoch), next(epoch)
        assert loader.reader.state_dict()["history"] == plain.state_dict()["history"]  # after three
        assert loader.state_dict()["history"] != plain.state_dict()["history"]


def test_pad_policy_gives_dense_arrays_and_masks(codecs_ds: str) -> None:
    kw = {"batch_size": 32, "shuffle": False, "columns": ["var", "var2", "maybe"]}
    with shardkit.make_reader(codecs_ds, **kw) as reader:
        want = next(iter(reader))
    with skj.make_loader(codecs_ds, collate=skj.Collate(variable="pad", pad_value=-1), **kw) as loader:
        got = next(iter(loader))
    assert list(got) == ["var", "var__mask", "var2", "var2__mask", "maybe", "maybe__valid"]
    assert all(isinstance(v, jax.Array) for v in got.values())
    assert got["var2"].shape == (32, max(r.shape[0] for r in want["var2"]), 2)
    assert got["var2__mask"].dtype == np.bool_
    for i, row in enumerate(want["var2"]):
        n = row.shape[0]
        np.testing.assert_array_equal(np.asarray(got["var2"][i, :n]), row)
        assert (np.asarray(got["var2"][i, n:]) == -1).all()
        assert int(got["var2__mask"][i].sum()) == n


# ---- what jax cannot hold as it is -------------------------------------------------------------------

def _odd_dtypes(path: Path) -> str:
    n = 40
    cols = {"id": np.arange(n) + 3_000_000_000, "score": np.linspace(0, 1, n),
            "big": np.arange(n, dtype=np.uint64), "depth": np.arange(n, dtype=np.uint16) * 1000,
            "when": np.arange(n).astype("datetime64[s]")}
    shardkit.write_dataset(cols, os.fspath(path), row_group_size=10)
    return os.fspath(path)


def test_64_bit_fields_are_narrowed_with_x64_off_only_where_they_fit_and_kept_with_it_on(
        tmp_path: Path) -> None:
    """jax narrows 64-bit values silently with x64 off (3e9 wraps to -1294967296). The loader narrows
    them itself: integers that fit become 32-bit, one that does not raises naming the field, the value
    and the options; floats become float32 as jax makes them. With x64 on the values stay exact."""
    url = _odd_dtypes(tmp_path / "odd")
    kw = {"shuffle": False, "batch_size": 8, "columns": ["id", "score", "big", "depth"]}
    with shardkit.make_reader(url, **kw) as reader:
        want = list(reader)
    three = {**kw, "columns": ["score", "big", "depth"]}
    with jax.enable_x64(False), skj.make_loader(url, **three) as loader:
        got = list(loader)
    narrowed = {"score": "float32", "big": "uint32"}
    for w, g in zip(want, got, strict=True):
        assert g["depth"].dtype == np.uint16  # jax computes on uint16 (torch does not): kept
        assert_same({k: w[k] for k in ("score", "big", "depth")}, g, narrowed)
        # what jax itself makes of the float64s
        np.testing.assert_array_equal(np.asarray(g["score"]), np.asarray(jax.device_put(w["score"])))
    with jax.enable_x64(False), skj.make_loader(url, **kw) as loader, pytest.raises(
            AdapterError, match=r"the batch's 'id' holds 3000000000 \(int64\), past the int32 .* wrap to "
                                r"-1294967296\); jax\.config\.update\('jax_enable_x64', True\).*"
                                r"leave 'id' out with columns=.*collate function"):
        next(iter(loader))
    with jax.enable_x64(True), skj.make_loader(url, **kw) as loader:
        got = list(loader)
    for w, g in zip(want, got, strict=True):
        assert_same(w, g)  # int64 3e9.., float64, uint64 and uint16 as they are
    with jax.enable_x64(False), skj.make_loader(url, columns=["depth"], batch_size=8, shuffle=False,
                                                collate=skj.Collate(cast={"depth": "int64"})) as loader:
        assert next(iter(loader))["depth"].dtype == np.int32  # a cast to int64 narrowed alike


def test_x64_turned_off_after_the_loader_was_made_narrows_and_checks(tmp_path: Path) -> None:
    url = _odd_dtypes(tmp_path / "odd")
    with jax.enable_x64(True):
        loader = skj.make_loader(url, columns=["id"], batch_size=8, shuffle=False)
    with loader, pytest.raises(AdapterError, match=r"'id' holds 3000000000 \(int64\), past the int32"):
        next(iter(loader))
    small = {"id": lambda b: {"id": b["id"] - 3_000_000_000}}["id"]  # a collate function's int64s: fit
    with skj.make_loader(url, columns=["id"], batch_size=8, shuffle=False, collate=small) as fn_loader:
        batch = next(iter(fn_loader))
    assert batch["id"].dtype == np.int32
    assert np.asarray(batch["id"]).tolist() == list(range(8))
    with skj.make_loader(url, columns=["id"], collate=lambda b: {"id": b["id"]}) as fn_loader, \
            pytest.raises(AdapterError, match=r"'id' holds 30000000\d\d \(int64\)"):
        next(iter(fn_loader))


def test_a_field_jax_has_no_dtype_for_fails_with_the_options(tmp_path: Path) -> None:
    url = _odd_dtypes(tmp_path / "odd")
    with pytest.raises(AdapterError, match=r"field 'when' is datetime64\[s\], which jax has no dtype for.*"
                                           r"cast=\{'when': '<dtype>'\}.*int64 \(or int32\).*columns="):
        skj.make_loader(url, columns=["when"])
    with skj.make_loader(url, columns=["when"], shuffle=False, batch_size=8,
                         collate=skj.Collate(cast={"when": "int32"})) as loader:
        batch = next(iter(loader))
    assert batch["when"].dtype == np.int32
    assert np.asarray(batch["when"]).tolist() == list(range(8))
    with pytest.raises(AdapterError, match="nope"):
        skj.make_loader(url, collate=skj.Collate(cast={"nope": "int32"}))
    with pytest.raises(AdapterError, match="complex128, which jax does not hold"):
        skj.make_loader(url, columns=["depth"], collate=skj.Collate(cast={"depth": "complex128"}))


# ---- devices and shardings ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["bogus", "gpu", "cpu:7", "cpu:x", 3])
def test_a_device_that_does_not_exist_fails_before_reading(device: Any, tmp_path: Path) -> None:
    # the URL does not exist either: the device error comes first, so nothing was opened
    with pytest.raises(AdapterError, match=f"device={device!r}"):
        skj.make_loader(os.fspath(tmp_path / "missing"), device=device)


@pytest.mark.parametrize("how", ["string", "device"])
def test_batches_go_to_the_device_named(ids_ds: str, how: str) -> None:
    second = two_devices()[1]
    device = "cpu:1" if how == "string" else second
    with skj.make_loader(ids_ds, device=device, batch_size=64, columns=["id", "label"],
                         collate=IDS32) as loader:
        batches = list(loader)
    assert all(b[k].devices() == {second} and b[k].committed for b in batches for k in b)
    assert_exactly_once(ids_of(batches), N_IDS)


def test_a_sharding_splits_each_batch_among_its_devices(ids_ds: str, tmp_path: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(two_devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    kw = {"batch_size": 64, "columns": ["id", "label"], "collate": IDS32, "seed": 4}
    with skj.make_loader(ids_ds, sharding=sharding, drop_last=True, **kw) as loader:
        batches = list(loader)
    assert all(b["id"].sharding == sharding for b in batches)
    assert [s.data.shape for s in batches[0]["id"].addressable_shards] == [(32,), (32,)]
    assert len(batches) == N_IDS // 64
    with shardkit.make_reader(ids_ds, drop_last=True, **{k: v for k, v in kw.items() if k != "collate"}) as r:
        np.testing.assert_array_equal(ids_of(batches), ids_of(r))
    with skj.make_loader(ids_ds, sharding=sharding, **kw) as loader:  # 480 = 7 x 64 + 32: divides too
        assert len(list(loader)) == len(loader) == 8
    odd = write_ids(tmp_path / "odd", 99)
    with skj.make_loader(odd, sharding=sharding, **{**kw, "batch_size": 16}) as loader, \
            pytest.raises(AdapterError, match=r"'id', shape \(3,\), does not divide.*drop_last=True"):
        list(loader)  # 99 = 6 x 16 + 3: the epoch's last batch does not divide between 2 devices
    with skj.make_loader(odd, sharding=sharding, drop_last=True, **{**kw, "batch_size": 16}) as loader:
        assert len(list(loader)) == 6
    with pytest.raises(AdapterError, match=r"field 'id'.*batch_size=63.*does not divide"):
        skj.make_loader(ids_ds, sharding=sharding, **{**kw, "batch_size": 63})


def test_shardings_and_devices_are_checked_up_front(codecs_ds: str, tmp_path: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(two_devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    with pytest.raises(AdapterError, match="pass one of them"):
        skj.make_loader(os.fspath(tmp_path / "missing"), device="cpu", sharding=sharding)
    with pytest.raises(AdapterError, match=r"not a jax\.sharding\.Sharding"):
        skj.make_loader(os.fspath(tmp_path / "missing"), sharding="data")  # type: ignore[arg-type]
    with pytest.raises(AdapterError, match=r"field 'var' has a variable shape.*variable='pad'"):
        skj.make_loader(codecs_ds, sharding=sharding, batch_size=16, columns=["var", "label"])
    pad = skj.Collate(variable="pad")
    with skj.make_loader(codecs_ds, sharding=sharding, batch_size=16, columns=["var", "label"], collate=pad,
                         drop_last=True) as loader:
        batch = next(iter(loader))
    assert batch["var"].sharding == sharding
    assert batch["var__mask"].shape[0] == 16


# ---- arguments, collate functions, closing, the missing extra -----------------------------------------

def test_bad_arguments(ids_ds: str) -> None:
    with shardkit.make_reader(ids_ds) as reader:
        with pytest.raises(AdapterError, match="batch_size"):
            skj.make_loader(reader, batch_size=3)
        with pytest.raises(AdapterError, match="collate"):
            skj.make_loader(reader, collate=42)  # type: ignore[arg-type]
        with pytest.raises(AdapterError, match="prefetch=-1"):
            skj.make_loader(reader, prefetch=-1, collate=IDS32)
    with pytest.raises(AdapterError, match="URL"):
        skj.make_loader(42)  # type: ignore[arg-type]


def test_a_collate_function_replaces_the_policy(ids_ds: str) -> None:
    def collate(batch: dict[str, np.ndarray]) -> dict[str, Any]:
        return {"id": (batch["id"] * 2).astype(np.int32), "rows": [batch["label"][:2], None],
                "group": batch["group"], "n": len(batch["id"]), "on_device": jax.numpy.ones(2)}

    with skj.make_loader(ids_ds, batch_size=50, shuffle=False, collate=collate) as loader:
        batch = next(iter(loader))
    assert np.asarray(batch["id"][:3]).tolist() == [0, 2, 4]
    assert isinstance(batch["rows"][0], jax.Array)
    assert batch["rows"][1] is None
    assert isinstance(batch["group"], np.ndarray)  # not a number: handed out as it is
    assert batch["n"] == 50
    assert isinstance(batch["on_device"], jax.Array)


def test_the_loader_closes_its_reader(ids_ds: str) -> None:
    with skj.make_loader(ids_ds, batch_size=32, collate=IDS32, columns=["id"]) as loader:
        next(iter(loader))
        assert loader.reader._pool is not None
    assert loader.reader._pool is None


def test_missing_jax_names_the_extra() -> None:
    code = ("import sys; sys.modules['jax'] = None\n"
            "try:\n    import shardkit.jax\nexcept ImportError as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "MissingDependencyError" in out.stdout
    assert "pip install 'shardkit[jax]'" in out.stdout
    assert issubclass(MissingDependencyError, ImportError)


# ---- passes, resume ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_new_pass_or_a_loaded_state_ends_the_pass_in_progress(ids_ds: str, prefetch: int) -> None:
    with skj.make_loader(ids_ds, prefetch=prefetch, batch_size=48, shuffle=False, columns=["id"],
                         collate=IDS32) as loader:
        first = iter(loader)
        a = next(first)
        second = iter(loader)
        b = next(second)  # goes on after `a`
        assert next(first, None) is None  # the older pass ended; it took nothing from the newer one
        loader.load_state_dict(loader.state_dict())
        assert next(second, None) is None
        rest = list(loader)
    np.testing.assert_array_equal(ids_of([a, b, *rest]), np.arange(N_IDS))


@pytest.mark.parametrize("prefetch", [0, 3])
def test_loading_an_earlier_state_mid_pass_goes_back_to_it(ids_ds: str, prefetch: int) -> None:
    with skj.make_loader(ids_ds, prefetch=prefetch, batch_size=16, shuffle=False, columns=["id"],
                         collate=IDS32) as loader:
        seen = []
        for i, batch in enumerate(loader):
            seen.append(int(batch["id"][0]))
            if i == 2:
                saved = loader.state_dict()
            if i == 6:
                loader.load_state_dict(saved)
        after = ids_of(list(loader))
    assert seen == [16 * i for i in range(7)]
    np.testing.assert_array_equal(after, np.arange(48, N_IDS))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stop=st.integers(0, 9), prefetch=st.integers(0, 4), world=st.sampled_from([1, 2, 3]))
def test_resume_through_the_loader_continues_at_the_next_batch(ids_ds: str, stop: int, prefetch: int,
                                                               world: int) -> None:
    kw = {"batch_size": 48, "seed": 3, "columns": ["id"]}
    with shardkit.make_reader(ids_ds, **kw) as reader:
        whole = list(reader)
    loader = skj.make_loader(ids_ds, prefetch=prefetch, collate=IDS32, **kw)
    it = iter(loader)
    first = [next(it) for _ in range(stop)]
    state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint keeps it
    for i, batch in enumerate(first):
        np.testing.assert_array_equal(np.asarray(batch["id"]), whole[i]["id"])
    if stop % 2:  # a pass that stops early and goes on: the batches put ahead are not lost
        del it
        rest = list(loader)
        np.testing.assert_array_equal(ids_of(first + rest), ids_of(whole))
    loader.close()
    # the state resumes the job on `world` shards: what they read completes the epoch, each id once
    later = []
    for shard in range(world):
        with skj.make_loader(ids_ds, shard=shard, num_shards=world, prefetch=prefetch, collate=IDS32,
                             **kw) as resumed:
            resumed.load_state_dict(state)
            later.append(ids_of(list(resumed)))
            if world == 1:
                np.testing.assert_array_equal(later[0], ids_of(whole[stop:]))
    assert_exactly_once(np.concatenate([ids_of(first), *later]), N_IDS)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(passes=st.integers(1, 3), num_epochs=st.sampled_from([1, 2]), cut=st.integers(0, 10_000),
       after_pass=st.booleans(), prefetch=st.integers(0, 3))
def test_an_epoch_loop_resumed_from_any_batch_reads_what_the_uninterrupted_loop_reads(
        ids_ds: str, passes: int, num_epochs: int, cut: int, after_pass: bool, prefetch: int) -> None:
    """``for p in range(passes): for batch in loader``, saved at any batch or after any pass, then a new
    loader continues the outer loop where it was: the batches equal the uninterrupted loop's, in order."""
    kw = {"batch_size": 64, "seed": 7, "columns": ["id"], "num_epochs": num_epochs, "collate": IDS32}
    with skj.make_loader(ids_ds, prefetch=0, **kw) as loader:
        whole = [[np.asarray(b["id"]) for b in loader] for _ in range(passes)]
    flat = [b for p in whole for b in p]
    if after_pass:  # saved between passes: after pass `at`, the loop goes on with pass at + 1
        at = cut % passes
        done, first_pass = sum(len(p) for p in whole[: at + 1]), at + 1
        with skj.make_loader(ids_ds, prefetch=prefetch, **kw) as loader:
            for _ in range(at + 1):
                for _ in loader:
                    pass
            state = loader.state_dict()
    else:  # saved after batch `done` of the loop, in pass `first_pass`, which then goes on
        done = 1 + cut % len(flat)
        first_pass = next(p for p in range(passes) if sum(len(q) for q in whole[: p + 1]) >= done)
        with skj.make_loader(ids_ds, prefetch=prefetch, **kw) as loader:
            it = (b for _ in range(passes) for b in loader)
            for _ in range(done):
                next(it)
            state = loader.state_dict()
    state = json.loads(json.dumps(state))
    with skj.make_loader(ids_ds, prefetch=prefetch, **kw) as resumed:
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state  # saved again before reading: the same position
        rest = [np.asarray(b["id"]) for _ in range(first_pass, passes) for b in resumed]
    assert len(rest) == len(flat) - done
    for got, want in zip(rest, flat[done:], strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_public_module_is_the_implementation() -> None:
    from shardkit.reader.adapters.collate import Collate

    assert skj.make_loader is reader_jax.make_loader
    assert skj.Loader is reader_jax.Loader
    assert skj.Collate is Collate  # the same policy class as shardkit.torch's and shardkit.tf's


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_the_loader_reads_a_table_at_its_snapshot_and_resumes_on_it(fmt: str, tmp_path: Path) -> None:
    """A Delta or an Iceberg table, unchanged: the snapshot opened, every shard's rows once; a loader
    resumed after the table moved on finishes the snapshot it started on."""
    from tests.dataset.tables import make_history

    history = make_history(fmt, tmp_path / "t", [("append", 150), ("delete", 30), ("append", 90)])
    expected = history.ids()
    kw = {"batch_size": 10, "seed": 4, "num_shards": 3, "remainder": "uneven", "columns": ["id"]}
    seen: list[int] = []
    states = []
    for shard in range(3):
        with skj.make_loader(history.url, shard=shard, collate=IDS32, **kw) as loader:
            seen += [int(i) for i in np.asarray(next(iter(loader))["id"])]
            states.append(loader.state_dict())
    history.apply(("overwrite", 20))  # the table moves on between the cut and the resume
    for shard, state in enumerate(states):
        with skj.make_loader(history.url, shard=shard, collate=IDS32, **kw) as loader:
            loader.load_state_dict(state)
            seen += [int(i) for batch in loader for i in np.asarray(batch["id"])]
    assert sorted(seen) == sorted(expected)


def test_a_mixed_reader_feeds_jax_unchanged(tmp_path: Path) -> None:
    """Here, not beside the other mixture tests: the JAX tests run last (see ``tests/conftest.py``)."""
    from collections import Counter

    from tests.reader.test_mixture import items, stream_of, write_sources

    two = write_sources(tmp_path, [[5, 5], [4]])
    kw: dict[str, Any] = {"weights": {"s0": 1, "s1": 2}, "samples_per_epoch": 18, "batch_size": 6, "seed": 1}
    collate = skj.Collate(cast={"id": "int32"})
    with skj.make_loader(shardkit.make_reader(two, **kw), collate=collate) as loader:
        got = Counter(i for b in loader for i in items({k: np.asarray(v) for k, v in b.items()}))
    assert got == stream_of(two, 1, **kw)
