"""The MLflow relay (pipeline/tracking/relay.py): a stage's params, tags, figures and end reach the store as they do
when the stage calls MLflow itself, without MLflow imported in the stage; failures warn in the stage once; the relay
ends when idle while no live process holds a run open through it (a stage calling after that starts it again) or
when its store is replaced, and is not used where switched off (a failing call through it:
unit/tracking/test_tracking.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from pipeline.tracking.mlflow_run import HTTP_DEFAULTS, Tracker, open_run
from pipeline.tracking.relay import SKINNY, SWITCH, open_relayed
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def relays(database: Path) -> list[psutil.Process]:
    """The relay processes serving `database`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "pipeline.tracking.relay" in cmdline and str(database) in cmdline:
            found.append(process)
    return found


def stage_like(opener, root: Path) -> list[str]:
    """Two stages of one execution, the second completing the run as stages/track.py does (relative paths), and a
    third that fails, as stages/_common.py logs them; their run ids."""
    ids = []
    kwargs = {"uri": "sqlite:///mlruns.db", "experiment": "lora", "run_id_file": root / "run.json", "root": root}
    with opener(**kwargs, execution="e1", run_name="first") as tracker:
        tracker.log_params({"lora.r": 8, "long": "x" * 7000, "targets": ["q_proj", "v_proj"]})
        tracker.set_tags({"stage.prepare_corpus": "ran", "git_dirty": False})
        tracker.log_metrics({"corpus.documents": 974, "seconds.prepare_corpus": 1.5})
        ids.append(tracker.run_id)
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text('{"r": 8}')
    (root / "params.yaml").write_text("lora:\n  r: 8\n")
    with opener(**kwargs, execution="e1", run_name="first") as tracker, contextlib.chdir(root):  # joins the run
        tracker.log_series({"train.loss": {1: 2.5, 2: 2.25, 3: 2.0}})
        metrics, tags = tracker.logged()
        assert metrics == {"corpus.documents": 974, "seconds.prepare_corpus": 1.5, "train.loss": 2.0}
        assert tags["stage.prepare_corpus"] == "ran" and tracker.logged_steps("train.loss") == {1, 2, 3}
        tracker.describe("**LoRA fine-tuning** of `tiny`")
        tracker.tag_experiment({"view": "bits_per_byte"})
        tracker.log_datasets(
            [{"name": "training data", "digest": "d" * 40, "source": "corpus.txt", "context": "training"}]
        )
        tracker.log_artifact(Path("params.yaml"), "config")
        tracker.log_artifact(Path("adapter"), "adapter")
        assert tracker.register_model("tiny-lora", "adapter") == "1"
        ids.append(tracker.run_id)
    with pytest.raises(RuntimeError), opener(**kwargs, execution="e2", run_name="second") as tracker:
        tracker.log_metrics({"eval.bits_per_byte": 1.1}, step=4)
        ids.append(tracker.run_id)
        raise RuntimeError("out of memory")
    return ids


def content(database: Path, run_id: str) -> dict:
    client = MlflowClient(f"sqlite:///{database}")
    run = client.get_run(run_id)
    histories = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in run.data.metrics}
    tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.") or k == "mlflow.note.content"}
    experiment = client.get_experiment(run.info.experiment_id).tags
    artifacts = {a.path: a.file_size for folder in ("config", "adapter") for a in client.list_artifacts(run_id, folder)}
    inputs = [(d.dataset.name, d.dataset.digest, [t.value for t in d.tags]) for d in run.inputs.dataset_inputs]
    versions = [(v.name, v.version) for v in client.search_model_versions(f"run_id = '{run_id}'")]
    return {"status": run.info.status, "name": run.info.run_name, "params": run.data.params, "tags": tags,
            "view": experiment.get("view"), "artifacts": artifacts, "inputs": inputs, "versions": versions,
            **histories}  # fmt: skip


def test_a_relayed_run_holds_what_the_stage_logging_itself_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(SWITCH, "5")
    direct, relayed = tmp_path / "direct", tmp_path / "relayed"
    direct.mkdir(), relayed.mkdir()
    expected = stage_like(open_run, direct)
    got = stage_like(open_relayed, relayed)
    assert expected[0] == expected[1] != expected[2] and got[0] == got[1] != got[2]
    for ours, theirs in zip(got[1:], expected[1:], strict=True):
        assert content(relayed / "mlruns.db", ours) == content(direct / "mlruns.db", theirs)
    assert content(relayed / "mlruns.db", got[2])["status"] == "FAILED"
    [relay] = relays(relayed / "mlruns.db")  # one relay served the three stages
    mapped = {m.path for m in relay.memory_maps()}  # the compiled libraries in its memory: as mlflow-skinny's
    assert not {path for path in mapped for package in SKINNY if f"/{package}/" in path or f"/{package}.libs/" in path}
    assert any("/numpy/" in path for path in mapped) and not relays(direct / "mlruns.db")  # (those it imports: seen)


def test_a_stage_logging_through_the_relay_never_imports_mlflow(tmp_path: Path):
    code = (
        "import sys\nfrom pathlib import Path\nfrom pipeline.tracking.relay import open_relayed\n"
        f"with open_relayed(uri='sqlite:///{tmp_path}/mlruns.db', experiment='lora', "
        f"run_id_file=Path('{tmp_path}/run.json'), execution='e') as t:\n"
        "    t.log_params({'a': 1}); t.log_metrics({'loss': 2.0}, step=1)\n"
        "    t.logged(); t.log_artifact(Path('pyproject.toml'))\n"
        "print(type(t).__name__, 'mlflow' in sys.modules, t.run_id)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    kind, imported, run_id = done.stdout.split()
    assert (kind, imported) == ("Relayed", "False"), done.stderr
    logged = content(tmp_path / "mlruns.db", run_id)
    assert logged["params"] == {"a": "1"} and logged["loss"] == [(1, 2.0)] and logged["status"] == "FINISHED"
    root = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db").get_run(run_id).info.artifact_uri.removeprefix("file://")
    assert (Path(root) / "pyproject.toml").read_bytes() == (REPO / "pyproject.toml").read_bytes()


def test_the_relay_ends_when_idle_comes_back_for_a_late_call_and_leaves_a_replaced_store_to_the_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(SWITCH, "2")
    database = tmp_path / "mlruns.db"
    kwargs = {"uri": f"sqlite:///{database}", "experiment": "lora", "run_id_file": tmp_path / "run.json"}
    open_relayed(**kwargs, execution="a").close()
    (relay,) = relays(database)
    cmdline = relay.cmdline()
    address = Path(cmdline[cmdline.index("pipeline.tracking.relay") + 1])
    assert address.exists() and address.with_suffix(".log").exists()
    relay.wait(timeout=30)
    assert not address.exists() and not address.with_suffix(".log").exists(), "ended idle: its socket and log gone"

    open_relayed(**kwargs, execution="b").close()
    (relay,) = relays(database)
    database.unlink()  # a store deleted and made again: the relay must not write into the old file
    tracker = open_relayed(**kwargs, execution="c")
    assert type(tracker) is Tracker and not tracker.disabled, "the stage logged itself"
    tracker.log_params({"after": "replaced"})
    tracker.close()
    assert content(database, tracker.run_id)["params"] == {"after": "replaced"}
    relay.wait(timeout=30)

    tracker = open_relayed(**kwargs, execution="d")
    tracker.log_params({"before": "idle"})
    (relay,) = relays(database)
    with pytest.raises(psutil.TimeoutExpired):
        relay.wait(timeout=6)  # idle three times over, but this process holds run d open
    relay.kill()  # a relay gone while the stage works
    relay.wait(timeout=30)
    tracker.log_metrics({"loss": 1.5}, step=3)
    tracker.close()
    assert type(tracker) is not Tracker and not tracker.disabled, "the call started the relay again"
    logged = content(database, tracker.run_id)
    assert logged["params"] == {"before": "idle"} and logged["loss"] == [(3, 1.5)] and logged["status"] == "FINISHED"
    (relay,) = relays(database)
    relay.wait(timeout=30)  # run d closed: idle, it ends


def test_the_relay_holds_on_while_a_stage_that_warmed_it_or_holds_a_run_open_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(SWITCH, "1")
    database = tmp_path / "mlruns.db"
    kwargs = f"uri='sqlite:///{database}', experiment='lora', run_id_file=Path('{tmp_path}/run.json')"
    opening = f"t = open_relayed({kwargs}, execution='e'); t.log_params({{'a': 1}})"
    warming = f"warm('sqlite:///{database}'); {opening}; t.close()"  # the warmed relay is the one the stage uses
    for code in (warming, opening):  # then a stage that ends without closing its run, as a killed one
        preamble = "from pathlib import Path\nfrom pipeline.tracking.relay import open_relayed, warm\n"
        stage = subprocess.Popen(
            [sys.executable, "-c", f"{preamble}{code}\nprint('working', flush=True)\ninput()"],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert stage.stdout.readline() == b"working\n"
        (relay,) = relays(database)
        with pytest.raises(psutil.TimeoutExpired):
            relay.wait(timeout=4)  # idle four times over: the stage's work goes on
        stage.communicate(b"\n", timeout=30)
        relay.wait(timeout=30)  # the stage ended: idle, the relay ends


def test_switched_off_the_stage_calls_mlflow_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(SWITCH, "off")
    tracker = open_relayed(uri=f"sqlite:///{tmp_path}/mlruns.db", experiment="lora", run_id_file=tmp_path / "r.json")
    assert type(tracker) is Tracker and not tracker.disabled
    tracker.close()
    assert not relays(tmp_path / "mlruns.db")


def test_a_tracking_server_is_never_relayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in HTTP_DEFAULTS:  # what open_run sets is undone after the test
        monkeypatch.setenv(name, "0")
    tracker = open_relayed(uri="http://127.0.0.1:9", experiment="lora", run_id_file=tmp_path / "h.json")
    assert type(tracker) is Tracker and tracker.disabled and tracker.missing
