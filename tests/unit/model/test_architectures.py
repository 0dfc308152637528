"""Every architecture of the matrix loads as transformers loads it: the whole path (ZeRO 0-2) reads each parameter
from the files by transformers' own checkpoint conversions, equal to `AutoModelForCausalLM.from_pretrained` tensor
for tensor (renamed heads, fused MoE experts, tied embeddings); the partitioned path is proven by 2 ranks in
tests/integration/test_architectures.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.architectures import MATRIX


@pytest.mark.parametrize("name", list(MATRIX))
def test_the_whole_base_is_transformers_own(name, architecture_dirs):
    from transformers import AutoModelForCausalLM

    from pipeline.model.base_weights import load_whole

    folder = architecture_dirs[name]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = reference.config.vocab_size
    ours = load_whole(base_dir=folder, dtype=torch.float32, vocab_rows=rows + 3, init="mean", seed=0)
    expected, got = reference.state_dict(), ours.state_dict()
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        if value.shape[0] == rows and got[key].shape[0] == rows + 3:  # the grown embedding: its mean rows after
            assert torch.equal(got[key][:rows], value), key
            assert torch.allclose(got[key][rows:], value.double().mean(0).float().expand(3, -1)), key
        else:
            assert torch.equal(got[key], value), key


def test_a_tensor_the_files_lack_is_named(architecture_dirs, tmp_path):
    """A folder whose files lack a tensor the architecture needs: refused, naming the folder and the parameter."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.model.base_weights import load_whole

    folder = tmp_path / "gpt_neox"
    shutil.copytree(architecture_dirs["gpt_neox"], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["embed_out.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"gpt_neox: no tensor for \['lm_head.weight'\]"):
        load_whole(base_dir=folder, dtype=torch.float32, vocab_rows=49152, init="mean", seed=0)


def _model_errors(folder, *overrides: str) -> list[str]:
    from pipeline.check import model_errors
    from pipeline.core import config
    from tests.conftest import REPO

    chosen = ["experiment=tiny", f"model.path={folder}", "launcher.accelerator=cpu", *overrides]
    return model_errors(config.Config(**config.compose(REPO / "conf", chosen)), folder)


def test_check_passes_every_architecture_and_names_what_it_cannot_train(architecture_dirs, tmp_path):
    """`check` (before any stage runs): every architecture of the matrix passes; an encoder (DistilBERT, written
    by transformers' own classes) is refused naming model.path; SDPA asked for a model without it (Gemma 2) is refused
    naming train.attention."""
    from transformers import DistilBertConfig, DistilBertModel

    for name, folder in architecture_dirs.items():
        assert _model_errors(folder) == [], name
    encoder = tmp_path / "distilbert"
    shape = {"dim": 32, "n_layers": 1, "n_heads": 2, "hidden_dim": 64}
    DistilBertModel(DistilBertConfig(**shape)).save_pretrained(str(encoder))
    (errors,) = _model_errors(encoder)
    assert errors.startswith(f"model.path: {encoder / 'config.json'} is a 'distilbert' model (DistilBertModel)")
    assert "cannot build as a causal language model" in errors
    assert _model_errors(architecture_dirs["gemma2"], "train.attention=sdpa") == [
        "train.attention: the model does not support sdpa (transformers' flags for its class); expected auto or one "
        "of eager, flash_attention_2"
    ]
    (refused,) = _model_errors(architecture_dirs["gpt_neox"], "export.gguf=true")
    assert refused == (
        "export.gguf: true, but the base's model_type 'gpt_neox' (GPTNeoXForCausalLM): the GGUF exporter knows "
        "llama, mistral, qwen2, qwen3; expected export.gguf=false for it"
    )
    (window,) = _model_errors(architecture_dirs["mistral"], "export.gguf=true")
    assert window.startswith("export.gguf: true, but the base's sliding_window 16: GGUF's llama attends to the whole")
    assert _model_errors(architecture_dirs["llama"], "export.gguf=true") == []
    assert _model_errors(architecture_dirs["qwen2"], "export.gguf=true") == []


def test_a_mistral_folder_s_tokenizer_loads_whatever_mistral_common_lacks(
    architecture_dirs, smol_tokenizer_dir, tmp_path
):
    """transformers probes mistral-common for every Mistral-family config, importing its optional dependencies
    (tiktoken, absent here): a folder with tokenizer.json loads all the same, the tokenizer it holds; one with only
    tekken.json is refused with the folder named, no traceback."""
    import json

    from pipeline.data.tokenizer import load_tokenizer

    text = "Mistral 7B, 32k context: 你好"
    loaded = load_tokenizer(architecture_dirs["mistral"])
    assert loaded(text).input_ids == load_tokenizer(smol_tokenizer_dir)(text).input_ids
    tekken = tmp_path / "tekken_only"
    tekken.mkdir()
    (tekken / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    (tekken / "tekken.json").write_text("{}")
    with pytest.raises(ValueError, match=str(tekken)):
        load_tokenizer(tekken)
