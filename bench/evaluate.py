"""evaluate's scoring against lm-evaluation-harness (`loglikelihood_rolling`, the same definitions: disjoint
windows of 512 tokens, the first token conditioned on BOS/EOS) on the merged default model and the first 16 kB of
the in-domain held-out text, each in its own process, in one run: wall time ratio (target: ours 1.5x faster) and
both bits-per-byte figures. Needs `make run` first."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench.common import report, run_measured
from pipeline.core.atomic import read_json

MODEL, TEXT, CONTEXT, MAX_BYTES = Path("artifacts/merged"), Path("data/corpus/peoples_daily_heldout.txt"), 512, 16000


def documents() -> list[str]:
    """The documents our --max-bytes keeps: whole lines up to MAX_BYTES."""
    from pipeline.data.textio import read_documents

    kept, total = [], 0
    for doc in read_documents(TEXT):
        size = len(doc.encode("utf-8"))
        if kept and total + size > MAX_BYTES:
            break
        kept.append(doc)
        total += size
    return kept


def harness(out: Path) -> None:
    from bench.lm_harness import bits_per_byte

    out.write_text(
        json.dumps(
            {
                "bits_per_byte": bits_per_byte(
                    MODEL, documents(), context=CONTEXT, workdir=out.parent / "task", batch_size=4
                )
            }
        )
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        theirs_file = Path(tmp) / "harness.json"
        their_seconds, their_peak, _ = run_measured(
            [sys.executable, "-m", "bench.evaluate", "harness", str(theirs_file)]
        )
        ours_command = [
            sys.executable, "-m", "pipeline", "evaluate", "--model", str(MODEL), "--file", str(TEXT),
            "--context", str(CONTEXT), "--stride", str(CONTEXT), "--max-bytes", str(MAX_BYTES),
        ]  # fmt: skip
        our_seconds, our_peak, output = run_measured(ours_command)
        theirs = read_json(theirs_file)
    ours = json.loads(output.splitlines()[-1])
    report(
        "evaluate",
        {
            "reference_seconds": round(their_seconds, 2), "ours_seconds": round(our_seconds, 2),
            "speedup": round(their_seconds / our_seconds, 3), "target_speedup": 1.5,
            "reference_bits_per_byte": round(theirs["bits_per_byte"], 5),
            "ours_bits_per_byte": round(ours["bits_per_byte"], 5), "tokens": ours["tokens"], "bytes": ours["bytes"],
            "reference_peak_memory_mb": round(their_peak, 1), "ours_peak_memory_mb": round(our_peak, 1),
        },
    )  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["harness"]:
        harness(Path(sys.argv[2]))
    else:
        main()
