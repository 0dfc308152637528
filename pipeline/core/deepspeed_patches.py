"""Every patch of DeepSpeed's internals, each written for DeepSpeed `WRITTEN_FOR` (0.19.8): on another version each
is left off with one warning naming it and both versions, and the run goes on with DeepSpeed's own code (the same
results, slower; `zero_init_keeps_dtype` is a fix: without it an fp32 ZeRO-3 run on a CPU without fp16 is bf16).
Each docstring is the issue one would file upstream: what DeepSpeed does and where, its cost here, the fix, why it is
safe. Proofs: tests/unit/core/test_deepspeed_patches.py and the tests each names; figures: docs/kernels.md.

- `imported()`: DeepSpeed imported with MLflow absent (its autotuner, never run here, imports it: 0.8 s and 50 MB a
  rank), then the import-time patches (`muon_uncompiled`, `zero_init_keeps_dtype`, `without_shm_all_reduce`,
  `cpu_info_once`).
- `ENGINE`: the patches `kernels.tune_engine` installs on the engine DeepSpeed built, by the names
  `train.kernels_skip` takes (each True where it applied): `zero_tail`, `zero3_lists`, `zero3_fetch`,
  `zero3_release`, `zero3_flags`."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from pipeline.core import log

WRITTEN_FOR = "0.19.8"  # the DeepSpeed every patch here was read from, measured and tested on
_warned: set[str] = set()


def written_for(patch: str, *, without: str = "the same results, slower") -> bool:
    """Whether this DeepSpeed is the one `patch` was written for; if not, one warning a process says what runs."""
    import deepspeed

    found = deepspeed.__version__.split("+")[0]
    if found != WRITTEN_FOR and patch not in _warned:
        _warned.add(patch)
        note = f"written for DeepSpeed {WRITTEN_FOR}, found {found}; DeepSpeed's own code runs ({without})"
        log.logger("deepspeed").warning(f"{patch} left off: {note}")
    return found == WRITTEN_FOR


def imported() -> ModuleType:
    """DeepSpeed, imported (the first time) with MLflow absent, importable again afterwards; the import-time patches
    applied."""
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # Python's own "not importable"
    try:
        import deepspeed
    finally:
        if hide:
            del sys.modules["mlflow"]
    for patch in (muon_uncompiled, zero_init_keeps_dtype, without_shm_all_reduce, cpu_info_once):
        patch()
    return deepspeed


MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def muon_uncompiled() -> None:
    """ZeRO imports Muon for every optimizer, and Muon compiles at import. `runtime/zero/stage_1_and_2.py`,
    `stage3.py` and `zero/utils.py` import `muon_optimizer` to tell a Muon optimizer apart; its `original_muon.py`
    wraps three functions in `compiler.compile()` (torch.compile) at import, which imports inductor: 1.2 s a rank
    that trains with AdamW. Fix: the module imported with `compiler.compile` answering DeepSpeed's `dummy_decorator`
    (its answer where torch has no compile). Safe: they are DeepSpeed's own functions, run eagerly if Muon is used."""
    if MUON in sys.modules or not written_for("muon_uncompiled"):
        return
    from deepspeed.runtime import compiler

    compile_ = compiler.compile
    compiler.compile = lambda: compiler.dummy_decorator
    try:
        importlib.import_module(MUON)
    finally:
        compiler.compile = compile_


def zero_init_keeps_dtype() -> None:
    """`zero.Init(dtype=torch.float32)` partitions in bf16 on an accelerator without fp16.
    `partition_parameters.py: Init._set_dtype` reads `dtype or torch.float16 if fp16 else torch.bfloat16 if bf16 else
    torch.float32`, which Python groups as `(dtype or fp16) if fp16 else ...`: on a CPU without fp16 (AMD's, Intel's
    before Sapphire Rapids) every partition of an fp32 ZeRO-3 run (the engine converts through Init with its dtype)
    was bf16 (DeepSpeed's open PR #8428 adds the missing `()` to `is_bf16_supported` on that line, not this grouping).
    Fix: the dtype given is kept. Safe: it is what the code means; no dtype given keeps DeepSpeed's rule."""
    from deepspeed.runtime.zero.partition_parameters import Init

    without = "an fp32 ZeRO-3 run partitions in bf16 where the accelerator lacks fp16"
    if getattr(Init._set_dtype, "keeps_dtype", False) or not written_for("zero_init_keeps_dtype", without=without):
        return
    set_dtype = Init._set_dtype

    def keeping(self, ds_config, dtype):
        set_dtype(self, ds_config, dtype)
        self.dtype = dtype or self.dtype

    keeping.keeps_dtype = True
    Init._set_dtype = keeping


def without_shm_all_reduce() -> None:
    """Every CPU rank loads a shared-memory all-reduce that training never calls. `comm/torch.py: build_shm_op`, in
    each `init_distributed`, probes every op's compatibility (`ops.__compatible_ops__`, a lazily built module
    attribute) and loads `deepspeed_shm_comm`, whose op serves `inference_all_reduce` only: 2.7 s a rank, and a
    /dev/shm buffer it never removes. Fix: that op answers incompatible. Safe: training's all-reduces are
    torch.distributed's (gloo) either way."""
    if not written_for("without_shm_all_reduce"):
        return
    import deepspeed.ops

    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False  # ShareMemCommBuilder.NAME


def cpu_info_once() -> None:
    """A rank that offloads to CPU Adam probes the CPU three times. `ops/op_builder/builder.py` (the op's -march and
    SIMD flags at its JIT load) and `ops/adam/cpu_adam.py` (the vendor) call py-cpuinfo's `get_cpu_info`, each a Python
    process of its own: 1.2 s, 0.7 s of CPU each on 2 cores. Fix: py-cpuinfo answers once a process. Safe: what it
    reads does not change while a process runs."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info") and written_for("cpu_info_once"):
        import functools

        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def zero_tail(engine) -> bool:
    """ZeRO-1/2 launch a few kernels per gradient tensor to check overflow and then to clip.
    `runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer.check_overflow` sums each tensor of the partition and reads
    the flag back; `scaled_global_norm` casts each to fp64 for its norm and stacks them: 448 tensors for r=16 on every
    linear layer of an 8B, thousands of small launches a step the GPU waits for. Fix: one non-finite element makes the
    norm non-finite, so one multi-tensor norm (fp64 accumulation) over the partition, the squares all-reduced over the
    data-parallel group as before, answers both with one read back; a non-finite norm skips the step as the overflow
    does. Safe: the same norm within 1e-6 and the same skips on 2 ranks (tests/integration/test_zero_tail.py); not
    installed where the step differs (offload, MoE, model parallelism; `zero_tail_usable`)."""
    if not zero_tail_usable(engine.optimizer) or not written_for("zero_tail"):
        return False
    from types import MethodType

    engine.optimizer.check_overflow = MethodType(_check_overflow, engine.optimizer)
    engine.optimizer.scaled_global_norm = MethodType(_scaled_global_norm, engine.optimizer)
    return True


def zero_tail_usable(optimizer) -> bool:
    """Whether `optimizer` is ZeRO-1/2's, its gradients on the device, with data parallelism alone."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if type(optimizer) is not DeepSpeedZeroOptimizer or optimizer.cpu_offload or optimizer.has_moe_layers:
        return False
    return optimizer.model_parallel_world_size == 1


def partition_norm(optimizer):
    """The L2 norm of every gradient of this rank's partition, all-reduced over the data-parallel group (fp32)."""
    import deepspeed.comm as dist
    import torch

    squares = []
    for index in range(len(optimizer.bit16_groups)):
        grads = optimizer.averaged_gradients.get(index)
        flat = getattr(grads, "flat_partition", None)  # one buffer: its padding is zeros
        tensors = [flat] if flat is not None else [g for g in grads or () if not getattr(g, "_zero_padding", False)]
        if tensors:
            squares.append(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square().sum())
    device = optimizer.device
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    total = total.to(device=device, dtype=torch.float32)  # DeepSpeed reduces the squares in fp32 too
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
    return total.sqrt()


def _check_overflow(self, partition_gradients: bool = True) -> None:
    import torch

    self._fused_grad_norm = partition_norm(self)  # read by the clipping, right after
    self.overflow = not bool(torch.isfinite(self._fused_grad_norm))  # the step's one read back to the host


def _scaled_global_norm(self, norm_type: int = 2):
    assert norm_type == 2, "only L2 norm supported"
    norm, self._fused_grad_norm = getattr(self, "_fused_grad_norm", None), None
    return partition_norm(self) if norm is None else norm


def zero3_lists(engine) -> bool:
    """ZeRO-3 walks a module's tree in Python at every fetch and release. `partitioned_param_coordinator.py` and
    `parameter_offload.py` (runtime/zero/) call `iter_params` (`named_parameters`) several times a module and step,
    and over the whole model at each step's end; a decoder layer gathered whole is about 40 modules: a quarter of a
    CPU rank's step at the host's share of an 8B step (273 -> 227 ms a step; docs/kernels.md). Fix: each module's
    list kept from its first walk; parameters registered as external later (`register_external_parameter`) still
    read at each call. Safe: DeepSpeed numbers the parameters when it builds the engine; none is added after."""
    if engine.zero_optimization_stage() != 3 or not written_for("zero3_lists"):
        return False
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    if not getattr(coordinator.iter_params, "kept", False):
        coordinator.iter_params = parameter_offload.iter_params = _kept_iter_params()
    return True


def _kept_iter_params():
    import itertools
    import weakref

    lists = weakref.WeakKeyDictionary()  # module: {recurse: its parameters, in named_parameters' order}

    def iter_params(module, recurse=False):
        kept = lists.setdefault(module, {})
        if recurse not in kept:
            kept[recurse] = tuple(param for _, param in module.named_parameters(recurse=recurse))
        external = module.ds_external_parameters()
        return itertools.chain(kept[recurse], (param for _, param in external)) if external else iter(kept[recurse])

    iter_params.kept = True
    return iter_params


def zero3_fetch(engine) -> bool:
    """ZeRO-3 syncs the host at every fetch that gathers nothing. Where a partition group is one rank (one GPU),
    `partition_parameters.py: _no_gather_coalesced` returns a `NoGatherCoalescedHandle` whose `wait` synchronizes the
    host with the device's stream: at every module fetch the GPU drains, then waits while the host prepares the next
    layer (the H200's one-GPU step waited 238 of 500 ms for its host; docs/gpu.md). Fix: where every partition of the
    fetch is the whole tensor on this device, the parameters are marked in flight, then available, as the handle does,
    without the sync. Safe: nothing was copied, so nothing is waited for; a partition offloaded or quantized keeps
    DeepSpeed's handle."""
    if engine.zero_optimization_stage() != 3 or not written_for("zero3_fetch"):
        return False
    from deepspeed.runtime.zero import partition_parameters

    if not getattr(partition_parameters._no_gather_coalesced, "on_device", False):
        partition_parameters._no_gather_coalesced = _on_device_first(partition_parameters._no_gather_coalesced)
    return True


def _on_device_first(deepspeed_no_gather):
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    def on_device(param, here) -> bool:
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
        return Fetched(params, ZeroParamStatus)

    no_gather.on_device = True
    return no_gather


class Fetched:
    """A fetch that copied nothing: the first wait marks its parameters available; the later ones (DeepSpeed waits
    once for each parameter of the fetch) return at once, as its handles' do."""

    def __init__(self, params: list, status) -> None:
        self.params, self.status, self.done = params, status, False

    def wait(self, **kwargs) -> None:
        if not self.done:
            for param in self.params:
                if param.ds_status == self.status.INFLIGHT:
                    param.ds_status = self.status.AVAILABLE
            self.done = True


RELEASE = "_PartitionedParameterCoordinator__release_param"  # DeepSpeed's private method, by its mangled name
AVAILABLE = "_PartitionedParameterCoordinator__n_available_params"


def zero3_release(engine) -> bool:
    """ZeRO-3 formats debug messages at every release. `partitioned_param_coordinator.py: __release_param` calls
    `param.partition()`, three calls deep, each formatting the parameter's name, id, shape and device for a debug
    line whether or not it prints, to do what is left once the partition exists: point the parameter at an empty
    tensor and mark it not available; after every module's forward and backward and for every persistent parameter at
    each step's end: 6% of a CPU rank's step at the host's share of an 8B step (273 -> 260 ms). Fix: where the
    partition is kept and nothing else applies (no NVMe, no ZeRO++ secondary partition, data freed, debug log off),
    that directly, as `free_param` does it (the stream recorded on an accelerator). Safe: otherwise DeepSpeed's own."""
    if engine.zero_optimization_stage() != 3 or not written_for("zero3_release"):
        return False
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    deepspeed_release = getattr(PartitionedParameterCoordinator, RELEASE)
    if not getattr(deepspeed_release, "direct", False):
        setattr(PartitionedParameterCoordinator, RELEASE, _direct_first(deepspeed_release))
    return True


def _direct_first(deepspeed_release):
    import logging

    import torch
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


def zero3_flags(engine) -> bool:
    """ZeRO-3 walks the whole module tree twice a forward to flag it. So that a module reading another's parameter
    gathers it, `runtime/engine.py: _forward_prologue` and `_forward_epilogue` set each module's `ZeROOrderedDict`
    in or out of a forward pass through `self.module.modules()`: about 2,700 modules for a LoRA model of 32 layers,
    12.5 ms of a CPU rank's step at the host's share of an 8B step (171 -> 158 ms). Fix: the dicts listed once, the
    flag set through that list, the rest of DeepSpeed's prologue and epilogue run with their walk skipped (told "no
    partitioned weights" for the call). Safe: a model's modules do not change once the engine is built."""
    if engine.zero_optimization_stage() != 3 or not written_for("zero3_flags"):
        return False
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    modules = list(engine.module.modules())
    for module in modules:
        ensure_zero_ordered_dict(module)
    flags = tuple(module._parameters for module in modules if isinstance(module._parameters, ZeROOrderedDict))
    engine_class = type(engine)
    engine._forward_prologue = _flagging(engine, engine_class._forward_prologue, flags, in_forward=True)
    engine._forward_epilogue = _flagging(engine, engine_class._forward_epilogue, flags, in_forward=False)
    return True


def _flagging(engine, deepspeed_method, flags: tuple, *, in_forward: bool):
    def partitions_no_weights() -> bool:
        return False

    def method(*args):
        for parameters in flags:
            parameters._in_forward = in_forward
        engine.zero_optimization_partition_weights = partitions_no_weights
        try:
            return deepspeed_method(engine, *args)
        finally:
            del engine.zero_optimization_partition_weights

    return method


ENGINE = {
    "zero_tail": zero_tail,
    "zero3_lists": zero3_lists,
    "zero3_fetch": zero3_fetch,
    "zero3_release": zero3_release,
    "zero3_flags": zero3_flags,
}
