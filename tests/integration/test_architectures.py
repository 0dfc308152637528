"""The architecture matrix under ZeRO-3 with 2 ranks. Loading: each rank reads only its own slice of every parameter
(converted ones, such as fused MoE experts, through transformers' own conversions), and the gathered model is
`AutoModelForCausalLM.from_pretrained`'s, tensor for tensor, its grown embedding rows the mean of the old. Training:
a LoRA adapter on every Linear layer of each architecture trains, consolidates to the live engine's tensors exactly,
and merges with the merge proof; the merged folder's logits, loaded by transformers, are PEFT's base + adapter, and
evaluate's scoring gives the merged model the adapter's bits per byte."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.environment import free_port, with_venv_path
from pipeline.launching.ops import remove_stale_shm_buffers
from tests.conftest import REPO
from tests.helpers.architectures import MATRIX

pytestmark = pytest.mark.integration
GROW = 5


def _launch(worker: str, out: Path, models: list[Path], *extra: str) -> Path:
    command = [
        "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", f"tests.helpers.{worker}",
        "--out", str(out), *extra, "--models", *map(str, models),
    ]  # fmt: skip
    env = {**with_venv_path(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    remove_stale_shm_buffers()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def partitioned(architecture_dirs, tmp_path_factory) -> Path:
    models = [architecture_dirs[name] for name in MATRIX]
    return _launch("architecture_load_worker", tmp_path_factory.mktemp("partitioned"), models, "--grow", str(GROW))


@pytest.fixture(scope="module")
def trained(architecture_dirs, tmp_path_factory) -> Path:
    models = [architecture_dirs[name] for name in MATRIX]
    return _launch("architecture_train_worker", tmp_path_factory.mktemp("trained"), models)


@pytest.mark.parametrize("name", list(MATRIX))
def test_the_partitioned_base_is_transformers_own(name, architecture_dirs, partitioned):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(architecture_dirs[name], dtype=torch.float32)
    rows = reference.config.vocab_size
    expected = dict(reference.named_parameters())
    got = load_file(partitioned / f"{name}.safetensors")
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        if got[key].shape[0] == rows + GROW and value.shape[0] == rows:
            assert torch.equal(got[key][:rows], value), key
            assert torch.allclose(got[key][rows:], value.double().mean(0).float().expand(GROW, -1)), key
        else:
            assert torch.equal(got[key], value), key


@pytest.mark.parametrize("name", list(MATRIX))
def test_each_architecture_trains_consolidates_and_merges_as_peft_defines_it(
    name, architecture_dirs, trained, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.checkpoints.adapter import WEIGHTS, peft_key
    from pipeline.checkpoints.consolidate import consolidate
    from pipeline.merge.fold import merge

    base = architecture_dirs[name]
    consolidate(checkpoint_dir=trained / name, output_dir=tmp_path / "adapter")
    live = load_file(trained / name / "final.safetensors")
    adapter = load_file(tmp_path / "adapter" / WEIGHTS)
    assert {peft_key(key) for key in live} == adapter.keys() and any("lora_B" in key for key in adapter)
    for key, value in live.items():  # the consolidated adapter is the live engine's tensors, exactly
        assert torch.equal(adapter[peft_key(key)], value), key
    report = merge(base_dir=base, adapter_dir=tmp_path / "adapter", out_dir=tmp_path / "merged")
    proof = report["verification"]  # merge raises where the merged logits are not base + adapter's
    assert proof["max_abs_logit_diff"] <= proof["limit_abs"], report
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()(ids).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                         str(tmp_path / "adapter")).eval()  # fmt: skip
        reference = peft(ids).logits
        untrained = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(ids).logits
    assert (reference - untrained).abs().max() > 1e-3, "the adapter moves the logits"
    assert (merged - reference).abs().max() < 1e-3
    _evaluate_gives_the_merged_model_the_adapter_s_figure(base, tmp_path)


def _evaluate_gives_the_merged_model_the_adapter_s_figure(base: Path, tmp_path: Path) -> None:
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.evaluation.likelihood import load_model, score, text_examples

    text = tmp_path / "heldout.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n你好，世界。 Merged or not, the same model.\n")
    examples = text_examples(load_tokenizer(base), text, None)
    figures = {
        side: score(load_model(folder, adapter, precision="fp32"), examples, context=16, stride=8, batch_size=4)
        for side, folder, adapter in (("adapter", base, tmp_path / "adapter"), ("merged", tmp_path / "merged", None))
    }
    assert figures["adapter"].tokens == figures["merged"].tokens > 0
    assert figures["merged"].as_dict()["bits_per_byte"] == pytest.approx(figures["adapter"].as_dict()["bits_per_byte"])
