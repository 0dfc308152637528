"""`python -m tests.helpers.without_torch MODULE ARGS...` runs MODULE as `python -m MODULE ARGS...` does, with torch
not importable in this process (its children import what they like): a process that must not import torch (the
train stage's, which plans and starts the ranks) fails, naming what imported it, where it does."""

from __future__ import annotations

import runpy
import sys


class RefuseTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} imported in a process that must not import torch")
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, RefuseTorch())
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
