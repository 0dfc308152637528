"""ZeRO-3's parameter lists read once (any device). DeepSpeed 0.19.8 lists a module's parameters each time it fetches,
releases or resets that module (`iter_params`, several times a module and step), and every parameter of the model at
each step's end: each list is a walk of the module tree in Python through `named_parameters`, and a decoder layer
gathered whole is a tree of about 40 modules. On CPU ranks of a 32-layer model with small matrices (the host's share
of an 8B step) these walks were about a quarter of ZeRO-3's step (docs/kernels.md). A model's parameters do not
change once DeepSpeed has built its engine (it numbers them then), so each module's list is kept from its first walk;
parameters registered as external to a module later (DeepSpeed's `register_external_parameter`) are still read at each
call."""

from __future__ import annotations

import itertools
import weakref


def install(engine) -> bool:
    """Keep the parameter lists of a ZeRO-3 engine's modules (for every ZeRO-3 engine of this process); False where
    the engine is not ZeRO-3."""
    if engine.zero_optimization_stage() != 3:
        return False
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    if not getattr(coordinator.iter_params, "kept", False):
        coordinator.iter_params = parameter_offload.iter_params = _kept_iter_params()
    return True


def _kept_iter_params():
    lists = weakref.WeakKeyDictionary()  # module: {recurse: its parameters, in named_parameters' order}

    def iter_params(module, recurse=False):
        kept = lists.setdefault(module, {})
        if recurse not in kept:
            kept[recurse] = tuple(param for _, param in module.named_parameters(recurse=recurse))
        external = module.ds_external_parameters()
        return itertools.chain(kept[recurse], (param for _, param in external)) if external else iter(kept[recurse])

    iter_params.kept = True
    return iter_params
