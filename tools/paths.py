"""The pipeline's paths as `dvc.yaml` declares them (its `vars`), for the tools and benchmarks that read outputs."""

from __future__ import annotations

from pathlib import Path

import yaml


def dvc_paths(root: Path = Path(".")) -> dict:
    """`vars: - paths: {...}` of root/dvc.yaml, as Paths under `root` (nested groups as dicts)."""
    declared = yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8"))["vars"]
    paths = next(v["paths"] for v in declared if isinstance(v, dict) and "paths" in v)

    def rooted(value):
        return {k: rooted(v) for k, v in value.items()} if isinstance(value, dict) else root / value

    return rooted(paths)
