"""ZeRO-1/2's optimizer step without a launch per gradient tensor: the clipping norm and the non-finite check as one
fused pass over the rank's gradient partition.

DeepSpeed's ZeRO-1/2 optimizer checks for overflow tensor by tensor (a sum each, then the flag read back to the host)
and computes the clipping norm tensor by tensor again (each cast to fp64, its norm, a stack), a few launches per
trained tensor: 448 tensors for r=16 on every linear layer of an 8B model, thousands of small launches a step that
the GPU waits for. One non-finite element makes the norm non-finite, so one norm answers both questions: the
partition's tensors go through one multi-tensor norm (fp64 accumulation, as DeepSpeed's), the squares summed,
all-reduced over the data-parallel group as before (several GPUs agree on the norm and the skip), then read back
once. A non-finite norm skips the step as DeepSpeed's overflow does (tests/unit/kernels/test_zero_tail.py: the same
norm within 1e-6, the same losses, an injected inf skips)."""

from __future__ import annotations

from types import MethodType

import torch

NORM_ATTRIBUTE = "_fused_grad_norm"  # this step's norm, computed by the overflow check, read by the clipping


def partition_norm(optimizer) -> torch.Tensor:
    """The L2 norm of every gradient this rank's partition holds, all-reduced over the data-parallel group (fp32,
    non-finite where any element is)."""
    import deepspeed.comm as dist

    squares = []
    for index in range(len(optimizer.bit16_groups)):
        grads = optimizer.averaged_gradients.get(index)
        flat = getattr(grads, "flat_partition", None)  # one buffer: its padding is zeros
        tensors = [flat] if flat is not None else [g for g in grads or () if not getattr(g, "_zero_padding", False)]
        if tensors:
            norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
            squares.append(torch.stack(norms).square().sum())
    device = optimizer.device
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    total = total.to(device=device, dtype=torch.float32)  # DeepSpeed reduces the squares in fp32 too
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
    return total.sqrt()


def _check_overflow(self, partition_gradients: bool = True) -> None:
    norm = partition_norm(self)
    setattr(self, NORM_ATTRIBUTE, norm)
    self.overflow = not bool(torch.isfinite(norm))  # the step's one read back to the host


def _scaled_global_norm(self, norm_type: int = 2) -> torch.Tensor:
    assert norm_type == 2, "only L2 norm supported"
    norm = getattr(self, NORM_ATTRIBUTE, None)
    setattr(self, NORM_ATTRIBUTE, None)
    return partition_norm(self) if norm is None else norm


def usable(optimizer) -> bool:
    """Whether `optimizer` is ZeRO-1/2's with its gradients on the device and no parallelism but data parallelism
    (offload computes its norms on the host as gradients arrive; MoE and model parallelism weigh tensors apart).
    The plan's optimizer is AdamW: Muon's per-group rescaling never applies."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if type(optimizer) is not DeepSpeedZeroOptimizer or optimizer.cpu_offload or optimizer.has_moe_layers:
        return False
    return optimizer.model_parallel_world_size == 1


def install(engine) -> bool:
    """Give the engine's ZeRO-1/2 optimizer the fused overflow check and norm; False (unchanged) where `usable`
    says no."""
    optimizer = engine.optimizer
    if not usable(optimizer):
        return False
    optimizer.check_overflow = MethodType(_check_overflow, optimizer)
    optimizer.scaled_global_norm = MethodType(_scaled_global_norm, optimizer)
    return True
