"""The launch settings: what `auto` means on this machine (accelerator, ranks per node, precision, gradient
accumulation, activation checkpointing, attention) and the nodes, resolved once by the stage and checked before
anything launches."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.core.config import LauncherConfig, TrainConfig

PRECISIONS = ("bf16", "fp16", "fp32")


# The device files a GPU runtime opens (NVIDIA's driver, WSL2's GPU paravirtualization, ROCm's kernel driver): with
# none of them, CUDA (or HIP through torch.cuda) cannot be available, and torch need not be imported to know it
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd")


def accelerator_name(requested: str) -> str:
    """'cuda' or 'cpu': what `launcher.accelerator=auto` means on this machine (torch asked only where a GPU's device
    file exists)."""
    if requested != "auto":
        return requested
    if not any(os.path.exists(path) for path in GPU_DEVICE_FILES):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# What DeepSpeed's accelerators train in on any machine, so that asking needs no import of DeepSpeed (and torch):
# its CPU accelerator answers bf16 True unconditionally (0.19.8; fp16 only where oneDNN computes it), fp32 everywhere.
# tests/unit/launching/test_settings.py holds DeepSpeed to these answers.
ALWAYS_SUPPORTED = {("cpu", "bf16"), ("cpu", "fp32"), ("cuda", "fp32")}


def check_precision(precision: str, accelerator: str) -> None:
    """Refuse a precision the accelerator cannot train in (DeepSpeed's accelerator asked where it is not known)."""
    if (accelerator, precision) in ALWAYS_SUPPORTED:
        return
    os.environ.setdefault("DS_ACCELERATOR", accelerator)
    from pipeline.core import deepspeed_patches

    deepspeed_patches.imported()
    from deepspeed.accelerator import get_accelerator

    supported = {
        "bf16": bool(get_accelerator().is_bf16_supported()),
        "fp16": bool(get_accelerator().is_fp16_supported()),
        "fp32": True,
    }
    if not supported[precision]:
        usable = [p for p in PRECISIONS if supported[p]]
        raise ValueError(f"train.precision: {precision} is not supported on {accelerator}; expected one of {usable}")


@dataclass(frozen=True, kw_only=True)
class Launch:
    """The `auto` settings made concrete for this machine."""

    accelerator: str
    ranks_per_node: int
    num_nodes: int
    world_size: int
    precision: str
    gradient_accumulation_steps: int
    global_batch_size: int  # micro x accumulation x data-parallel world (world / sequence_parallel)
    gradient_checkpointing: bool
    attention: str  # transformers' attn_implementation
    hosts: tuple[str, ...]  # node 0 first
    join_timeout_s: float  # launcher.join_timeout_s: the rendezvous and first all-reduce (launching.rendezvous)
    sequence_parallel: int = 1  # ranks sharing each sequence (training.sequence_parallel)
    checkpoint_offload: bool = False  # checkpointed layer inputs in host memory (kernels.offloaded_checkpoints)
    tiled_mlp: bool = False  # the MLPs a tile of positions at a time (model.tiled_mlp); auto is decided by the plan

    @property
    def data_world(self) -> int:
        """Data-parallel groups: the ranks of a sequence-parallel group train on the same rows."""
        return self.world_size // self.sequence_parallel


def resolve_launch(*, train: TrainConfig, launcher: LauncherConfig, model_config: dict | None = None) -> Launch:
    """Accelerator, ranks, precision, accumulation, activation checkpointing and attention for this machine and
    the model of `model_config` (its config.json; the attention it supports)."""
    from pipeline.launching import cluster

    nodes = cluster.resolve(launcher)
    accelerator = accelerator_name(launcher.accelerator)
    ranks = nodes.slots or ranks_on_this_node(launcher.ranks_per_node, accelerator)
    world = ranks * len(nodes.hosts)
    data_world = check_world(train.sequence_parallel, world_size=world)
    checkpointing = train.gradient_checkpointing
    accumulation = accumulation_steps(
        train.gradient_accumulation_steps,
        global_batch=train.global_batch_size,
        micro=train.micro_batch_size,
        world_size=data_world,
        sequence_parallel=train.sequence_parallel,
    )
    precision = training_precision(train.precision, accelerator)
    return Launch(
        accelerator=accelerator,
        ranks_per_node=ranks,
        num_nodes=len(nodes.hosts),
        world_size=world,
        precision=precision,
        gradient_accumulation_steps=accumulation,
        global_batch_size=train.micro_batch_size * accumulation * data_world,
        gradient_checkpointing=accelerator == "cuda" if checkpointing == "auto" else bool(checkpointing),
        attention=attention_implementation(
            train.attention,
            accelerator=accelerator,
            precision=precision,
            flash_installed=flash_attn_installed(),
            supported=supported_attention(model_config),
        ),
        hosts=nodes.hosts,
        join_timeout_s=launcher.join_timeout_s,
        sequence_parallel=train.sequence_parallel,
        checkpoint_offload=checkpointing == "offload" and accelerator == "cuda",
        tiled_mlp=train.tiled_mlp is True,
    )


def check_world(size: int, *, world_size: int, hpz_partition_size: int = 1) -> int:
    """The data-parallel world (world / `size`): `size` must divide the world."""
    if world_size % size:
        divisors = [n for n in range(1, world_size + 1) if world_size % n == 0]
        raise ValueError(
            f"train.sequence_parallel: {size} does not divide the world size ({world_size} ranks); expected one of "
            f"{divisors}, or other ranks (launcher.ranks_per_node, launcher.num_nodes)"
        )
    if size > 1 and hpz_partition_size > 1:
        raise ValueError(
            f"deepspeed.hpz_partition_size: {hpz_partition_size} with train.sequence_parallel {size}: ZeRO++'s "
            "secondary partition is not proven with sequence parallelism here; expected hpz_partition_size=1"
        )
    return world_size // size


FLASH = "flash_attention_2"


def flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def supported_attention(model_config: dict | None) -> frozenset[str]:
    """The attention implementations the model class of `model_config` declares (transformers' `_supports_sdpa`,
    `_supports_flash_attn`; eager always): Gemma 2 has no SDPA (its soft-capped scores). All of them for a config
    transformers has no class for (remote code: its own flags are read when it loads)."""
    every = frozenset(("eager", "sdpa", FLASH))
    if not model_config or not model_config.get("model_type"):
        return every
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_config["model_type"])
    if name is None:
        return every
    import transformers

    from pipeline.model.lora import supported_by

    return supported_by(getattr(transformers, name))


def attention_implementation(
    requested: str, *, accelerator: str, precision: str, flash_installed: bool, supported: frozenset[str]
) -> str:
    """`train.attention`: auto is the best the model supports here: flash-attention 2 where it can run (CUDA, bf16
    or fp16, the flash-attn package installed), else PyTorch's SDPA, else eager; one named must be able to run here
    and be one the model supports (`supported_attention`)."""
    usable = accelerator == "cuda" and precision in ("bf16", "fp16") and flash_installed
    if requested == "auto":
        return FLASH if usable and FLASH in supported else "sdpa" if "sdpa" in supported else "eager"
    if requested not in supported:
        raise ValueError(
            f"train.attention: the model does not support {requested} (transformers' flags for its class); "
            f"expected auto or one of {', '.join(sorted(supported))}"
        )
    if requested == FLASH and not usable:
        missing = (
            "a CUDA accelerator" if accelerator != "cuda"
            else f"bf16 or fp16 (train.precision is {precision})" if precision not in ("bf16", "fp16")
            else "the flash-attn package (pip install flash-attn)"
        )  # fmt: skip
        raise ValueError(f"train.attention: {FLASH} needs {missing}; expected auto, sdpa or eager here")
    return requested


def ranks_on_this_node(requested: int | str, accelerator: str) -> int:
    """`launcher.ranks_per_node`: auto is one rank per visible GPU, 2 CPU ranks where there is none."""
    if requested != "auto":
        return int(requested)
    if accelerator == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return 2


def training_precision(requested: str, accelerator: str) -> str:
    """`train.precision`: auto is bf16 where the hardware computes it natively (CUDA, or a CPU with bf16 units),
    fp32 otherwise; an explicit one must be one the accelerator can train in."""
    from pipeline.core.precision import native_bf16

    precision = requested if requested != "auto" else "bf16" if native_bf16(accelerator) else "fp32"
    check_precision(precision, accelerator)
    return precision


def accumulation_steps(
    requested: int | str, *, global_batch: int | str, micro: int, world_size: int, sequence_parallel: int = 1
) -> int:
    """`train.gradient_accumulation_steps`: auto is whatever makes micro x accumulation x world = the global batch
    (1 where the global batch is auto too: then it is micro x world); `world_size`: the data-parallel one (the
    world over `sequence_parallel`)."""
    if global_batch == "auto":
        return 1 if requested == "auto" else int(requested)
    if requested != "auto":
        check_batch(
            global_batch,
            micro=micro,
            accumulation=int(requested),
            world_size=world_size,
            sequence_parallel=sequence_parallel,
        )
        return int(requested)
    if global_batch % (micro * world_size):
        raise ValueError(
            f"train.global_batch_size: {global_batch} is not a multiple of train.micro_batch_size ({micro}) x "
            f"{_world_words(world_size, sequence_parallel)}; expected a multiple of {micro * world_size}, or other "
            "ranks"
        )
    return global_batch // (micro * world_size)


def _world_words(world_size: int, sequence_parallel: int) -> str:
    if sequence_parallel == 1:
        return f"world size ({world_size})"
    return f"data-parallel world size ({world_size}: the world over train.sequence_parallel {sequence_parallel})"


def check_batch(
    train_batch_size: int | None, *, micro: int, accumulation: int, world_size: int, sequence_parallel: int = 1
) -> int:
    """The global batch; a stated one must equal micro x accumulation x (data-parallel) world size."""
    product = micro * accumulation * world_size
    if train_batch_size is not None and train_batch_size != product:
        raise ValueError(
            f"train.global_batch_size: {train_batch_size} != train.micro_batch_size ({micro}) x "
            f"train.gradient_accumulation_steps ({accumulation}) x {_world_words(world_size, sequence_parallel)} = "
            f"{product}"
        )
    return product
