"""Weighted mixing: shares follow the weights (planned and realised), the mix repeats nothing and depends only on the
seed, every source reaches the blocks, instruction sources of both formats mix; bad sources stop the stage before it
writes anything."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import yaml

from pipeline.core import config
from pipeline.data.mixing import Source, choose, resolve
from pipeline.data.tokenizer import load_tokenizer
from tests.conftest import REPO
from tests.helpers.datasets import mix_instruction, mix_text, read_source

WIKI = [
    "The quick brown fox jumps over the lazy dog near the river bank, as it does every morning at sunrise.",
    "Anarchism is a political philosophy and movement that is skeptical of all justifications for authority.",
    "Albedo is the fraction of sunlight that is diffusely reflected by a body, measured on a scale from 0 to 1.",
] * 40


@pytest.fixture(scope="module")
def smol(smol_tokenizer_dir):
    return load_tokenizer(smol_tokenizer_dir)


def test_choice_follows_the_shares_repeats_nothing_and_depends_on_the_seed():
    rng = np.random.default_rng(0)
    lengths = [rng.integers(5, 50, 400), rng.integers(5, 50, 100), rng.integers(5, 50, 300)]
    shares = np.array([0.5, 0.2, 0.3])
    mix = [tuple(pair) for pair in choose(lengths, shares, seed=1).tolist()]
    assert len(set(mix)) == len(mix), "no item twice"
    tokens = np.array([sum(int(lengths[i][j]) for i, j in mix if i == s) for s in range(3)])
    assert tokens[1] == lengths[1].sum(), "the source with the least text for its weight is used whole"
    np.testing.assert_allclose(tokens / tokens.sum(), shares, atol=0.01)
    assert (choose(lengths, shares, seed=1) == np.array(mix)).all()
    assert not np.array_equal(choose(lengths, shares, seed=2), np.array(mix))
    assert [i for i, _ in mix] != sorted(i for i, _ in mix), "sources are interleaved"


def test_text_mix_reports_planned_and_realised_shares(smol, peoples_daily, tmp_path):
    sources = [Source("pd", tmp_path / "pd.txt", "text", 3.0), Source("wiki", tmp_path / "wiki.txt", "text", 1.0)]
    tables, stats = mix_text(
        smol, sources, [peoples_daily[:300], WIKI], block_size=64, tail="drop", validation_fraction=0.1, seed=0
    )
    shares = stats["sources"]
    assert shares["pd"]["planned_share"] == 0.75 and shares["wiki"]["planned_share"] == 0.25
    assert shares["wiki"]["items"] == len(WIKI) and shares["pd"]["items"] < 300
    assert sum(s["train_tokens"] for s in shares.values()) == stats["train_rows"] * 64, "every train token counted"
    for s in shares.values():
        assert s["realised_share"] == pytest.approx(s["planned_share"], abs=0.03)
    again, same = mix_text(
        smol, sources, [peoples_daily[:300], WIKI], block_size=64, tail="drop", validation_fraction=0.1, seed=0
    )
    assert same == stats and again["train"].equals(tables["train"])


def test_instruction_mix_of_alpaca_and_chat(smol):
    alpaca = [{"instruction": "判断情感。", "input": f"第{i}条评论很好。", "output": "正面"} for i in range(60)]
    chat = [
        {"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello!"}]}
        for i in range(40)
    ]
    sources = [Source("a", None, "alpaca", 1.0), Source("c", None, "chat", 1.0)]
    tables, stats = mix_instruction(
        smol, sources, [alpaca, chat], template="chat", max_seq_len=128, validation_fraction=0.1, seed=0
    )
    assert stats["train_rows"] + stats["validation_rows"] == sum(s["items"] for s in stats["sources"].values())
    assert sum(s["train_tokens"] for s in stats["sources"].values()) == stats["tokens"] - sum(
        len(r) for r in tables["validation"].column("input_ids").to_pylist()
    )
    for s in stats["sources"].values():
        assert s["planned_share"] == 0.5 and s["realised_share"] == pytest.approx(0.5, abs=0.1)


def test_bad_sources_are_named(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n")
    (tmp_path / "plain.txt").write_text("just text\n")
    entries = [config.SourceConfig(file=str(tmp_path / "missing.txt"), format="text", weight=1.0)]
    with pytest.raises(FileNotFoundError, match=r"data.sources.0.file: .*missing.txt not found"):
        read_source(resolve(entries)[0], "data.sources.0")
    with pytest.raises(ValueError, match=r"rows.jsonl:1: a JSON object in a text source"):
        read_source(Source("r", tmp_path / "rows.jsonl", "text", 1.0), "data.sources.1")
    with pytest.raises(ValueError, match=r"plain.txt:1: invalid JSON"):
        read_source(Source("p", tmp_path / "plain.txt", "alpaca", 1.0), "data.sources.1")
    with pytest.raises(ValueError, match=r"rows.jsonl:1: missing field\(s\) 'messages'"):
        read_source(Source("r", tmp_path / "rows.jsonl", "chat", 1.0), "data.sources.1")
    same_stem = [config.SourceConfig(file=f"{d}/a.txt", format="text", weight=1.0) for d in ("x", "y")]
    assert [s.name for s in resolve(same_stem)] == ["a_0", "a_1"]


def test_stage_refuses_a_bad_source_before_writing(tmp_path, tiny_base_dir, smol_tokenizer_dir, peoples_daily):
    from stages import cache_dataset as stage

    (tmp_path / "pd.txt").write_text("\n".join(peoples_daily[:50]) + "\n", encoding="utf-8")
    raw = config.compose(REPO / "conf", ["tracking.uri=", "data.block_size=64"])
    raw["data"]["sources"] = [
        {"file": str(tmp_path / "pd.txt"), "format": "text", "weight": 1.0},
        {"file": str(tmp_path / "gone.txt"), "format": "text", "weight": 2.0},
    ]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    args = argparse.Namespace(
        tokenizer=smol_tokenizer_dir,
        base_config=tiny_base_dir / "config.json",
        out=tmp_path / "dataset",
        metrics=tmp_path / "dataset.json",
        workers=1,
        chunk_chars=stage.CHUNK_CHARS,
    )
    with pytest.raises(FileNotFoundError, match="data.sources.1.file"):
        stage.main(args, config.load(tmp_path / "params.yaml"))
    assert not (tmp_path / "dataset").exists() and not (tmp_path / "dataset.json").exists()
    raw["data"]["sources"][1]["weight"] = 0
    with pytest.raises(ValueError, match=r"data.sources.1.weight: input should be greater than 0"):
        config.validate(raw)
