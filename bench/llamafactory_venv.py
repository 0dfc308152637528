"""LLaMA-Factory's virtual environment, the benchmarks' peer: built from the package registry (pinned) into the
user's cache folder once per machine (about 140 s of one core, 1.6 GB), shared by clones and worktrees. Standard
library only, so that `make test` can build it with the bare interpreter while pip fills our own venv
(`python3 bench/llamafactory_venv.py`)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

VERSION = "0.9.5"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-lora-pipeline"
VENV = CACHE / f"llamafactory-{VERSION}"
# Same torch and DeepSpeed as ours; LLaMA-Factory pins its own transformers/peft/datasets range.
PINS = [f"llamafactory=={VERSION}", "torch==2.13.0", "deepspeed==0.19.8"]
# It imports torchaudio unconditionally (audio datasets) and no torchaudio wheel loads beside the CPU torch 2.13;
# text training never calls it.
TORCHAUDIO_STUB = '"""Stub: LLaMA-Factory imports torchaudio, text training never uses it."""\n__version__ = "0.0"\n'


def python() -> Path:
    return VENV / "bin" / "python"


def ensure_venv() -> Path:
    """The peer's interpreter, building its environment on first use (a few minutes, from the registry); one process
    builds it while others wait."""
    done = VENV / ".complete"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(f"{VENV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        if not done.exists():
            _build()
            done.write_text(json.dumps(PINS) + "\n")
    return python()


def _build() -> None:
    print(f"bench: building LLaMA-Factory {VERSION}'s environment in {VENV} (once)", flush=True)
    venv.create(VENV, with_pip=True, clear=True)
    pip = [str(python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *PINS], check=True)
    # PyPI's torchvision and torchaudio (pulled in by dependencies) are built against CUDA torch and do not load
    # beside the CPU wheel; text training never needs them.
    subprocess.run([str(python()), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio"], check=False)
    site = subprocess.run(
        [str(python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    stub = Path(site) / "torchaudio"
    if not (stub / "__init__.py").exists():
        stub.mkdir(exist_ok=True)
        (stub / "__init__.py").write_text(TORCHAUDIO_STUB)
    subprocess.run([str(python()), "-c", "import llamafactory, deepspeed"], check=True, capture_output=True)


if __name__ == "__main__":
    print(ensure_venv())
    sys.exit(0)
