"""Sweeps and the MLflow UI on the tiny pipeline (a copy of the project that already ran `dvc repro`, from the
session's repro check): a Hydra multirun sweep and an Optuna sweep through `python -m tools.sweep`, a DVC queue
sweep, the UI server's REST API and the compare-runs view in headless Chromium, and an unreachable tracking server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import yaml
from mlflow import MlflowClient

from pipeline.core.atomic import read_json
from pipeline.core.environment import free_port, with_venv_path
from tests.conftest import REPO
from tools.repro_check import sh

pytestmark = pytest.mark.integration
OBJECTIVE = "eval.in_domain.adapter.bits_per_byte"
SCREENSHOT = REPO / "logs" / "ui" / "compare_runs.png"
BROWSER = shutil.which("chromium"), shutil.which("chromedriver")
NO_BROWSER = "chromium and chromedriver are not installed (`make browser` installs Debian's, as root)"


@pytest.fixture(scope="module")
def project(tiny_pipeline) -> Path:
    return tiny_pipeline.roots[1]


def runs(project: Path, filter_string: str = "") -> list:
    client = MlflowClient(f"sqlite:///{project / 'mlruns.db'}")
    return client.search_runs([client.get_experiment_by_name("llm-lora").experiment_id], filter_string)


def sweep(project: Path, *overrides: str) -> subprocess.CompletedProcess:
    return sh([sys.executable, "-m", "tools.sweep", "-m", *overrides], project)


def test_hydra_multirun_sweep_is_one_parent_run_with_a_child_run_per_combination(project, tiny_pipeline):
    # Two jobs (the 2 x 2 sweep of the README is the same code, twice as long): the first combination is the
    # workspace's, so DVC has nothing to re-run for it; the second trains.
    done = sweep(project, *tiny_pipeline.overrides, "lora.r=4,2", "train.lr=5e-4")
    table = done.stdout[done.stdout.index("sweep: 2 job(s), finished") :]
    assert table.count("\n| ") == 3, table  # header + 2 jobs
    (parent,) = runs(project, "tags.`sweep.objective` = 'in_domain.adapter.bits_per_byte'")
    children = runs(project, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    combos = {(c.data.params["lora.r"], c.data.params["train.lr"]) for c in children}
    assert combos == {("4", "0.0005"), ("2", "0.0005")}
    for child in children:
        assert child.info.status == "FINISHED" and OBJECTIVE in child.data.metrics
        assert child.data.tags["stage.cache_dataset"] == "cached", "base, tokenizer and dataset are reused"
    unchanged = next(c for c in children if (c.data.params["lora.r"], c.data.params["train.lr"]) == ("4", "0.0005"))
    assert unchanged.data.tags["stage.train"] == "cached", "the workspace's own combination: only track re-ran"
    best = min(children, key=lambda c: c.data.metrics[OBJECTIVE])
    assert parent.data.tags["sweep.best_run"] == best.info.run_id
    assert parent.data.metrics[f"best.{OBJECTIVE.removeprefix('eval.')}"] == best.data.metrics[OBJECTIVE]
    shown = json.loads(sh(["dvc", "exp", "show", "--json"], project).stdout)
    names = {e["name"] for entry in shown for e in (entry.get("experiments") or [])}
    assert {c.data.tags["dvc.experiment"] for c in children} <= names


def test_optuna_sweeper_returns_bits_per_byte(project, tiny_pipeline):
    params = yaml.safe_load((project / "params.yaml").read_text())  # the workspace's combination: nothing retrains
    r, lr = params["lora"]["r"], params["train"]["lr"]
    done = sweep(
        project, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", *tiny_pipeline.overrides,
        f"lora.r=choice({r})", f"train.lr=choice({lr})",
    )  # fmt: skip
    value = read_json(project / "metrics/eval.json")["in_domain"]["adapter"]["bits_per_byte"]
    assert f"Best value: {value}" in done.stdout + done.stderr
    (parent,) = runs(project, "attributes.run_name LIKE 'sweep %' and attributes.status = 'FINISHED'")[:1]
    (child,) = runs(project, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert child.data.metrics[OBJECTIVE] == value


def test_sweep_values_of_the_wrong_type_stop_before_any_job(project, tiny_pipeline):
    before = len(runs(project))
    done = subprocess.run(
        [sys.executable, "-m", "tools.sweep", "-m", *tiny_pipeline.overrides, "lora.r=2,two", "train.lr=fast"],
        cwd=project, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "lora.r: input should be a valid integer, got 'two'" in done.stderr
    assert "train.lr: input should be a valid number, got 'fast'" in done.stderr
    assert "Traceback" not in done.stderr and len(runs(project)) == before


@pytest.fixture(scope="module")
def queued(project, tiny_pipeline) -> list:
    """`dvc exp run --queue -S 'train.lr=2e-3,3e-3' && dvc queue start -j 2`, waited for: two pipelines at once,
    each training on a free port of its own and logging into the one SQLite store."""
    overrides = [x for o in tiny_pipeline.overrides for x in ("-S", o)]
    sh(["dvc", "exp", "run", "--queue", *overrides, "-S", "train.lr=2e-3,3e-3"], project)
    # The workers are daemons that keep the stdout they were given: a pipe would never reach its end.
    subprocess.run(
        ["dvc", "queue", "start", "-j", "2"], cwd=project, env=with_venv_path(), check=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline:
            polled = sh(["dvc", "queue", "status"], project, check=False)
            status = polled.stdout  # a status read while a worker writes its info file can fail (exit 255, a JSON
            if not polled.returncode and "Queued" not in status and "Running" not in status:  # error): asked again
                break
            time.sleep(5)
    finally:
        sh(["dvc", "queue", "stop"], project, check=False)  # a worker left idle would outlive the tests
    assert status.count("Success") == 2, status
    names = [line.split()[1] for line in status.splitlines() if "Success" in line]
    found = [r for r in runs(project) if r.data.tags.get("dvc.experiment") in names]
    assert len(found) == 2, f"one MLflow run per queued experiment {names}:\n{described(found, names, project)}"
    return found


def described(found: list, names: list[str], project: Path) -> str:
    """The runs of a failed sweep check, each with its stages, and the tail of each experiment's queue log."""
    lines = [
        f"{r.info.run_id} {r.data.tags.get('dvc.experiment')} {r.info.status} {r.info.start_time}-{r.info.end_time} "
        + ",".join(sorted(k.removeprefix("stage.") for k in r.data.tags if k.startswith("stage.")))
        for r in sorted(found, key=lambda r: r.info.start_time)
    ]
    logs = [sh(["dvc", "queue", "logs", name], project, check=False).stdout[-3000:] for name in names]
    return "\n".join(lines + logs)


def test_dvc_queue_sweep_is_one_mlflow_run_per_experiment(project, queued):
    assert {r.data.params["train.lr"] for r in queued} == {"0.002", "0.003"}
    for run in queued:
        assert run.info.status == "FINISHED" and OBJECTIVE in run.data.metrics
        assert run.info.artifact_uri.startswith((project / "mlartifacts").as_uri()), "the main workspace's store"
    shown = json.loads(sh(["dvc", "exp", "show", "--json"], project).stdout)
    experiments = {e["name"]: e for entry in shown for e in (entry.get("experiments") or [])}
    for run in queued:
        (revision,) = experiments[run.data.tags["dvc.experiment"]]["revs"]
        figures = revision["data"]["metrics"]["metrics/eval.json"]["data"]
        assert figures["in_domain"]["adapter"]["bits_per_byte"] == run.data.metrics[OBJECTIVE]


def _get(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


class UI(NamedTuple):
    base: str  # the server's URL
    runs: str  # the URL `make ui` prints first: the experiment's runs table in the headline view


@pytest.fixture(scope="module")
def ui(project, queued) -> UI:
    """`make ui` on a free loopback port over the project copy's store (where the queued sweep logged its runs)."""
    port = free_port()
    log = project / "ui_server.log"  # a file, not a pipe nobody reads: the server logs on and would block
    with log.open("w") as output:
        server = subprocess.Popen(
            ["make", "-s", "-C", str(REPO), "ui", f"UI_PORT={port}", f"UI_STORE=sqlite:///{project / 'mlruns.db'}"],
            stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, log.read_text()
                time.sleep(0.5)
        printed = log.read_text().splitlines()[0]
        assert printed.startswith("ui: the runs of llm-lora: "), printed
        yield UI(base, printed.split(": ", 2)[2])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_ui_server_serves_runs_metrics_and_artifacts(ui, queued):
    experiment = _get(f"{ui.base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=llm-lora")["experiment"]
    found = _get(f"{ui.base}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
    by_id = {r["info"]["run_id"]: r for r in found}
    for run in queued:
        served = {m["key"]: m["value"] for m in by_id[run.info.run_id]["data"]["metrics"]}
        assert served[OBJECTIVE] == run.data.metrics[OBJECTIVE]
        history = _get(f"{ui.base}/api/2.0/mlflow/metrics/get-history?run_id={run.info.run_id}&metric_key=loss")
        assert [m["step"] for m in history["metrics"]] == [1, 2, 3, 4]
        listed = _get(f"{ui.base}/api/2.0/mlflow/artifacts/list?run_id={run.info.run_id}&path=plots")
        assert {f["path"] for f in listed["files"]} == {"plots/eval_bits_per_byte.png", "plots/train_curve.png"}


def seen_text(browser, expected: set[str], timeout: float = 90) -> set[str]:
    """The lines the page shows, scrolling every virtualised grid (its rows render when scrolled to), until all of
    `expected` are there or `timeout` s have passed."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while not expected <= seen and time.monotonic() < deadline:
        seen |= set(browser.find_element("tag name", "body").text.splitlines())
        for grid in browser.find_elements("class name", "ReactVirtualized__Grid"):
            for top in range(0, browser.execute_script("return arguments[0].scrollHeight", grid), 150):
                browser.execute_script("arguments[0].scrollTop = arguments[1]", grid, top)
                seen |= set(grid.text.splitlines())
        time.sleep(0.5)
    return seen


@pytest.mark.needs(None if all(BROWSER) else NO_BROWSER)
def test_the_ui_opens_on_both_runs_of_a_sweep_and_compares_them_in_a_real_browser(ui, queued):
    """`make ui` over a two-point sweep's store (the DVC queue's train.lr=2e-3,3e-3): the URL it prints opens the
    runs table (not MLflow 3's GenAI overview) in the headline view, both runs named after their DVC experiments,
    the bits per byte and the swept key as columns; the compare view shows both runs, the swept key and the bits
    per byte; the run page says what the run is."""
    chromium, driver = BROWSER
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=2400,1200",
    ):  # fmt: skip
        options.add_argument(flag)
    names = {r.info.run_name for r in queued}
    assert names == {r.data.tags["dvc.experiment"] for r in queued}, "runs named after their DVC experiments"
    swept = "train.lr"
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        browser.get(ui.runs)
        table = seen_text(browser, names | {"Headline figures", "eval.in_domain.adapter.bits_per_byte", swept})
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(SCREENSHOT.with_name("runs_table.png")))
        ids = json.dumps([r.info.run_id for r in queued])
        browser.get(f"{ui.base}/#/compare-runs?runs={ids}&experiments={json.dumps([queued[0].info.experiment_id])}")
        expected = {OBJECTIVE, "train.final_train_loss", "tokenizer.heldout_tokens_per_char_after", "loss", swept}
        compared = seen_text(browser, expected | names)
        browser.save_screenshot(str(SCREENSHOT))
        run = queued[0]
        browser.get(f"{ui.base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}")
        page = ""
        deadline = time.monotonic() + 90
        while "LoRA fine-tuning" not in page and time.monotonic() < deadline:
            page = browser.find_element("tag name", "body").text
            time.sleep(0.5)
        browser.save_screenshot(str(SCREENSHOT.with_name("run_page.png")))
    finally:
        browser.quit()
    assert names <= table, f"both runs in the runs table: {names - table}"
    assert {"Headline figures", swept} <= table, "the headline view, with the swept key"
    assert any(line.startswith("eval.in_domain.adapter") for line in table), "the bits per byte as a column"
    assert expected <= compared, f"missing in the compare view: {expected - compared}"
    assert names <= compared, "both runs are compared"
    assert "LoRA fine-tuning" in page and "bits/byte" in page, "the run page says what the run is and how good"


def test_unreachable_tracking_server_warns_once_and_the_run_is_logged_later(project, tiny_pipeline):
    overrides = _same_combination(project, tiny_pipeline)
    done = sh(["dvc", "exp", "run", *overrides, "-S", "tracking.uri=http://127.0.0.1:9"], project)
    warnings = [line for line in done.stderr.splitlines() if line.startswith("tracking:")]
    assert len(warnings) == 2, done.stderr  # the first stage's failure, then the track stage's closing note
    assert warnings[0].startswith("tracking: cannot open a run on http://127.0.0.1:9")
    assert "is not in MLflow" in warnings[1] and "dvc repro -f track" in warnings[1]
    assert read_json(project / "logs/mlflow_run.json")["missing"]

    later = project / "later.db"
    sh(["dvc", "exp", "run", *overrides, "-S", f"tracking.uri=sqlite:///{later}"], project)
    client = MlflowClient(f"sqlite:///{later}")
    (run,) = client.search_runs([client.get_experiment_by_name("llm-lora").experiment_id])
    assert run.data.tags["stage.train"] == "cached" and OBJECTIVE in run.data.metrics
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4], "curve backfilled"


def _same_combination(project: Path, tiny_pipeline) -> list[str]:
    """-S overrides for the workspace's own combination: only track (which depends on all params) re-runs."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    same = [*tiny_pipeline.overrides, f"lora.r={params['lora']['r']}", f"train.lr={params['train']['lr']}"]
    return [x for o in same for x in ("-S", o)]


def test_a_tracking_server_receives_the_run_and_registers_the_merged_model(project, tiny_pipeline, ui):
    overrides = _same_combination(project, tiny_pipeline)
    server = ["-S", f"tracking.uri={ui.base}", "-S", "tracking.register_model=tiny-lora"]
    sh(["dvc", "exp", "run", *overrides, *server], project)
    client = MlflowClient(ui.base)
    run = client.get_run(read_json(project / "logs/mlflow_run.json")["run_id"])
    assert run.data.tags["stage.track"] == "ran" and OBJECTIVE in run.data.metrics
    (version,) = client.search_model_versions("name = 'tiny-lora'")
    assert version.run_id == run.info.run_id and version.source.endswith("/merged")
    from transformers import AutoModelForCausalLM

    merged = Path(version.source.removeprefix("file://"))
    registered = AutoModelForCausalLM.from_pretrained(merged)  # what the registry points at is a loadable HF folder
    local = AutoModelForCausalLM.from_pretrained(project / "artifacts/merged")
    for (name, value), (_, expected) in zip(registered.state_dict().items(), local.state_dict().items(), strict=True):
        assert torch.equal(value, expected), name
