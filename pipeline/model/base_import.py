"""Import the base model once into a plain HF safetensors folder (from a GGUF file or an HF folder)."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from pathlib import Path

import torch

from pipeline.core.atomic import atomic_path
from pipeline.core.precision import DTYPES
from pipeline.data.tokenizer import vocabulary_size
from pipeline.model import outline, pretrained
from pipeline.model.base_tokenizer import check_source
from pipeline.model.gguf_reading import read_once

WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")
MODEL_FILES = ("config.json", "generation_config.json")


def import_base(*, source: Path, out_dir: Path, tokenizer_dir: Path, dtype: str, max_shard_size: str) -> dict:
    """Write `out_dir`: the model, with the base's tokenizer copied from `tokenizer_dir` (`base_tokenizer`, which
    reads it without the weights); return a short summary."""
    check_source(source)
    if not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"{tokenizer_dir}: no such folder; expected the base's tokenizer folder")
    with atomic_path(out_dir) as tmp, read_once() if source.suffix == ".gguf" else contextlib.nullcontext():
        if source.suffix != ".gguf":
            _link_hf_folder(source, tmp, dtype=DTYPES[dtype], max_shard_size=max_shard_size)
        elif not convert_gguf(source, tmp, dtype=DTYPES[dtype], max_shard_size=max_shard_size):
            model = _load_gguf(source)  # an architecture whose tensors transformers merges or splits (MoE)
            model.to(DTYPES[dtype]).save_pretrained(tmp, max_shard_size=max_shard_size)
            expected = _probe(model)
            del model  # the reloaded copy need not sit beside it: one model in memory at a time
            _check_roundtrip(expected, tmp, DTYPES[dtype])
        for path in sorted(Path(tokenizer_dir).iterdir()):
            shutil.copy2(path, tmp / path.name)
        config = _plain_config(tmp)
        outline.write(tmp)
    return {
        "architecture": config.architectures[0],
        "vocab_size": config.vocab_size,
        "tokenizer_size": vocabulary_size(tokenizer_dir),
        "max_position_embeddings": config.max_position_embeddings,
    }


def _load_gguf(path: Path):
    """De-quantize a GGUF file into a plain (serializable) model of the same architecture."""
    from transformers import AutoModelForCausalLM

    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), assign=True)
    buffers = dict(gguf_model.named_buffers())  # non-persistent ones (rotary inv_freq) are not in the state dict
    for name, buffer in plain.named_buffers():
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            plain.get_submodule(owner).register_buffer(attr, buffers[name], persistent=False)
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    return plain.eval()


STREAMED = ("TensorProcessor", "LlamaTensorProcessor")  # transformers' GGUF processors that map tensors one to one
GGUF_ROWS = 4096  # rows of a tensor de-quantized at a time


def convert_gguf(path: Path, out_dir: Path, *, dtype: torch.dtype, max_shard_size: str) -> bool:
    """De-quantize a GGUF file into the new HF folder `out_dir` a tensor at a time, each named, reordered (LLaMA's
    Q/K) and de-quantized as transformers' own GGUF loader does it (its name map, tensor processor and gguf's
    de-quantization) and written as it is made: memory holds one tensor, never the model. False, with nothing
    written, for architectures whose tensors transformers merges or splits (its other processors: MoE)."""
    with read_once():
        return _convert_gguf(path, out_dir, dtype=dtype, max_shard_size=max_shard_size)


def _convert_gguf(path: Path, out_dir: Path, *, dtype: torch.dtype, max_shard_size: str) -> bool:
    import numpy as np
    from gguf import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.integrations.gguf import GgufHeader
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from pipeline.checkpoints.safetensors_stream import parse_size, write_shards

    header = GgufHeader.from_file(str(path))  # the tensor table alone (gguf's own reader parses the vocabulary too)
    size = path.stat().st_size
    if cut := [info.name for info in header.tensors if header.data_start + info.offset + info.nbytes > size]:
        raise ValueError(
            f"model.path: {path} ends inside tensor {cut[0]} ({len(cut)} cut short); expected the whole GGUF file"
        )
    processor_class = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)
    if processor_class.__name__ not in STREAMED:
        return False
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    processor = processor_class(config=config.to_dict())  # the head counts it reorders Q and K by
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = get_gguf_hf_weights_map(skeleton, processor)
    found = {names[info.name]: info for info in header.tensors if info.name in names}
    wanted = {key: tuple(value.shape) for key, value in skeleton.state_dict().items()}
    tied = {key for key in wanted if key not in found and _tied(skeleton, key)}
    missing = sorted(set(wanted) - set(found) - tied)
    if missing:
        raise ValueError(f"model.path: {path} holds no tensor for {missing[:4]} ({len(missing)} in all)")

    def produce(key: str) -> torch.Tensor:
        info = found[key]
        rows = math.prod(info.shape[:-1])
        row_bytes = info.nbytes // rows  # a row of blocks (or of values)
        weights = np.empty((rows, info.shape[-1]), dtype=np.float32)  # filled a block of rows at a time
        for start in range(0, rows, GGUF_ROWS):
            count = min(GGUF_ROWS, rows - start)
            raw = os.pread(file.fileno(), count * row_bytes, header.data_start + info.offset + start * row_bytes)
            weights[start : start + count] = dequantize(np.frombuffer(raw, np.uint8).reshape(count, -1), info.ggml_type)
        weights = weights.reshape(info.shape)
        weights = processor.process(weights=weights, name=info.name, tensor_key_mapping=names).weights
        return torch.from_numpy(np.ascontiguousarray(weights)).to(dtype)

    entries = [(key, wanted[key], dtype) for key in wanted if key not in tied]
    out_dir.mkdir(parents=True)
    with open(path, "rb") as file:  # read, not mapped: a mapped file's pages would stay in the process's memory
        write_shards(out_dir, entries, produce, max_bytes=parse_size(max_shard_size, "model.max_shard_size"))
    config.architectures = [type(skeleton).__name__]
    config.dtype = dtype
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    return True


def _tied(model, key: str) -> bool:
    """Whether `key` is the output head tied to the input embeddings (written once, under the embeddings' name)."""
    head = model.get_output_embeddings()
    return bool(model.config.tie_word_embeddings) and head is not None and key == f"{_name_of(model, head)}.weight"


def _name_of(model, module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def _link_hf_folder(source: Path, dst: Path, *, dtype: torch.dtype, max_shard_size: str) -> None:
    """Hard-link (or copy) a safetensors HF folder; torch pickles are read through the checkpoint loader and written
    as safetensors."""
    weights = [p for pattern in WEIGHT_FILES for p in sorted(source.glob(pattern))]
    if not any(p.suffix == ".safetensors" for p in weights):
        model = pretrained.causal_lm(source, dtype=dtype)
        model.save_pretrained(dst, max_shard_size=max_shard_size)
        return
    dst.mkdir(parents=True)
    for path in weights + [source / name for name in MODEL_FILES if (source / name).is_file()]:
        try:
            os.link(path.resolve(), dst / path.name)  # Linux's link() links a symlink itself (a hub cache's)
        except OSError:
            shutil.copy2(path, dst / path.name)


PROBE = torch.arange(1, 17).unsqueeze(0)  # the tokens the roundtrip check runs


def _probe(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(PROBE).logits


def _check_roundtrip(expected: torch.Tensor, folder: Path, dtype: torch.dtype) -> None:
    """The saved folder, loaded in `dtype`, must compute what the in-memory model computed (`expected`: its logits
    on PROBE)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    torch.testing.assert_close(_probe(reloaded), expected, rtol=0, atol=0)


def _plain_config(folder: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "quantization_config", None):
        raise ValueError(f"{folder}/config.json: still carries a quantization_config; expected a plain model")
    return config
