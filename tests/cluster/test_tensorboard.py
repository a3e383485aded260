"""The scalar writer's files read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardkit.cluster.monitor._tensorboard import ScalarWriter, _varint, crc32c, masked_crc32c


def _accumulate(logdir: Path):  # type: ignore[no-untyped-def]
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(logdir))
    acc.Reload()
    return acc


def test_crc32c_known_values() -> None:
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 test vector: 32 bytes of zeros
    assert masked_crc32c(b"123456789") == ((((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xA282EAD8)
                                           & 0xFFFFFFFF)


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_varint_roundtrip(n: int) -> None:
    data = _varint(n)
    value, shift = 0, 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
    assert value == n & ((1 << 64) - 1)
    assert all(b & 0x80 for b in data[:-1])
    assert not data[-1] & 0x80


def test_scalars_read_back_by_tensorboard(tmp_path: Path) -> None:
    with ScalarWriter(tmp_path) as tb:
        for step in range(1, 6):
            tb.add_scalars({"loss": 1.0 / step, "samples_per_s": 100.0 * step, "ignored": "text"}, step)
        tb.add_scalar("restarts", 1, step=3)
        tb.add_scalars({"big_step": 2.5}, step=2**40)
    acc = _accumulate(tmp_path)
    assert set(acc.Tags()["scalars"]) == {"loss", "samples_per_s", "restarts", "big_step"}
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.2], rel=1e-6)
    assert [(e.step, e.value) for e in acc.Scalars("restarts")] == [(3, 1.0)]
    assert acc.Scalars("big_step")[0].step == 2**40


def test_records_have_valid_checksums(tmp_path: Path) -> None:
    with ScalarWriter(tmp_path) as tb:
        tb.add_scalar("x", math.pi, 7)
    data = tb.path.read_bytes()
    records = 0
    while data:
        (length,) = struct.unpack("<Q", data[:8])
        assert struct.unpack("<I", data[8:12])[0] == masked_crc32c(data[:8])
        body = data[12:12 + length]
        assert struct.unpack("<I", data[12 + length:16 + length])[0] == masked_crc32c(body)
        data = data[16 + length:]
        records += 1
    assert records == 2


def test_write_after_close_is_ignored(tmp_path: Path) -> None:
    tb = ScalarWriter(tmp_path)
    tb.close()
    tb.add_scalar("x", 1.0, 1)
    assert len(_accumulate(tmp_path).Tags()["scalars"]) == 0


def test_finite_values_beyond_float32_are_written_as_infinity(tmp_path: Path) -> None:
    """TensorBoard stores float32: exp(100) (a perplexity early in training) is +inf there, not an error."""
    big = math.exp(100)
    with ScalarWriter(tmp_path) as tb:
        tb.add_scalars({"ppl": big, "neg": -1e300, "top": 3.4028234663852886e38, "nan": math.nan,
                        "inf": math.inf}, step=1)
        tb.add_scalars({"ppl": 2.5}, step=2)  # the writer goes on
    acc = _accumulate(tmp_path)
    assert [e.value for e in acc.Scalars("ppl")] == [math.inf, 2.5]
    assert acc.Scalars("neg")[0].value == -math.inf
    assert acc.Scalars("top")[0].value == pytest.approx(3.4028234663852886e38)  # float32's largest: kept
    assert math.isnan(acc.Scalars("nan")[0].value)
    assert acc.Scalars("inf")[0].value == math.inf
