"""Evaluation: the sliding window scores each token once with enough history, the scores equal a direct
computation, the stage writes the table for base / adapter / merged, lm-evaluation-harness agrees, bad input."""

from __future__ import annotations

import argparse
import copy
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.core import config
from pipeline.core.atomic import read_json
from pipeline.data.eval_sets import write_set
from pipeline.data.inputs import detected_format, items
from pipeline.data.tokenizer import load_tokenizer
from pipeline.evaluation.likelihood import Example, Score, check_vocabulary, load_examples, score, windows
from tests.conftest import REPO


@pytest.mark.parametrize(("context", "stride"), [(8, 8), (8, 3), (8, 1), (64, 64), (5, 4)])
def test_windows_score_every_token_once_with_enough_history(context, stride):
    example = Example(list(range(100, 137)), [False] + [True] * 30 + [False] * 2 + [True] * 4, 0)
    seen = []
    for ids, labels in windows(example, context, stride):
        assert len(ids) == len(labels) <= context
        for position, label in enumerate(labels):
            if label != -100:
                target = ids[0] - 100 + position + 1  # the index of the token this logit predicts
                assert label == example.ids[target]
                assert position + 1 >= min(target, context - stride), "too little history"
                seen.append(target)
    assert seen == [j for j in range(1, 37) if example.scored[j]]


@pytest.fixture(scope="module")
def tiny_model(tiny_base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32).eval()


def test_score_with_one_window_equals_a_plain_forward(tiny_model):
    ids = torch.randint(0, 49152, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        logits = tiny_model(input_ids=ids).logits[0, :-1]
    expected = float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
    got = score(tiny_model, [Example(ids[0].tolist(), [False] + [True] * 29, 40)], context=64, stride=64, batch_size=2)
    assert got.tokens == 29 and math.isclose(got.nll, expected, rel_tol=1e-5)
    assert math.isclose(got.as_dict()["bits_per_byte"], expected / (math.log(2) * 40), rel_tol=1e-5)
    assert math.isclose(Score(2.0, 4, 8).as_dict()["perplexity"], math.exp(0.5))


def test_batching_does_not_change_the_score(tiny_model):
    examples = [Example(list(range(5, 5 + n)), [False] + [True] * (n - 1), n) for n in (7, 40, 23)]
    one = score(tiny_model, examples, context=16, stride=16, batch_size=1)
    batched = score(tiny_model, examples, context=16, stride=16, batch_size=3)
    assert one.tokens == batched.tokens == 67 and math.isclose(one.nll, batched.nll, rel_tol=1e-5)


def test_bad_eval_input(tmp_path, smol_tokenizer_dir, tiny_model):
    tokenizer = load_tokenizer(smol_tokenizer_dir)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt"):
        load_examples(
            tokenizer, tmp_path / "empty.txt", template="alpaca", max_bytes=None, context=64, key="eval.sets.x"
        )
    (tmp_path / "short.txt").write_text("A few words.\n")
    with pytest.raises(ValueError, match=r"eval.sets.x: .*short.txt gives \d+ tokens .* shorter than one window"):
        load_examples(
            tokenizer, tmp_path / "short.txt", template="alpaca", max_bytes=None, context=64, key="eval.sets.x"
        )
    tiny_model.resize_token_embeddings(1000)
    try:
        with pytest.raises(ValueError, match="the tokenizer has 49152 tokens but the model only 1000 embedding rows"):
            check_vocabulary(tokenizer, tiny_model, "here")
    finally:
        tiny_model.resize_token_embeddings(49152)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_base_dir, peoples_daily) -> Path:
    """A tiny base, a (random, non-zero) adapter, their merge, and an eval text."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.merge.fold import merge

    root = tmp_path_factory.mktemp("evaluate")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.mul_(300.0)  # a change the scores must show
    peft.save_pretrained(str(root / "adapter"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_base_dir / name, root / "adapter" / name)
    merge(base_dir=tiny_base_dir, adapter_dir=root / "adapter", out_dir=root / "merged")
    (root / "in_domain.txt").write_text("\n".join(peoples_daily[:40]) + "\n", encoding="utf-8")
    return root


def _stage_args(root: Path, base: Path, sets: dict, out: Path) -> tuple[argparse.Namespace, config.Config]:
    raw = config.compose(REPO / "conf", ["tracking.uri=", "eval.context=64", "eval.stride=32", "eval.max_bytes=3000"])
    raw["eval"]["sets"] = sets
    raw["eval"]["max_new_tokens"] = 4
    (out / "params.yaml").write_text(yaml.safe_dump(raw))
    for name, path in sets.items():  # as the eval_set stages write them (an empty file: none, eval_set refuses it)
        if Path(path).is_file() and Path(path).stat().st_size:
            shutil.rmtree(out / "sets" / name, ignore_errors=True)
            read_as = detected_format(path)
            write_set(out / "sets" / name, items(path, read_as), data_format=read_as, source=path, held_out=False)
    args = argparse.Namespace(
        base=base,
        base_tokenizer=base,
        adapter=root / "adapter",
        merged=root / "merged",
        sets=out / "sets",
        metrics=out / "eval.json",
        plot=out / "plot.csv",
        task_plot=out / "tasks.csv",
        samples=out / "samples.md",
        run_id_file=out / "run.json",
    )
    return args, config.load(out / "params.yaml")


@pytest.mark.integration
def test_stage_table_for_base_adapter_and_merged(trained, tiny_base_dir, tmp_path):
    """Base + adapter scored through PEFT equals the merged model (a merge without a proof: both are scored)."""
    from stages import evaluate as stage

    unproven = tmp_path / "unproven"
    shutil.copytree(trained, unproven)
    (unproven / "merged" / "merge_report.json").unlink()
    sets = {"in_domain": str(trained / "in_domain.txt")}
    stage.main(*_stage_args(unproven, tiny_base_dir, sets, tmp_path))
    table = read_json(tmp_path / "eval.json")
    assert set(table) == {"in_domain", "variant"} and set(table["in_domain"]) == {"base", "adapter", "merged"}
    assert table["variant"] == {"name": "LoRA (base precision unknown)", "quantization": "unknown"}  # PEFT-saved
    base, adapter, merged = (table["in_domain"][m] for m in ("base", "adapter", "merged"))
    assert base["bytes"] == adapter["bytes"] == merged["bytes"] <= 3000 and base["tokens"] > 64
    assert math.isclose(adapter["bits_per_byte"], merged["bits_per_byte"], rel_tol=1e-5)
    assert not math.isclose(adapter["bits_per_byte"], base["bits_per_byte"], rel_tol=1e-4), "the adapter did nothing"
    rows = (tmp_path / "plot.csv").read_text().splitlines()
    assert len(rows) == 4 and rows[0].endswith(",variant") and rows[2].endswith(",LoRA (base precision unknown)")
    assert "**merged**" in (tmp_path / "samples.md").read_text()
    assert "scored_as" not in adapter


@pytest.mark.integration
def test_adapter_is_scored_once_when_the_merge_proof_passed(trained, tiny_base_dir, tmp_path):
    from stages import evaluate as stage

    stage.main(*_stage_args(trained, tiny_base_dir, {"in_domain": str(trained / "in_domain.txt")}, tmp_path))
    adapter, merged = (read_json(tmp_path / "eval.json")["in_domain"][m] for m in ("adapter", "merged"))
    assert adapter["scored_as"].startswith("merged (the merge proof passed")
    assert {k: v for k, v in adapter.items() if k != "scored_as"} == merged


@pytest.mark.integration
def test_stage_bad_set_writes_no_metrics(trained, tiny_base_dir, tmp_path):
    from stages import evaluate as stage

    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(FileNotFoundError, match="sets/in_domain: no set.json; expected a set written by the eval_set"):
        stage.main(*_stage_args(trained, tiny_base_dir, {"in_domain": str(tmp_path / "empty.txt")}, tmp_path))
    with pytest.raises(FileNotFoundError, match="missing model folder"):
        args, cfg = _stage_args(trained, tiny_base_dir, {"in_domain": str(trained / "in_domain.txt")}, tmp_path)
        stage.main(argparse.Namespace(**{**vars(args), "merged": tmp_path / "nowhere"}), cfg)
    assert not (tmp_path / "eval.json").exists()


@pytest.mark.integration
def test_bits_per_byte_match_lm_evaluation_harness(trained, tmp_path, peoples_daily):
    """Same definitions when stride == context == the harness's max_length and both condition the first token on
    the BOS (else EOS) token; documents are the file's lines."""
    from transformers import AutoModelForCausalLM

    from bench.lm_harness import bits_per_byte
    from pipeline.evaluation.likelihood import text_examples

    documents = peoples_daily[:12]
    (tmp_path / "docs.txt").write_text("\n".join(documents) + "\n", encoding="utf-8")
    model = AutoModelForCausalLM.from_pretrained(trained / "merged", dtype=torch.float32).eval()
    examples = text_examples(load_tokenizer(trained / "merged"), tmp_path / "docs.txt", None)
    ours = score(model, examples, context=64, stride=64, batch_size=4).as_dict()["bits_per_byte"]
    theirs = bits_per_byte(trained / "merged", documents, context=64, workdir=tmp_path / "harness")
    assert ours == pytest.approx(theirs, rel=0.01), (ours, theirs)


@pytest.mark.slow
def test_chunked_logits_score_exactly_as_whole_ones(tiny_model):
    """The head runs on a few positions at a time (the batch x window x vocabulary fp32 logits never exist at
    once); in fp32 the score is the same to the last bit."""
    generator = torch.Generator().manual_seed(3)
    examples = [
        Example(torch.randint(0, 49152, (n,), generator=generator).tolist(), [False] + [True] * (n - 1), n)
        for n in (70, 150, 33)
    ]
    whole = score(tiny_model, examples, context=64, stride=32, batch_size=2, chunk=10**9)
    for chunk in (1, 7, 64):
        assert score(tiny_model, examples, context=64, stride=32, batch_size=2, chunk=chunk) == whole


def test_replicas_score_their_share_of_the_batches_as_one_model_does(tiny_model):
    """Data-parallel scoring: each replica (one per GPU; here copies on the CPU) takes every n-th batch in a thread;
    the sum, taken in batch order, is the single model's to the last bit, with batches that do not divide evenly."""
    generator = torch.Generator().manual_seed(4)
    examples = [
        Example(torch.randint(0, 49152, (n,), generator=generator).tolist(), [False] + [True] * (n - 1), n)
        for n in (70, 150, 33, 90, 12)
    ]
    one = score(tiny_model, examples, context=32, stride=16, batch_size=2)
    for n in (2, 3):
        replicas = [tiny_model, *(copy.deepcopy(tiny_model) for _ in range(n - 1))]
        assert score(replicas, examples, context=32, stride=16, batch_size=2) == one


@pytest.mark.slow
def test_bf16_scores_agree_with_fp32(trained, peoples_daily):
    """bf16 (chosen where the hardware computes it natively) gives the fp32 bits per byte within 1% (relative)."""
    from pipeline.evaluation.likelihood import load_model, text_examples

    tokenizer = load_tokenizer(trained / "merged")
    path = trained / "in_domain.txt"
    examples = text_examples(tokenizer, path, 3000)
    figures = {
        precision: score(load_model(trained / "merged", None, precision=precision), examples, context=64, stride=32,
                         batch_size=4).as_dict()["bits_per_byte"]
        for precision in ("fp32", "bf16")
    }  # fmt: skip
    assert figures["bf16"] == pytest.approx(figures["fp32"], rel=0.01), figures


def test_a_model_goes_whole_on_each_gpu_that_holds_it_and_is_spread_only_where_none_does(tiny_base_dir):
    from pipeline.evaluation.likelihood import FIT, device_maps, model_bytes

    gib = 1 << 30
    assert device_maps(16 * gib, []) == [None]  # no GPU: the CPU
    free = [70 * gib, 79 * gib, 12 * gib, 40 * gib]
    assert device_maps(16 * gib, free) == [{"": 1}, {"": 0}, {"": 3}]  # a replica on each that holds it, freest first
    assert device_maps(140 * gib, [79 * gib] * 8) == ["auto"]  # a 70B in bf16: spread
    assert device_maps(int(FIT * 79 * gib) + 1, [79 * gib]) == ["auto"]
    parameters = sum(t.numel() for t in load_file(tiny_base_dir / "model.safetensors").values())
    assert model_bytes(tiny_base_dir, torch.bfloat16) == 2 * parameters


def _response_logp(model, ids, labels) -> float:
    """log p(response | prompt) of one row alone, from a plain forward (float64 log-softmax)."""
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(ids)[None]).logits[0].double()
    logps = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.as_tensor(ids[1:])[:, None]).squeeze(1)
    return float(logps[torch.as_tensor(labels[1:]) != -100].sum())


@pytest.mark.integration
def test_preference_sets_score_each_model_as_plain_forwards_do(trained, tiny_base_dir, tmp_path, peoples_daily):
    """eval.preference_sets: each model's preference accuracy, mean margin and (tuned models) reward accuracy in
    eval.json and the report equal those of plain forwards over each response alone."""
    import json

    from transformers import AutoModelForCausalLM

    from pipeline.evaluation.preference import load_pairs
    from pipeline.evaluation.report import evaluation_table
    from stages import evaluate as stage

    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": text[:8], "chosen": text[8:40], "rejected": peoples_daily[k + 20][8:40]}
        for k, text in enumerate(peoples_daily[:12])
    ]
    pairs.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    args, cfg = _stage_args(trained, tiny_base_dir, {"in_domain": str(trained / "in_domain.txt")}, tmp_path)
    changes = {"preference_sets": {"pairs": str(pairs)}, "precision": "fp32"}
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update=changes)})
    stage.main(args, cfg)
    evaluation = read_json(tmp_path / "eval.json")
    table = evaluation["preference"]["pairs"]
    assert set(table) == {"base", "adapter", "merged"} and table["adapter"] == table["merged"]  # the proof passed
    loaded = load_pairs(
        load_tokenizer(tiny_base_dir), pairs, template=cfg.data.prompt_template, max_seq_len=cfg.data.max_seq_len,
        key="pairs",
    )  # fmt: skip
    margins = {}
    for name, folder in (("base", tiny_base_dir), ("merged", trained / "merged")):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        margins[name] = [
            _response_logp(model, r["input_ids"], r["labels"])
            - _response_logp(model, r["rejected_input_ids"], r["rejected_labels"])
            for r in loaded
        ]
        figures = table[name]
        assert figures["pairs"] == len(loaded) == len(rows)
        assert figures["mean_margin"] == pytest.approx(sum(margins[name]) / len(loaded), abs=1e-4)
        assert figures["preference_accuracy"] == pytest.approx(sum(m > 0 for m in margins[name]) / len(loaded))
    rewards = [tuned - base for tuned, base in zip(margins["merged"], margins["base"], strict=True)]
    assert "reward_accuracy" not in table["base"]
    assert table["merged"]["reward_accuracy"] == pytest.approx(sum(r > 0 for r in rewards) / len(rewards))
    assert table["base"]["mean_margin"] != pytest.approx(table["merged"]["mean_margin"], abs=1e-3), "adapter acts"
    shown = [line for line in evaluation_table(evaluation) if line.startswith("pairs pairs")]
    assert len(shown) == 3 and f"{table['base']['preference_accuracy']:.3f}" in shown[0]
