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
from pipeline.checkpoints import folder
from pipeline.model import LoraSpec, load_lora_model, parameter_groups
from pipeline.processes import leave_process_group

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
        lora = LoraSpec(
            r=4,
            alpha=8,
            dropout=0.0,
            use_rslora=False,
            target_modules=TARGETS,
            modules_to_save=["embed_tokens", "lm_head"],
        )
        model = load_lora_model(base_dir=args.base, vocab_rows=args.vocab_rows, lora=lora, seed=0)
        config = ds_config.build(
            zero=ds_config.ZeroSettings(stage=int(stage)),
            precision=precision,
            micro=1,
            accumulation=1,
            world_size=world,
            lr=1e-2,
            weight_decay=0.01,
            max_grad_norm=1.0,
        )
        engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.01), config=config)
        engine.train()
        for step in range(2):
            ids = torch.randint(0, args.vocab_rows, (1, 16), generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        out = args.out / f"zero{stage}_{precision}_ranks{world}"
        folder.save(engine=engine, directory=out, step=2, state={"step": 2}, tokenizer_dir=args.base, keep_last=1)
        state = trainer.gathered_trainable(engine)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / "final.safetensors"))
    leave_process_group()


if __name__ == "__main__":
    main()
