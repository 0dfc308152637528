"""The proof that a merged model computes what base + adapter computed: the logits of both on fixed tokens, each
model run from its files one block at a time (a decoder layer, the embeddings, the head): memory stays at one block
plus the activations, whatever the model's size. Base + adapter is PEFT's own unmerged computation (its LoRA layers
around the base's), independent of the merge's arithmetic."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.checkpoints import adapter as adapter_format
from pipeline.checkpoints.model_files import FileTensor, model_tensors
from pipeline.model import weight_names

TOLERANCES = {"fp32": (1e-3, 1e-6), "bf16": (1.0, 2e-2), "fp16": (0.25, 2e-3)}  # max |logit diff|, max mean KL
Source = Callable[[], torch.Tensor]  # a parameter's value, read when its block runs
Transform = Callable[[torch.Tensor], torch.Tensor]


def logits_gap(
    *,
    base_dir: Path,
    adapter_dir: Path,
    merged_dir: Path,
    rows: int,
    seed: int = 0,
    base_linear: Transform | None = None,
) -> dict:
    """Base + adapter (through PEFT) against the merged model on fixed token sequences, both in fp32; with
    `base_linear`, the base's Linear weights (the output head aside) go through it first (a quantized base as it
    computes: see pipeline/model/quantization.py round_trip)."""
    ids = torch.randint(0, rows, (2, 48), generator=torch.Generator().manual_seed(seed))
    expected = streamed_logits(base_dir, ids, rows=rows, adapter_dir=adapter_dir, base_linear=base_linear)
    got = streamed_logits(merged_dir, ids, rows=rows)
    log_p, log_q = expected.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return {"max_abs_logit_diff": float((expected - got).abs().max()), "mean_kl": float(kl), "tokens": ids.numel()}


def streamed_logits(
    model_dir: Path,
    ids: torch.Tensor,
    *,
    rows: int,
    adapter_dir: Path | None = None,
    base_linear: Transform | None = None,
) -> torch.Tensor:
    """fp32 logits of the model in `model_dir` (with the PEFT adapter of `adapter_dir` applied, unmerged, when
    given; the weights of its Linear layers but the output head through `base_linear` when given), its embeddings
    `rows` long; every parameter is read from the files just before the block that uses it runs, and dropped right
    after."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers computed
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # outside the context, which would give the head a parameter of its own
    if model.get_input_embeddings().weight.shape[0] != rows:
        model.resize_token_embeddings(rows, mean_resizing=False)  # meta in, meta out
    blocks = set(model._no_split_modules or ())
    head = model.get_output_embeddings()
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    base = weight_names.by_parameter(model, model_tensors(model_dir))  # under the model's names
    if adapter_dir is None:
        sources = _sources(model, lambda name: base.get(name), str(model_dir))
    else:
        from peft import LoraConfig, get_peft_model

        _, tensors = adapter_format.read(adapter_dir)  # a LoRA adapter, its tensors under PEFT's saved names
        model = get_peft_model(model, LoraConfig.from_pretrained(str(adapter_dir)), autocast_adapter_dtype=False)
        sources = _sources(model, lambda name: _peft_tensor(name, base, tensors), f"{model_dir} + {adapter_dir}")
    for name in sources if base_linear is not None else ():
        if _base_name(name) in linear and ".lora_" not in name and ".modules_to_save." not in name:
            sources[name] = _through(sources[name], base_linear)
    handles = _stream(model.eval(), sources, blocks)
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits.float()
    finally:
        for handle in handles:
            handle.remove()


def _peft_tensor(name: str, base: dict[str, FileTensor], adapter: dict[str, FileTensor]) -> FileTensor | None:
    """The file tensor of a parameter of the PEFT-wrapped model: the adapter's (LoRA, modules_to_save) or the
    base's (`base_layer`, `original_module`)."""
    if ".lora_" in name or ".modules_to_save." in name:
        return adapter.get(adapter_format.peft_key(name))
    return base.get(_base_name(name))


def _base_name(name: str) -> str:
    """A parameter name of the PEFT-wrapped model as the base model names it."""
    return name.removeprefix(adapter_format.PREFIX).replace(".base_layer.", ".").replace(".original_module.", ".")


def _through(source: Source, transform: Transform) -> Source:
    return lambda: transform(source()).float()


def _sources(model: torch.nn.Module, find: Callable[[str], FileTensor | None], where: str) -> dict[str, Source]:
    """A reader for every parameter name (tied names share one), its value padded with zero rows when the files
    hold fewer rows than the model (an embedding the adapter replaces)."""
    named = list(model.named_parameters(remove_duplicate=False))
    found: dict[int, FileTensor] = {}
    for name, param in named:
        if (tensor := find(name)) is not None:
            found.setdefault(id(param), tensor)
    missing = [name for name, param in named if id(param) not in found]
    if missing:
        raise ValueError(f"{where}: no tensor in the files for {missing[:5]}")

    def reader(tensor: FileTensor, shape: torch.Size) -> Source:
        def read() -> torch.Tensor:
            value = tensor.read().float()
            if isinstance(tensor, weight_names.Converted):
                tensor.release()  # read once per forward: the conversion is not kept
            if value.shape == shape:
                return value
            padded = torch.zeros(shape)
            padded[: value.shape[0]] = value
            return padded

        return read

    return {name: reader(found[id(param)], param.shape) for name, param in named}


def _stream(model: torch.nn.Module, sources: dict[str, Source], blocks: set[str]) -> list:
    """Hooks that give each block (a module of a class in `blocks`, else the module holding the parameter) its
    parameters as its forward starts and take them back as it ends."""
    modules = dict(model.named_modules())
    owners: dict[str, list[tuple[torch.nn.Module, str, str]]] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        parent, _, leaf = name.rpartition(".")
        owner = parent
        for prefix in _prefixes(parent):
            if type(modules[prefix]).__name__ in blocks:
                owner = prefix
                break
        owners.setdefault(owner, []).append((modules[parent], leaf, name))

    def give(entries):
        def hook(module, args):
            for holder, leaf, name in entries:
                holder._parameters[leaf] = torch.nn.Parameter(sources[name](), requires_grad=False)

        return hook

    def take(entries):
        def hook(module, args, output):
            for holder, leaf, _ in entries:
                shape = holder._parameters[leaf].shape
                holder._parameters[leaf] = torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

        return hook

    handles = []
    for owner, entries in owners.items():
        handles.append(modules[owner].register_forward_pre_hook(give(entries)))
        handles.append(modules[owner].register_forward_hook(take(entries)))
    return handles


def _prefixes(name: str) -> list[str]:
    """'a.b.c' -> ['a', 'a.b', 'a.b.c']: the outermost block wins."""
    parts = name.split(".") if name else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]
