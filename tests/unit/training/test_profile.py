"""The opt-in profiler: a table of the profiled steps' operators where PIPELINE_PROFILE names a folder, else
nothing."""

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
