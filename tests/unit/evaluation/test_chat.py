"""The chat command's pieces in-process: the history as the chat template renders it, seeded sampling (the command
itself, through a pseudo-terminal, is tests/integration/test_chat.py)."""

from __future__ import annotations

import io

import pytest

from pipeline.data.tokenizer import load_tokenizer
from pipeline.evaluation import chat


def test_history_is_rendered_with_the_chat_template(smol_tokenizer_dir):
    tokenizer = load_tokenizer(smol_tokenizer_dir)
    conversation = chat.Conversation("Be brief.")
    conversation.messages += [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
    ]
    text = tokenizer.decode(conversation.prompt_ids(tokenizer)[0])
    assert text.index("Be brief.") < text.index("first question") < text.index("first answer")
    assert text.index("first answer") < text.index("second question")
    assert text.endswith("<|im_start|>assistant\n")
    conversation.reset()
    assert conversation.messages == [{"role": "system", "content": "Be brief."}]


def test_sampling_is_seeded_and_checked(tiny_base_dir):
    model, tokenizer = chat.load(tiny_base_dir, None, "fp32")

    def reply(seed: int) -> str:
        out = io.StringIO()
        sampling = chat.Sampling(max_new_tokens=8, temperature=1.0, seed=seed)
        chat.generate(model, tokenizer, "Tell me a story.", sampling, raw=False, out=out)
        return out.getvalue()

    assert reply(3) == reply(3) != reply(4)
    with pytest.raises(ValueError, match="--temperature: expected 0"):
        chat.Sampling(max_new_tokens=8, temperature=-1.0, seed=0)
    with pytest.raises(FileNotFoundError, match="--adapter: .*nowhere is not an adapter folder"):
        chat.load(tiny_base_dir, tiny_base_dir / "nowhere", "fp32")
