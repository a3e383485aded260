"""shardkit.torch on a CUDA device: pinned staging buffers, non-blocking copies on a side stream, overlap.

Marked ``gpu`` (deselected by default: ``pytest -m gpu`` runs them) and skipped, with the reason, where
torch sees no CUDA device. The bandwidth test prints host-to-device GB/s of the loader's copy path next
to torch copying the same pinned tensor alone; it asserts no speed (speed lives in benchmarks/).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import shardkit
from tests.reader.datasets import write_all_codecs

pytestmark = pytest.mark.gpu

import torch  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip(f"needs a CUDA GPU: torch {torch.__version__} sees none", allow_module_level=True)

import shardkit.torch as skt  # noqa: E402
from shardkit.reader.adapters import torch as reader_torch  # noqa: E402
from shardkit.reader.adapters.torch import _CudaStager  # noqa: E402

SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: a kernel that keeps the GPU busy ~0.1 s


@pytest.fixture(scope="module")
def codecs_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_all_codecs(tmp_path_factory.mktemp("codecs") / "ds")[0]


@pytest.fixture(scope="module")
def big_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    """1,024 rows of 64 KiB (float32[16384]): batches of 256 are 16 MiB copies."""
    path = tmp_path_factory.mktemp("big") / "ds"
    rng = np.random.default_rng(0)
    x = rng.random((1024, 16384), dtype=np.float32)
    shardkit.write_dataset({"id": np.arange(1024), "x": x}, os.fspath(path), row_group_size=256)
    return os.fspath(path)


def test_values_on_the_device_equal_the_readers(codecs_ds: str) -> None:
    kw = {"batch_size": 16, "shuffle": True, "seed": 1}
    with shardkit.make_reader(codecs_ds, **kw) as reader, \
            skt.make_loader(codecs_ds, device="cuda", **kw) as ld:
        assert ld.pin_memory
        pairs = list(zip(reader, ld, strict=True))
    torch.cuda.synchronize()
    for want, got in pairs:
        for name, value in want.items():
            out = got[name]
            if isinstance(out, torch.Tensor):
                assert out.device.type == "cuda"
                data = value.filled(0) if isinstance(value, np.ma.MaskedArray) else value
                assert out.cpu().numpy().dtype == data.dtype
                np.testing.assert_array_equal(out.cpu().numpy(), data)
            elif value.dtype == object and any(isinstance(v, np.ndarray) for v in value):
                for row, exp in zip(out, value, strict=True):
                    assert (row is None) == (exp is None)
                    if exp is not None:
                        assert row.device.type == "cuda"
                        np.testing.assert_array_equal(row.cpu().numpy(), exp)
            else:
                assert out == list(value)


def test_staging_buffers_are_pinned_and_reused(big_ds: str) -> None:
    """Unshuffled batches are views of decoded row groups (ordinary memory): copied into pinned slots."""
    with skt.make_loader(big_ds, device="cuda", batch_size=256, num_epochs=None, shuffle=False) as loader:
        it = iter(loader)
        next(it)
        next(it)
        stager = loader._stager
        first = {(i, k): b.data_ptr() for i, slot in enumerate(stager.buffers) for k, b in slot.items()}
        for _ in range(10):
            next(it)
        again = {(i, k): b.data_ptr() for i, slot in enumerate(stager.buffers) for k, b in slot.items()}
    assert first == again
    assert {k for _, k in first} == {"x", ""}  # x (16 MiB) alone, the small columns packed together
    assert all(b.is_pinned() for slot in stager.buffers for b in slot.values())


def test_shuffled_batches_are_pinned_where_the_shuffle_puts_them_and_sent_without_a_copy(big_ds: str) -> None:
    with shardkit.make_reader(big_ds, batch_size=128, seed=5) as reader:
        want = [b["x"].copy() for b in reader]
    with skt.make_loader(big_ds, device="cuda", batch_size=128, seed=5) as loader:
        got, direct = [], 0
        for batch in loader:
            held = [t for slot in loader._stager.held for t in slot]
            assert all(t.is_pinned() for t in held)
            expected = torch.from_numpy(want[len(got)])
            direct += any(t.shape == expected.shape and torch.equal(t, expected) for t in held)
            got.append(batch["x"].cpu().numpy())
    # all but batches that span two shuffle windows (joined in ordinary memory, then staged) go directly
    assert direct >= len(got) // 2, (direct, len(got))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_batch_in_use_is_never_overwritten(big_ds: str) -> None:
    """Slow compute on every batch while later ones are staged: the sums still match the data."""
    with shardkit.make_reader(big_ds, batch_size=128, seed=3) as reader:
        want = [float(b["x"].astype(np.float64).sum()) for b in reader]
    sums = []
    with skt.make_loader(big_ds, device="cuda", batch_size=128, seed=3) as loader:
        for batch in loader:
            torch.cuda._sleep(SLEEP_CYCLES // 10)  # the batch is read after this kernel, on this stream
            sums.append(batch["x"].double().sum())
    got = [float(s) for s in sums]
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_the_copy_of_the_next_batch_overlaps_compute_on_this_one(big_ds: str) -> None:
    with skt.make_loader(big_ds, device="cuda", batch_size=256) as loader:
        it = iter(loader)
        next(it)  # batch 0 handed out: the copy of batch 1 is already issued on the side stream
        torch.cuda._sleep(SLEEP_CYCLES)  # "compute" on batch 0
        compute_done = torch.cuda.Event()
        compute_done.record()
        copy_of_next = loader._stager.done[1]
        copy_of_next.synchronize()
        # the copy finished while the compute kernel still ran: it did not wait for it
        assert not compute_done.query()
        next(it)


def test_every_size_and_dtype_arrives_intact_through_the_staging_path() -> None:
    """Whole and chunked copies (past `_CHUNK`, not a multiple of it), the threaded host copy, empty
    tensors, and what numpy cannot view (bfloat16, strided), through two reuses of each slot."""
    rng = np.random.default_rng(7)
    chunk = reader_torch._CHUNK
    batches = []
    for round_ in range(4):
        batches.append({
            "empty": torch.empty(0, dtype=torch.float32),
            "one": torch.tensor([round_], dtype=torch.int64),
            "chunked": torch.from_numpy(rng.integers(0, 256, 2 * chunk + 3 + round_, dtype=np.uint8)),
            "floats": torch.from_numpy(rng.random((chunk // 4 + 5,), dtype=np.float32)),
            "bf16": torch.from_numpy(rng.random((1000,), dtype=np.float32)).to(torch.bfloat16),
            "strided": torch.from_numpy(rng.random((64, 32), dtype=np.float32)).t(),
            "text": ["a", "b"],
        })
    stager = _CudaStager(torch.device("cuda", torch.cuda.current_device()))
    staged = [stager.stage(b) for b in batches[:2]]
    got = [stager.hand(staged[0]), stager.hand(staged[1])]
    got += [stager.hand(stager.stage(b)) for b in batches[2:]]
    torch.cuda.synchronize()
    for want, out in zip(batches, got, strict=True):
        assert out["text"] == want["text"]
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert out[key].device.type == "cuda"
                assert out[key].dtype == value.dtype
                assert torch.equal(out[key].cpu(), value), key


def test_host_to_device_bandwidth_vs_a_plain_pinned_copy(capsys: pytest.CaptureFixture[str]) -> None:
    """The loader's copy path (pinned slot -> device, non_blocking, side stream) vs torch alone, measured
    as `benchmarks.gpu` measures it (the figure lives in its results; nothing is asserted of speed)."""
    from benchmarks.gpu import h2d

    got = h2d(64, repeat=20)
    with capsys.disabled():
        print(f"\nH2D 64 MiB: loader path {got['loader_gbps']:.1f} GB/s (host copy into the pinned slot "
              f"included), torch pinned copy alone {got['torch_gbps']:.1f} GB/s: {got['ratio']:.2f}x on "
              f"{torch.cuda.get_device_name()}")
    assert got["loader_gbps"] > 0
    assert got["torch_gbps"] > 0
