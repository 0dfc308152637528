"""Vocabulary extension keeps every base id, shortens Chinese text, round-trips, for both tokenizer kinds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.data.tokenizer import (
    extend_byte_level,
    load_tokenizer,
    round_up,
    tokenizer_kind,
    tokens_per_char,
    write_extended,
)

REPO = Path(__file__).resolve().parents[3]
ENGLISH = ["The capital of France is Paris.", "Hello world, this is a test of 42 tokens!"]


@pytest.fixture(scope="module")
def corpus(peoples_daily) -> tuple[list[str], list[str]]:
    """Train on the first 4,000 paragraphs, hold out the last 300 (another part of the month)."""
    return peoples_daily[:4000], peoples_daily[-300:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("base_fixture", "kind"), [("smol_tokenizer_dir", "byte_level_bpe"), ("sp_tokenizer_dir", "sentencepiece")]
)
def test_extension_keeps_ids_and_shortens_chinese(request, tmp_path, corpus, base_fixture, kind):
    base_dir = request.getfixturevalue(base_fixture)
    assert tokenizer_kind(base_dir) == kind
    train, heldout = corpus
    out = tmp_path / "extended"
    added = write_extended(base_dir, out, train, vocab_size=6000, model_type="bpe", character_coverage=0.9995)
    base, extended = load_tokenizer(base_dir), load_tokenizer(out)

    assert added > 500
    assert len(extended) == len(base) + added
    base_vocab, new_vocab = base.get_vocab(), extended.get_vocab()
    assert all(new_vocab[piece] == index for piece, index in base_vocab.items()), "a base token changed its id"
    assert sorted(set(new_vocab.values()) - set(base_vocab.values())) == list(range(len(base), len(extended)))

    before, after = tokens_per_char(base, heldout), tokens_per_char(extended, heldout)
    assert after < 0.8 * before, (before, after)
    for text in heldout + ENGLISH:
        assert extended.decode(extended(text, add_special_tokens=False).input_ids) == text
    for text in ENGLISH:  # new merges rank after every base merge: English tokenizes as before
        assert extended(text).input_ids == base(text).input_ids
    extended.save_pretrained(str(tmp_path / "resaved"))  # what transformers writes for what it read
    for path in (tmp_path / "resaved").iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), f"{path.name} is not as transformers writes it"


def test_a_byte_level_extension_imports_no_torch(smol_tokenizer_dir, tmp_path, corpus):
    (tmp_path / "texts.json").write_text(json.dumps(corpus[0][:200]), encoding="utf-8")
    code = (
        "import json, sys; from pathlib import Path; from pipeline.data.tokenizer import write_extended; "
        f"texts = json.loads(Path({str(tmp_path / 'texts.json')!r}).read_text()); "
        f"added = write_extended(Path({str(smol_tokenizer_dir)!r}), Path({str(tmp_path / 'out')!r}), texts, "
        "vocab_size=1000, model_type='bpe', character_coverage=0.9995); "
        "assert added > 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_unigram_cannot_extend_byte_level_bpe(smol_tokenizer_dir, tmp_path, corpus):
    with pytest.raises(ValueError, match="tokenizer.model_type: a byte-level BPE base can only be extended"):
        write_extended(
            smol_tokenizer_dir,
            tmp_path / "out",
            corpus[0][:200],
            vocab_size=1000,
            model_type="unigram",
            character_coverage=0.9995,
        )


def test_sentencepiece_model_types_must_match(sp_tokenizer_dir, tmp_path, corpus):
    with pytest.raises(ValueError, match="tokenizer.model_type: the base SentencePiece model is bpe"):
        write_extended(
            sp_tokenizer_dir,
            tmp_path / "out",
            corpus[0][:500],
            vocab_size=1000,
            model_type="unigram",
            character_coverage=0.9995,
        )


def test_byte_level_merges_skip_known_and_unreachable_tokens():
    base = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}, "added_tokens": []}
    extended, added = extend_byte_level(base, [["a", "b"], ["ab", "a"], ["x", "a"], ["aba", "b"]])
    assert added == 2
    assert extended["model"]["vocab"] == {"a": 0, "b": 1, "ab": 2, "aba": 3, "abab": 4}
    assert extended["model"]["merges"] == [["a", "b"], ["ab", "a"], ["aba", "b"]]
    assert base["model"]["vocab"] == {"a": 0, "b": 1, "ab": 2}, "the base mapping must not be mutated"


def test_sentencepiece_vocab_below_alphabet_is_named(sp_tokenizer_dir, tmp_path, corpus):
    with pytest.raises(
        ValueError, match="tokenizer.vocab_size / tokenizer.character_coverage: .*smaller than required"
    ):
        write_extended(
            sp_tokenizer_dir, tmp_path / "out", corpus[0], vocab_size=1000, model_type="bpe", character_coverage=0.9995
        )
    assert not (tmp_path / "out" / "tokenizer.model").exists()


def test_empty_tokenizer_folder_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}, "added_tokens": []})
    )
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"{tmp_path}: (tokenizer loads empty|cannot load a tokenizer)"):
        load_tokenizer(tmp_path)


def test_missing_tokenizer_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: tokenizer folder not found"):
        load_tokenizer(tmp_path / "nowhere")


def test_round_up():
    assert [round_up(n, 64) for n in (1, 64, 65, 56693)] == [64, 64, 128, 56704]


@pytest.mark.parametrize("folder", ["smol_tokenizer_dir", "sp_tokenizer_dir"])
def test_light_tokenizer_encodes_data_as_the_hf_tokenizer(request, folder, peoples_daily):
    """The Rust-only tokenizer the cache_dataset workers use gives the documents' stream and the SFT examples
    (alpaca and chat templates) the HF tokenizer gives, or declines the folder."""
    from pipeline.data.encoding import tokenize_documents
    from pipeline.data.tokenizer import light_tokenizer, load_tokenizer
    from tests.helpers.datasets import build_sft

    path = request.getfixturevalue(folder)
    light, full = light_tokenizer(path), load_tokenizer(path)
    if light is None:
        assert folder == "sp_tokenizer_dir", "our own tokenizer folders are read light"
        return
    assert (light.eos_token_id, light.pad_token_id, light.bos_token_id) == (
        full.eos_token_id, full.pad_token_id, full.bos_token_id
    )  # fmt: skip
    documents = [*peoples_daily[:200], "Mixed English 文本 with digits 2026."]
    ours, theirs = tokenize_documents(light, documents), tokenize_documents(full, documents)
    assert (ours[0] == theirs[0]).all() and (ours[1] == theirs[1]).all()
    rows = [{"instruction": q, "input": "x" * (i % 2), "output": a} for i, (q, a) in enumerate(zip(
        peoples_daily[:40], peoples_daily[1:41], strict=True))]  # fmt: skip
    rows.append({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"},
                              {"role": "assistant", "content": "hello again", "tool_calls": None}]})  # fmt: skip
    for template in ("alpaca", "chat") if full.chat_template else ("alpaca",):
        usable = rows if template == "chat" else rows[:-1]
        assert build_sft(light, usable, template=template, max_seq_len=64) == build_sft(
            full, usable, template=template, max_seq_len=64
        )
