"""The typed, validated view of params.yaml, and its composition from conf/ (the only Hydra-aware module)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PositiveInt = Field(gt=0)
RESERVED_SET_NAMES = ("tasks", "variant", "preference")  # eval.json's other keys (pipeline/evaluation/results.py)
Fraction = Field(ge=0.0, lt=1.0)


class Section(BaseModel):
    """A config group: unknown keys and loose types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelConfig(Section):
    path: str
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"]
    max_shard_size: str


class CorpusConfig(Section):
    heldout_fraction: float = Field(gt=0.0, lt=1.0)
    wiki_max_chars: int = PositiveInt
    wiki_train_chars: int = PositiveInt
    sft_train_examples: int = PositiveInt
    sft_heldout_examples: int = PositiveInt
    chat_train_examples: int = PositiveInt
    chat_heldout_examples: int = PositiveInt
    seed: int


class TokenizerConfig(Section):
    extend: bool
    train_file: str
    heldout_file: str
    vocab_size: int = Field(ge=300)
    model_type: Literal["bpe", "unigram"]
    character_coverage: float = Field(gt=0.0, le=1.0)
    max_train_chars: int = PositiveInt
    pad_to_multiple_of: int = PositiveInt


class SourceConfig(Section):
    """One file of a weighted mix: its format and its share of the mixed tokens (weights are normalised)."""

    file: str
    format: Literal["text", "alpaca", "chat", "prompt_completion"]
    weight: float = Field(gt=0.0)


class DataConfig(Section):
    format: Literal["text", "alpaca", "chat", "prompt_completion", "preference", "auto"]
    train_file: str
    sources: list[SourceConfig]
    heldout_file: str
    heldout_fraction: float = Field(gt=0.0, lt=1.0)
    max_bad_rows: float = Field(ge=0.0, le=1.0)
    validation_fraction: float = Fraction
    block_size: int = PositiveInt
    packing: Literal["blocks", "documents"]
    tail: Literal["drop", "pad"]
    max_seq_len: int = PositiveInt
    prompt_template: str
    seed: int

    @model_validator(mode="after")
    def _template(self) -> DataConfig:
        named = self.prompt_template in ("alpaca", "chat")
        if not named and "{instruction}" not in self.prompt_template:
            raise ValueError(
                "data.prompt_template: expected 'alpaca', 'chat' or a string containing '{instruction}', "
                f"got {self.prompt_template!r}"
            )
        if self.format == "preference" and self.sources:
            raise ValueError(
                "data.sources: data.format=preference trains on data.train_file alone; weighted mixes take text or "
                f"SFT (alpaca, chat, prompt_completion) sources, got {len(self.sources)} source(s); expected "
                "data.sources=[]"
            )
        families = {source.format == "text" for source in self.sources}
        if self.format == "auto" and len(families) > 1:
            raise ValueError(
                "data.sources: a mix takes text sources or SFT (alpaca, chat, prompt_completion) sources, not both"
            )
        for i, source in enumerate(self.sources):
            if self.format != "auto" and (source.format == "text") != (self.format == "text"):
                kind = "text" if self.format == "text" else "alpaca, chat or prompt_completion"
                raise ValueError(
                    f"data.sources.{i}.format: data.format={self.format} mixes {kind} sources only, "
                    f"got {source.format!r} for {source.file}"
                )
        return self


class LoraConfig(Section):
    r: int = PositiveInt
    alpha: float = Field(gt=0.0)
    dropout: float = Fraction
    use_rslora: bool
    target_modules: Annotated[list[str], Field(min_length=1)] | Literal["all-linear"]
    modules_to_save: list[str]
    init_new_embeddings: Literal["mean", "normal"]
    use_dora: bool
    lr_ratio: float | None = Field(gt=0.0)
    quantization: Literal["none", "nf4", "int8"]
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"]

    @model_validator(mode="after")
    def _quantization(self) -> LoraConfig:
        if self.compute_dtype != "auto" and self.quantization != "nf4":
            raise ValueError(
                f"lora.compute_dtype: {self.compute_dtype} applies to a 4-bit base only (lora.quantization=nf4); "
                f"expected auto with quantization={self.quantization}"
            )
        return self


class DeepSpeedConfig(Section):
    stage: Literal[0, 1, 2, 3]
    offload_optimizer: bool
    offload_param: bool
    overlap_comm: bool
    contiguous_gradients: bool
    hpz_partition_size: int = PositiveInt

    @model_validator(mode="after")
    def _offload(self) -> DeepSpeedConfig:
        if self.hpz_partition_size > 1 and self.stage != 3:
            raise ValueError(f"deepspeed.hpz_partition_size: needs deepspeed.stage=3, got stage={self.stage}")
        if self.offload_param and self.stage != 3:
            raise ValueError(f"deepspeed.offload_param: needs deepspeed.stage=3, got stage={self.stage}")
        if self.offload_optimizer and self.stage < 1:
            raise ValueError("deepspeed.offload_optimizer: needs deepspeed.stage >= 1, got stage=0")
        return self


class TrainConfig(Section):
    global_batch_size: Annotated[int, Field(gt=0)] | Literal["auto"]
    micro_batch_size: int = PositiveInt
    gradient_accumulation_steps: Annotated[int, Field(gt=0)] | Literal["auto"]
    max_steps: int = PositiveInt
    lr: float = Field(gt=0.0)
    weight_decay: float = Field(ge=0.0)
    adam_epsilon: float = Field(gt=0.0)
    warmup_steps: int = Field(ge=0)
    lr_scheduler: Literal["cosine", "linear", "constant"]
    max_grad_norm: float = Field(gt=0.0)
    precision: Literal["auto", "bf16", "fp16", "fp32"]
    gradient_checkpointing: bool | Literal["auto", "offload"]
    sequence_parallel: int = PositiveInt
    tiled_mlp: bool | Literal["auto"]
    attention: Literal["auto", "sdpa", "flash_attention_2", "eager"]
    kernels: Literal["auto", "off"]
    kernels_skip: list[str]
    resize_embeddings: bool
    objective: Literal["lm", "dpo", "orpo", "simpo"]
    beta: float = Field(gt=0.0)
    simpo_gamma: float = Field(ge=0.0)
    reference: Literal["step", "precomputed"]
    eval_every: int = PositiveInt
    eval_max_rows: int = Field(ge=0)
    save_every: int = PositiveInt
    keep_last: int = PositiveInt
    init_adapter: str | None
    resume_from: str | None
    convert_layout: bool
    seed: int

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"train.warmup_steps: must be < train.max_steps ({self.max_steps}), got {self.warmup_steps}"
            )
        return self

    @model_validator(mode="after")
    def _reference(self) -> TrainConfig:
        if self.objective == "dpo" and self.init_adapter is not None and self.reference == "step":
            raise ValueError(
                "train.reference: step takes the reference with the adapter disabled (the base), but "
                "train.init_adapter starts from an adapter, which is DPO's reference; expected "
                "train.reference=precomputed (that adapter's log-probabilities, before the first step)"
            )
        return self


class EvalConfig(Section):
    sets: dict[str, str] = Field(min_length=1)
    preference_sets: dict[str, str]
    context: int = PositiveInt
    stride: int = PositiveInt
    batch_size: int = PositiveInt
    max_bytes: int | None = Field(gt=0)
    max_new_tokens: int = Field(ge=0)
    prompts: list[str]
    precision: Literal["auto", "bf16", "fp32"]
    tasks: list[str]
    task_code: list[str]
    task_limit: int | None = Field(gt=0)

    @model_validator(mode="after")
    def _window(self) -> EvalConfig:
        if self.stride > self.context:
            raise ValueError(f"eval.stride: must be <= eval.context ({self.context}), got {self.stride}")
        for reserved in RESERVED_SET_NAMES:
            if reserved in self.sets:
                raise ValueError(f"eval.sets: {reserved!r} names other figures in eval.json; rename that set")
        return self


class MergeConfig(Section):
    dtype: Literal["fp32", "bf16", "fp16"]
    max_shard_size: str = Field(pattern=r"^\d+(\.\d+)?\s*([KMGkmg][Ii]?[Bb]|[Bb])$")
    verify: bool
    max_abs_logit_diff: float | None = Field(gt=0)
    max_kl: float | None = Field(gt=0)


class ExportConfig(Section):
    gguf: bool
    type: Literal["f16", "q8_0"]


class TrackingConfig(Section):
    uri: str
    experiment: str
    tensorboard: bool
    register_model: str | None = Field(min_length=1)


class LauncherConfig(Section):
    mode: Literal["local", "ssh", "slurm", "manual"]
    ranks_per_node: Annotated[int, Field(gt=0)] | Literal["auto"]
    num_nodes: int = PositiveInt
    hostfile: str | None
    master_addr: str
    master_port: int | None = Field(gt=0, lt=65536)
    join_timeout_s: float = Field(gt=0)
    accelerator: Literal["auto", "cpu", "cuda"]

    @model_validator(mode="after")
    def _nodes(self) -> LauncherConfig:
        if self.mode == "local" and self.num_nodes > 1:
            raise ValueError(
                f"launcher.num_nodes: {self.num_nodes} with launcher=local (this node alone); expected launcher=ssh "
                "(one dvc repro starts every node), slurm (inside an allocation) or manual (you start each node)"
            )
        if self.mode == "manual" and self.master_port is None:
            raise ValueError("launcher.master_port: launcher=manual needs a port (the same on every node), got null")
        if self.mode == "local" and self.master_addr == "auto":
            raise ValueError("launcher.master_addr: auto names the first of several nodes; launcher=local has one")
        return self


class Config(Section):
    seed: int
    model: ModelConfig
    corpus: CorpusConfig
    tokenizer: TokenizerConfig
    data: DataConfig
    lora: LoraConfig
    deepspeed: DeepSpeedConfig
    train: TrainConfig
    merge: MergeConfig
    export: ExportConfig
    eval: EvalConfig
    tracking: TrackingConfig
    launcher: LauncherConfig

    @model_validator(mode="after")
    def _variants(self) -> Config:
        if self.lora.quantization != "none" and self.deepspeed.offload_param:
            raise ValueError(
                f"deepspeed.offload_param: a quantized base (lora.quantization={self.lora.quantization}) is packed in "
                "bitsandbytes' own tensors, which DeepSpeed's parameter offload does not move; expected "
                "offload_param=false (offload_optimizer is fine)"
            )
        preference = self.data.format == "preference"
        if self.data.format != "auto" and (self.train.objective != "lm") != preference:  # auto: the check stage
            raise ValueError(
                f"train.objective: {self.train.objective} with data.format={self.data.format}; expected lm on text, "
                "alpaca, chat or prompt_completion data, and dpo, orpo or simpo on data.format=preference (pairs of "
                "responses)"
            )
        return self


def _known_keys(model: type[BaseModel] = None, prefix: str = "") -> list[str]:
    """Every dotted key the schema knows ("lora.r", "train.lr", ...)."""
    model = model or Config
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _known_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


# Names other tools give our keys (HF Trainer, PEFT, LLaMA-Factory): the key a user most likely meant.
SYNONYMS = {
    "learning_rate": "lr", "rank": "r", "lora_r": "r", "lora_rank": "r", "lora_alpha": "alpha",
    "lora_dropout": "dropout", "lora_target": "target_modules", "per_device_train_batch_size": "micro_batch_size",
    "batch_size": "micro_batch_size", "num_train_epochs": "max_steps", "epochs": "max_steps", "bf16": "precision",
    "fp16": "precision", "zero_stage": "stage", "cutoff_len": "max_seq_len", "seq_len": "block_size",
}  # fmt: skip


def closest_key(key: str) -> str | None:
    """The known key a misspelled one most likely meant ("lora.rank" -> "lora.r")."""
    import difflib

    known = _known_keys()
    group, _, leaf = key.rpartition(".")
    synonym = f"{group}.{SYNONYMS.get(leaf)}" if group else None
    if synonym in known:
        return synonym
    same_group = [k for k in known if k.rpartition(".")[0] == group]
    match = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in same_group], n=1, cutoff=0.3)
    if match:
        return f"{group}.{match[0]}" if group else match[0]
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    return match[0] if match else None


def _describe(error: dict, source: str) -> str:
    key = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        suggestion = closest_key(key)
        hint = f"; did you mean '{suggestion}'?" if suggestion else ""
        return f"{source}: unknown key '{key}'{hint}"
    if error["type"] == "missing":
        return f"{source}: missing key '{key}'"
    if error["type"] == "value_error":
        return f"{source}: {error['msg'].removeprefix('Value error, ')}"
    expected = error["msg"][0].lower() + error["msg"][1:]
    return f"{source}: {key}: {expected}, got {error['input']!r}"


def validate(raw: dict, source: str = "params.yaml") -> Config:
    """Check a params mapping against the schema; ValueError names every offending key."""
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ValueError("\n".join(_describe(e, source) for e in err.errors())) from None


class _Yaml12Floats(yaml.SafeLoader):
    """PyYAML's safe loader reading YAML 1.2's floats too: DVC writes params.yaml by YAML 1.2, where 1e-08 (a float
    without a dot, as `-S train.lr=1e-5` becomes) is a float; YAML 1.1's rules, PyYAML's, read it as a string."""


_Yaml12Floats.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+.0123456789")
)


def read_params(path: Path | str) -> object:
    """params.yaml (or any YAML DVC wrote) as DVC reads it."""
    return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Yaml12Floats)  # noqa: S506 (a safe loader)


def load(path: Path | str = "params.yaml") -> Config:
    """Read and validate params.yaml."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; run `make params` to compose it from conf/")
    raw = read_params(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of config groups")
    return validate(raw, str(path))


def compose(config_dir: Path | str = "conf", overrides: list[str] | None = None) -> dict:
    """Compose conf/ with Hydra overrides into a plain, resolved dict (what DVC writes to params.yaml)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides or [])
    return OmegaConf.to_container(cfg, resolve=True)


def write_params(path: Path | str = "params.yaml", config_dir: Path | str = "conf", overrides=None) -> None:
    """Compose conf/ with DVC's own writer, so that params.yaml is byte-identical to `dvc exp run`'s."""
    from dvc.utils.hydra import compose_and_dump

    from pipeline.core.atomic import atomic_path

    validate(compose(config_dir, overrides), "conf/")
    with atomic_path(Path(path)) as tmp:
        compose_and_dump(tmp, str(Path(config_dir).resolve()), None, "config", ".", overrides or [])


# Keys that do nothing in some configurations: (condition on the config, the keys, why).
INEFFECTIVE = (
    (lambda c: not c.tokenizer.extend, ("tokenizer.vocab_size", "tokenizer.model_type",
     "tokenizer.character_coverage", "tokenizer.max_train_chars"), "tokenizer.extend is false (tokenizer=extend_zh)"),
    (lambda c: not c.merge.verify, ("merge.max_abs_logit_diff", "merge.max_kl"), "merge.verify is false"),
    (lambda c: c.launcher.mode == "local", ("launcher.hostfile",), "launcher=local trains on this node alone"),
    (lambda c: c.launcher.mode in ("ssh", "slurm"), ("launcher.num_nodes",),
     "launcher=ssh and slurm count the nodes (the hostfile's, the allocation's)"),
    (lambda c: c.launcher.mode == "slurm", ("launcher.hostfile",), "launcher=slurm trains on the allocation's nodes"),
    (lambda c: c.data.format == "text", ("data.max_seq_len", "data.prompt_template"),
     "data.format is text (packed blocks of data.block_size tokens)"),
    (lambda c: c.data.format not in ("text", "auto"), ("data.block_size", "data.tail", "data.packing"),
     "data.format is not text"),
    (lambda c: c.data.packing == "documents", ("data.tail",), "data.packing is documents (no stream to cut)"),
    (lambda c: c.data.format == "chat" and c.data.prompt_template != "chat", ("data.prompt_template",),
     "data.format is chat (rendered with the tokenizer's chat template)"),
    (lambda c: c.data.heldout_file != c.data.train_file, ("data.heldout_fraction",),
     "data.heldout_file is a file of its own (the fraction applies when it is data.train_file)"),
)  # fmt: skip
REFUSED_IF_INEFFECTIVE = ("tokenizer.", "merge.", "launcher.")  # the others only warn (experiments set them all)


def _value(config: Config, key: str):
    group, name = key.split(".")
    return getattr(getattr(config, group), name)


def ineffective(config: Config, defaults: Config) -> tuple[list[str], list[str]]:
    """(errors, warnings) for keys set away from their default where, in this configuration, they do nothing."""
    errors, warnings = [], []
    for applies, keys, why in INEFFECTIVE:
        if not applies(config):
            continue
        for key in keys:
            if _value(config, key) != _value(defaults, key):
                message = f"{key}={_value(config, key)!r} has no effect: {why}"
                (errors if key.startswith(REFUSED_IF_INEFFECTIVE) else warnings).append(message)
    return errors, warnings


if __name__ == "__main__":
    write_params("params.yaml", "conf", sys.argv[1:])
