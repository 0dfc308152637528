"""Your data as you have it: every format (tests/helpers/user_data.py: plain text, Stanford Alpaca, OpenAI messages,
ShareGPT, TRL's standard, conversational and implicit-prompt pairs, LLaMA-Factory's ShareGPT pairs) in every container
(a JSON array, JSONL, Parquet, .gz, .zst, .bz2, a folder of shards), through `data=own` (`data.format: auto`) to
metrics/eval.json on the tiny LLaMA, in one DVC workspace with one DeepSpeed launch:

- `dvc exp run` trains on Stanford Alpaca's JSON array (the issue's first row, refused before) end to end: check warns
  that the experiment's max_seq_len cuts most examples short and names the length that keeps them whole, the held-out
  rows are the in-domain set as the user wrote them, eval.json scores their responses, the model card names the
  format found;
- `dvc repro -s` runs the data and evaluation stages on TRL's conversational pairs in a .jsonl.gz (trained, then
  evaluate failed, before): eval.json holds the held-out pairs' preference accuracy and margins beside the chosen
  responses' bits per byte, and those of an evaluation set of pairs of its own (LLaMA-Factory's, a JSON array); an
  evaluation that fails afterwards leaves those figures in place (persistent outputs);
- preference pairs with train.objective=lm are refused by check, naming the file, its row's format and the fix, with
  nothing deleted;
- every cell (format x container, 63) runs check, cache_dataset and eval_set (the stages' own `main`, in-process, on
  its own composed config: experiment ci_formats, data.train_file = the cell's path), then one evaluate `main`
  scores every cell's held-out set with the adapter of the run above (one load of each model rather than 63): each
  cell is accepted by check, cached with its held-out part left out, and scored; each container gives its format's
  JSONL cell's dataset figures, held-out bytes and eval.json figures (pairs: preference figures too), so the
  container changes nothing. Training on each format is not repeated here (one SFT launch; DPO on pairs:
  tests/integration/test_preference_training.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from pipeline.core import config
from pipeline.core.atomic import read_json
from tests.helpers import user_data
from tools.repro_check import GIT, copy_project, sh

pytestmark = pytest.mark.integration
MEASURED = ("tokenize_seconds", "tokens_per_second_per_core", "workers", "parts", "parts_reused")
EXPERIMENT = ["-S", "experiment=ci_formats"]
ROWS = 40  # per file: 2 held out (data.heldout_fraction 0.05), 38 trained


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_base_dir, peoples_daily) -> Path:
    """A git+DVC copy of the project, every cell's file under user/, and the experiment `ci_formats`: the tiny
    experiment with data=own on the tiny LLaMA, 2 steps, examples of 192 tokens (most alpaca rows cut short), 600 bytes
    of each set scored in disjoint windows, one short greedy sample, tracking off."""
    root = copy_project(tmp_path_factory.mktemp("formats"))
    texts = [text for text in peoples_daily if len(text) > 100][:ROWS]
    for name, (make, _) in user_data.FORMATS.items():
        for container in user_data.CONTAINERS:
            user_data.write(make(texts), root / "user", f"{name}-{container}", container)
    experiment = {
        "defaults": ["tiny", {"override /data": "own"}],
        "model": {"path": str(tiny_base_dir)},
        "train": {"max_steps": 2, "eval_every": 2, "save_every": 2},
        "data": {"train_file": "user/stanford_alpaca-json.json", "max_seq_len": 192},
        "eval": {"prompts": ["中国"], "max_new_tokens": 2, "max_bytes": 600, "stride": 64},
        "tracking": {"uri": ""},
    }
    (root / "conf/experiment/ci_formats.yaml").write_text("# @package _global_\n" + yaml.safe_dump(experiment))
    sh([*GIT, "add", "-A"], root)
    sh([*GIT, "commit", "-qm", "the user's files"], root)
    return root


def cell_path(root: Path, name: str, container: str) -> str:
    found = [p for p in (root / "user").iterdir() if p.name.split(".")[0] == f"{name}-{container}"]
    assert len(found) == 1, found
    return str(found[0].relative_to(root))


@pytest.fixture(scope="module")
def trained(repo) -> str:
    """The whole pipeline on Stanford Alpaca's JSON array (format found from its first row), committed."""
    done = sh(["dvc", "exp", "run", "evaluate", *EXPERIMENT], repo)
    sh([*GIT, "add", "-A"], repo)
    sh([*GIT, "commit", "-qm", "alpaca, evaluated"], repo)
    return done.stdout + done.stderr


def test_alpaca_json_array_end_to_end(repo, trained):
    assert "check: warning: data.max_seq_len=192 cuts 36 of all 40 examples of data.train_file short" in trained
    assert "-S data.max_seq_len=246 keeps 95% of them whole" in trained
    dataset = read_json(repo / "metrics/dataset.json")
    assert dataset["format"] == "alpaca" and dataset["examples"] == ROWS - 2, dataset
    assert dataset["warnings"] == [
        "data.max_seq_len=192 cuts 34 of all 38 examples of data.train_file short (89%), 0 of them left with no "
        "response token to train on (dropped); raise it"
    ]
    held = eval_set_rows(repo, "in_domain")
    rows = json.loads((repo / "user/stanford_alpaca-json.json").read_text(encoding="utf-8"))
    assert held == rows[-2:], "the last 5% of the array's rows are the in-domain set, as the user wrote them"
    evaluation = read_json(repo / "metrics/eval.json")
    assert set(evaluation["in_domain"]) == {"base", "adapter", "merged"}
    response_bytes = sum(len((row["output"] + "<|im_end|>").encode()) for row in rows[-2:])
    assert evaluation["in_domain"]["base"]["bytes"] == response_bytes, "the responses (and their EOS) are scored"
    assert "(alpaca)" in (repo / "artifacts/adapter/README.md").read_text(encoding="utf-8")


def eval_set_rows(repo: Path, name: str) -> list:
    lines = (repo / "artifacts/eval_sets" / name / "items.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def test_preference_pairs_are_evaluated_as_pairs_and_a_failure_keeps_the_figures(repo, trained):
    pairs, independent = cell_path(repo, "trl_conversational", "gz"), cell_path(repo, "sharegpt_pairs", "json")
    overrides = ["experiment=ci_formats", f"data.train_file={pairs}", "train.objective=dpo"]
    overrides += [f"+eval.sets.independent={independent}"]  # a set of pairs of its own, read as its rows show
    try:
        sh(["python", "-m", "pipeline.core.config", *overrides], repo)
        stages = ["check", "cache_dataset", "eval_set@in_domain", "eval_set@independent", "evaluate"]
        for stage in stages:
            sh(["dvc", "repro", "-s", stage], repo)
        evaluation = read_json(repo / "metrics/eval.json")
        figures = evaluation["preference"]["in_domain"]
        assert set(figures) == {"base", "adapter", "merged"} and figures["base"]["pairs"] == 2, figures
        assert {"preference_accuracy", "mean_margin", "reward_accuracy"} <= set(figures["merged"])
        assert evaluation["preference"]["independent"]["merged"]["pairs"] >= 1, "its first pairs, within max_bytes"
        assert evaluation["in_domain"]["base"]["bytes"] > 0, "the chosen responses' bits per byte"
        assert read_json(repo / "metrics/dataset.json")["pairs"] == ROWS - 2
        (repo / "artifacts/eval_sets/in_domain/set.json").unlink()
        failed = sh(["dvc", "repro", "-s", "evaluate"], repo, check=False)
        assert failed.returncode != 0 and "no set.json" in failed.stdout + failed.stderr
        assert "Traceback" not in failed.stderr
        assert read_json(repo / "metrics/eval.json") == evaluation, "the failed evaluation left the figures"
    finally:
        sh(["git", "checkout", "--", "."], repo)
        sh(["dvc", "checkout", "-q"], repo, check=False)


def test_pairs_with_a_language_model_objective_are_refused_in_check(repo, trained):
    before = read_json(repo / "metrics/eval.json")
    pairs = cell_path(repo, "trl_implicit", "jsonl")
    done = sh(["dvc", "exp", "run", "evaluate", *EXPERIMENT, "-S", f"data.train_file={pairs}"], repo, check=False)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in output
    assert f"data.format=auto: {pairs} holds preference pairs (its first row)" in output
    assert "expected -S train.objective=dpo (or orpo, simpo)" in output
    assert read_json(repo / "metrics/eval.json") == before
    sh(["git", "checkout", "--", "params.yaml"], repo)


def run_cell(repo: Path, cell: Path, data_path: str, sets: Path) -> dict:
    """check, cache_dataset and eval_set@in_domain (the stages' own `main`, as dvc runs them) on the cell's composed
    config, outputs under `cell` and its set under `sets`; the dataset's figures."""
    from stages import cache_dataset, check, eval_set

    _, data_format = user_data.FORMATS[Path(data_path).name.split("-")[0]]
    overrides = ["experiment=ci_formats", f"data.train_file={data_path}"]
    overrides += ["train.objective=dpo"] if data_format == "preference" else []
    cfg = config.validate(config.compose(repo / "conf", overrides))
    paths = argparse.Namespace(
        conf=repo / "conf", produced=[repo / "data/corpus"], out=cell / "checked.json", memo=None
    )
    check.main(paths, cfg)
    cached = argparse.Namespace(
        tokenizer=repo / "artifacts/tokenizer", base_config=repo / "artifacts/base/config.json",
        out=cell / "dataset", metrics=cell / "dataset.json", workers=1, chunk_chars=4000,
    )  # fmt: skip
    cache_dataset.main(cached, cfg)
    eval_set.main(argparse.Namespace(name="in_domain", file=data_path, out=sets), cfg)
    return read_json(cell / "dataset.json")


def evaluate_cells(repo: Path, out: Path, names: dict[str, str]) -> dict:
    """evaluate's `main` over every cell's held-out set at once (one load of each model), with the adapter and merged
    model of the alpaca run; eval.json's figures."""
    from stages import evaluate

    cfg = config.validate(config.compose(repo / "conf", ["experiment=ci_formats"]))
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"sets": names})})
    artifacts = {name: repo / "artifacts" / name for name in ("base", "adapter", "merged")}
    scored = argparse.Namespace(
        **artifacts, base_tokenizer=repo / "artifacts/base_tokenizer", sets=out / "sets", metrics=out / "eval.json",
        plot=out / "plot.csv", task_plot=out / "tasks.csv", samples=out / "samples.md",
    )  # fmt: skip
    evaluate.main(scored, cfg)
    return read_json(out / "eval.json")


def test_every_format_in_every_container(repo, trained, tmp_path, monkeypatch):
    monkeypatch.chdir(repo)
    datasets, names = {}, {}
    for name in user_data.FORMATS:
        for container in user_data.CONTAINERS:
            cell, path = f"{name}-{container}", cell_path(repo, name, container)
            datasets[cell] = run_cell(repo, tmp_path / cell, path, tmp_path / "sets" / cell)
            names[cell] = path
    evaluation = evaluate_cells(repo, tmp_path, names)
    for name, (_, data_format) in user_data.FORMATS.items():
        jsonl = f"{name}-jsonl"
        for container in user_data.CONTAINERS:
            cell = f"{name}-{container}"
            dataset = datasets[cell]
            assert dataset["format"] == data_format and dataset["documents"] == ROWS - 2, (cell, dataset)
            assert {k: v for k, v in dataset.items() if k not in MEASURED} == {
                k: v for k, v in datasets[jsonl].items() if k not in MEASURED
            }, (cell, "the container changes nothing")
            held = (tmp_path / "sets" / cell / "items.jsonl").read_bytes()
            assert held == (tmp_path / "sets" / jsonl / "items.jsonl").read_bytes(), cell
            assert evaluation[cell]["base"]["bytes"] > 0 and evaluation[cell] == evaluation[jsonl], cell
            if data_format == "preference":
                figures = evaluation["preference"][cell]
                assert figures["merged"]["pairs"] == 2 and figures == evaluation["preference"][jsonl], cell
