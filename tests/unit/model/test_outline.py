"""pipeline/model/outline.py: prepare_base's import writes the outline the train stage's checks read without
transformers' model code; a base without one, or whose config changed since, is outlined from its architecture."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pipeline.model import outline
from pipeline.model.base_import import import_base


@pytest.mark.slow
def test_the_imported_base_carries_its_outline_read_without_model_code(tiny_base_dir, smol_tokenizer_dir, tmp_path):
    base = tmp_path / "base"
    import_base(
        source=tiny_base_dir, out_dir=base, tokenizer_dir=smol_tokenizer_dir, dtype="fp32", max_shard_size="1GB"
    )
    assert (base / outline.FILE).is_file()
    expected = outline.of_model(outline.meta_model(base))
    assert outline.read(base) == expected
    assert expected.head == "lm_head" and "lm_head" in expected.linear and len(expected.linear) == 15
    probe = f"""
import sys
from pathlib import Path
from pipeline.model import outline
layers = outline.read(Path({str(base)!r}))
print(len(layers.linear), any(name.startswith("transformers.models") for name in sys.modules))
"""
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert seen == ["15", "False"]


def test_a_base_without_an_outline_or_changed_since_is_outlined_from_its_architecture(
    tiny_base_dir, smol_tokenizer_dir, tmp_path
):
    other = tmp_path / "other"  # written by other means than prepare_base
    shutil.copytree(tiny_base_dir, other, ignore=shutil.ignore_patterns(outline.FILE))
    assert outline.read(other) == outline.of_model(outline.meta_model(other))
    base = tmp_path / "base"
    import_base(source=other, out_dir=base, tokenizer_dir=smol_tokenizer_dir, dtype="fp32", max_shard_size="1GB")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").unlink()  # a link to the source's file: replaced, not written through
    (base / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    layers = outline.read(base)
    assert len(layers.linear) == 8 and not any(".1." in name for name in layers.modules)
    (base / outline.FILE).write_text("{not json")
    assert outline.read(base) == layers


def test_a_model_folder_mapped_to_its_own_code_is_refused(tmp_path, tiny_base_dir):
    """auto_map to a Python file for a type transformers does not implement: refused with a message (we never pass
    trust_remote_code); a type it implements keeps its auto_map ignored."""
    import shutil

    import pytest

    from pipeline.model.remote_code import custom_code

    folder = tmp_path / "custom"
    shutil.copytree(tiny_base_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "modeling_custom.py").write_text("raise SystemExit('executed')\n")
    mapped = {**config, "auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}
    (folder / "config.json").write_text(json.dumps(mapped))
    assert custom_code(folder) is None, "a llama: transformers' own code, the auto_map ignored"
    (folder / "config.json").write_text(json.dumps({**mapped, "model_type": "custom_llm"}))
    message = custom_code(folder)
    assert "maps the model to code of its own (modeling_custom.CustomForCausalLM)" in message
    assert "never runs (no trust_remote_code)" in message and "'custom_llm'" in message
    with pytest.raises(ValueError, match="code of its own"):
        import_base(source=folder, out_dir=tmp_path / "out", tokenizer_dir=tmp_path / "tok", dtype="auto",
                    max_shard_size="1GB")  # fmt: skip
    assert not (tmp_path / "out").exists()
