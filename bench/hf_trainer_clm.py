"""The reference the train benchmark measures against: HF Trainer + a DeepSpeed config + a PEFT LoRA model, the way
Chinese-LLaMA-Alpaca-2's run_clm_pt_with_peft.py trains, on our cached dataset. Started by bench/train.py as
`deepspeed --num_gpus 2 bench/hf_trainer_clm.py ...`, with the launcher's defaults."""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1)
    for name in ("base", "dataset", "ds-config", "out"):
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--vocab-rows", type=int, required=True)
    parser.add_argument("--modules-to-save", nargs="*", default=[])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--accumulation", type=int, required=True)
    args = parser.parse_args()

    import deepspeed.comm as dist
    from datasets import load_from_disk
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    if args.vocab_rows != model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(args.vocab_rows)
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM", modules_to_save=args.modules_to_save or None,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ensure_weight_tying=bool(model.config.tie_word_embeddings and args.modules_to_save),
    )  # fmt: skip
    model = get_peft_model(model, lora)
    data = load_from_disk(str(args.dataset))
    training_args = TrainingArguments(
        output_dir=str(args.out / "trainer"), deepspeed=str(args.ds_config), per_device_train_batch_size=1,
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=2e-4,
        lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, save_strategy="steps", save_steps=args.steps,
        eval_strategy="no", report_to=[], seed=42, disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo",
        use_cpu=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=data["train"], data_collator=default_data_collator)
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    peak = torch.tensor(float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        block = len(data["train"][0]["input_ids"])
        tokens = args.steps * args.accumulation * dist.get_world_size() * block
        figures = {
            "tokens_per_s": tokens / seconds,
            "train_runtime": result.metrics["train_runtime"],
            "peak_memory_mb": float(peak) / 2**20,
        }
        (args.out / "reference.json").write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
