"""The house stays navigable: stages/ is the DVC graph, each stage depends on exactly the code it runs, dvc.lock
records that code as it is, every module is named on its package's front page, and the configuration reference and
the README's code map are the ones conf/ and the front pages generate."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.conftest import REPO
from tools import code_deps, code_map, config_reference, lock_check


def test_stage_files_are_the_dvc_stages():
    stages = set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    files = {p.stem for p in (REPO / "stages").glob("*.py") if not p.name.startswith("_")}
    assert files == stages
    assert code_deps.stage_entries() == {name: f"stages.{name}" for name in stages}


def test_tools_and_benchmarks_import_nothing_from_the_tests():
    """What `make` runs outside the suite (tools/, bench/) stands on the product alone."""
    found = [
        f"{path.relative_to(REPO)}: {name}"
        for folder in ("tools", "bench")
        for path in (REPO / folder).rglob("*.py")
        for name in code_deps.imported_names(path)
        if name == "tests" or name.startswith("tests.")
    ]
    assert found == []


def test_dvc_yaml_lists_every_module_each_stage_runs():
    assert code_deps.problems() == {}


def test_the_dependency_check_sees_lazy_imports_and_modules_started_by_name(tmp_path):
    """A copy of the project whose train stage misses a module it imports inside a function, and lists one it no
    longer runs: both are reported."""
    for package in code_deps.PACKAGES:
        for path in [*(REPO / package).rglob("*.py"), *(REPO / package).rglob("*.cpp")]:
            target = tmp_path / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    deps = dvc["stages"]["train"]["deps"]
    deps.remove("pipeline/training/loop.py")  # imported lazily by pipeline/training/rank.py, started by name
    deps.append("pipeline/merge/fold.py")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    assert code_deps.problems(tmp_path)["train"] == {
        "missing": ["pipeline/training/loop.py"],
        "extra": ["pipeline/merge/fold.py"],
    }


def test_exempt_modules_exist():
    assert all((REPO / path).is_file() for path in code_deps.NOT_DEPENDENCIES)


def test_configuration_reference_is_generated_from_conf():
    assert config_reference.missing_comments() == [], "every key of conf/ explains itself in a comment"
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == config_reference.render(), "docs/configuration.md drifted: run `python -m tools.config_reference`"


def test_package_inits_hold_a_front_page_and_only_kernels_code():
    """Package __init__ files hold a docstring; kernels' also its one door (`apply`), and the dependency check then
    counts it as a module the train stage runs (with the C++ its modules compile)."""
    with_code = {
        init.relative_to(REPO).as_posix()
        for package in code_deps.PACKAGES
        for init in (REPO / package).rglob("__init__.py")
        if code_deps.holds_code(init)
    }
    assert with_code == {"pipeline/kernels/__init__.py"}
    runs = code_deps.closure("stages.train")
    assert {Path("pipeline/kernels/__init__.py"), Path("pipeline/kernels/csrc/kernels.cpp")} <= runs
    assert Path("pipeline/__init__.py") not in runs


def test_every_module_is_named_on_its_package_s_front_page():
    assert code_map.missing() == [], "name each module on its package's __init__ docstring, as `module`"


def test_a_module_left_off_its_front_page_is_found(tmp_path):
    """A copy of the library with a module that its package's front page does not name: the check names it."""
    shutil.copytree(REPO / "pipeline", tmp_path / "pipeline")
    (tmp_path / "pipeline" / "merge" / "unlisted.py").write_text('"""Not on the front page."""\n')
    assert code_map.missing(tmp_path) == ["pipeline/merge/unlisted.py"]


def test_the_readme_code_map_is_generated_from_the_front_pages():
    readme = REPO / "README.md"
    assert readme.read_text(encoding="utf-8") == code_map.rewrite(readme), (
        "README.md's code map drifted: run `python -m tools.code_map`"
    )


def test_dvc_lock_records_the_code_and_params_each_stage_runs_now():
    """Pipeline code changed without the `make run` that records it leaves dvc.lock behind: a fresh `make run` would
    retrain. (After a change to a stage's code this fails until `make run` is committed with it.)"""
    assert lock_check.stale() == []


def test_the_lock_check_sees_changed_code_and_params(tmp_path):
    """A copy of the project's pipeline definition and code, where one train module and one train param changed, and
    prepare_base's params were never recorded (a stage given params since the last `make run`)."""
    for name in ("dvc.yaml", "dvc.lock", "params.yaml", ".dvc/config", "requirements-assets.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((REPO / name).read_bytes())
    for folder in (*code_deps.PACKAGES, "tasks"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    before = set(lock_check.stale(tmp_path))
    with (tmp_path / "pipeline/training/schedule.py").open("a") as f:
        f.write("# changed\n")
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["train"]["lr"] *= 2
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    lock = yaml.safe_load((tmp_path / "dvc.lock").read_text())
    del lock["stages"]["prepare_base"]["params"]
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    found = set(lock_check.stale(tmp_path)) - before
    assert "train: pipeline/training/schedule.py differs from dvc.lock" in " ".join(sorted(found)), found
    assert "train: params train modified" in found, found
    assert "prepare_base: params model new" in found, found
