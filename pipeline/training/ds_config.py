"""The DeepSpeed config, generated from the deepspeed/train choices (with the launch settings of this machine)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.core.precision import NAMES as DTYPE_NAMES
from pipeline.launching.settings import check_batch

LEAN_LIVE = 100_000_000  # ZeRO-3 gathered elements kept live on CPU ranks (DeepSpeed's default: 1e9)


@dataclass(frozen=True, kw_only=True)
class ZeroSettings:
    """The ZeRO choices of a run (the `deepspeed` config group)."""

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    hpz_partition_size: int = 1


@dataclass(frozen=True, kw_only=True)
class LayerSizes:
    """What ZeRO-3's settings need of the model: the largest LoRA tensor (LoRA's tensors are kept whole on every
    rank: a few MB, gathered in no step) and a decoder layer's parameters (on GPUs the prefetch reaches a layer)."""

    largest_trained: int
    layer: int


ADAM_EPSILON = 1e-8  # AdamW's eps (the update is lr * m / (sqrt(v) + eps)): DeepSpeed's and PyTorch's default


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
    adam_epsilon: float = ADAM_EPSILON,
    global_batch: int | None = None,
    accelerator: str = "cpu",
    sizes: LayerSizes | None = None,
    sequence_parallel: int = 1,
) -> dict:
    """A DeepSpeed config dict (AdamW from DeepSpeed; the LR schedule is the client's) for ranks on `accelerator`. On
    CPU ranks, where memory is what runs out, ZeRO-3 keeps at most 1e8 gathered parameter elements live instead of
    1e9 (figures: docs/scaling.md); on GPUs, offloaded states live in pinned host memory (the copies to and from
    the GPU run asynchronously; on CPU ranks there is no copy to pin for). With `sizes` (ZeRO-3), the LoRA tensors
    stay whole and on GPUs the prefetch reaches a whole layer."""
    section: dict = {"stage": zero.stage}
    if zero.stage > 0:
        section.update(overlap_comm=zero.overlap_comm, contiguous_gradients=zero.contiguous_gradients)
    if zero.stage in (1, 2):
        # reduce_scatter on: DeepSpeed #8382 skipped the all-reduce on CPU with both of these off.
        section.update(reduce_scatter=True)
    if zero.stage == 3:
        section.update(stage3_gather_16bit_weights_on_model_save=False)
        if sequence_parallel > 1:  # the reduction training.sequence_parallel's gradient scale is for
            section.update(reduce_scatter=True)
        if zero.hpz_partition_size > 1:  # ZeRO++: a secondary copy of the parameters within each group of ranks
            if world_size % zero.hpz_partition_size:
                raise ValueError(
                    f"deepspeed.hpz_partition_size: {zero.hpz_partition_size} does not divide the world size "
                    f"({world_size}); expected the ranks per node"
                )
            section.update(zero_hpz_partition_size=zero.hpz_partition_size)
        if accelerator == "cpu":
            section.update(stage3_max_live_parameters=LEAN_LIVE, stage3_max_reuse_distance=LEAN_LIVE)
        if sizes is not None:  # LoRA's tensors whole on every rank; on GPUs a layer prefetched while one computes
            section.update(stage3_param_persistence_threshold=sizes.largest_trained + 1)
            if accelerator == "cuda":
                section.update(stage3_prefetch_bucket_size=max(sizes.layer, 50_000_000))
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
            "params": {
                "lr": lr,
                "betas": [0.9, 0.999],
                "eps": adam_epsilon,
                "weight_decay": weight_decay,
                "torch_adam": True,
            },
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
    if sequence_parallel > 1:  # `world_size` is the data-parallel one: ZeRO-3's zero.Init (no mpu) reads it so
        config["sequence_parallel_size"] = sequence_parallel
    return config


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """A run's DeepSpeed config as typed choices, checked when made; `as_dict()` is the dict DeepSpeed reads."""

    zero: ZeroSettings
    precision: str  # bf16 | fp16 | fp32: what the module trains in (the optimizer keeps fp32 masters)
    micro: int
    accumulation: int
    world_size: int
    lr: float
    weight_decay: float
    max_grad_norm: float
    adam_epsilon: float = ADAM_EPSILON
    global_batch: int | None = None
    accelerator: str = "cpu"
    sizes: LayerSizes | None = None  # ZeRO-3: the model's sizes its settings follow
    sequence_parallel: int = 1  # ranks sharing each sequence: `world_size` is the world over them

    def __post_init__(self) -> None:
        self.as_dict()  # refused now, not when an engine is built

    def as_dict(self) -> dict:
        """The config for deepspeed.initialize (and transformers' ZeRO-3 loading)."""
        return build(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def module_dtype(self):
        """The torch dtype the module trains in."""
        from pipeline.core.precision import DTYPES

        return DTYPES[self.precision]

    @property
    def module_dtype_bytes(self) -> int:
        """The bytes of one element of the module's dtype (without importing torch: the stage plans with it)."""
        return 4 if DTYPE_NAMES[self.precision] == "float32" else 2
