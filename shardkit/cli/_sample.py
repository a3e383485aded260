"""What ``shardkit inspect URL --row N`` prints: one sample, field by field (`format_sample`), or as JSON
(`sample_json`)."""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np

from shardkit.dataset import Field, Schema

_SHOWN = 6  # values of an array shown at each end before "..."


def describe_value(field: Field, value: Any) -> str:
    """One field's value for people: scalars as they are, text quoted, bytes by length and first bytes,
    arrays by shape and dtype, with their values (summarized when long) and, for images, their range."""
    if value is None:
        return "null"
    if field.dtype.kind == "U":
        return repr(str(value))
    if field.dtype.kind == "S":
        data = bytes(value)
        head = data[:16].hex(" ")
        return f"{len(data)} bytes: {head}{' ...' if len(data) > 16 else ''}"
    arr = np.asarray(value)
    if arr.ndim == 0:
        return str(arr.item()) if arr.dtype.kind not in "mM" else str(arr)
    shape = "x".join(str(d) for d in arr.shape)
    text = np.array2string(arr, threshold=4 * _SHOWN, edgeitems=_SHOWN // 2, separator=", ",
                           max_line_width=100)
    summary = f"{arr.dtype} {shape}"
    if field.codec.name == "image" or arr.size > 4 * _SHOWN:
        if arr.size and arr.dtype.kind in "biuf":
            summary += f", min {arr.min()}, max {arr.max()}, mean {arr.mean():.4g}"
        if field.codec.name == "image":
            return summary
    return f"{summary}: " + " ".join(line.strip() for line in text.splitlines())


def format_sample(schema: Schema, url: str, row: int, num_rows: int, sample: dict[str, Any]) -> str:
    """``sample`` (row ``row`` of the dataset at ``url``) as lines, one per field."""
    lines = [f"{url}  row {row} of {num_rows}"]
    width = max((len(name) for name in sample), default=0)
    for name, value in sample.items():
        lines.append(f"  {name:<{width}}  {describe_value(schema[name], value)}")
    return "\n".join(lines)


def sample_json(url: str, row: int, num_rows: int, sample: dict[str, Any]) -> dict[str, Any]:
    """``sample`` as JSON-able data: numbers and arrays as (nested) lists, text as text, bytes as
    ``{"base64": ...}``, times as ISO strings, null as null."""
    return {"url": url, "row": row, "num_rows": num_rows,
            "fields": {name: _json_value(value) for name, value in sample.items()}}


def _json_value(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bytes | np.bytes_):
        return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, str):
        return value
    arr = np.asarray(value)
    if arr.dtype.kind in "mM":
        return arr.astype(str).tolist()
    return _finite(arr.tolist())


def _finite(value: Any) -> Any:
    """NaN and infinities as the strings ``"nan"``, ``"inf"``, ``"-inf"``: they are not JSON numbers."""
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
