"""Failures to reach storage, as shardkit errors: permissions, credentials, missing filesystems.

What the layers below raise for these names neither the dataset nor the fix, and reads as something
else: Arrow reports an unreadable file as an ``OSError`` that the Parquet paths took for corruption,
fsspec leaves a folder it may not list out of its listing (so a dataset looked empty), and botocore's
``NoCredentialsError`` is no ``OSError`` at all. Each is turned into an error of `shardkit.errors`
here: `is_denied` / `permission_error` (a `DatasetPermissionError` with the owner and mode to fix),
`filesystem_error` (a URL no installed filesystem serves), `storage_option_error` (an option the
URL's filesystem does not take) and `storage_errors` (credentials and connections). botocore and
google-auth are not imported: their errors are matched by class name.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import importlib
import inspect
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from shardkit.errors import (
    DatasetError,
    DatasetPermissionError,
    MissingDependencyError,
    MissingFilesystemError,
    ShardkitError,
    StorageOptionsError,
    UnsupportedURLError,
    one_line,
)

if TYPE_CHECKING:
    from shardkit._storage.location import Location

#: What a permission needs, by action: on local files (mode bits), and on object stores. "write to":
#: a dataset written (`write_dataset`): it looks for one there (list, read its schema), writes its files
#: under a staging folder, moves them (a copy, then a delete, on an object store) and removes replaced ones.
_LOCAL_NEED = {"read": "r", "list": "r and x", "write in": "w and x", "open": "r and x",
               "write to": "r, w and x"}
_STORE_NEED = {"read": "read objects", "list": "list the bucket", "write in": "write objects",
               "open": "list the bucket and read objects",
               "write to": "list the bucket and read, write and delete objects"}
#: Packages of fsspec filesystems that a shardkit extra installs; others are installed by name.
_EXTRAS = {"s3fs": "s3"}
_CREDENTIALS = (
    "no credentials were found for it: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
    "or pass storage_options={'key': ..., 'secret': ...}, or {'anon': True} for a public bucket; for "
    "gs:// run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
)
_CONNECTION = (
    "the storage service could not be reached: check the network and proxy, and the endpoint "
    "(storage_options={'client_kwargs': {'endpoint_url': ...}} for an S3-compatible store)"
)
#: Errors of cloud SDKs, by class name (theirs or a base's), and what to do about them.
_CLOUD_ERRORS = {
    "NoCredentialsError": _CREDENTIALS,  # botocore
    "PartialCredentialsError": _CREDENTIALS,
    "CredentialRetrievalError": _CREDENTIALS,
    "ProfileNotFound": _CREDENTIALS,
    "TokenRetrievalError": _CREDENTIALS,
    "SSOTokenLoadError": _CREDENTIALS,
    "UnauthorizedSSOTokenError": _CREDENTIALS,
    "DefaultCredentialsError": _CREDENTIALS,  # google.auth (gcsfs)
    "RefreshError": _CREDENTIALS,
    "ClientAuthenticationError": _CREDENTIALS,  # azure (adlfs)
    "NoRegionError": "no region is set: set AWS_DEFAULT_REGION, or storage_options="
                     "{'client_kwargs': {'region_name': ...}}",
    "EndpointConnectionError": _CONNECTION,  # botocore
    "ConnectTimeoutError": _CONNECTION,
    "ConnectionClosedError": _CONNECTION,
    "ProxyConnectionError": _CONNECTION,
    "ReadTimeoutError": _CONNECTION,  # botocore: a server that took the connection but does not answer
}
#: Where a filesystem sends the storage options its constructor does not name, when not to fsspec's
#: base class (which ignores what it does not use): ``module:callable``, whose signature says which it
#: takes, and the arguments the filesystem fills in itself. s3fs makes a botocore session with them,
#: fsspec's HTTP passes them to every request; either raises ``TypeError`` for an unknown one, and only
#: at the first request.
_PASSED_ON = {
    "s3fs.core.S3FileSystem": ("aiobotocore.session:AioSession", ()),
    "fsspec.implementations.http.HTTPFileSystem": (
        "aiohttp:ClientSession._request", ("method", "str_or_url")),
}


def is_denied(e: BaseException) -> bool:
    """Whether ``e`` is a refused permission: a `PermissionError`, or an `OSError` with errno EACCES or
    EPERM (as Arrow and some fsspec filesystems raise it)."""
    return isinstance(e, PermissionError) or (
        isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM))


def permission_error(loc: Location, path: str, e: BaseException, *, action: str = "read"
                     ) -> DatasetPermissionError:
    """The error for ``path`` (under ``loc``) that this user may not ``action``: ``"read"`` (a file),
    ``"list"`` or ``"write in"`` (a folder), ``"open"`` or ``"write to"`` (a dataset: what reading or
    writing one needs, `_STORE_NEED`). It names the path and the fix, the owner and mode (the
    credentials' permissions on an object store), and never suggests removing the file."""
    if loc.is_local:
        fix = (f"{_owner_mode(path)}; this process runs as uid {_uid()}. Give this user "
               f"{_LOCAL_NEED.get(action, 'access')} on it (chmod/chown, and x on the folders above it), "
               "or run as a user who may")
    else:
        fix = f"check that these credentials may {_STORE_NEED.get(action, 'access it')} under {loc.url!r}"
    what = "" if path.rstrip("/") == loc.root.rstrip("/") else f" of {loc.url!r}"
    verdict = "The file is not corrupt: this user may not read it. " if action == "read" else ""
    return DatasetPermissionError(f"permission denied: cannot {action} {path!r}{what} ({e}). {verdict}"
                                  f"{fix[0].upper()}{fix[1:]}")


def _owner_mode(path: str) -> str:
    """``path``'s owner and mode, or those of its nearest folder this user can look at."""
    probe = path
    while True:
        try:
            st = os.stat(probe)
        except OSError:
            parent = os.path.dirname(probe.rstrip("/"))
            if not parent or parent == probe:
                return "its owner and mode cannot be seen"
            probe = parent
            continue
        where = "it is" if probe == path else f"its folder {probe!r} is"
        return f"{where} owned by uid {st.st_uid}, gid {st.st_gid}, mode {stat.filemode(st.st_mode)}"


def _uid() -> str:
    geteuid = getattr(os, "geteuid", None)  # POSIX only
    return str(geteuid()) if geteuid is not None else "?"


def filesystem_error(url: str, e: BaseException) -> ShardkitError | None:
    """The shardkit error for ``e``, raised by fsspec while making the filesystem of ``url``; None
    for an error that is not about the URL's filesystem (a bad storage option: raised as it is)."""
    import fsspec

    protocol = fsspec.core.split_protocol(url)[0] or "file"
    if isinstance(e, ImportError):
        cause = e.__cause__ if isinstance(e.__cause__, ImportError) else e
        package = (cause.name or "").split(".", 1)[0] or _package_of(protocol)
        if package in _EXTRAS:
            return MissingDependencyError(package, _EXTRAS[package], f"{url!r} ({protocol}://)")
        return MissingFilesystemError(package, url, f"Install it with: pip install {package}")
    if isinstance(e, ValueError):
        if "protocol not known" not in str(e).lower():
            return None
        return UnsupportedURLError(
            f"{url!r}: no filesystem serves the protocol {protocol!r}. Check the URL for a typo; shardkit "
            "reads local paths and fsspec URLs such as s3://, gs://, abfs://, hdfs://, https:// and memory://"
        )
    if protocol in ("hdfs", "viewfs") and any(lib in str(e) for lib in ("libjvm", "libhdfs")):
        return MissingFilesystemError(
            "HDFS's native client (libhdfs and a Java runtime)", url,
            "Install Hadoop and Java and set JAVA_HOME, HADOOP_HOME and ARROW_LIBHDFS_DIR so that pyarrow "
            "finds them (see pyarrow's HDFS documentation), or read the data over webhdfs://",
        )
    if isinstance(e, OSError) and not isinstance(e, FileNotFoundError | PermissionError):
        # a connection that failed (sftp, hdfs with its client): a missing file or a refused permission
        # keeps its own type, which callers catch
        return DatasetError(f"cannot open the filesystem of {url!r} ({type(e).__name__}: {e}); check the "
                            "host and port in the URL and that the service is running")
    return None


def storage_option_error(url: str, options: Mapping[Any, Any]) -> StorageOptionsError | None:
    """The error for the keys of ``options`` that the filesystem of ``url`` does not take, else None.

    Read from signatures, so it holds for any fsspec filesystem without a list of keys: those its
    constructor names, fsspec's own (instance and listings caches) and, where the constructor passes
    the rest on (`_PASSED_ON`), those that what it passes them to names. A filesystem that keeps the
    rest, or hands them to fsspec's base class (which ignores them: local, memory, dir://), takes any
    key, so that one set of options serves a local source and an S3 destination alike. Chained URLs
    (``simplecache::s3://``) are not checked.

    Example:
        >>> storage_option_error("s3://bucket/ds", {"bogus": 1})  # names 'bogus', the URL and the fix
    """
    import fsspec

    if not isinstance(options, Mapping):
        return StorageOptionsError(
            f"storage_options for {url!r} is a {type(options).__name__}, not a dict (not shown: options "
            "may hold credentials); give a dict of the filesystem's options, e.g. "
            "storage_options={'anon': True} or {'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9000'}}")
    if "::" in url or not options:
        return None
    protocol = options.get("protocol") or fsspec.core.split_protocol(url)[0] or "file"
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return None  # Location.of says why, with filesystem_error
    taken = _options_taken(cls)
    if taken is None:
        return None
    # a key named for the protocol holds options for it (fsspec merges them); fsspec.open's arguments
    # are dropped by url_to_fs
    mine = {cls.protocol} if isinstance(cls.protocol, str) else set(cls.protocol)
    keys = [k for k, v in options.items() if k not in mine] + [
        k for p, v in options.items() if p in mine and isinstance(v, Mapping) for k in v]
    unknown = [k for k in keys if k not in taken and k not in _open_arguments()]
    if not unknown:
        return None
    close = sorted({m for k in unknown if isinstance(k, str) for m in difflib.get_close_matches(k, taken, 1)})
    meant = f"Did you mean {' or '.join(map(repr, close))}? " if close else ""
    dicts = sorted(k for k in taken if k.endswith("_kwargs"))
    inside = ""
    if dicts:
        inside = f". An option of the client it makes goes inside {' or '.join(map(repr, dicts))}"
    if "config_kwargs" in dicts:  # s3fs
        inside = (". botocore's options go inside 'client_kwargs' (client arguments: region_name, verify, "
                  "...) or 'config_kwargs' (botocore.config.Config: connect_timeout, retries, ...), S3 "
                  "request arguments inside 's3_additional_kwargs'")
    plural = len(unknown) > 1
    return StorageOptionsError(
        f"the storage option{'s' if plural else ''} {', '.join(map(repr, unknown))} for {url!r} "
        f"{'are' if plural else 'is'} not taken by {cls.__module__.split('.', 1)[0]}'s {cls.__name__}, "
        f"which would fail on {'them' if plural else 'it'} at its first request. {meant}Remove "
        f"{'them' if plural else 'it'}, or use the options it takes: {', '.join(sorted(taken))}{inside}"
    )


@functools.cache
def _options_taken(cls: type) -> frozenset[str] | None:
    """The storage options ``cls`` takes (see `storage_option_error`), or None where it takes any."""
    from fsspec.dircache import DirCache

    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return frozenset(_named(params))
    target = next((_PASSED_ON[n] for n in (f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__)
                   if n in _PASSED_ON), None)
    if target is None:
        return None
    (module, _, path), filled = target[0].partition(":"), target[1]
    try:
        sink: Any = importlib.import_module(module)
        for name in path.split("."):
            sink = getattr(sink, name)
        sink_params = inspect.signature(sink).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None  # another version of the library: take any key rather than refuse a good one
    if any(p.kind is p.VAR_KEYWORD for p in sink_params.values()):
        return None
    fsspec_own = {"skip_instance_cache"} | _named(inspect.signature(DirCache.__init__).parameters)
    return frozenset(_named(params) | fsspec_own | (_named(sink_params) - set(filled)))


def _named(params: Mapping[str, inspect.Parameter]) -> set[str]:
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}


@functools.cache
def _open_arguments() -> frozenset[str]:
    import fsspec

    return frozenset(_named(inspect.signature(fsspec.open).parameters) - {"urlpath"})


def root_exists(loc: Location, *, action: str = "open") -> bool:
    """Whether ``loc``'s root exists; a store that cannot be reached raises `DatasetError` (credentials
    and connections, as `storage_errors` says them, and those the filesystem's ``exists`` hides: see
    `_unreachable`), so False means missing indeed. A store that refuses to say raises
    `DatasetPermissionError` (`permission_error`): s3fs's ``exists`` raised a bare ``PermissionError:
    Forbidden`` for a key or secret the store does not know, and for credentials that may not look at
    the root (``HEAD`` of the key, then a listing). Its message names what the caller is about to do,
    ``action``: ``"open"`` (a read: list and read) or ``"write to"`` (`write_dataset`: write and delete
    too, so that fixing the credentials for the first refusal does not meet a second one mid-write).

    Example:
        >>> if not root_exists(loc):
        ...     raise DatasetNotFoundError(f"no dataset at {loc.url!r}: ...")
    """
    try:
        with storage_errors(loc.url):  # the first request: where missing credentials show
            if loc.fs.exists(loc.root):
                return True
    except OSError as e:
        if isinstance(e, ShardkitError) or not is_denied(e):
            raise
        raise permission_error(loc, loc.root, e, action=action) from e
    failed = _unreachable(loc)
    if failed is not None:
        raise failed
    return False


def _unreachable(loc: Location) -> DatasetError | None:
    """Why ``loc``'s root looked missing, when the filesystem's ``exists`` hid a failed connection; None
    when it is missing indeed (or the filesystem tells no more).

    fsspec's HTTP ``exists`` answers False for a refused connection, an unknown host or a timeout, and
    its ``info`` raises ``FileNotFoundError`` from the ``aiohttp`` error: "no dataset at ...: the path
    does not exist" sent users looking for a typo in the path when the server was down. Asked only on
    the way to that error (one more request).
    """
    try:
        loc.fs.info(loc.root)
    except FileNotFoundError as e:
        cause = e.__cause__
    except Exception:  # whatever else it raises, the caller's error stands
        return None
    else:
        return None
    if not isinstance(cause, OSError) or isinstance(cause, FileNotFoundError | PermissionError):
        return None  # aiohttp's connection and timeout errors are OSErrors; a 404 is not
    return DatasetError(f"cannot reach {loc.url!r} ({type(cause).__name__}: {cause}); check the host and "
                        "port in the URL, that the server is running, and the network and proxy")


#: Connection failures of aiohttp (fsspec's HTTP, gcsfs, adlfs), by class name: a refused or cut
#: connection, a body cut short, a timeout (fsspec's FSTimeoutError).
_CONNECTION_ERRORS = frozenset({"ClientConnectionError", "ClientPayloadError", "FSTimeoutError"})


def request_error(url: str, path: str, e: BaseException) -> DatasetError | None:
    """The shardkit error for ``e``, raised by a request for the bytes of ``path`` (a file of the dataset
    at ``url``) that was never answered, else None (``e`` goes through as it is).

    A read that fails this way is no corruption: the Parquet layer took the ``OSError`` of a cut
    connection for a truncated file (and ``on_error="skip"`` skipped the row group: rows lost for a
    network blip), fsspec's HTTP answers a server that is down with ``FileNotFoundError`` (read as a
    file deleted since the dataset was opened), botocore's errors are no ``OSError`` at all. The
    error is a `DatasetError`, neither corrupt nor missing: the read stops, nothing is skipped, and
    the reader's state resumes where it stopped. Also: an HTTP server that ignores range requests
    (``python -m http.server``), which fsspec reports as a ``ValueError`` naming its own options.
    """
    cause = e.__cause__ if isinstance(e, FileNotFoundError) else e  # fsspec's HTTP wraps the failure
    classes = [c.__name__ for c in type(cause).__mro__] if cause is not None else []
    fix = next((_CLOUD_ERRORS[n] for n in classes if n in _CLOUD_ERRORS), None)
    if fix is None and (_CONNECTION_ERRORS.intersection(classes) or isinstance(cause, TimeoutError)):
        fix = ("the server could not be reached or stopped answering: check that it is running, and the "
               "network and proxy")
    if fix is not None:
        return DatasetError(f"cannot read {path!r} of {url!r}: {fix} ({type(cause).__name__}: "
                            f"{one_line(cause)}). Nothing was skipped: read again once this is fixed (a "
                            "reader's state_dict() resumes where it stopped)")
    if isinstance(e, ValueError) and "support range requests" in str(e):
        return no_ranges_error(url, path)
    return None


def no_ranges_error(url: str, path: str) -> DatasetError:
    """The error for a server that answers a range request with other bytes than those asked for."""
    return DatasetError(f"cannot read {path!r} of {url!r}: the HTTP server does not answer range "
                        "requests (HTTP Range headers), and shardkit reads each row group by its "
                        "range. Serve the folder with a server that does (nginx, Apache, a cloud "
                        "bucket; `python -m http.server` does not), or copy the dataset locally")


def _package_of(protocol: str) -> str:
    from fsspec.registry import known_implementations

    spec = known_implementations.get(protocol, {})
    return str(spec.get("class", protocol)).split(".", 1)[0]


@contextlib.contextmanager
def storage_errors(url: str, *, error: Callable[[str], ShardkitError] = DatasetError) -> Iterator[None]:
    """Raise a cloud SDK's credential or connection error (`_CLOUD_ERRORS`) as ``error`` (`DatasetError`;
    the checkpoint store passes `CheckpointError`), naming ``url`` and the fix; anything else goes
    through as it is.

    Wraps the first requests to a store: credentials are looked up and the endpoint is first reached
    there (botocore then keeps them), and there these errors surface.
    """
    try:
        yield
    except Exception as e:
        fix = next((_CLOUD_ERRORS[c.__name__] for c in type(e).__mro__ if c.__name__ in _CLOUD_ERRORS), None)
        if fix is None or isinstance(e, ShardkitError):
            raise
        raise error(f"cannot reach {url!r}: {fix} ({type(e).__name__}: {e})") from e
