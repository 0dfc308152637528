"""Interoperability of merge and evaluate: bases and adapters as other tools save them (no tokenizer in the base,
PyTorch-pickle bases in bf16, `adapter_model.bin` without PEFT's name prefix, GPT-2's Conv1D layers, Qwen2 with
biases and tied embeddings, Mistral, Phi-3's fused qkv_proj/gate_up_proj) merge into models whose logits equal PEFT's
unmerged base + adapter, and evaluate reads them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.merge.fold import REPORT, merge
from tests.conftest import REPO

VOCAB = 128


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(config), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    return MistralForCausalLM(config), ["q_proj", "v_proj", "down_proj"]


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=0)
    return GPT2LMHeadModel(config), ["c_attn", "c_proj", "c_fc"]  # Conv1D: PEFT sets fan_in_fan_out


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    return Phi3ForCausalLM(config), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


ARCHITECTURES = {"qwen2": _qwen2, "mistral": _mistral, "gpt2": _gpt2, "phi3": _phi3}


def _base_and_adapter(root: Path, build, modules_to_save: list[str] | None) -> tuple[Path, Path]:
    """A random base saved by save_pretrained (no tokenizer) and a trained-looking PEFT adapter of it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model, targets = build()
    model.save_pretrained(str(root / "base"))
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, modules_to_save=modules_to_save, init_lora_weights=False
    )
    peft = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    peft.save_pretrained(str(root / "adapter"))
    return root / "base", root / "adapter"


def _peft_logits(base: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.inference_mode():
        return PeftModel.from_pretrained(model, str(adapter)).eval()(input_ids=ids).logits


def _merged_logits(merged: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        return AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_architectures_merge_to_peft_logits(tmp_path, arch):
    tied = arch in ("qwen2", "gpt2")
    base, adapter = _base_and_adapter(tmp_path, ARCHITECTURES[arch], None if tied else ["lm_head"])
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    torch.testing.assert_close(_merged_logits(tmp_path / "merged", IDS), _peft_logits(base, adapter, IDS))
    assert report["verification"]["max_abs_logit_diff"] < 1e-4 and report["tied"] is tied
    assert report["tokenizer_size"] is None and report["tokenizer"].startswith("not checked: no tokenizer")
    assert report["lora_layers"] == sum(1 for k in load_file(adapter / "adapter_model.safetensors") if "lora_A" in k)
    assert report["notes"] == []
    if arch == "gpt2":
        assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    _assert_evaluate_scores_the_forward_logits(tmp_path / "merged")


def _assert_evaluate_scores_the_forward_logits(model_dir: Path) -> None:
    """evaluate's scoring (decoder, then the head in chunks) gives the NLL of the model's own forward."""
    from pipeline.evaluation.likelihood import load_model, token_nll

    model = load_model(model_dir, None, precision="fp32")
    with torch.inference_mode():
        expected = torch.nn.functional.cross_entropy(model(input_ids=IDS).logits.transpose(1, 2), IDS, reduction="none")
        torch.testing.assert_close(token_nll(model, IDS, IDS, chunk=5), expected.reshape(-1))


def test_conv1d_adapter_whose_config_says_not_fan_in_fan_out(tmp_path):
    """A config written by another tool with fan_in_fan_out false on GPT-2: the layer shapes decide, as in PEFT."""
    base, adapter = _base_and_adapter(tmp_path, _gpt2, None)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(target_modules=["c_attn", "c_fc"], fan_in_fan_out=False)  # non-square layers only
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".c_proj." not in k}, str(adapter / "adapter_model.safetensors"))
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    assert "fan_in_fan_out is False in adapter_config.json" in report["notes"][0]
    torch.testing.assert_close(_merged_logits(tmp_path / "merged", IDS), _peft_logits(base, adapter, IDS))


def _as_other_tools_save(base: Path, adapter: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The base as pytorch_model.bin in bf16 (older transformers, DeepSpeed-Chat), the adapter as adapter_model.bin
    with names lacking PEFT's `base_model.model.` prefix."""
    from transformers import AutoModelForCausalLM

    old_base, old_adapter = tmp_path / "bin_base", tmp_path / "bin_adapter"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model.config.save_pretrained(str(old_base))
    torch.save(model.state_dict(), old_base / "pytorch_model.bin")
    old_adapter.mkdir()
    shutil.copy(adapter / "adapter_config.json", old_adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    torch.save({k.removeprefix("base_model.model."): v for k, v in tensors.items()}, old_adapter / "adapter_model.bin")
    return old_base, old_adapter


def test_pickled_bf16_base_and_unprefixed_bin_adapter(tmp_path):
    from pipeline.evaluation.likelihood import load_model

    base, adapter = _base_and_adapter(tmp_path, _mistral, ["lm_head"])
    old_base, old_adapter = _as_other_tools_save(base, adapter, tmp_path)
    report = merge(base_dir=old_base, adapter_dir=old_adapter, out_dir=tmp_path / "merged", dtype="bf16")
    assert report["verification"]["max_abs_logit_diff"] <= report["verification"]["limit_abs"]
    merge(base_dir=old_base, adapter_dir=old_adapter, out_dir=tmp_path / "merged32")
    expected = _peft_logits(old_base, adapter, IDS)  # PEFT's own loader on the same values
    torch.testing.assert_close(_merged_logits(tmp_path / "merged32", IDS), expected)
    with torch.inference_mode():
        got = load_model(old_base, old_adapter, precision="fp32")(input_ids=IDS).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_pickled_base_holding_objects_is_refused_unread(tmp_path):
    base, adapter = _base_and_adapter(tmp_path, _mistral, None)
    old_base, _ = _as_other_tools_save(base, adapter, tmp_path)
    state = torch.load(old_base / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "trainer": Path("anything")}, old_base / "pytorch_model.bin")  # an object, not a tensor
    with pytest.raises(ValueError, match="pytorch_model.bin: refused: GLOBAL pathlib.PosixPath"):
        merge(base_dir=old_base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_base_without_tokenizer_merges_and_a_given_tokenizer_is_checked(tmp_path, tiny_base_dir):
    """The issue's case: a base folder as model.save_pretrained() writes it (no tokenizer files)."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    _, adapter = _base_and_adapter(tmp_path / "adapter_of", lambda: _reload(base), None)
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    assert report["tokenizer_size"] is None and "verification" in report
    assert not (tmp_path / "merged" / "tokenizer.json").exists()
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged2", tokenizer_dir=tiny_base_dir)
    assert report["tokenizer_size"] == 49152 and (tmp_path / "merged2" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "merged2" / REPORT).read_text())["tokenizer"] == str(tiny_base_dir)


def _reload(base: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base), ["q_proj", "v_proj"]


@pytest.mark.slow
def test_evaluate_cli_needs_a_tokenizer_only_when_none_is_there(tmp_path, tiny_base_dir, peoples_daily):
    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    _, adapter = _base_and_adapter(tmp_path / "adapter_of", lambda: _reload(base), None)
    (tmp_path / "text.txt").write_text("\n".join(peoples_daily[:5]) + "\n", encoding="utf-8")
    command = [sys.executable, "-m", "pipeline", "evaluate", "--model", str(base), "--adapter", str(adapter)]
    command += ["--file", str(tmp_path / "text.txt"), "--context", "32", "--stride", "32", "--precision", "fp32"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "no tokenizer files; pass --tokenizer FOLDER" in done.stderr
    done = subprocess.run([*command, "--tokenizer", str(tiny_base_dir)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["tokens"] > 0


def test_adapter_with_extra_modules_to_save_copies(tmp_path):
    """A state dict dumped with PEFT's internal names beside the saved ones (`lm_head.modules_to_save.default`,
    `lm_head.original_module`): merge and evaluate use the trained copy."""
    from pipeline.evaluation.likelihood import load_model

    base, adapter = _base_and_adapter(tmp_path, _mistral, ["lm_head"])
    expected = _peft_logits(base, adapter, IDS)
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.modules_to_save.default.weight"] = tensors["base_model.model.lm_head.weight"] + 0
    tensors["base_model.model.lm_head.original_module.weight"] = load_file(base / "model.safetensors")["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(adapter / "adapter_model.safetensors"))
    merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    torch.testing.assert_close(_merged_logits(tmp_path / "merged", IDS), expected)
    with torch.inference_mode():
        torch.testing.assert_close(load_model(base, adapter, precision="fp32")(input_ids=IDS).logits, expected)


def test_sharded_pickled_base(tmp_path):
    base, adapter = _base_and_adapter(tmp_path, _phi3, None)
    state = load_file(base / "model.safetensors")
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, base / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (base / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (base / "model.safetensors").unlink()
    report = merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    assert report["verification"]["max_abs_logit_diff"] < 1e-4
    torch.testing.assert_close(_merged_logits(tmp_path / "merged", IDS), _peft_logits(base, adapter, IDS))


def test_adapter_of_another_architecture_is_refused_with_its_file_named(tmp_path):
    _, adapter = _base_and_adapter(tmp_path / "gpt2", _gpt2, None)
    base, _ = _base_and_adapter(tmp_path / "mistral", _mistral, None)
    with pytest.raises(ValueError) as err:
        merge(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    assert str(err.value).startswith(f"{adapter / 'adapter_model.safetensors'} on the base {base}: the adapter targets")
    assert "which the base has no weight for (transformer.h.0.attn.c_attn.weight)" in str(err.value)
    assert not (tmp_path / "merged").exists()
