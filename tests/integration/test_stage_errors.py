"""Bad input through the real stage entry points: one clear line, exit 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core import config
from pipeline.core.atomic import read_json
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def _run_stage(tmp_path: Path, stage: str, overrides: list[str], *args: str) -> subprocess.CompletedProcess:
    """The stage as a process; tracking off unless `overrides` turn it on (never into the project's own store)."""
    params = tmp_path / "params.yaml"
    raw = config.compose(REPO / "conf", ["tracking.uri=", *overrides])
    params.write_text(yaml.safe_dump(raw), encoding="utf-8")
    command = [
        sys.executable, "-m", f"stages.{stage}", "--params", str(params), "--run-id-file", str(tmp_path / "run.json"),
    ]  # fmt: skip
    return subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True)


def _assert_clean_failure(done: subprocess.CompletedProcess, message: str, out: Path) -> None:
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("data_format", "content", "message"),
    [
        ("alpaca", b'{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n', "bad.jsonl:2: missing field(s)"),
        ("text", b"ok\ncaf\xe9\n", "bad.txt:2: invalid UTF-8"),
        ("text", b"\n \n", "bad.txt: data file is empty"),
        ("text", None, "bad.txt: data file not found"),
        ("text", b'{"text": "a"}\n{"body": "b"}\n', "bad.jsonl:2: a JSON object in a text source without a 'text'"),
    ],
)
def test_cache_dataset_refuses_bad_data(tmp_path, tiny_base_dir, data_format, content, message):
    data = tmp_path / message.split(":")[0]  # the file the message names
    if content is not None:
        _write(data, content)
    out = tmp_path / "dataset"
    done = _run_stage(
        tmp_path,
        "cache_dataset",
        [f"data.format={data_format}", f"data.train_file={data}", "data.block_size=64", "data.max_seq_len=64"],
        "--tokenizer", str(tiny_base_dir), "--base-config", str(tiny_base_dir / "config.json"),
        "--out", str(out), "--metrics", str(tmp_path / "metrics.json"),
    )  # fmt: skip
    _assert_clean_failure(done, message, out)
    assert not (tmp_path / "metrics.json").exists()


def test_prepare_tokenizer_refuses_an_empty_tokenizer(tmp_path, peoples_daily):
    empty = tmp_path / "empty_tokenizer"
    empty.mkdir()
    (empty / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}, "added_tokens": []})
    )
    (empty / "tokenizer_config.json").write_text("{}")
    text = _write(tmp_path / "train.txt", "\n".join(peoples_daily[:50]).encode())
    out = tmp_path / "tokenizer"
    done = _run_stage(
        tmp_path,
        "prepare_tokenizer",
        [f"data.train_file={text}", f"data.heldout_file={text}"],
        "--base", str(empty), "--out", str(out), "--metrics", str(tmp_path / "metrics.json"),
    )  # fmt: skip
    _assert_clean_failure(done, f"{empty}:", out)


@pytest.mark.parametrize(
    ("stage", "other"), [("prepare_base", ["--tokenizer", "tok"]), ("prepare_base_tokenizer", ["--context", "c.json"])]
)
def test_the_base_stages_name_a_missing_model_and_mark_the_run_failed(tmp_path, stage, other):
    out = tmp_path / "base"
    store = f"sqlite:///{tmp_path / 'mlruns.db'}"
    done = _run_stage(
        tmp_path, stage, [f"model.path={tmp_path / 'nope'}", f"tracking.uri={store}"], "--out", str(out),
        other[0], str(tmp_path / other[1]), "--metrics", str(tmp_path / "base.json"),
        "--checked", str(tmp_path / "checked.json"),
    )  # fmt: skip
    _assert_clean_failure(done, "model.path:", out)
    assert not (tmp_path / other[1]).exists()
    from mlflow import MlflowClient

    run = MlflowClient(store).get_run(read_json(tmp_path / "run.json")["run_id"])
    assert run.info.status == "FAILED" and run.data.tags[f"stage.{stage}"] == "ran"
