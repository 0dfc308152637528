"""The peer of bench/long_context.py on CPU ranks: Ulysses sequence parallelism as transformers' Trainer runs it
(accelerate's `ParallelismConfig(sp_backend="deepspeed")`, the path TRL's SFTTrainer takes too), PEFT LoRA and
DeepSpeed ZeRO-2, launched by `accelerate launch` as its users launch it (one OpenMP thread per rank). The same random
model, the same tokenized blocks and the same settings as our side (bf16, r=16 on every linear layer, activation
checkpointing, one sequence a step). Each rank writes its figures to `--out`/rank{N}.json: the step times and the
process's peak memory and the logged losses.

    accelerate launch --config_file CONFIG bench/long_context_peer.py --base B --dataset D --rows 4,0,2 --out DIR"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path


def accelerate_config(folder: Path, *, ranks: int, ds_config: Path) -> Path:
    """The accelerate config file a user writes for Ulysses over `ranks` CPU processes (transformers'
    deepspeed_alst guide; SDPA: the attention a CPU has)."""
    import yaml

    config = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "use_cpu": True,
        "num_machines": 1, "machine_rank": 0, "num_processes": ranks,
        "deepspeed_config": {"deepspeed_config_file": str(ds_config)},
        "parallelism_config": {"parallelism_config_sp_size": ranks, "parallelism_config_dp_replicate_size": 1,
                               "parallelism_config_sp_backend": "deepspeed",
                               "parallelism_config_sp_seq_length_is_variable": True,
                               "parallelism_config_sp_attn_implementation": "sdpa"},
    }  # fmt: skip
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": "auto",
    }  # the Trainer's values: HF's template
    ds_config.write_text(json.dumps(ds))
    path = folder / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--dataset", type=Path, required=True, help="tokenized blocks (datasets' save_to_disk)")
    parser.add_argument("--rows", required=True, help="the training rows of each step, in order (one a step)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from datasets import load_from_disk
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # accelerate on CPU starts torch.distributed, not DeepSpeed's
        import deepspeed  # comm, which registering Ulysses asserts: what a user adds to run this on CPU ranks

        deepspeed.init_distributed(dist_backend="gloo")
    rows = [int(n) for n in args.rows.split(",")]
    train = load_from_disk(str(args.dataset))["train"].select(rows).select_columns(["input_ids"])
    train = train.map(lambda row: {"labels": row["input_ids"], "position_ids": list(range(len(row["input_ids"])))})
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16, attn_implementation="sdpa")
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.losses = [], []

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.start)

        def on_log(self, *_, logs=None, **__):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    training = TrainingArguments(
        output_dir=str(args.out / "trainer"), per_device_train_batch_size=1, gradient_accumulation_steps=1,
        max_steps=len(rows), train_sampling_strategy="sequential", learning_rate=1e-4, warmup_steps=0, bf16=True,
        gradient_checkpointing=True, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, deepspeed=os.environ["PEER_DS_CONFIG"],
    )  # fmt: skip
    timer = StepTimes()
    Trainer(model=model, args=training, train_dataset=train, callbacks=[timer]).train()
    rank = int(os.environ.get("RANK", "0"))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures = {"step_seconds": timer.times, "losses": timer.losses, "peak_mb": peak_mb}
    (args.out / f"rank{rank}.json").write_text(json.dumps(figures))
    # As PyTorch asks of a script's end: left to the interpreter's teardown, gloo's threads could abort a rank whose
    # work was done (exit -6, "terminate called without an active exception"; seen in make test).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
