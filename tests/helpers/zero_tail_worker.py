"""Started by tests/integration/test_zero_tail.py through `deepspeed --num_gpus 2 --module
tests.helpers.zero_tail_worker`: for ZeRO-1 and ZeRO-2 in fp32 and bf16, a LoRA engine with the fused step tail
(`deepspeed_patches.zero_tail`) and one with DeepSpeed's own: after the same backward, DeepSpeed's clipping norm
and ours; one step each; then an inf injected into one gradient element of rank 1 only, and whether each engine
skipped that step on every rank with its parameters unchanged. Each rank writes `<out>/rank<R>.json`."""

import argparse
import json
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from pipeline.core.deepspeed_patches import partition_norm, zero_tail
from pipeline.launching.ranks import leave_process_group
from pipeline.training import ds_config
from tests.helpers.lora_model import tiny_lora


def engine_for(stage: int, precision: str, fused: bool):
    model = tiny_lora(torch.float32)
    config = ds_config.build(
        zero=ds_config.ZeroSettings(stage=stage), precision=precision, micro=1, accumulation=1, world_size=2,
        lr=1e-2, weight_decay=0.0, max_grad_norm=0.5,
    )  # fmt: skip
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=config)
    if fused:
        assert zero_tail(engine)
    return engine


def backward(engine, step: int) -> None:
    rank = dist.get_rank()
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(100 * step + rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss * 40.0)  # large gradients: the clipping acts


def trained(engine) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters() if p.requires_grad]


def case(stage: int, precision: str, fused: bool) -> dict:
    engine = engine_for(stage, precision, fused)
    optimizer = engine.optimizer
    backward(engine, 0)
    stock = float(DeepSpeedZeroOptimizer.scaled_global_norm(optimizer))
    ours = float(partition_norm(optimizer))
    before = trained(engine)
    engine.step()
    moved = any(not torch.equal(a, b) for a, b in zip(before, trained(engine), strict=True))
    backward(engine, 1)
    if dist.get_rank() == 1:  # one element of one gradient of one rank
        grads = optimizer.averaged_gradients[0]
        tensor = getattr(grads, "flat_partition", None)
        tensor = tensor if tensor is not None else next(g for g in grads if g.numel())
        tensor.view(-1)[0] = float("inf")
    before = trained(engine)
    engine.step()
    kept = all(torch.equal(a, b) for a, b in zip(before, trained(engine), strict=True))
    return {"stock_norm": stock, "fused_norm": ours, "first_step_moved": moved, "inf_skipped": kept}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed()
    results = {
        f"zero{stage}-{precision}-{'fused' if fused else 'stock'}": case(stage, precision, fused)
        for stage in (1, 2)
        for precision in ("fp32", "bf16")
        for fused in (True, False)
    }
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    leave_process_group()


if __name__ == "__main__":
    main()
