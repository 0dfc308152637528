"""evaluate's scoring against lm-evaluation-harness (`loglikelihood_rolling`, the same definitions: disjoint
windows of 512 tokens, the first token conditioned on BOS/EOS) on the merged default model and the first 16 kB of
the in-domain held-out text, each in its own process, in one run: wall time ratio (target: ours 1.5x faster) and
both bits-per-byte figures. Needs `make run` first.

    python -m bench.evaluate
    python -m bench.evaluate --smoke [--results DIR]   # the tiny merged model, 64-token windows, 1.5 kB (make test)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.common import report, results_folder, run_measured, smoke_arguments, smoke_project
from pipeline.core.atomic import read_json

MODEL, TEXT, CONTEXT, MAX_BYTES = Path("artifacts/merged"), Path("data/corpus/peoples_daily_heldout.txt"), 512, 16000
SMOKE_CONTEXT, SMOKE_MAX_BYTES = 64, 1500  # the tiny model's window is 256 tokens


def documents(text: Path, max_bytes: int) -> list[str]:
    """The documents our --max-bytes keeps: whole lines up to `max_bytes`."""
    from pipeline.data.textio import read_documents

    kept, total = [], 0
    for doc in read_documents(text):
        size = len(doc.encode("utf-8"))
        if kept and total + size > max_bytes:
            break
        kept.append(doc)
        total += size
    return kept


def harness(out: Path, model: Path, text: Path, context: int, max_bytes: int) -> None:
    from bench.lm_harness import bits_per_byte

    docs = documents(text, max_bytes)
    figure = bits_per_byte(model, docs, context=context, workdir=out.parent / "task", batch_size=4)
    out.write_text(json.dumps({"bits_per_byte": figure}))


def measure(model: Path, text: Path, *, context: int, max_bytes: int) -> dict:
    """Both sides on `model` and the first `max_bytes` of `text`, each in its own measured process."""
    sizes = [str(model), str(text), str(context), str(max_bytes)]
    with tempfile.TemporaryDirectory() as tmp:
        theirs_file = Path(tmp) / "harness.json"
        their_seconds, their_peak, _ = run_measured(
            [sys.executable, "-m", "bench.evaluate", "harness", str(theirs_file), *sizes]
        )
        ours_command = [
            sys.executable, "-m", "pipeline", "evaluate", "--model", str(model), "--file", str(text),
            "--context", str(context), "--stride", str(context), "--max-bytes", str(max_bytes),
        ]  # fmt: skip
        our_seconds, our_peak, output = run_measured(ours_command)
        theirs = read_json(theirs_file)
    ours = json.loads(output.splitlines()[-1])
    return {
        "reference_seconds": round(their_seconds, 2), "ours_seconds": round(our_seconds, 2),
        "speedup": round(their_seconds / our_seconds, 3), "target_speedup": 1.5,
        "reference_bits_per_byte": round(theirs["bits_per_byte"], 5),
        "ours_bits_per_byte": round(ours["bits_per_byte"], 5), "tokens": ours["tokens"], "bytes": ours["bytes"],
        "reference_peak_memory_mb": round(their_peak, 1), "ours_peak_memory_mb": round(our_peak, 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    if not args.smoke:
        report("evaluate", measure(MODEL, TEXT, context=CONTEXT, max_bytes=MAX_BYTES), results)
        return
    with smoke_project(args.project) as project:
        figures = measure(project / MODEL, project / TEXT, context=SMOKE_CONTEXT, max_bytes=SMOKE_MAX_BYTES)
        report("evaluate", {**figures, "smoke": True}, results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["harness"]:
        out, model, text, context, max_bytes = sys.argv[2:7]
        harness(Path(out), Path(model), Path(text), int(context), int(max_bytes))
    else:
        main()
