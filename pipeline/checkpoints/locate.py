"""What a user points `consolidate` or `convert` at -> the DeepSpeed tag folder to read, whichever tool wrote it:

- our train stage's folder (`latest` + `step_N/`), or any DeepSpeed save_dir (`latest` + `global_stepN/`);
- an HF Trainer (LLaMA-Factory, axolotl) `checkpoint-N/` folder: a save_dir with the adapter files beside the tag;
- an HF Trainer output_dir holding several `checkpoint-N/`: the newest by N (said in a note);
- a tag folder itself (the one holding `*_model_states.pt`).

Folders that hold a model or an adapter but no DeepSpeed checkpoint (DeepSpeed-Chat's output, HF Trainer with
`save_only_model`) are refused with what to do instead."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints.shard_files import SHARD

LATEST = "latest"
HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class Located:
    """The folder holding the tag (and `latest`, and in HF layouts the adapter files), the tag, and what was chosen."""

    checkpoint_dir: Path
    tag: str
    notes: tuple[str, ...] = ()

    @property
    def tag_dir(self) -> Path:
        return self.checkpoint_dir / self.tag


def is_tag_folder(folder: Path) -> bool:
    """Whether `folder` holds DeepSpeed shard files itself."""
    return folder.is_dir() and any(SHARD.match(p.name) for p in folder.iterdir())


def _tags(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def resolve_tag(checkpoint_dir: Path, tag: str | None) -> str:
    """TAG when given, else the tag `latest` names; each must be a folder of the checkpoint (a missing `latest` is
    refused rather than guessed)."""
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"{checkpoint_dir}: no such checkpoint folder")
    available = _tags(checkpoint_dir)
    if tag is None:
        pointer = checkpoint_dir / LATEST
        if not pointer.is_file():
            _refuse_without_checkpoint(checkpoint_dir)
            raise FileNotFoundError(f"{pointer}: missing; pass --tag (tags here: {available or 'none'})")
        tag = pointer.read_text(encoding="utf-8").strip()
    if not (checkpoint_dir / tag).is_dir():
        raise ValueError(f"{checkpoint_dir}: tag '{tag}' is not a checkpoint here (tags: {available or 'none'})")
    return tag


def locate(path: Path, tag: str | None = None) -> Located:
    """The tag folder `path` (and --tag) designate; see the module docstring for what is accepted."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint folder")
    if is_tag_folder(path):
        if tag is not None and tag != path.name:
            raise ValueError(f"{path}: is the checkpoint tag '{path.name}' itself; --tag {tag} names another")
        return Located(path.parent, path.name)
    runs = {int(m[1]): p for p in path.iterdir() if p.is_dir() and (m := HF_CHECKPOINT.match(p.name))}
    if not (path / LATEST).is_file() and tag is None and runs:
        newest = runs[max(runs)]
        note = f"{path}: picked {newest.name}, the newest of {len(runs)} HF Trainer checkpoint folder(s) (by N)"
        return Located(newest, resolve_tag(newest, None), (note,))
    if tag is not None and not (path / tag).is_dir() and runs:
        holding = [p for _, p in sorted(runs.items()) if (p / tag).is_dir()]
        if len(holding) == 1:
            return Located(holding[0], tag, (f"{path}: tag {tag} found in {holding[0].name}",))
    return Located(path, resolve_tag(path, tag))


def _refuse_without_checkpoint(folder: Path) -> None:
    """A folder with final weights but no DeepSpeed tag: say what it is and what to do with it."""
    names = {p.name for p in folder.iterdir()}
    adapter = sorted(n for n in names if n.startswith("adapter_model."))
    weights = sorted(n for n in names if re.match(r"(pytorch_)?model.*\.(safetensors|bin)$", n))
    if adapter:
        raise ValueError(
            f"{folder}: holds a PEFT adapter ({', '.join(adapter)}) but no DeepSpeed checkpoint (no `latest`, no tag "
            f"folder: HF Trainer with save_only_model=True?): there are no fp32 masters to consolidate; the adapter "
            f"holds the training dtype's values, merge or evaluate it as it is (python -m pipeline merge --adapter "
            f"{folder})"
        )
    if "config.json" in names and weights:
        raise ValueError(
            f"{folder}: holds a whole model ({', '.join(weights)}) but no DeepSpeed checkpoint: DeepSpeed-Chat, like "
            f"save_pretrained, writes merged weights and never engine.save_checkpoint, so there is nothing to "
            f"consolidate; evaluate it as it is (python -m pipeline evaluate --model {folder})"
        )
