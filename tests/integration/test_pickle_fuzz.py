"""The checkpoint loader under a seeded fuzzer (tests/helpers/pickle_fuzz.py): the pickles of a real checkpoint (the
session's 2-rank ZeRO-2 run: model states, optimizer shards, RNG states; and a universal form's files) mutated,
each case loaded in a worker process, many per worker. Every case ends in a clean refusal, the original data, or
other data of the kinds a checkpoint holds; no traceback, signal or hang. `make test` runs the short mode
(PICKLE_FUZZ_CASES cases, 800 unless set, within PICKLE_FUZZ_SECONDS); `make fuzz` runs it for 10 minutes with no
case limit and keeps the report (and any failing case) in fuzz-pickles/."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pipeline.checkpoints.universal import to_universal
from tests.helpers import pickle_fuzz

pytestmark = pytest.mark.integration


def test_fuzzed_checkpoint_pickles_end_in_a_refusal_or_in_data(two_ranks_zero2, tmp_path, request):
    tag = two_ranks_zero2 / "checkpoints" / "step_000006"
    sources = tmp_path / "sources"
    sources.mkdir()
    for path in tag.glob("*.pt"):
        shutil.copy(path, sources / path.name)
    to_universal(tag, tmp_path / "universal")
    parameter = sorted((tmp_path / "universal" / "zero").iterdir())[0]
    for path in parameter.glob("*.pt"):
        shutil.copy(path, sources / f"universal_{path.name}")
    cases = int(os.environ.get("PICKLE_FUZZ_CASES", "800")) or None
    seconds = float(os.environ.get("PICKLE_FUZZ_SECONDS", "300"))
    out = Path(os.environ.get("PICKLE_FUZZ_OUT") or tmp_path / "fuzz")
    report = pickle_fuzz.run(
        folder=sources, seconds=seconds, cases=cases, seed=int(os.environ.get("PICKLE_FUZZ_SEED", "0")), out=out
    )
    (out / "report.json").write_text(json.dumps(report, indent=2))
    request.node.user_properties.append(
        ("fuzzed", json.dumps({k: report[k] for k in ("seed", "seconds", "cases", "outcomes")}))
    )
    assert report["failures"] == [], json.dumps(report["failures"][:5], indent=1)[:6000]
    assert all(report["by_mutation"][kind] for kind in pickle_fuzz.KINDS), report["by_mutation"]
