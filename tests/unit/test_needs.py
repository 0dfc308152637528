"""The `needs` marker (tests/conftest.py): a test whose program is missing skips on a developer's machine, but fails
under CI=true, where `make test` has installed everything and a skip would let the suite go green unchecked."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

CASE = """
import pytest

@pytest.mark.needs("frobnicator is not installed")
def test_missing():
    pass

@pytest.mark.needs(None)
def test_present():
    pass
"""


def outcome(tmp_path, ci: str | None) -> str:
    (tmp_path / "test_case.py").write_text(CASE)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci is not None else {})
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.conftest", "-c",
               str(REPO / "pyproject.toml"), "--rootdir", str(REPO), str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    return done.stdout.splitlines()[-1]


def test_a_missing_program_skips_off_ci_and_fails_under_ci(tmp_path):
    assert "1 passed, 1 skipped" in outcome(tmp_path, None)
    assert "1 passed, 1 error" in outcome(tmp_path, "true")
