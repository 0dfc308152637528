"""make test-times: JUnit files as pytest writes them (one per tier), summed by test file, slowest first."""

from __future__ import annotations

import pytest

from tools.test_times import file_times, main

HEAD = '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="2" time="42.0">'
INTEGRATION = """<testcase classname="tests.integration.test_train" name="test_resume" time="30.5" />
<testcase classname="tests.integration.test_train" name="test_zero3[a@b]@training_runs" time="1.5" />"""
UNIT = """<testcase classname="tests.unit.merge.test_merge" name="test_tied[fp32]" time="10.0" />"""
TAIL = "</testsuite></testsuites>"


def test_each_files_tests_slowest_first(tmp_path, capsys):
    junit = tmp_path / "junit.xml"
    junit.write_text(HEAD + INTEGRATION + UNIT + TAIL)
    assert file_times(junit) == {
        "integration/test_train.py": [(30.5, "test_resume"), (1.5, "test_zero3[a@b]")],
        "unit/merge/test_merge.py": [(10.0, "test_tied[fp32]")],
    }
    main([str(junit), "--top", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "3 tests, 0.7 min in tests (fixtures included)",
        "integration/test_train.py (2, 0.5 min): test_resume 30",
        "unit/merge/test_merge.py (1, 0.2 min): test_tied[fp32] 10",
    ]


def test_the_tiers_files_add_up_as_one_run(tmp_path, capsys):
    unit, integration, whole = tmp_path / "unit.xml", tmp_path / "integration.xml", tmp_path / "junit.xml"
    unit.write_text(HEAD + UNIT + TAIL)
    integration.write_text(HEAD + INTEGRATION + TAIL)
    whole.write_text(HEAD + INTEGRATION + UNIT + TAIL)
    assert file_times(unit, integration) == file_times(whole)
    main([str(unit), str(integration), "--top", "1"])
    tiers = capsys.readouterr().out
    main([str(whole), "--top", "1"])
    assert tiers == capsys.readouterr().out and tiers.startswith("3 tests, 0.7 min in tests (fixtures included)\n")
    with pytest.raises(SystemExit, match="missing.xml: no JUnit file"):
        main([str(unit), str(tmp_path / "missing.xml")])
