"""Codecs by name: the registry that turns a schema's JSON codec entry back into a codec object.

A codec in the schema is data (``{"name": "image", "format": "png", "quality": 95}``), never a class
path, so reading a dataset never imports or runs anything the dataset names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardkit.dataset.codecs.base import Codec, check_options
from shardkit.dataset.codecs.image import ImageCodec
from shardkit.dataset.codecs.scalar import ScalarCodec
from shardkit.dataset.codecs.tensor import NdarrayCodec, TensorCodec
from shardkit.errors import SchemaError

__all__ = [
    "CODECS",
    "Codec",
    "ImageCodec",
    "NdarrayCodec",
    "ScalarCodec",
    "TensorCodec",
    "codec_from_json",
    "register",
]

CODECS: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Add a codec class to the registry under its ``name``."""
    CODECS[cls.name] = cls
    return cls


for _cls in (ScalarCodec, TensorCodec, NdarrayCodec, ImageCodec):
    register(_cls)


def codec_from_json(spec: Any, *, where: str = "schema") -> Codec:
    """Build a codec from its JSON form (``{"name": ..., **options}``) or its bare name."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise SchemaError(f"{where}: a codec must be a name or {{'name': ..., options}}, got {spec!r}")
    options = dict(spec)
    name = options.pop("name")
    if name.startswith("petastorm."):
        import shardkit.dataset.petastorm.codecs  # noqa: F401 - registers the read-only Petastorm codecs
    cls = CODECS.get(name)
    if cls is None:
        raise SchemaError(
            f"{where}: unknown codec {name!r}; known codecs are {sorted(CODECS)}. "
            "A dataset written by a newer shardkit may need an upgrade: pip install -U shardkit"
        )
    try:
        check_options(name, options, {f.name for f in dataclasses.fields(cls)})
        return cls(**options)
    except SchemaError as e:
        raise SchemaError(f"{where}: {e}") from e
    except (TypeError, ValueError) as e:
        raise SchemaError(f"{where}: codec {name!r} options {options!r} are invalid: {e}") from e
