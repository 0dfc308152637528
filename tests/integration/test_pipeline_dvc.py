"""Real DVC over the real data stages, on a tiny model and corpus in a temporary copy of the repository (the train
stage has its own tests, tests/integration/test_train.py; `make run` runs the whole graph)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tools.repro_check import GIT, copy_project, sh

pytestmark = pytest.mark.integration
EXP_RUN = ["dvc", "exp", "run", "cache_dataset", "-S", "experiment=ci_tiny"]
# Upstream of cache_dataset in ci_tiny: the check of params.yaml and its files comes first; data/ is a dependency (the
# files of data.sources live there), so prepare_corpus, which writes data/corpus, is upstream too. The base's
# tokenizer and context length come from prepare_base_tokenizer: preparing data never converts the base's weights.
STAGES = {"check", "prepare_base_tokenizer", "prepare_corpus", "prepare_tokenizer", "cache_dataset"}


def _ran(done: subprocess.CompletedProcess) -> set[str]:
    return set(re.findall(r"Running stage '([\w@]+)'", done.stdout + done.stderr))


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_base_dir, peoples_daily) -> Path:
    """A git+DVC copy of the project whose `ci_tiny` experiment points at a tiny model and corpus."""
    root = copy_project(tmp_path_factory.mktemp("repo"))
    (root / "data" / "tiny").mkdir(parents=True)
    (root / "data/tiny/train.txt").write_text("\n".join(peoples_daily[:300]) + "\n", encoding="utf-8")
    (root / "data/tiny/heldout.txt").write_text("\n".join(peoples_daily[-50:]) + "\n", encoding="utf-8")
    tiny = {
        "defaults": [{"override /tokenizer": "extend_zh"}],  # the vocabulary extension (experiment extend_vocab)
        "model": {"path": str(tiny_base_dir)},
        "corpus": {"wiki_max_chars": 2000, "sft_train_examples": 20, "chat_train_examples": 10},
        "tokenizer": {"vocab_size": 600},
        "data": {"train_file": "data/tiny/train.txt", "heldout_file": "data/tiny/heldout.txt", "block_size": 64},
    }
    (root / "conf/experiment/ci_tiny.yaml").write_text("# @package _global_\n" + yaml.safe_dump(tiny))
    sh([*GIT, "add", "-A"], root)
    sh([*GIT, "commit", "-qm", "tiny experiment"], root)
    return root


def test_exp_run_composes_conf_and_reruns_only_dependent_stages(repo):
    first = sh([*EXP_RUN], repo)
    assert _ran(first) == STAGES
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["data"]["train_file"] == params["tokenizer"]["train_file"] == "data/tiny/train.txt"
    metrics = yaml.safe_load((repo / "metrics/tokenizer.json").read_text())
    assert metrics["vocab_size"] > metrics["base_vocab_size"] == 49152
    assert metrics["heldout_tokens_per_char_after"] < metrics["heldout_tokens_per_char_before"]

    from datasets import load_from_disk

    dataset = load_from_disk(str(repo / "artifacts/dataset"))
    assert len(dataset["train"][0]["input_ids"]) == 64
    assert max(max(row) for row in dataset["train"]["input_ids"]) >= 49152, "extended ids are used"

    second = sh([*EXP_RUN, "-S", "tokenizer.vocab_size=700"], repo)
    assert _ran(second) == {"check", "prepare_tokenizer", "cache_dataset"}  # check re-reads the changed params.yaml
    assert yaml.safe_load((repo / "params.yaml").read_text())["tokenizer"]["vocab_size"] == 700

    third = sh(["dvc", "repro", "cache_dataset"], repo)
    assert _ran(third) == set()
    assert "Data and pipelines are up to date" in third.stdout


def test_block_size_above_model_positions_fails_cleanly(repo):
    done = sh([*EXP_RUN, "-S", "data.block_size=1024"], repo, check=False)
    assert done.returncode != 0
    assert "data.block_size: 1024 exceeds the model's max_position_embeddings (256)" in done.stderr
    assert "Traceback" not in done.stderr
    assert not list((repo / "artifacts").glob(".*tmp*")), "no temporary output left behind"
    assert not (repo / "artifacts/dataset").exists()


def test_unknown_override_is_refused(repo):
    done = sh([*EXP_RUN, "-S", "lora.rank=8"], repo, check=False)
    assert done.returncode != 0
    assert "lora.rank" in done.stdout + done.stderr
