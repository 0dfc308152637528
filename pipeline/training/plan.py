"""A training run resolved once, by the stage, into frozen dataclasses: where everything is, the launch (world,
precision, batch split), the model and schedule, what it resumes from and whether it is already finished. Written as
one file (`plan.json` in the checkpoint folder) that each rank reads, and nothing else."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pipeline import kernels
from pipeline.checkpoints import adapter, folder
from pipeline.core import config
from pipeline.core.atomic import atomic_path, read_json
from pipeline.core.log import logger
from pipeline.data.tokenizer import META, light_tokenizer, load_tokenizer
from pipeline.launching.settings import Launch, check_world
from pipeline.model import outline
from pipeline.model.lora import ALL_LINEAR, LoraSpec, check_targets, describe_targets, resolve_targets
from pipeline.training import ds_config as dsc
from pipeline.training import initial, memory_estimate
from pipeline.training.preference import Objective
from pipeline.training.schedule import Schedule
from pipeline.training.sequence_parallel import check_model

log = logger("train")

FILE = "plan.json"
# Not part of a training trajectory: reporting and checkpointing, how the global batch is split into micro-batches
# and accumulation steps (a resume under another world size re-splits it), and how fast the same arithmetic runs.
UNTRACKED_TRAIN_KEYS = (
    "eval_every",
    "eval_max_rows",
    "save_every",
    "keep_last",
    "resume_from",
    "convert_layout",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "gradient_checkpointing",
    "kernels",
    "kernels_skip",
    "attention",
    "sequence_parallel",
    "tiled_mlp",
    "init_adapter",
)  # fmt: skip  (init_adapter: its tensors' digest is tracked instead of its path)


@dataclass(frozen=True, kw_only=True)
class Paths:
    """Where the run reads and writes (the stage's arguments)."""

    base: Path
    tokenizer: Path
    dataset: Path
    checkpoints: Path
    metrics: Path
    curve: Path
    run_id_file: Path
    tensorboard: Path | None = None
    final_state: Path | None = None  # tests: the gathered fp32 trainable tensors at the end
    loaded_state: Path | None = None  # tests: the state the run resumed from, with Adam's moments


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    lr: float
    weight_decay: float
    lr_ratio: float | None  # LoRA+: B's learning rate over A's


@dataclass(frozen=True, kw_only=True)
class Tracking:
    uri: str
    experiment: str
    tensorboard: bool


@dataclass(frozen=True, kw_only=True)
class Resume:
    """What the ranks start from: nothing, a checkpoint folder's newest tag (this run's, or `train.resume_from`'s),
    or a universal checkpoint converted from another layout; `finished` holds the figures when this run's final
    checkpoint is already there (the ranks then only write what tests ask for)."""

    source: Path | None = None
    universal: Path | None = None
    finished: dict | None = None


@dataclass(frozen=True, kw_only=True)
class Identity:
    """The model a run trains: its checkpoints resume only into the same (`checkpoints.folder.check_same_model`)."""

    base_config: str  # digest of the base's config.json
    vocab_rows: int
    lora_r: int
    target_modules: list[str]
    modules_to_save: list[str]
    use_dora: bool


@dataclass(frozen=True, kw_only=True)
class Variant:
    """What kind of adapter the run trains (DoRA, LoRA+, QLoRA): carried to the adapter, merge, evaluate and MLflow."""

    use_dora: bool
    lr_ratio: float | None
    quantization: str
    compute_dtype: str | None
    load_dtype: str  # the dtype the base is loaded (and quantized) from


@dataclass(frozen=True, kw_only=True)
class RunState:
    """What identifies a run's checkpoints, kept in every one of them (`saved()`): the fingerprint of its trajectory,
    the model, the layout (world size, ZeRO stage), the launch settings and the adapter's variant."""

    fingerprint: str
    identity: Identity
    world_size: int
    zero_stage: int
    launch: dict  # the Launch settings less num_nodes (one world of N ranks trains alike on any number of nodes)
    variant: Variant

    def saved(self) -> dict:
        """As a checkpoint's trainer state holds it (JSON)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Plan:
    paths: Paths
    launch: Launch
    schedule: Schedule
    lora: LoraSpec  # target_modules resolved to the base's layer names
    optimizer: Optimizer
    tracking: Tracking
    kernels: str
    kernels_skip: list[str]  # train.kernels_skip: paths left out
    checkpointing: str  # how launch.gradient_checkpointing was decided (auto: from the memory estimate)
    checkpointed_layers: int | None  # with checkpointing, the decoder layers that recompute (None: all)
    zero_stage: int
    ds_config: dsc.EngineConfig
    run_state: RunState
    pad_token_id: int
    objective: Objective
    init_adapter: Path | None = None  # the adapter the run starts from (training.initial)
    resume: Resume = Resume()


def vocab_rows(base_rows: int, tokenizer: Path, resize: bool) -> int:
    """Embedding rows for training: the tokenizer's padded size, or the model's when resizing is off."""
    meta = read_json(tokenizer / META)
    if resize:
        return max(base_rows, meta["padded_vocab_size"])
    if meta["vocab_size"] > base_rows:
        raise ValueError(
            f"train.resize_embeddings: false, but the tokenizer has {meta['vocab_size']} tokens and the model "
            f"{base_rows} embedding rows; expected resize_embeddings=true or a tokenizer of at most {base_rows} tokens"
        )
    return base_rows


def variant(lora: config.LoraConfig, launch: Launch) -> Variant:
    """What kind of adapter this run trains, resolved (the compute dtype) and checked where it can be before a launch:
    bitsandbytes must quantize on this accelerator. Checkpoints carry it to the adapter, merge, evaluate and MLflow."""
    quantized = lora.quantization != "none"
    if quantized:
        from pipeline.model.quantization import check_available, check_available_apart

        probe = check_available_apart if launch.accelerator == "cuda" else check_available
        version = probe(lora.quantization, launch.accelerator)
        log.info(f"the base is loaded in {lora.quantization} by bitsandbytes {version} on every rank")
    compute = lora.compute_dtype if lora.compute_dtype != "auto" else launch.precision
    return Variant(
        use_dora=lora.use_dora,
        lr_ratio=lora.lr_ratio,
        quantization=lora.quantization,
        compute_dtype=compute if quantized else None,
        load_dtype=launch.precision,
    )


def run_state(
    *, paths: Paths, lora: config.LoraConfig, train: config.TrainConfig, zero_stage: int, launch: Launch
) -> RunState:
    """What identifies this run's checkpoints: the model it trains and the fingerprint of its trajectory; checked."""
    layers = outline.read(paths.base)
    targets = resolve_targets(layers, lora.target_modules)
    check_targets(layers, targets, lora.modules_to_save)
    if lora.target_modules == ALL_LINEAR:
        log.info(f"lora.target_modules all-linear is {len(targets)} layers: {describe_targets(targets)}")
    base_rows = read_json(paths.base / "config.json")["vocab_size"]
    rows = vocab_rows(base_rows, paths.tokenizer, train.resize_embeddings)
    if rows > base_rows and "embed_tokens" not in lora.modules_to_save:
        raise ValueError(
            f"lora.modules_to_save: the vocabulary grows from {base_rows} to {rows} rows but embed_tokens is not "
            f"trained, so every new token would keep its initial embedding; expected [embed_tokens, lm_head]"
        )
    identity = Identity(
        base_config=folder.file_digest([paths.base / "config.json"]),
        vocab_rows=rows,
        lora_r=lora.r,
        target_modules=sorted(targets),
        modules_to_save=sorted(lora.modules_to_save),
        use_dora=lora.use_dora,
    )
    trajectory = {**train.model_dump(), "precision": launch.precision, "global_batch_size": launch.global_batch_size}
    settings = {
        "lora": lora.model_dump(),
        "train": {k: v for k, v in trajectory.items() if k not in UNTRACKED_TRAIN_KEYS},
    }
    inputs = {
        name: folder.file_digest([path]) for name, path in (("tokenizer", paths.tokenizer), ("dataset", paths.dataset))
    }
    if train.init_adapter is not None:
        initial.check(Path(train.init_adapter), lora)
        inputs["init_adapter"] = folder.file_digest([adapter.weights_file(Path(train.init_adapter))])
    launched = {k: v for k, v in dataclasses.asdict(launch).items() if k != "num_nodes"}
    return RunState(
        fingerprint=folder.fingerprint({**inputs, **dataclasses.asdict(identity)}, settings),
        identity=identity,
        world_size=launch.world_size,
        zero_stage=zero_stage,
        launch=launched,
        variant=variant(lora, launch),
    )


def make(
    *,
    paths: Paths,
    train: config.TrainConfig,
    lora: config.LoraConfig,
    deepspeed: config.DeepSpeedConfig,
    launch: Launch,
    tracking: config.TrackingConfig,
) -> Plan:
    """The run as the ranks will carry it out, checked (targets, vocabulary, batch, precision), before any
    checkpoint is touched; its resume point is decided by `training.resume.prepare`."""
    state = run_state(paths=paths, lora=lora, train=train, zero_stage=deepspeed.stage, launch=launch)
    check_world(launch.sequence_parallel, world_size=launch.world_size, hpz_partition_size=deepspeed.hpz_partition_size)
    check_model(launch.sequence_parallel, config=read_json(paths.base / "config.json"), attention=launch.attention)

    def built(sizes: dsc.LayerSizes | None = None) -> dsc.EngineConfig:
        return dsc.EngineConfig(
            zero=dsc.ZeroSettings(**deepspeed.model_dump()),
            precision=launch.precision,
            micro=train.micro_batch_size,
            accumulation=launch.gradient_accumulation_steps,
            world_size=launch.data_world,  # DeepSpeed's batch: its world over the sequence-parallel size
            lr=train.lr,
            weight_decay=train.weight_decay,
            max_grad_norm=train.max_grad_norm,
            adam_epsilon=train.adam_epsilon,
            global_batch=launch.global_batch_size,
            accelerator=launch.accelerator,
            sizes=sizes,
            sequence_parallel=launch.sequence_parallel,
        )

    ds_config = built()
    skip = tuple(train.kernels_skip)  # checked here, before any launch
    kernels.chosen(device=launch.accelerator, enabled=train.kernels, skip=skip)
    model, setting = memory_estimate.planned(
        paths=paths,
        state=state,
        deepspeed=deepspeed,
        launch=launch,
        micro=train.micro_batch_size,
        ds_config=ds_config,
        tiled_mlp=train.tiled_mlp,
        kernels=train.kernels,
    )
    if deepspeed.stage == 3:
        ds_config = built(dsc.LayerSizes(largest_trained=model.largest_lora, layer=model.layer))
    device = memory_estimate.gpu_memory() if launch.accelerator == "cuda" else None
    stated = "offload (to host memory)" if launch.checkpoint_offload else str(launch.gradient_checkpointing).lower()
    checkpointed = None
    checkpointing = "auto: off (CPU ranks)" if train.gradient_checkpointing == "auto" else f"set: {stated}"
    if train.gradient_checkpointing == "auto" and launch.accelerator == "cuda":
        checkpointed, offload, checkpointing = memory_estimate.checkpointing_choice(
            model, setting, device_bytes=device, may_tile=train.tiled_mlp == "auto"
        )
        launch = dataclasses.replace(launch, gradient_checkpointing=checkpointed > 0, checkpoint_offload=offload)
        setting = dataclasses.replace(
            setting, checkpointing=checkpointed > 0, checkpointed=checkpointed, checkpoint_offload=offload
        )
        chosen = {"gradient_checkpointing": checkpointed > 0, "checkpoint_offload": offload}
        state = dataclasses.replace(state, launch={**state.launch, **chosen})
    estimate = memory_estimate.check_plan(
        model,
        setting,
        quantized=lora.quantization != "none",
        device_bytes=device,
        ranks_per_node=launch.ranks_per_node,
        tiled_mlp=train.tiled_mlp,
    )
    log.info(f"about {estimate['device']:.2f} GB a rank ({launch.accelerator}), {estimate['host']:.2f} GB of host")
    log.info(f"activation checkpointing {checkpointing}")
    if estimate["tiled_mlp"] and train.tiled_mlp == "auto":
        log.info("the MLPs run a tile of positions at a time (train.tiled_mlp auto): the run fits only so")
    launch = dataclasses.replace(launch, tiled_mlp=estimate["tiled_mlp"])
    state = dataclasses.replace(state, launch={**state.launch, "tiled_mlp": launch.tiled_mlp})
    # the ranks only need its pad id (they skip loading it): read without transformers where it can be (its import,
    # about 2 s, on the core a rank imports on)
    tokenizer = light_tokenizer(paths.tokenizer) or load_tokenizer(paths.tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    spec = lora.model_dump(exclude={"lr_ratio", "quantization", "compute_dtype"})
    return Plan(
        paths=paths,
        launch=launch,
        schedule=Schedule(
            micro_batch_size=train.micro_batch_size,
            accumulation=launch.gradient_accumulation_steps,
            max_steps=train.max_steps,
            warmup_steps=train.warmup_steps,
            lr_scheduler=train.lr_scheduler,
            eval_every=train.eval_every,
            eval_max_rows=train.eval_max_rows,
            save_every=train.save_every,
            keep_last=train.keep_last,
            seed=train.seed,
        ),
        lora=LoraSpec(**{**spec, "target_modules": state.identity.target_modules}),
        optimizer=Optimizer(lr=train.lr, weight_decay=train.weight_decay, lr_ratio=lora.lr_ratio),
        tracking=Tracking(uri=tracking.uri, experiment=tracking.experiment, tensorboard=tracking.tensorboard),
        kernels=train.kernels,
        kernels_skip=list(train.kernels_skip),
        checkpointing=checkpointing,
        checkpointed_layers=checkpointed,
        zero_stage=deepspeed.stage,
        ds_config=ds_config,
        run_state=state,
        pad_token_id=pad or 0,
        objective=Objective(
            kind=train.objective,
            beta=train.beta,
            simpo_gamma=train.simpo_gamma,
            reference="initial" if train.init_adapter is not None else train.reference,
        ),
        init_adapter=None if train.init_adapter is None else Path(train.init_adapter),
    )


def write(plan: Plan, path: Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(dataclasses.asdict(plan), indent=1, default=str) + "\n", encoding="utf-8")


def read(path: Path) -> Plan:
    """The plan `write` wrote, typed again."""
    return _typed(Plan, read_json(path))


def _typed(kind, value):
    """`value` (JSON) as `kind`: dataclasses field by field, paths as Path, tuples as tuples, optional ones as None."""
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return kind(
            **{f.name: _typed(hints[f.name], value[f.name]) for f in dataclasses.fields(kind) if f.name in value}
        )
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        return None if value is None else _typed(options[0], value) if len(options) == 1 else value
    if typing.get_origin(kind) is tuple:
        return tuple(value)
    return Path(value) if kind is Path else value
