"""A base named by its hub id (`model.path=Qwen/Qwen3-0.6B`), as every peer takes it: huggingface_hub's own cache
and download (offline, or with the Hub unreachable, read from the cache), pinned to one commit so that a run names
exactly the weights it trained. The check stage resolves the revision (`model.revision`, else the commit its last
run recorded for this id, else `main`) and records the commit in its output; the stages after it read that record.
Only the files a causal LM's import needs are fetched: config, tokenizer, safetensors (never the repo's Python)."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.core import assets
from pipeline.core.atomic import read_json

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")  # owner/name, as the Hub spells repository ids
DESCRIBING = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt"]  # config, generation config, tokenizer files
WEIGHTS = ["*.safetensors"]
PICKLED = ["pytorch_model*.bin"]  # older checkpoints without safetensors: read by the checkpoint loader, weights only
SKIPPED = ["original/*", "consolidated*"]  # the same weights again in the authors' own layout (Llama, Mistral)


def is_hub_id(path: str) -> bool:
    """Whether `model.path` names a hub repository: owner/name, and no such local path or package file."""
    return not path.startswith(assets.PACKAGE_SCHEME) and not Path(path).exists() and bool(HUB_ID.fullmatch(path))


def snapshot(repo_id: str, *, revision: str, weights: bool) -> Path:
    """The cached snapshot folder of `repo_id` at `revision` (its name is the commit), fetched where the Hub is
    reachable; `weights`: the safetensors too, or the PyTorch pickles where the repository has no safetensors (else
    only what describes the model). A revision neither reachable nor cached is refused naming model.path and the
    cache looked in."""
    folder = _fetched(repo_id, revision=revision, patterns=DESCRIBING + (WEIGHTS if weights else []))
    if weights and not any(folder.glob("*.safetensors")):
        folder = _fetched(repo_id, revision=revision, patterns=PICKLED)
    return folder


def _fetched(repo_id: str, *, revision: str, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, ignore_patterns=SKIPPED))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        why = " ".join(f"{type(err).__name__}: {err}".split())
        raise FileNotFoundError(
            f"model.path: {repo_id} is no local path, and revision {revision!r} of that hub repository can neither be "
            f"downloaded nor be found in the cache {constants.HF_HUB_CACHE} ({why}); expected a .gguf file, an HF "
            "model folder, or a hub id that is cached or reachable"
        ) from None


def revision(*, chosen: str | None, recorded: dict, repo_id: str) -> str:
    """The revision to resolve: the one chosen (model.revision), else the commit recorded for `repo_id` (a moving
    branch stays where it was first seen), else `main`."""
    if chosen:
        return chosen
    return recorded["commit"] if recorded.get("hub_id") == repo_id else "main"


def checked_source(path: str, *, chosen: str | None, recorded: dict) -> tuple[Path, dict]:
    """The base the check stage reads at `path` (`chosen`: model.revision), and what its output records of it: a hub
    id's commit ({} for a package file or a local path, where a revision means nothing and is refused)."""
    if not is_hub_id(path):
        if chosen:
            raise ValueError(
                f"model.revision={chosen!r}, but model.path {path} is no hub id (a local path or package file); "
                "expected model.revision=null, or model.path=OWNER/NAME"
            )
        try:
            return assets.resolve(path), {}
        except FileNotFoundError as err:
            raise FileNotFoundError(f"model.path: {err}") from None
    folder = snapshot(path, revision=revision(chosen=chosen, recorded=recorded, repo_id=path), weights=False)
    return folder, {"hub_id": path, "commit": folder.name}


def recorded(checked: Path) -> dict:
    """The hub model the check stage's output `checked` records ({} where it records none, or does not exist)."""
    if not checked.is_file():
        return {}
    return read_json(checked).get("model", {})


def base_source(path: str, *, checked: Path, weights: bool) -> Path:
    """The base at `path` as stages after the check read it: a hub id at the commit `checked` records, a package
    file or a local path as it is."""
    if not is_hub_id(path):
        return assets.resolve(path)
    pinned = recorded(checked)
    if pinned.get("hub_id") != path:
        raise ValueError(f"model.path: {checked} records no commit for {path}; expected the check stage to run first")
    return snapshot(path, revision=pinned["commit"], weights=weights)
