"""Checkpoints of any ZeRO stage, world size and tool, read without DeepSpeed; one module a concern (imports core
and data only):

- `folder`: a training run's checkpoint folder (tags, `latest`, trainer state, identity, pruning, RNG, saving).
- `locate`: what a user points consolidate/convert at (ours, a DeepSpeed save_dir, HF Trainer folders, a tag) ->
  the tag folder to read.
- `shard_files`: a DeepSpeed tag's files (which is which, one save or refused) and loading them without DeepSpeed.
- `zero_shards`: the fp32 masters (and Adam moments) of a tag's partitioned optimizer shards (ZeRO-1/2/3,
  BF16_Optimizer); `zero0_masters`: those ZeRO-0 keeps whole in the model-state file (fused, unfused, plain).
- `mapped`: torch.save files read memory-mapped, pages handed back once copied.
- `universal`: DeepSpeed's universal layout, written from the shards and loaded into an engine of any layout.
- `adapter`: the PEFT adapter format (file names, config, tensor names, other trainers' variants read into it).
- `consolidate`: a ZeRO tag -> a PEFT adapter folder, verified.
- `safetensors_stream`: safetensors files read and written one tensor at a time; `model_files`: an HF model
  folder's tensors in any format (safetensors or torch pickles) behind one interface.
- `safe_pickle`: the one loader for every torch pickle the project reads: torch's weights-only loader with the
  classes checkpoints hold, and the bounds it lacks (TorchScript archives, inflation, views against their storage)
  around it; `pickle_scan`: a pickle read opcode by opcode, never run (hashing work, nesting, storages against the
  file); `engine_loads`: DeepSpeed's engine reading a resume's files through it.
"""
