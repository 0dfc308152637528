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
