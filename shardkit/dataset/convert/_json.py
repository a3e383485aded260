"""A JSON-lines file read as `shardkit.dataset.convert` reads it: by ``pyarrow.json.open_json`` (which fails
on a key its first block lacks, where pyarrow.dataset would drop it), its times' UTC offsets kept apart.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.json as pj

from shardkit._storage.location import Location

__all__ = ["json_batches"]

#: The UTC offset that ends an ISO time (after its date and "T" or " "), as pyarrow's parser takes it.
_OFFSET = r"[T ][0-9:.,]*(?P<offset>Z|[+-]\d\d(?::?\d\d)?)$"


def json_batches(loc: Location, schema: pa.Schema, fragment: pads.Fragment, names: list[str], *,
                 strict: bool, zones: dict[str, list[str]], block_bytes: int) -> Iterator[pa.RecordBatch]:
    """A JSON-lines file's batches of ``names``, its partition keys' values added. Its times are parsed
    as text, then by `_json_times`: pyarrow's JSON parser turns a time's UTC offset into UTC silently
    (where its CSV parser types the column ``tz=UTC``); the offsets seen are added to ``zones``. It is
    parsed ``block_bytes`` at a time, each value as ``schema`` types it."""
    keys = pads.get_partition_keys(fragment.partition_expression)
    times = {f.name: f.type for f in schema if f.name not in keys and pa.types.is_timestamp(f.type)}
    parsed = pa.schema([pa.field(f.name, pa.string()) if f.name in times else f
                        for f in schema if f.name not in keys])
    options = pj.ParseOptions(explicit_schema=parsed,
                              unexpected_field_behavior="error" if strict else "ignore")
    with loc.arrow_fs.open_input_stream(fragment.path, compression="detect") as stream:
        for batch in pj.open_json(stream, pj.ReadOptions(block_size=block_bytes), options):
            n, cols = batch.num_rows, []
            for name in names:
                if name in keys:
                    cols.append(pa.repeat(pa.scalar(keys[name], schema.field(name).type), n))
                elif name in times:
                    values, offsets = _json_times(batch.column(name), times[name])
                    cols.append(values)
                    if new := [z for z in offsets if z not in zones.get(name, [])]:
                        zones[name] = [*zones.get(name, []), *new]
                else:
                    cols.append(batch.column(name))
            yield pa.RecordBatch.from_arrays(cols, schema=pa.schema([schema.field(name) for name in names]))


def _json_times(text: pa.Array, t: pa.DataType) -> tuple[pa.Array, list[str]]:
    """ISO times as the timestamps ``t`` (no zone), as pyarrow's JSON parser reads them (those with a UTC
    offset as their UTC wall time, the others as they are), and the offsets they carry (``Z`` and
    ``+00:00`` as ``UTC``). Arrow's cast refuses an offset where ``t`` has no zone, and a time without
    one where it has: the two kinds are cast apart."""
    found = pc.extract_regex(text, _OFFSET)
    zoned, offsets = pc.is_valid(found), found.flatten()[0]  # (flatten: null where nothing matched)
    if not pc.any(zoned).as_py():
        return text.cast(t), []
    utc = pc.if_else(zoned, text, None).cast(pa.timestamp(t.unit, "UTC")).cast(t)
    values = pc.if_else(zoned, utc, pc.if_else(zoned, None, text).cast(t))
    return values, list(dict.fromkeys(_zone_name(o) for o in pc.unique(offsets.drop_null()).to_pylist()))


def _zone_name(offset: str) -> str:
    """A UTC offset as ``+HH:MM`` (``+02`` and ``+0200`` are ``+02:00``), ``UTC`` for ``Z`` and zero."""
    if offset == "Z" or not offset.strip("+-0:"):
        return "UTC"
    digits = offset[1:].replace(":", "")
    return f"{offset[0]}{digits[:2]}:{digits[2:] or '00'}"
