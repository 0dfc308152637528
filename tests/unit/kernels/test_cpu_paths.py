"""The CPU code paths by name (pipeline/kernels/cpu_paths.py): each library's forced path is named where it ran,
the variables that force them reach another node's ranks, a path this CPU cannot run is refused, and bf16 counts as
native only where oneDNN may use the CPU's bf16 instructions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline import kernels
from pipeline.core.precision import native_bf16
from pipeline.kernels import cpp
from pipeline.kernels.cpu_paths import describe
from pipeline.launching.ranks import remote_environment
from tests.conftest import REPO

FORCED = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"}


@pytest.mark.cpu_family("x86_64", reason="the forced paths (ATen's default, oneDNN's AVX2, sse2) are x86-64's")
def test_a_forced_path_is_named_where_it_ran():
    code = "import json; from pipeline.kernels.cpu_paths import describe; print(json.dumps(describe(kernels=True)))"
    env = {**FORCED, cpp.ISA_VARIABLE: "scalar"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    forced = json.loads(done.stdout.splitlines()[-1])
    assert forced["aten"] == "DEFAULT" and forced["mkl"] == "MKL_CBWR=COMPATIBLE"
    assert "AVX2" in forced["onednn"] and "AVX-512" not in forced["onednn"]
    assert forced["kernels"] == "scalar (sse2)"  # no vectors, no fused multiply-add
    here = describe(kernels=True)
    assert here["cpu"] == forced["cpu"] and here["kernels"].startswith(f"{cpp.target()} (")


def test_the_variables_that_force_a_path_reach_another_node_s_ranks():
    env = {**FORCED, cpp.ISA_VARIABLE: "avx2", "DNNL_MAX_CPU_ISA": "AVX2", "HOME": "/root"}
    assert remote_environment(env) == {k: v for k, v in env.items() if k != "HOME"}


def test_a_path_this_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setenv(cpp.ISA_VARIABLE, "fast")
    with pytest.raises(ValueError, match="PIPELINE_KERNELS_ISA='fast'; expected one of native, avx512, avx2, scalar"):
        cpp.target()
    monkeypatch.setenv(cpp.ISA_VARIABLE, "avx2")
    monkeypatch.setattr(cpp, "X86", True)
    monkeypatch.setattr(cpp, "cpu_flags", lambda: {"sse2", "avx", "avx2"})
    with pytest.raises(ValueError, match="PIPELINE_KERNELS_ISA=avx2: this CPU lacks bmi2, f16c, fma, movbe"):
        cpp.target()
    assert cpp.runnable() == ("native", "scalar")
    with pytest.raises(ValueError, match="PIPELINE_KERNELS_ISA=avx2: this CPU lacks"):  # the stage, before a launch
        kernels.environment(device="cpu", enabled="auto")


def test_bf16_is_native_only_where_onednn_may_use_the_cpu_s_bf16(monkeypatch):
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    here = native_bf16("cpu")  # the CPU's flags alone
    for cap, native in (("AVX2", False), ("AVX512_CORE", False), ("AVX512_CORE_BF16", here), ("", here)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert native_bf16("cpu") is native, cap
