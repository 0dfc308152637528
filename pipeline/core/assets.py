"""Locate files shipped inside installed PyPI packages (the offline default model and corpora)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE_SCHEME = "pkg://"


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (some data packages cannot be imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"package '{package}' is not installed; run `make setup` (it installs requirements-assets.txt)"
        )
    return Path(spec.origin).parent


def resolve(path: str) -> Path:
    """Turn 'pkg://PACKAGE/FILE' into the file's real path; other paths are returned as they are."""
    if not path.startswith(PACKAGE_SCHEME):
        return Path(path)
    package, _, rel = path.removeprefix(PACKAGE_SCHEME).partition("/")
    found = package_dir(package) / rel
    if not found.exists():
        raise FileNotFoundError(f"{path}: '{rel}' not found in package '{package}' ({found.parent})")
    return found
