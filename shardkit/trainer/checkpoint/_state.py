"""A checkpoint's ``state.json``: step, reader state, RNG states and user extra, as JSON (never pickle)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np

from shardkit.errors import CheckpointError

STATE_VERSION = 1
_MT_WORDS = 624  # Mersenne Twister state words (python `random` keeps one more: the position)


def capture_rng() -> dict[str, Any]:
    """The global RNG states as JSON lists: python ``random``, numpy's global, torch CPU and CUDA.

    torch is recorded only when the script imported it (a TensorFlow job never pays for importing
    torch), and CUDA only when CUDA was initialized (asking would start a context on every GPU).
    TensorFlow's global generator is not recorded: keep a ``tf.random.Generator`` in the
    ``tf.train.Checkpoint`` instead, where TensorFlow saves it itself.
    """
    version, internal, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]",
                                             np.random.get_state(legacy=True))
    rng: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {"kind": str(kind), "key": key.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(cached)},
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        rng["torch"] = torch.get_rng_state().tolist()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = [state.tolist() for state in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Set the global RNGs from a state that `check_rng` accepted (entries absent are left alone)."""
    if "python" in rng:
        py = rng["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "numpy" in rng:
        st = rng["numpy"]
        np.random.set_state((st["kind"], np.array(st["key"], dtype=np.uint32), st["pos"],
                             st["has_gauss"], st["gauss"]))
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if "torch" in rng:
        torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    # A run resumed on fewer GPUs (or none) cannot continue their streams: those states are dropped.
    if "cuda" in rng and torch.cuda.is_available() and torch.cuda.device_count() == len(rng["cuda"]):
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])


def check_rng(rng: Any) -> dict[str, Any]:
    """Validate a loaded RNG state before anything is set; raises ValueError naming the bad entry."""
    if not isinstance(rng, dict):
        raise ValueError(f"rng is {type(rng).__name__}, not an object")
    if "python" in rng:
        py = rng["python"]
        if not (isinstance(py, dict) and _ints(py.get("internal"), _MT_WORDS + 1, 2**32)
                and isinstance(py.get("version"), int)
                and (py.get("gauss_next") is None or isinstance(py.get("gauss_next"), float))):
            raise ValueError("rng.python is not a python `random` state")
    if "numpy" in rng:
        st = rng["numpy"]
        if not (isinstance(st, dict) and st.get("kind") == "MT19937"
                and _ints(st.get("key"), _MT_WORDS, 2**32)
                and isinstance(st.get("pos"), int) and st.get("has_gauss") in (0, 1)
                and isinstance(st.get("gauss"), float)):
            raise ValueError("rng.numpy is not a numpy MT19937 state")
    if "torch" in rng and not _ints(rng["torch"], None, 256):
        raise ValueError("rng.torch is not a list of bytes")
    cuda = rng.get("cuda", [])
    if not (isinstance(cuda, list) and all(_ints(s, None, 256) for s in cuda)):
        raise ValueError("rng.cuda is not a list of byte lists")
    return rng


def encode_state(step: int, *, reader: Mapping[str, Any] | None, rng: Mapping[str, Any] | None,
                 extra: Mapping[str, Any] | None, where: str,
                 rng_ranks: Sequence[Mapping[str, Any]] | None = None,
                 reader_shards: Sequence[Mapping[str, Any] | None] | None = None) -> bytes:
    """``state.json`` bytes; a reader state or ``extra`` that is not JSON fails here, before any write.

    Dict keys must be strings: JSON would turn ``3``, ``True`` and ``None`` into ``"3"``, ``"true"`` and
    ``"null"``, and the restored dict would miss the keys the script looks up. Tuples are saved as lists
    (and come back as lists). ``rng_ranks``: every rank's `capture_rng` in rank order (torch allreduce
    jobs of several processes), beside ``rng`` (this process's). ``reader_shards``: every data shard's
    own reader state in shard order, None for a shard that starts from the beginning (a torch
    parameter-server job, whose workers do not step together), beside ``reader`` (the writer's).
    """
    shards = [(f"reader_shards[{i}]", value) for i, value in enumerate(reader_shards or ())]
    for name, value in (("reader.state_dict()", reader), ("extra", extra), *shards):
        if value is not None and not isinstance(value, Mapping):
            raise CheckpointError(f"checkpoint {where}: {name} is {type(value).__name__}, not a dict of "
                                  "JSON values; pass a dict (numbers, strings, lists, dicts)")
        for path, key in _keys(value, name):
            if not isinstance(key, str):
                raise CheckpointError(
                    f"checkpoint {where}: {path} has the key {key!r} ({type(key).__name__}), "
                    f"{_as_json(key)}; use str keys (checkpoints are JSON: the restored dict would not have "
                    "this key)")
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {where}: {name} is not JSON ({e}); keep only numbers, strings, lists and dicts "
                "in it (checkpoints never pickle)"
            ) from e
    doc: dict[str, Any] = {"version": STATE_VERSION, "step": step, "reader": reader, "rng": rng,
                           "extra": dict(extra or {})}
    if rng_ranks is not None:
        doc["rng_ranks"] = [dict(r) for r in rng_ranks]
    if reader_shards is not None:
        doc["reader_shards"] = [None if r is None else dict(r) for r in reader_shards]
    return json.dumps(doc, separators=(",", ":")).encode()


def _keys(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``(path of the dict, key)`` for every dict key in ``value``, outermost first."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield path, key
            yield from _keys(item, f"{path}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _keys(item, f"{path}[{i}]")


def _as_json(key: Any) -> str:
    try:
        return f"which JSON turns into the string {next(iter(json.loads(json.dumps({key: 0}))))!r}"
    except (TypeError, ValueError):
        return "which JSON cannot hold"


def decode_state(data: bytes, step: int) -> dict[str, Any]:
    """Parse ``state.json``; raises ValueError (the caller names the file) when it does not fit."""
    doc = json.loads(data.decode())
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
        raise ValueError(f"not a shardkit checkpoint state (version {STATE_VERSION})")
    if doc.get("step") != step:
        raise ValueError(f"it holds step {doc.get('step')!r}, its commit says step {step}")
    if doc.get("reader") is not None and not isinstance(doc["reader"], dict):
        raise ValueError("its reader state is not an object")
    shards = doc.get("reader_shards")
    if shards is not None and not (isinstance(shards, list) and shards
                                   and all(r is None or isinstance(r, dict) for r in shards)):
        raise ValueError("its reader_shards is not a list of reader states (objects or null)")
    if not isinstance(doc.get("extra"), dict):
        raise ValueError("its extra is not an object")
    if doc.get("rng") is not None:
        check_rng(doc["rng"])
    ranks = doc.get("rng_ranks")
    if ranks is not None:
        if not isinstance(ranks, list) or not ranks:
            raise ValueError("its rng_ranks is not a list of RNG states")
        for i, rng in enumerate(ranks):
            try:
                check_rng(rng)
            except ValueError as e:
                raise ValueError(f"rng_ranks[{i}]: {e}") from e
    return doc


def _ints(value: Any, length: int | None, bound: int) -> bool:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        return False
    return all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < bound for v in value)
