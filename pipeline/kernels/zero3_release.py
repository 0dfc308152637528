"""ZeRO-3's release of a gathered parameter whose partition is kept, without DeepSpeed's partitioning path (any
device). After a module's forward or backward, and for every parameter still gathered at the step's end (the
persistent ones, LoRA's tensors, all of them), DeepSpeed 0.19.8 releases a parameter through `param.partition()`:
three calls deep, each formatting a debug message whether or not it is printed (the parameter's name, id, shape and
device), to reach the one thing left to do when the partition exists already: point the parameter at an empty
tensor and mark it not available. On CPU ranks of a 32-layer model with small matrices (the host's share of an 8B
step on a GPU) that path was 6% of ZeRO-3's step (docs/kernels.md). Where the partition is kept and nothing else
applies (no NVMe partition to swap out, no ZeRO++ secondary partition, data freed, DeepSpeed's debug log off), the
release does that directly, as DeepSpeed's `free_param` does it (the stream recorded on an accelerator that does not
synchronize); otherwise DeepSpeed's own release runs."""

from __future__ import annotations

import logging

import torch

RELEASE = "_PartitionedParameterCoordinator__release_param"  # DeepSpeed's private method, by its mangled name
AVAILABLE = "_PartitionedParameterCoordinator__n_available_params"


def install(engine) -> bool:
    """Release kept partitions directly (for every ZeRO-3 engine of this process); False where the engine is not
    ZeRO-3."""
    if engine.zero_optimization_stage() != 3:
        return False
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    deepspeed_release = getattr(PartitionedParameterCoordinator, RELEASE)
    if not getattr(deepspeed_release, "direct", False):
        setattr(PartitionedParameterCoordinator, RELEASE, _direct_first(deepspeed_release))
    return True


def _direct_first(deepspeed_release):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import logger

    accelerator = get_accelerator()
    record_stream = not accelerator.is_synchronized_device()

    def direct(param) -> bool:
        partition = param.ds_tensor
        return (
            partition is not None
            and partition.final_location != OffloadDeviceEnum.nvme
            and param.ds_zero_param_process_group is None
            and not logger.isEnabledFor(logging.DEBUG)
        )

    def release(coordinator, param, free_data: bool = True) -> None:
        if param.ds_status != ZeroParamStatus.AVAILABLE or param.ds_active_sub_modules:
            return  # DeepSpeed's release leaves it too
        if not (free_data and direct(param)):
            return deepspeed_release(coordinator, param, free_data)
        if record_stream and accelerator.on_accelerator(param.data):
            param.data.record_stream(accelerator.current_stream())  # not freed while a kernel still reads it
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        setattr(coordinator, AVAILABLE, getattr(coordinator, AVAILABLE) - param.ds_numel)

    release.direct, release.replaced = True, deepspeed_release
    return release
