"""Every crafted construct (tests/helpers/crafted_pickles.py: payloads spliced into a file, and whole crafted files)
through every entry point that reads a pickle, in one process (imports paid once): consolidate and convert both ways
(`pipeline.cli.main`, as the commands run), the train stage's resume (`resume.prepare` under the stages' error
handling: train.resume_from, the run's own folder, a checkpoint of another layout and the universal form beside it,
RNG states), merge and evaluate with `.bin` bases and adapters (evaluate, which loads a tokenizer and a model first,
with a few constructs; every construct goes through consolidate). Each case gets a fresh copy of its inputs (hard
links) in which one file carries the payload, then must: exit 2 with one line naming that file and the construct,
print no traceback, leave the marker file unmade, write no output and leave every input file as it was. Python's
copyreg registry holds posix.system under the EXT code, so that the EXT payloads are live.

    python -m tests.helpers.untrusted_entries CONFIG.json      # one JSON line per case on stdout
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.helpers import crafted_pickles as crafted

CORE = (
    "GLOBAL posix.system", "INST os.system", "OBJ os.system", "OBJ of an allowed class", "EXT1 posix.system",
    "NEWOBJ argparse.Namespace whose state calls posix.system",
    "NEWOBJ of a loss scaler with a state of Python's own fields", "numpy array of object dtype",
    "numpy void dtype claiming object items", "a persistent id naming a storage outside the file",
    "STACK_GLOBAL deepspeed.runtime.engine.os.system", "STACK_GLOBAL torch.os.system", "EXT4 posix.system",
    "NEWOBJ_EX argparse.Namespace whose keyword argument calls posix.system",
    "30,000 copies of one large tuple as dict keys", *crafted.files(Path("never")),
)  # fmt: skip
FEW = (  # the slow entries
    "INST os.system", "STACK_GLOBAL torch.os.system", "numpy array of object dtype", CORE[9],
    "a TorchScript archive whose __setstate__ writes a file", "a 8 x 4096 tensor of stride 0 over one element",
)  # fmt: skip
TAG = "step_000006"


@dataclass(frozen=True)
class Case:
    """One entry point's run on a copy: the file that carries the payload, the call, what it must not write."""

    target: Path
    run: Callable[[], None]
    outputs: tuple[Path, ...]
    inputs: Path


def link_copy(source: Path, out: Path) -> Path:
    shutil.copytree(source, out, copy_function=os.link)
    return out


def checkpoint_copy(config: dict, out: Path) -> Path:
    """The fixture run's checkpoint folder, its last tag only."""
    out.mkdir(parents=True)
    link_copy(Path(config["checkpoints"]) / TAG, out / TAG)
    (out / "latest").write_text(TAG)
    return out


def cli(*arguments) -> Callable[[], None]:
    from pipeline.cli import main

    return lambda: main([str(a) for a in arguments])


def resume(directory: Path, resume_from: Path | None, world_size: int) -> Callable[[], None]:
    """The train stage's resume decision as the stage makes it (bad input: one line, exit 2)."""
    from pipeline.checkpoints import folder
    from pipeline.core.errors import guarded
    from pipeline.training import resume as resume_module
    from pipeline.training.plan import Identity, RunState, Variant

    saved = folder.read_state(resume_from or directory, TAG)
    state = RunState(
        fingerprint=saved["fingerprint"], identity=Identity(**saved["identity"]), world_size=world_size,
        zero_stage=saved["zero_stage"], launch=saved["launch"], variant=Variant(**saved["variant"]),
    )  # fmt: skip

    def prepare() -> None:
        resume_module.prepare(directory=directory, state=state, resume_from=resume_from, convert=True)

    return lambda: guarded(prepare)


def bin_copy(folder: Path, out: Path, weights: str, name: str) -> Path:
    """`folder` with its safetensors weights saved again as a torch pickle `name` (as older tools write them)."""
    from safetensors.torch import load_file

    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(folder / weights), out / name)
    return out


def entries(config: dict, work: Path) -> dict[str, Callable[[Path], Case]]:
    """{entry point: make its case in a fresh folder}."""
    base, universal, adapter = Path(config["base"]), Path(config["universal"]), Path(config["adapter"])
    text = Path(config["text"])

    def consolidate(file: str) -> Callable[[Path], Case]:
        def make(at: Path) -> Case:
            ckpt = checkpoint_copy(config, at / "ckpt")
            return Case(ckpt / TAG / file, cli("consolidate", ckpt, at / "out"), (at / "out",), ckpt)

        return make

    def to_universal(at: Path) -> Case:
        ckpt = checkpoint_copy(config, at / "ckpt")
        target = ckpt / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        return Case(target, cli("convert", ckpt, at / "out", "--to", "universal"), (at / "out",), ckpt)

    def to_zero(pattern: str) -> Callable[[Path], Case]:
        def make(at: Path) -> Case:
            copy = link_copy(universal, at / "universal")
            run = cli("convert", copy, at / "out", "--to", "zero", "--base", base, "--world-size", 1, "--zero-stage", 2)
            return Case(sorted(copy.glob(pattern))[0], run, (at / "out",), copy)

        return make

    def resume_from(file: str) -> Callable[[Path], Case]:
        def make(at: Path) -> Case:
            ckpt = checkpoint_copy(config, at / "theirs")
            run = resume(at / "run" / "checkpoints", ckpt, world_size=2)
            return Case(ckpt / TAG / file, run, (at / "run",), ckpt)

        return make

    def own_folder(at: Path) -> Case:
        ckpt = checkpoint_copy(config, at / "checkpoints")
        target = ckpt / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        return Case(target, resume(ckpt, None, world_size=2), (ckpt.with_name("checkpoints.previous"),), ckpt)

    def other_layout(at: Path) -> Case:
        ckpt = checkpoint_copy(config, at / "theirs")
        run = resume(at / "run" / "checkpoints", ckpt, world_size=1)
        outputs = (at / "run", ckpt / f"{TAG}_universal")
        return Case(ckpt / TAG / "mp_rank_00_model_states.pt", run, outputs, ckpt)

    def universal_beside(at: Path) -> Case:
        ckpt = checkpoint_copy(config, at / "theirs")
        beside = link_copy(universal, ckpt / f"{TAG}_universal")
        run = resume(at / "run" / "checkpoints", ckpt, world_size=1)
        return Case(sorted(beside.glob("zero/*/fp32.pt"))[0], run, (at / "run",), ckpt)

    def merge_base(at: Path) -> Case:
        copy = bin_copy(base, at / "base", "model.safetensors", "pytorch_model.bin")
        run = cli("merge", "--base", copy, "--adapter", adapter, "--out", at / "out")
        return Case(copy / "pytorch_model.bin", run, (at / "out",), copy)

    def merge_adapter(at: Path) -> Case:
        copy = bin_copy(adapter, at / "adapter", "adapter_model.safetensors", "adapter_model.bin")
        run = cli("merge", "--base", base, "--adapter", copy, "--out", at / "out")
        return Case(copy / "adapter_model.bin", run, (at / "out",), copy)

    def evaluate_base(at: Path) -> Case:
        copy = bin_copy(base, at / "base", "model.safetensors", "pytorch_model.bin")
        run = cli("evaluate", "--model", copy, "--file", text, "--context", 16, "--stride", 16)
        return Case(copy / "pytorch_model.bin", run, (), copy)

    def evaluate_adapter(at: Path) -> Case:
        copy = bin_copy(adapter, at / "adapter", "adapter_model.safetensors", "adapter_model.bin")
        run = cli("evaluate", "--model", base, "--adapter", copy, "--file", text, "--context", 16, "--stride", 16)
        return Case(copy / "adapter_model.bin", run, (), copy)

    return {
        "consolidate (optimizer shard)": consolidate("zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        "consolidate (model states)": consolidate("mp_rank_00_model_states.pt"),
        "convert --to universal": to_universal,
        "convert --to zero (a parameter's file)": to_zero("zero/*/exp_avg.pt"),
        "convert --to zero (model states)": to_zero("*model_states.pt"),
        "train.resume_from (optimizer shard)": resume_from("zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        "train.resume_from (RNG state)": resume_from("rng_state_rank1.pt"),
        "resume of the run's own folder": own_folder,
        "resume under another layout (the tag)": other_layout,
        "resume under another layout (its universal form)": universal_beside,
        "merge (.bin base)": merge_base,
        "merge (.bin adapter)": merge_adapter,
        "evaluate (.bin base)": evaluate_base,
        "evaluate (.bin adapter)": evaluate_adapter,
    }


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every file under `folder` with its size, modification time and inode (a write, delete or rename shows)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def run_case(entry: str, make: Callable[[Path], Case], construct: str, at: Path) -> dict:
    marker = at / "executed"
    at.mkdir(parents=True)
    case = make(at)
    if construct in (whole := crafted.files(marker)):
        rewrite, named = whole[construct]
        rewrite(case.target)
    else:
        payload, named = crafted.payloads(marker)[construct]
        key = "extra"
        if case.target.name.startswith("rng_state") and construct == "numpy array of object dtype":
            key = "numpy"  # the RNG state's own numpy entry, replaced by ('MT19937', object array, 0, 0, 0.0)
            payload = crafted.tuple_(crafted.text("MT19937"), payload, *[crafted.small(0)] * 2, crafted.OP["NONE"])
        crafted.carry(case.target, key, payload)
    before = snapshot(case.inputs)
    stderr, code, escaped = io.StringIO(), None, None
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            case.run()
        except SystemExit as err:
            code = err.code
        except BaseException as err:  # noqa: BLE001 - anything else escaping the entry point is the finding
            escaped = f"{type(err).__name__}: {err}"
    message = stderr.getvalue()
    problems = []
    if escaped or code != 2:
        problems.append(f"exit {code}, escaped {escaped}")
    named_in_one_line = any(str(case.target) in line and named in line for line in message.splitlines())
    if "Traceback" in message or not named_in_one_line:
        problems.append(f"no line names {case.target} and {named!r}, or a traceback was printed")
    if marker.exists():
        problems.append("the payload ran")
    problems += [f"{p} was written" for p in case.outputs if p.exists()]
    if snapshot(case.inputs) != before:
        problems.append("an input file was written, moved or deleted")
    first = message.strip().splitlines()[0][:300] if message.strip() else ""
    return {"entry": entry, "construct": construct, "problems": problems, "message": first}


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    work = Path(config["work"])
    copyreg.add_extension("posix", "system", crafted.EXT_CODE)
    every = [*crafted.payloads(work / "never"), *crafted.files(work / "never")]
    number = 0
    for entry, make in entries(config, work).items():
        constructs = (
            every if entry.startswith("consolidate (optimizer") else FEW if entry.startswith("evaluate") else CORE
        )
        for construct in constructs:
            number += 1
            start = time.perf_counter()
            result = run_case(entry, make, construct, work / f"case{number}")
            print(json.dumps({**result, "seconds": round(time.perf_counter() - start, 2)}), flush=True)
            shutil.rmtree(work / f"case{number}", ignore_errors=True)


if __name__ == "__main__":
    main()
