"""The pipeline's results, readable in a terminal (under 100 columns): the evaluation table, the training summary
and the merge proof; with --compare, DVC experiments side by side on the key figures and the params that differ.

    python -m tools.report                         # make report
    python -m tools.report --compare EXP [EXP ...] # names from `dvc exp show` (the workspace is `workspace`)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from pipeline.core.atomic import read_json
from pipeline.core.environment import with_venv_path
from pipeline.evaluation.report import evaluation_table, merge_proof, training_summary
from pipeline.tracking.mlflow_run import flatten
from tools.paths import dvc_paths

KEY_FIGURES = {  # column title: dotted path in the metrics files dvc exp show reports
    "in-domain bpb": "eval.in_domain.adapter.bits_per_byte",
    "en_wiki bpb": "eval.en_wiki.adapter.bits_per_byte",
    "train loss": "train.final_train_loss",
    "val loss": "train.val_loss",
    "tok/s": "train.tokens_per_s",
}


def report(root: Path = Path(".")) -> str:
    paths = dvc_paths(root)["metrics"]
    lines = []
    if paths["eval"].is_file():
        lines += evaluation_table(read_json(paths["eval"])) + [""]
    if paths["train"].is_file():
        lines += training_summary(read_json(paths["train"]))
    if paths["merge"].is_file():
        lines += merge_proof(read_json(paths["merge"]))
    return "\n".join(lines) if lines else "no results yet: run `dvc repro` (or `make run`)"


def _experiments(root: Path) -> dict[str, dict]:
    """{name: {"params": flat params, "metrics": flat metrics}} from `dvc exp show --json`."""
    done = subprocess.run(
        ["dvc", "exp", "show", "--json"], cwd=root, capture_output=True, text=True, env=with_venv_path()
    )
    if done.returncode:
        raise ValueError(f"dvc exp show failed: {done.stderr.strip()[-500:]}")
    found = {}
    for entry in json.loads(done.stdout):
        for exp in [entry, *(entry.get("experiments") or [])]:
            for revision in exp.get("revs", [exp]):
                data = revision.get("data") or {}
                name = exp.get("name") or revision.get("name") or data.get("rev") or "workspace"
                metrics = {}
                for path, content in (data.get("metrics") or {}).items():
                    prefix = Path(path).stem
                    metrics.update(flatten(content.get("data", {}), f"{prefix}."))
                params = flatten((data.get("params") or {}).get("params.yaml", {}).get("data", {}))
                found.setdefault(name, {"params": params, "metrics": metrics})
    return found


def compare(names: list[str], root: Path = Path(".")) -> str:
    experiments = _experiments(root)
    unknown = [n for n in names if n not in experiments]
    if unknown:
        raise ValueError(f"--compare: no experiment {unknown}; known: {sorted(experiments)[:20]}")
    chosen = [experiments[n] for n in names]
    width = max(12, *(len(n) for n in names)) + 1
    lines = [f"{'':<16}" + "".join(f"{n[: width - 1]:>{width}}" for n in names)]
    for title, key in KEY_FIGURES.items():
        values = [e["metrics"].get(key) for e in chosen]
        lines.append(f"{title:<16}" + "".join(f"{_shown(v):>{width}}" for v in values))
    differing = sorted(k for k in set().union(*(e["params"] for e in chosen))
                       if len({e["params"].get(k) for e in chosen}) > 1)  # fmt: skip
    lines += ["", "params that differ:"] if differing else ["", "the same params"]
    for key in differing:
        values = "".join(f"{str(e['params'].get(key, '-'))[: width - 1]:>{width}}" for e in chosen)
        lines.append(f"  {key[:38]:<38}{values}")
    return "\n".join(lines)


def _shown(value) -> str:  # a figure from dvc exp show
    try:
        return f"{float(value):.4f}"
    except (TypeError, ValueError):
        return "-"


def main(argv: list[str] | None = None) -> int:
    from pipeline.core.errors import guarded

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", nargs="+", metavar="EXP", help="DVC experiments to compare (dvc exp show)")
    args = parser.parse_args(argv)
    guarded(lambda: print(compare(args.compare) if args.compare else report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
