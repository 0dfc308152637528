"""ZeRO's host work per training step, measured on a CPU. On a GPU, ZeRO-3's step is ZeRO-2's GPU time plus the GPU
waiting for its host (docs/gpu.md); that host work runs the same on a CPU. One rank over gloo in this process, a
LLaMA of many thin layers (LoRA r=4 on every linear layer, fp32, 32 tokens: the arithmetic a small part of the step)
over the layer paths a GPU installs (`kernels.apply` for CUDA, PyTorch's operators, less the compiled layers), the
CPU time of one thread per step, in blocks of steps. This machine's speed moves between runs more than within one, so
`--compare NAME` trains one engine in alternating blocks with and without one change:

- `zero3_release`: core/deepspeed_patches.py's release against DeepSpeed's own;
- `aten_linear`: the kernels' products through ATen's linear against `torch.nn.functional.linear` (DeepSpeed's
  replacement of it under ZeRO-3);
- `zero3_flags`: core/deepspeed_patches.py's forward flags set through a list against DeepSpeed's walk of the modules.

    python -m tools.host_step [--stage 3] [--compare zero3_release] [--rounds 16] [--steps 5] [--layers 32]

Prints one JSON line: each side's milliseconds a step per block and their medians; with --compare the paired
difference, and how often each side called the replaced function (0 on the side with the change)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

COMPARED = ("zero3_release", "aten_linear", "zero3_flags")
NEEDS_ZERO3 = ("zero3_release", "zero3_flags")
TOKENS = 32


def engine_for(*, stage: int, layers: int, width: int):
    """A thin LoRA LLaMA under DeepSpeed's ZeRO `stage` on this process's one rank, set up as a GPU rank sets it up."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline import kernels
    from pipeline.core import deepspeed_patches
    from pipeline.model.lora import parameter_groups
    from pipeline.training import ds_config
    from pipeline.training.rank import gather_whole_layers

    torch.manual_seed(0)
    shape = LlamaConfig(
        hidden_size=width, num_hidden_layers=layers, intermediate_size=2 * width, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=4 * TOKENS,
    )  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(shape), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.config.use_cache = False
    kernels.apply(model, device="cuda", zero_stage=stage, enabled="auto", skip=("compiled_layers",))
    if stage == 3:
        gather_whole_layers(model)
    config = ds_config.build(
        zero=ds_config.ZeroSettings(stage=stage), precision="fp32", micro=1, accumulation=1, world_size=1, lr=1e-3,
        weight_decay=0.0, adam_epsilon=1e-8, max_grad_norm=1.0,
    )  # fmt: skip
    groups = parameter_groups(model, 0.0, lr=1e-3, lr_ratio=None)
    engine, *_ = deepspeed_patches.imported().initialize(model=model, model_parameters=groups, config=config)
    kernels.tune_engine(engine, enabled="auto")
    return engine


def switch(name: str, calls: list, engine):
    """`set(on)`: the change `name` in place (on) or not; each call of the replaced function appends to `calls`."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as coordinator

    from pipeline.core.deepspeed_patches import RELEASE, zero3_flags
    from pipeline.kernels import linear

    if name == "zero3_flags":
        deepspeed_prologue = type(engine)._forward_prologue

        def counted_prologue(*args):
            calls.append(1)
            return deepspeed_prologue(engine, *args)

        def set_flags(on: bool) -> None:
            for method in ("_forward_prologue", "_forward_epilogue"):  # DeepSpeed's own again
                engine.__dict__.pop(method, None)
            if on:
                zero3_flags(engine)
            else:
                engine._forward_prologue = counted_prologue

        return set_flags

    if name == "zero3_release":
        ours = getattr(coordinator, RELEASE)
        theirs = ours.replaced  # DeepSpeed's own

        def counted_release(*args, **kwargs):
            calls.append(1)
            return theirs(*args, **kwargs)

        return lambda on: setattr(coordinator, RELEASE, ours if on else counted_release)

    def functional(x, weight, bias=None):
        calls.append(1)
        return torch.nn.functional.linear(x, weight, bias)

    return lambda on: setattr(linear, "ATEN_LINEAR", torch._C._nn.linear if on else functional)


def block(engine, ids: torch.Tensor, steps: int) -> float:
    """Milliseconds of this thread's CPU time a step, over `steps` steps."""
    gc.collect()
    start = time.thread_time()
    for _ in range(steps):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return (time.thread_time() - start) / steps * 1000


def measure(*, stage: int, layers: int, width: int, rounds: int, steps: int, compare: str | None) -> dict:
    from pipeline.core import deepspeed_patches
    from pipeline.core.environment import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    deepspeed_patches.imported().init_distributed(dist_backend="gloo")
    engine = engine_for(stage=stage, layers=layers, width=width)
    engine.train()
    ids = torch.randint(0, 1024, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    block(engine, ids, 2)  # warm-up
    sides = ("with", "without") if compare else ("as installed",)
    calls = {side: [] for side in sides}
    toggles = {side: switch(compare, calls[side], engine) for side in sides} if compare else {}
    times = {side: [] for side in sides}
    for _ in range(rounds):
        for side in sides:
            if compare:
                toggles[side](side == "with")
            times[side].append(round(block(engine, ids, steps), 1))
    out = {"stage": stage, "layers": layers, "width": width, "steps_a_block": steps, "ms_a_step": times}
    out["median"] = {side: statistics.median(values) for side, values in times.items()}
    if compare:
        paired = [b - a for a, b in zip(times["with"], times["without"], strict=True)]
        out |= {"compare": compare, "calls": {side: len(c) for side, c in calls.items()}}
        out |= {"paired_median_ms": round(statistics.median(paired), 1)}
        out |= {"rounds_faster_with": sum(d > 0 for d in paired)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--compare", choices=COMPARED)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="steps a block")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args(argv)
    if args.compare in NEEDS_ZERO3 and args.stage != 3:
        parser.error(f"--compare {args.compare} needs --stage 3")
    from pipeline.kernels import linear

    linear._MATMUL = None  # a GPU's products: ATen's, not oneDNN's CPU path
    figures = measure(
        stage=args.stage, layers=args.layers, width=args.width, rounds=args.rounds, steps=args.steps,
        compare=args.compare,
    )  # fmt: skip
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
