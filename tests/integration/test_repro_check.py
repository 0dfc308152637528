"""`make repro-check` at tiny size (the session fixture runs it), and the one MLflow run each of those two pipeline
executions logged: every stage's figures, the curve, DVC stage hashes, the artifacts."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from pipeline.core.atomic import read_json
from pipeline.tracking.mlflow_run import flatten
from pipeline.tracking.runs_view import TRAIN_FIGURES, VIEW_TAG
from tools.repro_check import compare

pytestmark = pytest.mark.integration
PREFIXES = ("base.", "corpus.", "tokenizer.", "dataset.", "train.", "consolidate.", "merge.", "eval.", "seconds.")


def test_two_runs_from_scratch_give_the_same_outputs(tiny_pipeline):
    assert tiny_pipeline.differences == [], "\n".join(tiny_pipeline.report + tiny_pipeline.differences)
    lock = yaml.safe_load((tiny_pipeline.roots[0] / "dvc.lock").read_text())
    outputs = {o["path"] for entry in lock["stages"].values() for o in entry.get("outs", [])}
    assert {line.split()[1] for line in tiny_pipeline.report if len(line.split()) > 2} >= outputs
    assert tiny_pipeline.report[-1] == "dvc status: clean in both"


def test_a_difference_is_reported(tiny_pipeline, tmp_path: Path):
    first, second = tmp_path / "first", tmp_path / "second"
    for root in (first, second):
        for name in ("dvc.lock", "metrics/eval.json", "metrics/train.json", "metrics/dataset.json"):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tiny_pipeline.roots[0] / name, root / name)
    lock = yaml.safe_load((second / "dvc.lock").read_text())
    lock["stages"]["merge"]["outs"][0]["md5"] = "0" * 32
    (second / "dvc.lock").write_text(yaml.safe_dump(lock))
    train = read_json(second / "metrics/train.json")
    (second / "metrics/train.json").write_text(json.dumps({**train, "tokens_per_s": 1.0}))  # a measurement: ignored
    evaluation = read_json(second / "metrics/eval.json")
    evaluation["in_domain"]["adapter"]["bits_per_byte"] += 1e-6
    (second / "metrics/eval.json").write_text(json.dumps(evaluation))
    _, differences = compare(first, second)
    assert len(differences) == 2, differences
    assert differences[0].startswith("merge: artifacts/merged differs") and "metrics/eval.json" in differences[1]


def test_each_execution_is_one_complete_mlflow_run(tiny_pipeline):
    root = tiny_pipeline.roots[0]
    client = MlflowClient(f"sqlite:///{root / 'mlruns.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("llm-lora").experiment_id])
    assert run.info.run_id == read_json(root / "logs/mlflow_run.json")["run_id"]
    assert run.info.status == "FINISHED"
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert run.data.params == flatten(params), "the flat resolved config"

    lock = yaml.safe_load((root / "dvc.lock").read_text())
    tags = run.data.tags
    for stage, entry in lock["stages"].items():
        key = stage.replace("@", ".")
        if stage != "track":  # the track stage's own entry is written after it ran
            assert tags[f"dvc.stage.{key}"] == hashlib.md5(json.dumps(entry, sort_keys=True).encode()).hexdigest()
        if "--run-id-file" in entry["cmd"]:  # the stages that log into the run
            assert tags[f"stage.{key}"] == "ran"
    assert "dvc.stage.track" not in tags
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    assert tags["git_commit"] == head and tags["version.deepspeed"] and tags["world_size"] == "2"
    plan = read_json(root / "artifacts/checkpoints/plan.json")  # the attention chosen for the model, in both
    assert tags["train.attention"] == plan["launch"]["attention"] == "sdpa" and tags["train.precision"] == "bf16"

    metrics = run.data.metrics
    assert all(any(k.startswith(p) for k in metrics) for p in PREFIXES), sorted(metrics)
    evaluation = read_json(root / "metrics/eval.json")
    assert metrics["eval.in_domain.adapter.bits_per_byte"] == evaluation["in_domain"]["adapter"]["bits_per_byte"]
    tokenizer = read_json(root / "metrics/tokenizer.json")
    assert metrics["tokenizer.heldout_tokens_per_char_after"] == tokenizer["heldout_tokens_per_char_after"]
    curve = [float(line.split(",")[1]) for line in (root / "metrics/train_curve.csv").read_text().splitlines()[1:]]
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert [s for s, _ in history] == [1, 2, 3, 4] and [round(v, 6) for _, v in history] == curve

    def files(path: str | None = None) -> list[str]:
        found = []
        for item in client.list_artifacts(run.info.run_id, path):
            found += files(item.path) if item.is_dir else [item.path]
        return found

    logged = set(files())
    expected = {"config/params.yaml", "config/dvc.lock", "adapter/adapter_model.safetensors", "metrics/eval.json"}
    assert expected | {"metrics/eval_samples.md", "plots/train_curve.png", "plots/eval_bits_per_byte.png"} <= logged
    local = Path(run.info.artifact_uri.removeprefix("file://"))
    assert (local / "adapter/adapter_model.safetensors").read_bytes() == (
        root / "artifacts/adapter/adapter_model.safetensors"
    ).read_bytes()
    assert (local / "plots/train_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_run_reads_as_what_it_is(tiny_pipeline):
    """A model-training experiment; the run's description holds the evaluation table, the merge proof and the
    command that reproduces it; its dataset inputs are the training data and each evaluation set, each digest the
    DVC hash of what the pipeline made of it."""
    root = tiny_pipeline.roots[0]
    client = MlflowClient(f"sqlite:///{root / 'mlruns.db'}")
    experiment = client.get_experiment_by_name("llm-lora")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on the runs
    (run,) = client.search_runs([experiment.experiment_id])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    assert run.info.run_name == f"repro {commit.stdout.strip()}", "`dvc repro` names the run after its commit"
    view = json.loads(json.loads(experiment.tags[VIEW_TAG])["state"])
    assert view["selectedColumns"][:2] == ["metrics.`eval.in_domain.adapter.bits_per_byte`",
                                           "metrics.`eval.in_domain.base.bits_per_byte`"]  # fmt: skip
    assert (
        {f"metrics.`{m}`" for m in TRAIN_FIGURES}
        <= set(view["selectedColumns"])
        <= {*(f"metrics.`{m}`" for m in run.data.metrics), *(f"params.`{p}`" for p in run.data.params)}
    ), "every headline column is a figure the run has"
    note = run.data.tags["mlflow.note.content"]
    assert "bits/byte" in note and "in_domain" in note and "merge proof: max |logit diff|" in note
    assert "Reproduce: `git checkout" in note
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    training = inputs["training data"]
    assert training.dataset.digest == lock["stages"]["cache_dataset"]["outs"][0]["md5"][:36]
    assert {t.key: t.value for t in training.tags}["mlflow.data.context"] == "training"
    for name in ("in_domain", "en_wiki"):
        assert inputs[f"eval set {name}"].dataset.digest == lock["stages"][f"eval_set@{name}"]["outs"][0]["md5"][:36]


def test_model_cards_and_the_export_note(tiny_pipeline):
    """consolidate and merge put a model card in their folders (reproducible: the hashes above compared them);
    the export stage, off by default, left only its note."""
    root = tiny_pipeline.roots[0]
    params = yaml.safe_load((root / "params.yaml").read_text())
    for folder, library in (("adapter", "peft"), ("merged", "transformers")):
        card = (root / "artifacts" / folder / "README.md").read_text(encoding="utf-8")
        header = yaml.safe_load(card.split("---\n")[1])
        assert header["library_name"] == library and header["base_model"] == params["model"]["path"]
        assert "```yaml\nmodel:" in card and "python -m pipeline chat --model" in card
    assert [p.name for p in (root / "artifacts/gguf").iterdir()] == ["README.md"]
    assert read_json(root / "metrics/export.json") == {"exported": False}
