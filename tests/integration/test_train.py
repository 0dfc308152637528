"""The train stage with real DeepSpeed ranks over gloo on a tiny random LLaMA whose vocabulary was extended."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.core import config
from pipeline.core.atomic import read_json
from pipeline.core.environment import free_port
from pipeline.data.tokenizer import META
from pipeline.kernels.cpu_paths import describe
from tests.conftest import REPO
from tests.helpers.training import (
    ONE_RANK,
    TINY,
    TWO_RANKS,
    assert_same_training,
    env,
    killed_after_a_checkpoint,
    losses,
    train,
    train_command,
)

pytestmark = pytest.mark.integration


def test_reference_trains_the_adapter_and_the_resized_embeddings(reference, inputs):
    state = load_file(reference / "final.safetensors")
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b), "LoRA B left at its zero init"
    embeddings = [v for k, v in state.items() if "embed_tokens" in k and "modules_to_save" in k]
    assert embeddings and embeddings[0].shape[0] == read_json(inputs / "tokenizer" / META)["padded_vocab_size"]
    metrics = read_json(reference / "metrics.json")
    assert metrics["steps"] == 6 and metrics["world_size"] == 1
    assert metrics["val_perplexity"] > 1 and metrics["tokens_per_s"] > 0
    assert metrics["steady_tokens_per_s"] > 0  # without the first step's warm-up
    curve = losses(reference)
    assert len(curve) == 6 and curve[-1] < curve[0], curve
    checkpoint = reference / "checkpoints"
    tag = (checkpoint / "latest").read_text()
    assert tag == "step_000006"
    for name in ("adapter_config.json", "tokenizer.json", "trainer_state.json", "rng_state_rank0.pt"):
        assert (checkpoint / tag / name).is_file(), name
    adapter_config = read_json(checkpoint / tag / "adapter_config.json")
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{reference}/mlruns.db")
    run = client.get_run(read_json(reference / "run_id.json")["run_id"])
    assert run.data.params["lora.r"] == "4" and run.data.tags["world_size"] == "1"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4, 5, 6]
    assert adapter_config["r"] == 4 and "embed_tokens" in adapter_config["modules_to_save"]  # lm_head is tied to it


def test_two_ranks_equal_one_rank_zero2(two_ranks_zero2, reference):
    assert_same_training(two_ranks_zero2, reference, atol=1e-5)
    assert (two_ranks_zero2 / "checkpoints" / "latest").read_text() == "step_000006"
    assert len(list((two_ranks_zero2 / "checkpoints").glob("step_*"))) == 2, "keep_last=2"


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, inputs, tiny_base_dir):
    """2 ranks with activation checkpointing (`train.gradient_checkpointing=true`, which trains as the run without
    it: `test_activation_checkpointing_trains_as_without_it`), trained once for each ZeRO stage and kernel switch
    asked for, and shared by the tests that prove things of such a run: `checkpointed(zero, kernels)` is its
    folder."""
    runs: dict[tuple[str, str], Path] = {}

    def run(zero: str, kernels: str) -> Path:
        if (zero, kernels) not in runs:
            out = tmp_path_factory.mktemp(f"checkpointed_{zero}_{kernels}")
            overrides = [*TINY, *TWO_RANKS, f"deepspeed={zero}", f"train.kernels={kernels}"]
            train(inputs, tiny_base_dir, out, [*overrides, "train.gradient_checkpointing=true"])
            runs[zero, kernels] = out
        return runs[zero, kernels]

    return run


def test_kernels_off_trains_as_auto_with_stock_layers(checkpointed, two_ranks_zero2):
    """`train.kernels=off` runs stock transformers + PEFT + DeepSpeed (no speed path installed, none imported) and
    trains what `auto` trains on 2 CPU ranks (ZeRO-2), within fp32 rounding; `auto` says what it installed. The `off`
    side is the activation-checkpointing run's (`checkpointed`)."""
    off_run = checkpointed("zero2", "off")
    assert_same_training(off_run, two_ranks_zero2, atol=1e-5)
    off, auto = read_json(off_run / "metrics.json"), read_json(two_ranks_zero2 / "metrics.json")
    assert off["kernels"] == {}
    paths = {
        "lean_layers",
        "fused_loss",
        "lora_linear",
        "linear",
        "attention",
        "allocator",
        "zero_tail",
        "zero3_lists",
        "zero3_fetch",
        "zero3_release",
        "zero3_flags",
    }
    assert auto["kernels"].keys() == paths
    assert auto["kernels"]["fused_loss"] == auto["kernels"]["attention"] == auto["kernels"]["allocator"] == 1
    assert auto["kernels"]["zero_tail"] == 1, "ZeRO-2's step tail fused (DeepSpeed's own under kernels=off)"
    assert {auto["kernels"][name] for name in ("zero3_lists", "zero3_fetch", "zero3_release", "zero3_flags")} == {0}
    assert auto["kernels"]["lora_linear"] > 0
    # the ranks ran on this process's CPU paths (forced ones included) and say so; with `off`, no C++ kernels
    assert auto["cpu_paths"] == describe(kernels=True)
    assert off["cpu_paths"] == {**describe(kernels=True), "kernels": "off"}


@pytest.mark.parametrize("zero", ["zero0", "zero1"])
def test_zero0_and_zero1_train_in_bf16(tmp_path, inputs, tiny_base_dir, reference, zero):
    train(inputs, tiny_base_dir, tmp_path, [*TINY, *TWO_RANKS, f"deepspeed={zero}", "train.precision=bf16"])
    torch.testing.assert_close(torch.tensor(losses(tmp_path)), torch.tensor(losses(reference)), atol=0.05, rtol=0)
    assert (tmp_path / "checkpoints" / "step_000006" / "adapter_config.json").is_file()


@pytest.mark.parametrize("zero", ["zero2_offload", "zero3_offload"])
def test_offload_variants_match_one_rank(tmp_path, inputs, tiny_base_dir, reference, zero):
    train(inputs, tiny_base_dir, tmp_path, [*TINY, *TWO_RANKS, f"deepspeed={zero}"])
    assert_same_training(tmp_path, reference, atol=1e-5)


def test_sigkill_then_rerun_equals_uninterrupted(tmp_path, inputs, tiny_base_dir):
    """With LoRA dropout on, so that the RNG state and the train/eval mode must be restored too; and DoRA with
    LoRA+ on all-linear targets, so that the stage builds them and a resume restores magnitudes and the groups."""
    variants = ["lora.use_dora=true", "lora.lr_ratio=4.0", "lora.target_modules=all-linear"]
    overrides = [*TINY, *TWO_RANKS, "deepspeed=zero2", "lora.dropout=0.1", *variants]
    whole = tmp_path / "whole"
    train(inputs, tiny_base_dir, whole, overrides)
    out = tmp_path / "killed"
    first = killed_after_a_checkpoint(inputs, tiny_base_dir, out, overrides)
    assert first in ("step_000003", "step_000006")
    rerun = train(inputs, tiny_base_dir, out, overrides)
    assert f"resuming from {out / 'checkpoints' / first}" in rerun.stdout
    metrics = read_json(out / "metrics.json")
    assert metrics["resumed_from_step"] == int(first.removeprefix("step_"))
    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(whole)), atol=1e-6, rtol=0)
    expected, resumed = load_file(whole / "final.safetensors"), load_file(out / "final.safetensors")
    assert sum("lora_magnitude_vector" in name for name in expected) == 14
    run = read_json(out / "checkpoints" / "plan.json")["run_state"]
    trained = {"use_dora": True, "lr_ratio": 4.0, "quantization": "none", "compute_dtype": None, "load_dtype": "fp32"}
    assert run["variant"] == trained and len(run["identity"]["target_modules"]) == 14
    for name in expected:
        torch.testing.assert_close(resumed[name], expected[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.needs(None if importlib.util.find_spec("bitsandbytes") else "bitsandbytes is missing (make setup)")
def test_qlora_through_the_train_stage_consolidate_and_merge(tmp_path, inputs, tiny_base_dir):
    """The train stage on an nf4 base, 2 ranks under ZeRO-3 in bf16, DoRA with LoRA+ on all-linear; consolidated,
    merged into the unquantized base within the fp32 proof, and its gap to the nf4 base it trained on measured."""
    from pipeline.checkpoints.consolidate import consolidate
    from pipeline.merge.fold import merge

    variants = ["lora.quantization=nf4", "lora.use_dora=true", "lora.lr_ratio=16", "lora.target_modules=all-linear"]
    done = train(
        inputs, tiny_base_dir, tmp_path, [*TINY, *TWO_RANKS, "deepspeed=zero3", "train.precision=bf16", *variants]
    )
    assert "train: the base is loaded in nf4 by bitsandbytes" in done.stdout
    curve = losses(tmp_path)
    assert curve[-1] < curve[0], curve
    manifest = consolidate(checkpoint_dir=tmp_path / "checkpoints", output_dir=tmp_path / "adapter")
    trained = {"use_dora": True, "lr_ratio": 16.0, "quantization": "nf4", "compute_dtype": "bf16", "load_dtype": "bf16"}
    assert manifest["variant"] == trained
    assert sum(key.endswith(".lora_magnitude_vector") for key in manifest["tensors"]) == 14
    report = merge(base_dir=tiny_base_dir, adapter_dir=tmp_path / "adapter", out_dir=tmp_path / "merged")
    assert report["variant"] == "DoRA + LoRA+ x16 on an nf4 base (bf16 compute)"
    assert report["verification"]["max_abs_logit_diff"] < report["verification"]["limit_abs"]
    assert report["against_trained_base"]["quantization"] == "nf4" and report["against_trained_base"]["mean_kl"] > 0


def test_manual_nodes_join_node_0_s_launch(tmp_path, inputs, tiny_base_dir, reference):
    """launcher=manual: node 0 runs the train stage, node 1 only `pipeline.launching.manual_node` (as a scheduler
    would start it, before node 0); one world of two ranks trains what one rank trains, checkpoints in the one shared
    folder."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    overrides = [*TINY, "launcher=manual", f"launcher.hostfile={hostfile}", f"launcher.master_port={free_port()}",
                 "train.gradient_accumulation_steps=2"]  # fmt: skip
    join = [sys.executable, "-m", "pipeline.launching.manual_node", "--checkpoints", str(tmp_path / "checkpoints"),
            "--node-rank", "1", "--timeout", "300"]  # fmt: skip
    node1 = subprocess.Popen(join, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    node0 = train(inputs, tiny_base_dir, tmp_path, overrides, check=False)
    output1 = node1.communicate(timeout=300)[0]
    assert (node0.returncode, node1.returncode) == (0, 0), node0.stdout[-2000:] + node0.stderr[-2000:] + output1[-2000:]
    assert read_json(tmp_path / "checkpoints" / "plan.json")["launch"]["world_size"] == 2
    assert not (tmp_path / "checkpoints" / "launch.json").exists()
    assert_same_training(tmp_path, reference, atol=1e-5)


JOIN_TIMEOUT_S = 5
# The whole stage, from its start to its refusal: JOIN_TIMEOUT_S plus starting the stage and its ranks (imports, the
# pre-flight: about 30 s on an idle 2-core machine), with room for a loaded one. A timeout not honoured (torch's own
# 30 minutes, or ours multiplied) ends past it: the stage is then killed at the bound and the test fails.
JOIN_WALL_BOUND_S = 150


def test_a_node_that_never_joins_is_named_within_the_join_timeout(tmp_path, inputs, tiny_base_dir):
    """launcher=manual with node 1 never started: node 0's ranks give up after launcher.join_timeout_s, naming the
    node, instead of waiting for torch's 30 minutes."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    overrides = [*TINY, "launcher=manual", f"launcher.hostfile={hostfile}", f"launcher.master_port={free_port()}",
                 f"launcher.join_timeout_s={JOIN_TIMEOUT_S}", "train.gradient_accumulation_steps=2"]  # fmt: skip
    stage = subprocess.Popen(
        train_command(inputs, tiny_base_dir, tmp_path, overrides), cwd=REPO, env=env(), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    started = time.monotonic()
    try:
        output = stage.communicate(timeout=JOIN_WALL_BOUND_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(stage.pid, signal.SIGKILL)
        output = stage.communicate()[0]
        pytest.fail(f"still waiting for node 1 after {JOIN_WALL_BOUND_S} s: {output[-2000:]}")
    elapsed = time.monotonic() - started
    assert stage.returncode != 0
    assert "node 1 (127.0.0.1, rank 1) did not join the rendezvous at" in output and "within 5 s" in output, output
    assert "Traceback" not in output
    assert JOIN_TIMEOUT_S <= elapsed < JOIN_WALL_BOUND_S, elapsed


class NoRanks:
    """What `ranks.start_ranks` gives a train stage called in-process: the ranks it would start ahead of its checks
    are not started (what started ones do when cancelled or released: unit/launching/test_ranks.py); it records
    what the stage did with them. Released, they fail the launch."""

    def __init__(self) -> None:
        self.released = self.cancelled = False

    def release(self, message: dict) -> None:
        self.released = True

    def cancel(self) -> None:
        self.cancelled = True

    def wait(self) -> int:
        return 1


def in_process(out: Path, inputs: Path, base: Path, overrides: list[str], monkeypatch, final_state=True) -> list:
    """The train stage's `main` in this process, as its entry point calls it, its ranks left unstarted (`NoRanks`):
    the stage's checks, plan and reports without a launch. Returns the NoRanks it got; the
    stage's exceptions propagate. bitsandbytes and scipy stay importable in this worker (`imports.without_unused`)."""
    from pipeline.core import imports
    from pipeline.launching import ranks
    from stages import train as train_stage

    started: list[NoRanks] = []
    monkeypatch.setattr(ranks, "start_ranks", lambda **kwargs: started.append(NoRanks()) or started[-1])
    monkeypatch.setattr(imports, "without_unused", lambda: None)
    command = train_command(inputs, base, out, overrides)
    flags = {a.removeprefix("--").replace("-", "_"): v for a, v in zip(command[3::2], command[4::2], strict=True)}
    if not final_state:
        del flags["final_state"]
    args = argparse.Namespace(**{k: v if k == "params" else Path(v) for k, v in flags.items()})
    train_stage.main(args, config.load(args.params))
    return started


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.global_batch_size=6"], "train.global_batch_size: 6 != train.micro_batch_size (1) x "
         "train.gradient_accumulation_steps (2) x world size (2) = 4"),
        (["lora.target_modules=[q_proj,vproj]"], "lora.target_modules: ['vproj'] match no Linear layer; available: "),
        (["train.resize_embeddings=false"], "train.resize_embeddings: false, but the tokenizer has"),
        (["lora.modules_to_save=[]"], "lora.modules_to_save: the vocabulary grows from 49152 to "),
        (["deepspeed.stage=5"], "deepspeed.stage: input should be 0, 1, 2 or 3, got 5"),
    ],
)  # fmt: skip
def test_bad_input_stops_before_any_step(tmp_path, inputs, tiny_base_dir, overrides, message, monkeypatch):
    """In-process (the checks run before the launcher, the ranks started ahead are never released); the CLI path is
    covered by the next two tests."""
    started: list[NoRanks] = []
    with pytest.raises(ValueError) as err:
        started = in_process(tmp_path, inputs, tiny_base_dir, [*TINY, *TWO_RANKS, *overrides], monkeypatch)
    assert message in str(err.value)
    assert not (tmp_path / "checkpoints").exists()
    assert not any(ranks.released for ranks in started)


def test_a_precision_the_cpu_cannot_train_in_is_refused(tmp_path, inputs, tiny_base_dir, monkeypatch):
    """fp16 on a CPU without AVX512-FP16 (oneDNN's path capped below it, so on every CPU: one with it, such as a
    Sapphire Rapids Xeon, trains in fp16)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    done = train(inputs, tiny_base_dir, tmp_path, [*TINY, *TWO_RANKS, "train.precision=fp16"], check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "train.precision: fp16 is not supported on cpu; expected one of ['bf16', 'fp32']" in done.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_batch_arithmetic_error_exits_2_without_traceback(tmp_path, inputs, tiny_base_dir):
    done = train(inputs, tiny_base_dir, tmp_path, [*TINY, *TWO_RANKS, "train.global_batch_size=6"], check=False)
    assert done.returncode == 2, done.stderr
    assert "error: train.global_batch_size: 6 != " in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lora.r=8", "is a checkpoint of another model (lora_r: checkpoint 4, this run 8)"),
        ("lora.use_dora=true", "is a checkpoint of another model (use_dora: checkpoint False, this run True)"),
        ("lora.lr_ratio=16", "was trained with lr_ratio None, this run has 16.0; its optimizer groups"),
    ],
)
def test_resume_from_another_model_is_refused(
    tmp_path, inputs, tiny_base_dir, reference, override, message, monkeypatch
):
    """In-process, as the bad input above (the same refusal through the CLI, exit 2:
    integration/test_layouts.py)."""
    overrides = [*TINY, *ONE_RANK, "deepspeed=zero2", override, f"train.resume_from={reference / 'checkpoints'}"]
    before = sorted(p.name for p in (reference / "checkpoints").iterdir())
    started: list[NoRanks] = []
    with pytest.raises(ValueError) as err:
        started = in_process(tmp_path, inputs, tiny_base_dir, overrides, monkeypatch)
    assert message in str(err.value)
    assert not any(ranks.released for ranks in started)
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == before


def test_a_finished_run_rerun_reports_the_figures_of_the_run_that_trained_it(
    tmp_path, inputs, tiny_base_dir, two_ranks_zero2, monkeypatch, capfd
):
    """`dvc repro` re-runs train after a launcher change: no rank is released, and metrics.json keeps the training
    run's measurements (not an idle process's), marked with the checkpoint they come from."""
    shutil.copytree(two_ranks_zero2 / "checkpoints", tmp_path / "checkpoints")
    overrides = [*TINY, *ONE_RANK, "deepspeed=zero2"]
    (started,) = in_process(tmp_path, inputs, tiny_base_dir, overrides, monkeypatch, final_state=False)
    assert "is this run's final checkpoint; its figures are reported" in capfd.readouterr().out
    assert started.cancelled and not started.released, "no rank was released"
    trained, reported = read_json(two_ranks_zero2 / "metrics.json"), read_json(tmp_path / "metrics.json")
    assert reported == {**trained, "reused_checkpoint": "step_000006"}
    assert (tmp_path / "curve.csv").read_text() == (two_ranks_zero2 / "curve.csv").read_text()


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tiny_base_dir, peoples_daily) -> tuple[Path, Path, int]:
    """A random LLaMA of 132 M parameters (530 MB in fp32: far more than the runtime), the base tokenizer, and
    packed 64-token blocks: (base, inputs, the model's bytes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.data.tokenizer import load_tokenizer
    from tests.helpers.datasets import build_pretraining, save_splits

    root = tmp_path_factory.mktemp("wide")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=768, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=12,
        num_key_value_heads=12, tie_word_embeddings=False, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(root / "base")
    size = sum(p.numel() * 4 for p in model.parameters())
    del model
    tokenizer = load_tokenizer(tiny_base_dir)
    tokenizer.save_pretrained(root / "inputs" / "tokenizer")
    (root / "inputs" / "tokenizer" / META).write_text(json.dumps({"vocab_size": 49152, "padded_vocab_size": 49152}))
    tables, _ = build_pretraining(
        tokenizer, peoples_daily[:200], block_size=64, tail="drop", validation_fraction=0.1, seed=0
    )
    save_splits(root / "inputs" / "dataset", tables)
    return root / "base", root / "inputs", size


def test_zero3_ranks_never_hold_the_whole_model(tmp_path, wide_model):
    """Under ZeRO-3 each rank builds the model partitioned and reads only its slice of every tensor: right after
    loading, every large parameter is partitioned, and what loading added to a rank's memory is about half the
    model (2 ranks), well below the whole model the old path loaded into every rank."""
    base, inputs, size = wide_model
    small = [
        "train.max_steps=1", "train.warmup_steps=0", "train.save_every=1", "train.eval_every=1",
        "train.eval_max_rows=2", "lora.modules_to_save=[]",
    ]  # fmt: skip
    train(inputs, base, tmp_path, [*TINY, *TWO_RANKS, "deepspeed=zero3", *small])
    metrics = read_json(tmp_path / "metrics.json")
    assert metrics["zero3_partitioned_parameters"] == metrics["zero3_large_parameters"] >= 6 * 7 + 2
    added = [(peak - before) * 2**20 for peak, before in zip(
        metrics["load_peak_mb_per_rank"], metrics["load_before_mb_per_rank"], strict=True)]  # fmt: skip
    assert all(0 < mb < 0.7 * size for mb in added), (added, size)


@pytest.mark.parametrize("kernels", ["auto", "off"])
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_activation_checkpointing_trains_as_without_it(checkpointed, reference, zero, kernels):
    """Non-reentrant activation checkpointing (the default on GPUs) under ZeRO-2 and ZeRO-3, with our kernels and
    without: the same losses and tensors as the one-rank run without it, within fp32 rounding. So 2 ranks under
    ZeRO-3 train what 1 rank trains (ZeRO-0 and 1: `test_zero0_and_zero1_train_in_bf16`, ZeRO-2: the session's
    run, with offload: `test_offload_variants_match_one_rank`)."""
    run = checkpointed(zero, kernels)
    assert read_json(run / "checkpoints" / "plan.json")["launch"]["gradient_checkpointing"] is True
    assert read_json(run / "metrics.json")["checkpointed_layers"] == 2  # the tiny model's decoder layers
    installed = read_json(run / "metrics.json")["kernels"]
    if kernels == "auto":  # under ZeRO-3 the LoRA kernel inside the layers gathered whole, the parameter lists kept
        zero3 = {installed[name] for name in ("zero3_lists", "zero3_fetch", "zero3_release", "zero3_flags")}
        assert installed["lora_linear"] > 0 and zero3 == {zero == "zero3"}
    assert read_json(reference / "metrics.json")["checkpointed_layers"] == 0
    assert_same_training(run, reference, atol=1e-5)


def test_the_fused_loss_under_zero3_gathers_a_frozen_head(tmp_path, inputs, tiny_base_dir, peoples_daily):
    """ZeRO-3 partitions the output head; the fused loss gathers it for each micro-batch (its module is never
    called) and trains what transformers' loss trains under ZeRO-2 with the kernels off, within fp32 rounding."""
    from pipeline.data.tokenizer import META, load_tokenizer
    from tests.helpers.datasets import build_pretraining, save_splits

    own = tmp_path / "inputs"  # the base's own tokenizer: the embeddings keep their rows and stay frozen
    shutil.copytree(tiny_base_dir, own / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    tokenizer = load_tokenizer(own / "tokenizer")
    meta = {"vocab_size": len(tokenizer), "padded_vocab_size": len(tokenizer)}
    (own / "tokenizer" / META).write_text(json.dumps(meta))
    tables, _ = build_pretraining(
        tokenizer, peoples_daily[:120], block_size=64, tail="drop", validation_fraction=0.1, seed=0
    )
    save_splits(own / "dataset", tables)
    frozen = [*TINY, *TWO_RANKS, "lora.modules_to_save=[]", "train.resize_embeddings=false"]
    train(own, tiny_base_dir, tmp_path / "fused", [*frozen, "deepspeed=zero3"])
    train(own, tiny_base_dir, tmp_path / "stock", [*frozen, "deepspeed=zero2", "train.kernels=off"])
    assert read_json(tmp_path / "fused" / "metrics.json")["kernels"]["fused_loss"] == 1
    assert_same_training(tmp_path / "fused", tmp_path / "stock", atol=1e-5)


def test_eager_attention_trains_as_sdpa(tmp_path, inputs, tiny_base_dir, reference):
    """train.attention reaches the rank's model: eager attention (transformers' own, so not our CPU attention
    kernel) gives the SDPA reference's losses and tensors within fp32 rounding, on one rank as the reference (the
    ranks do not meet inside attention; 2 ranks equal 1 rank: above)."""
    train(inputs, tiny_base_dir, tmp_path, [*TINY, *ONE_RANK, "deepspeed=zero2", "train.attention=eager"])
    assert read_json(tmp_path / "checkpoints" / "plan.json")["launch"]["attention"] == "eager"
    assert read_json(tmp_path / "metrics.json")["kernels"]["attention"] == 0
    assert read_json(reference / "metrics.json")["kernels"]["attention"] == 1
    assert_same_training(tmp_path, reference, atol=1e-5)
