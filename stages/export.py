"""Stage export: the merged model as one GGUF file (llama.cpp, Ollama) with its tokenizer inside, proven by a round
trip through an independent reader. Off by default: with export.gguf false it writes only a note saying how to turn
it on, so that the default pipeline neither spends the time nor caches a second copy of the model."""

import argparse
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import atomic_path, write_json
from pipeline.core.log import logger
from stages._common import run

log = logger("export")

GGUF = "model.gguf"
NOTE = """# GGUF export: off

`export.gguf` is false, so this stage wrote only this note. Turn it on with

    dvc exp run -S export.gguf=true              # f16; -S export.type=q8_0 for 8-bit

or export any merged model by hand:

    python -m pipeline export --to gguf --model artifacts/merged --out model.gguf --type f16
"""


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    x = cfg.export
    if not x.gguf:  # the default: nothing that imports torch (about 2 s of CPU a pipeline)
        with atomic_path(args.out) as tmp:
            tmp.mkdir()
            (tmp / "README.md").write_text(NOTE, encoding="utf-8")
        metrics = {"exported": False}
    else:
        from pipeline.export.gguf import check_exportable, export_gguf
        from pipeline.export.gguf_roundtrip import roundtrip

        check_exportable(args.merged, x.type)
        with atomic_path(args.out) as tmp:
            tmp.mkdir()
            written = export_gguf(model_dir=args.merged, out=tmp / GGUF, type_name=x.type)
            figures = roundtrip(model_dir=args.merged, gguf_file=tmp / GGUF, type_name=x.type)
        metrics = {"exported": True, "type": x.type, "bytes": written["bytes"], **figures}
        log.info(f"{args.out / GGUF} ({written['bytes'] / 1e6:.1f} MB); read back: {figures}")
    write_json(args.metrics, metrics)
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--merged", type=Path, required=True, help="merged model folder")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (model.gguf, or a note when off)")
    parser.add_argument("--metrics", type=Path, required=True, help="round-trip figures (DVC metrics)")
    run(main, parser, prefix="export")
