"""The launch settings made concrete for the machine: a global batch that follows the world unless it is stated, the
node's cores shared among its ranks, flash attention only where it can run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO


def test_an_auto_global_batch_grows_with_the_world_and_a_stated_one_is_checked():
    from pipeline.core import config
    from pipeline.launching.settings import resolve_launch

    def launch(world: int, *overrides: str):
        cfg = config.Config(**config.compose(REPO / "conf", [f"launcher.ranks_per_node={world}", *overrides]))
        return resolve_launch(train=cfg.train, launcher=cfg.launcher)

    for world in (1, 2, 8, 16):  # the default: one row per rank and step
        got = launch(world, "launcher.accelerator=cpu")
        assert (got.global_batch_size, got.gradient_accumulation_steps) == (world, 1)
    got = launch(8, "launcher.accelerator=cpu", "train.gradient_accumulation_steps=4", "train.micro_batch_size=2")
    assert (got.global_batch_size, got.gradient_accumulation_steps) == (64, 4)
    got = launch(8, "launcher.accelerator=cpu", "train.global_batch_size=32")
    assert (got.global_batch_size, got.gradient_accumulation_steps) == (32, 4)
    with pytest.raises(ValueError, match=r"train.global_batch_size: 2 is not a multiple of .* world size \(8\)"):
        launch(8, "launcher.accelerator=cpu", "train.global_batch_size=2")


def test_ranks_share_the_node_s_cores_on_every_accelerator(monkeypatch):
    import os

    from pipeline.launching.ranks import rank_environment

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for accelerator, ranks in (("cpu", 2), ("cuda", 8), ("cuda", 1)):
        env = rank_environment(accelerator=accelerator, ranks_per_node=ranks, kernels="auto", keep_bitsandbytes=False)
        assert env["OMP_NUM_THREADS"] == str(max(1, cores // ranks)) and env["DS_ACCELERATOR"] == accelerator
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice is kept
    assert (
        rank_environment(accelerator="cuda", ranks_per_node=8, kernels="auto", keep_bitsandbytes=False)[
            "OMP_NUM_THREADS"
        ]
        == "3"
    )


def test_attention_is_flash_where_it_can_run_and_a_choice_that_cannot_is_named():
    from pipeline.core import config
    from pipeline.launching.settings import FLASH, attention_implementation, resolve_launch, supported_attention

    def choose(requested: str, accelerator="cuda", precision="bf16", installed=True, model="llama") -> str:
        supported = supported_attention({"model_type": model})
        return attention_implementation(
            requested, accelerator=accelerator, precision=precision, flash_installed=installed, supported=supported
        )

    assert choose("auto") == FLASH
    assert choose("auto", installed=False) == choose("auto", precision="fp32") == choose("auto", "cpu") == "sdpa"
    assert choose("eager", "cpu") == "eager" and choose("sdpa") == "sdpa"
    for where, missing in (
        ({"accelerator": "cpu"}, "a CUDA accelerator"),
        ({"precision": "fp32"}, r"bf16 or fp16 \(train.precision is fp32\)"),
        ({"installed": False}, r"the flash-attn package \(pip install flash-attn\)"),
    ):
        with pytest.raises(ValueError, match=rf"train.attention: flash_attention_2 needs {missing}"):
            choose(FLASH, **where)
    cfg = config.Config(**config.compose(REPO / "conf", ["launcher.accelerator=cpu", "train.attention=eager"]))
    assert resolve_launch(train=cfg.train, launcher=cfg.launcher).attention == "eager"


def test_attention_is_the_best_the_architecture_supports():
    """Gemma 2 has no SDPA (soft-capped scores): auto is flash-attention where it runs, else eager; sdpa named for it
    is refused, naming the key. The flags are transformers' own, read for the model's class."""
    from transformers import Gemma2ForCausalLM, LlamaForCausalLM

    from pipeline.launching.settings import FLASH, attention_implementation, supported_attention

    gemma2, llama = supported_attention({"model_type": "gemma2"}), supported_attention({"model_type": "llama"})
    assert (FLASH in gemma2, "sdpa" in gemma2) == (Gemma2ForCausalLM._supports_flash_attn, False)
    assert llama == {"eager", "sdpa", FLASH} == supported_attention({"model_type": "not-in-transformers"})
    assert LlamaForCausalLM._supports_sdpa
    on = {"accelerator": "cpu", "precision": "fp32", "flash_installed": False}
    assert attention_implementation("auto", **on, supported=gemma2) == "eager"
    gpu = {"accelerator": "cuda", "precision": "bf16", "flash_installed": True}
    assert attention_implementation("auto", **gpu, supported=gemma2) == FLASH
    with pytest.raises(ValueError, match="train.attention: the model does not support sdpa"):
        attention_implementation("sdpa", **on, supported=gemma2)


def test_the_ranks_take_the_best_implementation_the_model_class_has():
    """The train stage imports no model code: the ranks apply the class's flags to the stage's choice."""
    from transformers import Gemma2ForCausalLM, LlamaForCausalLM

    from pipeline.launching.settings import FLASH
    from pipeline.model.lora import supported_by, usable_attention

    gemma2, llama = supported_by(Gemma2ForCausalLM), supported_by(LlamaForCausalLM)
    assert usable_attention("sdpa", gemma2) == "eager" and usable_attention(FLASH, gemma2) == FLASH
    assert usable_attention("sdpa", llama) == "sdpa" and usable_attention("eager", llama) == "eager"
    assert usable_attention(FLASH, frozenset({"eager", "sdpa"})) == "sdpa"


def test_the_precisions_known_without_deepspeed_are_deepspeed_s_own_answers():
    """check_precision skips DeepSpeed (and torch) for the pairs it knows; each is what DeepSpeed's accelerator of
    that kind answers (its CPU accelerator here; CUDA's fp32 is trained everywhere), so an upgrade that changes an
    answer fails here, not on a user's machine. fp16 on a CPU is still asked."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from pipeline.core.precision import DTYPES
    from pipeline.launching.settings import ALWAYS_SUPPORTED, PRECISIONS, check_precision

    trained = CPU_Accelerator().supported_dtypes()  # DeepSpeed's own list (fp16 only where oneDNN computes it)
    answers = {precision: DTYPES[precision] in trained for precision in PRECISIONS}
    assert all(answers[precision] for accelerator, precision in ALWAYS_SUPPORTED if accelerator == "cpu")
    assert ("cpu", "fp16") not in ALWAYS_SUPPORTED and ("cuda", "bf16") not in ALWAYS_SUPPORTED
    if not answers["fp16"]:
        with pytest.raises(ValueError, match=r"train.precision: fp16 is not supported on cpu"):
            check_precision("fp16", "cpu")


def test_the_check_stage_s_launch_settings_import_neither_torch_nor_deepspeed_on_a_machine_without_a_gpu():
    """On a machine with no GPU device file, `launcher.accelerator=auto` resolves to cpu and bf16 / fp32 are known:
    resolving the launch imports neither torch nor DeepSpeed (about 2 s and 200 MB of every check and train stage)."""
    import subprocess
    import sys

    from pipeline.launching.settings import GPU_DEVICE_FILES

    if any(Path(path).exists() for path in GPU_DEVICE_FILES):
        pytest.skip("a GPU's device file exists here: torch is asked, as it should be")
    code = (
        "import sys\n"
        "from pipeline.core import config\n"
        "from pipeline.launching.settings import resolve_launch\n"
        f"cfg = config.Config(**config.compose({str(REPO / 'conf')!r}, ['train.precision=PRECISION']))\n"
        "launch = resolve_launch(train=cfg.train, launcher=cfg.launcher)\n"
        "print(launch.accelerator, launch.precision, 'torch' in sys.modules, 'deepspeed' in sys.modules)\n"
    )
    for precision in ("auto", "fp32", "bf16"):
        done = subprocess.run(
            [sys.executable, "-c", code.replace("PRECISION", precision)],
            cwd=REPO, capture_output=True, text=True, check=True,
        )  # fmt: skip
        accelerator, chosen, torch_imported, deepspeed_imported = done.stdout.split()
        assert accelerator == "cpu" and chosen in ("bf16", "fp32"), done.stdout
        assert (torch_imported, deepspeed_imported) == ("False", "False"), done.stdout
