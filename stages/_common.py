"""What every stage entry point shares: argument parsing, the pipeline execution's MLflow run, and turning bad input
into a clean exit."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.core import config, imports
from pipeline.core.errors import guarded
from pipeline.core.quiet import quiet_third_parties
from pipeline.tracking import execution
from pipeline.tracking.mlflow_run import Tracker, flatten, numeric_leaves, runtime_tags

Main = Callable[[argparse.Namespace, config.Config], "dict | None"]
Hides = Callable[[config.Config], bool]


def stage_name() -> str:
    """The DVC stage running this process ($DVC_STAGE), else its entry point's name (`stages/NAME.py`)."""
    return os.environ.get("DVC_STAGE") or Path(sys.argv[0]).stem


def pipeline_run(cfg: config.Config, run_id_file: Path) -> Tracker:
    """The pipeline execution's MLflow run, as `cfg.tracking` names it (opened, or joined)."""
    return execution.pipeline_run(uri=cfg.tracking.uri, experiment=cfg.tracking.experiment, run_id_file=run_id_file)


def run(
    main: Main, parser: argparse.ArgumentParser, prefix: str | None = None, *, hides_unused: Hides | None = None
) -> None:
    """Parse arguments, load params.yaml, run; a ValueError/FileNotFoundError prints one line and exits 2.

    With `prefix`, the stage logs into the pipeline's MLflow run, once `main` has returned: the flat config, runtime
    tags, `stage.NAME=ran`, its duration, and the figures `main` returns under `prefix.` (numbers as metrics, words
    as tags; the run is marked FAILED if `main` raises).
    `hides_unused(cfg)`: whether the run imports without bitsandbytes and scipy (`imports.without_unused`)."""
    quiet_third_parties()
    parser.add_argument("--params", default="params.yaml", help="composed config (default: params.yaml)")
    if prefix is not None:
        parser.add_argument("--run-id-file", type=Path, required=True, help="the pipeline's MLflow run id (JSON)")
    args = parser.parse_args()

    def tracked() -> None:
        cfg = config.load(args.params)
        if hides_unused is not None and hides_unused(cfg):
            imports.without_unused()
        if prefix is None:
            main(args, cfg)
            return
        execution.hand_down()  # before the stage's own processes start (the ranks log to the same run)
        start = time.perf_counter()
        try:
            figures = main(args, cfg) or {}
        except BaseException:
            with pipeline_run(cfg, args.run_id_file) as tracker:  # marked FAILED
                announce(tracker, args.params)
                raise
        seconds = time.perf_counter() - start
        with pipeline_run(cfg, args.run_id_file) as tracker:
            words = {f"{prefix}.{key}": value for key, value in figures.items() if isinstance(value, str)}
            name = announce(tracker, args.params, tags=words)  # figures that are words (the attention chosen)
            tracker.log_metrics({**numeric_leaves(figures, f"{prefix}."), f"seconds.{name}": seconds})

    guarded(tracked)


def announce(tracker: Tracker, params: Path | str, tags: dict[str, str] | None = None) -> str:
    """Log that this stage ran in the execution's run, with `params` as written (the schema would turn 16 into
    16.0), runtime tags, the DVC experiment where there is one, and `tags`; returns the stage's name."""
    name = stage_name()
    experiment = {"DVC_EXP_NAME": "dvc.experiment", "DVC_EXP_BASELINE_REV": "dvc.baseline"}
    dvc = {tag: os.environ[env] for env, tag in experiment.items() if os.environ.get(env)}
    tracker.log_params(flatten(config.read_params(params)))
    tracker.set_tags({**runtime_tags(), **dvc, **(tags or {}), f"stage.{name}": "ran"})
    return name
