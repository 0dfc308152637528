"""The base model's weights for training, never more than a rank needs: loaded whole in the training dtype (ZeRO
0-2 keep the whole model on every rank; so is a base bitsandbytes quantizes as it loads), or built inside
DeepSpeed's partitioned initialisation with each rank reading only its own ZeRO-3 slice of every tensor from the
safetensors shards, so that no rank ever holds a whole parameter. Rows a grown vocabulary adds are the mean of the
old rows (or seeded normal noise): the same values on either path, whatever the world size."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.checkpoints.model_files import FileTensor, model_tensors
from pipeline.model import weight_names

ROW_BLOCK = 1024  # rows read, or drawn, at a time
COPY_ELEMENTS = 1 << 24  # elements read and copied at a time into a partition
Rows = Callable[[int, int], torch.Tensor]  # rows [a, b) of an embedding past the base's, in fp32


def added_rows(source: FileTensor, *, init: str, seed: int, std: float) -> Rows:
    """The values of the rows past `source`'s: the mean of its rows (accumulated in fp64, a block at a time), or
    N(0, std) drawn per block of ROW_BLOCK rows from a generator seeded by (seed, block)."""
    old, hidden = source.shape
    mean: list[torch.Tensor] = []

    def mean_row() -> torch.Tensor:
        if not mean:
            total = torch.zeros(hidden, dtype=torch.float64)
            for first in range(0, old, ROW_BLOCK):
                count = min(ROW_BLOCK, old - first)
                total += source.read_flat(first * hidden, count * hidden).view(count, hidden).double().sum(0)
            mean.append((total / old).float())
        return mean[0]

    def rows(a: int, b: int) -> torch.Tensor:
        if init == "mean":
            return mean_row().expand(b - a, hidden)
        blocks = []
        for block in range((a - old) // ROW_BLOCK, (b - old - 1) // ROW_BLOCK + 1):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + block)
            blocks.append(torch.randn(ROW_BLOCK, hidden, generator=generator) * std)
        first = old + (a - old) // ROW_BLOCK * ROW_BLOCK
        return torch.cat(blocks)[a - first : b - first]

    return rows


def fill_flat(out: torch.Tensor, source: FileTensor, grown: Rows | None, start: int) -> None:
    """Fill `out` with elements [start, start + len(out)) of a parameter flattened: the file's, then the added rows',
    cast as copied, COPY_ELEMENTS at a time (memory: one block, whatever the tensor)."""
    hidden = math.prod(source.shape[1:])  # elements per row (of an embedding, or of the first dimension)
    stored = source.shape[0] * hidden
    for offset in range(0, out.numel(), COPY_ELEMENTS):
        a = start + offset
        b = min(a + COPY_ELEMENTS, start + out.numel())
        target = out[offset : offset + b - a]
        if b <= stored:
            target.copy_(source.read_flat(a, b - a))
            continue
        if a < stored:
            target[: stored - a].copy_(source.read_flat(a, stored - a))
        first = max(a, stored)
        block = grown(first // hidden, -(-b // hidden)).reshape(-1)
        target[first - a :].copy_(block[first - first // hidden * hidden : b - first // hidden * hidden])


def _sources(model: torch.nn.Module, base_dir: Path) -> dict[str, FileTensor]:
    """The file tensor of every parameter (tied ones once, under their first name), by transformers' names."""
    tensors = weight_names.by_parameter(model, model_tensors(base_dir))
    missing = [name for name, _ in model.named_parameters() if name not in tensors]
    if missing:
        raise ValueError(f"{base_dir}: no tensor for {missing[:5]} in the model files; expected an HF model")
    return {name: tensors[name] for name, _ in model.named_parameters()}


def _embedding_names(model: torch.nn.Module) -> set[str]:
    weights = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return {name for name, param in model.named_parameters() if id(param) in weights}


def load_whole(
    *, base_dir: Path, dtype: torch.dtype, vocab_rows: int, init: str, seed: int, device: str = "cpu"
) -> torch.nn.Module:
    """The base in `dtype` on `device` (a rank's GPU: no host copy of the model), its embeddings `vocab_rows` rows,
    each parameter read from the files into place a block at a time (memory: the model in `dtype` and one block of
    host memory; from_pretrained would also map the whole files, which count as the rank's memory while it converts
    them)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = _grown_config(base_dir, vocab_rows)
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _fill(model, base_dir=base_dir, init=init, seed=seed, part=lambda param: (param.data.view(-1), 0, param.shape))
    return model


def load_quantized(
    *, base_dir: Path, dtype: torch.dtype, vocab_rows: int, init: str, seed: int, load_kwargs: dict
) -> torch.nn.Module:
    """The base quantized by from_pretrained (`load_kwargs`: the quantization config and where to load), its
    floating-point parameters in `dtype`, its embeddings grown to `vocab_rows` rows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype, **load_kwargs)
    old = model.get_input_embeddings().weight.shape[0]
    if vocab_rows < old:
        raise ValueError(f"tokenizer: {vocab_rows} rows is fewer than the model's {old} embeddings")
    if vocab_rows == old:
        return model
    model.resize_token_embeddings(vocab_rows, mean_resizing=False)
    sources = _sources(model, base_dir)
    std = model.config.initializer_range
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in _embedding_names(model):
            grown = added_rows(sources[name], init=init, seed=seed, std=std)
            params[name][old:] = grown(old, vocab_rows).to(params[name].device, dtype)
    return model


def _grown_config(base_dir: Path, vocab_rows: int):
    """The base's config with `vocab_rows` embedding rows (never fewer than the base's)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_dir)
    if vocab_rows < config.vocab_size:
        raise ValueError(f"tokenizer: {vocab_rows} rows is fewer than the model's {config.vocab_size} embeddings")
    config.vocab_size = vocab_rows
    return config


def _fill(model: torch.nn.Module, *, base_dir: Path, init: str, seed: int, part: Callable) -> None:
    """Every parameter's values from the files, tied weights tied first: `part(param)` is (where this rank keeps
    it, flat; the first element it keeps; the parameter's whole shape). Embedding rows past the files' are the
    added rows."""
    if model.config.tie_word_embeddings:
        model.tie_weights()
    sources = _sources(model, base_dir)
    embeddings = _embedding_names(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            out, start, shape = part(param)
            file_shape, shape = tuple(sources[name].shape), tuple(shape)
            if file_shape != shape and not (name in embeddings and file_shape[1:] == shape[1:]):
                raise ValueError(f"{base_dir}: {name} is {list(file_shape)} in the files, the model's is {list(shape)}")
            grown = None
            if name in embeddings:
                grown = added_rows(sources[name], init=init, seed=seed, std=model.config.initializer_range)
            if len(out):
                fill_flat(out, sources[name], grown, start)
            if isinstance(sources[name], weight_names.Converted):
                sources[name].release()


def _partition_only():
    """deepspeed.zero.Init without its broadcast of every new parameter from rank 0 (which makes each other rank
    hold the whole parameter, and sends the whole model, only for the values to be overwritten from the files), and
    keeping the dtype it is given (deepspeed_patches.zero_init_keeps_dtype)."""
    from pipeline.core import deepspeed_patches

    deepspeed = deepspeed_patches.imported()

    class PartitionOnly(deepspeed.zero.Init):
        def _zero_init_param(self, param):  # DeepSpeed 0.19: convert, broadcast, partition
            self._convert_to_deepspeed_param(param)
            param.partition()

    return PartitionOnly


def load_partitioned(
    *, base_dir: Path, dtype: torch.dtype, vocab_rows: int, init: str, seed: int, zero3_config: dict
) -> torch.nn.Module:
    """The base built under deepspeed.zero.Init (nothing initialised, nothing whole), each rank filling its own
    partition of every parameter from the files; embeddings have `vocab_rows` rows from the start."""
    import deepspeed.comm as dist
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = _grown_config(base_dir, vocab_rows)
    with _partition_only()(config_dict_or_path=zero3_config, dtype=dtype), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)

    def part(param):
        held = param.ds_tensor
        start = held.ds_numel * dist.get_rank(group=param.ds_process_group)
        held.data.zero_()  # the padding of the last partition
        return held.data[: max(0, min(held.ds_numel, param.ds_numel - start))], start, param.ds_shape

    _fill(model, base_dir=base_dir, init=init, seed=seed, part=part)
    return model
