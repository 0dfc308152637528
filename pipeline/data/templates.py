"""Instruction rows rendered as training text: alpaca prompts, and conversations through the tokenizer's chat template
a turn at a time, as (text, trained) segments: prompts untrained, replies trained."""

from __future__ import annotations

from functools import cache

from pipeline.data.formats import ToolChat
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
    """An alpaca row as the conversation it is (LLaMA-Factory's converter): its system prompt, each `history` pair a
    user and an assistant turn, then the instruction (and input) and the output."""
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    pairs = row.get("history") or []
    earlier = [{"role": role, "content": text} for pair in pairs for role, text in zip(ROLES, pair, strict=True)]
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [*system, *earlier, {"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


ROLES = ("user", "assistant")  # a `history` pair's speakers


def is_conversation(row: dict) -> bool:
    """Whether an alpaca row holds more than one turn's prompt: a `system` or a `history` (LLaMA-Factory's)."""
    return bool(row.get("system") or row.get("history"))


def alpaca_turns(row: dict, template: str, eos: str) -> list[tuple[str, bool]]:
    """An alpaca row with a system prompt or history, for a tokenizer without a chat template: the system text, then
    each turn (the history's, then the row's) an alpaca prompt, untrained, and its response with EOS, trained."""
    turns = [{"instruction": q, "output": a} for q, a in row.get("history") or []] + [row]
    segments = [(alpaca_prompt(turn, template), False) for turn in turns]
    segments = [s for prompt, turn in zip(segments, turns, strict=True) for s in (prompt, (turn["output"] + eos, True))]
    if row.get("system"):
        segments[0] = (f"{row['system']}\n\n{segments[0][0]}", False)
    return segments


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
        if "messages" in row or template == "chat" or (is_conversation(row) and tokenizer.chat_template):
            chats[k] = row["messages"] if "messages" in row else alpaca_messages(row)
        elif is_conversation(row):
            segments[k] = alpaca_turns(row, template, tokenizer.eos_token or "")
        else:
            segments[k] = [(alpaca_prompt(row, template), False), (row["output"] + (tokenizer.eos_token or ""), True)]
    tools = {k: _tools(tokenizer, rows[k]) for k in chats}
    replies = {k: [i for i, m in enumerate(chat) if m["role"] == "assistant"] for k, chat in chats.items()}
    done, cut = dict.fromkeys(chats, ""), set()
    for turn in range(max(map(len, replies.values()), default=0)):
        active = [k for k in chats if turn < len(replies[k]) and k not in cut]
        ends = [replies[k][turn] for k in active]
        given = [tools[k] for k in active]
        prompts = _render(tokenizer, [chats[k][:end] for k, end in zip(active, ends, strict=True)], given, True)
        fulls = _render(tokenizer, [chats[k][: end + 1] for k, end in zip(active, ends, strict=True)], given, False)
        for k, end, prompt, full in zip(active, ends, prompts, fulls, strict=True):
            if not (prompt.startswith(done[k]) and full.startswith(prompt)):
                raise ValueError(
                    "the chat template does not render conversations incrementally; use an alpaca template"
                )
            trained = chats[k][end].get("weight", 1) != 0  # OpenAI's weight 0: the reply is context, not trained
            segments[k] += [(prompt[len(done[k]) :], False), (full[len(prompt) :], trained)]
            done[k] = full
            if max_chars is not None and len(full) > max_chars and turn + 1 < len(replies[k]):
                cut.add(k)
    return [(row_segments, k not in cut) for k, row_segments in enumerate(segments)]


def _render(
    tokenizer, conversations: list[list[dict]], tools: list[list | None], add_generation_prompt: bool
) -> list[str]:
    """The conversations rendered by the chat template, those without tools in one call, each with its tools alone."""
    rendered: list[str] = [""] * len(conversations)
    plain = [i for i, given in enumerate(tools) if given is None]
    with template_refusals():
        if plain:
            found = tokenizer.apply_chat_template(
                [conversations[i] for i in plain], tokenize=False, add_generation_prompt=add_generation_prompt
            )
            for i, text in zip(plain, found, strict=True):
                rendered[i] = text
        for i, given in enumerate(tools):
            if given is not None:
                rendered[i] = tokenizer.apply_chat_template(
                    conversations[i], tools=given, tokenize=False, add_generation_prompt=add_generation_prompt
                )
    return rendered


def _tools(tokenizer, row: dict) -> list | None:
    """A conversation's `tools` (None where it has none), refused with the row where the chat template would not
    render its tool calls (`tool_refusal`)."""
    if not isinstance(row, ToolChat):
        return None
    if why := tool_refusal(tokenizer, row.get("tools")):
        raise ValueError(
            f"{row.at}: a conversation with tool calls (OpenAI's tool_calls, tool results or tools) cannot be trained "
            f"with this base's tokenizer: {why}, so the calls would be missing from the text trained on; expected a "
            "base whose chat template renders tool calls (as Qwen2.5's and Llama 3.1's do), or rows without them"
        )
    return row.get("tools")


def tool_refusal(tokenizer, tools: list | None) -> str | None:
    """Why the tokenizer's chat template cannot render a conversation with tool calls, None where it can: the template
    that transformers picks for it (a tokenizer's `tool_use` template where it has named ones) must read an assistant
    message's `tool_calls`, and the `tools` variable where the row gives tools."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = tokenizer.get_chat_template(tools=tools)
    if not template:
        return "it has no chat template"
    missing = [name for name in ("tool_calls", "tools") if name not in _names(template) and (tools or name != "tools")]
    return f"its chat template never reads {' or '.join(repr(m) for m in missing)}" if missing else None


@cache
def _names(template: str) -> frozenset[str]:
    """The names and strings of a template's code (not its text or comments): what it can read."""
    import jinja2

    with template_refusals():
        tokens = list(jinja2.Environment().lex(template))
    return frozenset(value.strip("'\"") for _, kind, value in tokens if kind in ("name", "string"))
