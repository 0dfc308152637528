"""params.yaml is the composition of conf/, and the config module rejects bad values by key."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from pipeline.core import config
from tests.conftest import REPO


def test_params_yaml_equals_composition_of_conf():
    committed = config.read_params(REPO / "params.yaml")
    assert committed == config.compose(REPO / "conf"), "params.yaml is stale: run `make params`"


@pytest.mark.parametrize("experiment", ["sft_reviews", "sft_chat"])
def test_experiments_compose_and_validate(experiment):
    cfg = config.validate(config.compose(REPO / "conf", [f"experiment={experiment}"]))
    assert cfg.data.format in ("alpaca", "chat")
    assert cfg.tokenizer.extend is False


def test_override_reaches_interpolations():
    raw = config.compose(REPO / "conf", ["data.train_file=/corpora/mine.txt", "seed=7"])
    cfg = config.validate(raw)
    assert cfg.tokenizer.train_file == "/corpora/mine.txt"
    assert cfg.data.seed == cfg.train.seed == cfg.corpus.seed == 7


def _defaults() -> dict:
    return config.compose(REPO / "conf")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["lora"].update(rank=8), "unknown key 'lora.rank'"),
        (lambda r: r.update(extra_group={}), "unknown key 'extra_group'"),
        (lambda r: r["data"].update(block_size="512"), "data.block_size: input should be a valid integer"),
        (lambda r: r["data"].update(block_size=0), "data.block_size: input should be greater than 0"),
        (lambda r: r["data"].update(tail="wrap"), "data.tail: input should be 'drop' or 'pad'"),
        (lambda r: r["deepspeed"].update(stage=4), "deepspeed.stage: input should be 0, 1, 2 or 3"),
        (lambda r: r["deepspeed"].update(offload_param=True), "deepspeed.offload_param: needs deepspeed.stage=3"),
        (lambda r: r["eval"].update(stride=1024), "eval.stride: must be <= eval.context"),
        (lambda r: r["data"].update(prompt_template="Q: {question}"), "data.prompt_template: expected"),
        (
            lambda r: r["data"].update(format="yaml"),
            "data.format: input should be 'text', 'alpaca', 'chat', 'prompt_completion', 'pref",
        ),
        (lambda r: r["launcher"].update(num_nodes=2), "launcher.num_nodes: 2 with launcher=local (this node alone)"),
        (lambda r: r["launcher"].update(mode="manual", num_nodes=2), "launcher.master_port: launcher=manual needs a "),
        (lambda r: r["tokenizer"].pop("vocab_size"), "missing key 'tokenizer.vocab_size'"),
        (lambda r: r["lora"].update(quantization="fp4"), "lora.quantization: input should be 'none', 'nf4' or 'int8'"),
        (lambda r: r["lora"].update(compute_dtype="bf16"), "lora.compute_dtype: bf16 applies to a 4-bit base only"),
        (lambda r: r["lora"].update(quantization="int8", compute_dtype="fp16"), "lora.compute_dtype: fp16 applies"),
        (lambda r: r["lora"].update(lr_ratio=0.0), "lora.lr_ratio: input should be greater than 0"),
        (lambda r: r["lora"].update(target_modules="all"), "lora.target_modules.literal['all-linear']: input should"),
        (
            lambda r: r["train"].update(objective="dpo", init_adapter="artifacts/adapter", reference="step"),
            "train.reference: step takes the reference with the adapter disabled (the base), but train.init_adapter",
        ),
        (
            lambda r: (r["lora"].update(quantization="nf4"), r["deepspeed"].update(stage=3, offload_param=True)),
            "deepspeed.offload_param: a quantized base (lora.quantization=nf4)",
        ),
    ],
)
def test_bad_values_are_named(edit, message):
    raw = _defaults()
    edit(raw)
    with pytest.raises(ValueError, match="params.yaml") as err:
        config.validate(raw)
    assert message in str(err.value)


def test_stage_reports_bad_params_without_traceback(tmp_path):
    raw = _defaults()
    raw["lora"]["rank"] = 8
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw), encoding="utf-8")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stages.prepare_corpus",
            "--out",
            str(tmp_path / "corpus"),
            "--params",
            str(params),
            "--metrics",
            str(tmp_path / "corpus.json"),
            "--run-id-file",
            str(tmp_path / "run.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "unknown key 'lora.rank'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "corpus").exists()


@pytest.mark.parametrize("name", ["tasks", "variant", "preference"])
def test_an_eval_set_named_like_eval_json_s_other_figures_is_refused(name):
    """eval.json keeps task scores, preference figures and the variant beside the sets' figures: a set of that name
    would overwrite them, so the config refuses it, and evaluation/results.py reserves exactly those names."""
    from pipeline.evaluation.results import RESERVED

    assert set(config.RESERVED_SET_NAMES) == set(RESERVED)
    with pytest.raises(ValueError, match=rf"eval.sets: '{name}' names other figures in eval.json; rename that set"):
        config.Config(**config.compose(REPO / "conf", [f"+eval.sets.{name}=data/x.txt"]))


def test_params_read_as_dvc_writes_them(tmp_path):
    """DVC writes params.yaml by YAML 1.2: `-S train.lr=1e-5` becomes `lr: 1e-05`, a float there and a string under
    PyYAML's YAML 1.1 rules; read_params reads it as DVC does, and what it meant stays a string where quoted."""
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  lr: 1e-05\n  adam_epsilon: 1.0e-08\n  scale: -2E+3\n  name: '1e-05'\n  id: 1e5x\n")
    assert config.read_params(params) == {
        "train": {"lr": 1e-5, "adam_epsilon": 1e-8, "scale": -2000.0, "name": "1e-05", "id": "1e5x"}
    }
