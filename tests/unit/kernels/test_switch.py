"""The kernels' one door: what `train.kernels` installs on which device and ZeRO stage, that `off` imports and
changes nothing, and that a GPU run decides on the device it trains on (the model still on the CPU when loaded):
no C++ built, no attention registered, no CPU-only layer installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline import kernels
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("device", "enabled", "expected"),
    [
        ("cpu", "auto", ("lean_layers", "fused_loss", "lora_linear", "linear", "attention")),
        ("cuda", "auto", ("lean_layers", "fused_loss", "lora_linear", "compiled_layers")),
        ("cpu", "off", ()),
        ("cuda", "off", ()),
    ],
)
def test_chosen_paths(device, enabled, expected):
    assert kernels.chosen(device=device, enabled=enabled) == expected


def test_an_unknown_switch_is_refused():
    with pytest.raises(ValueError, match="train.kernels: 'fast'; expected one of auto, off"):
        kernels.chosen(device="cpu", enabled="fast")


def test_skipped_paths_are_left_out_and_unknown_ones_named():
    chosen = kernels.chosen(device="cuda", enabled="auto", skip=("compiled_layers", "zero_tail"))
    assert chosen == ("lean_layers", "fused_loss", "lora_linear")
    with pytest.raises(ValueError, match=r"train.kernels_skip: \['fused_los'\] are not kernel paths"):
        kernels.chosen(device="cpu", enabled="auto", skip=("fused_los",))


def test_process_environment_only_for_cpu_ranks_with_kernels():
    assert "GLIBC_TUNABLES" in kernels.environment(device="cpu", enabled="auto")
    assert kernels.environment(device="cuda", enabled="auto") == {}
    assert kernels.environment(device="cpu", enabled="off") == {}
    assert kernels.settle(device="cuda", enabled="auto") == kernels.settle(device="cpu", enabled="off") == {}


PROBE = """
import sys, torch
from pipeline import kernels
from tests.helpers.lora_model import tiny_lora

model = tiny_lora(torch.float32)
forwards = {name: m.forward for name, m in model.named_modules()}
installed = kernels.apply(model, device=sys.argv[1], zero_stage=2, enabled=sys.argv[2])
changed = sorted({type(m).__name__ for n, m in model.named_modules() if m.forward != forwards[n]})
loaded = sorted(m for m in sys.modules if m.startswith("pipeline.kernels."))
cpp = sys.modules.get("pipeline.kernels.cpp")
built = cpp is not None and cpp.build.cache_info().currsize
print(installed, changed, loaded, model.config._attn_implementation, built)
"""


def probe(device: str, enabled: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, device, enabled], cwd=REPO, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


@pytest.mark.slow
def test_off_imports_and_changes_nothing():
    assert probe("cpu", "off") == "{} [] [] sdpa False"


@pytest.mark.slow
def test_a_gpu_run_loaded_on_the_cpu_gets_only_device_generic_paths():
    """fp32: the lean norm would need the C++ kernels, so only the MLPs change; no C++ built, no attention
    registered; the decoder layers marked for torch.compile (compiled on their first call, on the GPU)."""
    installed, rest = probe("cuda", "auto").split("} ", 1)
    assert installed == "{'lean_layers': 2, 'fused_loss': 1, 'lora_linear': 8, 'compiled_layers': 2"
    assert rest.endswith("sdpa 0") and "pipeline.kernels.attention" not in rest and "allocator" not in rest


@pytest.mark.slow
def test_a_cpu_run_gets_every_path():
    installed, rest = probe("cpu", "auto").split("} ", 1)
    assert "'linear':" in installed and "'attention': 1" in installed
    assert "sdpa_matmul_backward" in rest
