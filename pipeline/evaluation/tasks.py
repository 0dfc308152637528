"""Downstream task accuracy through lm-evaluation-harness: task YAMLs over local files, checked before any model is
loaded (the harness only warns about an unknown metric and drops it), then run on a model already in memory, so
that base + adapter is the PeftModel the other figures use (the harness ignores `peft=` for a loaded model)."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

OUTPUT_TYPES = ("multiple_choice", "generate_until", "loglikelihood", "loglikelihood_rolling")
LOCAL_BUILDERS = ("json", "csv", "text", "parquet")  # `datasets` builders that read local files
# Metrics the harness computes when a task lists none (its DEFAULT_METRIC_REGISTRY).
DEFAULT_METRICS = {
    "loglikelihood": ("perplexity", "acc"),
    "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    "multiple_choice": ("acc", "acc_norm"),
    "generate_until": ("exact_match",),
}
REFUSED_KEYS = ("include", "group", "task_list", "class")  # what would pull in code or files we did not check
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclass(frozen=True)
class TaskSpec:
    """A checked task: its config as the harness takes it (data files absolute) and the result keys it gives,
    as (metric, filter) pairs."""

    name: str
    path: Path
    config: dict
    metrics: tuple[tuple[str, str], ...]


def _known(kind: str) -> set[str]:
    import lm_eval.api.metrics  # noqa: F401  (registers the metrics)
    import lm_eval.filters  # noqa: F401  (registers the filters)
    from lm_eval.api import registry

    return set((registry.metric_registry if kind == "metric" else registry.filter_registry).keys())


def _data_files(raw: object, path: Path) -> dict[str, str] | list[str] | str:
    """The task's local data files, made absolute (relative paths are taken from the current folder, like every
    path of params.yaml); each must exist."""

    def checked(where: str, file: object) -> str:
        if not isinstance(file, str):
            raise ValueError(f"{path}: dataset_kwargs.data_files{where}: expected a file path, got {file!r}")
        if not Path(file).is_file():
            raise FileNotFoundError(f"{path}: dataset_kwargs.data_files{where}: {file} not found")
        return str(Path(file).resolve())

    if isinstance(raw, dict):
        return {split: checked(f".{split}", file) for split, file in raw.items()}
    if isinstance(raw, list):
        return [checked(f".{i}", file) for i, file in enumerate(raw)]
    return checked("", raw)


def load_task(path: Path | str, key: str) -> TaskSpec:
    """Read and check one task YAML: a single task over local files, with metrics and filters the harness knows."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {path} not found; expected an lm-evaluation-harness task YAML")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not plain YAML ({' '.join(str(err).split())}); tags such as !function are not "
                         "supported") from None  # fmt: skip
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise ValueError(f"{path}: expected a mapping with a `task` name")
    refused = [k for k in REFUSED_KEYS if k in config]
    if refused:
        raise ValueError(f"{path}: {', '.join(refused)} not supported; expected one self-contained task")
    output_type = config.get("output_type", "generate_until")
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"{path}: output_type: expected one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
    if config.get("dataset_path") not in LOCAL_BUILDERS:
        raise ValueError(
            f"{path}: dataset_path: expected one of {', '.join(LOCAL_BUILDERS)} with local data files (no hub "
            f"datasets), got {config.get('dataset_path')!r}"
        )
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        raise ValueError(f"{path}: dataset_kwargs.data_files: missing; expected the task's local data files")
    config = {**config, "dataset_kwargs": {**config["dataset_kwargs"], "data_files": _data_files(files, path)}}
    metrics = [entry.get("metric") if isinstance(entry, dict) else entry for entry in config.get("metric_list", [])]
    metrics = metrics or list(DEFAULT_METRICS[output_type])
    known_metrics = _known("metric")
    for i, metric in enumerate(metrics):
        if metric not in known_metrics:
            raise ValueError(
                f"{path}: metric_list.{i}.metric: unknown metric {metric!r}; expected one of "
                f"{', '.join(sorted(known_metrics))}"
            )
    filters = config.get("filter_list") or [{"name": "none", "filter": []}]
    known_filters = _known("filter")
    for i, entry in enumerate(filters):
        for j, step in enumerate(entry.get("filter", [])):
            if step.get("function") not in known_filters:
                raise ValueError(
                    f"{path}: filter_list.{i}.filter.{j}.function: unknown filter {step.get('function')!r}; "
                    f"expected one of {', '.join(sorted(known_filters))}"
                )
    pairs = tuple((metric, entry["name"]) for entry in filters for metric in metrics)
    return TaskSpec(config["task"], path, config, pairs)


def load_tasks(paths: list[str]) -> list[TaskSpec]:
    """Every task of `eval.tasks`, checked; names must differ."""
    specs = [load_task(p, f"eval.tasks.{i}") for i, p in enumerate(paths)]
    names = [s.name for s in specs]
    for spec in specs:
        if names.count(spec.name) > 1:
            raise ValueError(f"eval.tasks: task name {spec.name!r} is used by more than one file")
    return specs


def offline() -> None:
    """No hub access from here on: the environment for what is imported later, the flags of what already is."""
    os.environ.update(OFFLINE)
    for module, flags in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)), ("datasets.config", tuple(OFFLINE))):
        if module in sys.modules:
            for flag in flags:
                setattr(sys.modules[module], flag, True)


def figure_name(metric: str, filter_name: str) -> str:
    """`acc` for the unfiltered metric, `exact_match_extract` for a filtered one."""
    return metric if filter_name == "none" else f"{metric}_{filter_name}"


def run_tasks(model, tokenizer, specs: list[TaskSpec], *, batch_size: int, limit: int | None) -> dict[str, dict]:
    """{task: {metric: value, metric_stderr: value or None, samples: n}} of a loaded model (seeded, no hub)."""
    if not specs:
        return {}
    offline()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    harness_model = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(
        model=harness_model,
        tasks=[spec.config for spec in specs],
        task_manager=TaskManager(include_defaults=False),
        limit=limit,
        bootstrap_iters=100,  # the closed form for means (acc, exact_match); bootstrap only for the others
        log_samples=False,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    figures = {}
    for spec in specs:
        results = out["results"][spec.name]
        entry = {"samples": int(out["n-samples"][spec.name]["effective"])}
        for metric, filter_name in spec.metrics:
            if f"{metric},{filter_name}" not in results:
                raise ValueError(f"{spec.path}: the harness returned no {metric!r} with filter {filter_name!r}")
            name = figure_name(metric, filter_name)
            entry[name] = float(results[f"{metric},{filter_name}"])
            stderr = results.get(f"{metric}_stderr,{filter_name}")
            entry[f"{name}_stderr"] = (
                float(stderr) if isinstance(stderr, int | float) and math.isfinite(stderr) else None
            )
        figures[spec.name] = entry
    return figures


def scores(results: dict[str, dict[str, dict]]) -> list[tuple[str, str, str, float, float | None]]:
    """(task, metric, model, value, standard error) of {task: {model: figures}}."""
    return [
        (task, name, model, value, figures.get(f"{name}_stderr"))
        for task, by_model in results.items()
        for model, figures in by_model.items()
        for name, value in figures.items()
        if name != "samples" and not name.endswith("_stderr")
    ]


def table_rows(results: dict[str, dict[str, dict]]) -> list[str]:
    """CSV lines (header first) of {task: {model: figures}}: one row per task, metric and model (a DVC plot)."""
    rows = ["label,task,metric,model,value,stderr"]
    for task, name, model, value, stderr in scores(results):
        error = "" if stderr is None else f"{stderr:.6f}"
        rows.append(f"{task} {name} / {model},{task},{name},{model},{value:.6f},{error}")
    return rows
