"""Downstream tasks through lm-evaluation-harness: the adapter is really applied (an adapter built so that it must
change the answers changes them, and merged = adapter), the figures reach eval.json and the plot, the shipped tasks
ask what training taught, and bad task files are refused before any model is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.core.atomic import read_json
from pipeline.evaluation.tasks import load_task, load_tasks
from tests.conftest import REPO

REVIEWS = [
    "这台电脑质量很差，非常失望。",
    "物流很快，包装完好，很满意。",
    "屏幕有划痕，客服也不理。",
    "味道不错，下次还买。",
] * 3
PROMPT = "评论：{text}\n情感："
MC_TASK = {
    "task": "toy_mc", "dataset_path": "json", "test_split": "test", "output_type": "multiple_choice",
    "doc_to_text": PROMPT.replace("{text}", "{{text}}"), "doc_to_choice": ["positive", "negative"],
    "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}],
}  # fmt: skip
GEN_TASK = {
    "task": "toy_gen", "dataset_path": "json", "test_split": "test", "output_type": "generate_until",
    "doc_to_text": PROMPT.replace("{text}", "{{text}}"), "doc_to_target": "{{label}}",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False},
    "filter_list": [{"name": "extract", "filter": [
        {"function": "regex", "regex_pattern": "(positive|negative)", "group_select": 0, "fallback": "[invalid]"},
        {"function": "take_first"}]}],
    "metric_list": [{"metric": "exact_match", "ignore_case": True}],
}  # fmt: skip


def write_task(folder: Path, task: dict, data: Path, **changes) -> Path:
    path = folder / f"{task['task']}.yaml"
    path.write_text(yaml.safe_dump({**task, "dataset_kwargs": {"data_files": {"test": str(data)}}, **changes}))
    return path


@pytest.fixture(scope="module")
def toy(tmp_path_factory, tiny_base_dir) -> Path:
    """Reviews whose gold answer is " positive", which the tiny base never picks, and a rank-1 LoRA on the last
    down_proj that adds a large multiple of the " positive" embedding to the residual stream at the prompt's last
    position (A is aligned with what down_proj sees there for every prompt, so the push is positive on each): the
    adapter must answer " positive" (the tied head's self-similarity makes that token the argmax); and its merge."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.merge.fold import merge

    root = tmp_path_factory.mktemp("tasks")
    rows = [{"text": text, "label": "positive"} for text in REVIEWS]
    (root / "reviews.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tokenizer = load_tokenizer(tiny_base_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32).eval()
    down = model.model.layers[-1].mlp.down_proj
    seen = []
    hook = down.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0][0, -1]))
    with torch.no_grad():
        for text in REVIEWS:
            model(input_ids=tokenizer(PROMPT.format(text=text), return_tensors="pt").input_ids)
    hook.remove()
    inputs = torch.stack(seen)
    direction = torch.nn.functional.normalize(torch.nn.functional.normalize(inputs, dim=-1).mean(0), dim=0)
    assert bool((inputs @ direction > 0).all()), "the construction needs a positive push on every prompt"
    answer = model.get_input_embeddings().weight[tokenizer(" positive", add_special_tokens=False).input_ids[0]]
    lora = LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=["model.layers.1.mlp.down_proj"])
    peft = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_A" in name:
                param.copy_(direction.unsqueeze(0))
            elif "lora_B" in name:
                param.copy_(1000.0 * answer.detach().unsqueeze(1))
    peft.save_pretrained(str(root / "adapter"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_base_dir / name, root / "adapter" / name)
    merge(base_dir=tiny_base_dir, adapter_dir=root / "adapter", out_dir=root / "merged")
    (root / "text.txt").write_text("\n".join(REVIEWS * 4) + "\n", encoding="utf-8")
    return root


@pytest.mark.integration
def test_adapter_is_applied_and_merged_equals_adapter(toy, tiny_base_dir, tmp_path, monkeypatch):
    import socket

    from stages import evaluate as stage
    from tests.unit.evaluation.test_evaluate import _stage_args

    attempts = []

    def refuse(address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"no network in this test ({address})")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: refuse(address))
    tasks = [str(write_task(tmp_path, t, toy / "reviews.jsonl")) for t in (MC_TASK, GEN_TASK)]
    args, cfg = _stage_args(toy, tiny_base_dir, {"in_domain": str(toy / "text.txt")}, tmp_path)
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"tasks": tasks, "task_limit": None})})
    returned = stage.main(args, cfg)
    table = read_json(tmp_path / "eval.json")["tasks"]
    assert returned["tasks"] == table
    mc, gen = table["toy_mc"], table["toy_gen"]
    assert mc["base"]["acc"] == 0.0 and gen["base"]["exact_match_extract"] == 0.0, "the base never says positive"
    assert mc["adapter"]["acc"] == 1.0 and gen["adapter"]["exact_match_extract"] == 1.0, "the adapter was not applied"
    assert mc["merged"] == mc["adapter"] and gen["merged"] == gen["adapter"]
    assert mc["base"]["samples"] == len(REVIEWS) and mc["base"]["acc_stderr"] == 0.0
    rows = (tmp_path / "tasks.csv").read_text().splitlines()
    assert rows[0] == "label,task,metric,model,value,stderr"
    assert "toy_mc acc / adapter,toy_mc,acc,adapter,1.000000,0.000000" in rows
    assert len(rows) == 1 + 2 * 3
    assert attempts == [], "the harness reached for the network"


def test_the_shipped_tasks_ask_what_training_taught(tmp_path, monkeypatch):
    """Same Alpaca prompt as the SFT examples, and choices that are the corpus's labels."""
    from lm_eval.utils import apply_template

    from pipeline.data.corpus import SENTIMENT_INSTRUCTION
    from pipeline.data.templates import alpaca_prompt

    row = {"instruction": SENTIMENT_INSTRUCTION, "input": "质量很好，推荐。", "output": "正面"}
    (tmp_path / "data/corpus").mkdir(parents=True)
    (tmp_path / "data/corpus/reviews_sft_heldout.jsonl").write_text(json.dumps(row, ensure_ascii=False) + "\n")
    monkeypatch.chdir(tmp_path)
    specs = load_tasks([str(REPO / "tasks/reviews_sentiment_mc.yaml"), str(REPO / "tasks/reviews_sentiment_gen.yaml")])
    for spec in specs:
        assert apply_template(spec.config["doc_to_text"], row) == alpaca_prompt(row, "alpaca")
        assert spec.config["dataset_kwargs"]["data_files"]["test"] == str(
            tmp_path / "data/corpus/reviews_sft_heldout.jsonl"
        )
    assert specs[0].config["doc_to_choice"] == ["正面", "负面"] and specs[0].metrics == (("acc", "none"),)
    assert specs[1].metrics == (("exact_match", "extract"),)


def test_bad_task_files_are_named(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x", "label": "positive"}\n')
    with pytest.raises(FileNotFoundError, match=r"eval.tasks.0: .*nowhere.yaml not found"):
        load_tasks([str(tmp_path / "nowhere.yaml")])
    cases = [
        (dict(dataset_kwargs={"data_files": {"test": str(tmp_path / "gone.jsonl")}}), FileNotFoundError,
         r"toy_mc.yaml: dataset_kwargs.data_files.test: .*gone.jsonl not found"),
        (dict(metric_list=[{"metric": "accuracy_typo"}]), ValueError,
         r"toy_mc.yaml: metric_list.0.metric: unknown metric 'accuracy_typo'; expected one of .*acc"),
        (dict(dataset_path="super_glue"), ValueError, r"toy_mc.yaml: dataset_path: expected one of json"),
        (dict(output_type="ranking"), ValueError, r"toy_mc.yaml: output_type: expected one of"),
        (dict(include="base.yaml"), ValueError, r"toy_mc.yaml: include not supported"),
        (dict(filter_list=[{"name": "s", "filter": [{"function": "strip"}]}]), ValueError,
         r"toy_mc.yaml: filter_list.0.filter.0.function: unknown filter 'strip'"),
    ]  # fmt: skip
    for changes, error, message in cases:
        with pytest.raises(error, match=message):
            load_task(write_task(tmp_path, MC_TASK, data, **changes), "eval.tasks.0")
    (tmp_path / "broken.yaml").write_text("task: [t\n")
    with pytest.raises(ValueError, match=r"broken.yaml: not YAML the harness reads"):
        load_task(tmp_path / "broken.yaml", "eval.tasks.0")
    path = write_task(tmp_path, MC_TASK, data)
    with pytest.raises(ValueError, match="eval.tasks: task name 'toy_mc' is used by more than one file"):
        load_tasks([str(path), str(path)])


@pytest.mark.integration
def test_stage_refuses_a_bad_task_before_loading_a_model(toy, tiny_base_dir, tmp_path):
    from stages import evaluate as stage
    from tests.unit.evaluation.test_evaluate import _stage_args

    bad = write_task(tmp_path, MC_TASK, toy / "reviews.jsonl", metric_list=[{"metric": "no_such_metric"}])
    args, cfg = _stage_args(toy, tiny_base_dir, {"in_domain": str(toy / "text.txt")}, tmp_path)
    args.base = tmp_path / "not_loaded"  # a model load would fail differently
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"tasks": [str(bad)]})})
    with pytest.raises(ValueError, match="unknown metric 'no_such_metric'"):
        stage.main(args, cfg)
    assert not (tmp_path / "eval.json").exists()


CODE = """
from pathlib import Path

Path({imported!r}).touch()


def render(doc):
    Path({called!r}).touch()
    return "评论：" + doc["text"] + "\\n情感："
"""


def task_with_code(folder: Path, data: Path) -> tuple[Path, Path, Path]:
    """A task whose doc_to_text is `!function utils.render` (beside it, a utils.py that leaves a marker when it
    is imported and another when it is called)."""
    folder.mkdir(parents=True, exist_ok=True)
    imported, called = folder / "imported", folder / "called"
    (folder / "utils.py").write_text(CODE.format(imported=str(imported), called=str(called)))
    path = write_task(folder, MC_TASK, data)
    path.write_text(path.read_text().replace(f"doc_to_text: {yaml.safe_dump(MC_TASK['doc_to_text']).strip()}",
                                             "doc_to_text: !function utils.render"))  # fmt: skip
    assert "!function utils.render" in path.read_text()
    return path, imported, called


def test_task_code_runs_only_from_the_project_tasks_or_a_folder_named_for_it(tmp_path, monkeypatch):
    from pipeline.evaluation import tasks

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x", "label": "positive"}\n')
    path, imported, _ = task_with_code(tmp_path / "theirs", data)
    with pytest.raises(ValueError, match=r"toy_mc.yaml: names Python code \(!function utils.render\).*eval.task_code"):
        load_tasks([str(path)])
    assert not imported.exists(), "refused before anything was imported"
    with pytest.raises(FileNotFoundError, match=r"eval.task_code.0: .*nowhere is not a folder"):
        load_tasks([str(path)], [str(tmp_path / "nowhere")])
    spec = load_tasks([str(path)], [str(tmp_path / "theirs")])[0]
    assert imported.exists() and spec.config["doc_to_text"]({"text": "好"}) == "评论：好\n情感："
    imported.unlink()
    monkeypatch.setattr(tasks, "PROJECT_TASKS", tmp_path / "theirs")  # as the project's own tasks/
    assert callable(load_tasks([str(path)])[0].config["doc_to_text"]) and imported.exists()
    path.write_text(path.read_text().replace("utils.render", "helpers.render"))
    with pytest.raises(FileNotFoundError, match=r"!function helpers.render: .*helpers.py not found"):
        load_tasks([str(path)])


@pytest.mark.parametrize("key", ["doc_to_text", "doc_to_target"])
def test_a_task_template_that_reaches_for_python_is_refused_before_any_model(tmp_path, key):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x", "label": "positive"}\n')
    template = "{{ cycler.__init__.__globals__.os.system('touch " + str(tmp_path / "executed") + "') }}"
    with pytest.raises(ValueError, match=rf"toy_mc.yaml: {key}: the template reaches for '__"):
        load_tasks([str(write_task(tmp_path, MC_TASK, data, **{key: template}))])


@pytest.mark.integration
def test_task_templates_render_in_the_sandbox_and_trusted_code_runs(toy, tiny_base_dir, tmp_path):
    """What the load-time check cannot see (an attribute name built at render time) the sandbox refuses: nothing
    runs, and the error names the task; a trusted task's function is what the harness calls."""
    import lm_eval.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoModelForCausalLM

    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.evaluation.tasks import run_tasks

    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(tiny_base_dir)
    marker = tmp_path / "executed"
    hidden = "(cycler|attr('_' ~ '_init__')|attr('_' ~ '_globals__'))['os'].system('touch " + str(marker) + "')"
    cases = [("{{ " + hidden + " }}", "UndefinedError"), ("{{ cycler|attr('_' ~ '_init__') }}", "SecurityError")]
    for template, error in cases:
        path = write_task(tmp_path, MC_TASK, toy / "reviews.jsonl", doc_to_text=template)
        specs = load_tasks([str(path)])
        with pytest.raises(ValueError, match=rf"toy_mc.yaml\): a task template failed in the sandbox .*\({error}"):
            run_tasks(model, tokenizer, specs, batch_size=4, limit=2)
    assert not marker.exists() and isinstance(lm_eval.utils.env, ImmutableSandboxedEnvironment)
    path, _, called = task_with_code(tmp_path / "ours", toy / "reviews.jsonl")
    with_code = run_tasks(model, tokenizer, load_tasks([str(path)], [str(tmp_path / "ours")]), batch_size=4, limit=4)
    templated = write_task(tmp_path / "ours", {**MC_TASK, "task": "toy_template"}, toy / "reviews.jsonl")
    with_template = run_tasks(model, tokenizer, load_tasks([str(templated)]), batch_size=4, limit=4)
    assert called.exists() and with_code["toy_mc"] == with_template["toy_template"]
