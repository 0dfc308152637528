"""The chat command driven through a pseudo-terminal (streamed replies, /reset, /exit), and the scriptable generate
command giving the same reply."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

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
