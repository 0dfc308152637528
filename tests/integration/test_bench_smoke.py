"""The benchmarks cannot rot: each one's --smoke mode runs its full code path (ours and the peer's side by side: the
LLaMA-Factory benchmarks build its environment where it is not built yet, once per machine) at a tiny size, on the
project the session's tiny pipeline left (tiny_pipeline, shared with the repro check), and writes its figures where
--results says, never into bench/results."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

import pytest

from bench.common import RESULTS, results_folder
from pipeline.core.environment import with_venv_path
from tests.conftest import REPO

pytestmark = pytest.mark.integration

PEER = [  # ours and LLaMA-Factory's (with and without activation checkpointing), and both comparisons
    "tokens", *(f"{side}_{key}" for side in ("ours", "llamafactory", "llamafactory_no_checkpointing")
                for key in ("tokens_per_s", "wall_s", "peak_mb_per_rank")),
    *(f"{comparison}.{key}" for comparison in ("equal_work", "defaults") for key in ("speedup", "memory_ratio")),
]  # fmt: skip
SIDES = ("reference_seconds", "ours_seconds", "reference_peak_memory_mb", "ours_peak_memory_mb")
POSITIVE = {  # bench: {results file: the figures that must be positive}
    "noop_repro": {"noop_repro": ["median_seconds"]},
    "train": {"train": [f"{kind}_fp32.{key}" for kind in ("text", "chat") for key in ("eager_tokens_per_s", *PEER)]},
    "preference": {"preference": [f"fp32.{key}" for key in PEER]},
    "consolidate": {"consolidate": list(SIDES)},
    "merge": {"merge": [*SIDES, "ours_verified_seconds"]},
    "evaluate": {"evaluate": [*SIDES, "reference_bits_per_byte", "ours_bits_per_byte", "tokens"]},
    "track": {"track": list(SIDES)},
    "convert": {"convert": [f"workers{n}_{key}" for n in (1, 2) for key in (*SIDES, "tensors_equal")]},
    "variants": {
        "variants": [
            f"{v}.{key}" for v in ("lora", "loraplus", "int8", "dora_nf4") for key in ("step_seconds", "peak_rss_mb")
        ],
        "variants_merge_gap": ["nf4.against_quantized_base.max_abs_logit_diff", "int8.against_quantized_base.mean_kl"],
    },
    "gpu_train": {  # on CPU ranks at smoke size: the previous path, the defaults, transformers + PEFT, DPO
        "gpu_train": [f"{v}.tokens_per_s" for v in ("previous", "default", "eager", "dpo")] + ["default.peak_memory_mb"]
    },
    "long_context": {
        "long_context": [f"{side}longest_trained.{n}" for side in ("", "peer_") for n in (1, 2)]
        + ["speedup_over_peer.256_sp1", "speedup_over_peer.256_sp2"],
        "long_context_gpu": ["longest_trained", "peer_longest_trained"],
    },
}


def figure(figures: dict, dotted: str) -> float:
    for key in dotted.split("."):
        figures = figures[key]
    return figures


@pytest.fixture(scope="module")
def project(tiny_pipeline):
    """The tiny pipeline's first project (read only here: noop_repro repros in a copy of it)."""
    return tiny_pipeline.roots[0]


@pytest.mark.parametrize("bench", list(POSITIVE))
def test_smoke_runs_both_sides(bench, project, tmp_path):
    started = time.time()
    command = [sys.executable, "-m", f"bench.{bench}", "--smoke", "--results", str(tmp_path), "--project", str(project)]
    done = subprocess.run(command, cwd=REPO, env=with_venv_path(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name, keys in POSITIVE[bench].items():
        figures = json.loads((tmp_path / f"{name}.json").read_text())
        assert figures["smoke"] is True
        for key in keys:  # a side that failed: its runs (with the output's tail) in the message
            value = figure(figures, key)
            assert value is not None and value > 0, f"{name}.json: {key} = {value}\n{json.dumps(figures, indent=1)}"
        recorded = REPO / RESULTS / f"{name}.json"
        assert not recorded.exists() or recorded.stat().st_mtime < started, f"the smoke run wrote {recorded}"
    if bench == "evaluate":  # the same definitions on both sides: the same figure
        assert figures["ours_bits_per_byte"] == pytest.approx(figures["reference_bits_per_byte"], abs=1e-3)
    if bench in ("train", "preference"):  # every run of every side trained the same tokens (the bench stops if not)
        for compared in (figures[k] for k in ("text_fp32", "chat_fp32", "fp32") if k in figures):
            runs = [run for side in compared["runs"].values() for run in side]
            assert len(runs) == 3 and {run["tokens"] for run in runs} == {compared["tokens"]}, compared["runs"]
    if bench == "long_context":  # the same model on both sides: the same first loss
        cpu = json.loads((tmp_path / "long_context.json").read_text())
        for ours, peer in zip(cpu["runs"], cpu["peer_runs"], strict=True):
            assert ours["first_loss"] == pytest.approx(peer["first_loss"], rel=1e-4), (ours, peer)
    if bench == "train":  # the same dialogues, token for token, in the same order
        assert figures["same_chat_tokens"]["rows"] == 3 * 2 and figures["same_chat_tokens"]["tokens"] > 0
    if bench == "preference":  # DPO starts at log 2 (B = 0); against LLaMA-Factory: the same tokens and losses
        fp32 = figures["fp32"]
        assert figures["same_tokens"]["equal"] and figures["same_tokens"]["pairs"] == 3 * 2, figures["same_tokens"]
        assert fp32["ours_first_losses"][0] == pytest.approx(math.log(2), abs=1e-4)
        for side in ("llamafactory", "llamafactory_no_checkpointing"):
            assert len(fp32[f"{side}_first_losses"]) == len(fp32["ours_first_losses"]) == 3
            assert fp32[f"{side}_first_losses"] == pytest.approx(fp32["ours_first_losses"], abs=1e-3)


def test_a_smoke_run_never_overwrites_the_recorded_figures():
    with pytest.raises(SystemExit, match="recorded full-size figures"):
        results_folder(argparse.Namespace(smoke=True, results=RESULTS, project=None))


def test_the_gpu_check_runs_its_chain_on_cpu(project, tmp_path):
    """make gpu-check's smoke mode: the same chain on CPU at a tiny size (the GPU machine runs it with CUDA)."""
    command = [sys.executable, "-m", "bench.gpu_check", "--smoke", "--results", str(tmp_path)]
    command += ["--project", str(project)]
    done = subprocess.run(command, cwd=REPO, env=with_venv_path(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = figures["steps"]
    assert all(step["ok"] or "skipped" in step for step in steps.values()), steps
    ran = {name for name, s in steps.items() if s["ok"]}
    assert {"train_zero2", "train_zero3", "merge", "evaluate", "train_dpo_zero2", "train_dpo_from_adapter_zero3"} <= ran
    assert steps["train_dpo_zero2"]["first_loss"] == pytest.approx(0.693147, abs=1e-5)  # log 2: B = 0 at step 1
    assert steps["train_dpo_from_adapter_zero3"]["first_loss"] == pytest.approx(0.693147, abs=1e-5)  # policy = ref
    for zero in (2, 3):  # the consolidated adapter is the live engine's tensors, exactly
        assert steps[f"consolidate_zero{zero}"]["max_abs_diff_vs_live"] == 0.0
        assert steps[f"train_zero{zero}"]["checkpointed_layers"] > 0
    assert steps["merge"]["max_abs_logit_diff"] <= steps["merge"]["limit_abs"]
    assert figures["zero2_vs_zero3_max_abs_diff"] < 0.01
    eval_in_domain = steps["evaluate"]["eval"]["in_domain"]
    assert eval_in_domain["merged"]["bits_per_byte"] == pytest.approx(eval_in_domain["adapter"]["bits_per_byte"])
