"""The base model and the LoRA model built on it:

- `hub`: a base named by its hub id, through huggingface_hub's cache and download, pinned to the commit the check
  recorded.
- `base_import`: a GGUF file or an HF folder -> one plain HF safetensors folder, checked to compute the same logits.
- `base_tokenizer`: the base's tokenizer and context length alone, read without torch or the weights (the data
  stages' view of the base).
- `gguf_reading`: a GGUF file's metadata read once by transformers for its config, tokenizer and model, and without
  torch for the tokenizer and config.
- `remote_code`: whether a model folder could only load by running code of its own, or is no causal LM (refused),
  from its config.json.
- `base_weights`: a base's tensors loaded in a dtype, whole or (under ZeRO-3) one rank's partition at a time.
- `weight_names`: which file tensor is which model parameter, by transformers' own checkpoint conversions.
- `pretrained`: from_pretrained for a folder in any weight format (torch pickles read by the checkpoint loader).
- `outline`: the base's module outline (layers, Linear layers, head) written once, read instead of the architecture.
- `lora`: the PEFT LoRA model (targets checked, DoRA, LoRA+ parameter groups, vocabulary resize).
- `quantization`: a bitsandbytes-quantized base (QLoRA nf4, int8).
- `tiled_mlp`: every decoder layer's MLP a tile of positions at a time through DeepSpeed ALST's TiledMLP: long
  sequences in training (`train.tiled_mlp`) and long evaluation windows.
"""
