"""Mixtures in jobs and commands: ``data.sources`` in the job config (and its bad forms), ``ctx.reader()``
and ``ctx.checkpoint`` over a mixture, ``shardkit inspect`` and ``shardkit bench`` of several URLs."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import yaml

import shardkit
from shardkit.cli import main
from shardkit.errors import CheckpointWarning, ConfigError
from shardkit.job.config import load_config
from shardkit.reader import SOURCE, MixedReader
from shardkit.trainer import init

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("mix")
    out = {}
    for i, (name, n) in enumerate((("web", 60), ("books", 20))):
        ids = np.arange(n, dtype=np.int64) + 1000 * i
        out[name] = shardkit.write_dataset({"id": ids, "x": np.ones((n, 2), np.float32)}, folder / name,
                                           row_group_size=7).url
    return out


def job(folder: Path, data: dict[str, Any], **extra: Any) -> Path:
    config = {"name": "mix", "entrypoint": str(REPO / "tests" / "trainer" / "scripts" / "behave.py"),
              "framework": "tensorflow", "roles": {"worker": {"count": 1}}, "logdir": str(folder / "job"),
              "data": data, **extra}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))  # the sources in their order
    return path


def mixture(sources: dict[str, str], **weights: float) -> dict[str, Any]:
    return {name: {"url": url, **({"weight": weights[name]} if name in weights else {})}
            for name, url in sources.items()}


# ---- the config ---------------------------------------------------------------------------------------

def test_data_sources_make_the_readers_mixture(tmp_path: Path, sources: dict[str, str]) -> None:
    data = {"sources": {**mixture(sources, web=3, books=1),
                        "books": {"url": sources["books"], "weight": 1, "filter": [["id", "<", 1010]]}},
            "samples_per_epoch": 40, "batch_size": 8, "seed": 4}
    config = load_config(job(tmp_path, data))
    assert config.data is not None
    kwargs = config.data.reader_kwargs()
    assert kwargs["url"] == sources
    assert kwargs["weights"] == {"web": 3, "books": 1}
    assert kwargs["filter"] == {"books": [["id", "<", 1010]]}
    with init(config=config) as ctx:
        reader = ctx.reader()
        assert isinstance(reader, MixedReader)
        assert (reader.samples_per_epoch, reader.batch_size, reader.seed) == (40, 8, 4)
        batches = list(reader)
    books = np.concatenate([b["id"][b[SOURCE] == 1] for b in batches])
    assert len(books) == 10
    assert books.max() < 1010


def test_sources_resolve_relative_to_the_config_and_weigh_by_rows_without_weights(tmp_path: Path) -> None:
    for name, n in (("a", 30), ("b", 10)):
        shardkit.write_dataset({"id": np.arange(n)}, tmp_path / name)
    config = load_config(job(tmp_path, {"sources": {"a": {"url": "a"}, "b": {"url": "b"}}}))
    assert config.data is not None
    assert config.data.sources is not None
    assert config.data.sources["a"].url == str(tmp_path / "a")
    with init(config=config) as ctx:
        reader = ctx.reader()
        assert isinstance(reader, MixedReader)
        assert reader.num_samples == 40
        assert [float(s) for s in reader.shares.values()] == [0.75, 0.25]
        other = ctx.reader(url=str(tmp_path / "a"))  # another dataset in the mixture's place: one reader
        assert not isinstance(other, MixedReader)


@pytest.mark.parametrize(("data", "key", "words"), [
    ({"url": "s3://b/a", "sources": {"a": {"url": "s3://b/a"}}}, "data.url", ["both url and sources"]),
    ({"batch_size": 8}, "data.url", ["missing", "add url:", "sources:"]),
    ({"url": "s3://b/a", "samples_per_epoch": 10}, "data.samples_per_epoch", ["for a mixture"]),
    ({"sources": {}}, "data.sources", ["no source"]),
    ({"sources": {"a": {"url": "s3://b/a", "weight": 1}, "b": {"url": "s3://b/b"}}}, "data.sources.b.weight",
     ["['a'] have a weight and ['b'] do not", "give every source a weight"]),
    ({"sources": {"a": {"url": "s3://b/a", "weight": 0}}}, "data.sources", ["every source's weight is 0"]),
    ({"sources": {"a": {"url": "s3://b/a", "weight": -1}}}, "data.sources.a.weight",
     ["greater than or equal"]),
    ({"sources": {"a": {"url": "s3://b/a", "weight": "x"}}}, "data.sources.a.weight", []),
    ({"sources": {"a": {"url": "s3://b/a"}}, "samples_per_epoch": 0}, "data.samples_per_epoch", []),
    ({"sources": {"a": {"url": "s3://b/a", "filter": [["x", "<", 1]]}},
      "options": {"filter": [["x", "<", 2]]}}, "data.sources.a.filter", ["data.options.filter is set too"]),
    ({"sources": {"a": {"url": "s3://b/a"}}, "options": {"weights": {"a": 1}}}, "data.options.weights",
     ["data.sources.<name>.weight"]),
    ({"sources": {"a": {"url": "s3://b/a", "storage_options": {"secret": "x"}}}},
     "data.sources.a.storage_options.secret", ["plain text"]),
    ({"sources": {"a": {"url": "s3://b/a", "wieght": 1}}}, "data.sources.a.wieght", []),
])
def test_bad_sources_fail_with_the_key_and_the_fix(tmp_path: Path, data: dict[str, Any], key: str,
                                                   words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(job(tmp_path, data))
    lines = [line for line in str(e.value).splitlines() if line.strip().startswith(f"- {key}")]
    assert lines, str(e.value)
    assert "Fix: " in lines[0], lines[0]
    for word in words:
        assert word in str(e.value), str(e.value)


# ---- checkpoints --------------------------------------------------------------------------------------

def test_ctx_checkpoints_carry_the_mixture_and_resume_on_another_number_of_shards(
        tmp_path: Path, sources: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    data = {"sources": mixture(sources, web=1, books=1), "samples_per_epoch": 48, "batch_size": 4,
            "seed": 2, "num_epochs": 2}
    path = job(tmp_path, data, checkpoint={"dir": str(tmp_path / "ckpt")})
    seen: list[tuple[int, int]] = []

    def take(reader: shardkit.Reader, steps: int | None, ctx: Any) -> None:
        for i, batch in enumerate(reader):
            seen.extend(zip(batch[SOURCE].tolist(), batch["id"].tolist(), strict=True))
            ctx.step()
            if steps is not None and i + 1 == steps:
                return

    for rank in (1, 0):  # two ranks of a job stepping together: rank 0 saves (and marks the run done)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with init(config=path) as ctx:
            reader = ctx.reader()
            assert ctx.checkpoint.restore(reader=reader) == 0
            take(reader, 5, ctx)
            if rank == 0:
                assert ctx.checkpoint.save() is not None
            ctx.finish(save=False)
    monkeypatch.setenv("SHARDKIT_RERUN", "resume")  # the ranks finished: go on from their checkpoint
    for rank in range(3):  # the job resumed on three ranks
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        with warnings.catch_warnings(), init(config=path) as ctx:
            warnings.simplefilter("ignore", CheckpointWarning)  # RNG states saved by another layout
            reader = ctx.reader()
            assert ctx.checkpoint.restore(reader=reader) == 5
            take(reader, None, ctx)
            ctx.finish(save=False)
    with shardkit.make_reader(sources, weights={"web": 1, "books": 1}, samples_per_epoch=48, batch_size=4,
                              seed=2, num_epochs=2, shard=0, num_shards=1) as whole:
        everything = [(s, i) for b in whole for s, i in zip(b[SOURCE].tolist(), b["id"].tolist(),
                                                            strict=True)]
    # the two runs read the stream from its start, each sample once: the 8 samples epoch 0 had left after
    # the resume gave 3 shards 2 each, and the other 2 went first into epoch 1, whose last 2 are not read
    assert len(seen) == 94
    assert sorted(seen) == sorted(everything[:94])


# ---- the commands -------------------------------------------------------------------------------------

def test_inspect_several_urls_shows_each_and_the_mixture(sources: dict[str, str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", sources["web"], f"b={sources['books']}", "--weights", "3,1",
                 "--samples-per-epoch", "100"]) == 0
    text = capsys.readouterr().out
    assert f"source web: {sources['web']}" in text
    assert "mixture: 2 sources, 100 samples per epoch" in text
    assert "fields: the same in every source" in text
    assert "web     60    3       75.00%  75.0           1.25" in text
    assert main(["inspect", f"web={sources['web']}", f"books={sources['books']}", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in info["sources"]] == ["web", "books"]
    mix = info["mixture"]
    assert mix["samples_per_epoch"] == 80
    assert [m["share"] for m in mix["sources"]] == [0.75, 0.25]
    assert mix["bound"] == 0.5
    assert mix["fields_differ"] is None


def test_inspect_says_where_the_fields_differ(tmp_path: Path, sources: dict[str, str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    other = shardkit.write_dataset(pa.table({"id": pa.array([1, 2], pa.int64())}), tmp_path / "other").url
    assert main(["inspect", sources["web"], other]) == 0
    assert "fields: DIFFER: source 'other' has no field(s) ['x'] of source 'web'" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "words"), [
    (["--weights", "3,1,2"], ["--weights 3,1,2 gives 3 weight(s) for 2 source(s)"]),
    (["--weights", "3,x"], ["--weights 3,x", "give numbers"]),
    (["--weights", "web=-1,books=1"], ["weights['web']=-1 is negative"]),
    (["--weights", "news=1,books=1"], ["['news']", "not sources of the mixture"]),
])
def test_inspect_bad_weights_fail_in_one_line(sources: dict[str, str], capsys: pytest.CaptureFixture[str],
                                              args: list[str], words: list[str]) -> None:
    assert main(["inspect", sources["web"], sources["books"], *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardkit inspect: error: ")
    for word in words:
        assert word in err


def test_two_sources_of_one_name_are_refused(sources: dict[str, str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", sources["web"], f"{tmp_path}/x/web"]) == 2
    assert "two sources are named 'web'" in capsys.readouterr().err


def test_bench_several_urls_measures_the_mixture(sources: dict[str, str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", sources["web"], sources["books"], "--weights", "web=1,books=1",
                 "--samples-per-epoch", "40", "--batch-size", "8", "--warmup", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == 40
    assert result["rows_by_source"] == {"web": 20, "books": 20}
    assert [m["name"] for m in result["mixture"]] == ["web", "books"]
    assert main(["bench", sources["web"], sources["books"], "--batch-size", "8", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    assert "mixture      web: weight 60, share 75.00%, measured 60 rows (75.00%)" in text
