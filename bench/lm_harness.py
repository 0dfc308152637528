"""lm-evaluation-harness (the peer the evaluate stage is checked and timed against): a local JSONL task of
`output_type: loglikelihood_rolling`, one document per line, scored with disjoint windows of `context` tokens."""

from __future__ import annotations

import json
from pathlib import Path

TASK = "pipeline_rolling_bpb"


def write_task(folder: Path, documents: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "docs.jsonl", "w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    task = {
        "task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / "docs.jsonl")}},
        "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "bits_per_byte"}],
    }  # fmt: skip
    (folder / f"{TASK}.yaml").write_text(json.dumps(task), encoding="utf-8")


def bits_per_byte(model_dir: Path, documents: list[str], *, context: int, workdir: Path, batch_size: int = 1) -> float:
    """The harness's bits per byte of `model_dir` on `documents` (fp32, CPU)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    write_task(workdir, documents)
    results = simple_evaluate(
        model="hf", model_args=f"pretrained={model_dir},dtype=float32,max_length={context}", tasks=[TASK],
        task_manager=TaskManager(include_path=str(workdir)), batch_size=batch_size, device="cpu",
    )  # fmt: skip
    return results["results"][TASK]["bits_per_byte,none"]
