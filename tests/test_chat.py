"""The chat command driven through a pseudo-terminal (streamed replies, /reset, /exit), the scriptable generate
command, the history as the chat template renders it, seeded sampling."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from pipeline import chat
from pipeline.tokenizer import load_tokenizer
from tests.conftest import REPO

ARGS = ["--max-new-tokens", "6", "--temperature", "0", "--precision", "fp32"]


def read_until(fd: int, marker: str, timeout: float = 120.0) -> str:
    """What the terminal shows until `marker` (newlines without the terminal's carriage returns)."""
    seen, deadline = b"", time.monotonic() + timeout
    while marker.encode() not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(
                f"no {marker!r} within {timeout} s; the terminal showed {seen.decode(errors='replace')!r}"
            )
        seen += os.read(fd, 4096)
    return seen.decode(errors="replace").replace("\r\n", "\n")


@pytest.mark.integration
def test_chat_in_a_terminal(tiny_base_dir):
    main, child = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "chat", "--model", str(tiny_base_dir), *ARGS],
        stdin=child, stdout=child, stderr=subprocess.DEVNULL, cwd=REPO, close_fds=True,
    )  # fmt: skip
    os.close(child)
    try:
        assert "/reset clears the history" in read_until(main, ">>> ")
        os.write(main, "你好，介绍一下自己\n".encode())
        first = read_until(main, ">>> ").split("你好，介绍一下自己\n", 1)[1].removesuffix(">>> ")
        os.write(main, b"/reset\n")
        assert "(history cleared)" in read_until(main, ">>> ")
        os.write(main, "你好，介绍一下自己\n".encode())
        again = read_until(main, ">>> ").split("你好，介绍一下自己\n", 1)[1].removesuffix(">>> ")
        assert again == first, "after /reset the same question sees the same (empty) history"
        os.write(main, b"/exit\n")
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        os.close(main)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "generate", "--model", str(tiny_base_dir), "--prompt", "你好，介绍一下自己",
         *ARGS], cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout == first, "generate streams the reply chat streamed for the same first message"


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
