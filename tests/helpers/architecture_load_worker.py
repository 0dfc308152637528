"""Started by tests through `deepspeed --num_gpus 2 --module tests.helpers.architecture_load_worker`: each model
folder loaded under ZeRO-3 as the train stage loads it (base_weights.load_partitioned: every rank reading its own
slice of every parameter, converted ones through transformers' conversions), then gathered, and rank 0 writing
every parameter (the embeddings grown by `--grow` rows) to NAME.safetensors in `--out`."""

import argparse
from pathlib import Path

import deepspeed
import torch
from safetensors.torch import save_file

from pipeline.launching.ranks import leave_process_group
from pipeline.model.base_weights import load_partitioned
from pipeline.training import ds_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--models", type=Path, nargs="+", required=True)
    parser.add_argument("--grow", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deepspeed.init_distributed()
    config = ds_config.build(
        zero=ds_config.ZeroSettings(stage=3),
        precision="fp32",
        micro=1,
        accumulation=1,
        world_size=torch.distributed.get_world_size(),
        lr=1e-3,
        weight_decay=0.0,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
    )
    from transformers import AutoConfig

    for base in args.models:
        rows = AutoConfig.from_pretrained(base).vocab_size + args.grow
        model = load_partitioned(
            base_dir=base, dtype=torch.float32, vocab_rows=rows, init="mean", seed=0, zero3_config=config
        )
        held = {name: param.ds_tensor.numel() for name, param in model.named_parameters()}
        whole = {name: param.ds_numel for name, param in model.named_parameters()}
        assert all(held[n] < whole[n] for n in held if whole[n] > 1), "a rank holds a whole parameter"
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            state = {name: param.detach().clone() for name, param in model.named_parameters()}
        if torch.distributed.get_rank() == 0:
            save_file(state, str(args.out / f"{base.name}.safetensors"))
        del model
    leave_process_group()


if __name__ == "__main__":
    main()
