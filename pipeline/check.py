"""The whole configuration and every input file it names, checked before any stage runs (the check stage's one
call), so that a bad value stops the pipeline before DVC deletes a single output: keys set where they have no effect
refused (or warned about) by name; the model folder, the launch (batch arithmetic, precision, ranks, every node) and
LoRA targets named one by one against the model's Linear layers; the resume point; the input files read as the stages
will read them (those unchanged since they were last found valid are not read again)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.core import assets, config
from pipeline.data import verified
from pipeline.data.textio import verify


@dataclass(frozen=True, kw_only=True)
class Checked:
    """What the check found: errors (each once), warnings, and the identities of the input files found valid."""

    errors: list[str]
    warnings: list[str]
    verified: set[str]


def check(cfg: config.Config, *, defaults: config.Config, produced: list[Path], known: set[str]) -> Checked:
    """Every problem of `cfg` (composed with `defaults`: conf/ as it stands), input files in folders an earlier
    stage writes (`produced`) left to that stage, files whose identity is in `known` taken as valid."""
    errors, warnings = config.ineffective(cfg, defaults)
    errors += model_errors(cfg)
    if cfg.train.resume_from and not (Path(cfg.train.resume_from) / "latest").is_file():
        errors.append(f"train.resume_from: {cfg.train.resume_from} holds no checkpoint ('latest' missing)")
    seen = set()
    for key, path, data_format in inputs(cfg):
        if is_produced(path, produced):
            continue
        data_format = "text" if data_format == "texts" and not path.endswith(".jsonl") else data_format
        if (file := verified.identity(path, data_format)) in known:
            seen.add(file)  # unchanged since it was read and found valid
            continue
        try:
            check_file(key, path, data_format)
            seen.add(file)
        except ValueError as err:
            errors.append(str(err))
    return Checked(errors=list(dict.fromkeys(errors)), warnings=warnings, verified=seen)


def is_produced(path: str, outputs: list[Path]) -> bool:
    """Whether `path` lies in a folder an earlier stage writes (it need not exist yet)."""
    return any(Path(path).resolve().is_relative_to(out.resolve()) for out in outputs)


def check_file(key: str, path: str, data_format: str) -> None:
    """`path` read as the stage that uses it will: text lines, or JSONL rows of the format's fields."""
    try:
        verify(path, data_format)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"{key}: {err}") from None


def inputs(cfg: config.Config) -> list[tuple[str, str, str]]:
    """(key, path, format) of every input file the configuration names."""
    d, t = cfg.data, cfg.tokenizer
    files = [("data.train_file", d.train_file, d.format), ("data.heldout_file", d.heldout_file, d.format)]
    files += [(f"data.sources.{i}.file", s.file, s.format) for i, s in enumerate(d.sources)]
    if t.extend:
        files += [("tokenizer.train_file", t.train_file, "texts"), ("tokenizer.heldout_file", t.heldout_file, "texts")]
    files += [(f"eval.sets.{n}", p, "text" if not p.endswith(".jsonl") else "jsonl") for n, p in cfg.eval.sets.items()]
    return files


def model_errors(cfg: config.Config) -> list[str]:
    """The model path: there, no code of its own, and (then) what training it would refuse."""
    from pipeline.model.base_import import custom_code

    model = cfg.model.path
    try:
        source = assets.resolve(model)
        if not source.exists():
            return [f"model.path: {model} does not exist; expected a .gguf file or an HF model folder"]
        if source.is_dir() and (source / "config.json").is_file() and (reason := custom_code(source)):
            return [reason]
        return training_errors(cfg, source)
    except FileNotFoundError as err:
        return [f"model.path: {err}"]


def training_errors(cfg: config.Config, source: Path) -> list[str]:
    """What the train stage would refuse, found now: the batch arithmetic, precision and ranks on this machine's
    world, and LoRA targets named one by one against the model's Linear layers (read from its config or GGUF
    header, on the meta device)."""
    from pipeline.launching import cluster, preflight
    from pipeline.launching.settings import resolve_launch
    from pipeline.model import lora, outline

    errors = []
    try:
        resolve_launch(train=cfg.train, launcher=cfg.launcher)
        if cfg.launcher.mode in ("ssh", "slurm"):  # every node answers with this code (shared folder: train)
            preflight.check_nodes(cluster.resolve(cfg.launcher), checkpoints=None)
    except (ValueError, FileNotFoundError) as err:
        errors.append(str(err))
    if cfg.lora.target_modules != lora.ALL_LINEAR:
        try:
            layers = outline.of_model(outline.meta_model(source))
            lora.check_targets(layers, list(cfg.lora.target_modules), list(cfg.lora.modules_to_save))
        except ValueError as err:
            errors.append(str(err))
    return errors
