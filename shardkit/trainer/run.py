"""``python -m shardkit.trainer.run package.module:function``: runs a ``module:function`` entrypoint.

The function is called with no arguments (it calls ``shardkit.trainer.init()`` itself, like a script);
its return value is ignored. The current folder is on ``sys.path`` (as with ``python -m``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from shardkit.errors import ConfigError

__all__ = ["load_entrypoint", "main"]


def load_entrypoint(target: str) -> Callable[[], Any]:
    """``"package.module:function"`` -> the function.

    Raises:
        ConfigError: malformed, the module does not import, or it has no such callable.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"entrypoint {target!r} is not package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"entrypoint {target!r}: cannot import {module_name!r} ({e}). Fix: install the "
                          "package in the job's python, or run from the folder that holds it") from e
    function = getattr(module, attr, None)
    if not callable(function):
        raise ConfigError(f"entrypoint {target!r}: {module_name} has no function {attr!r}")
    return function  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m shardkit.trainer.run package.module:function", file=sys.stderr)
        return 2
    if "" not in sys.path:
        sys.path.insert(0, "")
    load_entrypoint(args[0])()
    return 0


if __name__ == "__main__":
    sys.exit(main())
