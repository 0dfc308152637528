"""The row formats users bring, each read into the one form the builders take (docs/data.md shows a row of each):

- text: a document (a line of a text file, or a row's "text");
- alpaca: {instruction, input?, output} (Stanford Alpaca), with LLaMA-Factory's system? and history? (earlier turns);
- chat: {messages: [{role, content}, ...], tools?} (OpenAI: an assistant's weight 0/1 and tool_calls, tool results),
  or ShareGPT's {conversations: [{from, value}, ...], system?} (human/gpt/system, as LLaMA-Factory reads it), read as
  messages;
- prompt_completion: TRL's SFT rows, a prompt (a string, or a message list) and its completion (a string, or one
  assistant message), read as {prompt, completion: str}; only the completion is trained;
- preference: a prompt (a string, or the conversation before the responses as `messages`) with a chosen and a rejected
  response (strings or assistant messages); also TRL's conversational rows (prompt, chosen and rejected as message
  lists), its implicit-prompt rows (chosen and rejected only: their shared beginning is the prompt), LLaMA-Factory's
  ShareGPT pairs (conversations, chosen/rejected {from, value}) and its Alpaca pairs (instruction, input?), and
  Anthropic's hh-rlhf rows (chosen and rejected each the whole "\n\nHuman: ...\n\nAssistant: ..." dialogue), read
  as the conversation before the last Assistant turn and the two answers after it.

`canonical` checks a row of a format and returns it in our form (a row already in it, as it is); `detect` names the
format a row's fields show (`data.format: auto`), refusing a row that fits none or several; `is_empty` tells a row with
no text (dropped and counted, not refused); `unused` names the columns of a table a format does not read."""

from __future__ import annotations

import json
import re
from pathlib import Path

FORMATS = ("text", "alpaca", "chat", "prompt_completion", "preference")
SIGNATURES = (  # the fields that name a format (preference: chosen and rejected, whatever else a row has)
    ("chat", ("messages",)),
    ("chat", ("conversations",)),
    ("alpaca", ("instruction", "output")),
    ("prompt_completion", ("prompt", "completion")),
    ("text", ("text",)),
)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"  # Anthropic's hh-rlhf turn markers
DIALOGUE_ROLES = {HUMAN: "user", ASSISTANT: "assistant"}
DIALOGUE_TURNS = re.compile(f"({HUMAN}|{ASSISTANT})")
EXPECTED = {
    "text": "'text' (a string)",
    "alpaca": "'instruction' and 'output' (strings; 'input' optional)",
    "chat": "'messages' ([{role, content}, ...]) or ShareGPT's 'conversations' ([{from, value}, ...])",
    "prompt_completion": "'prompt' and 'completion' (strings, or TRL's message lists)",
    "preference": "'chosen' and 'rejected' (with a 'prompt', 'messages' or 'conversations', or sharing their start)",
}


def where(path: Path | str, place: int | str) -> str:
    """How an error names a row: `FILE:LINE`, `FILE:row N` (Parquet), `FILE:element N (line L)` (a JSON array)."""
    return f"{path}:{place}"


def detect(row: dict, at: str) -> str:
    """The format `row`'s fields show: preference where it has chosen and rejected, else the one of chat, alpaca and
    text whose fields it has; refused (naming the row and the fields of each format) where none or several fit."""
    if "chosen" in row and "rejected" in row:
        return "preference"
    fits = [name for name, fields in SIGNATURES if all(field in row for field in fields)]
    fits = list(dict.fromkeys(fits))
    if len(fits) == 1:
        return fits[0]
    expected = "; ".join(f"{name}: {fields}" for name, fields in EXPECTED.items())
    if not fits:
        raise ValueError(
            f"{at}: data.format=auto cannot tell the format of a row with field(s) {sorted(row)}; expected the "
            f"fields of one format ({expected}), or set data.format"
        )
    raise ValueError(
        f"{at}: data.format=auto finds a row that fits {' and '.join(fits)} (fields {sorted(row)}); "
        f"set data.format to the one meant ({', '.join(fits)})"
    )


def canonical(row: dict, data_format: str, at: str) -> dict | str:
    """`row` (named `at` in errors) read as `data_format`: a text document, or the row in our form, refused where it
    lacks the format's fields or holds them malformed."""
    if data_format == "text":
        return _document(row, at)
    if data_format == "alpaca":
        return _alpaca(row, at)
    if data_format == "chat":
        return _chat(row, at)
    if data_format == "prompt_completion":
        return _completion(row, at)
    if data_format == "preference":
        return _pair(row, at)
    raise ValueError(f"data.format: expected one of {', '.join(FORMATS)} or auto, got {data_format!r}")


READ = {  # per format, every field a row of it may have read (the others are not trained on)
    "text": ("text",),
    "alpaca": ("instruction", "input", "output", "system", "history"),
    "chat": ("messages", "conversations", "system", "tools"),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "messages", "conversations", "system", "instruction", "input", "chosen", "rejected"),
}


def unused(columns: list[str], data_format: str) -> list[str]:
    """The `columns` (of a table, or a JSON file's first row) that `data_format` does not read: said by the check, so
    that none is silently left out of training."""
    return [column for column in columns if column not in READ.get(data_format, columns)]


EMPTY = (None, "", [])
TEXT_FIELDS = {  # per format, the fields holding a row's text: one of them null or empty leaves nothing to train on
    "text": ("text",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("chosen", "rejected"),
}


def is_empty(row: dict, data_format: str) -> bool:
    """Whether `row` holds no text (a field of TEXT_FIELDS, or a chat row's conversation, null or empty): such rows,
    as spreadsheets and pandas export them, are dropped and counted rather than refusing the file. A row lacking a
    field is malformed, not empty: `canonical` refuses it."""
    if data_format == "chat":
        fields = [field for field in ("messages", "conversations") if field in row]
        return bool(fields) and all(row[field] in EMPTY for field in fields)
    fields = TEXT_FIELDS.get(data_format, ())
    return bool(fields) and all(f in row for f in fields) and any(row[f] in EMPTY for f in fields)


def _missing(row: dict, fields: tuple[str, ...], data_format: str, at: str) -> None:
    missing = [field for field in fields if row.get(field) is None]
    if missing:
        raise ValueError(
            f"{at}: missing field(s) {', '.join(repr(m) for m in missing)}; data.format={data_format} expects "
            f"{EXPECTED[data_format]} (fields here: {sorted(row)})"
        )


def _string(row: dict, field: str, at: str) -> str:
    value = row[field]
    if not isinstance(value, str):
        raise ValueError(f"{at}: {field!r} must be a string, got {type(value).__name__}")
    return value


def _document(row: dict, at: str) -> str:
    if "text" not in row:
        raise ValueError(
            f"{at}: a JSON object in a text source without a 'text' field; expected plain text (one document per "
            "line) or rows with 'text', or the data format alpaca/chat/preference (or auto)"
        )
    return _string(row, "text", at)


def _alpaca(row: dict, at: str) -> dict:
    """An alpaca row as it is, its LLaMA-Factory fields checked: a `system` string and a `history` of [instruction,
    response] pairs (the earlier turns); its other LLaMA-Factory fields, which we cannot honour, refused."""
    _missing(row, ("instruction", "output"), "alpaca", at)
    _string(row, "instruction", at)
    _string(row, "output", at)
    for field in ("input", "system"):
        if row.get(field) is not None:
            _string(row, field, at)
    history = row.get("history")
    if history is not None and not (
        isinstance(history, list)
        and all(isinstance(t, list) and len(t) == 2 and all(isinstance(s, str) for s in t) for t in history)
    ):
        raise ValueError(
            f"{at}: 'history' must be a list of [instruction, response] string pairs (LLaMA-Factory's alpaca format), "
            f"got {history!r:.80}"
        )
    if unused := [field for field in UNHONOURED if row.get(field) not in EMPTY]:
        raise ValueError(
            f"{at}: {', '.join(repr(f) for f in unused)}: LLaMA-Factory's {'/'.join(UNHONOURED)} are not trained "
            "here; expected rows without them (text only)"
        )
    return row


UNHONOURED = ("tools", "images", "videos", "audios")  # LLaMA-Factory's alpaca fields we do not train on


def _chat(row: dict, at: str) -> dict:
    """A chat row as {messages, tools?}: OpenAI's messages as its fine-tuning format defines them (`_openai`), a row
    with tool calls as a `ToolChat` (which remembers `at`); ShareGPT's turns read as messages."""
    if row.get("messages") is None and row.get("conversations") is None:
        _missing(row, ("messages",), "chat", at)
    if row.get("messages") is not None and row.get("conversations") is not None:
        raise ValueError(f"{at}: both 'messages' and 'conversations'; expected one of them")
    if row.get("messages") is None:
        return {"messages": _conversation(row, at)}
    if row.get("functions") is not None:
        raise ValueError(f"{at}: 'functions' (OpenAI's deprecated function calling); expected 'tools'")
    chat = {"messages": _conversation(row, at, openai=True)}
    if row.get("tools") is not None:
        chat["tools"] = _tools(row["tools"], at)
    assistants = [m for m in chat["messages"] if m["role"] == "assistant"]
    if assistants and all(m.get("weight", 1) == 0 for m in assistants):
        raise ValueError(f"{at}: every assistant message has 'weight': 0, so nothing is trained; expected one with 1")
    uses_tools = "tools" in chat or any("tool_calls" in m or m["role"] == "tool" for m in chat["messages"])
    return ToolChat(chat, at) if uses_tools else chat


OPENAI_KEYS = {"tool_calls", "weight", "tool_call_id"}  # message keys of OpenAI's format that change what is trained


class ToolChat(dict):
    """A chat row (our form) with tool calls, tool results or tools, and `at`, where it was read: such a row renders
    only with a chat template that renders tool calls, and a refusal names the row."""

    def __init__(self, chat: dict, at: str):
        super().__init__(chat)
        self.at = at


def _is_message(turn: object) -> bool:
    return isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)


def _conversation(row: dict, at: str, field: str | None = None, *, openai: bool = False) -> list[dict]:
    """A row's messages (`messages`, `conversations` or `field`) as [{role, content}], ShareGPT's {from, value}
    turns and roles read as ours, a `system` string put first; with `openai`, OpenAI's messages (`_openai`)."""
    field = field or ("messages" if row.get("messages") is not None else "conversations")
    turns = row[field]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{at}: {field!r} must be a non-empty list of messages, got {turns!r:.80}")
    messages = [
        _openai(turn, f"{field}[{i}]", at) if openai else _message(turn, field, at) for i, turn in enumerate(turns)
    ]
    system = row.get("system")
    if system is not None and field != "prompt":
        if not isinstance(system, str):
            raise ValueError(f"{at}: 'system' must be a string, got {type(system).__name__}")
        messages = [{"role": "system", "content": system}, *messages] if system else messages
    return messages


def _message(turn: object, field: str, at: str) -> dict:
    """One turn: {role, content} as it is (any role the chat template knows), or ShareGPT's {from, value}."""
    if _is_message(turn):
        return {"role": turn["role"], "content": turn["content"]}
    if isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str):
        if turn["from"] not in ROLES:
            raise ValueError(
                f"{at}: {field!r} has a turn from {turn['from']!r}; expected one of {', '.join(ROLES)} (tool turns, "
                "function_call/observation, are not trained here)"
            )
        return {"role": ROLES[turn["from"]], "content": turn["value"]}
    raise ValueError(
        f'{at}: {field!r} must be a non-empty list of {{"role": str, "content": str}} (or ShareGPT\'s '
        f'{{"from": str, "value": str}}) objects, got {turn!r:.80}'
    )


def _openai(turn: object, name: str, at: str) -> dict:
    """One message of OpenAI's chat fine-tuning format, kept with its keys (null ones left out): an assistant's
    `weight` (0: not trained, 1: trained) and `tool_calls` (content null; each call's JSON `arguments` read into the
    object chat templates take), a tool result's `tool_call_id`; any other message as `_message` reads it."""
    if not isinstance(turn, dict) or not (OPENAI_KEYS & turn.keys() or turn.get("role") == "tool"):
        message = _message(turn, "messages", at)
        return dict(turn) if _is_message(turn) else message
    message = {key: value for key, value in turn.items() if value is not None}
    role = message.get("role")
    if "weight" in turn and (role != "assistant" or type(turn["weight"]) is not int or turn["weight"] not in (0, 1)):
        raise ValueError(
            f"{at}: {name}.weight must be 0 or 1 on an assistant message (OpenAI's chat fine-tuning: 0 is not "
            f"trained), got {turn['weight']!r} on a {role!r} message"
        )
    if "tool_calls" in message:
        calls = message["tool_calls"]
        if role != "assistant" or not isinstance(calls, list) or not calls:
            raise ValueError(
                f"{at}: {name}.tool_calls must be a non-empty list on an assistant message, got {calls!r:.80}"
            )
        message["tool_calls"] = [_tool_call(call, f"{name}.tool_calls[{j}]", at) for j, call in enumerate(calls)]
    elif role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise ValueError(f"{at}: {name} is a tool result without a 'tool_call_id' string")
    if not isinstance(role, str) or not isinstance(
        message.get("content", "" if "tool_calls" in message else None), str
    ):
        raise ValueError(
            f"{at}: {name} must have a 'role' and a string 'content' (null only beside 'tool_calls'), got {turn!r:.80}"
        )
    return message


def _tool_call(call: object, name: str, at: str) -> dict:
    """An OpenAI tool call, its `arguments` (a JSON string) read as the object it encodes."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str) and "arguments" in function):
        raise ValueError(
            f'{at}: {name} must be {{"id", "type": "function", "function": {{"name": str, "arguments": str}}}}, '
            f"got {call!r:.80}"
        )
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ValueError(f"{at}: {name}.function.arguments is not JSON ({err.msg}): {arguments!r:.80}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _tools(tools: object, at: str) -> list:
    """A row's `tools` (OpenAI's function schemas), as they are."""
    if not (
        isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    ):
        raise ValueError(
            f'{at}: \'tools\' must be a list of {{"type": "function", "function": {{"name", ...}}}} objects, '
            f"got {tools!r:.80}"
        )
    return tools


def _completion(row: dict, at: str) -> dict:
    """A prompt-completion row (TRL's SFT form, standard or conversational) as {prompt: str | messages, completion:
    str}: our form keeps the prompt where TRL puts it, so that its conversation stays untrained context."""
    _missing(row, ("prompt", "completion"), "prompt_completion", at)
    prompt = row["prompt"]
    if isinstance(prompt, list):
        prompt = _conversation(row, at, "prompt")
    elif not isinstance(prompt, str):
        raise ValueError(f"{at}: 'prompt' must be a string or a message list, got {type(prompt).__name__}")
    return {"prompt": prompt, "completion": _response(row, "completion", at)}


def _pair(row: dict, at: str) -> dict:
    """A preference row as {prompt: str | messages: [...], chosen: str, rejected: str}."""
    _missing(row, ("chosen", "rejected"), "preference", at)
    prompt, conversation = row.get("prompt"), row.get("messages", row.get("conversations"))
    if prompt is None and conversation is None and isinstance(row.get("instruction"), str):  # LLaMA-Factory's Alpaca
        if row.get("system") or row.get("history"):
            raise ValueError(
                f"{at}: an alpaca pair with 'system' or 'history' (LLaMA-Factory's) is not read here; expected the "
                "conversation before the responses as 'messages', with 'chosen' and 'rejected'"
            )
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    if prompt is not None and conversation is not None:
        field = "messages" if "messages" in row else "conversations"
        raise ValueError(
            f"{at}: both 'prompt' and {field!r}; expected one of them: 'prompt' (a string or a message list) or "
            f"{field!r} (the conversation before the responses)"
        )
    if isinstance(prompt, list):  # TRL's conversational rows: the prompt is the conversation
        return _responses({"messages": _conversation(row, at, "prompt")}, row, at)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"{at}: 'prompt' must be a string or a message list, got {type(prompt).__name__}")
        return (
            row
            if isinstance(row["chosen"], str) and isinstance(row["rejected"], str)
            else _responses({"prompt": prompt}, row, at)
        )
    if conversation is not None:
        return _responses({"messages": _conversation(row, at)}, row, at)
    return _implicit(row, at)


def _responses(pair: dict, row: dict, at: str) -> dict:
    return {**pair, "chosen": _response(row, "chosen", at), "rejected": _response(row, "rejected", at)}


def _response(row: dict, field: str, at: str) -> str:
    """A response: a string, an assistant message ({role, content} or {from: gpt, value}), or a list of one."""
    value = row[field]
    if isinstance(value, str):
        return value
    turns = value if isinstance(value, list) else [value]
    if len(turns) == 1 and isinstance(turns[0], dict):
        turn = _message(turns[0], field, at)
        if turn["role"] == "assistant":
            return turn["content"]
    raise ValueError(
        f'{at}: {field!r} must be a string or one assistant message ({{"role": "assistant", "content": str}}, '
        f"or a list of one), got {value!r:.80}"
    )


def _implicit(row: dict, at: str) -> dict:
    """TRL's implicit prompt: chosen and rejected are whole texts (or conversations) and the prompt is their shared
    beginning; each side's remainder is its response (a conversation's: one assistant message)."""
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, list) and isinstance(rejected, list):
        chosen, rejected = (_conversation(row, at, side) for side in ("chosen", "rejected"))
        shared = _shared(chosen, rejected)
        if shared == 0:
            raise ValueError(
                f"{at}: 'chosen' and 'rejected' share no first message and there is no 'prompt'; expected a 'prompt' "
                "(or 'messages'), or two conversations that begin with the same prompt (TRL's implicit prompt)"
            )
        sides = {"chosen": chosen[shared:], "rejected": rejected[shared:]}
        return _responses({"messages": chosen[:shared]}, sides, at)
    if isinstance(chosen, str) and isinstance(rejected, str):
        if all(side.startswith(HUMAN) and ASSISTANT in side for side in (chosen, rejected)):
            return _dialogue(chosen, rejected, at)
        shared = _shared(chosen, rejected)
        if shared > 0 and chosen[shared - 1] == " ":  # as TRL: the space before the responses starts them
            shared -= 1
        if shared == 0:
            raise ValueError(
                f"{at}: neither 'prompt' nor 'messages', and 'chosen' and 'rejected' share no beginning to take as "
                "the prompt; expected a 'prompt' (a string or message list) or 'messages' with the responses"
            )
        return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}
    raise ValueError(
        f"{at}: without a 'prompt', 'chosen' and 'rejected' must be two strings or two message lists (TRL's implicit "
        f"prompt), got {type(chosen).__name__} and {type(rejected).__name__}"
    )


def _dialogue(chosen: str, rejected: str, at: str) -> dict:
    """An hh-rlhf pair: two whole dialogues sharing every turn but the last Assistant response. Cut after each one's
    last Assistant marker (not at their shared characters, which run into answers that begin alike: "1899"/"1889"),
    the turns before it are the prompt conversation, the texts after it the responses; refused where the turns
    before it differ."""
    (before, chosen), (other, rejected) = (side.rsplit(ASSISTANT, 1) for side in (chosen, rejected))
    if before != other:
        n = _shared(before, other)
        raise ValueError(
            f"{at}: 'chosen' and 'rejected' are Anthropic HH dialogues ({HUMAN!r} ... {ASSISTANT!r} ...) that differ "
            f"before their last Assistant turn ({before[n:][:30]!r} against {other[n:][:30]!r}); expected the same "
            "conversation with a different last answer"
        )
    pieces = DIALOGUE_TURNS.split(before)[1:]  # marker, text, marker, text, ...
    messages = [
        {"role": DIALOGUE_ROLES[marker], "content": _turn_text(text)}
        for marker, text in zip(pieces[0::2], pieces[1::2], strict=True)
    ]
    return {"messages": messages, "chosen": _turn_text(chosen), "rejected": _turn_text(rejected)}


def _turn_text(text: str) -> str:
    """A turn's text after its marker, less the space that follows the marker ("Human: Hi")."""
    return text.removeprefix(" ")


def _shared(a, b) -> int:
    """How many leading items (characters, messages) `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def template_for(data_format: str, prompt_template: str) -> str:
    """The prompt template rows are rendered with: the tokenizer's chat template for chat data (data.format=chat
    brings it), data.prompt_template for the others."""
    return "chat" if data_format == "chat" else prompt_template
