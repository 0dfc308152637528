"""Fold a LoRA adapter into its base, one base shard at a time, and prove the result computes what base + adapter
computed.

W' = W + scale * (B @ A) in fp32 (scale = alpha / r, or alpha / sqrt(r) with rsLoRA; rank_pattern/alpha_pattern
honoured; transposed for fan_in_fan_out), then cast. A DoRA adapter's layers become m / ||V|| x V with V that sum,
one L2 norm per output row (taken over the inputs, as PEFT's DoRA computes it), m its trained magnitude.
modules_to_save tensors replace the base's. A tied base stays tied when input and output embeddings end up equal,
and is untied (with a note) when only one side changed. The base may be safetensors or PyTorch pickles in any
float dtype; a tokenizer is checked when there is one."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.checkpoints import adapter as adapter_format
from pipeline.checkpoints import safetensors_stream
from pipeline.checkpoints.adapter import MAGNITUDE, PREFIX, pattern_value
from pipeline.checkpoints.model_files import FileTensor, model_tensors
from pipeline.core.atomic import atomic_path, read_json
from pipeline.core.precision import DTYPES, dtype_name
from pipeline.data.tokenizer import BPE_FILES, find_tokenizer
from pipeline.data.tokenizer import FILES as TOKENIZER_FILES
from pipeline.merge.verify import TOLERANCES, logits_gap

REPORT = "merge_report.json"
NO_TOKENIZER = "no tokenizer in the base or adapter folder, and none given"


@dataclass(frozen=True)
class Delta:
    """One LoRA layer's change: B @ A x scale, added transposed for a Conv1D-style (in, out) weight; with DoRA the
    magnitude m (out,) that rescales each output row of the sum to it."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    transposed: bool
    magnitude: torch.Tensor | None = None


@dataclass
class Plan:
    """What happens to each base tensor, decided (and checked) before anything is written."""

    deltas: dict[str, Delta] = field(default_factory=dict)
    replacements: dict[str, FileTensor] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)  # output key -> base key it starts from (an untied head)
    notes: list[str] = field(default_factory=list)
    vocab_rows: int = 0


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, FileTensor]]:
    """adapter_config.json and the adapter's tensors (not read yet); variants this merge cannot fold are refused."""
    config, tensors = adapter_format.read(adapter_dir)
    if config.get("lora_bias"):
        raise ValueError(f"{adapter_dir / adapter_format.CONFIG}: lora_bias is true; not supported by this merge")
    return config, tensors


def plan_merge(
    *,
    config: dict,
    adapter: dict[str, FileTensor],
    base: dict[str, FileTensor],
    tied: bool,
    embed: str,
    head: str,
    where: str = "adapter",
) -> Plan:
    """Check that adapter and base fit, and decide every output tensor (errors start with `where`: the adapter's
    file and the base)."""
    plan = Plan()
    if tied and head not in base:
        base = {**base, head: base[embed]}  # the output side reads the input embeddings
    fan_in_fan_out, flipped = bool(config.get("fan_in_fan_out")), []
    dora = bool(config.get("use_dora"))
    for key in sorted(adapter):
        if not key.startswith(PREFIX):
            raise ValueError(f"{where}: tensor {key}: expected names starting with {PREFIX!r} (PEFT's save format)")
        name = key[len(PREFIX) :]
        if name.endswith(f".{MAGNITUDE}") and not dora:
            raise ValueError(f"{where}: {key} is a DoRA magnitude but adapter_config.json has use_dora false")
        if ".lora_B." in name or ".original_module." in name or ".modules_to_save." in name or MAGNITUDE in name:
            continue  # B and m go with A; the others are copies PEFT's own save adds beside `module.weight`
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0]
            b_key, target = f"{PREFIX}{module}.lora_B.weight", f"{module}.weight"
            if b_key not in adapter:
                raise ValueError(f"{where}: {key} has no lora_B partner")
            a, b = adapter[key].read(), adapter[b_key].read()
            if target not in base:
                raise ValueError(f"{where}: the adapter targets {module}, which the base has no weight for ({target})")
            rank = a.shape[0]
            expected_r = pattern_value(config.get("rank_pattern") or {}, module, config["r"])
            if rank != expected_r:
                raise ValueError(f"{where}: {module} has rank {rank}, adapter_config.json says {expected_r}")
            alpha = pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
            scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
            transposed = _orientation(a, b, tuple(base[target].shape), fan_in_fan_out)
            if transposed is None or b.shape[1] != rank:
                raise ValueError(
                    f"{where}: {module} B{tuple(b.shape)} @ A{tuple(a.shape)} does not fit the base weight "
                    f"{tuple(base[target].shape)}"
                )
            if transposed != fan_in_fan_out:
                flipped.append(module)
            plan.deltas[target] = Delta(
                a, b, scale, transposed, _magnitude(adapter, module=module, rows=b.shape[0], where=where, dora=dora)
            )
        else:
            target = name
            if target not in base:
                raise ValueError(f"{where}: tensor {key} replaces {target}, which the base does not have")
            base_shape = base[target].shape
            if list(adapter[key].shape[1:]) != base_shape[1:]:
                raise ValueError(f"{where}: tensor {key}: shape {tuple(adapter[key].shape)} vs base {base_shape}")
            plan.replacements[target] = adapter[key]
    if flipped:
        plan.notes.append(
            f"fan_in_fan_out is {fan_in_fan_out} in adapter_config.json but the base stores {flipped[:3]}"
            f"{' ...' if len(flipped) > 3 else ''} the other way round; merged as their shapes say (PEFT decides by "
            f"the layer type the same way)"
        )
    plan.vocab_rows = plan.replacements.get(embed, base[embed]).shape[0]
    _decide_tie(plan, tied=tied, embed=embed, head=head, base_rows=base[embed].shape[0])
    return plan


def _magnitude(
    adapter: dict[str, FileTensor], *, module: str, rows: int, where: str, dora: bool
) -> torch.Tensor | None:
    """DoRA's magnitude of `module` (one value per output row), checked; None without DoRA."""
    if not dora:
        return None
    key = f"{PREFIX}{module}.{MAGNITUDE}"
    if key not in adapter:
        raise ValueError(f"{where}: adapter_config.json has use_dora true but {module} has no {MAGNITUDE}")
    magnitude = adapter[key].read()
    if tuple(magnitude.shape) != (rows,):
        raise ValueError(f"{where}: {key} has shape {tuple(magnitude.shape)}, expected ({rows},): one per output row")
    return magnitude


def _orientation(a: torch.Tensor, b: torch.Tensor, base_shape: tuple, fan_in_fan_out: bool) -> bool | None:
    """Whether B @ A is added transposed: the base weight is (out, in) for a Linear, (in, out) for a Conv1D (GPT-2);
    the shapes decide where they can, else the config's fan_in_fan_out; None when neither way fits."""
    product = (b.shape[0], a.shape[1])
    fits = [transposed for transposed in (False, True) if (base_shape[::-1] if transposed else base_shape) == product]
    if not fits:
        return None
    return fan_in_fan_out if len(fits) == 2 else fits[0]


def _decide_tie(plan: Plan, *, tied: bool, embed: str, head: str, base_rows: int) -> None:
    if not tied:
        return
    new_embed, new_head = plan.replacements.get(embed), plan.replacements.get(head)
    embed_changed, head_changed = (
        embed in plan.deltas or new_embed is not None,
        head in plan.deltas or new_head is not None,
    )
    same = (not embed_changed and not head_changed) or (
        new_embed is not None and new_head is not None and not plan.deltas.keys() & {embed, head}
        and new_embed.shape == new_head.shape and new_embed.digest() == new_head.digest()
    )  # fmt: skip
    if same:
        return
    if new_head is None and plan.vocab_rows != base_rows:
        raise ValueError(
            f"adapter: {embed} was resized to {plan.vocab_rows} rows but {head} was not trained; base + adapter "
            f"would use the resize's initial rows: train with lm_head in modules_to_save (or tied)"
        )
    plan.extra[head] = embed  # written from the input embeddings, then changed as the adapter says
    side = "input" if embed_changed and not head_changed else "output" if head_changed and not embed_changed else "both"
    plan.notes.append(f"untied {embed} and {head}: the adapter changed the {side} embeddings differently")


def merged_weight(weight: torch.Tensor, delta: Delta) -> torch.Tensor:
    """The weight with the LoRA layer folded in, in fp32: W + scale x B @ A, and with DoRA m / ||V|| x V (V that
    sum, its L2 norm per output row over the inputs)."""
    rows = weight.float().T if delta.transposed else weight.float()  # (out, in)
    rows = rows + (delta.b.float() @ delta.a.float()) * delta.scale
    if delta.magnitude is not None:
        rows = (delta.magnitude.float() / torch.linalg.norm(rows, dim=1)).unsqueeze(1) * rows
    return rows.T.contiguous() if delta.transposed else rows


def _merged_tensor(key: str, base: FileTensor, plan: Plan) -> torch.Tensor:
    value = plan.replacements.get(key, base).read().float()
    return merged_weight(value, plan.deltas[key]) if key in plan.deltas else value


def write_merged(*, out: Path, base: dict[str, FileTensor], plan: Plan, dtype: str, max_bytes: int) -> int:
    """Stream every base tensor through the plan into `out`'s shards, one tensor in memory at a time."""
    kind = DTYPES[dtype]
    sources = {**base, **{key: base[source] for key, source in plan.extra.items() if key not in base}}
    shapes = {key: tuple((plan.replacements.get(key) or src).shape) for key, src in sources.items()}

    def produce(key: str) -> torch.Tensor:
        value = _merged_tensor(key, sources[key], plan)
        if not safetensors_stream.all_finite(value):
            raise ValueError(f"merged tensor {key} holds NaN or Inf")
        return value.to(kind)

    entries = [(key, shapes[key], kind) for key in sources]
    return safetensors_stream.write_shards(out, entries, produce, max_bytes=max_bytes)


EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "gpt_neox.embed_in.weight")
HEADS = ("lm_head.weight", "embed_out.weight")


def _embedding_names(base_dir: Path, config: dict, base: dict[str, FileTensor]) -> tuple[str, str, bool]:
    """(input embedding weight, output embedding weight, tied): the usual names, else from the architecture
    (importing transformers costs memory the merge otherwise never spends)."""
    embed = next((name for name in EMBEDDINGS if name in base), None)
    head = next((name for name in HEADS if name in base), None)
    if embed is not None:
        tied = bool(config.get("tie_word_embeddings", head is None))
        return embed, head or "lm_head.weight", tied
    from pipeline.model.outline import meta_model

    model = meta_model(base_dir)
    names = {id(m): n for n, m in model.named_modules()}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return (
        f"{names[id(model.get_input_embeddings())]}.weight",
        f"{names[id(model.get_output_embeddings())]}.weight",
        tied,
    )


def _write_config(config: dict, *, out: Path, rows: int, tied: bool, dtype: str) -> None:
    config = {**config, "vocab_size": rows, "tie_word_embeddings": tied, "dtype": dtype_name(DTYPES[dtype])}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _check_tokenizer(folder: Path | None, rows: int) -> int | None:
    """The tokenizer's size, which must fit the embeddings; None when there is no tokenizer to check."""
    from pipeline.data.tokenizer import vocabulary_size

    if folder is None:
        return None
    size = vocabulary_size(folder)
    if size > rows:
        raise ValueError(f"{folder}: tokenizer has {size} tokens, the merged embeddings only {rows} rows")
    return size


def against_trained_base(*, base_dir: Path, adapter_dir: Path, merged_dir: Path, plan: Plan) -> dict:
    """For an adapter trained on a quantized base (its variant.json says so): the logits gap between the merged
    model and the quantized base + adapter it was trained as (a measure, not a check: merging into the unquantized
    base is meant to differ from it); nothing otherwise."""
    from functools import partial

    from pipeline.model import quantization

    variant = adapter_format.read_variant(adapter_dir)
    kind = variant.get("quantization")
    if kind not in quantization.KINDS:
        return {}
    try:
        quantization.check_available(kind, "cpu")
    except ValueError as err:
        plan.notes.append(f"the gap to the {kind} base the adapter was trained on is not measured: {err}")
        return {}
    trained = partial(quantization.round_trip, kind=kind, load_dtype=DTYPES[variant["load_dtype"]])
    gap = logits_gap(
        base_dir=base_dir, adapter_dir=adapter_dir, merged_dir=merged_dir, rows=plan.vocab_rows, base_linear=trained
    )
    return {"against_trained_base": {**gap, "quantization": kind, "base_loaded_as": variant["load_dtype"]}}


def merge(
    *,
    base_dir: Path,
    adapter_dir: Path,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    dtype: str = "fp32",
    max_shard_size: str = "2GB",
    verify: bool = True,
    max_abs_logit_diff: float | None = None,
    max_kl: float | None = None,
) -> dict:
    """Merge, write config/tokenizer/generation config, verify; OUT_DIR appears only when all of it passed. The
    tokenizer checked and shipped is TOKENIZER_DIR, else the adapter's, else the base's; with none, the check is
    skipped (and the report says so)."""
    if dtype not in TOLERANCES:
        raise ValueError(f"merge.dtype: {dtype!r}; expected one of {sorted(TOLERANCES)}")
    if not base_dir.is_dir():
        raise FileNotFoundError(f"{base_dir}: no such base model folder")
    max_bytes = safetensors_stream.parse_size(max_shard_size, "merge.max_shard_size")
    config, adapter = read_adapter(adapter_dir)
    base, base_config = model_tensors(base_dir), read_json(base_dir / "config.json")
    embed, head, tied = _embedding_names(base_dir, base_config, base)
    where = f"{adapter_format.weights_file(adapter_dir)} on the base {base_dir}"
    plan = plan_merge(config=config, adapter=adapter, base=base, tied=tied, embed=embed, head=head, where=where)
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"{tokenizer_dir}: no such tokenizer folder")
    tokenizer_dir = tokenizer_dir or find_tokenizer([adapter_dir, base_dir])
    tokens = _check_tokenizer(tokenizer_dir, plan.vocab_rows)
    report = {
        "variant": adapter_format.describe_variant(adapter_format.read_variant(adapter_dir)),
        "lora_layers": len(plan.deltas),
        "replaced": sorted(plan.replacements),
        "tied": tied and not plan.extra,
        "notes": plan.notes,
        "vocab_rows": plan.vocab_rows,
        "tokenizer_size": tokens,
        "tokenizer": str(tokenizer_dir) if tokenizer_dir else f"not checked: {NO_TOKENIZER}",
        "dtype": dtype,
    }
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        report["shards"] = write_merged(out=tmp, base=base, plan=plan, dtype=dtype, max_bytes=max_bytes)
        _write_config(base_config, out=tmp, rows=plan.vocab_rows, tied=report["tied"], dtype=dtype)
        for name in ("generation_config.json",):
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, tmp / name)
        for name in (*TOKENIZER_FILES, *BPE_FILES) if tokenizer_dir else ():
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, tmp / name)
        if verify:
            report.update(against_trained_base(base_dir=base_dir, adapter_dir=adapter_dir, merged_dir=tmp, plan=plan))
            limit_abs, limit_kl = TOLERANCES[dtype]
            limit_abs, limit_kl = max_abs_logit_diff or limit_abs, max_kl or limit_kl
            gap = logits_gap(base_dir=base_dir, adapter_dir=adapter_dir, merged_dir=tmp, rows=plan.vocab_rows)
            report["verification"] = {**gap, "limit_abs": limit_abs, "limit_kl": limit_kl}
            if gap["max_abs_logit_diff"] > limit_abs or gap["mean_kl"] > limit_kl:
                raise ValueError(
                    f"merge verification failed: merged logits differ from base + adapter by "
                    f"{gap['max_abs_logit_diff']:.3g} (limit {limit_abs:g}), mean KL {gap['mean_kl']:.3g} "
                    f"(limit {limit_kl:g}); nothing written to {out_dir}"
                )
        (tmp / REPORT).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return report
