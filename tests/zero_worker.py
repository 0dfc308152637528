"""Started by tests through `deepspeed --num_gpus N --module tests.zero_worker`: for each ZeRO stage x precision,
train a LoRA engine two steps on random tokens, save a checkpoint as the train stage does and write the live
engine's gathered fp32 trainable tensors beside it (final.safetensors)."""

import argparse
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch
from safetensors.torch import save_file

from pipeline import ds_config, trainer
from pipeline.model import load_lora_model, parameter_groups

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-rows", type=int, required=True)
    parser.add_argument("--configs", nargs="+", required=True, help="STAGE:PRECISION, e.g. 3:bf16")
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    for item in args.configs:
        stage, precision = item.split(":")
        model = load_lora_model(
            args.base, args.vocab_rows, "mean", 4, 8, 0.0, False, TARGETS, ["embed_tokens", "lm_head"], 0, False
        )
        config = ds_config.build(int(stage), False, False, False, True, precision, 1, 1, world, 1e-2, 0.01, 1.0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.01), config=config)
        engine.train()
        for step in range(2):
            ids = torch.randint(0, args.vocab_rows, (1, 16), generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        out = args.out / f"zero{stage}_{precision}_ranks{world}"
        trainer.save_checkpoint(engine, out, 2, {"step": 2}, args.base, keep_last=1)
        state = trainer.gathered_trainable(engine)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / "final.safetensors"))


if __name__ == "__main__":
    main()
