"""Started by tests/integration/test_interop.py through `deepspeed --num_gpus N --module
tests.helpers.interop_engine_worker`: for each case, a bare `deepspeed.initialize` (no code of ours) trains a tiny PEFT
LoRA LLaMA two steps with the optimizer the case names and saves a checkpoint as DeepSpeed's own API does
(`<case>/latest`, `<case>/global_step2/`), with the adapter config beside the tag; then writes the live engine's fp32
masters (and, where the engine can say, Adam's moments) and its module values to `<case>/live.safetensors`."""

from __future__ import annotations

CONFIG_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
# case: (ZeRO stage, precision, optimizer "config" | "client", DeepSpeed config additions, options)
CASES = {
    "z0_bf16_fused_frozen_saved": (0, "bf16", "config", {}, {"two_groups", "frozen_saved"}),
    "z0_fp16_fused": (0, "fp16", "config", {}, set()),
    "z0_bf16_unfused_two_groups": (0, "bf16", "client", {}, {"two_groups"}),
    "z0_fp32_fusedadam": (0, "fp32", "config", {}, {"frozen_saved"}),
    "z1_bf16_bf16_optimizer": (1, "bf16", "config", {"data_types": {"grad_accum_dtype": "fp32"}}, {"two_groups"}),
    "z1_fp16_config": (1, "fp16", "config", {}, set()),
    "z2_bf16_round_robin_client": (2, "bf16", "client", {"zero_optimization": {"round_robin_gradients": True}}, set()),
    "z2_bf16_elastic_aligned": (
        2, "bf16", "config", {"zero_optimization": {"elastic_checkpoint": True, "parameter_alignment": True}}, set()
    ),
    "z2_bf16_legacy_offload": (
        2, "bf16", "config", {"checkpoint": {"checkpoint_serialization": False},
                              "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, set()
    ),
    "z2_bf16_bf16_masters": (
        2, "bf16", "config", {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}, set()
    ),
    "z3_bf16_subgroups_frozen_saved": (
        3, "bf16", "config", {"zero_optimization": {"sub_group_size": 500}}, {"two_groups", "frozen_saved"}
    ),
    "z3_fp32_offload_client": (
        3, "fp32", "client", {"zero_force_ds_cpu_optimizer": False, "zero_optimization": {
            "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}, set()
    ),
}  # fmt: skip
VOCAB = 96


def tiny_llama():
    """A tiny random LLaMA (odd sizes: ZeRO pads), its own lm_head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=33, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=3, lora_alpha=6, target_modules=["q_proj", "v_proj", "up_proj"], modules_to_save=["lm_head"],
        init_lora_weights="gaussian",
    )  # fmt: skip
    return get_peft_model(model, config)


def _merge(into: dict, extra: dict) -> dict:
    for key, value in extra.items():
        into[key] = _merge(dict(into.get(key, {})), value) if isinstance(value, dict) else value
    return into


def live_state(engine) -> dict:
    """The live engine's fp32 master (NAME), module value (NAME#lp) and, where the engine can give them, Adam's
    moments (NAME#exp_avg...) of every trainable parameter, each from where that engine keeps it (a collective
    under ZeRO-3: call on every rank)."""
    import deepspeed.comm as dist
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt, out = engine.optimizer, {}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    kind = type(opt).__name__
    if kind == "FP16_Optimizer":  # one flat fp32 vector per group, parameters in group order
        for params, flat in zip(opt.fp16_groups, opt.fp32_groups_flat, strict=True):
            offset = 0
            for p in params:
                out[names[id(p)]] = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
    elif kind == "FP16_UnfusedOptimizer":
        for params, masters in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
            out.update({names[id(p)]: m for p, m in zip(params, masters, strict=True)})
    elif engine.zero_optimization_stage() == 0 and kind != "BF16_Optimizer":  # the module trains in fp32 itself
        out.update({n: p for n, p in trainable})
    elif getattr(opt, "round_robin_gradients", False):  # DeepSpeed's accessors use module order here: walk the flat
        for g, params in enumerate(opt.round_robin_bit16_groups):
            partition = opt.single_partition_of_fp32_groups[g]
            state = opt.optimizer.state[partition]
            for key, local in (("", partition), ("#exp_avg", state["exp_avg"]), ("#exp_avg_sq", state["exp_avg_sq"])):
                parts = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, local.detach())
                flat, offset = torch.cat(parts), 0
                for p in params:
                    out[names[id(p)] + key] = flat[offset : offset + p.numel()].view(p.shape)
                    offset += p.numel()
    else:
        for name, p in trainable:
            out[name] = safe_get_full_fp32_param(p)
            for moment in ("exp_avg", "exp_avg_sq"):
                out[f"{name}#{moment}"] = safe_get_full_optimizer_state(p, moment)
    if engine.zero_optimization_stage() == 3:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([p for _, p in trainable]):
            out.update({f"{n}#lp": p.detach().clone() for n, p in trainable})
    else:
        out.update({f"{n}#lp": p.detach().clone() for n, p in trainable})
    return {k: v.detach().float().cpu().contiguous().clone() for k, v in out.items()}


def run_case(name: str, out) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from safetensors.torch import save_file

    stage, precision, optimizer, extra, options = CASES[name]
    model = lora(tiny_llama())
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [p for _, p in trainable]
    if "two_groups" in options:  # lora_A decays, the rest does not (as trainers split decay groups)
        groups = [
            {"params": [p for n, p in trainable if "lora_A" in n], "weight_decay": 0.01},
            {"params": [p for n, p in trainable if "lora_A" not in n], "weight_decay": 0.0},
        ]
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
    }  # fmt: skip
    if precision != "fp32":
        config[precision] = {"enabled": True, **({"initial_scale_power": 4} if precision == "fp16" else {})}
    if optimizer == "config":
        config["optimizer"] = CONFIG_OPTIMIZER
    config = _merge(config, extra)
    client = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01) if optimizer == "client" else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, optimizer=client, config=config)
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(out / name), exclude_frozen_parameters="frozen_saved" not in options)
    state = live_state(engine)
    if rank == 0:
        save_file(state, str(out / name / "live.safetensors"))
        engine.module.peft_config["default"].save_pretrained(str(out / name))
        (out / name / "wrapper.txt").write_text(type(engine.optimizer).__name__)
    dist.barrier()


def main() -> None:
    import argparse
    from pathlib import Path

    import deepspeed
    import deepspeed.comm as dist

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args()
    deepspeed.init_distributed()
    # DeepSpeed refuses fp16 on a CPU that does not compute it (AVX512-FP16 or AMX-FP16); torch computes it anyway,
    # slowly, and the checkpoints are what an fp16 engine writes everywhere: the fp16 cases are written on any CPU
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True
    # DeepSpeed probes the CPU with py-cpuinfo, a Python process each time, at every JIT load of its CPU Adam (each
    # case's engine, twice) and in DeepSpeedCPUAdam: asked once here, as in our ranks (what it writes is the same)
    from pipeline.core.deepspeed_patches import cpu_info_once

    cpu_info_once()
    for name in args.cases:
        run_case(name, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
