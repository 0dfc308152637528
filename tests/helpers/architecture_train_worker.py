"""Started by tests through `deepspeed --num_gpus 2 --module tests.helpers.architecture_train_worker`: for each model
folder, a LoRA adapter on every Linear layer (`all-linear`, resolved for the architecture) trained two steps under
ZeRO-3 as the train stage trains it, saved as the train stage saves it (OUT/NAME), the live engine's gathered
trainable tensors beside it (final.safetensors)."""

import argparse
from pathlib import Path

import deepspeed
import torch
from safetensors.torch import save_file

from pipeline.checkpoints import folder
from pipeline.launching.ranks import leave_process_group
from pipeline.launching.settings import attention_implementation, supported_attention
from pipeline.model.lora import LoraSpec, load_lora_model, parameter_groups
from pipeline.training import ds_config, loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--models", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = ds_config.build(
        zero=ds_config.ZeroSettings(stage=3),
        precision="fp32",
        micro=1,
        accumulation=1,
        world_size=world,
        lr=1e-2,
        weight_decay=0.0,
        adam_epsilon=1e-4,
        max_grad_norm=1.0,
    )
    from transformers import AutoConfig

    lora = LoraSpec(r=4, alpha=8, dropout=0.0, use_rslora=False, target_modules="all-linear", modules_to_save=[])
    for base in args.models:
        architecture = AutoConfig.from_pretrained(base)
        rows = architecture.vocab_size
        here = {"accelerator": "cpu", "precision": "fp32", "flash_installed": False}  # as the train stage chooses
        attention = attention_implementation("auto", **here, supported=supported_attention(architecture.to_dict()))
        model = load_lora_model(
            base_dir=base, vocab_rows=rows, lora=lora, seed=0, zero3_config=config, attention=attention
        )
        with torch.no_grad():  # B drawn non-zero (the same on every rank): the adapter moves the logits at once
            generator = torch.Generator().manual_seed(7)
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.0, lr=1e-2),
                                          config=config)  # fmt: skip
        engine.train()
        for step in range(2):
            ids = torch.randint(0, rows, (1, 16), generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        out = args.out / base.name
        folder.save(engine=engine, directory=out, step=2, state={"step": 2}, tokenizer_dir=base, keep_last=1)
        final = loop.gathered_trainable(engine)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in final.items()}, str(out / "final.safetensors"))
        del engine, model
    leave_process_group()


if __name__ == "__main__":
    main()
