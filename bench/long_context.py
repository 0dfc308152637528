"""Long sequences: the longest sequence that trains and tokens/s as it grows.

On CPU ranks (the default): a small random LLaMA through the train stage (DeepSpeed over gloo, ZeRO-2, LoRA r=16 on
every linear layer, one sequence per step, activation checkpointing, the tiled MLP) at 1-, 2- and 4-way sequence
parallelism (`train.sequence_parallel`, one group of that many ranks), at growing lengths until a length's predicted
step time passes the budget: tokens/s without the first step, and each rank's peak memory. Beside it, at each length
and size, the peer: transformers' Trainer with accelerate's Ulysses (DeepSpeed's ALST sequence parallelism, the path
TRL's SFTTrainer takes), PEFT and ZeRO-2 under `accelerate launch` (bench/long_context_peer.py), on the same model,
rows and settings; `speedup_over_peer` is ours over its tokens/s.

On one GPU (`--gpu`, where CUDA is present; nothing is downloaded): Llama-3-8B's shape with random weights made on the
GPU, LoRA r=16 on every linear layer, bf16, one sequence a step, a rank's model path without DeepSpeed's engine (one
card: nothing to partition or split; the tiled MLP is DeepSpeed's: `make gpu-wheels` carries it): our kernels, the
tiled MLP, activation checkpointing with the kept layer inputs in pinned host memory; the lengths grow (4k, 32k, 128k,
256k, 512k) until one runs out of memory or its predicted time passes the budget. Beside it, the loop a user writes with
transformers and PEFT alone (SDPA, checkpointing, fused AdamW) on the same model and lengths, as far as it goes. Goals
on one H100 (issue 46): >= 128k tokens a sequence, aiming at ALST's 500k; tokens/s at 32k within 0.8x of 4k's per
token with attention's extra work accounted for (`work_ratio_32k_over_4k`: the ratio of the FLOPs rates).

    python -m bench.long_context [--lengths 2048,8192,32768] [--budget-s 1200]
    python -m bench.long_context --gpu [--budget-s 240] [--results DIR]    # one command, about 5 minutes on an H200
    python -m bench.long_context --smoke   # make test: both modes at a tiny size on the CPU (1- and 2-way)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import report, results_folder, smoke_arguments

REPO = Path(__file__).resolve().parents[1]

GPU_SHAPE = {  # Llama-3-8B
    "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "max_position_embeddings": 524288,
    "rope_theta": 500000.0,
}  # fmt: skip
GPU_LENGTHS = (4096, 32768, 131072, 262144, 524288)
CPU_SHAPE = {
    "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 688, "num_attention_heads": 8,
    "num_key_value_heads": 4, "tie_word_embeddings": False, "max_position_embeddings": 65536,
}  # fmt: skip
CPU_LENGTHS = (2048, 8192, 32768)
SMOKE_SHAPE = {**CPU_SHAPE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}  # fmt: skip
SMOKE_LENGTHS = (128, 256)  # the GPU mode's on a CPU; the CPU ranks' smoke: one length (a launch each way)


def predicted_seconds(measured: list[tuple[int, float]], length: int, *, shape: dict) -> float:
    """A step's time at `length`: the last measured step's, scaled by the step's FLOPs (`work_per_token` x L). An
    overestimate from short steps, whose fixed cost is scaled too; a quadratic fit refused 32k on an H200 after a
    1.1 s step at 4k, where 32k then took 6 s."""
    if not measured:
        return 0.0
    (n, t) = measured[-1]
    return t * length * work_per_token(shape, length) / (n * work_per_token(shape, n))


def work_per_token(shape: dict, length: int) -> float:
    """Training FLOPs a token with LoRA: 4 x the parameters that multiply plus causal attention
    (training.figures.flops_per_token's convention)."""
    from transformers import LlamaConfig

    from pipeline.training.figures import flops_per_token

    config = LlamaConfig(**shape)
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        n_params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    return flops_per_token(n_params=n_params, model_config=config, seq_len=length)


# ---------------------------------------------------------------------------------------------------------- GPU


def lora_model(shape: dict, *, ours: bool, device: str, dtype: torch.dtype):
    """The random model of `shape` made on `device`, LoRA r=16 on every linear layer; `ours`: with our kernels, the
    tiled MLP and offloaded checkpoints, else as a user's transformers + PEFT loop has it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the weights made in the training dtype, on the device: nothing read or copied
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(default)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not ours:
        model.enable_input_require_grads()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(model, lora, autocast_adapter_dtype=not ours)
    if ours:
        from pipeline import kernels
        from pipeline.kernels import offloaded_checkpoints
        from pipeline.model import tiled_mlp

        kernels.apply(model, device=device.split(":")[0], zero_stage=0, enabled="auto")
        tiled_mlp.install(model)
        offloaded_checkpoints.install(model)
    return model.train()


def run_lengths(shape: dict, lengths, *, ours: bool, budget_s: float, device: str, dtype: torch.dtype) -> list[dict]:
    """A training step (forward, backward, AdamW) at each length, growing, until one runs out of memory or would
    pass the budget: seconds (without the first step's warm-up where it ran two), tokens/s, peak memory."""
    model = lora_model(shape, ours=ours, device=device, dtype=dtype)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    cuda = device.startswith("cuda")
    rows, measured, start = [], [], time.perf_counter()
    for length in lengths:
        left = budget_s - (time.perf_counter() - start)
        predicted = predicted_seconds(measured, length, shape=shape)
        if measured and predicted > left:
            rows.append({"length": length, "result": "not tried: past the time budget",
                         "predicted_s": round(predicted, 1)})  # fmt: skip
            continue
        steps = 2 if length <= 32768 else 1  # a warm-up step where it is cheap
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            seconds = []
            for _ in range(steps):
                ids = torch.randint(0, shape["vocab_size"], (1, length), device=device)
                if cuda:
                    torch.cuda.synchronize()
                tick = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - tick)
        except (torch.OutOfMemoryError, RuntimeError) as err:  # the GPU's memory, or pinned host memory
            if "out of memory" not in str(err).lower():
                raise
            optimizer.zero_grad(set_to_none=True)
            rows.append({"length": length, "result": "out of memory", "error": str(err).splitlines()[0][:200]})
            break
        step_s = seconds[-1]
        measured.append((length, step_s))
        row = {"length": length, "result": "trained", "step_s": round(step_s, 2),
               "tokens_per_s": round(length / step_s, 1)}  # fmt: skip
        if cuda:
            row["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        if cuda and ours:
            row["estimate_gpu_memory_gb"] = round(estimate(shape, length)["device"] / 1e9, 2)
        row["peak_host_memory_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        rows.append(row)
        print(f"bench.long_context: {'ours' if ours else 'transformers + PEFT'} {row}", flush=True)
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return rows


def estimate(shape: dict, length: int) -> dict[str, float]:
    """The plan's memory estimate (training.memory_estimate) of our path on one GPU at `length` tokens, bytes."""
    from pipeline.training.memory_estimate import Setting, Shapes, per_rank

    hidden, layers, inner = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    linear = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner)
    vocab = shape["vocab_size"] * hidden * (1 if shape.get("tie_word_embeddings") else 2)
    lora = 16 * layers * (4 * hidden + 2 * (hidden + kv) + 3 * (hidden + inner))
    model = Shapes(parameters=linear + vocab, largest=shape["vocab_size"] * hidden, trainable=lora, hidden=hidden,
                   layers=layers, heads=shape["num_attention_heads"], intermediate=inner,
                   vocab=shape["vocab_size"])  # fmt: skip
    setting = Setting(zero_stage=0, offload_param=False, offload_optimizer=False, world_size=1, dtype_bytes=2,
                      tokens=length, checkpointing=True, accelerator="cuda", tiled_mlp=True,
                      checkpoint_offload=True)  # fmt: skip
    return per_rank(model, setting)


def gpu_figures(shape: dict, lengths, *, budget_s: float, device: str, dtype: torch.dtype, peer: bool = True) -> dict:
    ours = run_lengths(shape, lengths, ours=True, budget_s=budget_s, device=device, dtype=dtype)
    peer = run_lengths(shape, lengths, ours=False, budget_s=budget_s / 3, device=device, dtype=dtype) if peer else []
    trained = {r["length"]: r for r in ours if r["result"] == "trained"}
    figures = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "shape": shape,
        "ours": ours,
        "transformers_peft": peer,
        "longest_trained": max(trained, default=None),
        "peer_longest_trained": max((r["length"] for r in peer if r["result"] == "trained"), default=None),
    }
    short, long = sorted(trained)[:1], [n for n in sorted(trained) if n > lengths[0]][:1]
    if short and long:
        a, b = trained[short[0]], trained[long[0]]
        work = work_per_token(shape, long[0]) / work_per_token(shape, short[0])
        figures |= {
            f"tokens_per_s_ratio_{long[0]}_over_{short[0]}": round(b["tokens_per_s"] / a["tokens_per_s"], 3),
            f"work_ratio_{long[0]}_over_{short[0]}": round(b["tokens_per_s"] * work / a["tokens_per_s"], 3),
        }
    return figures


# ---------------------------------------------------------------------------------------------------------- CPU


def cpu_inputs(root: Path, shape: dict, lengths) -> tuple[Path, dict[int, Path]]:
    """A random model of `shape` with SmolLM2's tokenizer, and per length a dataset of People's Daily as blocks of
    that many tokens (a few rows: one sequence a step)."""
    import yaml

    from bench.common import peoples_daily_text
    from bench.scale_check import write_random_llama
    from pipeline.core.assets import resolve
    from pipeline.data import streamed
    from pipeline.data.assembly import Packing
    from pipeline.data.tokenizer import META, load_tokenizer

    gguf = resolve(yaml.safe_load((REPO / "conf/model/smollm2_135m.yaml").read_text())["path"])
    tokenizer = load_tokenizer(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(str(root / "tokenizer"))
    meta = {"vocab_size": len(tokenizer), "padded_vocab_size": len(tokenizer)}
    (root / "tokenizer" / META).write_text(json.dumps(meta))
    write_random_llama(root / "base", root / "tokenizer", shape={**shape, "vocab_size": len(tokenizer)})
    documents = peoples_daily_text().decode("utf-8").splitlines()
    datasets = {}
    for length in lengths:
        need = 4 * length  # characters: comfortably more than 3 blocks
        text, total = [], 0
        for doc in documents:
            text.append(doc)
            total += len(doc)
            if total > need:
                break
        (root / f"text_{length}.txt").write_text("\n".join(text) + "\n", encoding="utf-8")
        packing = Packing("text", length, "drop", "alpaca", length, validation_fraction=0.34, seed=0)
        streamed.build(
            root / f"dataset_{length}",
            tokenizer_dir=root / "tokenizer",
            train_file=str(root / f"text_{length}.txt"),
            heldout_fraction=None,
            packing=packing,
            work=root / f"parts_{length}",
            workers=1,
            chunk_chars=1 << 30,
        )
        datasets[length] = root / f"dataset_{length}"
    return root / "base", datasets


def cpu_run(root: Path, base: Path, dataset: Path, *, length: int, size: int, steps: int) -> dict:
    """The train stage on `size` CPU ranks sharing each sequence; its figures."""
    import yaml

    from pipeline.core import config
    from pipeline.core.atomic import read_json
    from pipeline.core.environment import with_venv_path

    out = root / f"run_{length}_{size}"
    out.mkdir()
    overrides = [
        "tracking.uri=", "launcher.accelerator=cpu", f"launcher.ranks_per_node={size}",
        f"train.sequence_parallel={size}", "train.micro_batch_size=1", "train.global_batch_size=1",
        f"train.max_steps={steps}", "train.warmup_steps=0", f"train.save_every={steps}", f"train.eval_every={steps}",
        "train.eval_max_rows=1", "train.gradient_checkpointing=true", "train.tiled_mlp=true", "train.precision=bf16",
        "lora.r=16", "lora.alpha=32", "lora.dropout=0.0", "lora.target_modules=all-linear", "lora.modules_to_save=[]",
        "train.resize_embeddings=false", "deepspeed=zero2",
    ]  # fmt: skip
    (out / "params.yaml").write_text(yaml.safe_dump(config.compose(REPO / "conf", overrides)))
    command = [
        sys.executable, "-m", "stages.train", "--params", str(out / "params.yaml"), "--base", str(base),
        "--tokenizer", str(root / "tokenizer"), "--dataset", str(dataset), "--checkpoints", str(out / "ckpt"),
        "--metrics", str(out / "train.json"), "--curve", str(out / "curve.csv"), "--run-id-file", str(out / "run.json"),
    ]  # fmt: skip
    tick = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=with_venv_path(), capture_output=True, text=True)
    if done.returncode:
        return {"length": length, "sequence_parallel": size, "result": f"failed: {done.stderr.strip()[-300:]}",
                "output_tail": (done.stdout + done.stderr)[-4000:]}  # fmt: skip
    metrics = read_json(out / "train.json")
    step_s = length / (metrics["steady_tokens_per_s"] or metrics["tokens_per_s"])
    return {
        "length": length, "sequence_parallel": size, "result": "trained", "step_s": round(step_s, 2),
        "tokens_per_s": round(metrics["steady_tokens_per_s"] or metrics["tokens_per_s"], 1),
        "peak_memory_mb_per_rank": metrics["peak_memory_mb_per_rank"],
        "first_loss": float((out / "curve.csv").read_text().splitlines()[1].split(",")[1]),
        "stage_seconds": round(time.perf_counter() - tick, 1),
    }  # fmt: skip


def peer_run(root: Path, base: Path, dataset: Path, *, length: int, size: int, steps: int) -> dict:
    """transformers' Trainer with accelerate's Ulysses (bench/long_context_peer.py) on `size` CPU ranks, launched by
    `accelerate launch`, given the rows our run trains on in our order: step seconds without the first step, each
    rank's peak memory, the first loss."""
    import statistics

    from datasets import load_from_disk

    from bench.long_context_peer import accelerate_config
    from pipeline.core import config
    from pipeline.core.environment import free_port, with_venv_path
    from pipeline.training.schedule import global_batch

    out = root / f"peer_{length}_{size}"
    out.mkdir()
    n_rows, seed = load_from_disk(str(dataset))["train"].num_rows, config.compose(REPO / "conf", [])["seed"]
    rows = [int(global_batch(step, n_rows=n_rows, global_batch_size=1, seed=seed)[0]) for step in range(steps)]
    ds_config = out / "ds_config.json"
    launch_config = accelerate_config(out, ranks=size, ds_config=ds_config)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launch_config),
        "--main_process_port", str(free_port()), str(REPO / "bench" / "long_context_peer.py"),
        "--base", str(base), "--dataset", str(dataset), "--rows", ",".join(map(str, rows)), "--out", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in with_venv_path().items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    tick = time.perf_counter()
    done = subprocess.run(command, cwd=out, env={**env, "PEER_DS_CONFIG": str(ds_config)}, capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode:  # the launcher's last line names only its wrapper: the rank's own output kept in the figures
        errors = [line for line in done.stderr.splitlines() if "Error" in line] or [done.stderr.strip()[-300:]]
        return {"length": length, "sequence_parallel": size, "result": f"failed: {errors[-1][-300:]}",
                "output_tail": (done.stdout + done.stderr)[-4000:]}  # fmt: skip
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(size)]
    step_s = statistics.median(max(r["step_seconds"][i] for r in ranks) for i in range(1, steps))
    return {
        "length": length, "sequence_parallel": size, "result": "trained", "step_s": round(step_s, 2),
        "tokens_per_s": round(length / step_s, 1), "peak_memory_mb_per_rank": [round(r["peak_mb"], 1) for r in ranks],
        "first_loss": ranks[0]["losses"][0], "stage_seconds": round(time.perf_counter() - tick, 1),
    }  # fmt: skip


def cpu_figures(shape: dict, lengths, sizes, *, budget_s: float, steps: int) -> dict:
    """Each size's lengths on both sides (ours, then transformers' Trainer with accelerate's Ulysses) while the next
    length's predicted time for both fits the size's budget."""
    rows, peer_rows = [], []
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        root = Path(tmp)
        base, datasets = cpu_inputs(root, shape, lengths)
        for size in sizes:
            measured, start = [], time.perf_counter()
            for length in lengths:
                predicted = predicted_seconds(measured, length, shape=shape) * steps * 2
                if measured and predicted > budget_s - (time.perf_counter() - start):
                    skipped = {"length": length, "sequence_parallel": size, "result": "not tried: past the time budget",
                               "predicted_s": round(predicted, 1)}  # fmt: skip
                    rows.append(skipped)
                    peer_rows.append(skipped)
                    continue
                row = cpu_run(root, base, datasets[length], length=length, size=size, steps=steps)
                peer = peer_run(root, base, datasets[length], length=length, size=size, steps=steps)
                rows.append(row)
                peer_rows.append(peer)
                print(f"bench.long_context: ours {row}\nbench.long_context: peer {peer}", flush=True)
                if row["result"] != "trained":
                    break
                measured.append((length, max(row["step_s"], peer.get("step_s", 0))))

    def longest(side: list[dict]) -> dict:
        return {size: max((r["length"] for r in side if r["sequence_parallel"] == size and r["result"] == "trained"),
                          default=None) for size in sizes}  # fmt: skip

    both = [(r, p) for r, p in zip(rows, peer_rows, strict=True) if r.get("tokens_per_s") and p.get("tokens_per_s")]
    speedups = {f"{r['length']}_sp{r['sequence_parallel']}": round(r["tokens_per_s"] / p["tokens_per_s"], 3)
                for r, p in both}  # fmt: skip
    return {"device": "cpu", "shape": shape, "runs": rows, "peer": "transformers Trainer + accelerate Ulysses",
            "peer_runs": peer_rows, "longest_trained": longest(rows), "peer_longest_trained": longest(peer_rows),
            "speedup_over_peer": speedups}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="one GPU, the 8B shape (a CPU runs it at the smoke shape)")
    parser.add_argument("--lengths", help="comma-separated sequence lengths (tokens)")
    parser.add_argument("--budget-s", type=float, help="seconds of steps per mode (GPU: ours; the peer gets a third)")
    parser.add_argument("--sizes", default="1,2,4", help="CPU: the sequence-parallel sizes")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="GPU: without the transformers loop")
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    picked = tuple(int(n) for n in args.lengths.split(",")) if args.lengths else None
    if args.gpu:
        on_gpu = torch.cuda.is_available() and not args.smoke
        shape = GPU_SHAPE if on_gpu else {**SMOKE_SHAPE, "vocab_size": 512}
        device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
        lengths = picked or (GPU_LENGTHS if on_gpu else SMOKE_LENGTHS)
        figures = gpu_figures(shape, lengths, budget_s=args.budget_s or (240 if on_gpu else 60), device=device,
                              dtype=dtype, peer=args.peer)  # fmt: skip
        report("long_context_gpu", {**figures, "smoke": not on_gpu}, results)
        return
    if args.smoke:  # the GPU mode's code path too, at the smoke shape on the CPU
        figures = gpu_figures({**SMOKE_SHAPE, "vocab_size": 512}, SMOKE_LENGTHS, budget_s=60, device="cpu",
                              dtype=torch.float32)  # fmt: skip
        report("long_context_gpu", {**figures, "smoke": True}, results)
    sizes = (1, 2) if args.smoke else tuple(int(n) for n in args.sizes.split(","))
    shape = SMOKE_SHAPE if args.smoke else CPU_SHAPE
    lengths = picked or (SMOKE_LENGTHS[-1:] if args.smoke else CPU_LENGTHS)
    figures = cpu_figures(shape, lengths, sizes, budget_s=args.budget_s or (120 if args.smoke else 1200),
                          steps=2 if args.smoke else 3)  # fmt: skip
    report("long_context", {**figures, "smoke": args.smoke}, results)


if __name__ == "__main__":
    main()
