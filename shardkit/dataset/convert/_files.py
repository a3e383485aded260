"""Which files `shardkit.dataset.convert` reads from a folder or a glob pattern: those of its data format
(`FORMATS`, by name; Parquet also by its magic bytes); any other file is left out and named in a
`FilesLeftOutWarning`, files that hold no rows are left out quietly (`listed`, `holding_rows`), and
files whose columns share none with the others' are refused (`related`).
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import warnings
from typing import Any

from shardkit._storage.location import Location
from shardkit.dataset._footers import PARQUET_SUFFIXES
from shardkit.errors import DatasetNotFoundError, FilesLeftOutWarning, NotADatasetError, SchemaMismatchError

__all__ = ["COMPRESSED", "FORMATS", "Files", "holding_rows", "is_pattern", "listed", "related", "suffix"]

#: File name endings -> the pyarrow.dataset format that reads them (CSV and JSON may be compressed too).
FORMATS = {**dict.fromkeys(PARQUET_SUFFIXES, "parquet"), ".csv": "csv", ".json": "json", ".jsonl": "json",
           ".ndjson": "json"}
COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
_MAGIC = re.compile(r"[*?[]")  # what makes a path a glob pattern (fsspec's `has_magic`)
_NAMED = 10  # the files left out that a warning names (then how many more)
#: The most bytes of a file `_no_rows` reads: one that holds only whitespace, or a CSV's header, is smaller.
_NO_ROWS_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class Files:
    """Data files of one format: ``paths`` in order, and what they came from."""

    paths: list[str]
    fmt: str
    base: str | None  # the folder (a pattern's: before its first wildcard); None: the one file named
    roots: list[str]  # what the source names: the file, the folder, or what the pattern matched
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # of the paths a listing gave sizes


def suffix(path: str) -> str:
    """The ending of ``path`` that says its format (``.csv`` for ``a.CSV.gz``), else ``""``."""
    name = posixpath.basename(path).lower()
    for ending in COMPRESSED:
        name = name.removesuffix(ending)
    return posixpath.splitext(name)[1]


def is_pattern(path: str) -> bool:
    return _MAGIC.search(path) is not None


def listed(loc: Location, *, pattern: bool = False) -> Files | None:
    """The data files of the folder at ``loc``, or of what the glob ``pattern`` at ``loc`` matches (a folder
    it matches: all its files); None for a folder without any.

    A folder's data format is that of most bytes among its files of the `FORMATS` (then of most files):
    a README.txt, or a notes.json beside Parquet files, is not its data. Every other file is left out,
    named in one `FilesLeftOutWarning`, so no data is left out unsaid; silently only what holds none:
    names that start with ``_`` or ``.`` (Spark's ``_SUCCESS``, ``.crc`` files, ``_temporary/``) and
    empty files (a CSV or JSON part of a task that wrote no rows; those of only whitespace, or a CSV's
    header without a newline, are left out where pyarrow refuses them: `holding_rows`). A file whose
    name says no format is Parquet when it starts with Parquet's magic bytes (Hive names files
    ``000000_0``).

    Raises:
        DatasetNotFoundError: the pattern matches no file.
        NotADatasetError: the pattern matches no data file.
    """
    found: dict[str, dict[str, Any]] = {}  # fsspec's listing: path -> its "size", "type", ...
    if pattern:
        parts = loc.root.split("/")
        base = "/".join(parts[:next(i for i, part in enumerate(parts) if is_pattern(part))]) or "/"
        try:
            matched = loc.fs.glob(loc.root, detail=True)
        except FileNotFoundError:  # (a folder before the wildcard that does not exist, on some stores)
            matched = {}
        roots = sorted(matched)
        for path, info in matched.items():
            found.update(loc.fs.find(path, detail=True) if info.get("type") == "directory" else {path: info})
        if not found:
            raise DatasetNotFoundError(f"cannot convert {loc.url!r}: the path does not exist, and no file "
                                       "matches it as a glob pattern; check the path or URL (in a shell, "
                                       "quote a pattern: shardkit matches it, not the shell)")
    else:
        base, roots, found = loc.root, [loc.root], loc.fs.find(loc.root, detail=True)
    prefix = base.rstrip("/") + "/"
    files: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    other: list[str] = []
    for path in sorted(found):
        name = path.removeprefix(prefix)
        size = found[path].get("size")
        if any(part.startswith(("_", ".")) for part in name.split("/")) or (
                size == 0 and not name.lower().endswith(PARQUET_SUFFIXES)):  # (empty Parquet: broken)
            continue
        fmt = FORMATS.get(suffix(path)) or ("parquet" if _is_parquet(loc, path) else None)
        if fmt is None:
            other.append(name)
            continue
        files.setdefault(fmt, []).append(path)
        sizes[fmt] = sizes.get(fmt, 0) + (size if isinstance(size, int) else 0)
    if not files:
        if pattern:
            raise NotADatasetError(f"cannot convert {loc.url!r}: the pattern matches no file of "
                                   f"{sorted(set(FORMATS))} (CSV and JSON also {list(COMPRESSED)}): "
                                   f"{_names(other) or 'only hidden or empty files'}; match data files")
        return None
    fmt = max(files, key=lambda f: (sizes[f], len(files[f]), f))
    left = sorted(other + [p.removeprefix(prefix) for f, paths in files.items() if f != fmt for p in paths])
    if left:
        warnings.warn(FilesLeftOutWarning(
            f"{loc.url!r}: left out {len(left)} file(s) that are not {fmt}, the format of its data "
            f"({len(files[fmt])} file(s), most of its bytes): {_names(left)}; if one holds data, convert it "
            "apart (shardkit write FILE DEST --mode append), else move it out to silence this"), stacklevel=4)
    return Files(files[fmt], fmt, base, roots,
                 {p: n for p in files[fmt] if isinstance(n := found[p].get("size"), int)})


def related(url: str, columns: dict[str, list[str]]) -> None:
    """Refuse files (name -> its columns, in name order) that fall into groups sharing no column: a
    ``schema.json`` or ``metadata.json`` (``{"rows": 40}``) among JSON data files, which is read as
    data like them.

    Files that differ in columns are one dataset (its columns evolved: each is null where a file lacks
    it) as long as each shares a column with another, directly or through others. A file that shares
    none would only add rows that are null in every column of the others, and the others null in its
    own: junk that Spark's and pyarrow's union of the files' columns writes without a word. Which group
    is the data cannot be told by the files alone (a metadata file can outweigh a small data file), so
    nothing is guessed: the error names each group, and the fix (move a file that holds no data out,
    or start its name with ``_``, which is left out as Spark and pyarrow leave it; else convert each
    group apart).

    Raises:
        SchemaMismatchError: the files fall into more than one group.
    """
    groups: list[tuple[list[str], set[str]]] = []  # files, and the columns they hold
    for name, names in columns.items():
        joined = [g for g in groups if g[1] & set(names)]
        merged = ([f for g in joined for f in g[0]] + [name], set(names).union(*(g[1] for g in joined)))
        groups = [g for g in groups if g not in joined] + [merged]
    if len(groups) > 1:
        groups.sort(key=lambda g: min(g[0]))
        said = "; ".join(f"{_names(sorted(files))} with the column(s) {_names(sorted(cols)) or 'none'}"
                         for files, cols in groups)
        raise SchemaMismatchError(
            f"cannot convert {url!r}: its files fall into {len(groups)} groups that share no column: {said}; "
            "written together, each group's rows would be null in the others' columns. Move a file that "
            "holds no data (a schema, metadata) out of the folder, or start its name with '_' (left out, "
            "as by Spark and pyarrow); else convert each group apart (shardkit write FILE DEST --mode "
            "append)")


def holding_rows(loc: Location, files: Files, e: Exception) -> tuple[list[str], bytes | None]:
    """The ``files`` that hold rows, where pyarrow refused one as empty (its error ``e``, raised again if
    none is): files of only whitespace, and a CSV's header without a newline (`_no_rows`), are left out of
    a folder as 0-byte ones are (they hold no rows); the one file a source names is refused if it holds
    only whitespace, and read as a header if it is one: then the paths are none, and the header is given
    with a newline (what ``a,b\\n`` is read as).

    Raises:
        NotADatasetError: no file holds rows.
    """
    held = {p: _no_rows(loc, p, files.fmt, files.sizes.get(p)) for p in files.paths}
    if not any(held.values()):
        raise e
    if files.base is None:
        kind, header = held[files.paths[0]] or ("", b"")
        if kind == "blank":
            raise NotADatasetError(f"cannot convert {loc.url!r}: the file holds no data (it is empty, or "
                                   "only whitespace); point at a file of rows") from e
        return [], header
    if rest := [p for p in files.paths if held[p] is None]:
        return rest, None
    prefix = files.base.rstrip("/") + "/"
    raise NotADatasetError(f"cannot convert {loc.url!r}: its files hold no rows (only whitespace, or a CSV's "
                           f"header): {_names([p.removeprefix(prefix) for p in files.paths])}; point at data"
                           ) from e


def _no_rows(loc: Location, path: str, fmt: str, size: int | None = None) -> tuple[str, bytes] | None:
    """What the CSV or JSON file at ``path`` holds, where pyarrow refuses it as empty though it is not 0
    bytes: ``("blank", b"")`` for nothing but whitespace (a newline; compressed or not), ``("header",
    line)`` for a CSV's header without a newline (``line`` ends with one added); None for anything else,
    or a file of more than `_NO_ROWS_BYTES` (``size``, where known, spares reading it).

    pyarrow reads neither: a JSON file of a newline fails with "Empty JSON stream", a CSV of ``a,b``
    (where ``a,b\\n`` is a header) with "Empty CSV file". Neither holds a row: in a folder they are left
    out as 0-byte files are.
    """
    if size is not None and size > _NO_ROWS_BYTES:
        return None
    with loc.arrow_fs.open_input_stream(path, compression="detect") as stream:
        head = stream.read(_NO_ROWS_BYTES + 1)
    if len(head) > _NO_ROWS_BYTES:
        return None
    if not head.strip():
        return "blank", b""
    if fmt == "csv" and b"\n" not in head and b"\r" not in head:
        return "header", head + b"\n"
    return None


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return ", ".join(repr(n) for n in names[:_NAMED]) + more


def _is_parquet(loc: Location, path: str) -> bool:
    try:
        with loc.fs.open(path, "rb") as f:
            return bool(f.read(4) == b"PAR1")
    except OSError:  # unreadable: left out, and named in the warning
        return False
