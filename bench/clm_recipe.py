"""The data preparation users of Chinese-LLaMA-Alpaca-2 run, written after its training scripts, as bench.cache_dataset
runs it in its own process (nothing of ours imported, so it carries only what the recipe loads):

    python -m bench.clm_recipe text --data corpus.txt --tokenizer artifacts/tokenizer --cache-dir C --out O \
        --figures F.json [--num-proc N] [--block-size 512]
    python -m bench.clm_recipe sft --data rows.jsonl --tokenizer artifacts/tokenizer --cache-dir C --out O \
        --figures F.json [--num-proc N] [--max-seq-len 512]

text, after run_clm_pt_with_peft.py: `load_dataset("text")`, a batched `datasets.map` that tokenizes each line
(`tokenizer.add_eos_token = True`, as the script sets), a batched `group_texts` map that concatenates each batch of
1,000 lines, cuts it into blocks and drops the batch's remainder (labels = a copy of input_ids), save_to_disk, then
the train/validation split. sft, after build_instruction_dataset (build_dataset.py): `load_dataset("json")`, a batched
map that tokenizes every prompt and every response (+ EOS) separately, masks the prompt's labels with -100 and cuts
both at max_seq_len, then save_to_disk; the prompt is the tokenizer's chat template for `messages` rows (the text our
stage renders) or the Alpaca template for {instruction, output} rows. The script turns each example into a torch
tensor; plain lists here (less work for the recipe, not more). Both write their figures (tokens tokenized, tokens
and rows kept) to --figures."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from itertools import chain
from pathlib import Path

IGNORE_INDEX = -100
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)  # pipeline.data.templates' no-input template, so both sides tokenize the same text


def list_tokens(dataset, column: str = "input_ids") -> int:
    """Tokens in a list column of a datasets.Dataset, summed by Arrow (no row is read into Python)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(dataset.data.column(column))
    return int(pc.sum(lengths).as_py() or 0)


def text_recipe(tokenizer, *, data: Path, out: Path, cache_dir: Path, num_proc: int, block_size: int) -> dict:
    """run_clm_pt_with_peft.py's tokenize, group, save and split; its figures."""
    from datasets import load_dataset

    tokenizer.add_eos_token = True

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = len(concatenated["input_ids"])
        if total >= block_size:
            total = (total // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    raw = load_dataset("text", data_files=str(data), cache_dir=str(cache_dir / "text"), keep_in_memory=False)
    tokenized = raw.map(
        tokenize_function,
        batched=True,
        num_proc=num_proc,
        remove_columns="text",
        keep_in_memory=False,
        cache_file_names={k: str(cache_dir / "tokenized.arrow") for k in raw},
        desc="Running tokenizer on dataset",
    )
    grouped = tokenized.map(
        group_texts,
        batched=True,
        num_proc=num_proc,
        keep_in_memory=False,
        cache_file_names={k: str(cache_dir / "grouped.arrow") for k in tokenized},
        desc=f"Grouping texts in chunks of {block_size}",
    )
    grouped.save_to_disk(str(out))
    splits = grouped["train"].train_test_split(test_size=0.02)
    return {
        "documents": raw["train"].num_rows,
        "tokens": list_tokens(tokenized["train"]),
        "packed_tokens": list_tokens(grouped["train"]),
        "rows": splits["train"].num_rows + splits["test"].num_rows,
    }


def prompt_and_response(tokenizer, row: dict) -> tuple[str, str]:
    """The untrained prompt and the trained response of one row, as text."""
    if "messages" in row:
        messages = row["messages"]
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt, full[len(prompt) :]
    return ALPACA_PROMPT.format(instruction=row["instruction"]), f"{row['output']}{tokenizer.eos_token}"


def sft_recipe(tokenizer, *, data: Path, out: Path, cache_dir: Path, num_proc: int, max_seq_len: int) -> dict:
    """build_instruction_dataset's tokenize, mask, truncate and save; its figures."""
    from datasets import load_dataset

    def tokenization(examples):
        rows = [dict(zip(examples, values, strict=True)) for values in zip(*examples.values(), strict=True)]
        sources, targets = zip(*(prompt_and_response(tokenizer, row) for row in rows), strict=True)
        tokenized_sources = tokenizer(list(sources), return_attention_mask=False)["input_ids"]
        tokenized_targets = tokenizer(list(targets), return_attention_mask=False, add_special_tokens=False)["input_ids"]
        input_ids, labels = [], []
        for s, t in zip(tokenized_sources, tokenized_targets, strict=True):
            input_ids.append((s + t)[:max_seq_len])
            labels.append(([IGNORE_INDEX] * len(s) + t)[:max_seq_len])
        return {"input_ids": input_ids, "labels": labels}

    raw = load_dataset("json", data_files=str(data), cache_dir=str(cache_dir / "json"), keep_in_memory=False)
    processed = raw.map(
        tokenization,
        batched=True,
        num_proc=num_proc,
        remove_columns=raw["train"].column_names,
        keep_in_memory=False,
        desc="preprocessing on dataset",
    )
    processed.save_to_disk(str(out))
    tokens = list_tokens(processed["train"])
    return {"documents": raw["train"].num_rows, "tokens": tokens, "packed_tokens": tokens, "rows": processed.num_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("text", "sft"))
    parser.add_argument("--data", type=Path, required=True, help="text file (one document a line) or JSONL rows")
    parser.add_argument("--tokenizer", type=Path, required=True, help="HF tokenizer folder")
    parser.add_argument("--cache-dir", type=Path, required=True, help="the recipe's datasets cache (emptied first)")
    parser.add_argument("--out", type=Path, required=True, help="folder save_to_disk writes")
    parser.add_argument("--figures", type=Path, required=True, help="JSON of tokens, rows and documents to write")
    parser.add_argument("--num-proc", type=int, default=len(os.sched_getaffinity(0)), help="datasets.map workers")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--max-seq-len", type=int, default=512)
    args = parser.parse_args()
    shutil.rmtree(args.cache_dir, ignore_errors=True)  # no map result of an earlier run is reused
    args.cache_dir.mkdir(parents=True)
    os.environ["HF_DATASETS_CACHE"] = str(args.cache_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    common = {"data": args.data, "out": args.out, "cache_dir": args.cache_dir, "num_proc": args.num_proc}
    if args.mode == "text":
        figures = text_recipe(tokenizer, block_size=args.block_size, **common)
    else:
        figures = sft_recipe(tokenizer, max_seq_len=args.max_seq_len, **common)
    args.figures.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
