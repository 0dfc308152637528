"""The opt-in profiler: a table of the profiled steps' operators where PIPELINE_PROFILE names a folder, else
nothing."""

import pytest
import torch

from pipeline.training.profile import VARIABLE, profiled_steps


def _train(steps: int) -> None:
    layer = torch.nn.Linear(16, 16)
    with profiled_steps(rank=3) as step:
        for _ in range(steps):
            layer(torch.ones(4, 16)).sum().backward()
            step()


def test_the_operators_of_the_profiled_steps_are_written_per_rank(tmp_path, monkeypatch):
    monkeypatch.setenv(VARIABLE, str(tmp_path / "profile"))
    _train(5)
    table = (tmp_path / "profile" / "profile_rank3.txt").read_text()
    assert "aten::addmm" in table and "ProfilerStep*" in table


def test_unset_it_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    _train(5)
    assert list(tmp_path.iterdir()) == []


def test_the_step_summary_counts_kernels_and_the_gpus_idle_time():
    from types import SimpleNamespace

    from pipeline.training.profile import step_summary

    kernel = SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, self_device_time_total=150_000, count=300)
    host = SimpleNamespace(device_type=torch.autograd.DeviceType.CPU, self_device_time_total=0, count=999)
    assert step_summary([kernel, host], wall_seconds=0.5, steps=2) == {
        "kernels_per_step": 150, "gpu_busy_ms_per_step": 75.0, "wall_ms_per_step": 250.0, "gpu_idle_ms_per_step": 175.0,
    }  # fmt: skip


@pytest.mark.gpu
def test_a_gpu_profile_writes_the_step_summary(tmp_path, monkeypatch):
    from pipeline.core.atomic import read_json
    from pipeline.training.profile import SUMMARY

    monkeypatch.setenv(VARIABLE, str(tmp_path / "profile"))
    layer = torch.nn.Linear(4096, 4096).cuda()  # about 1 ms of kernels a step: the summary keeps 0.1 ms
    with profiled_steps(rank=0) as step:
        for _ in range(5):
            layer(torch.ones(8192, 4096, device="cuda")).sum().backward()
            step()
    summary = read_json(tmp_path / "profile" / SUMMARY)
    assert summary["kernels_per_step"] >= 3 and 0 < summary["gpu_busy_ms_per_step"] <= summary["wall_ms_per_step"]
