"""Merge: merged logits equal base + adapter (through PEFT) for every supported adapter shape, and bad input is
refused before anything is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from pipeline.checkpoints.safetensors_stream import INDEX
from pipeline.core import config
from pipeline.core.atomic import read_json
from pipeline.merge.fold import REPORT, merge
from pipeline.merge.verify import TOLERANCES
from tests.conftest import REPO

ROWS = 49216  # the tiny base's 49,152 rows after a vocabulary extension
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base(root: Path, tiny_base_dir: Path, tied: bool, shard: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.02)
    out = root / f"base_{'tied' if tied else 'untied'}_{shard or 'one'}"
    model.save_pretrained(str(out), max_shard_size=shard or "1GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_base_dir / name, out / name)
    return out


def _adapter(root: Path, base: Path, modules_to_save: list[str] | None, rows: int = ROWS, **lora) -> Path:
    """A trained-looking adapter: random A and B (not B = 0), perturbed modules_to_save copies."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(rows, mean_resizing=False)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=LINEAR, modules_to_save=modules_to_save, init_lora_weights=False, **lora
    )
    peft = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    out = root / "adapter"
    peft.save_pretrained(str(out))
    return out


def _peft_logits(base: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(ROWS, mean_resizing=False)
    with torch.inference_mode():
        return PeftModel.from_pretrained(model, str(adapter)).eval()(input_ids=ids).logits


def _assert_merged_equals_peft(base: Path, adapter: Path, merged: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, ROWS, (2, 40), generator=torch.Generator().manual_seed(7))
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.inference_mode():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, _peft_logits(base, adapter, ids), atol=2e-5, rtol=1e-5)
    weights = {}
    for path in merged.glob("*.safetensors"):
        weights.update(load_file(path))
    assert not [k for k in weights if "lora_" in k or "modules_to_save" in k or "base_model" in k]
    assert read_json(merged / "config.json")["vocab_size"] == ROWS == weights["model.embed_tokens.weight"].shape[0]


def test_untied_all_linear_with_resized_modules_to_save(tmp_path, tiny_base_dir):
    base = _base(tmp_path, tiny_base_dir, tied=False)
    adapter = _adapter(tmp_path, base, ["embed_tokens", "lm_head"])
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    _assert_merged_equals_peft(base, adapter, tmp_path / "merged")
    assert report["lora_layers"] == 14 and report["tied"] is False and report["vocab_rows"] == ROWS
    assert report["verification"]["max_abs_logit_diff"] < 1e-3 and report["verification"]["mean_kl"] < 1e-6
    assert (tmp_path / "merged" / REPORT).is_file()


def test_tied_embeddings_with_rslora_stay_tied(tmp_path, tiny_base_dir):
    base = _base(tmp_path, tiny_base_dir, tied=True)
    adapter = _adapter(tmp_path, base, ["embed_tokens", "lm_head"], use_rslora=True, ensure_weight_tying=True)
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    _assert_merged_equals_peft(base, adapter, tmp_path / "merged")
    assert report["tied"] is True and report["notes"] == []
    assert read_json(tmp_path / "merged" / "config.json")["tie_word_embeddings"] is True


def test_tied_base_is_untied_when_only_the_input_side_changed(tmp_path, tiny_base_dir):
    base = _base(tmp_path, tiny_base_dir, tied=True)
    adapter = _adapter(tmp_path, base, None, rows=49152)
    config = read_json(adapter / "adapter_config.json")
    tensors = load_file(adapter / "adapter_model.safetensors")
    embed = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    tensors["base_model.model.model.embed_tokens.weight"] = embed + 0.1  # a modules_to_save of embed_tokens only
    config["modules_to_save"] = ["embed_tokens"]
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 49152, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))(ids).logits
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    with torch.inference_mode():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert report["tied"] is False and "untied model.embed_tokens.weight and lm_head.weight" in report["notes"][0]


def test_rank_and_alpha_patterns_on_a_sharded_base(tmp_path, tiny_base_dir):
    base = _base(tmp_path, tiny_base_dir, tied=False, shard="1MB")
    assert (base / INDEX).is_file()
    adapter = _adapter(
        tmp_path, base, ["embed_tokens", "lm_head"], rank_pattern={"q_proj": 8, "layers.1.mlp.down_proj": 2},
        alpha_pattern={"v_proj": 3.0},
    )  # fmt: skip
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged", max_shard_size="2MB")
    _assert_merged_equals_peft(base, adapter, tmp_path / "merged")
    index = read_json(tmp_path / "merged" / INDEX)
    assert report["shards"] > 1 and len(set(index["weight_map"].values())) == report["shards"]


@pytest.fixture
def fitted(tmp_path, tiny_base_dir) -> tuple[Path, Path]:
    base = _base(tmp_path, tiny_base_dir, tied=False)
    return base, _adapter(tmp_path, base, ["embed_tokens", "lm_head"])


def _rename_target(adapter: Path) -> str:
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key.replace("q_proj", "qkv_proj")] = tensors.pop(key)
    tensors[key.replace("q_proj", "qkv_proj").replace("lora_A", "lora_B")] = tensors.pop(key.replace("A", "B"))
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    return "which the base has no weight for (model.layers.0.self_attn.qkv_proj.weight)"


def _wrong_shape(adapter: Path) -> str:
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in tensors if "o_proj.lora_A" in k)
    tensors[key] = torch.zeros(4, 16)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    return "does not fit the base weight (32, 32)"


def _no_config(adapter: Path) -> str:
    (adapter / "adapter_config.json").unlink()
    return "adapter_config.json: missing"


def _nan(adapter: Path) -> str:
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in tensors if "up_proj.lora_B" in k)
    tensors[key][0, 0] = float("inf")
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    return "holds NaN or Inf"


def _big_tokenizer(adapter: Path) -> str:
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.weight"] = tensors["base_model.model.model.embed_tokens.weight"][
        :49000
    ]
    tensors["base_model.model.lm_head.weight"] = tensors["base_model.model.lm_head.weight"][:49000]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(adapter / "adapter_model.safetensors"))
    return "tokenizer has 49152 tokens, the merged embeddings only 49000 rows"


@pytest.mark.parametrize("damage", [_rename_target, _wrong_shape, _no_config, _nan, _big_tokenizer])
def test_bad_input_is_refused_and_nothing_written(fitted, tmp_path, damage):
    base, adapter = fitted
    message = damage(adapter)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    assert message in str(err.value)
    assert not (tmp_path / "merged").exists()


def _wrong_alpha(adapter: Path) -> None:
    config = read_json(adapter / "adapter_config.json")
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 9}))  # scale 9/4, not 8/4


def _missed_layer(adapter: Path) -> None:
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if "layers.1.mlp.gate_proj" not in k},
        str(adapter / "adapter_model.safetensors"),
    )


@pytest.mark.parametrize("mistake", [_wrong_alpha, _missed_layer])
def test_default_tolerances_catch_a_wrong_scale_or_a_missed_layer(fitted, tmp_path, mistake):
    from pipeline.merge.verify import TOLERANCES, logits_gap

    base, adapter = fitted
    wrong = tmp_path / "wrong"
    shutil.copytree(adapter, wrong)
    mistake(wrong)
    merge(base_dir=base, adapter_dir=wrong, out_dir=tmp_path / "merged", verify=False)
    gap = logits_gap(base_dir=base, adapter_dir=adapter, merged_dir=tmp_path / "merged", rows=ROWS)
    limit_abs, limit_kl = TOLERANCES["fp32"]
    assert gap["max_abs_logit_diff"] > limit_abs and gap["mean_kl"] > limit_kl, gap


@pytest.mark.slow
def test_cli_missing_adapter_exits_2(fitted, tmp_path):
    base, _ = fitted
    command = [sys.executable, "-m", "pipeline", "merge", "--base", str(base), "--adapter", str(tmp_path / "x")]
    done = subprocess.run([*command, "--out", str(tmp_path / "m")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "adapter_config.json: missing" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["stage", "command"])
def test_a_merge_of_a_base_not_quantized_imports_no_bitsandbytes(fitted, tmp_path, entry):
    """PEFT imports bitsandbytes wherever it is installed, and bitsandbytes torch's compiler: about 2 s of the
    stage's CPU and 85 MB for a base it does not quantize (measured on the tiny experiment's merge); the same for
    `python -m pipeline merge` (3 s of bench.merge's 9.7), which reads the adapter's variant instead of the params."""
    base, adapter = fitted
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(config.compose(REPO / "conf", ["tracking.uri="])))
    (tmp_path / "figures.json").write_text("{}")
    module = {"stage": "stages.merge", "command": "pipeline"}[entry]
    probe = (
        "import json, runpy, sys\n"
        f"sys.argv[0] = {module.replace('.', '/') + '.py'!r}\n"
        f"runpy.run_module({module!r}, run_name='__main__')\n"
        "seen = ('peft', 'bitsandbytes', 'scipy', 'torch._inductor.compile_fx')\n"
        "print(json.dumps([m for m in seen if sys.modules.get(m)]))\n"
    )
    arguments = {"base": base, "adapter": adapter, "out": "merged"}
    if entry == "stage":
        arguments |= {"params": "params.yaml", "metrics": "merge.json", "dataset-metrics": "figures.json"}
        arguments |= {"train-metrics": "figures.json", "run-id-file": "run.json"}
    words = [
        *(["merge"] if entry == "command" else []),
        *(x for k, v in arguments.items() for x in (f"--{k}", str(tmp_path / v))),
    ]
    done = subprocess.run([sys.executable, "-c", probe, *words], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["peft"], "PEFT verified the merge, nothing else was imported"
    if entry == "stage":
        merged = read_json(tmp_path / "merge.json")
        assert merged["max_abs_logit_diff"] <= merged["limit_abs"]
    assert (tmp_path / "merged" / "config.json").is_file()


def test_bf16_output_passes_its_own_tolerance(fitted, tmp_path):
    base, adapter = fitted
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged", dtype="bf16")
    assert {t.dtype for t in load_file(tmp_path / "merged" / "model.safetensors").values()} == {torch.bfloat16}
    assert 0 < report["verification"]["max_abs_logit_diff"] <= report["verification"]["limit_abs"]


def test_streamed_verification_equals_whole_models(fitted, tmp_path):
    """The proof reads each model block by block from its files: it gives exactly the logits of base + adapter and
    of the merged model loaded whole."""
    from transformers import AutoModelForCausalLM

    from pipeline.merge.verify import streamed_logits

    base, adapter = fitted
    merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged", verify=False)
    ids = torch.randint(0, ROWS, (2, 40), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(
        streamed_logits(base, ids, rows=ROWS, adapter_dir=adapter), _peft_logits(base, adapter, ids), rtol=0, atol=0
    )
    with torch.inference_mode():
        whole = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(streamed_logits(tmp_path / "merged", ids, rows=ROWS), whole, rtol=0, atol=0)


PEAK = """
import sys, torch
from pathlib import Path
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from pipeline.merge.verify import streamed_logits
with init_empty_weights():
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))  # imports done, nothing held
from tests.helpers.peak_memory import reset_peak, status_mb
before = reset_peak()
streamed_logits(Path(sys.argv[1]), torch.zeros(1, 8, dtype=torch.long), rows=int(sys.argv[2]))
print(int((status_mb("VmHWM") - before) * 2**20))
"""


@pytest.mark.slow
def test_streamed_verification_holds_one_block_at_a_time(tmp_path):
    """On a model of 12 layers of 16 MB each (fp32), the proof's memory grows by about one layer, not the model.
    glibc's mmap threshold is fixed at 1 MB here, as the ranks fix it: left dynamic, it rises as freed blocks come
    back, up to 32 MB, and glibc then keeps this model's 4 MB tensors in its heap once freed (the first call grew by
    71 to 354 MB that way, the same call on a warm heap by 0-13 MB; 45 MB with the fixed threshold). A 7-70B layer's
    tensors are above 32 MB: always mapped and handed back when freed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=1024, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=8, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "model")
    size = sum(p.numel() * 4 for p in model.parameters())
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(tmp_path / "model"), "512"], cwd=REPO, capture_output=True, text=True,
        env=os.environ | {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    grown = int(done.stdout.split()[-1])
    assert grown < 3 * layer < size / 3, (grown, layer, size)


def _dora_adapter(root: Path, base: Path) -> Path:
    """A trained-looking DoRA adapter: random A and B, magnitudes moved off their initial row norms."""
    adapter = _adapter(root, base, None, rows=49152, use_dora=True)
    tensors = load_file(adapter / "adapter_model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for key, value in tensors.items():
        if key.endswith("lora_magnitude_vector"):
            tensors[key] = value * (1 + 0.2 * torch.rand(value.shape, generator=generator))
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    return adapter


def test_dora_merges_with_its_row_norm(tmp_path, tiny_base_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _base(tmp_path, tiny_base_dir, tied=True)
    adapter = _dora_adapter(tmp_path, base)
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    assert report["variant"] == "DoRA (base precision unknown)" and report["lora_layers"] == 14
    ids = torch.randint(0, 49152, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert report["verification"]["max_abs_logit_diff"] < TOLERANCES["fp32"][0]


@pytest.mark.slow
def test_dora_merged_without_its_norm_fails_the_verification(tmp_path, tiny_base_dir, monkeypatch):
    """m x (W + scale B A), the row norm forgotten: the merge's own verification refuses it and writes nothing."""
    import pipeline.merge.fold

    def no_norm(weight: torch.Tensor, delta) -> torch.Tensor:
        rows = weight.float() + (delta.b.float() @ delta.a.float()) * delta.scale
        return delta.magnitude.float().unsqueeze(1) * rows

    base = _base(tmp_path, tiny_base_dir, tied=True)
    adapter = _dora_adapter(tmp_path, base)
    monkeypatch.setattr(pipeline.merge.fold, "merged_weight", no_norm)
    with pytest.raises(ValueError, match="merge verification failed"):
        merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
