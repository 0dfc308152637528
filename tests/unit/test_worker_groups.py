"""The integration tier's workers (tests/conftest.py, `make test`): the files sharing a session run (the tiny
pipeline) go to one worker, every other file's tests stay together, so that no shared run or module fixture is
built twice. Run through pytest-xdist as `make test` runs it: the groups are given in a collection hook, which
xdist 3.8 under pytest 9.2 ignored without a word (pytest-dev/pytest-xdist#1386)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO

SHARING = """
import time
import pytest

pytestmark = pytest.mark.integration

@pytest.fixture(scope="session")
def tiny_pipeline():  # stands in for the session's tiny pipeline: the name is what groups the file
    return None

@pytest.mark.parametrize("i", range(3))
def test_case(tiny_pipeline, i):
    time.sleep(0.2)
"""

ALONE = """
import time
import pytest

pytestmark = pytest.mark.integration

@pytest.mark.parametrize("i", range(3))
def test_case(i):
    time.sleep(0.2)
"""


def test_files_sharing_a_run_go_to_one_worker_and_each_file_stays_whole(tmp_path):
    for name, text in {"a": SHARING, "b": SHARING, "c": ALONE, "d": ALONE}.items():
        (tmp_path / f"test_{name}.py").write_text(text)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.conftest", "-c",
               str(REPO / "pyproject.toml"), "--rootdir", str(REPO), "-o", "addopts=", "-v",
               "-n", "2", "--dist", "loadgroup", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    ran = re.findall(r"\[(gw\d)\] .*PASSED \S*test_(\w)\.py::test_case\[\d\](@\w+)?", done.stdout)
    assert len(ran) == 12, done.stdout[-3000:]
    workers = {file: {worker for worker, f, _ in ran if f == file} for file in "abcd"}
    assert workers["a"] == workers["b"] and len(workers["a"]) == 1, workers
    assert all(len(workers[file]) == 1 for file in "cd"), workers
    assert {group for _, f, group in ran if f in "ab"} == {"@tiny_pipeline"}, ran
