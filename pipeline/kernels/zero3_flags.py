"""ZeRO-3's "in a forward pass" flags set through a list read once (any device). So that a module reading another
module's parameter gathers it (DeepSpeed's external parameters), DeepSpeed 0.19.8 flags every module's parameter
dict (`ZeROOrderedDict`) as in a forward pass before the model's forward and clears it after, each time walking the
whole module tree in Python (`engine.module.modules()`, in `_forward_prologue` and `_forward_epilogue`). A LoRA
model of 32 layers is about 2,700 modules: 12.5 ms of a CPU rank's step at tools/host_step's shape (the host's share
of an 8B step on a GPU; docs/kernels.md). A model's modules do not change once DeepSpeed has built its engine (the
ground zero3_lists stands on too), so their dicts are listed once; the engine's prologue and epilogue set the flag
through that list and run the rest of DeepSpeed's own, its walk left out."""

from __future__ import annotations


def install(engine) -> bool:
    """Flag the forward passes of this ZeRO-3 engine through its modules' dicts listed now; False where the engine is
    not ZeRO-3."""
    if engine.zero_optimization_stage() != 3:
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


def uninstall(engine) -> None:
    """DeepSpeed's own prologue and epilogue again (tools/host_step compares the two on one engine)."""
    for name in ("_forward_prologue", "_forward_epilogue"):
        engine.__dict__.pop(name, None)


def _flagging(engine, deepspeed_method, flags: tuple, *, in_forward: bool):
    """DeepSpeed's `deepspeed_method` of `engine` with the flags set first and its own walk over the modules skipped
    (the one thing it does where the engine partitions weights)."""

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
