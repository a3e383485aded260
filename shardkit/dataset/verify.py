"""`verify_dataset`: a scrub. Read every page of every file of a dataset, check each page checksum, and
decode every row group; report what is damaged, file by file, and which pages carry no checksum.

What ``shardkit verify URL`` runs. Files are checked in parallel threads (the work is reading and
CRC-32, which release the GIL), each from its own footer (not the summary: a file whose footer no longer
parses is damaged too).

Example:
    >>> report = verify_dataset("s3://bucket/train")
    >>> report.ok, report.damaged, report.unchecked_pages
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from shardkit._storage.location import Location
from shardkit.dataset._pages import PageError, check_row_group, first_page, ranges_of
from shardkit.errors import one_line

if TYPE_CHECKING:
    from shardkit.dataset._dataset import Dataset

__all__ = ["Damage", "FileReport", "VerifyReport", "checksum_presence", "verify_dataset", "verify_file"]


@dataclasses.dataclass(frozen=True)
class Damage:
    """One damaged place: the file, the row group (None: the file as a whole, e.g. its footer), the
    column (None: not one column) and what is wrong."""

    file: str
    row_group: int | None
    column: str | None
    problem: str

    def __str__(self) -> str:
        where = self.file
        if self.row_group is not None:
            where = f"row group {self.row_group} of {where}"
        if self.column is not None:
            where = f"column {self.column!r} of {where}"
        return f"{where}: {self.problem}"


@dataclasses.dataclass
class FileReport:
    """What `verify_file` found in one file."""

    file: str
    row_groups: int = 0
    rows: int = 0
    pages: int = 0
    unchecked_pages: int = 0  # pages without a checksum: decoded, but their bytes cannot be checked
    bytes: int = 0
    damage: list[Damage] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class VerifyReport:
    """A whole dataset's scrub: every file's report, and the totals."""

    url: str
    files: list[FileReport]

    @property
    def damaged(self) -> list[Damage]:
        return [d for f in self.files for d in f.damage]

    @property
    def ok(self) -> bool:
        return not self.damaged

    @property
    def pages(self) -> int:
        return sum(f.pages for f in self.files)

    @property
    def unchecked_pages(self) -> int:
        return sum(f.unchecked_pages for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url, "ok": self.ok, "files": len(self.files),
            "row_groups": sum(f.row_groups for f in self.files), "pages": self.pages,
            "unchecked_pages": self.unchecked_pages,
            "files_without_checksums": [f.file for f in self.files if f.unchecked_pages],
            "damaged": [dataclasses.asdict(d) for d in self.damaged],
        }


def verify_file(loc: Location, file: str) -> FileReport:
    """Check every page checksum of ``file`` (relative to ``loc``) and decode each of its row groups.

    A row group whose pages fail their checksums is not decoded (its damage is named by column); one
    whose pages pass (or carry none) is decoded with pyarrow, which finds what checksums cannot
    (a page without one, a damaged page header)."""
    report = FileReport(file)
    try:
        f = loc.open_ranges(loc.join(file))
    except FileNotFoundError:
        report.damage.append(Damage(file, None, None, "the file is missing"))
        return report
    with f:
        _check_file(f, report)
    return report


def _check_file(f: pa.NativeFile, report: FileReport) -> None:
    file = report.file
    try:
        report.bytes = f.size()
        meta = pq.read_metadata(f)
    except (OSError, pa.ArrowException) as e:
        report.damage.append(Damage(file, None, None, f"its footer cannot be read ({one_line(e)}): the file "
                                                      "is truncated or corrupt"))
        return
    report.row_groups, report.rows = meta.num_row_groups, meta.num_rows
    for i in range(meta.num_row_groups):
        bad = False
        for column, chunk in check_row_group(ranges_of(f), meta.row_group(i), size=report.bytes):
            report.pages += chunk.pages
            report.unchecked_pages += chunk.unchecked
            for problem in chunk.problems:
                report.damage.append(Damage(file, i, column, problem))
                bad = True
        if bad:
            continue
        try:
            pq.ParquetFile(f, metadata=meta, page_checksum_verification=True).read_row_group(i)
        except (OSError, pa.ArrowException) as e:
            report.damage.append(Damage(file, i, None, f"does not decode ({one_line(e)})"))


#: files whose first pages `checksum_presence` looks at (spread over the dataset)
PRESENCE_SAMPLE = 16


def checksum_presence(ds: Dataset, sample: int = PRESENCE_SAMPLE) -> dict[str, int]:
    """Whether the files of ``ds`` carry page checksums, from the first page header of each column of
    their first row group, for up to ``sample`` files spread over the dataset (one small read per
    column; `verify_dataset` checks every page): ``{"files_checked", "with_checksums", "unreadable"}``.
    """
    files = ds.files
    step = max(1, len(files) // max(1, sample))
    chosen = files[::step][:sample]

    def has(name: str) -> bool | None:
        try:
            with ds.location.open_ranges(ds.location.join(name)) as f:
                meta = pq.read_metadata(f)
                if not meta.num_row_groups or not meta.row_group(0).num_columns:
                    return None
                group = meta.row_group(0)
                return all(first_page(f.read_at, group.column(j)).crc is not None
                           for j in range(group.num_columns))
        except (OSError, pa.ArrowException, PageError):
            return None

    with ThreadPoolExecutor(max_workers=8) as pool:
        found = list(pool.map(has, chosen))
    return {"files_checked": len(chosen), "with_checksums": sum(1 for x in found if x),
            "unreadable": sum(1 for x in found if x is None)}


def verify_dataset(url: str | os.PathLike[str] | Any, *, storage_options: dict[str, Any] | None = None,
                   version: int | None = None, workers: int = 8,
                   progress: Callable[[FileReport], None] | None = None) -> VerifyReport:
    """Scrub the dataset at ``url`` (any URL `shardkit.open_dataset` opens; a table at ``version``):
    every data file it lists, ``workers`` at a time; ``progress`` is called with each file's report as it
    is done.

    Raises:
        DatasetError: the dataset cannot be opened (its summary or a table's log is unreadable).
    """
    from shardkit.dataset.open import open_dataset

    ds = open_dataset(url, storage_options=storage_options, version=version)
    loc = ds.location
    reports: list[FileReport] = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for report in pool.map(lambda name: verify_file(loc, name), ds.files):
            reports.append(report)
            if progress is not None:
                progress(report)
    return VerifyReport(ds.url, reports)
