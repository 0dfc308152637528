"""Talk to a model: `python -m pipeline chat` (interactive: the tokenizer's chat template, tokens streamed to the
terminal as they come, the conversation kept as history, /reset and /exit) and `python -m pipeline generate` (one
prompt, for scripts)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from pipeline.data.tokenizer import template_refusals

COMMANDS = "/reset clears the history, /exit (or Ctrl-D) quits"


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How replies are drawn: greedy when temperature is 0, else sampled (seeded before each reply)."""

    max_new_tokens: int
    temperature: float
    seed: int

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens: expected a positive number, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature: expected 0 (greedy) or more, got {self.temperature}")


@dataclass
class Conversation:
    """The messages so far, rendered with the tokenizer's chat template (a plain transcript where it has none)."""

    system: str | None = None
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self, tokenizer) -> torch.Tensor:
        """Token ids of the history with the assistant's turn opened."""
        if tokenizer.chat_template:
            with template_refusals():
                return tokenizer.apply_chat_template(
                    self.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
                )["input_ids"]
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in self.messages]
        return tokenizer("\n".join([*lines, "Assistant:"]), return_tensors="pt").input_ids


def load(model_dir: Path, adapter_dir: Path | None, precision: str):
    """The model (with its adapter applied) and its tokenizer (the adapter's, else the model's)."""
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.evaluation.likelihood import check_vocabulary, load_model

    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"--model: {model_dir} is not a model folder")
    if adapter_dir is not None and not Path(adapter_dir).is_dir():
        raise FileNotFoundError(f"--adapter: {adapter_dir} is not an adapter folder")
    tokenizer = load_tokenizer(adapter_dir or model_dir)
    model = load_model(Path(model_dir), adapter_dir and Path(adapter_dir), precision=precision)
    check_vocabulary(tokenizer, model, str(adapter_dir or model_dir))
    return model, tokenizer


def stream_reply(model, tokenizer, ids: torch.Tensor, sampling: Sampling, out: TextIO) -> str:
    """Generate after `ids`, writing the text to `out` as it is decoded; returns it."""
    from transformers import TextStreamer

    pieces: list[str] = []

    class ToStream(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            pieces.append(text)
            out.write(text + ("\n" if stream_end else ""))
            out.flush()

    torch.manual_seed(sampling.seed)
    eos = tokenizer.eos_token_id
    device = next(model.parameters()).device
    with torch.inference_mode():
        model.generate(
            input_ids=ids.to(device),
            attention_mask=torch.ones_like(ids).to(device),
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sampling.temperature > 0,
            temperature=sampling.temperature if sampling.temperature > 0 else None,
            top_p=None,
            top_k=None,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
            streamer=ToStream(tokenizer, skip_prompt=True, skip_special_tokens=True),
        )
    return "".join(pieces)


def chat(model, tokenizer, sampling: Sampling, *, system: str | None = None, out: TextIO = sys.stdout) -> None:
    """The interactive loop on stdin (line editing and the prompt on stdout, through readline, in a terminal)."""
    import contextlib

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (without it, input() writes its prompt to stderr)
    conversation = Conversation(system)
    out.write(f"chat: {COMMANDS}\n")
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            out.write("\n")
            return
        if line == "/exit":
            return
        if line == "/reset":
            conversation.reset()
            out.write("(history cleared)\n")
            continue
        if line.startswith("/"):
            out.write(f"unknown command {line}: {COMMANDS}\n")
            continue
        if not line:
            continue
        conversation.messages.append({"role": "user", "content": line})
        answer = stream_reply(model, tokenizer, conversation.prompt_ids(tokenizer), sampling, out)
        conversation.messages.append({"role": "assistant", "content": answer.strip()})


def generate(model, tokenizer, prompt: str, sampling: Sampling, *, raw: bool, out: TextIO = sys.stdout) -> str:
    """One reply to `prompt` (a user turn of the chat template, or with `raw` the text as it is), streamed."""
    if raw or not tokenizer.chat_template:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    else:
        conversation = Conversation()
        conversation.messages.append({"role": "user", "content": prompt})
        ids = conversation.prompt_ids(tokenizer)
    return stream_reply(model, tokenizer, ids, sampling, out)
