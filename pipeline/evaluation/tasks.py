"""Downstream task accuracy through lm-evaluation-harness: task YAMLs over local files, checked before any model is
loaded (the harness only warns about an unknown metric and drops it), then run on a model already in memory, so
that base + adapter is the PeftModel the other figures use (the harness ignores `peft=` for a loaded model).

A task file executes nothing it does not say: `!function module.name` (Python beside the YAML, as the harness
imports it) only in the project's `tasks/` or a folder named in `eval.task_code`, and its Jinja templates
(doc_to_text, doc_to_target, ...) render in Jinja's sandbox, not in the harness's plain environment, where a
template can reach Python objects."""

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
PROJECT_TASKS = Path("tasks")  # the project's own task folder (relative to the project root): its code is ours


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


class FunctionName(str):
    """A `!function module.name` of a task YAML, read as its text: nothing is imported until the file is trusted."""


class _TaskLoader(yaml.SafeLoader):
    """YAML's safe loader that reads the harness's one tag, `!function`, as a FunctionName."""


_TaskLoader.add_constructor("!function", lambda loader, node: FunctionName(loader.construct_scalar(node)))


def _leaves(value: object):
    """Every value of a YAML tree that is neither a mapping nor a list."""
    if isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _leaves(item)
    else:
        yield value


def _mapped(value: object, change) -> object:
    """The YAML tree `value` with `change` applied to each leaf."""
    if isinstance(value, dict):
        return {k: _mapped(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_mapped(v, change) for v in value]
    return change(value)


def _with_functions(config: object, path: Path, code_folders: tuple[Path, ...]) -> object:
    """`config` with each FunctionName imported as the harness does (`module.py` beside the YAML), where the file
    lies in a trusted folder; refused, naming the function, elsewhere."""
    names = [leaf for leaf in _leaves(config) if isinstance(leaf, FunctionName)]
    if not names:
        return config
    here = path.resolve().parent
    trusted = [folder.resolve() for folder in (PROJECT_TASKS, *code_folders)]
    if not any(here.is_relative_to(folder) for folder in trusted):
        raise ValueError(
            f"{path}: names Python code (!function {names[0]}), which runs only from the project's tasks/ or a "
            "folder named in eval.task_code; expected the task there, or its folder in eval.task_code"
        )
    imported = {name: _import(name, path) for name in set(names)}
    return _mapped(config, lambda leaf: imported[leaf] if isinstance(leaf, FunctionName) else leaf)


def _check_templates(config: object, path: Path) -> None:
    """Refuse a template that names a Python internal (an attribute or key starting with `_`), before any model
    loads; the sandbox the templates render in (`sandboxed_templates`) refuses whatever this cannot see."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(config, dict):
        return
    environment = ImmutableSandboxedEnvironment()
    for key, value in config.items():
        for template in (leaf for leaf in _leaves(value) if isinstance(leaf, str) and "{" in leaf):
            try:
                tree = environment.parse(template)
            except TemplateSyntaxError:
                continue  # the harness reads some {...} strings as plain text (a regex, a literal list)
            names = [n.attr for n in tree.find_all(nodes.Getattr)]
            names += [n.arg.value for n in tree.find_all(nodes.Getitem) if isinstance(n.arg, nodes.Const)]
            internal = [name for name in names if isinstance(name, str) and name.startswith("_")]
            if internal:
                raise ValueError(
                    f"{path}: {key}: the template reaches for {internal[0]!r}, a Python internal; a task template "
                    "may format a document's fields, never reach Python objects"
                )


def sandboxed_templates() -> None:
    """Make the harness render task templates in Jinja's sandbox: it renders them (lm_eval.utils.apply_template)
    in a plain Environment, where `{{ cycler.__init__.__globals__.os }}` reaches the os module. The sandbox has
    the same settings and filters."""
    import lm_eval.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = lm_eval.utils.env
    if isinstance(plain, ImmutableSandboxedEnvironment):
        return
    sandbox = ImmutableSandboxedEnvironment(
        loader=plain.loader, undefined=plain.undefined, keep_trailing_newline=plain.keep_trailing_newline
    )
    sandbox.filters.update(plain.filters)
    lm_eval.utils.env = sandbox


def _import(name: str, path: Path):
    """The function `module.name` of `module.py` beside the task file (the harness's rule)."""
    import importlib.util

    module_name, _, function = name.rpartition(".")
    source = path.parent / f"{module_name}.py"
    if not module_name or not source.is_file():
        raise FileNotFoundError(f"{path}: !function {name}: {source} not found; expected module.function of a file "
                                "beside the task")  # fmt: skip
    spec = importlib.util.spec_from_file_location(f"task_code.{module_name}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, function, None)):
        raise ValueError(f"{path}: !function {name}: {source} defines no function {function!r}")
    return getattr(module, function)


def load_task(path: Path | str, key: str, code_folders: tuple[Path, ...] = ()) -> TaskSpec:
    """Read and check one task YAML: a single task over local files, with metrics and filters the harness knows;
    `!function` only where the file lies in the project's tasks/ or in one of `code_folders` (eval.task_code)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {path} not found; expected an lm-evaluation-harness task YAML")
    try:
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskLoader)  # noqa: S506 (safe + one tag)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not YAML the harness reads ({' '.join(str(err).split())})") from None
    config = _with_functions(config, path, code_folders)
    _check_templates(config, path)
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
    metrics = [m.__name__ if callable(m) else m for m in metrics]  # the harness names a metric function so
    metrics = metrics or list(DEFAULT_METRICS[output_type])
    known_metrics = _known("metric")
    functions = {f.__name__ for f in _leaves(config.get("metric_list", [])) if callable(f)}
    for i, metric in enumerate(metrics):
        if metric not in known_metrics and metric not in functions:
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


def load_tasks(paths: list[str], code_folders: list[str] = ()) -> list[TaskSpec]:
    """Every task of `eval.tasks`, checked; names must differ. `code_folders`: eval.task_code."""
    for i, folder in enumerate(code_folders):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"eval.task_code.{i}: {folder} is not a folder; expected one holding task YAMLs")
    trusted = tuple(Path(f) for f in code_folders)
    specs = [load_task(p, f"eval.tasks.{i}", trusted) for i, p in enumerate(paths)]
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
    import jinja2.exceptions
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    sandboxed_templates()
    harness_model = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    try:
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
    except jinja2.exceptions.TemplateError as err:  # the sandbox's refusal, or an undefined field
        raise ValueError(
            f"eval.tasks ({', '.join(str(spec.path) for spec in specs)}): a task template failed in the sandbox it "
            f"renders in ({type(err).__name__}: {err}); a task template may format a document's fields, never "
            "reach Python objects"
        ) from None
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
