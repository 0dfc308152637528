"""DPO (and SimPO) through the real stages: pairs cached by cache_dataset, trained by DeepSpeed ranks with the
reference as the base with the adapter disabled; 2 ranks = 1 rank, and a run killed after a checkpoint and rerun
equals the uninterrupted one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.core.atomic import read_json
from tests.helpers.training import (
    ONE_RANK,
    TINY,
    TWO_RANKS,
    assert_same_training,
    cache_rows,
    killed_after_a_checkpoint,
    losses,
    train,
)

pytestmark = pytest.mark.integration
PAIRS = 40
DPO = ["data.format=preference", "train.objective=dpo", "train.beta=0.5", "data.max_seq_len=48",
       "data.prompt_template='{instruction}:'", "train.lr=2e-3"]  # fmt: skip


def pairs_file(path: Path, paragraphs: list[str]) -> Path:
    """Prompt: a paragraph's start; both responses how it goes on, the chosen one opened by 好 and the rejected one by
    坏: a preference a model can learn from a few pairs and show on held-out ones."""
    rows = []
    for text in paragraphs[:PAIRS]:
        rows.append({"prompt": text[:12], "chosen": "好" + text[12:24], "rejected": "坏" + text[12:24]})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pref_inputs(tmp_path_factory, inputs, tiny_base_dir, peoples_daily) -> Path:
    """The tiny run's tokenizer and a preference dataset made by the cache_dataset stage."""
    root = tmp_path_factory.mktemp("pref_inputs")
    source = pairs_file(root / "pairs.jsonl", [p for p in peoples_daily if len(p) > 40])
    return cache_rows(root, inputs=inputs, base=tiny_base_dir, source=source, overrides=DPO)


@pytest.fixture(scope="module")
def dpo_one_rank(tmp_path_factory, pref_inputs, tiny_base_dir) -> Path:
    out = tmp_path_factory.mktemp("dpo_one_rank")
    train(pref_inputs, tiny_base_dir, out, [*TINY, *DPO, *ONE_RANK, "deepspeed=zero2"])
    return out


def test_the_pairs_are_cached_with_the_prompt_masked(pref_inputs):
    figures = read_json(pref_inputs / "dataset.json")
    kept = PAIRS - 2  # data.heldout_fraction (0.05) of the file's rows are held out for the evaluate stage
    assert figures["pairs"] == kept and figures["train_rows"] + figures["validation_rows"] == kept
    from pipeline.data.saved_splits import SplitRows

    row = SplitRows(pref_inputs / "dataset" / "train")[0]
    assert set(row) == {"input_ids", "labels", "rejected_input_ids", "rejected_labels"}
    prompt = int((row["labels"] == -100).sum())
    assert prompt > 0 and (row["rejected_labels"][:prompt] == -100).all()
    assert (row["input_ids"][:prompt] == row["rejected_input_ids"][:prompt]).all()


def test_dpo_learns_to_prefer_the_chosen_responses(dpo_one_rank):
    metrics = read_json(dpo_one_rank / "metrics.json")
    curve = (dpo_one_rank / "curve.csv").read_text().splitlines()
    assert "preference_accuracy" in curve[0] and "reward_margin" in curve[0] and "val_preference_accuracy" in curve[0]
    first, *later = losses(dpo_one_rank)
    assert abs(first - 0.6931) < 1e-3, "step 1: the adapter starts at B = 0, so the policy is the reference: log 2"
    assert sum(later[-3:]) / 3 < first and metrics["val_reward_margin"] > 0 and metrics["val_preference_accuracy"] > 0.5
    run = read_json(dpo_one_rank / "checkpoints" / "plan.json")
    assert run["objective"] == {"kind": "dpo", "beta": 0.5, "simpo_gamma": 0.5, "reference": "step"}


@pytest.mark.parametrize("zero", ["zero0", "zero1", "zero2", "zero3"])
def test_two_ranks_train_what_one_rank_trains(tmp_path, pref_inputs, tiny_base_dir, dpo_one_rank, zero):
    train(pref_inputs, tiny_base_dir, tmp_path, [*TINY, *DPO, *TWO_RANKS, f"deepspeed={zero}"])
    assert_same_training(tmp_path, dpo_one_rank, atol=1e-5)


def test_two_ranks_sharing_each_pair_batch_train_what_one_rank_trains(
    tmp_path, pref_inputs, tiny_base_dir, dpo_one_rank
):
    """train.sequence_parallel=2, ZeRO-1: the micro-batch's padded chosen and rejected rows end to end, split over
    both ranks; each response's log-probability gathered from both (pipeline/training/ulysses.py)."""
    split = ["launcher.ranks_per_node=2", "train.sequence_parallel=2", "train.gradient_accumulation_steps=4"]
    train(pref_inputs, tiny_base_dir, tmp_path, [*TINY, *DPO, *split, "deepspeed=zero1"])
    assert_same_training(tmp_path, dpo_one_rank, atol=1e-5)


def test_orpo_on_two_ranks_trains_what_one_rank_trains(tmp_path, pref_inputs, tiny_base_dir):
    """ORPO (no reference: the chosen response's NLL plus the odds-ratio term) through the DeepSpeed ranks."""
    orpo = [*TINY, *DPO, "train.objective=orpo", "deepspeed=zero2"]
    train(pref_inputs, tiny_base_dir, tmp_path / "one", [*orpo, *ONE_RANK])
    train(pref_inputs, tiny_base_dir, tmp_path / "two", [*orpo, *TWO_RANKS])
    assert_same_training(tmp_path / "two", tmp_path / "one", atol=1e-5)
    first, *later = losses(tmp_path / "one")
    assert first > 1.0 and sum(later[-3:]) / 3 < first, "ORPO's loss holds the chosen NLL: above log 2, falling"


def test_a_precomputed_reference_trains_as_the_reference_of_each_step(
    tmp_path, pref_inputs, tiny_base_dir, dpo_one_rank
):
    """train.reference=precomputed: computed once for every pair the run trains on, split over both ranks."""
    train(
        pref_inputs,
        tiny_base_dir,
        tmp_path,
        [*TINY, *DPO, *TWO_RANKS, "deepspeed=zero2", "train.reference=precomputed"],
    )
    assert_same_training(tmp_path, dpo_one_rank, atol=1e-5)


def test_a_killed_dpo_run_resumes_as_if_uninterrupted(tmp_path, pref_inputs, tiny_base_dir):
    overrides = [*TINY, *DPO, *TWO_RANKS, "deepspeed=zero2", "train.objective=simpo"]
    whole = tmp_path / "whole"
    train(pref_inputs, tiny_base_dir, whole, overrides)
    out = tmp_path / "killed"
    first = killed_after_a_checkpoint(pref_inputs, tiny_base_dir, out, overrides)
    rerun = train(pref_inputs, tiny_base_dir, out, overrides)
    assert f"resuming from {out / 'checkpoints' / first}" in rerun.stdout
    assert read_json(out / "metrics.json")["resumed_from_step"] == int(first.removeprefix("step_"))
    assert_same_training(out, whole, atol=1e-6)


@pytest.fixture(scope="module")
def start_adapter(dpo_one_rank, tmp_path_factory) -> Path:
    """An adapter to start from: the DPO run's, consolidated in this process (any trained adapter of this base and
    LoRA does; `python -m pipeline consolidate` itself: integration/test_consolidate.py)."""
    from pipeline.checkpoints.consolidate import consolidate

    out = tmp_path_factory.mktemp("start") / "adapter"
    consolidate(checkpoint_dir=dpo_one_rank / "checkpoints", output_dir=out)
    return out


def test_dpo_from_an_adapter_starts_from_it_and_against_it(tmp_path, pref_inputs, tiny_base_dir, start_adapter):
    """train.init_adapter under ZeRO-3 on 2 ranks: the run starts from the adapter's tensors exactly, and DPO's
    reference is that model (base + adapter), not the base: at step 1 the policy is the reference, so the loss is
    log 2 and both rewards are 0, although the adapter is far from the base."""
    from safetensors.torch import load_file

    from pipeline.checkpoints.adapter import WEIGHTS, peft_key

    overrides = [*TINY, *DPO, *TWO_RANKS, "deepspeed=zero3", f"train.init_adapter={start_adapter}",
                 "train.reference=precomputed"]  # fmt: skip
    train(pref_inputs, tiny_base_dir, tmp_path, overrides, extra=("--loaded-state", str(tmp_path / "loaded.st")))
    started, adapter = load_file(tmp_path / "loaded.st"), load_file(start_adapter / WEIGHTS)
    masters = {peft_key(name): value for name, value in started.items() if "#" not in name}
    head, embedding = "base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"
    assert set(adapter) - set(masters) == {head} and torch.equal(adapter[head], adapter[embedding])  # tied: a copy
    for name, value in masters.items():
        torch.testing.assert_close(value, adapter[name].float(), atol=0, rtol=0, msg=name)
    header, first = (tmp_path / "curve.csv").read_text().splitlines()[:2]
    step_1 = dict(zip(header.split(","), first.split(","), strict=True))
    assert abs(float(step_1["loss"]) - math.log(2)) < 1e-5, step_1
    assert float(step_1["reward_chosen"]) == float(step_1["reward_rejected"]) == 0.0
    assert read_json(tmp_path / "checkpoints" / "plan.json")["objective"]["reference"] == "initial"
    final = {peft_key(name): value for name, value in load_file(tmp_path / "final.safetensors").items()}
    assert max(float((final[k] - adapter[k].float()).abs().max()) for k in final) > 1e-4, "it trained on from there"


def test_a_killed_dpo_run_from_an_adapter_resumes_with_its_reference(
    tmp_path, pref_inputs, tiny_base_dir, start_adapter
):
    """The reference of the starting adapter cannot be computed again once the adapter has trained: the checkpoint
    keeps it, and the resumed run equals the uninterrupted one."""
    overrides = [*TINY, *DPO, *TWO_RANKS, "deepspeed=zero2", f"train.init_adapter={start_adapter}",
                 "train.reference=precomputed"]  # fmt: skip
    whole = tmp_path / "whole"
    train(pref_inputs, tiny_base_dir, whole, overrides)
    out = tmp_path / "killed"
    first = killed_after_a_checkpoint(pref_inputs, tiny_base_dir, out, overrides)
    state = read_json(out / "checkpoints" / first / "trainer_state.json")
    assert len(state["reference_logps"]) > 0
    train(pref_inputs, tiny_base_dir, out, overrides)
    assert_same_training(out, whole, atol=1e-6)


def test_an_adapter_of_other_lora_settings_is_refused_before_a_launch(
    tmp_path, pref_inputs, tiny_base_dir, start_adapter
):
    overrides = [*TINY, *DPO, *ONE_RANK, "lora.r=8", f"train.init_adapter={start_adapter}",
                 "train.reference=precomputed"]  # fmt: skip
    done = train(pref_inputs, tiny_base_dir, tmp_path, overrides, check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (
        f"train.init_adapter: {start_adapter} is an adapter of other LoRA settings (lora.r: 8 (the adapter's: 4)"
        in done.stderr
    )
    assert not (tmp_path / "checkpoints").exists()
