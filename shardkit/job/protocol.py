"""What the trainer and its role processes agree on: environment variable names and the heartbeat datagram."""

from __future__ import annotations

import json
import math
import operator
import time as _time
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, get_args

__all__ = [
    "ALL_ENV",
    "ENV_ATTEMPT",
    "ENV_COLLECTIVE_TIMEOUT",
    "ENV_DATA_NUM_SHARDS",
    "ENV_DATA_SHARD",
    "ENV_HEARTBEAT_ADDR",
    "ENV_JOB_CONFIG",
    "ENV_JOB_DIR",
    "ENV_RESUME_STEP",
    "ENV_ROLE",
    "ENV_ROLE_INDEX",
    "HEARTBEAT_KINDS",
    "HEARTBEAT_VERSION",
    "JOB_CONFIG_FILE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MAX_DATAGRAM_BYTES",
    "RANK",
    "ROLES",
    "TF_CONFIG",
    "WORLD_SIZE",
    "Heartbeat",
    "HeartbeatKind",
    "format_addr",
    "parse_addr",
]

# Set for every role.
ENV_JOB_CONFIG: Final = "SHARDKIT_JOB_CONFIG"  # path of <job dir>/job.json, the resolved redacted config
ENV_JOB_DIR: Final = "SHARDKIT_JOB_DIR"  # the job's folder (= config.logdir)
ENV_ROLE: Final = "SHARDKIT_ROLE"  # worker | ps | chief | evaluator
ENV_ROLE_INDEX: Final = "SHARDKIT_ROLE_INDEX"  # 0-based index within the role
ENV_ATTEMPT: Final = "SHARDKIT_ATTEMPT"  # 0, then 1 after the first restart, ...
ENV_HEARTBEAT_ADDR: Final = "SHARDKIT_HEARTBEAT_ADDR"  # "127.0.0.1:PORT" (UDP); absent: heartbeats off
# Seconds one torch.distributed collective may wait (fault_tolerance.collective_timeout); absent: torch's.
ENV_COLLECTIVE_TIMEOUT: Final = "SHARDKIT_COLLECTIVE_TIMEOUT"
# The newest checkpoint folder's step when the attempt started (0: none), which every process of the attempt
# restores at most: a checkpoint a faster peer saved while this process was still starting is not taken.
# Absent (torchrun, by hand, or the supervisor could not list them): the newest.
ENV_RESUME_STEP: Final = "SHARDKIT_RESUME_STEP"
# Set only for the roles that read the job's data (see shardkit.cluster._spec).
ENV_DATA_SHARD: Final = "SHARDKIT_DATA_SHARD"
ENV_DATA_NUM_SHARDS: Final = "SHARDKIT_DATA_NUM_SHARDS"
# torch.distributed's env:// rendezvous (torch jobs only).
MASTER_ADDR: Final = "MASTER_ADDR"
MASTER_PORT: Final = "MASTER_PORT"
RANK: Final = "RANK"
WORLD_SIZE: Final = "WORLD_SIZE"
LOCAL_RANK: Final = "LOCAL_RANK"
LOCAL_WORLD_SIZE: Final = "LOCAL_WORLD_SIZE"
# TensorFlow's cluster description (tensorflow jobs only).
TF_CONFIG: Final = "TF_CONFIG"

ALL_ENV: Final = frozenset(
    {
        ENV_JOB_CONFIG, ENV_JOB_DIR, ENV_ROLE, ENV_ROLE_INDEX, ENV_ATTEMPT, ENV_HEARTBEAT_ADDR,
        ENV_DATA_SHARD, ENV_DATA_NUM_SHARDS, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE, TF_CONFIG, ENV_COLLECTIVE_TIMEOUT, ENV_RESUME_STEP,
    }
)
"""Every variable the trainer sets itself; a job config's `env`/`secrets` may not override them."""

JOB_CONFIG_FILE: Final = "job.json"
ROLES: Final = ("worker", "ps", "chief", "evaluator")

HEARTBEAT_VERSION: Final = 1
HeartbeatKind = Literal["start", "step", "checkpoint", "done", "alive"]
HEARTBEAT_KINDS: Final[tuple[str, ...]] = get_args(HeartbeatKind)
# Well under the 65,507-byte UDP payload limit, so a datagram is never fragmented away on loopback.
MAX_DATAGRAM_BYTES: Final = 32_768


@dataclass(frozen=True)
class Heartbeat:
    """One heartbeat datagram from a role process to the supervisor (UDP, JSON, version 1).

    Example:
        >>> hb = Heartbeat(role="worker", index=0, attempt=0, pid=os.getpid(), kind="step", step=17,
        ...                time=time.time(), samples=1088, metrics={"loss": 0.3})
        >>> sock.sendto(hb.to_bytes(), parse_addr(os.environ[ENV_HEARTBEAT_ADDR]))
        >>> Heartbeat.decode(datagram)   # receiver side: None for anything malformed, never raises

    Wire form: ``{"v": 1, "role", "index", "attempt", "pid", "kind", "step", "time", "samples",
    "metrics", "checkpoint"}``. Receivers ignore unknown extra keys (so a later minor addition does not
    break an older supervisor) but drop a datagram with another ``v``, a missing or mistyped field.
    Non-finite metric values (a NaN loss) are sent as JSON ``NaN``/``Infinity``, which Python's json
    reads back, so the supervisor can see a diverging run. ``checkpoint``: on a "checkpoint" beat, the
    checkpoint saved at ``step``; on an "alive" beat, the one the process restored (``step`` is its
    step; ``""``: it restored none), sent once, after ``ctx.checkpoint.restore``.
    """

    role: str
    index: int
    attempt: int
    pid: int
    kind: HeartbeatKind
    step: int = 0
    time: float = field(default_factory=_time.time)
    samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None
    v: int = HEARTBEAT_VERSION

    def __post_init__(self) -> None:
        # Coerce what a training loop naturally hands over (numpy scalars, 0-d tensors) to JSON types.
        for key in ("index", "attempt", "pid", "step", "samples"):
            value = getattr(self, key)
            if not isinstance(value, bool) and hasattr(value, "__index__"):
                object.__setattr__(self, key, operator.index(value))
        try:
            object.__setattr__(self, "time", float(self.time))
            object.__setattr__(self, "metrics", {str(k): float(v) for k, v in dict(self.metrics).items()})
        except (TypeError, ValueError) as e:
            raise ValueError(f"heartbeat time and metrics must be numbers: {e}") from e
        problem = _problem(asdict(self))
        if problem is not None:
            raise ValueError(f"invalid heartbeat {self!r}: {problem}")

    def to_bytes(self) -> bytes:
        """Encode as one UTF-8 JSON datagram; ValueError beyond `MAX_DATAGRAM_BYTES` (too many metrics)."""
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        if len(data) > MAX_DATAGRAM_BYTES:
            raise ValueError(
                f"heartbeat of {len(data)} bytes exceeds {MAX_DATAGRAM_BYTES}: send fewer or shorter metrics"
            )
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> Heartbeat:
        """Decode a datagram; raises ValueError (naming the problem) when it is not a valid heartbeat."""
        if len(data) > MAX_DATAGRAM_BYTES:
            raise ValueError(f"datagram of {len(data)} bytes is larger than any heartbeat")
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ValueError(f"datagram is not UTF-8 JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ValueError(f"datagram is JSON {type(obj).__name__}, not an object")
        obj = {key: obj[key] for key in _FIELDS if key in obj}
        problem = _problem(obj)
        if problem is not None:
            raise ValueError(f"invalid heartbeat: {problem}")
        return cls(**obj)

    @classmethod
    def decode(cls, data: bytes) -> Heartbeat | None:
        """Decode a datagram, or None if it is malformed: what a receiver loop calls (never raises)."""
        try:
            return cls.from_bytes(data)
        except Exception:  # a stray or hostile datagram must never stop the supervisor
            return None


_FIELDS = ("v", "role", "index", "attempt", "pid", "kind", "step", "time", "samples", "metrics", "checkpoint")
_REQUIRED = frozenset({"v", "role", "index", "attempt", "pid", "kind"})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problem(obj: dict[str, Any]) -> str | None:
    """What is wrong with a heartbeat's fields, or None (shared by the constructor and the decoder)."""
    missing = sorted(_REQUIRED - obj.keys())
    if missing:
        return f"missing {', '.join(missing)}"
    if obj["v"] != HEARTBEAT_VERSION or not _is_int(obj["v"]):
        return f"version {obj['v']!r}, expected {HEARTBEAT_VERSION}"
    if obj["role"] not in ROLES:
        return f"role {obj['role']!r} is not one of {', '.join(ROLES)}"
    if obj["kind"] not in HEARTBEAT_KINDS:
        return f"kind {obj['kind']!r} is not one of {', '.join(HEARTBEAT_KINDS)}"
    for key in ("index", "attempt", "step", "samples"):
        if key in obj and not (_is_int(obj[key]) and obj[key] >= 0):
            return f"{key} {obj[key]!r} is not an integer >= 0"
    if not (_is_int(obj["pid"]) and obj["pid"] > 0):
        return f"pid {obj['pid']!r} is not a positive integer"
    if "time" in obj and not (isinstance(obj["time"], int | float) and not isinstance(obj["time"], bool)
                              and math.isfinite(obj["time"])):
        return f"time {obj['time']!r} is not a finite number"
    metrics = obj.get("metrics", {})
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
        for k, v in metrics.items()
    ):
        return "metrics is not an object of name -> number"
    checkpoint = obj.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str):
        return f"checkpoint {checkpoint!r} is not a string or null"
    return None


def parse_addr(addr: str) -> tuple[str, int]:
    """``"127.0.0.1:5000"`` (or ``"[::1]:5000"``) -> ``("127.0.0.1", 5000)``; ValueError when malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {addr!r} is not HOST:PORT (e.g. 127.0.0.1:5000)")
    return host.removeprefix("[").removesuffix("]"), int(port)


def format_addr(host: str, port: int) -> str:
    """``("127.0.0.1", 5000)`` -> ``"127.0.0.1:5000"``; IPv6 hosts are bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
