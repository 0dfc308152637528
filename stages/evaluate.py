"""Stage evaluate: bits per byte and perplexity of the base, base + adapter and merged models on every eval set,
greedy samples from fixed prompts; the table and eval.json name the adapter's variant (DoRA, LoRA+, QLoRA)."""

import argparse
import csv
import io
import json
from pathlib import Path

from pipeline import config
from pipeline.atomic import atomic_path, write_json
from stages._common import run


def adapter_variant(adapter_dir: Path) -> dict[str, str]:
    """What produced the adapter, as strings: `name` ("DoRA + LoRA+ x16 on an nf4 base (bf16 compute)") and the
    base's `quantization` (none | nf4 | int8 | unknown for an adapter trained elsewhere)."""
    from pipeline.checkpoints import adapter

    variant = adapter.read_variant(adapter_dir)
    return {"name": adapter.describe_variant(variant), "quantization": variant.get("quantization") or "unknown"}


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    from pipeline import evaluate as ev
    from pipeline.tokenizer import load_tokenizer

    e = cfg.eval
    models = {
        "base": (args.base, None, args.base_tokenizer),
        "adapter": (args.base, args.adapter, args.adapter),
        "merged": (args.merged, None, args.merged),
    }
    for name, (folder, adapter, _) in models.items():
        for path in (folder, adapter):
            if path is not None and not path.is_dir():
                raise FileNotFoundError(f"{path}: missing model folder for '{name}'")
    results: dict[str, dict] = {s: {} for s in e.sets}
    samples: dict[str, list[str]] = {}
    for name, (folder, adapter, tokenizer_dir) in models.items():
        tokenizer = load_tokenizer(tokenizer_dir)
        sets = {
            s: ev.load_examples(
                tokenizer,
                Path(p),
                template=cfg.data.prompt_template,
                max_bytes=e.max_bytes,
                context=e.context,
                key=f"eval.sets.{s}",
            )
            for s, p in e.sets.items()
        }
        model = ev.load_model(folder, adapter, precision=e.precision)
        ev.check_vocabulary(tokenizer, model, f"{tokenizer_dir} with {folder}")
        for set_name, examples in sets.items():
            scored = ev.score(
                model,
                examples,
                context=e.context,
                stride=e.stride,
                batch_size=e.batch_size,
                desc=f"evaluate {name}/{set_name}",
            )
            results[set_name][name] = {k: round(v, 6) for k, v in scored.as_dict().items()}
        samples[name] = ev.greedy_samples(model, tokenizer, prompts=e.prompts, max_new_tokens=e.max_new_tokens)
        del model
    variant = adapter_variant(args.adapter)
    write_json(args.metrics, {**results, "variant": variant})
    table = io.StringIO()
    writer = csv.writer(table, lineterminator="\n")
    writer.writerow(["set", "model", "bits_per_byte", "perplexity", "variant"])
    for s, by in results.items():
        for m, v in by.items():
            writer.writerow([s, m, v["bits_per_byte"], v["perplexity"], "" if m == "base" else variant["name"]])
    with atomic_path(args.plot) as tmp:
        tmp.write_text(table.getvalue(), encoding="utf-8")
    lines = ["# Greedy samples", ""]
    for i, prompt in enumerate(e.prompts):
        answers = [f"- **{m}**: {json.dumps(texts[i], ensure_ascii=False)}" for m, texts in samples.items()]
        lines += [f"## {prompt}", "", *answers, ""]
    with atomic_path(args.samples) as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")
    print(f"eval: the adapter is {variant['name']}")
    print(f"{'set':<12} {'model':<8} {'bits/byte':>10} {'perplexity':>12} {'tokens':>8} {'bytes':>8}")
    for s, by in results.items():
        for m, v in by.items():
            print(
                f"{s:<12} {m:<8} {v['bits_per_byte']:>10.4f} {v['perplexity']:>12.3f} {v['tokens']:>8} {v['bytes']:>8}"
            )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    for name, meaning in (
        ("base", "prepared base model folder"),
        ("base-tokenizer", "the base's own tokenizer"),
        ("adapter", "consolidated adapter folder (with its tokenizer)"),
        ("merged", "merged model folder"),
        ("metrics", "eval.json to write"),
        ("plot", "CSV of bits per byte per set and model (a DVC plot)"),
        ("samples", "Markdown file of greedy samples"),
    ):
        parser.add_argument(f"--{name}", type=Path, required=True, help=meaning)
    run(main, parser, prefix="eval")
