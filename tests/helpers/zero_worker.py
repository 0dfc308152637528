"""Started by tests through `deepspeed --num_gpus N --module tests.helpers.zero_worker`: for each ZeRO stage x precision
(x LoRA variant), train a LoRA engine two steps on random tokens, save a checkpoint as the train stage does and write
the live engine's gathered fp32 trainable tensors beside it (final.safetensors). A variant (dora, loraplus,
dora_loraplus, nf4, int8, dora_nf4, dora_int8) starts from a non-zero B, and rank 0 also trains it in one process
without DeepSpeed on the same global batch (reference.safetensors); LoRA+ records its optimizer groups and first
update (loraplus.json)."""

import argparse
import json
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch
from safetensors.torch import save_file

from pipeline.checkpoints import folder
from pipeline.core.precision import DTYPES
from pipeline.launching.ranks import leave_process_group
from pipeline.model.lora import LoraSpec, load_lora_model, parameter_groups
from pipeline.training import ds_config, loop

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR, WEIGHT_DECAY, RATIO = 1e-2, 0.01, 16.0
EPSILON = 1e-4  # Adam's: an element whose gradient is a rounding residue moves by up to lr x residue / eps a step
# (docs/cpu_paths.md); at 1e-8 two summation orders left LoRA+'s 0.16 rate up to 3.9e-5 apart in two steps


def build(args: argparse.Namespace, precision: str, variant: str | None, zero3_config: dict | None):
    """The LoRA model of a config; a variant's B drawn from a seeded generator (the same on every rank)."""
    from pipeline.model.quantization import Quantization

    kind = variant.removeprefix("dora_") if variant in ("nf4", "int8", "dora_nf4", "dora_int8") else None
    dtype = DTYPES[precision] if kind else torch.float32  # a quantized base is stored in the training dtype
    lora = LoraSpec(
        r=4,
        alpha=8,
        dropout=0.0,
        use_rslora=False,
        target_modules="all-linear" if kind else TARGETS,
        modules_to_save=["embed_tokens", "lm_head"],
        use_dora=variant is not None and variant.startswith("dora"),
    )
    model = load_lora_model(
        base_dir=args.base,
        vocab_rows=args.vocab_rows,
        lora=lora,
        seed=0,
        dtype=dtype,
        zero3_config=zero3_config,
        quantization=Quantization(kind=kind, compute_dtype=dtype, storage_dtype=dtype) if kind else None,
    )
    if variant is not None:
        generator = torch.Generator().manual_seed(123)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def batch(step: int, rank: int, rows: int) -> torch.Tensor:
    return torch.randint(0, rows, (1, 16), generator=torch.Generator().manual_seed(10 * step + rank))


def reference(args: argparse.Namespace, precision: str, variant: str, world: int) -> dict[str, torch.Tensor]:
    """The same training in one process with torch's AdamW: each step on the ranks' micro-batches together."""
    model = build(args, precision, variant, None)
    ratio = RATIO if variant is not None and "loraplus" in variant else None
    optimizer = torch.optim.AdamW(
        parameter_groups(model, WEIGHT_DECAY, lr=LR, lr_ratio=ratio), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPSILON
    )
    model.train()
    for step in range(2):
        losses = [
            model(input_ids=ids, labels=ids).loss for ids in (batch(step, r, args.vocab_rows) for r in range(world))
        ]
        (sum(losses) / world).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-rows", type=int, required=True)
    parser.add_argument("--configs", nargs="+", required=True, help="STAGE:PRECISION[:VARIANT], e.g. 3:bf16:dora")
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    for item in args.configs:
        stage, precision, *rest = item.split(":")
        variant = rest[0] if rest else None
        config = ds_config.build(
            zero=ds_config.ZeroSettings(stage=int(stage)),
            precision=precision,
            micro=1,
            accumulation=1,
            world_size=world,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            adam_epsilon=EPSILON,
            max_grad_norm=1.0,
        )
        quantized = variant is not None and variant.removeprefix("dora_") in ("nf4", "int8")
        model = build(args, precision, variant, config if stage == "3" and not quantized else None)
        ratio = RATIO if variant is not None and "loraplus" in variant else None
        groups = parameter_groups(model, WEIGHT_DECAY, lr=LR, lr_ratio=ratio)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        engine.train()
        out = args.out / (f"zero{stage}_{precision}_ranks{world}" + (f"_{variant}" if variant else ""))
        start = loop.gathered_trainable(engine) if ratio else {}
        for step in range(2):
            ids = batch(step, rank, args.vocab_rows)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            if ratio and step == 0:
                first = loop.gathered_trainable(engine)
        state = {"step": 2}
        if variant is not None:
            state["variant"] = {
                "use_dora": variant.startswith("dora"),
                "lr_ratio": ratio,
                "quantization": variant.removeprefix("dora_") if quantized else "none",
                "compute_dtype": precision if quantized else None,
                "load_dtype": precision,
            }
        folder.save(engine=engine, directory=out, step=2, state=state, tokenizer_dir=args.base, keep_last=1)
        final = loop.gathered_trainable(engine)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in final.items()}, str(out / "final.safetensors"))
        if rank == 0 and ratio:
            moved = {k: float((first[k] - start[k]).abs().max()) for k in start if "lora_" in k}
            figures = {
                "group_lrs": [g["lr"] for g in engine.optimizer.param_groups],
                "max_update_B": max(v for k, v in moved.items() if "lora_B" in k),
                "max_update_A": max(v for k, v in moved.items() if "lora_A" in k),
            }
            (out / "loraplus.json").write_text(json.dumps(figures))
        if rank == 0 and variant is not None and precision == "fp32":
            save_file(reference(args, precision, variant, world), str(out / "reference.safetensors"))
        del engine, model
    leave_process_group()


if __name__ == "__main__":
    main()
