"""Started by tests/integration/test_interop.py through `deepspeed --num_gpus 2 --module
tests.helpers.interop_trainer_worker`: for each case, HF `Trainer` with a DeepSpeed config (as LLaMA-Factory and axolotl
drive it; no code of ours) trains the tiny PEFT LoRA LLaMA two steps, saving `checkpoint-1/` and `checkpoint-2/` into
`<case>/`; then writes the live engine's state (tests/helpers/interop_engine_worker.py's `live_state`) to
`<case>/live.safetensors`: what checkpoint-2 must hold."""

from __future__ import annotations

AUTO = "auto"
# case: (ZeRO stage, precision, "config" (an "optimizer" section: DeepSpeed builds it) | "client" (the Trainer's
# AdamW), zero_optimization additions)
CASES = {
    "hf_z0_bf16_config": (0, "bf16", "config", {}),
    "hf_z0_bf16_client": (0, "bf16", "client", {}),
    "llamafactory_z2_bf16_client": (
        2, "bf16", "client",
        {"overlap_comm": False, "reduce_scatter": True, "contiguous_gradients": True, "round_robin_gradients": True},
    ),
    "hf_z2_fp32_offload_config": (2, "fp32", "config", {"offload_optimizer": {"device": "cpu"}}),
    "hf_z3_bf16_config": (3, "bf16", "config", {"stage3_gather_16bit_weights_on_model_save": True}),
}  # fmt: skip


def deepspeed_config(stage: int, optimizer: str, zero: dict) -> dict:
    """A DeepSpeed config as HF Trainer users write one: values the Trainer fills in left "auto"."""
    config = {
        "train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO, "zero_allow_untested_optimizer": True, "bf16": {"enabled": AUTO},
        "zero_optimization": {"stage": stage, **zero},
    }  # fmt: skip
    if optimizer == "config":
        params = {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}
        config["optimizer"] = {"type": "AdamW", "params": params}
    return config


def run_case(name: str, out) -> None:
    import deepspeed.comm as dist
    import torch
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import save_file
    from transformers import Trainer, TrainingArguments

    from tests.helpers.interop_engine_worker import VOCAB, live_state, lora, tiny_llama

    stage, precision, optimizer, zero = CASES[name]
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(out / name), per_device_train_batch_size=2, max_steps=2, save_strategy="steps", save_steps=1,
        learning_rate=1e-2, weight_decay=0.01, bf16=precision == "bf16", deepspeed=deepspeed_config(
            stage, optimizer, zero), use_cpu=True, report_to=[], seed=0, logging_steps=1, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=lora(tiny_llama()), args=args, train_dataset=data)
    trainer.train()
    state = live_state(trainer.model_wrapped)
    if dist.get_rank() == 0:
        save_file(state, str(out / name / "live.safetensors"))
        (out / name / "wrapper.txt").write_text(type(trainer.model_wrapped.optimizer).__name__)
    dist.barrier()
    AcceleratorState._reset_state()  # the next case's Trainer brings its own DeepSpeed config
    GradientState._reset_state()


def main() -> None:
    import argparse
    from pathlib import Path

    import deepspeed.comm as dist

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args()
    for name in args.cases:
        run_case(name, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
