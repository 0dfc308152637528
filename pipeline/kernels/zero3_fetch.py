"""ZeRO-3's fetch of a parameter whose partition is the whole tensor on the device already, without a host sync.
Where a parameter's partition group is one rank (one GPU, or each rank of a replicated group), DeepSpeed 0.19.8 does
not gather: its handle points the parameter at its partition and, when the fetch is waited for, synchronizes the host
with the device's stream (`NoGatherHandle`, `NoGatherCoalescedHandle`). That is every module fetch, forward and
backward: the GPU drains before the host prepares the next layer, and waits while it does. The H200's one-GPU ZeRO-3
step waited 238 ms of 500 for its host (docs/gpu.md). Where the partition already lives on the device, nothing was
copied and nothing needs waiting for: the handle marks the parameters available as DeepSpeed's does, without the
sync. A partition elsewhere (parameter offload to the host or NVMe) or quantized is copied or converted, and keeps
DeepSpeed's handle."""

from __future__ import annotations

import torch


def install(engine) -> bool:
    """Fetch on-device single-rank partitions without a host sync (for every ZeRO-3 engine of this process); False
    where the engine is not ZeRO-3."""
    if engine.zero_optimization_stage() != 3:
        return False
    from deepspeed.runtime.zero import partition_parameters

    if not getattr(partition_parameters._no_gather_coalesced, "on_device", False):
        partition_parameters._no_gather_coalesced = _on_device_first(partition_parameters._no_gather_coalesced)
    return True


def _on_device_first(deepspeed_no_gather):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    def on_device(param, here: torch.device) -> bool:
        partition = param.ds_tensor
        return partition is not None and partition.device == here and not hasattr(partition, "ds_quant_scale")

    def no_gather(params):
        params = list(params)
        here = torch.device(get_accelerator().current_device_name())
        if not params or not all(on_device(p, here) for p in params):
            return deepspeed_no_gather(params)
        for param in params:
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                raise RuntimeError(f"expected param {param.ds_summary()} to be released before it is fetched")
            param.ds_status = ZeroParamStatus.INFLIGHT
            param.data = param.ds_tensor.data.view(param.ds_shape)
        return _Fetched(params, ZeroParamStatus)

    no_gather.on_device = True
    return no_gather


class _Fetched:
    """A fetch that copied nothing: the first wait marks its parameters available (DeepSpeed's handles' states); the
    later ones, which DeepSpeed makes once for each parameter of the fetch, return at once, as its handles' do."""

    def __init__(self, params: list, status) -> None:
        self.params, self.status, self.done = params, status, False

    def wait(self, **kwargs) -> None:
        if self.done:
            return
        for param in self.params:
            if param.ds_status == self.status.INFLIGHT:
                param.ds_status = self.status.AVAILABLE
        self.done = True
