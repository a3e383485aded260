"""``shardkit inspect URL --row N``: one decoded sample, for people and as JSON; bad rows and a mixture
refused with the reason."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from shardkit.cli import main
from tests.reader.datasets import write_all_codecs


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    return write_all_codecs(tmp_path_factory.mktemp("row") / "all", 30, row_group_size=7)


def test_row_for_people(written: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    url, columns = written
    assert main(["inspect", url, "--row", "7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{url}  row 7 of 30"
    shown = {line.split()[0]: " ".join(line.split()[1:]) for line in lines[1:]}
    assert list(shown) == list(columns)
    assert shown["id"] == "7"
    assert shown["name"] == "'row-7'"
    assert shown["maybe"] == "null"  # row 7 of `maybe` is a null
    assert shown["blob"] == "3 bytes: 07 07 07"
    assert shown["var"] == "float32 3: [ 0., 7., 14.]"
    img = columns["img"][7]
    assert shown["img"] == f"uint8 8x8x3, min {img.min()}, max {img.max()}, mean {img.mean():.4g}"


def test_row_as_json_from_the_end(written: tuple[str, dict[str, Any]],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    url, columns = written
    assert main(["inspect", url, "--row", "-1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["url"], out["row"], out["num_rows"]) == (url, 29, 30)
    fields = out["fields"]
    assert fields["id"] == 29
    assert fields["note"] == "n29"
    assert base64.b64decode(fields["blob"]["base64"]) == columns["blob"][29]
    np.testing.assert_array_equal(np.array(fields["img"], np.uint8), columns["img"][29])
    assert fields["var2"] == columns["var2"][29].tolist()


def test_the_description_is_unchanged_without_row(written: tuple[str, dict[str, Any]],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", written[0], "--json"]) == 0
    assert "row_groups" in json.loads(capsys.readouterr().out)


def test_a_row_out_of_range(written: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", written[0], "--row", "30"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardkit inspect: error: row index 30 is out of range")
    assert "0 to 29" in err


def test_row_of_a_mixture_is_refused(written: tuple[str, dict[str, Any]],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["inspect", written[0], written[0], "--row", "0"])
    assert exited.value.code == 2
    assert "--row prints a row of one dataset" in capsys.readouterr().err
