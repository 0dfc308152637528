"""`make report` fits a terminal of 100 columns whatever the figures: long set and task names, large counts, the
limits and figures of any merge, a reused checkpoint (pipeline/evaluation/report.py, tools/report.py)."""

from __future__ import annotations

from pipeline.evaluation.report import evaluation_table, merge_proof, training_summary
from pipeline.evaluation.results import PREFERENCE_KEY, TASKS_KEY, VARIANT_KEY

WIDTH = 100
MODELS = ("base", "adapter", "merged")


def test_every_line_fits_100_columns_at_the_largest_figures():
    scored = {"bits_per_byte": 12.345678, "perplexity": 123456.789, "tokens": 123_456_789}
    evaluation = {
        "a_very_long_evaluation_set_name": {m: scored for m in MODELS},
        TASKS_KEY: {"a_very_long_task_name_indeed": {m: {"acc": 0.123456, "acc_stderr": 0.0123} for m in MODELS}},
        PREFERENCE_KEY: {"long_preference_set_name": {m: {"preference_accuracy": 0.5, "pairs": 12345} for m in MODELS}},
        VARIANT_KEY: {"name": "DoRA + LoRA+ on an nf4-quantized base (QLoRA)"},
    }
    train = {
        "steps": 1_000_000, "world_size": 1024, "zero_stage": 3, "precision": "bf16", "final_train_loss": 12.345678,
        "val_loss": 12.345678, "tokens_per_s": 1_234_567.89, "train_seconds": 1_234_567.8, "peak_memory_mb": 1e6,
        "reused_checkpoint": "step_001000000",
    }  # fmt: skip
    merge = {"max_abs_logit_diff": 0.00390625, "limit_abs": 0.00390625, "mean_kl": 1.234e-7, "limit_kl": 0.0000123,
             "tokens": 123_456_789}  # fmt: skip
    lines = [*evaluation_table(evaluation), *training_summary(train), *merge_proof(merge)]
    assert len(lines) > 10
    too_wide = [line for line in lines if len(line) > WIDTH]
    assert not too_wide, too_wide
