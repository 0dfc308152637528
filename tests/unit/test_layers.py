"""The library's packages form layers: none imports one after it (core < data < tracking < checkpoints < model <
kernels < launching < training < merge < evaluation < export), and no module cycle; the check sees an upward import
and a cycle when there is one."""

from __future__ import annotations

import shutil

from tests.conftest import REPO
from tools import layers


def test_no_upward_import_and_no_cycle():
    graph = layers.imports()
    assert layers.upward(graph) == []
    assert layers.cycles(graph) == []


def test_every_package_is_placed():
    packages = {p.name for p in (REPO / "pipeline").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(layers.ORDER)
    modules = {p.stem for p in (REPO / "pipeline").glob("*.py") if p.name != "__init__.py"}
    assert modules == set(layers.TOP), "a module beside the packages sits above all of them"


def test_the_check_sees_an_upward_import_and_a_cycle(tmp_path):
    shutil.copytree(REPO / "pipeline", tmp_path / "pipeline")
    atomic = tmp_path / "pipeline" / "core" / "atomic.py"
    atomic.write_text(atomic.read_text() + "\n\ndef _late():\n    from pipeline.merge import fold  # noqa: F401\n")
    fold = tmp_path / "pipeline" / "merge" / "fold.py"
    verify = tmp_path / "pipeline" / "merge" / "verify.py"
    verify.write_text(verify.read_text() + "\nfrom pipeline.merge.fold import merge  # noqa: E402,F401\n")
    graph = layers.imports(tmp_path)
    assert "pipeline.core.atomic -> pipeline.merge.fold" in layers.upward(graph)
    assert ["pipeline.merge.fold", "pipeline.merge.verify", "pipeline.merge.fold"] in layers.cycles(graph)
    assert fold.is_file()
