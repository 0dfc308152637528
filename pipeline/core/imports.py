"""DeepSpeed, PEFT and transformers imported without the optional parts they import whenever those are installed but
a run does not use:
- DeepSpeed's autotuner imports MLflow (in every rank);
- ZeRO imports its Muon optimizer (to tell it apart), whose functions are wrapped by torch.compile as it is imported,
  which imports inductor in every rank, though we train with AdamW. Here it is imported with DeepSpeed's own
  no-op decorator in torch.compile's place, so Muon would run uncompiled;
- PEFT and transformers import bitsandbytes for a base that is not quantized, and transformers imports
  scipy.optimize for its object-detection losses;
- DeepSpeed runs py-cpuinfo's CPU probe, a Python process each time, three times in a rank that offloads to CPU
  Adam: here it runs once;
- DeepSpeed's torch backend loads its shared-memory all-reduce op (and probes every op's compatibility first) in
  each rank's init_distributed on a CPU, though only inference_all_reduce uses it: about 2.5 s of every launch, and
  a /dev/shm buffer per rank it never removes.
What each costs: docs/training.md. DeepSpeed is also given one fix here (see zero_init_keeps_dtype).
A None entry in sys.modules is Python's own "not importable": importing it raises ImportError and find_spec finds
nothing, which is how these packages test for their optional dependencies.
`imports.torch` is torch imported at the first read of one of its attributes (`Lazy`), for the modules whose
planning functions the train stage's process uses: it never imports torch on a fresh run (2.1 -> 0.9 s of CPU)."""

from __future__ import annotations

import functools
import importlib
import sys
from types import ModuleType

MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def deepspeed() -> ModuleType:
    """DeepSpeed, imported (the first time) with MLflow absent and its Muon optimizer uncompiled; MLflow stays
    importable afterwards (our tracking imports it when a run logs; DeepSpeed's autotuner, which we never run, is
    left without it)."""
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None
    try:
        import deepspeed as loaded
    finally:
        if hide:
            del sys.modules["mlflow"]
    if MUON not in sys.modules:
        from deepspeed.runtime import compiler

        compile_ = compiler.compile
        compiler.compile = lambda: compiler.dummy_decorator
        try:
            importlib.import_module(MUON)
        finally:
            compiler.compile = compile_
    zero_init_keeps_dtype()
    without_shm_all_reduce()
    cpu_info_once()
    return loaded


def cpu_info_once() -> None:
    """Make py-cpuinfo's get_cpu_info answer once a process. DeepSpeed 0.19.8 calls it three times in a rank that
    offloads its optimizer to CPU Adam (the op's -march and SIMD flags at its JIT load, the vendor in
    DeepSpeedCPUAdam), and each call is a Python process of its own that probes the CPU: 1.2 s, 0.7 s of CPU each on
    a 2-core machine. What it reads does not change while a process runs."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


SHM_ALL_REDUCE = "deepspeed_shm_comm"  # deepspeed.ops.op_builder.cpu.ShareMemCommBuilder.NAME


def without_shm_all_reduce() -> None:
    """Make DeepSpeed's torch backend find its shared-memory all-reduce op incompatible, so init_distributed neither
    probes the ops nor loads it: `__compatible_ops__` (a lazily probed module attribute) is read by build_shm_op
    alone (DeepSpeed 0.19.8), whose op serves inference_all_reduce only; training's all-reduces are
    torch.distributed's (gloo on CPU ranks) either way."""
    import deepspeed.ops

    vars(deepspeed.ops).setdefault("__compatible_ops__", {})[SHM_ALL_REDUCE] = False


def zero_init_keeps_dtype() -> None:
    """Make deepspeed.zero.Init keep the dtype it is given. DeepSpeed 0.19.8 reads `dtype or fp16 if the accelerator
    has fp16 else bf16`: on a CPU without fp16 (AMD's, Intel's before Sapphire Rapids) every ZeRO-3 partition of an
    fp32 run, the base's and the adapter's (the engine converts them through Init), was bf16, the weights rounded
    to bf16 and the run no longer what it was on another machine."""
    from deepspeed.runtime.zero.partition_parameters import Init

    if getattr(Init._set_dtype, "keeps_dtype", False):
        return
    set_dtype = Init._set_dtype

    def keeping(self, ds_config, dtype):
        set_dtype(self, ds_config, dtype)
        self.dtype = dtype or self.dtype

    keeping.keeps_dtype = True
    Init._set_dtype = keeping


class Lazy:
    """A module imported at the first read of one of its attributes: `torch = imports.Lazy("torch")` at the top of a
    module whose functions use torch, so that the processes importing it for its other functions (the train stage's,
    which plans and never touches a tensor) do not import torch (2.1 -> 0.9 s of CPU a launch). Each read is the
    module's attribute as it is then (no copy is kept: a test's monkeypatch is seen)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str):
        return getattr(sys.modules.get(self._name) or importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"Lazy({self._name!r})"


torch = Lazy("torch")  # for the modules the train stage's process imports: it plans, and never touches a tensor

UNUSED = ("bitsandbytes", "scipy")


def without_unused() -> None:
    """Make bitsandbytes and scipy absent for the rest of this process (a run without a quantized base: bitsandbytes
    quantizes, and may use scipy for it). Nothing is hidden once PEFT or transformers are imported: they may have
    found them already, and would then fail to import them."""
    if "transformers" in sys.modules or "peft" in sys.modules:
        return
    for name in UNUSED:
        sys.modules.setdefault(name, None)


def tokenizers_only() -> bool:
    """Make torch absent for the rest of this process, so that transformers imports in its tokenizers-only mode
    (tokenizers and configs: about 70 MB imported, against 250 MB with torch): for a stage that reads a base's
    tokenizer and config and nothing else. Whether it did: not where torch or transformers is imported already."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None
    return True
