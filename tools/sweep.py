"""Hydra multirun sweeps over the pipeline. Each combination runs as `dvc exp run -S ...` (so stages it does not
change, such as the base, tokenizer and dataset, are reused) and is logged as an MLflow child run of the sweep's
run; every combination is checked before the first one starts; a summary table ends the sweep.

    python -m tools.sweep -m lora.r=8,16 train.lr=1e-4,3e-4
    python -m tools.sweep -m hydra/sweeper=optuna hydra.sweeper.n_trials=4 'lora.r=choice(4,8)' \\
        'train.lr=interval(1e-4,1e-3)'        # Optuna minimises sweep.objective (eval bits per byte)
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.core.atomic import atomic_path, read_json, write_json
from pipeline.core.config import validate
from pipeline.core.environment import with_venv_path
from pipeline.tracking.execution import EXECUTION_ENV, PARENT_RUN_ENV
from pipeline.tracking.mlflow_run import Tracker, open_run
from pipeline.tracking.runs_view import RUN_NAME_ENV, SWEPT_KEYS_ENV, swept_keys
from tools.paths import dvc_paths

PATHS = dvc_paths()
EVAL_METRICS, TRAIN_METRICS, RUN_ID_FILE = PATHS["metrics"]["eval"], PATHS["metrics"]["train"], PATHS["mlflow_run"]
JOB_RUN = "mlflow_run.json"  # in each job's Hydra output folder: its pipeline's run (the job hands it to the callback)


def lookup(figures: dict, dotted: str) -> float:
    """figures["a"]["b"] for "a.b"; a missing key names what exists."""
    value: Any = figures
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"sweep.objective: {dotted!r} is not in {EVAL_METRICS} (keys here: {list(value)})")
        value = value[part]
    return float(value)


def plain(cfg: DictConfig) -> dict:
    """The pipeline's config: resolved, without the sweep's own node."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("sweep", None)
    return raw


def combinations(overrides: list[str]) -> list[list[str]]:
    """Override lists to check before a sweep: every value of every swept key (an interval's two ends), the other
    keys at their first value. Enough to catch a value of the wrong type without composing the whole product."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if override.is_interval_sweep():
            sweep = override.value()
            values = [str(sweep.start), str(sweep.end)]
        elif override.is_sweep_override():
            values = list(override.sweep_string_iterator())
        else:
            values = [override.get_value_element_as_str()]
        choices.append([f"{key}={v}" for v in values])
    firsts = [c[0] for c in choices]
    checks = [firsts]
    for index, values in enumerate(choices):
        checks += [firsts[:index] + [v] + firsts[index + 1 :] for v in values[1:]]
    return checks


def swept(overrides: list[str]) -> list[str]:
    """The keys a sweep varies: those given several values, a choice or an interval."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [o.key_or_group for o in parsed if o.is_sweep_override() or o.is_interval_sweep()]


def point(overrides: list[str], keys: list[str]) -> str:
    """A job's values of the swept keys (`lora.r=8 train.lr=0.0003`): its place in the sweep."""
    return " ".join(o for o in overrides if o.split("=", 1)[0].lstrip("+~") in keys)


def summary(rows: list[dict], objective: str) -> str:
    """A Markdown table: one row per job, best objective first."""
    ordered = sorted(rows, key=lambda r: (r["objective"] is None, r["objective"] or 0.0))
    lines = [
        f"| job | overrides | {objective} | final train loss | tokens/s | MLflow run |",
        "|---|---|---|---|---|---|",
    ]
    for r in ordered:
        figures = [f"{r[k]:.4f}" if isinstance(r[k], float) else "failed" for k in ("objective", "loss")]
        speed = f"{r['tokens_per_s']:.1f}" if isinstance(r["tokens_per_s"], float) else ""
        lines.append(f"| {r['job']} | {' '.join(r['overrides'])} | {' | '.join(figures)} | {speed} | {r['run']} |")
    return "\n".join(lines)


class SweepCallback(Callback):
    """Checks every combination first, opens the sweep's parent MLflow run, collects each job, prints the table."""

    def __init__(self) -> None:
        self.parent = Tracker()
        self.rows: list[dict] = []
        self.objective = ""
        self.folder = Path(".")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra import compose

        overrides = list(config.hydra.overrides.task)
        errors = []
        for check in combinations(overrides):
            try:
                validate(plain(compose(config_name="config", overrides=check)), f"sweep {' '.join(check)}")
            except ValueError as err:
                errors.append(str(err))
            except Exception as err:  # Hydra's own: a value its grammar or the config's type rejects
                errors.append(f"sweep {' '.join(check)}: {' '.join(str(err).split())}")
        if errors:
            print("error: " + "\nerror: ".join(dict.fromkeys(errors)), file=sys.stderr)
            sys.exit(2)
        self.objective = config.sweep.objective
        self.folder = Path(config.hydra.sweep.dir)
        os.environ[SWEPT_KEYS_ENV] = ",".join(swept(overrides))  # the jobs run in this process
        tracking = config.tracking
        self.parent = open_run(
            tracking.uri,
            tracking.experiment,
            self.folder / "parent_run.json",
            execution=f"sweep-{uuid.uuid4().hex}",
            run_name=f"sweep {self.folder.name}",
        )
        self.parent.set_tags({"sweep.overrides": " ".join(overrides), "sweep.objective": self.objective})
        if self.parent.run_id:
            os.environ[PARENT_RUN_ENV] = self.parent.run_id
        print(f"sweep: {len(overrides)} override(s) checked; parent MLflow run {self.parent.run_id or '(none)'}")

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        done = job_return.status == JobStatus.COMPLETED
        train = read_json(TRAIN_METRICS) if done and TRAIN_METRICS.is_file() else {}
        handed = Path(config.hydra.runtime.output_dir) / JOB_RUN
        run = read_json(handed).get("run_id") if handed.is_file() else None
        self.rows.append(
            {
                "job": config.hydra.job.num,
                "overrides": list(job_return.overrides),
                "objective": float(job_return.return_value) if done else None,
                "loss": train.get("final_train_loss"),
                "tokens_per_s": train.get("tokens_per_s"),
                "run": run or "",
            }
        )
        if not done:
            self._finish("FAILED")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish("FINISHED")

    def _finish(self, status: str) -> None:
        table = summary(self.rows, self.objective)
        print(f"\nsweep: {len(self.rows)} job(s), {status.lower()}\n{table}")
        with atomic_path(self.folder / "summary.md") as tmp:
            tmp.write_text(table + "\n", encoding="utf-8")
        self.parent.log_artifact(self.folder / "summary.md")
        scored = [r for r in self.rows if r["objective"] is not None]
        if scored:
            best = min(scored, key=lambda r: r["objective"])
            self.parent.log_metrics({f"best.{self.objective}": best["objective"]})
            self.parent.set_tags({"sweep.best_run": best["run"], "sweep.best_overrides": " ".join(best["overrides"])})
        self.parent.close(status)


@hydra.main(config_path="../conf", config_name="sweep", version_base=None)
def main(cfg: DictConfig) -> float:
    """One combination: the whole pipeline through `dvc exp run`; returns the objective from metrics/eval.json.
    When DVC finds nothing to re-run (the combination is the workspace's), only the track stage is forced, so
    that the combination still has its own child run."""
    overrides = list(HydraConfig.get().overrides.task)
    validate(plain(cfg), f"sweep job {' '.join(overrides)}")
    job = uuid.uuid4().hex[:8]
    name = f"sweep-{job}-{HydraConfig.get().job.num}"  # the DVC experiment, also when only track is forced
    command = ["dvc", "exp", "run", "-n", name, *itertools.chain.from_iterable(("-S", o) for o in overrides)]
    print(f"sweep: job {HydraConfig.get().job.num}: {' '.join(command)}", flush=True)
    env = {**with_venv_path(), EXECUTION_ENV: f"sweep-job-{job}", RUN_NAME_ENV: point(overrides, swept_keys()) or name}
    forced = ["dvc", "repro", "--force", "--single-item", "track"]
    for step, extra in ((command, {}), (forced, {"DVC_EXP_NAME": name})):
        done = subprocess.run(step, env={**env, **extra})
        if done.returncode:
            raise RuntimeError(f"sweep job {' '.join(overrides)}: `{' '.join(step)}` exited {done.returncode}")
        recorded = read_json(RUN_ID_FILE) if RUN_ID_FILE.is_file() else {}
        if recorded.get("execution") == env[EXECUTION_ENV]:
            write_json(Path(HydraConfig.get().runtime.output_dir) / JOB_RUN, recorded)
            break
    return lookup(read_json(EVAL_METRICS), cfg.sweep.objective)


if __name__ == "__main__":
    main()
