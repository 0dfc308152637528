"""Sequence parallelism (train.sequence_parallel) through the train stage: DeepSpeed ranks over gloo, each holding
part of every sequence, train what one rank trains on the whole sequences (losses and adapter tensors, within fp32
rounding): packed text blocks on 2 ranks (ZeRO-2) and 4 (each sequence over all 4: the key-value heads repeated),
packed SFT rows with their prompts masked on 2 ranks and on 4 (2 groups of 2, ZeRO-3); a killed run resumes as if
uninterrupted; the checkpoint consolidates into the adapter one rank writes, and merges. DPO's padded pairs:
tests/integration/test_preference_training.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.core import config
from pipeline.core.atomic import read_json
from tests.conftest import REPO
from tests.helpers.training import TINY, assert_same_training, cache_rows, killed_after_a_checkpoint, losses, train

pytestmark = pytest.mark.integration
SFT = ["data.format=alpaca", "data.max_seq_len=48", "data.prompt_template='{instruction}:'",
       "train.micro_batch_size=2"]  # fmt: skip


def ranks(world: int, size: int, accumulation: int) -> list[str]:
    return [f"launcher.ranks_per_node={world}", f"train.sequence_parallel={size}",
            f"train.gradient_accumulation_steps={accumulation}"]  # fmt: skip


@pytest.fixture(scope="module")
def blocks_sp2(tmp_path_factory, inputs, tiny_base_dir) -> Path:
    """2 ranks, one sequence-parallel group: the 64-token blocks split in two, ZeRO-2."""
    out = tmp_path_factory.mktemp("blocks_sp2")
    train(inputs, tiny_base_dir, out, [*TINY, *ranks(2, 2, 4), "deepspeed=zero2"])
    return out


def test_two_ranks_sharing_each_sequence_train_what_one_rank_trains(blocks_sp2, reference):
    assert_same_training(blocks_sp2, reference, atol=1e-5)
    metrics = read_json(blocks_sp2 / "metrics.json")
    assert metrics["sequence_parallel"] == 2 and metrics["world_size"] == 2
    seen = [read_json(run / "checkpoints" / "step_000006" / "trainer_state.json")["tokens_seen"]
            for run in (blocks_sp2, reference)]  # fmt: skip
    assert seen[0] == seen[1] == 6 * 4 * 64, "each token counted once"


def test_four_ranks_sharing_each_sequence_train_what_one_rank_trains(tmp_path, inputs, tiny_base_dir, reference):
    """16 tokens a rank; 4 ranks over the tiny model's 2 key-value heads: each head on two ranks."""
    train(inputs, tiny_base_dir, tmp_path, [*TINY, *ranks(4, 4, 4), "deepspeed=zero2"])
    assert_same_training(tmp_path, reference, atol=1e-5)


def test_the_checkpoint_consolidates_and_merges_as_one_rank_s(tmp_path, blocks_sp2, reference, tiny_base_dir):
    """The adapter does not depend on how the ranks split the sequence: consolidated from the 2 sequence-parallel
    ranks' ZeRO-2 shards, it holds the one rank's tensors (within fp32 rounding); its merge passes the proof."""
    from pipeline.checkpoints.consolidate import consolidate
    from pipeline.merge.fold import merge

    for name, run in (("split", blocks_sp2), ("whole", reference)):
        consolidate(checkpoint_dir=run / "checkpoints", output_dir=tmp_path / name)
    split, whole = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("split", "whole"))
    assert split.keys() == whole.keys() and any("lora_B" in k for k in split)
    for key in split:
        torch.testing.assert_close(split[key], whole[key], atol=1e-5, rtol=1e-4, msg=key)
    report = merge(base_dir=tiny_base_dir, adapter_dir=tmp_path / "split", out_dir=tmp_path / "merged")
    assert report["verification"]["max_abs_logit_diff"] < report["verification"]["limit_abs"]


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory, inputs, tiny_base_dir, peoples_daily) -> Path:
    """Instruction rows of several lengths (a paragraph's start as the prompt, masked; its next words the response)
    cached by the cache_dataset stage; micro-batches of 2 rows are packed end to end, positions restarting."""
    root = tmp_path_factory.mktemp("sft_inputs")
    rows = [{"instruction": p[:8], "output": p[8 : 16 + i % 24]} for i, p in enumerate(peoples_daily[:80])]
    source = root / "sft.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return cache_rows(root, inputs=inputs, base=tiny_base_dir, source=source, overrides=SFT)


@pytest.fixture(scope="module")
def sft_one_rank(tmp_path_factory, sft_inputs, tiny_base_dir) -> Path:
    out = tmp_path_factory.mktemp("sft_one_rank")
    train(sft_inputs, tiny_base_dir, out, [*TINY, *SFT, "launcher.ranks_per_node=1",
                                           "train.gradient_accumulation_steps=2", "deepspeed=zero2"])  # fmt: skip
    return out


def test_packed_sft_rows_split_over_2_ranks_train_and_resume_as_one_rank(
    tmp_path, sft_inputs, tiny_base_dir, sft_one_rank
):
    """The micro-batch's 2 rows end to end (prompts masked, each row attending only to itself), split in two; a run
    killed after a checkpoint and rerun equals the uninterrupted one."""
    from pipeline.data.saved_splits import SplitRows

    rows = SplitRows(sft_inputs / "dataset" / "train")
    assert len({len(rows[i]["input_ids"]) for i in range(len(rows))}) > 5 and (rows[0]["labels"] == -100).any()
    overrides = [*TINY, *SFT, *ranks(2, 2, 2), "deepspeed=zero2"]
    whole = tmp_path / "whole"
    train(sft_inputs, tiny_base_dir, whole, overrides)
    assert_same_training(whole, sft_one_rank, atol=1e-5)
    out = tmp_path / "killed"
    first = killed_after_a_checkpoint(sft_inputs, tiny_base_dir, out, overrides)
    rerun = train(sft_inputs, tiny_base_dir, out, overrides)
    assert f"resuming from {out / 'checkpoints' / first}" in rerun.stdout
    assert read_json(out / "metrics.json")["resumed_from_step"] == int(first.removeprefix("step_"))
    assert_same_training(out, whole, atol=1e-6)


def test_two_groups_of_two_under_zero3_train_packed_sft_rows_as_one_rank(
    tmp_path, sft_inputs, tiny_base_dir, sft_one_rank
):
    """4 ranks: 2 data-parallel groups of 2 sequence-parallel ranks, ZeRO-3 partitioning and reducing over all 4 (its
    reduce-scatter divides by 4, not 2: without the gradient's scale every gradient was halved, the losses off by
    2e-3). Losses and tensors within 1e-5."""
    train(sft_inputs, tiny_base_dir, tmp_path, [*TINY, *SFT, *ranks(4, 2, 1), "deepspeed=zero3"])
    assert_same_training(tmp_path, sft_one_rank, atol=1e-5)
    assert len(losses(tmp_path)) == 6


def test_the_long_context_experiment_runs_at_smoke_size(tmp_path, inputs, tiny_base_dir, peoples_daily):
    """experiment=long_context shrunk to the tiny model (4 heads: 2 ranks share each sequence, of 128 tokens): the
    cache_dataset stage cuts the corpus into sequences of the trained length, the train stage trains them over both
    ranks (the estimate leaving the MLPs whole: they fit), and the adapter scores windows of the trained length
    (eval.context follows data.block_size)."""
    from pipeline.checkpoints.consolidate import consolidate
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.evaluation.likelihood import load_model, score, text_examples

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(p + "\n" for p in peoples_daily[:400]), encoding="utf-8")
    overrides = [
        "experiment=long_context", "launcher.ranks_per_node=2", "train.sequence_parallel=2", "data.block_size=128",
        f"data.train_file={corpus}", f"data.heldout_file={corpus}", "train.max_steps=2", "train.save_every=2",
        "train.eval_every=2", "launcher.accelerator=cpu", "train.precision=fp32", "lora.r=4",
        "lora.modules_to_save=[embed_tokens,lm_head]", "eval.stride=64",
    ]  # fmt: skip
    cfg = config.Config(**config.compose(REPO / "conf", ["tracking.uri=", *overrides]))
    cache_rows(tmp_path, inputs=inputs, base=tiny_base_dir, overrides=overrides)
    train(tmp_path, tiny_base_dir, tmp_path / "run", overrides)
    plan = read_json(tmp_path / "run" / "checkpoints" / "plan.json")
    assert plan["launch"]["sequence_parallel"] == 2 and plan["launch"]["tiled_mlp"] is False
    assert plan["launch"]["gradient_checkpointing"] is True and len(losses(tmp_path / "run")) == 2
    consolidate(checkpoint_dir=tmp_path / "run" / "checkpoints", output_dir=tmp_path / "adapter")
    model = load_model(tiny_base_dir, tmp_path / "adapter", precision="fp32")
    examples = text_examples(load_tokenizer(inputs / "tokenizer"), corpus, max_bytes=4000)
    scored = score(model, examples, context=cfg.eval.context, stride=cfg.eval.stride, batch_size=cfg.eval.batch_size)
    assert cfg.eval.context == 128 and 0 < scored.as_dict()["bits_per_byte"] < 20
