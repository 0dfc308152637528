"""make test's two tiers side by side (tools/test_tiers.py): every test runs in exactly one tier, each tier writes
its JUnit file, and a failure in either fails the run."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

TESTS = {
    "test_unit.py": "def test_unit():\n    assert True\n",
    "test_integration.py": "import pytest\n\n@pytest.mark.integration\ndef test_integration():\n    assert FAIL == 0\n",
}
CONFTEST = "def pytest_configure(config):\n    config.addinivalue_line('markers', 'integration: tier')\n"


def run(tmp_path, fail: int) -> subprocess.CompletedProcess:
    for name, text in {**TESTS, "conftest.py": CONFTEST}.items():
        (tmp_path / name).write_text(text.replace("FAIL", str(fail)))
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "tools.test_tiers", "-q", "-p", "no:cacheprovider", "."]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_each_tier_runs_its_tests_and_either_failing_fails_the_run(tmp_path):
    done = run(tmp_path, fail=0)
    assert done.returncode == 0, done.stdout + done.stderr
    for tier, test in (("unit", "test_unit"), ("integration", "test_integration")):
        junit = (tmp_path / "test-results" / f"junit-{tier}.xml").read_text()
        assert f'name="{test}"' in junit and junit.count("<testcase") == 1
    assert "test tiers: both passed" in done.stdout
    failed = run(tmp_path, fail=1)
    assert failed.returncode == 1 and "test tiers: integration failed" in failed.stdout
