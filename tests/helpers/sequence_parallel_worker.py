"""One rank of a sequence-parallel group over gloo, started N times by tests/unit/training/test_ulysses.py (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): a tiny LoRA LLaMA split over the group (pipeline.training.ulysses) and
the same model unsplit, on the same micro-batches of every kind the loop builds; writes (rank 0) each case's loss and
the largest difference of the group's summed gradients from the unsplit ones."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from pipeline.data.batches import pack
from pipeline.data.examples import IGNORE_INDEX
from pipeline.launching.ranks import leave_process_group
from pipeline.training.preference import Objective, pair_loss

VOCAB = 96


def lora_model(kernels: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from pipeline import kernels as speed_paths
    from tools.tiny_model import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, tie_word_embeddings=False))
    model.config.use_cache = False
    model.set_attn_implementation("sdpa")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():  # B != 0: A's gradients are not zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    speed_paths.apply(model, device="cpu", zero_stage=0, enabled=kernels)
    return model


def rows(lengths: list[int], masked: list[int], seed: int) -> list[dict]:
    """Rows of random tokens; the first `masked[i]` labels of row i ignored (a prompt)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n, m in zip(lengths, masked, strict=True):
        ids = torch.randint(1, VOCAB, (n,), generator=generator)
        labels = ids.clone()
        labels[:m] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def pairs(count: int, seed: int) -> list[dict]:
    chosen, rejected = rows([9, 13][:count], [4, 5][:count], seed), rows([11, 6][:count], [4, 5][:count], seed + 1)
    return [
        {"input_ids": c["input_ids"], "labels": c["labels"], "rejected_input_ids": r["input_ids"],
         "rejected_labels": r["labels"]}
        for c, r in zip(chosen, rejected, strict=True)
    ]  # fmt: skip


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def compare(name: str, step, plain, split, group) -> dict:
    """Run `step(model) -> (loss, extra)` on both models; the split one's gradients summed over the group."""
    import deepspeed.comm as dist

    expected, extra_expected = step(plain)
    expected.backward()
    want = gradients(plain)
    seen = []  # the token count of each forward's embedding call: this rank's shard
    hook = split.get_input_embeddings().register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[1]))
    loss, extra = step(split)
    hook.remove()
    loss.backward()
    got = gradients(split)
    worst = 0.0
    for key, value in got.items():
        dist.all_reduce(value, group=group)
        worst = max(worst, float((value - want[key]).abs().max()))
    scale = max(float(v.abs().max()) for v in want.values())
    extra_diff = float((extra - extra_expected).abs().max()) if extra is not None else 0.0
    return {
        "case": name,
        "loss": float(loss),
        "expected_loss": float(expected),
        "grad_diff": worst,
        "grad_scale": scale,
        "extra_diff": extra_diff,
        "shard_tokens": seen,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", type=int, required=True)
    args = parser.parse_args()
    import deepspeed

    from pipeline.training import sequence_parallel, ulysses

    deepspeed.init_distributed(dist_backend="gloo")
    layout = sequence_parallel.initialize(args.size, zero_stage=0)
    results = []
    for kernels in ("off", "auto"):
        plain, split = lora_model(kernels), lora_model(kernels)
        assert ulysses.install(split, layout)
        split.train(), plain.train()

        def lm(batch_rows, model):
            batch = pack(batch_rows, pad_id=0)
            return model(**batch).loss, None

        def logits(batch_rows, model):
            batch = pack(batch_rows, pad_id=0)
            out = model(input_ids=batch["input_ids"]).logits
            return out.float().square().mean(), out

        def preference(kind, batch_rows, model):
            objective = Objective(kind=kind, beta=0.5, simpo_gamma=0.3, reference="precomputed")
            reference = torch.tensor([[-30.0, -31.0], [-40.0, -38.0]])[: len(batch_rows)]
            loss, stats = pair_loss(model, batch_rows, pad_id=0, objective=objective, reference=reference)
            return loss, torch.tensor([stats["correct"], stats["reward_chosen"], stats["reward_rejected"]])

        cases = {
            "blocks": partial_step(lm, rows([24, 24], [0, 0], 1)),
            "packed_sft": partial_step(lm, rows([7, 12, 6], [3, 5, 2], 2)),
            "labels_on_one_shard": partial_step(lm, rows([16, 10], [16, 0], 3)),
            "one_long_row": partial_step(lm, rows([41], [0], 4)),
            "logits": partial_step(logits, rows([9, 9], [0, 0], 5)),
            "dpo_padded_pairs": partial_step(lambda r, m: preference("dpo", r, m), pairs(2, 6)),
            "orpo_padded_pairs": partial_step(lambda r, m: preference("orpo", r, m), pairs(2, 8)),
        }
        for name, step in cases.items():
            results.append({"kernels": kernels, **compare(name, step, plain, split, layout.group)})
    if int(os.environ["RANK"]) == 0:
        args.out.write_text(json.dumps(results, indent=1))
    leave_process_group()  # else gloo's threads can abort a rank at the interpreter's teardown, its work done


def partial_step(fn, batch_rows):
    return lambda model: fn(batch_rows, model)


if __name__ == "__main__":
    main()
