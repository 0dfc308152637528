"""The GPU bundle takes our pins: every package it carries is pinned in constraints.txt, and one that is not is
refused by name."""

from pathlib import Path

import pytest

from tests.conftest import REPO
from tools.gpu_wheels import PACKAGES, pinned, pins


def test_every_carried_package_is_pinned():
    versions = pins(REPO / "constraints.txt")
    assert [pinned(name, versions).split("==")[0] for name in PACKAGES] == list(PACKAGES)


def test_an_unpinned_package_is_named(tmp_path: Path):
    (tmp_path / "constraints.txt").write_text("torch==2.13.0\n")
    with pytest.raises(SystemExit, match="deepspeed is not pinned"):
        pinned("deepspeed", pins(tmp_path / "constraints.txt"))
