"""Stage check (the first): the whole configuration and every input file it names, checked before any stage runs,
so that a bad value stops the pipeline before DVC deletes a single output. Unknown keys get the closest known one
suggested; keys set where they have no effect are refused (or warned about) by name; files are read as the stages
will read them."""

import argparse
from pathlib import Path

from pipeline.core import assets, config
from pipeline.core.atomic import write_json
from pipeline.data import verified
from pipeline.data.textio import verify
from stages._common import run


def produced(path: str, outputs: list[Path]) -> bool:
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


def training_errors(cfg: config.Config, source: Path) -> list[str]:
    """What the train stage would refuse, found now: the batch arithmetic, precision, ranks and sequence-parallel
    split on this machine's world, and LoRA targets named one by one against the model's Linear layers (read from
    its config or GGUF header, on the meta device)."""
    from pipeline.model import lora, outline
    from pipeline.training import cluster, preflight, sequence_parallel
    from pipeline.training import ds_config as dsc

    errors = []
    try:
        launch = dsc.resolve_launch(train=cfg.train, launcher=cfg.launcher)
        size = cfg.train.sequence_parallel
        sequence_parallel.check_world(
            size, world_size=launch.world_size, hpz_partition_size=cfg.deepspeed.hpz_partition_size
        )
        if size > 1:  # the heads and the attention the ranks will split
            config = outline.meta_model(source).config.to_dict()
            sequence_parallel.check_model(size, config=config, attention=launch.attention)
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


def main(args: argparse.Namespace, cfg: config.Config) -> None:
    from pipeline.model.base_import import custom_code

    errors, warnings = config.ineffective(cfg, config.validate(config.compose(args.conf), "conf/"))
    model = cfg.model.path
    try:
        source = assets.resolve(model)
        if not source.exists():
            errors.append(f"model.path: {model} does not exist; expected a .gguf file or an HF model folder")
        elif source.is_dir() and (source / "config.json").is_file() and (reason := custom_code(source)):
            errors.append(reason)
        else:
            errors += training_errors(cfg, source)
    except FileNotFoundError as err:
        errors.append(f"model.path: {err}")
    if cfg.train.resume_from and not (Path(cfg.train.resume_from) / "latest").is_file():
        errors.append(f"train.resume_from: {cfg.train.resume_from} holds no checkpoint ('latest' missing)")
    known, seen = verified.load(args.memo) if args.memo else set(), set()
    for key, path, data_format in inputs(cfg):
        if produced(path, args.produced):
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
    for warning in warnings:
        print(f"check: warning: {warning}")
    if errors:
        raise ValueError("\n".join(dict.fromkeys(errors)))
    if args.memo:
        verified.save(args.memo, known | seen)
    write_json(args.out, {"checked": "params.yaml and the input files it names"})
    print("check: the configuration and its input files are fine")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conf", type=Path, default=Path("conf"), help="the config groups (their defaults)")
    parser.add_argument("--produced", type=Path, nargs="*", default=[], help="folders earlier stages write")
    parser.add_argument("--out", type=Path, required=True, help="written when every check passed")
    parser.add_argument("--memo", type=Path, help="input files already verified (by size and time): not read again")
    run(main, parser)
