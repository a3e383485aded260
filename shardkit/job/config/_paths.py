"""The paths and URLs of a job config: local paths made absolute against the config file's folder, URLs
checked for a protocol some filesystem serves, and what no path may hold (a NUL, an environment variable).
"""

from __future__ import annotations

import contextvars
import os
import re
from pathlib import Path

from shardkit.job.config.values import Problem

__all__ = ["BASE_DIR", "absolute", "base_dir", "in_yaml_dir", "location", "plain_path"]

#: Where relative paths resolve while a config is validated: the YAML file's folder (else the current one).
BASE_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("shardkit_config_base", default=None)
# A URL (``s3://...``), or one of fsspec's chained URLs (``simplecache::s3://...``): kept as it is.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*(://|::)")


def location(value: str) -> str:
    """A data or checkpoint location: a URL as it is (its protocols checked), a local path made absolute."""
    if _SCHEME.match(value):
        _no_nul(value)
        _check_protocols(value)
        return value
    return str(absolute(value))


def base_dir() -> Path:
    return BASE_DIR.get() or Path.cwd()


def absolute(value: str | Path) -> Path:
    """A user path made absolute against the YAML's folder; symlinks are kept (a venv's python is one)."""
    _no_nul(str(value))
    _no_variable(str(value))
    path = Path(os.path.expanduser(value))
    return Path(os.path.normpath(base_dir() / path))


def _no_nul(value: str) -> None:
    """Refuse a NUL character (YAML's "\\0") in a path or URL: no OS call takes one, and the first that
    met it (making the logdir, starting a process) failed with a bare ``ValueError: embedded null byte``."""
    if "\0" in value:
        raise Problem((), value, "it holds a NUL character, which no path, URL or environment variable can "
                      "hold", "remove the \\0 from it")


_VARIABLE = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def _no_variable(value: str) -> None:
    """Refuse ``$NAME`` / ``${NAME}`` in a local path: job configs do not expand environment variables
    (a config is also rendered for, and read on, other machines, whose environment differs), and
    ``logdir: $SCRATCH/runs`` made a folder named ``$SCRATCH`` beside the config, without a word."""
    found = _VARIABLE.search(value)
    if found is not None:
        name = found.group(1).strip("{}")
        raise Problem((), value, f"it names the environment variable {found.group(0)}, and job configs do "
                      f"not expand variables (it would be a folder named {found.group(0)!r})",
                      f"write the path out, or give it on the command line, where your shell expands it: "
                      f"--set <this key>=\"${name}/...\"")


def plain_path(value: str) -> bool:
    """Whether ``value`` passes `_no_nul` and `_no_variable`."""
    return "\0" not in value and _VARIABLE.search(value) is None


def in_yaml_dir() -> str:
    return f"relative paths are relative to the config file's folder {base_dir()}"


def _check_protocols(url: str) -> None:
    """Refuse a URL whose protocol no fsspec filesystem serves (``foo://``, ``s4://``): the same refusal
    every role's reader or checkpoint store would make (`shardkit.errors.UnsupportedURLError`), made before
    anything starts, on any machine. A known protocol whose package is missing here is not refused: the
    machines that run the job may have it."""
    from fsspec.registry import get_filesystem_class  # lazily: fsspec is only needed for URLs

    for link in url.split("::"):  # a chained URL: simplecache::s3://bucket/ds
        protocol = link.split("://", 1)[0] if "://" in link else link
        try:
            get_filesystem_class(protocol)
        except ValueError:
            raise Problem((), url, f"no filesystem serves the protocol {protocol!r}",
                          "check the URL for a typo: a local path, or an fsspec URL such as s3://, gs://, "
                          "abfs://, hdfs://, https:// or memory://") from None
        except ImportError:
            pass  # known; its package may be installed where the job runs
