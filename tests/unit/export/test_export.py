"""GGUF export: read back by transformers, an f16 file computes exactly what the model computes with its weights
rounded to f16 and a q8_0 file stays within its tolerances; the rotary row order is what makes that so (without it
the check fails); the tokenizer and chat template travel inside; unknown architectures, types and tokenizers are
refused before anything is written; the stage writes only a note when off."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from pipeline.core import config
from pipeline.core.atomic import read_json
from pipeline.export import gguf as gguf_export
from pipeline.export.gguf import check_exportable, export_gguf
from pipeline.export.gguf_roundtrip import F16_MAX_ABS, roundtrip
from tests.conftest import REPO


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ["f16", "q8_0"])
def test_round_trip_through_transformers(tiny_base_dir, tmp_path, type_name, monkeypatch):
    import gguf

    out = tmp_path / "model.gguf"
    written = export_gguf(model_dir=tiny_base_dir, out=out, type_name=type_name)
    assert written["tensors"] == {type_name: 15, "f32": 5}, "2 layers x 7 matrices + tied embeddings; 5 norms"
    parsed = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, reader=gguf.GGUFReader, **k: parsed.append(1) or reader(*a, **k))
    figures = roundtrip(model_dir=tiny_base_dir, gguf_file=out, type_name=type_name)
    assert len(parsed) == 1, "the file's fields parsed once: for the tokenizer, the config and the tensors"
    monkeypatch.undo()
    assert figures["top1_agreement"] == 1.0
    if type_name == "f16":
        assert figures["max_abs_diff_vs_f16_rounded"] == 0.0, "f16 changes nothing but the rounding"
        assert figures["max_abs_logit_diff"] < 1e-3
    else:
        assert figures["max_abs_logit_diff"] < 0.05 * figures["max_abs_logit"]
    reader = gguf.GGUFReader(str(out))
    fields = {name: reader.fields[name] for name in ("general.architecture", "tokenizer.ggml.model")}
    assert [bytes(f.parts[f.data[0]]).decode() for f in fields.values()] == ["llama", "gpt2"]
    assert "tokenizer.chat_template" in reader.fields and "tokenizer.ggml.merges" in reader.fields


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "changes", "pre"),
    [
        ("qwen2", {}, "qwen2"),  # biases on q, k, v, an untied head, Qwen2's split (transformers loads it so)
        ("qwen3", {"head_dim": 128}, "gpt2"),  # QK norms (the head_dim every released Qwen3 has)
        ("mistral", {"sliding_window": None}, "gpt2"),  # llama.cpp writes Mistral as its llama architecture
    ],
)
def test_round_trip_of_other_architectures(name, changes, pre, smol_tokenizer_dir, tmp_path):
    """Architectures beyond LLaMA, written by transformers' own classes, read back by transformers' GGUF loader
    (the tensors' names by llama.cpp's map, the tokenizer's split by name): f16 computes exactly the f16-rounded
    source, the tokenizer encodes the probes alike."""
    import gguf

    from tests.helpers.architectures import write

    folder = write(name, tmp_path / "merged", smol_tokenizer_dir, changes=changes)  # the stage's folder: the file's
    # name (transformers' GGUF reader takes a file named "mistral..." for an architecture of that name, which it lacks)
    export_gguf(model_dir=folder, out=tmp_path / "m.gguf", type_name="f16")
    figures = roundtrip(model_dir=folder, gguf_file=tmp_path / "m.gguf", type_name="f16")
    assert figures["max_abs_diff_vs_f16_rounded"] == 0.0 and figures["top1_agreement"] == 1.0
    field = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[field.data[0]]).decode() == pre


def test_what_gguf_cannot_hold_is_refused_naming_it(smol_tokenizer_dir, tmp_path):
    """A sliding window (GGUF's architectures attend to the whole context) and a Qwen3 head size transformers'
    reader cannot rebuild: refused before anything is written."""
    from tests.helpers.architectures import write

    mistral = write("mistral", tmp_path / "mistral", smol_tokenizer_dir)
    with pytest.raises(ValueError, match=r"mistral/config.json: sliding_window 16: GGUF's llama attends to the whole"):
        export_gguf(model_dir=mistral, out=tmp_path / "a.gguf", type_name="f16")
    qwen3 = write("qwen3", tmp_path / "qwen3", smol_tokenizer_dir)
    with pytest.raises(ValueError, match=r"qwen3/config.json: head_dim 8: transformers' GGUF reader"):
        export_gguf(model_dir=qwen3, out=tmp_path / "a.gguf", type_name="f16")
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".*tmp*")) == []


@pytest.mark.slow
def test_without_the_rotary_row_order_the_proof_fails(tiny_base_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_export, "rope_rows_interleaved", lambda weight, heads: weight)
    export_gguf(model_dir=tiny_base_dir, out=tmp_path / "m.gguf", type_name="f16")
    with pytest.raises(ValueError, match=rf"differ from the f16-rounded source by .* \(limit {F16_MAX_ABS}\)"):
        roundtrip(model_dir=tiny_base_dir, gguf_file=tmp_path / "m.gguf", type_name="f16")


def test_bad_export_input_writes_nothing(tiny_base_dir, tmp_path):
    other = tmp_path / "gpt2"
    shutil.copytree(tiny_base_dir, other)
    raw = read_json(other / "config.json")
    (other / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(
        ValueError,
        match=r"model_type 'gpt2' \(LlamaForCausalLM\): the GGUF exporter knows llama, mistral, qwen2, qwen3; --type",
    ):
        export_gguf(model_dir=other, out=tmp_path / "a.gguf", type_name="q8_0")
    with pytest.raises(ValueError, match=r"--type: expected one of f16, q8_0, got 'q4_k'"):
        check_exportable(tiny_base_dir, "q4_k")
    (other / "config.json").write_text(json.dumps(raw))
    spec = read_json(other / "tokenizer.json")
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁"}
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(
        ValueError, match=r"its tokenizer splits text as .*Metaspace.*; the exporter writes byte-level BPE"
    ):
        export_gguf(model_dir=other, out=tmp_path / "a.gguf", type_name="f16")
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".*tmp*")) == []


def test_stage_off_writes_only_a_note(tmp_path):
    """As DVC runs it, in a process that cannot import torch (tests/helpers/without_torch.py): off, it loads nothing."""
    raw = config.compose(REPO / "conf", ["tracking.uri="])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "tests.helpers.without_torch", "stages.export", "--merged", tmp_path / "nowhere",
               "--out", tmp_path / "gguf", "--metrics", tmp_path / "export.json", "--params", tmp_path / "params.yaml",
               "--run-id-file", tmp_path / "run.json"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_json(tmp_path / "export.json") == {"exported": False}
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == ["README.md"]
    assert "dvc exp run -S export.gguf=true" in (tmp_path / "gguf" / "README.md").read_text()
