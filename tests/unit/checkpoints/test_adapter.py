"""The PEFT adapter format from PEFT's side: engine names become the names save_pretrained writes, a config and
tensors that do not belong together are refused by name, the weights file is found in either format, and a ZeRO tag
of synthetic shards consolidates into an adapter whose tensors are the saved masters."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.checkpoints import adapter
from pipeline.checkpoints.consolidate import consolidate
from tests.helpers.zero_files import PARAMETERS, adapter_config, tensors, write_run

BASE = "base_model.model.model.layers.0"


def test_engine_names_become_peft_s_saved_names():
    assert (
        adapter.peft_key(f"{BASE}.self_attn.q_proj.lora_A.default.weight") == f"{BASE}.self_attn.q_proj.lora_A.weight"
    )
    assert (
        adapter.peft_key("base_model.model.lm_head.modules_to_save.default.weight") == "base_model.model.lm_head.weight"
    )
    dora = f"{BASE}.mlp.up_proj.lora_magnitude_vector.default.weight"
    assert adapter.peft_key(dora) == f"{BASE}.mlp.up_proj.lora_magnitude_vector"


def test_a_config_and_tensors_that_do_not_belong_together_are_refused():
    shapes = {f"{BASE}.self_attn.q_proj.lora_A.weight": (4, 16), f"{BASE}.self_attn.q_proj.lora_B.weight": (16, 4)}
    adapter.check_config(adapter_config(r=4), shapes, "here")
    with pytest.raises(ValueError, match=r"q_proj has rank 4, the adapter config says 8"):
        adapter.check_config(adapter_config(r=8), shapes, "here")
    with pytest.raises(ValueError, match=r"is not among target_modules \['o_proj'\]"):
        adapter.check_config({**adapter_config(), "target_modules": ["o_proj"]}, shapes, "here")
    with pytest.raises(ValueError, match="use_dora true but the DoRA magnitudes"):
        adapter.check_config({**adapter_config(), "use_dora": True}, shapes, "here")
    with pytest.raises(ValueError, match="is neither LoRA nor in modules_to_save"):
        adapter.check_config(adapter_config(), {**shapes, "base_model.model.lm_head.weight": (9, 16)}, "here")


def test_the_weights_file_and_config_are_read_as_peft_writes_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors: missing"):
        adapter.weights_file(tmp_path)
    torch.save({"x": torch.zeros(1)}, tmp_path / adapter.WEIGHTS_BIN)
    assert adapter.weights_file(tmp_path) == tmp_path / adapter.WEIGHTS_BIN
    save_file({"x": torch.zeros(1)}, str(tmp_path / adapter.WEIGHTS))
    assert adapter.weights_file(tmp_path) == tmp_path / adapter.WEIGHTS, "safetensors first"
    (tmp_path / adapter.CONFIG).write_text(json.dumps({**adapter_config(), "target_modules": ["v_proj", "q_proj"]}))
    assert adapter.read_config(tmp_path / adapter.CONFIG)["target_modules"] == ["q_proj", "v_proj"]
    (tmp_path / adapter.CONFIG).write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(ValueError, match="peft_type is 'PREFIX_TUNING', expected 'LORA'"):
        adapter.read_config(tmp_path / adapter.CONFIG)


def test_two_names_of_one_tensor_must_hold_the_same_values(tmp_path):
    name = f"{BASE}.self_attn.q_proj.lora_A"
    save_file({f"{name}.default.weight": torch.ones(2, 2), f"{name}.weight": torch.zeros(2, 2)}, str(tmp_path / "a.st"))
    (tmp_path / adapter.WEIGHTS).write_bytes((tmp_path / "a.st").read_bytes())
    with pytest.raises(ValueError, match=r"two different tensors are both .*q_proj.lora_A.weight"):
        adapter.read_tensors(tmp_path)


def test_variants_are_described_in_words():
    qdora = {"use_dora": True, "lr_ratio": 16.0, "quantization": "nf4", "compute_dtype": "bf16"}
    assert adapter.describe_variant(qdora) == "DoRA + LoRA+ x16 on an nf4 base (bf16 compute)"
    assert adapter.describe_variant({"use_dora": False, "quantization": None}) == "LoRA (base precision unknown)"


@pytest.mark.parametrize(("stage", "world"), [(2, 2), (3, 3)])
def test_a_synthetic_zero_run_consolidates_to_its_masters(tmp_path, stage, world):
    values = tensors(seed=stage)
    write_run(tmp_path / "checkpoints", values, stage=stage, world=world, steps=[3])
    (tmp_path / "checkpoints" / "step_000003" / adapter.CONFIG).write_text(json.dumps(adapter_config()))
    manifest = consolidate(checkpoint_dir=tmp_path / "checkpoints", output_dir=tmp_path / "adapter")
    written = load_file(str(tmp_path / "adapter" / adapter.WEIGHTS))
    assert written.keys() == {adapter.peft_key(name) for name in PARAMETERS}
    for name in PARAMETERS:
        torch.testing.assert_close(written[adapter.peft_key(name)], values[name]["fp32"], rtol=0, atol=0)
    assert (manifest["source"]["zero_stage"], manifest["source"]["world_size"]) == (stage, world)
