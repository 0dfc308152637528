"""`python -m pipeline COMMAND ...`: the library's commands (consolidate, convert, merge, evaluate, chat, generate,
export)."""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import guarded
from pipeline.core.log import logger
from pipeline.core.quiet import quiet_third_parties


def _consolidate(args: argparse.Namespace) -> None:
    from pipeline.checkpoints.consolidate import consolidate

    manifest = consolidate(
        checkpoint_dir=args.checkpoint_dir,
        output_dir=args.output_dir,
        tag=args.tag,
        adapter_config=args.adapter_config,
        dtype=args.dtype,
    )
    source, layout = manifest["source"], manifest["layout"]
    for note in manifest["notes"]:
        logger("consolidate").info(f"note: {note}")
    logger("consolidate").info(
        f"{len(manifest['tensors'])} tensors ({manifest['elements']:,} elements) from "
        f"{source['checkpoint']}/{source['tag']} (ZeRO-{source['zero_stage']}, {source['world_size']} rank(s), "
        f"{layout['optimizer']}, {layout['master_dtype']} masters) -> {args.output_dir}"
    )


def _convert(args: argparse.Namespace) -> None:
    import time

    from pipeline.checkpoints.locate import locate
    from pipeline.checkpoints.universal import ensure_universal, is_universal, to_universal
    from pipeline.training.zero_writer import to_zero

    start = time.perf_counter()
    if args.to == "zero":
        if args.base is None or args.world_size is None or args.zero_stage is None:
            raise ValueError("--to zero: expected --base, --world-size and --zero-stage")
        universal = args.checkpoint_dir
        if not is_universal(universal):  # a ZeRO checkpoint: its universal form first, beside its tag
            universal, _ = ensure_universal(locate(args.checkpoint_dir, args.tag).tag_dir, args.workers)
        to_zero(
            universal=universal,
            out_dir=args.output_dir,
            base=args.base,
            world_size=args.world_size,
            zero_stage=args.zero_stage,
            port=args.master_port,
        )
        logger("convert").info(
            f"{universal} -> {args.output_dir}: ZeRO-{args.zero_stage} for {args.world_size} rank(s) in "
            f"{time.perf_counter() - start:.1f} s; resume it with train.resume_from={args.output_dir}"
        )
        return
    where = locate(args.checkpoint_dir, args.tag)
    for note in where.notes:
        logger("convert").info(f"note: {note}")
    manifest = to_universal(where.tag_dir, args.output_dir, args.workers)
    source = manifest["source"]
    logger("convert").info(
        f"{where.tag_dir} (ZeRO-{source['zero_stage']}, {source['world_size']} rank(s), step "
        f"{manifest['step']}) -> {args.output_dir}: {len(manifest['parameters'])} parameters with their Adam "
        f"moments in {time.perf_counter() - start:.1f} s; a run of any world size under ZeRO 1-3 resumes from it"
    )


def _merge(args: argparse.Namespace) -> None:
    from pipeline.checkpoints.adapter import read_variant
    from pipeline.core import imports
    from pipeline.model.quantization import KINDS

    if read_variant(args.adapter).get("quantization") not in KINDS:  # as the stage: no bitsandbytes (and torch's
        imports.without_unused()  # compiler through it) for a merge that measures no quantized base
    from pipeline.merge.fold import merge

    report = merge(
        base_dir=args.base,
        adapter_dir=args.adapter,
        out_dir=args.out,
        tokenizer_dir=args.tokenizer,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        verify=not args.no_verify,
        max_abs_logit_diff=args.max_abs_diff,
        max_kl=args.max_kl,
    )
    logger("merge").info(f"{json.dumps(report, sort_keys=True)}")


def _evaluate(args: argparse.Namespace) -> None:
    from pipeline.data.tokenizer import find_tokenizer, load_tokenizer
    from pipeline.evaluation import likelihood as ev

    if args.stride > args.context:
        raise ValueError(f"--stride: must be <= --context ({args.context}), got {args.stride}")
    folder = args.tokenizer or find_tokenizer([args.adapter, args.model])
    if folder is None:
        raise FileNotFoundError(
            f"{', '.join(str(p) for p in (args.adapter, args.model) if p)}: no tokenizer files; pass --tokenizer FOLDER"
        )
    tokenizer = load_tokenizer(folder)
    examples = ev.load_examples(
        tokenizer, args.file, template=args.template, max_bytes=args.max_bytes, context=args.context, key="--file"
    )
    model = ev.load_model(args.model, args.adapter, precision=args.precision)
    ev.check_vocabulary(tokenizer, model, str(folder))
    result = ev.score(model, examples, context=args.context, stride=args.stride, batch_size=args.batch_size).as_dict()
    print(json.dumps({"file": str(args.file), "model": str(args.model), "adapter": str(args.adapter), **result}))


CONF = Path(__file__).resolve().parents[1] / "conf"
TRUST_HELP = (
    "read the checkpoint's pickles with torch.load(weights_only=False), which calls whatever functions a file names "
    "(your own files only: a pickle from elsewhere can run code); off: torch's weights-only loader with the classes "
    "and bounds of docs/checkpoints.md (tensors inside the file's own storages, numbers, numeric numpy arrays, "
    "DeepSpeed's classes as stand-ins)"
)


def stage_defaults(group: str, choice: str = "default") -> dict:
    """A stage's config defaults (conf/GROUP/CHOICE.yaml), so that a command's defaults are the stage's."""
    import yaml

    return yaml.safe_load((CONF / group / f"{choice}.yaml").read_text(encoding="utf-8"))


def _chat(args: argparse.Namespace) -> None:
    from pipeline.evaluation import chat

    sampling = chat.Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    model, tokenizer = chat.load(args.model, args.adapter, args.precision)
    if args.command == "chat":
        chat.chat(model, tokenizer, sampling, system=args.system)
    else:
        chat.generate(model, tokenizer, args.prompt, sampling, raw=args.raw)


def _export(args: argparse.Namespace) -> None:
    from pipeline.export.gguf import check_exportable, export_gguf
    from pipeline.export.gguf_roundtrip import roundtrip

    check_exportable(args.model, args.type)
    written = export_gguf(model_dir=args.model, out=args.out, type_name=args.type)
    logger("export").info(f"{args.model} -> {args.out} ({written['bytes'] / 1e6:.1f} MB, tensors {written['tensors']})")
    if not args.no_verify:
        figures = roundtrip(model_dir=args.model, gguf_file=args.out, type_name=args.type)
        logger("export").info(f"read back by transformers: {json.dumps(figures)}")


def _card(args: argparse.Namespace) -> None:
    from pipeline.core import config
    from pipeline.core.atomic import read_json
    from pipeline.export import model_card

    def figures(name: str) -> dict | None:
        path = args.metrics / f"{name}.json"
        return read_json(path) if path.is_file() else None

    params = config.read_params(args.params)
    text = model_card.render(
        kind=args.kind,
        params=params,
        dataset=figures("dataset") or {},
        training=figures("train") or {},
        merge=figures("merge") if args.kind == "merged" else None,
        evaluation=figures("eval"),
    )
    with atomic_path(args.out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    logger("card").info(
        f"{args.kind} model card with {'the' if figures('eval') else 'no'} evaluation tables -> {args.out}"
    )


def _talk_options(command: argparse.ArgumentParser, *, max_new_tokens: int, temperature: float) -> None:
    command.add_argument("--model", type=Path, required=True, help="HF model folder (e.g. artifacts/merged)")
    command.add_argument("--adapter", type=Path, help="PEFT adapter folder applied on the model")
    command.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens to generate at most")
    command.add_argument("--temperature", type=float, default=temperature, help="0: greedy")
    command.add_argument("--seed", type=int, default=0, help="seeds the sampling before each reply")
    command.add_argument(
        "--precision", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 where the hardware has it"
    )
    command.set_defaults(handler=_chat)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    commands.add_parser = partial(commands.add_parser, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    merging, scoring = stage_defaults("merge"), stage_defaults("eval")
    consolidate = commands.add_parser("consolidate", help="DeepSpeed ZeRO checkpoint -> PEFT adapter folder")
    consolidate.add_argument(
        "checkpoint_dir",
        type=Path,
        help="DeepSpeed save_dir (holds `latest`), HF Trainer checkpoint-N or output_dir, or a tag folder",
    )
    consolidate.add_argument("output_dir", type=Path, help="adapter folder to write")
    consolidate.add_argument("--tag", help="checkpoint tag (default: the one `latest` names)")
    consolidate.add_argument("--adapter-config", type=Path, help="adapter_config.json (default: the checkpoint's)")
    consolidate.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="output dtype")
    consolidate.add_argument("--trust-pickles", action="store_true", help=TRUST_HELP)
    consolidate.set_defaults(handler=_consolidate)
    convert = commands.add_parser("convert", help="checkpoint layouts: ZeRO 1-3 <-> DeepSpeed's universal layout")
    convert.add_argument(
        "checkpoint_dir", type=Path, help="checkpoint folder (as for consolidate), or a universal one for --to zero"
    )
    convert.add_argument("output_dir", type=Path, help="folder to write (must not exist)")
    convert.add_argument("--to", choices=("universal", "zero"), required=True, help="the layout to write")
    convert.add_argument("--tag", help="checkpoint tag (default: the one `latest` names)")
    convert.add_argument("--workers", type=int, default=1, help="parallel worker processes")
    convert.add_argument("--world-size", type=int, help="--to zero: ranks of the run that resumes it")
    convert.add_argument("--zero-stage", type=int, choices=(1, 2, 3), help="--to zero: its ZeRO stage")
    convert.add_argument("--base", type=Path, help="--to zero: the base model folder (the engine is rebuilt)")
    convert.add_argument("--master-port", type=int, help="--to zero: port of the CPU ranks (default: a free one)")
    convert.add_argument("--trust-pickles", action="store_true", help=TRUST_HELP)
    convert.set_defaults(handler=_convert)
    merge = commands.add_parser("merge", help="fold a LoRA adapter into its base and verify the logits")
    merge.add_argument("--base", type=Path, required=True, help="base HF model folder")
    merge.add_argument("--adapter", type=Path, required=True, help="PEFT adapter folder")
    merge.add_argument("--out", type=Path, required=True, help="merged HF model folder to write")
    merge.add_argument(
        "--tokenizer", type=Path, help="tokenizer to check and ship (default: the adapter's, else the base's, if any)"
    )
    merge.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=merging["dtype"], help="output dtype")
    merge.add_argument("--max-shard-size", default=merging["max_shard_size"], help="largest output shard")
    merge.add_argument("--no-verify", action="store_true", help="skip the base + adapter vs merged logits check")
    merge.add_argument("--max-abs-diff", type=float, help="largest |logit difference| accepted (per-dtype default)")
    merge.add_argument("--max-kl", type=float, help="largest mean KL divergence accepted (per-dtype default)")
    merge.set_defaults(handler=_merge)
    evaluate = commands.add_parser("evaluate", help="perplexity and bits per byte of a model on a text/JSONL file")
    evaluate.add_argument("--model", type=Path, required=True, help="HF model folder")
    evaluate.add_argument("--adapter", type=Path, help="PEFT adapter folder applied on the model")
    evaluate.add_argument(
        "--tokenizer", type=Path, help="tokenizer folder (default: the adapter's, else the model's, if any)"
    )
    evaluate.add_argument("--file", type=Path, required=True, help="text (one document per line) or SFT JSONL")
    evaluate.add_argument("--context", type=int, default=scoring["context"], help="window length in tokens")
    evaluate.add_argument("--stride", type=int, default=scoring["stride"], help="tokens the window advances by")
    evaluate.add_argument("--batch-size", type=int, default=scoring["batch_size"], help="windows per forward pass")
    evaluate.add_argument(
        "--max-bytes", type=int, default=scoring["max_bytes"], help="score whole documents up to this many bytes"
    )
    evaluate.add_argument("--template", default="alpaca", help="prompt template for alpaca-style JSONL")
    evaluate.add_argument(
        "--precision", choices=("auto", "bf16", "fp32"), default=scoring["precision"],
        help="auto: bf16 where the hardware computes it natively",
    )  # fmt: skip
    evaluate.set_defaults(handler=_evaluate)
    chat = commands.add_parser("chat", help="talk to a model in the terminal (chat template, streamed, history)")
    _talk_options(chat, max_new_tokens=256, temperature=0.7)
    chat.add_argument("--system", help="a system message opening the conversation")
    generate = commands.add_parser("generate", help="one reply to --prompt on stdout (for scripts)")
    _talk_options(generate, max_new_tokens=128, temperature=0.0)
    generate.add_argument("--prompt", required=True, help="the user's message")
    generate.add_argument("--raw", action="store_true", help="continue the prompt as it is (no chat template)")
    export = commands.add_parser("export", help="a merged LLaMA-style model -> one GGUF file (llama.cpp, Ollama)")
    export.add_argument("--to", choices=("gguf",), required=True, help="the format to write")
    export.add_argument("--model", type=Path, required=True, help="HF model folder (e.g. artifacts/merged)")
    export.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    export.add_argument("--type", default="f16", help="f16 or q8_0: how 2-D weights are stored")
    export.add_argument("--no-verify", action="store_true", help="skip reading the file back and comparing logits")
    export.set_defaults(handler=_export)
    card = commands.add_parser("card", help="a model card with the evaluation tables (for publishing a copy)")
    card.add_argument("--kind", choices=("adapter", "merged"), required=True, help="which folder it describes")
    card.add_argument("--out", type=Path, required=True, help="README.md to write (not the DVC output's own)")
    card.add_argument("--params", type=Path, default=Path("params.yaml"), help="composed config (params.yaml)")
    card.add_argument("--metrics", type=Path, default=Path("metrics"), help="folder of the stages' metrics JSON")
    card.set_defaults(handler=_card)
    return top


def main(argv: list[str] | None = None) -> None:
    from pipeline.checkpoints.safe_pickle import TRUSTED

    quiet_third_parties()
    args = parser().parse_args(argv)
    TRUSTED.set(getattr(args, "trust_pickles", False))
    guarded(lambda: args.handler(args))
