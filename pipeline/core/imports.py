"""PEFT and transformers imported without the optional parts they import whenever those are installed but a run does
not use: bitsandbytes for a base that is not quantized, and scipy.optimize for transformers' object-detection losses
(what each costs: docs/training.md). DeepSpeed is imported by `core/deepspeed_patches.imported`.
A None entry in sys.modules is Python's own "not importable": importing it raises ImportError and find_spec finds
nothing, which is how these packages test for their optional dependencies.
`imports.torch` is torch imported at the first read of one of its attributes (`Lazy`), for the modules whose
planning functions the train stage's process uses: it never imports torch on a fresh run (2.1 -> 0.9 s of CPU)."""

from __future__ import annotations

import importlib
import sys


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
