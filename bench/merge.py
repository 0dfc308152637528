"""merge against what users run today: PeftModel.from_pretrained(base, adapter).merge_and_unload()
.save_pretrained(out) (after resizing the base to the adapter's vocabulary), on the default model and adapter, in
one run: wall time and peak memory ratios (targets: at most 1.0x time, 0.5x memory). Ours is timed without and
with its logits verification (the reference verifies nothing). `--large` also merges a random 1.2B-parameter
LLaMA stored in 500 MB shards, to show the streaming bound. Needs `make run` first.

    python -m bench.merge [--large]
    python -m bench.merge --smoke [--results DIR]   # the tiny pipeline's base and adapter (make test)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.common import report, results_folder, run_measured, smoke_arguments, smoke_project
from pipeline.core.atomic import read_json

BASE, ADAPTER = Path("artifacts/base"), Path("artifacts/adapter")


def peft_merge(base: Path, adapter: Path, out: Path) -> None:
    """The reference, as users write it."""
    import torch
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        rows = [f.get_slice(k).get_shape()[0] for k in f.keys() if k.endswith("embed_tokens.weight")]  # noqa: SIM118
    if rows:  # a vocabulary extension: PEFT needs the base resized first
        model.resize_token_embeddings(rows[0])
    PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().save_pretrained(str(out))


def large_base(out: Path) -> None:
    """A random 1.2B LLaMA (TinyLlama's shape, SmolLM2's vocabulary) in fp32 500 MB shards, and a LoRA adapter."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    for param in model.parameters():
        param.data.normal_(0, 0.02)
    model.save_pretrained(str(out / "base"), max_shard_size="500MB")
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    get_peft_model(model, lora).save_pretrained(str(out / "adapter"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / "base" / name).write_bytes((BASE / name).read_bytes())


def _ours(base: Path, adapter: Path, out: Path, *, verify: bool, shard: str = "2GB") -> list[str]:
    flags = [] if verify else ["--no-verify"]
    command = ["-m", "pipeline", "merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out)]
    return [sys.executable, *command, "--max-shard-size", shard, *flags]


def measure(base: Path, adapter: Path, *, large: bool) -> dict:
    """Both sides on `base` and `adapter`, each in its own measured process; with `large`, ours on the 1.2B too."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        reference = [sys.executable, "-m", "bench.merge", "reference", str(base), str(adapter), str(work / "peft")]
        ref_seconds, ref_peak, _ = run_measured(reference)
        seconds, peak, _ = run_measured(_ours(base, adapter, work / "ours", verify=False))
        verified_seconds, verified_peak, _ = run_measured(_ours(base, adapter, work / "verified", verify=True))
        figures = {
            "reference_seconds": round(ref_seconds, 2), "ours_seconds": round(seconds, 2),
            "time_ratio": round(seconds / ref_seconds, 3), "target_time_ratio": 1.0,
            "reference_peak_memory_mb": round(ref_peak, 1), "ours_peak_memory_mb": round(peak, 1),
            "memory_ratio": round(peak / ref_peak, 3), "target_memory_ratio": 0.5,
            "ours_verified_seconds": round(verified_seconds, 2),
            "ours_verified_peak_memory_mb": round(verified_peak, 1),
        }  # fmt: skip
        if large:
            run_measured([sys.executable, "-m", "bench.merge", "make-large", str(work / "large")])
            base = work / "large" / "base"
            shard = max(p.stat().st_size for p in base.glob("*.safetensors"))
            seconds, peak, _ = run_measured(
                _ours(base, work / "large" / "adapter", work / "merged", verify=False, shard="500MB")
            )
            params = read_json(base / "model.safetensors.index.json")["metadata"]["total_size"] / 4
            figures.update(
                large_parameters=int(params), large_largest_shard_mb=round(shard / 2**20, 1),
                large_seconds=round(seconds, 2), large_peak_memory_mb=round(peak, 1),
            )  # fmt: skip
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", action="store_true", help="also merge a random 1.2B LLaMA in 500 MB shards")
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    if not args.smoke:
        report("merge", measure(BASE, ADAPTER, large=args.large), results)
        return
    if args.large:
        parser.error("--large and --smoke: the smoke run merges the tiny model only")
    with smoke_project(args.project) as project:
        report("merge", {**measure(project / BASE, project / ADAPTER, large=False), "smoke": True}, results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["reference"]:
        peft_merge(*map(Path, sys.argv[2:5]))
    elif sys.argv[1:2] == ["make-large"]:
        large_base(Path(sys.argv[2]))
    else:
        main()
