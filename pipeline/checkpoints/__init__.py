"""Checkpoints, one module a concern:

- `folder`: a training run's checkpoint folder (tags, `latest`, trainer state, identity, pruning, RNG, saving).
- `zero_shards`: reading a DeepSpeed ZeRO tag's shards (fp32 masters, Adam moments) without DeepSpeed.
- `universal`: DeepSpeed's universal layout, written from the shards and loaded into an engine of any layout.
- `zero_writer`: a universal checkpoint -> the ZeRO layout of N ranks (the ranks build and save an engine).
- `adapter`: the PEFT adapter format (file names, config, tensor names).
- `consolidate`: a ZeRO tag -> a PEFT adapter folder, verified.
- `safetensors_stream`: safetensors files read and written one tensor at a time.
"""
