"""cache_dataset's tokenize+pack throughput against run_clm_pt_with_peft.py's recipe (Chinese-LLaMA-Alpaca-2):
`load_dataset("text")`, a batched `datasets.map` tokenize, then a batched `group_texts` map, then
save_to_disk; same corpus, same tokenizer, both written to disk. Needs `make run` first (uses its outputs)."""

from __future__ import annotations

import tempfile
from itertools import chain
from pathlib import Path

from bench.common import median_seconds, report
from pipeline.data.dataset import build_pretraining, save_splits
from pipeline.data.textio import read_documents
from pipeline.data.tokenizer import load_tokenizer

CORPUS = Path("data/corpus/peoples_daily_train.txt")
TOKENIZER = Path("artifacts/tokenizer")
BLOCK_SIZE = 512
REPEATS = 3


def reference(tokenizer, workdir: Path) -> int:
    """The recipe of run_clm_pt_with_peft.py with its default settings (no num_proc, batch 1000)."""
    from datasets import load_dataset

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = (len(concatenated["input_ids"]) // BLOCK_SIZE) * BLOCK_SIZE
        result = {k: [t[i : i + BLOCK_SIZE] for i in range(0, total, BLOCK_SIZE)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    raw = load_dataset("text", data_files=str(CORPUS), cache_dir=str(workdir / "hf"))
    tokenized = raw.map(tokenize_function, batched=True, remove_columns="text")
    grouped = tokenized.map(group_texts, batched=True)
    grouped["train"].train_test_split(test_size=0.02, seed=42).save_to_disk(str(workdir / "out"))
    return sum(len(r) for r in grouped["train"]["input_ids"])


def ours(tokenizer, workdir: Path) -> int:
    tables, stats = build_pretraining(
        tokenizer, read_documents(CORPUS), block_size=BLOCK_SIZE, tail="drop", validation_fraction=0.02, seed=42
    )
    save_splits(workdir / "ours", tables)
    return (stats["train_rows"] + stats["validation_rows"]) * BLOCK_SIZE


def main() -> None:
    tokenizer = load_tokenizer(TOKENIZER)
    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(1000))
        ref_s, ref_tokens = median_seconds(lambda: reference(tokenizer, Path(tmp) / f"r{next(runs)}"), REPEATS)
        our_s, our_tokens = median_seconds(lambda: ours(tokenizer, Path(tmp) / f"o{next(runs)}"), REPEATS)
    report(
        "cache_dataset",
        {
            "corpus_chars": sum(map(len, read_documents(CORPUS))),
            "tokenizer_size": len(tokenizer),
            "reference_seconds": round(ref_s, 3),
            "ours_seconds": round(our_s, 3),
            "reference_tokens_packed": ref_tokens,
            "ours_tokens_packed": our_tokens,
            "reference_tokens_per_s": round(ref_tokens / ref_s),
            "ours_tokens_per_s": round(our_tokens / our_s),
            "speedup": round(ref_s / our_s, 2),
            "target_speedup": 1.5,
        },
    )


if __name__ == "__main__":
    main()
