"""The memory a training rank will need, estimated before anything is loaded from the model's shapes (the model of
docs/scaling.md, fitted on CPU ranks and checked on a 3.2 B model), and the refusal of a run that cannot fit,
naming the settings that would: a 70B under ZeRO-2 is refused at plan time, not by the out-of-memory killer after
eight ranks have each read the model."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.checkpoints.model_files import model_tensors
from pipeline.core.atomic import read_json
from pipeline.training.ds_config import LEAN_LIVE

INTERPRETER = {"cpu": 0.53e9, "cuda": 0.5e9}  # torch + DeepSpeed + transformers on a CPU rank; a CUDA context on a GPU
HOST_PER_RANK = 0.53e9  # the same interpreter in host memory on a GPU node
ACTIVATION_BYTES = {False: 34, True: 2}  # per token x hidden x layer in bf16 (x2 in fp32): without/with checkpointing
# Per token x hidden in bf16, the layer being recomputed under checkpointing (its activations and their gradients in
# flight), its MLP in tiles: measured at 4k-128k tokens on the Llama-3-8B shape on an H200 (docs/long_context.md).
RECOMPUTED = 40
LIVE = {"cpu": LEAN_LIVE, "cuda": 1_000_000_000}  # ZeRO-3's gathered elements kept live (DeepSpeed's default on GPUs)


@dataclass(frozen=True, kw_only=True)
class Shapes:
    """What the estimate needs of a model: parameters (embeddings at their trained rows), the largest one, the
    trainable ones (LoRA and modules trained in full), and the activations' sizes."""

    parameters: int
    largest: int
    trainable: int
    hidden: int
    layers: int
    heads: int
    largest_lora: int = 0  # the largest LoRA tensor (ZeRO-3 keeps them whole)
    layer: int = 0  # the largest decoder layer's parameters
    intermediate: int = 0  # the MLP's width (0: unknown, no tiling counted)
    vocab: int = 0  # the head's rows (the logits where the fused loss does not apply)


@dataclass(frozen=True, kw_only=True)
class Setting:
    """How a run holds the model: ZeRO stage, offload, ranks, precision and the tokens of a micro-batch."""

    zero_stage: int
    offload_param: bool
    offload_optimizer: bool
    world_size: int
    dtype_bytes: int
    tokens: int
    checkpointing: bool
    accelerator: str
    sequence: int = 0  # the longest row: with eager attention each layer keeps its score matrices
    eager_attention: bool = False
    checkpointed: int | None = None  # with checkpointing, the layers recomputed (None: all)
    tiled_mlp: bool = False  # the MLPs' intermediate activations for one tile only (model.tiled_mlp)
    checkpoint_offload: bool = False  # the checkpointed layers' inputs in host memory (kernels.offloaded_checkpoints)
    fused_loss: bool = True  # no logits kept (kernels.fused_loss); else tokens x vocabulary of them, three times


def shapes(*, base_dir: Path, vocab_rows: int, targets: list[str], modules_to_save: list[str], r: int) -> Shapes:
    """The model's shapes from its config and safetensors headers (nothing loaded); `targets`: LoRA's, as full
    module paths or leaf names."""
    config = read_json(base_dir / "config.json")
    tensors = {name: list(t.shape) for name, t in model_tensors(base_dir).items()}
    grown = {name: [vocab_rows, *shape[1:]] if shape[0] == config["vocab_size"] and len(shape) == 2 else shape
             for name, shape in tensors.items()}  # fmt: skip
    sizes = {name: math.prod(shape) for name, shape in grown.items()}
    trainable, largest_lora, layers = 0, 0, {}
    for name, shape in grown.items():
        module = name.removesuffix(".weight")
        leaf = module.rsplit(".", 1)[-1]
        if name.endswith(".weight") and len(shape) == 2 and (module in targets or leaf in targets):
            trainable += r * (shape[0] + shape[1])
            largest_lora = max(largest_lora, r * max(shape))
        if leaf in modules_to_save:
            trainable += sizes[name]
        if (index := re.search(r"\.layers\.(\d+)\.", name)) is not None:
            layers[index.group(1)] = layers.get(index.group(1), 0) + sizes[name]
    return Shapes(
        parameters=sum(sizes.values()),
        largest=max(sizes.values()),
        trainable=trainable,
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=config["num_attention_heads"],
        largest_lora=largest_lora,
        layer=max(layers.values(), default=0),
        intermediate=config.get("intermediate_size", 0),
        vocab=vocab_rows,
    )


def per_rank(model: Shapes, setting: Setting) -> dict[str, float]:
    """Bytes a rank needs on its device ("device") and, on a GPU node, in host memory ("host"; on CPU ranks both are
    the same memory, counted under "device"): docs/scaling.md's terms."""
    s, b, w = setting, setting.dtype_bytes, setting.world_size
    recomputed = (model.layers if s.checkpointed is None else s.checkpointed) if s.checkpointing else 0
    kept = model.layers - recomputed + (1 if recomputed else 0)  # the layer being recomputed keeps what a layer keeps
    per_layer = s.tokens * model.hidden * b / 2  # bytes per unit of ACTIVATION_BYTES, per layer
    mlp, tile = 0.0, 0.0  # gate(x), up(x) and their product, per token x hidden in bf16 bytes; one tile's of them
    if model.intermediate:
        mlp = min(ACTIVATION_BYTES[False] - ACTIVATION_BYTES[True], 6 * model.intermediate / model.hidden)
    if s.tiled_mlp and model.intermediate:  # those for one tile of `hidden` positions at a time
        tile = 3 * min(s.tokens, model.hidden) * model.intermediate * b
    layer = ACTIVATION_BYTES[False] - (mlp if s.tiled_mlp else 0.0)  # what a layer keeps, per token x hidden
    inputs = per_layer * recomputed * ACTIVATION_BYTES[True]  # the checkpointed layers' inputs
    activations = tile + per_layer * (model.layers - recomputed) * layer
    activations += 0.0 if s.checkpoint_offload else inputs  # offloaded: in host memory
    if recomputed:  # the layer being recomputed: its activations and their gradients in flight
        activations += per_layer * (RECOMPUTED + (0.0 if s.tiled_mlp else mlp))
    if not s.fused_loss:  # the logits in the training dtype, upcast to fp32, and their gradient
        activations += s.tokens * model.vocab * (b + 8)
    if s.eager_attention:  # the fp32 softmax and its copy in the training dtype, per score, per layer kept
        activations += s.tokens * s.sequence * model.heads * (4 + b) * kept
    optimizer = 12 * model.trainable / (w if s.zero_stage >= 1 else 1)  # fp32 masters and Adam's two moments
    if s.zero_stage == 3:
        weights = model.parameters * b / w
        gathered = min(model.parameters, LIVE[s.accelerator]) * b + 3 * model.largest * b
        trained = model.trainable * b  # LoRA's tensors whole on every rank (training.ds_config)
    else:
        weights, gathered, trained = model.parameters * b, 0.0, model.trainable * b
    host = HOST_PER_RANK if s.accelerator != "cpu" else 0.0
    offloaded = (weights if s.offload_param else 0.0) + (optimizer if s.offload_optimizer else 0.0)
    if s.checkpoint_offload:
        host += inputs
    device = INTERPRETER[s.accelerator] + weights + gathered + trained + optimizer + activations - offloaded
    return {"device": device, "host": host + offloaded}


def check_fits(model: Shapes, setting: Setting, *, device_bytes: float | None, host_bytes: float, ranks: int) -> None:
    """Refuse the run where a rank's estimate exceeds its device's memory (`device_bytes`: a GPU's, None on CPU
    ranks) or the node's ranks exceed `host_bytes`, naming the settings that would fit."""
    need = per_rank(model, setting)
    if _fits(need, device_bytes, host_bytes, ranks):
        return
    options = []
    changes = [
        ("deepspeed=zero3", {"zero_stage": 3, "offload_param": False, "offload_optimizer": False}),
        ("deepspeed=zero3_offload", {"zero_stage": 3, "offload_param": True, "offload_optimizer": True}),
        ("train.tiled_mlp=true", {"tiled_mlp": True}),
        ("train.gradient_checkpointing=true", {"checkpointing": True, "checkpointed": None}),
    ]
    if setting.accelerator == "cuda":
        changes.append(
            (
                "train.gradient_checkpointing=offload",
                {"checkpointing": True, "checkpointed": None, "checkpoint_offload": True},
            )
        )
    for name, change in changes:
        other = replace(setting, **change)
        if other != setting and _fits(other_need := per_rank(model, other), device_bytes, host_bytes, ranks):
            options.append(f"{name} (about {other_need['device'] / 1e9:.1f} GB a rank)")
    hint = " or ".join(options) if options else "more ranks (launcher.num_nodes) or a smaller micro-batch"
    where = "of GPU memory" if device_bytes is not None else "of host memory"
    have = device_bytes if device_bytes is not None else host_bytes / ranks
    raise ValueError(
        f"deepspeed.stage: this run needs about {need['device'] / 1e9:.1f} GB {where} a rank under ZeRO-"
        f"{setting.zero_stage} (docs/scaling.md), {have / 1e9:.1f} GB are there; expected {hint}"
    )


def _fits(need: dict[str, float], device_bytes: float | None, host_bytes: float, ranks: int) -> bool:
    if device_bytes is None:  # CPU ranks: one memory for the node's ranks
        return need["device"] * ranks <= host_bytes
    return need["device"] <= device_bytes and need["host"] * ranks <= host_bytes


def gpu_memory() -> float | None:
    """The smallest free memory of this node's GPUs (nvidia-smi: no CUDA context in the asking process); None where
    it cannot be read."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    values = [float(line) * 2**20 for line in done.stdout.split() if line.strip()] if done.returncode == 0 else []
    return min(values) if values else None


def planned(
    *, paths, state, deepspeed, launch, micro: int, ds_config, tiled_mlp: bool | str, kernels: str
) -> tuple[Shapes, Setting]:
    """The model's shapes and the run's setting for a planned run (the micro-batch's tokens from the longest row of
    the dataset's first record batch: nothing else of it is read; a sequence-parallel rank's share of them)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipeline.data.saved_splits import split_files

    with pa.memory_map(str(split_files(paths.dataset / "train")[0])) as source:
        first = pa.ipc.open_stream(source).read_next_batch()
    sequence = pc.max(pc.list_value_length(first.column("input_ids"))).as_py()
    identity = state.identity
    model = shapes(
        base_dir=paths.base,
        vocab_rows=identity.vocab_rows,
        targets=identity.target_modules,
        modules_to_save=identity.modules_to_save,
        r=identity.lora_r,
    )
    tied = read_json(paths.base / "config.json").get("tie_word_embeddings", False)
    head_trained = "lm_head" in identity.modules_to_save or (tied and "embed_tokens" in identity.modules_to_save)
    setting = Setting(
        zero_stage=deepspeed.stage,
        offload_param=deepspeed.offload_param,
        offload_optimizer=deepspeed.offload_optimizer,
        world_size=launch.world_size,
        dtype_bytes=ds_config.module_dtype_bytes,
        tokens=-(-micro * sequence // launch.sequence_parallel),  # a rank's shard of the micro-batch
        checkpointing=launch.gradient_checkpointing,
        accelerator=launch.accelerator,
        sequence=sequence,
        eager_attention=launch.attention == "eager",
        tiled_mlp=tiled_mlp is True,
        checkpoint_offload=launch.checkpoint_offload,
        fused_loss=kernels != "off" and not (deepspeed.stage == 3 and head_trained),  # as kernels.fused_loss installs
    )
    return model, setting


AUTO_MARGIN = 0.85  # checkpointing off only where the estimate without it leaves 15% of the GPU's free memory


def checkpointing_choice(
    model: Shapes, setting: Setting, *, device_bytes: float | None, may_tile: bool = False
) -> tuple[int, bool, str]:
    """`train.gradient_checkpointing: auto` on a GPU: how many decoder layers recompute their activations, the fewest
    with which the run fits the GPU's free memory with `AUTO_MARGIN` (0 where it fits without: nothing recomputed,
    fastest; all where even that does not fit); whether their inputs go to host memory (only where every layer
    recomputing does not fit, with the MLPs in tiles where `may_tile`: long sequences); and why, as
    metrics/train.json says it."""
    if device_bytes is None:
        return model.layers, False, "auto: on (the GPU's free memory could not be read)"
    budget = AUTO_MARGIN * device_bytes
    for count in range(model.layers + 1):
        need = per_rank(model, replace(setting, checkpointing=count > 0, checkpointed=count))["device"]
        if need <= budget:
            break
    free = f"{device_bytes / 1e9:.1f} GB free"
    every = replace(setting, checkpointing=True, checkpointed=model.layers, tiled_mlp=setting.tiled_mlp or may_tile)
    if need > budget and per_rank(model, every)["device"] > budget:
        offloaded = per_rank(model, replace(every, checkpoint_offload=True))
        if offloaded["device"] <= budget:
            held = f"about {offloaded['device'] / 1e9:.1f} GB a rank, {offloaded['host'] / 1e9:.1f} GB of host memory"
            return model.layers, True, f"auto: offload ({held}, {free})"
    which = "off" if count == 0 else "on" if count == model.layers else f"{count} of {model.layers} layers"
    return count, False, f"auto: {which} (about {need / 1e9:.1f} GB a rank, {free})"


def check_plan(
    model: Shapes,
    setting: Setting,
    *,
    quantized: bool,
    device_bytes: float | None,
    ranks_per_node: int,
    tiled_mlp: bool | str = False,
) -> dict:
    """The estimate for a planned run, refused where it cannot fit this node; GB a rank, as the plan records it, and
    whether the MLPs are tiled (`tiled_mlp` auto: only where the run fits with tiling and not without). A quantized
    base is not estimated (its 4-bit weights are not in this model)."""
    import psutil

    if not quantized:
        node = {"device_bytes": device_bytes, "host_bytes": psutil.virtual_memory().available, "ranks": ranks_per_node}
        tiled = replace(setting, tiled_mlp=True)
        if (
            tiled_mlp == "auto"
            and not _fits(per_rank(model, setting), **node)
            and _fits(per_rank(model, tiled), **node)
        ):
            setting = tiled
        check_fits(model, setting, **node)
    estimate = {k: round(v / 1e9, 2) for k, v in per_rank(model, setting).items()}
    return {**estimate, "tiled_mlp": setting.tiled_mlp}
