"""The house stays navigable: stages/ is the DVC graph, each stage depends on exactly the code it runs, every module
is named on its package's front page, and the configuration reference and the README's code map are the ones conf/
and the front pages generate."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from tests.conftest import REPO
from tools import code_deps, code_map, config_reference


def test_stage_files_are_the_dvc_stages():
    stages = set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    files = {p.stem for p in (REPO / "stages").glob("*.py") if not p.name.startswith("_")}
    assert files == stages
    assert code_deps.stage_entries() == {name: f"stages.{name}" for name in stages}


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
