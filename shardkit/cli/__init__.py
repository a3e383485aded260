"""The ``shardkit`` command: parses arguments and calls the Python API, nothing more.

Its commands: ``inspect``, ``verify``, ``index``, ``write``, ``bench`` (datasets) and ``validate``,
``train``, ``render`` (training jobs); `main` runs one, `build_parser` describes them all (the docs'
command-line reference is generated from it).
"""

from shardkit.cli._main import build_parser, main

__all__ = ["build_parser", "main"]
