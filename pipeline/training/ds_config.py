"""The DeepSpeed config, generated from the deepspeed/train choices and checked before anything launches."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.core.config import LauncherConfig, TrainConfig

PRECISIONS = ("bf16", "fp16", "fp32")
LEAN_LIVE = 100_000_000  # ZeRO-3 gathered elements kept live on CPU ranks (DeepSpeed's default: 1e9)


def accelerator_name(requested: str) -> str:
    """'cuda' or 'cpu': what `launcher.accelerator=auto` means on this machine."""
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_precision(precision: str, accelerator: str) -> None:
    """Refuse a precision the accelerator cannot train in."""
    os.environ.setdefault("DS_ACCELERATOR", accelerator)
    from pipeline.core import imports

    imports.deepspeed()
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
    join_timeout_s: float  # launcher.join_timeout_s: the rendezvous and first all-reduce (training.world)
    sequence_parallel: int = 1  # ranks sharing each sequence (training.sequence_parallel)
    checkpoint_offload: bool = False  # checkpointed layer inputs in host memory (kernels.offloaded_checkpoints)
    tiled_mlp: bool = False  # the MLPs a tile of positions at a time (model.tiled_mlp); auto is decided by the plan

    @property
    def data_world(self) -> int:
        """Data-parallel groups: the ranks of a sequence-parallel group train on the same rows."""
        return self.world_size // self.sequence_parallel


def resolve_launch(*, train: TrainConfig, launcher: LauncherConfig) -> Launch:
    """Accelerator, ranks, precision, accumulation, activation checkpointing and attention for this machine."""
    from pipeline.training import cluster
    from pipeline.training.sequence_parallel import check_world

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
            train.attention, accelerator=accelerator, precision=precision, flash_installed=flash_attn_installed()
        ),
        hosts=nodes.hosts,
        join_timeout_s=launcher.join_timeout_s,
        sequence_parallel=train.sequence_parallel,
        checkpoint_offload=checkpointing == "offload" and accelerator == "cuda",
        tiled_mlp=train.tiled_mlp is True,
    )


FLASH = "flash_attention_2"


def flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def attention_implementation(requested: str, *, accelerator: str, precision: str, flash_installed: bool) -> str:
    """`train.attention`: auto is flash-attention 2 where it can run (CUDA, bf16 or fp16, the flash-attn package
    installed), else PyTorch's SDPA; one named must be able to run here."""
    usable = accelerator == "cuda" and precision in ("bf16", "fp16") and flash_installed
    if requested == "auto":
        return FLASH if usable else "sdpa"
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


@dataclass(frozen=True, kw_only=True)
class ZeroSettings:
    """The ZeRO choices of a run (the `deepspeed` config group)."""

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    hpz_partition_size: int = 1


def build(
    *,
    zero: ZeroSettings,
    precision: str,
    micro: int,
    accumulation: int,
    world_size: int,
    lr: float,
    weight_decay: float,
    max_grad_norm: float,
    global_batch: int | None = None,
    accelerator: str = "cpu",
) -> dict:
    """A DeepSpeed config dict (AdamW from DeepSpeed; the LR schedule is the client's) for ranks on `accelerator`. On
    CPU ranks, where memory is what runs out, ZeRO-3 keeps at most 1e8 gathered parameter elements live instead of
    1e9 (figures: docs/scaling.md); on GPUs, offloaded states live in pinned host memory (the copies to and from
    the GPU run asynchronously; on CPU ranks there is no copy to pin for)."""
    section: dict = {"stage": zero.stage}
    if zero.stage > 0:
        section.update(overlap_comm=zero.overlap_comm, contiguous_gradients=zero.contiguous_gradients)
    if zero.stage in (1, 2):
        # reduce_scatter on: DeepSpeed #8382 skipped the all-reduce on CPU with both of these off.
        section.update(reduce_scatter=True)
    if zero.stage == 3:
        section.update(stage3_gather_16bit_weights_on_model_save=False)
        if zero.hpz_partition_size > 1:  # ZeRO++: a secondary copy of the parameters within each group of ranks
            if world_size % zero.hpz_partition_size:
                raise ValueError(
                    f"deepspeed.hpz_partition_size: {zero.hpz_partition_size} does not divide the world size "
                    f"({world_size}); expected the ranks per node"
                )
            section.update(zero_hpz_partition_size=zero.hpz_partition_size)
        if accelerator == "cpu":
            section.update(stage3_max_live_parameters=LEAN_LIVE, stage3_max_reuse_distance=LEAN_LIVE)
    pinned = accelerator == "cuda"
    if zero.offload_optimizer:
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": pinned}
    if zero.offload_param:
        section["offload_param"] = {"device": "cpu", "pin_memory": pinned}
    config = {
        "train_batch_size": check_batch(global_batch, micro=micro, accumulation=accumulation, world_size=world_size),
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": section,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": weight_decay, "torch_adam": True},
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2}
    if zero.offload_optimizer:
        del config["optimizer"]["params"]["torch_adam"]  # offload uses DeepSpeedCPUAdam
    return config


def module_dtype(config: dict):
    """The dtype a DeepSpeed config trains the module in (its fp32 master weights are the optimizer's)."""
    import torch

    if config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    return torch.float16 if config.get("fp16", {}).get("enabled") else torch.float32
