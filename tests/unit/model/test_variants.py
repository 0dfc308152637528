"""LoRA variants without a launch: LoRA+'s groups under the train stage's schedule, all-linear resolved, the
bitsandbytes base exactly as the merge measures it, and a missing bitsandbytes refused by name."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from pipeline.model import outline
from pipeline.model.lora import (
    LoraSpec,
    check_targets,
    describe_targets,
    load_lora_model,
    parameter_groups,
    resolve_targets,
)
from pipeline.training.schedule import Schedule, lr_scheduler_factory
from tests.conftest import REPO

BNB = importlib.util.find_spec("bitsandbytes") is not None
ROWS = 49152  # the tiny base's vocabulary
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _spec(**changes) -> LoraSpec:
    settings = {"r": 4, "alpha": 8, "dropout": 0.0, "use_rslora": False, "target_modules": LINEAR}
    return LoraSpec(**{**settings, "modules_to_save": [], **changes})


def test_loraplus_gives_b_and_magnitudes_their_rate_through_the_schedule(tiny_base_dir):
    """Every lora_B and DoRA magnitude learns at lr x lr_ratio, every lora_A at lr, and the stage's LambdaLR keeps
    the ratio through warmup and decay (it scales each group's own initial rate)."""
    model = load_lora_model(base_dir=tiny_base_dir, vocab_rows=ROWS, lora=_spec(use_dora=True), seed=0)
    groups = parameter_groups(model, 0.01, lr=1e-3, lr_ratio=16.0)
    rate = {id(p): g["lr"] for g in groups for p in g["params"]}
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(rate) == len(trained)
    for name, param in trained.items():
        fast = "lora_B" in name or "lora_magnitude_vector" in name
        assert rate[id(param)] == pytest.approx(1.6e-2 if fast else 1e-3), name
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    schedule = Schedule(
        micro_batch_size=1, accumulation=1, max_steps=10, warmup_steps=3, lr_scheduler="cosine", eval_every=10,
        eval_max_rows=0, save_every=10, keep_last=1, seed=0,
    )  # fmt: skip
    scheduler = lr_scheduler_factory(schedule)(optimizer)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        lrs = sorted({round(g["lr"], 12) for g in optimizer.param_groups})
        assert len(lrs) == 2 and lrs[1] == pytest.approx(16 * lrs[0]), lrs
    assert all("lr" not in g for g in parameter_groups(model, 0.01))  # off: DeepSpeed's configured rate applies


def test_all_linear_is_every_linear_but_the_head(tiny_base_dir):
    meta = outline.read(tiny_base_dir)
    targets = resolve_targets(meta, "all-linear")
    assert len(targets) == 14 and not any("lm_head" in t for t in targets)
    assert describe_targets(targets) == ", ".join(f"{leaf} x2" for leaf in sorted(LINEAR))
    assert resolve_targets(meta, ["q_proj"]) == ["q_proj"]
    check_targets(meta, targets, [])  # the resolved paths are what the ranks are given
    with pytest.raises(ValueError, match=r"lora.target_modules: \['model.layers.9.mlp.up_proj'\] match no Linear"):
        check_targets(meta, ["model.layers.9.mlp.up_proj"], [])


def test_missing_bitsandbytes_is_refused_by_key(monkeypatch):
    from pipeline.model.quantization import check_available

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as when it is not installed
    with pytest.raises(ValueError, match=r"lora.quantization: nf4 needs bitsandbytes"):
        check_available("nf4", "cpu")


@pytest.mark.needs(None if BNB else "bitsandbytes is not installed here (make setup installs it)")
def test_bitsandbytes_that_cannot_quantize_here_is_refused_by_key(monkeypatch):
    """As on a machine without a backend for it: bitsandbytes imports, its round trip raises."""
    import bitsandbytes.functional

    from pipeline.model.quantization import check_available

    def no_backend(*args, **kwargs):
        raise NotImplementedError("no kernel for this device")

    monkeypatch.setattr(bitsandbytes.functional, "quantize_4bit", no_backend)
    with pytest.raises(ValueError, match=r"lora.quantization: bitsandbytes .* cannot quantize to nf4 on cpu here"):
        check_available("nf4", "cpu")


@pytest.mark.slow
@pytest.mark.needs(None if BNB else "bitsandbytes is not installed here (make setup installs it)")
def test_the_gpu_probe_runs_apart_and_leaves_the_launching_process_clean():
    """On a GPU the train stage probes bitsandbytes in a child process (here on the CPU, the same path): its answer
    and its refusals come back, and the stage process imports nothing of it (nor starts CUDA)."""
    code = (
        "import sys\n"
        "from pipeline.model.quantization import check_available_apart\n"
        "print(check_available_apart('nf4', 'cpu'), 'bitsandbytes' in sys.modules)\n"
        "try:\n    check_available_apart('nf4', 'no_such_device')\n"
        "except ValueError as err:\n    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    first, refusal = done.stdout.splitlines()[:2]
    assert first.endswith(" False") and first.split()[0][0].isdigit()
    assert (
        refusal.startswith("lora.quantization: bitsandbytes ") and "cannot quantize to nf4 on no_such_device" in refusal
    )


@pytest.mark.needs(None if BNB else "bitsandbytes is not installed here (make setup installs it)")
@pytest.mark.parametrize(("kind", "dtype"), [("nf4", torch.float32), ("nf4", torch.bfloat16), ("int8", torch.float32)])
def test_quantized_base_computes_with_the_round_trip_the_merge_measures(tiny_base_dir, kind, dtype):
    """The weights the loaded 4-bit/8-bit base computes with, after an eval forward (bitsandbytes' CPU repacking
    trap), equal quantization.round_trip of the file's weights: the "trained base" of the merge's measure; and
    PEFT's DoRA on it trains (finite gradients) without the base layer's weight being replaced."""
    from pipeline.model import quantization

    check = quantization.check_available(kind, "cpu")
    spec = quantization.Quantization(kind=kind, compute_dtype=dtype, storage_dtype=dtype)
    lora = _spec(use_dora=True, target_modules="all-linear")
    model = load_lora_model(base_dir=tiny_base_dir, vocab_rows=ROWS, lora=lora, seed=0, dtype=dtype, quantization=spec)
    ids = torch.randint(0, ROWS, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.eval()(input_ids=ids)
    model.train()(input_ids=ids, labels=ids).loss.backward()
    files = load_file(tiny_base_dir / "model.safetensors")
    layers = [(n, m) for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    assert len(layers) == 14, check
    for name, module in layers:
        key = name.removeprefix("base_model.model.") + ".weight"
        expected = quantization.round_trip(files[key], kind=kind, load_dtype=dtype)
        torch.testing.assert_close(quantization.dequantize(module.base_layer).float(), expected, atol=0, rtol=0)
        assert type(module.base_layer.weight).__name__ == ("Params4bit" if kind == "nf4" else "Int8Params"), name
        assert all(torch.isfinite(p.grad).all() for p in module.lora_B.parameters()), name


def test_track_tags_name_the_variant(tmp_path):
    """The MLflow run says what produced the adapter: from variant.json, else what adapter_config.json tells."""
    from pipeline.checkpoints.adapter import variant_tags

    (tmp_path / "adapter_config.json").write_text(json.dumps({"use_dora": True}))
    assert variant_tags(tmp_path) == {
        "variant": "DoRA (base precision unknown)",
        "variant.dora": "true",
        "variant.lr_ratio": "unknown",
        "variant.quantization": "unknown",
    }
    variant = {"use_dora": True, "lr_ratio": 16.0, "quantization": "nf4", "compute_dtype": "bf16", "load_dtype": "bf16"}
    (tmp_path / "variant.json").write_text(json.dumps(variant))
    assert variant_tags(tmp_path) == {
        "variant": "DoRA + LoRA+ x16 on an nf4 base (bf16 compute)",
        "variant.dora": "true",
        "variant.lr_ratio": "16.0",
        "variant.quantization": "nf4",
        "variant.compute_dtype": "bf16",
    }
    assert variant_tags(tmp_path / "absent") == {}


def test_resume_under_another_lora_plus_ratio_is_refused(tmp_path):
    from pipeline.checkpoints.folder import check_same_rates

    check_same_rates({"identity": {}}, tmp_path, None)  # a checkpoint from before LoRA+ existed: plain groups
    check_same_rates({"variant": {"lr_ratio": 16.0}}, tmp_path, 16.0)
    with pytest.raises(ValueError, match=r"lora.lr_ratio: .* was trained with lr_ratio None, this run has 16.0"):
        check_same_rates({"variant": {"lr_ratio": None}}, tmp_path, 16.0)
    with pytest.raises(ValueError, match=r"expected lora.lr_ratio=16.0"):
        check_same_rates({"variant": {"lr_ratio": 16.0}}, tmp_path, 4.0)


@pytest.mark.integration
def test_track_stage_tags_the_run_with_the_variant(tmp_path, monkeypatch):
    """stages/track.py on an adapter folder alone (every other file absent): the MLflow run carries its variant."""
    import argparse

    import yaml
    from mlflow import MlflowClient

    from pipeline.core import config
    from stages import track

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"use_dora": False}))
    variant = {"use_dora": False, "lr_ratio": None, "quantization": "int8", "compute_dtype": None, "load_dtype": "bf16"}
    (adapter / "variant.json").write_text(json.dumps(variant))
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(config.compose(REPO / "conf", [f"tracking.uri={uri}"])))
    monkeypatch.chdir(tmp_path)
    absent = tmp_path / "absent"
    args = argparse.Namespace(
        lock=absent, metrics=[], curve=absent, eval_table=absent, task_table=absent, samples=absent, adapter=adapter,
        merged=absent, run_id_file=tmp_path / "run.json", params=str(tmp_path / "params.yaml"),
    )  # fmt: skip
    track.main(args, config.load(tmp_path / "params.yaml"))
    run = MlflowClient(uri).get_run(json.loads((tmp_path / "run.json").read_text())["run_id"])
    assert run.data.tags["variant"] == "LoRA on an int8 base" and run.data.tags["variant.quantization"] == "int8"


def test_a_whole_base_is_built_on_the_rank_s_device(tiny_base_dir):
    """ZeRO 0-2 on a GPU: the base is built on the rank's device and filled from the files a block at a time, never
    whole in host memory first (the meta device stands in for a GPU: nothing is allocated, every file is read)."""
    from pipeline.model.base_weights import load_whole

    model = load_whole(
        base_dir=tiny_base_dir, dtype=torch.bfloat16, vocab_rows=ROWS, init="mean", seed=0, device="meta"
    )
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    assert model.get_input_embeddings().weight.shape[0] == ROWS
