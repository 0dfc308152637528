"""Instruction rows rendered as training text: alpaca prompts, and conversations through the tokenizer's chat template
a turn at a time, as (text, trained) segments: prompts untrained, replies trained."""

from __future__ import annotations

from pipeline.data.tokenizer import template_refusals

ALPACA_TEMPLATES = {
    "with_input": (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    ),
    "no_input": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:\n"
    ),
}


def alpaca_prompt(row: dict, template: str) -> str:
    if template == "alpaca":
        template = ALPACA_TEMPLATES["with_input" if row.get("input") else "no_input"]
    return template.format(instruction=row["instruction"], input=row.get("input", ""))


def alpaca_messages(row: dict) -> list[dict]:
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def sft_segments(tokenizer, row: dict, template: str) -> list[tuple[str, bool]]:
    """One example as (text, trained) segments: prompts untrained, responses (with EOS) trained."""
    return rendered_segments(tokenizer, [row], template, None)[0][0]


def rendered_segments(
    tokenizer, rows: list[dict], template: str, max_chars: int | None
) -> list[tuple[list[tuple[str, bool]], bool]]:
    """Each row's (text, trained) segments, and whether they are all of them: a conversation stops after the turn
    whose rendering passes `max_chars` characters (None: no bound). Conversations are rendered with the chat
    template a turn at a time for all rows at once (two template calls per turn, not per row and turn): turn k's
    prompt is the conversation before its k-th reply with the generation prompt, the reply is what the template
    writes after it."""
    segments: list[list[tuple[str, bool]]] = [[] for _ in rows]
    chats: dict[int, list[dict]] = {}
    for k, row in enumerate(rows):
        if "messages" in row or template == "chat":
            chats[k] = row["messages"] if "messages" in row else alpaca_messages(row)
        else:
            segments[k] = [(alpaca_prompt(row, template), False), (row["output"] + (tokenizer.eos_token or ""), True)]
    replies = {k: [i for i, m in enumerate(chat) if m["role"] == "assistant"] for k, chat in chats.items()}
    done, cut = dict.fromkeys(chats, ""), set()
    for turn in range(max(map(len, replies.values()), default=0)):
        active = [k for k in chats if turn < len(replies[k]) and k not in cut]
        ends = [replies[k][turn] for k in active]
        prompts = _render(tokenizer, [chats[k][:end] for k, end in zip(active, ends, strict=True)], True)
        fulls = _render(tokenizer, [chats[k][: end + 1] for k, end in zip(active, ends, strict=True)], False)
        for k, prompt, full in zip(active, prompts, fulls, strict=True):
            if not (prompt.startswith(done[k]) and full.startswith(prompt)):
                raise ValueError(
                    "the chat template does not render conversations incrementally; use an alpaca template"
                )
            segments[k] += [(prompt[len(done[k]) :], False), (full[len(prompt) :], True)]
            done[k] = full
            if max_chars is not None and len(full) > max_chars and turn + 1 < len(replies[k]):
                cut.add(k)
    return [(row_segments, k not in cut) for k, row_segments in enumerate(segments)]


def _render(tokenizer, conversations: list[list[dict]], add_generation_prompt: bool) -> list[str]:
    if not conversations:
        return []
    with template_refusals():
        return tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=add_generation_prompt)
