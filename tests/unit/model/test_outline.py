"""pipeline/model/outline.py: prepare_base's import writes the outline the train stage's checks read without
transformers' model code; a base without one, or whose config changed since, is outlined from its architecture."""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline.model import outline
from pipeline.model.base_import import import_base


def test_the_imported_base_carries_its_outline_read_without_model_code(tiny_base_dir, tmp_path):
    base = tmp_path / "base"
    import_base(source=tiny_base_dir, out_dir=base, tokenizer_dir=tmp_path / "tok", dtype="fp32", max_shard_size="1GB")
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


def test_a_base_without_an_outline_or_changed_since_is_outlined_from_its_architecture(tiny_base_dir, tmp_path):
    assert not (tiny_base_dir / outline.FILE).exists()  # written by other means than prepare_base
    assert outline.read(tiny_base_dir) == outline.of_model(outline.meta_model(tiny_base_dir))
    base = tmp_path / "base"
    import_base(source=tiny_base_dir, out_dir=base, tokenizer_dir=tmp_path / "tok", dtype="fp32", max_shard_size="1GB")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").unlink()  # a link to the source's file: replaced, not written through
    (base / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    layers = outline.read(base)
    assert len(layers.linear) == 8 and not any(".1." in name for name in layers.modules)
    (base / outline.FILE).write_text("{not json")
    assert outline.read(base) == layers
