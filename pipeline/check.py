"""The whole configuration and every input file it names, checked before any stage runs (the check stage's one
call), so that a bad value stops the pipeline before DVC deletes a single output: keys set where they have no effect
refused (or warned about) by name; the model folder, the launch (batch arithmetic, precision, ranks, every node) and
LoRA targets named one by one against the model's Linear layers; the resume point; the input files read as the stages
will read them (those unchanged since they were last found valid are not read again; the data's format found from its
first row with data.format=auto, and matched to train.objective); where rows are involved, the first ones tokenized
with the base's tokenizer as the stages will (a warning when data.max_seq_len cuts more than a small share of them;
each evaluation set's first rows scored as evaluate does)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from pipeline.core import config
from pipeline.data import tables, truncation, verified
from pipeline.data.formats import template_for
from pipeline.data.inputs import (
    Dropped,
    data_files,
    detected_format,
    heldout_path,
    items,
    kind,
    resolved_format,
    unused_columns,
)
from pipeline.data.textio import verify
from pipeline.model import hub

TRIED_ROWS = 8  # rows of each evaluation set tried as evaluate will score them


@dataclass(frozen=True, kw_only=True)
class Checked:
    """What the check found: errors (each once), warnings, and the identities of the input files found valid."""

    errors: list[str]
    warnings: list[str]
    verified: set[str]
    model: dict  # the hub model's commit (hub.checked_source), {} for a local base


def check(
    cfg: config.Config,
    *,
    defaults: config.Config,
    produced: list[Path],
    known: set[str],
    tokenizer_memo: Path | None,
    pinned: dict,
) -> Checked:
    """Every problem of `cfg` (composed with `defaults`: conf/ as it stands), input files in folders an earlier
    stage writes (`produced`) left to that stage, files whose identity is in `known` taken as valid; a .gguf base's
    tokenizer kept in the folder `tokenizer_memo` (None: read from the file each time); a hub base resolved at the
    commit `pinned` records for it, unless model.revision chooses one."""
    errors, warnings = config.ineffective(cfg, defaults)
    try:
        source, model = hub.checked_source(cfg.model.path, chosen=cfg.model.revision, recorded=pinned)
    except (ValueError, FileNotFoundError) as err:
        return Checked(errors=[*errors, str(err)], warnings=warnings, verified=set(), model={})
    errors += model_errors(cfg, source)
    if cfg.train.resume_from and not (Path(cfg.train.resume_from) / "latest").is_file():
        errors.append(f"train.resume_from: {cfg.train.resume_from} holds no checkpoint ('latest' missing)")
    found, cautions, seen = data_findings(
        cfg, source=source, produced=produced, known=known, tokenizer_memo=tokenizer_memo
    )
    errors = list(dict.fromkeys(errors + found))
    return Checked(errors=errors, warnings=warnings + cautions, verified=seen, model=model)


def is_produced(path: str, outputs: list[Path]) -> bool:
    """Whether `path` lies in a folder an earlier stage writes (it need not exist yet)."""
    return any(Path(path).resolve().is_relative_to(out.resolve()) for out in outputs)


def check_file(key: str, path: str, data_format: str, *, max_bad_rows: float) -> str | None:
    """`path` read as the stage that uses it will: text lines, or JSONL rows of the format's fields; the warning
    naming the rows it drops for holding no text, if any, refused where they are more than `max_bad_rows` of its
    rows (`Dropped.refusal`)."""
    dropped = Dropped()
    try:
        kept = verify(path, data_format, dropped=dropped)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"{key}: {err}") from None
    if refused := dropped.refusal(key, rows=kept + len(dropped.positions), max_share=max_bad_rows):
        raise ValueError(refused)
    return dropped.warning(key)


def inputs(cfg: config.Config, data_format: str) -> list[tuple[str, str, str]]:
    """(key, path, format) of every input file the configuration names ("auto": as its first row shows); the held-out
    part where it is read from (a DatasetDict folder's held-out split)."""
    d, t = cfg.data, cfg.tokenizer
    heldout = heldout_path(d.train_file, d.heldout_file) or d.heldout_file
    files = [("data.train_file", d.train_file, data_format), ("data.heldout_file", heldout, data_format)]
    files += [(f"data.sources.{i}.file", s.file, s.format) for i, s in enumerate(d.sources)]
    if t.extend:
        files += [("tokenizer.train_file", t.train_file, "texts"), ("tokenizer.heldout_file", t.heldout_file, "texts")]
    own = () if d.sources else (d.train_file, d.heldout_file)
    files += [(f"eval.sets.{n}", p, data_format if p in own else "auto") for n, p in cfg.eval.sets.items()]
    return files


def data_findings(
    cfg: config.Config, *, source: Path, produced: list[Path], known: set[str], tokenizer_memo: Path | None
) -> tuple[list[str], list[str], set[str]]:
    """(errors, warnings, files found valid) about the data: its format, every input file read as its stage will
    (those in `known` are unchanged since they were; rows with no text dropped, with a warning, up to
    data.max_bad_rows of a file's rows), then the first rows tokenized with the tokenizer of the base at `source`
    where any input holds rows (`sample_findings`)."""
    from pipeline.data.tokenizer import model_tokenizer

    data_format, errors = format_errors(cfg)
    if data_format is None:
        return errors, [], set()
    seen, row_sets, said, dropped, unread = set(), {}, set(), [], {}
    try:
        files = inputs(cfg, data_format)
    except ValueError as err:  # a DatasetDict folder's dataset_dict.json unreadable
        return [f"data.train_file: {err}"], [], set()
    for key, path, read_as in files:
        if is_produced(path, produced):
            continue
        try:
            read_as = detected_format(path) if read_as == "auto" else read_as
            if read_as == "texts" and all(kind(file) == "text" for file in data_files(path)):
                read_as = "text"  # the same reading as the data's text files (one verification for both)
            columns = tuple(unused_columns(path, read_as)) if read_as != "texts" else ()
            if columns and (columns, read_as) not in unread:  # said once, as the first key naming them
                names = ", ".join(repr(c) for c in columns)
                unread[columns, read_as] = (
                    f"{key}: column(s) {names} are not used by data.format={read_as}"  # a table's, or JSON rows' fields
                )
        except (ValueError, FileNotFoundError) as err:
            errors.append(f"{key}: {err}")
            continue
        if key.startswith("eval.sets.") and read_as != "text":
            row_sets[key.removeprefix("eval.sets.")] = read_as
        if (file := verified.identity(path, read_as)) in known | seen:
            seen.add(file)  # unchanged since it was read and found valid
            continue
        if file in said:  # read under another key: its dropped rows (or its refusal) said once
            continue
        said.add(file)
        try:
            warning = check_file(key, path, read_as, max_bad_rows=cfg.data.max_bad_rows)
        except ValueError as err:
            errors.append(str(err))
            continue
        if warning is None:
            seen.add(file)
        else:  # not remembered: the next check reads it again and says it again
            dropped.append(warning)
    dropped = unused_splits(cfg) + list(unread.values()) + dropped
    if errors or (data_format == "text" and not row_sets):
        return errors, dropped, seen
    try:
        tokenizer = model_tokenizer(source, tokenizer_memo)
    except (ValueError, FileNotFoundError) as err:
        return [f"model.path: {err}"], dropped, seen
    found, warnings = sample_findings(cfg, data_format, row_sets, tokenizer)
    return found, dropped + warnings, seen


def unused_splits(cfg: config.Config) -> list[str]:
    """The warning naming the splits of a DatasetDict training folder that are neither trained on nor held out."""
    d, folder = cfg.data, Path(cfg.data.train_file)
    if not (folder / "dataset_dict.json").is_file():
        return []
    held = tables.heldout_split(folder) if d.heldout_file == d.train_file else None
    left = [name for name in tables.splits(folder) if name not in ("train", held and held.name)]
    if not left:
        return []
    return [f"data.train_file: split(s) {', '.join(map(repr, left))} of {folder} are not used (training: 'train')"]


def format_errors(cfg: config.Config) -> tuple[str | None, list[str]]:
    """The training data's format (data.format, or with auto what its first row shows) and what is wrong with it:
    a row no format fits, or pairs without a preference objective (and the other way round)."""
    d = cfg.data
    try:
        data_format = resolved_format(d.format, d.train_file, [s.format for s in d.sources])
    except (ValueError, FileNotFoundError) as err:
        return None, [f"data.train_file: {err}"]
    pairs, objective = data_format == "preference", cfg.train.objective
    if d.format == "auto" and pairs != (objective != "lm"):
        fix = "-S train.objective=dpo (or orpo, simpo)" if pairs else "-S train.objective=lm"
        found = "preference pairs" if pairs else f"{data_format} data"
        return data_format, [
            f"data.format=auto: {d.train_file} holds {found} (its first row); train.objective={objective} trains on "
            f"{'text or instructions' if objective == 'lm' else 'pairs'}; expected {fix}"
        ]
    return data_format, []


def sample_findings(cfg: config.Config, data_format: str, sets: dict[str, str], tokenizer) -> tuple[list, list]:
    """(errors, warnings) from the first rows tokenized as the stages will: the training rows' truncation at
    data.max_seq_len (a sample of truncation.SAMPLE_ROWS), and each row set's first TRIED_ROWS scored as evaluate
    scores them."""
    from pipeline.evaluation.likelihood import set_examples
    from pipeline.evaluation.preference import load_pairs

    d, errors, warnings = cfg.data, [], []
    template = template_for(data_format, d.prompt_template)
    if data_format != "text" and not d.sources:
        try:
            rows = list(islice(items(d.train_file, data_format), truncation.SAMPLE_ROWS))
            counts = truncation.sample(
                tokenizer, rows, data_format=data_format, template=template, max_seq_len=d.max_seq_len
            )
            sampled = len(rows) == truncation.SAMPLE_ROWS
            warnings += truncation.warnings(counts, max_seq_len=d.max_seq_len, sampled=sampled)
            if refused := truncation.refusal(counts, max_seq_len=d.max_seq_len, sampled=sampled):
                errors.append(refused)
        except ValueError as err:
            errors.append(f"data.train_file: {err}")
    for name, set_as in sets.items():
        path, key = cfg.eval.sets[name], f"eval.sets.{name}"
        try:
            set_examples(
                tokenizer,
                islice(items(path, set_as), TRIED_ROWS),
                data_format=set_as,
                template=template,
                max_bytes=None,
            )
            if set_as == "preference":
                load_pairs(tokenizer, path, template=template, max_seq_len=d.max_seq_len, key=key, max_bytes=1)
        except ValueError as err:
            errors.append(f"{key}: {err}")
    return errors, warnings


def model_errors(cfg: config.Config, source: Path) -> list[str]:
    """The base (model.path, found at `source`): there, no code of its own, and (then) what training it would
    refuse."""
    from pipeline.model.remote_code import custom_code, not_causal

    if not source.exists():
        return [
            f"model.path: {cfg.model.path} does not exist; expected a .gguf file, an HF model folder or a hub id "
            "(OWNER/NAME)"
        ]
    folder = source.is_dir() and (source / "config.json").is_file()
    if folder and (reason := custom_code(source) or not_causal(source)):
        return [reason]
    return training_errors(cfg, source)


def model_config(source: Path) -> dict:
    """The config of the model at `source` as transformers reads it (an HF folder's, or a GGUF file's header), with
    its class's defaults."""
    from transformers import AutoConfig

    if source.is_dir():
        return AutoConfig.from_pretrained(source).to_dict()
    return AutoConfig.from_pretrained(source.parent, gguf_file=source.name).to_dict()


def training_errors(cfg: config.Config, source: Path) -> list[str]:
    """What the train stage would refuse, found now: the batch arithmetic, precision, ranks and sequence-parallel
    split on this machine's world, and LoRA targets named one by one against the model's Linear layers (read from
    its config or GGUF header, on the meta device)."""
    from pipeline.export import gguf
    from pipeline.launching import cluster, preflight
    from pipeline.launching.settings import check_world, resolve_launch
    from pipeline.training.sequence_parallel import check_model

    try:
        architecture = model_config(source)
    except (ValueError, OSError) as err:
        return [f"model.path: transformers cannot read the config of {source} ({err})"]
    errors = []
    try:
        launch = resolve_launch(train=cfg.train, launcher=cfg.launcher, model_config=architecture)
        size = cfg.train.sequence_parallel
        check_world(size, world_size=launch.world_size, hpz_partition_size=cfg.deepspeed.hpz_partition_size)
        check_model(size, config=architecture, attention=launch.attention)  # the heads and attention ranks split
        if cfg.launcher.mode in ("ssh", "slurm"):  # every node answers with this code (shared folder: train)
            preflight.check_nodes(cluster.resolve(cfg.launcher), checkpoints=None)
    except (ValueError, FileNotFoundError) as err:
        errors.append(str(err))
    if cfg.export.gguf and (problem := gguf.architecture_problem(architecture)):
        errors.append(f"export.gguf: true, but the base's {problem}; expected export.gguf=false for it")
    if isinstance(cfg.lora.target_modules, list):  # named one by one (not all-linear): torch's meta model
        from pipeline.model import lora, outline

        try:
            layers = outline.of_model(outline.meta_model(source))
            lora.check_targets(layers, list(cfg.lora.target_modules), list(cfg.lora.modules_to_save))
        except ValueError as err:
            errors.append(str(err))
    return errors
