"""The digits job read by index (`examples/digits_map.yaml`): `shardkit.torch.MapDataset` through 2
DataLoader workers per rank, in a class-balanced `WeightedRandomSampler`'s order, trains the model to the
accuracy the stream (`examples/digits.yaml`) reaches, on as many samples."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def _train(config: str, data: Path, logdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "train", str(REPO / "examples" / config),
         "--set", f"data.url={data}", "--set", f"logdir={logdir}"],
        capture_output=True, text=True, timeout=200, start_new_session=True, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = json.loads(re.search(r"TRAIN_STATS (\{.*\})", proc.stdout).group(1))  # type: ignore[union-attr]
    return stats, json.loads((logdir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_weighted_sampler_over_map_style_workers_trains_digits_like_the_stream(tmp_path: Path) -> None:
    data = tmp_path / "digits"
    subprocess.run([sys.executable, str(REPO / "examples" / "make_digits.py"), str(data)], check=True,
                   capture_output=True, timeout=60)
    stream, stream_summary = _train("digits.yaml", data, tmp_path / "stream")
    mapped, summary = _train("digits_map.yaml", data, tmp_path / "map")
    assert summary["samples"] == stream_summary["samples"] == 20 * 1500  # the same number of samples
    assert mapped["test_accuracy"] >= 0.95
    assert abs(mapped["test_accuracy"] - stream["test_accuracy"]) <= 0.02
    # The sampler drew every class about as often: rank 0's 15,000 draws, 1,500 a class expected.
    counts = mapped["label_counts"]
    assert sum(counts) == 15_000
    assert min(counts) >= 1_350
    assert max(counts) <= 1_650
    assert 0.0 < summary["metrics"]["data_wait"] < 1.0  # ctx.timed(loader): the DataLoader's share
