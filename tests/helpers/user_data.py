"""Data files as users have them, written the way each ecosystem defines its format (not the way our code reads):
Stanford Alpaca's `alpaca_data.json` (an indented JSON array, non-ASCII escaped), OpenAI's fine-tuning `messages`
JSONL (with a system turn), LLaMA-Factory's ShareGPT (`conversations` of `from`/`value` turns, human/gpt, an optional
`system`) and its ShareGPT pairs, TRL's prompt-completion rows for SFT and its preference rows (standard and
conversational, with an explicit or an implicit prompt), Anthropic's hh-rlhf pairs (two whole dialogues), plain text;
each in any container (JSON array, JSONL, Parquet, compressed, a folder of shards)."""

from __future__ import annotations

import bz2
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SYSTEM = "You are a terse assistant who answers in Chinese."


def answers(texts: list[str]) -> list[tuple[str, str, str]]:
    """(question, answer, another answer) from consecutive texts: the material of every format's rows."""
    n = len(texts)
    return [(f"Continue: {texts[i][:24]}", texts[i][24:90], texts[(i + 7) % n][24:90]) for i in range(n)]


def stanford_alpaca(texts: list[str]) -> list[dict]:
    """Stanford Alpaca's rows: instruction, input ("" when there is none), output."""
    return [
        {"instruction": q, "input": "" if i % 2 else a[:8], "output": a} for i, (q, a, _) in enumerate(answers(texts))
    ]


def openai_messages(texts: list[str]) -> list[dict]:
    """OpenAI's chat fine-tuning rows: a system turn, then user and assistant."""
    return [
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
            ]
        }
        for q, a, _ in answers(texts)
    ]


def sharegpt(texts: list[str]) -> list[dict]:
    """LLaMA-Factory's ShareGPT rows: `conversations` of human/gpt turns (two rounds here), `system` beside them."""
    return [
        {
            "conversations": [
                {"from": "human", "value": q},
                {"from": "gpt", "value": a},
                {"from": "human", "value": "And then?"},
                {"from": "gpt", "value": b},
            ],
            "system": SYSTEM,
        }
        for q, a, b in answers(texts)
    ]


def trl_prompt_completion(texts: list[str]) -> list[dict]:
    """TRL's standard prompt-completion rows (SFT: the loss on the completion only)."""
    return [{"prompt": q, "completion": a} for q, a, _ in answers(texts)]


def trl_conversational_prompt_completion(texts: list[str]) -> list[dict]:
    """TRL's conversational prompt-completion rows: the prompt a conversation (two rounds here, its assistant turn
    context), the completion one assistant message."""
    return [
        {
            "prompt": [
                {"role": "user", "content": q},
                {"role": "assistant", "content": b[:12]},
                {"role": "user", "content": "Again, please."},
            ],
            "completion": [{"role": "assistant", "content": a}],
        }
        for q, a, b in answers(texts)
    ]


def trl_standard(texts: list[str]) -> list[dict]:
    """TRL's standard preference rows with an explicit prompt."""
    return [{"prompt": q, "chosen": a, "rejected": b} for q, a, b in answers(texts)]


def trl_conversational(texts: list[str]) -> list[dict]:
    """TRL's conversational preference rows: prompt, chosen and rejected as message lists."""
    return [
        {
            "prompt": [{"role": "user", "content": q}],
            "chosen": [{"role": "assistant", "content": a}],
            "rejected": [{"role": "assistant", "content": b}],
        }
        for q, a, b in answers(texts)
    ]


def trl_implicit(texts: list[str]) -> list[dict]:
    """TRL's standard rows with an implicit prompt: whole texts sharing their beginning (a space before the answer)."""
    return [{"chosen": f"{q} {a}", "rejected": f"{q} {b}"} for q, a, b in answers(texts)]


def trl_implicit_conversational(texts: list[str]) -> list[dict]:
    """TRL's conversational rows with an implicit prompt: two whole conversations sharing their first turns."""
    return [
        {
            "chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
            "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": b}],
        }
        for q, a, b in answers(texts)
    ]


def sharegpt_pairs(texts: list[str]) -> list[dict]:
    """LLaMA-Factory's ShareGPT preference rows: the conversation, then chosen and rejected gpt turns."""
    return [
        {
            "conversations": [{"from": "human", "value": q}],
            "chosen": {"from": "gpt", "value": a},
            "rejected": {"from": "gpt", "value": b},
        }
        for q, a, b in answers(texts)
    ]


def hh_dialogue(rounds: list[tuple[str, str]]) -> str:
    """A whole dialogue as Anthropic's hh-rlhf writes it, each (human, assistant) round after its markers."""
    return "".join(f"\n\nHuman: {human}\n\nAssistant: {assistant}" for human, assistant in rounds)


def anthropic_hh(texts: list[str]) -> list[dict]:
    """Anthropic's hh-rlhf rows: chosen and rejected each the whole dialogue, sharing every turn but the last
    Assistant response (two rounds here)."""
    return [
        {
            "chosen": hh_dialogue([(q, b[:12]), ("And then?", a)]),
            "rejected": hh_dialogue([(q, b[:12]), ("And then?", b)]),
        }
        for q, a, b in answers(texts)
    ]


def plain_text(texts: list[str]) -> list[str]:
    return list(texts)


FORMATS = {  # name -> (how the rows are made, the data.format they are)
    "text": (plain_text, "text"),
    "stanford_alpaca": (stanford_alpaca, "alpaca"),
    "openai_messages": (openai_messages, "chat"),
    "sharegpt": (sharegpt, "chat"),
    "trl_prompt_completion": (trl_prompt_completion, "prompt_completion"),
    "trl_conversational_prompt_completion": (trl_conversational_prompt_completion, "prompt_completion"),
    "trl_standard": (trl_standard, "preference"),
    "trl_conversational": (trl_conversational, "preference"),
    "trl_implicit": (trl_implicit, "preference"),
    "trl_implicit_conversational": (trl_implicit_conversational, "preference"),
    "sharegpt_pairs": (sharegpt_pairs, "preference"),
    "anthropic_hh": (anthropic_hh, "preference"),
}
CONTAINERS = ("json", "jsonl", "parquet", "gz", "zst", "bz2", "folder")


def _jsonl(rows: list) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()


def _text(rows: list) -> bytes:
    return "".join(f"{row}\n" for row in rows).encode()


def write(rows: list, folder: Path, name: str, container: str) -> Path:
    """`rows` (dicts, or plain texts) in `container` under `folder`: the data path a user would pass.
    json: one indented array, non-ASCII escaped (as alpaca_data.json); jsonl; parquet; gz, zst, bz2: compressed JSONL
    (plain text for texts), zst as a compressed JSON array; folder: two shards that sort in order."""
    texts = isinstance(rows[0], str)
    objects = [{"text": row} for row in rows] if texts else rows
    folder.mkdir(parents=True, exist_ok=True)
    if container == "json":
        path = folder / f"{name}.json"
        path.write_text(json.dumps(objects, indent=4), encoding="utf-8")
    elif container == "jsonl":
        path = folder / f"{name}.jsonl"
        path.write_bytes(_jsonl(objects))
    elif container == "parquet":
        path = folder / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(objects), path)
    elif container == "gz":
        path = folder / (f"{name}.txt.gz" if texts else f"{name}.jsonl.gz")
        path.write_bytes(gzip.compress(_text(rows) if texts else _jsonl(rows)))
    elif container == "bz2":
        path = folder / (f"{name}.txt.bz2" if texts else f"{name}.jsonl.bz2")
        path.write_bytes(bz2.compress(_text(rows) if texts else _jsonl(rows)))
    elif container == "zst":
        path = folder / (f"{name}.txt.zst" if texts else f"{name}.json.zst")
        body = _text(rows) if texts else json.dumps(objects, indent=2, ensure_ascii=False).encode()
        path.write_bytes(_zstd(body))
    elif container == "folder":
        path = folder / name
        half = len(rows) // 2
        for part, chunk in (("part-000", rows[:half]), ("part-001", rows[half:])):
            (path / part).parent.mkdir(parents=True, exist_ok=True)
            if texts:
                (path / f"{part}.txt").write_bytes(_text(chunk))
            else:
                (path / f"{part}.jsonl").write_bytes(_jsonl(chunk))
    else:
        raise ValueError(f"container: expected one of {CONTAINERS}, got {container!r}")
    return path


def _zstd(data: bytes) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as out:
        out.write(data)
    return sink.getvalue().to_pybytes()
