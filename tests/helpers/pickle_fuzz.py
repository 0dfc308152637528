"""A seeded, time-bounded fuzzer of the checkpoint loader (pipeline/checkpoints/safe_pickle.py). It mutates the
pickles of a real checkpoint's files (opcodes swapped, truncation, random bytes, integer arguments pushed to their
limits, hostile payloads and hashing bombs and pieces of other files spliced in, the zip itself damaged, whole
crafted files in its place: TorchScript archives, DEFLATE bombs, stride tricks), writes each case as a torch
file and loads it in a worker process, many cases per worker. Every case must end in a clean refusal (a ValueError
of the loader naming the file), in the original data, or in other data made only of the kinds a checkpoint holds (a
mutated number or name), checked by a walk of this module's own; then RNG states go through their schema and
`set_rng_state`, DeepSpeed's states through `engine_loads.revive`. Never another exception (a traceback), a
signal or a hang: those are failures, kept with the case's bytes for replay.

    python -m tests.helpers.pickle_fuzz TAG_FOLDER [--seconds 600] [--cases N] [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pickletools
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from tests.helpers import crafted_pickles as crafted

KINDS = ("opcode", "truncate", "bytes", "insert", "argument", "payload", "crossover", "file", "whole")
OPCODES = [ord(op.code) for op in pickletools.opcodes]
INT_ARGS = {"BININT": "<i", "BININT1": "<B", "BININT2": "<H", "BINPUT": "<B", "BINGET": "<B", "LONG_BINPUT": "<I"}
LIMITS = (0, 1, 2, 4, 255, 65535, 2**31 - 1, -1, -(2**31), 2**32 - 1)
CASE_SECONDS = 20.0  # a case still running after this is a hang
BATCH = 500  # cases per worker process
SCRATCH = Path("/dev/shm")  # where cases are written, when there is one (memory, not disk)
TAG = "@pickle-fuzz"  # how the worker's reports stand out from what libraries print


def sources(folder: Path) -> list[Path]:
    """The torch files of a checkpoint tag (and of a universal form's first parameter, if given one)."""
    found = sorted(p for p in Path(folder).rglob("*.pt") if p.stat().st_size < 64 << 20)
    if not found:
        raise FileNotFoundError(f"{folder}: no .pt files to fuzz")
    return found


def op_starts(data: bytes) -> list[tuple[int, str]]:
    """(position, opcode name) of each opcode of a well-formed pickle."""
    return [(pos, op.name) for op, _, pos in pickletools.genops(data)]


def mutate(rng: random.Random, kind: str, data: bytes, ops: list, others: list[bytes], marker: Path) -> bytes:
    """One mutation of the pickle `data` (whose opcodes start at `ops`)."""
    if kind == "opcode":
        pos = rng.choice(ops)[0]
        return data[:pos] + bytes([rng.choice(OPCODES)]) + data[pos + 1 :]
    if kind == "truncate":
        return data[: rng.randrange(len(data))]
    if kind == "bytes":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    if kind == "insert":
        pos = rng.randrange(len(data))
        return data[:pos] + rng.randbytes(rng.randint(1, 16)) + data[pos:]
    if kind == "argument":
        candidates = [(pos, name) for pos, name in ops if name in INT_ARGS]
        if not candidates:
            return data[:-1]
        pos, name = rng.choice(candidates)
        fmt = INT_ARGS[name]
        size = {"<i": 4, "<I": 4, "<H": 2, "<B": 1}[fmt]
        value = rng.choice(LIMITS) % (1 << (8 * size))
        return data[: pos + 1] + value.to_bytes(size, "little") + data[pos + 1 + size :]
    if kind == "payload":
        payload, _ = rng.choice(list(crafted.payloads(marker).values()))
        if rng.random() < 0.5:
            return crafted.splice(data, "fuzz", payload)
        pos = rng.choice(ops)[0]
        return data[:pos] + payload + data[pos:]
    other = rng.choice(others)
    other_ops = op_starts(other)
    a, b = sorted(rng.sample(range(len(other_ops)), 2)) if len(other_ops) > 2 else (0, 1)
    piece = other[other_ops[a][0] : other_ops[b][0]]
    pos = rng.choice(ops)[0]
    return data[:pos] + piece + data[pos:]


def write_case(seed: int, index: int, files: list[Path], pickles: list[bytes], work: Path) -> tuple[Path, str, int]:
    """Case `index` of `seed`, written under `work`: (its file, its mutation, the source's position)."""
    rng = random.Random(f"{seed}:{index}")
    which = rng.randrange(len(files))
    kind = KINDS[index % len(KINDS)]
    out = work / f"case{index}.pt"
    if kind == "whole":  # a crafted file in the source's place (TorchScript, inflation, stride tricks)
        shutil.copy(files[which], out)
        rng.choice(list(crafted.files(work / "executed").values()))[0](out)
    elif kind == "file":
        data = bytearray(files[which].read_bytes())
        if rng.random() < 0.5:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 16)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        out.write_bytes(bytes(data))
    else:
        original = pickles[which]
        body = mutate(rng, kind, original, op_starts(original), pickles, work / "executed")
        crafted.rewrite_torch_file(files[which], out, body)
    return out, kind, which


# -- the worker -------------------------------------------------------------------------------------------------------
def same(a: object, b: object) -> bool:
    """Deep equality of loaded checkpoint values (tensors and arrays by dtype, shape and bytes)."""
    import numpy as np
    import torch

    from pipeline.checkpoints.safe_pickle import StandIn

    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, StandIn):
        return a.pickled_as == b.pickled_as and same(a.fields, b.fields)
    if isinstance(a, dict):
        attributes = vars_of(a), vars_of(b)
        same_attributes = attributes == ({}, {}) or same(*attributes)
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a) and same_attributes
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def vars_of(value: object) -> dict:
    return dict(getattr(value, "__dict__", {}))


def data_only(value: object, depth: int = 0) -> None:
    """Raise unless `value` is made of what checkpoints hold (this module's own list, independent of the loader's)."""
    import argparse as _argparse

    import numpy as np
    import torch

    from pipeline.checkpoints.safe_pickle import StandIn

    if depth > 70:
        raise AssertionError("nested deeper than the loader allows")
    leaves = (
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        bytearray,
        slice,
        torch.Size,
        torch.device,
        torch.dtype,
    )
    if type(value) in leaves or type(value) is torch.storage.TypedStorage:
        return
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        children = list(vars_of(value).values())
    elif type(value) is np.ndarray or isinstance(value, np.generic | np.dtype):
        dtype = value if isinstance(value, np.dtype) else value.dtype
        assert dtype.kind in "biufc" and not dtype.hasobject and dtype.names is None, f"numpy {dtype}"
        return
    elif isinstance(value, StandIn):
        children = list(value.fields.values())
    elif type(value) is _argparse.Namespace:
        children = list(vars(value).values())
    elif type(value).__name__ in ("dict", "OrderedDict"):
        children = [x for pair in value.items() for x in pair] + list(vars_of(value).values())
    elif type(value) in (list, tuple, set, frozenset):
        children = list(value)
    else:
        import deepspeed.runtime.fp16.loss_scaler as scalers

        assert type(value) in (scalers.LossScaler, scalers.DynamicLossScaler), f"a {type(value)} in the result"
        children = list(vars(value).values())
    for child in children:
        data_only(child, depth + 1)


def classify(path: Path, original: object) -> str:
    """How loading `path` ended, as one word (failures raise)."""
    from pipeline.checkpoints import engine_loads, folder, safe_pickle

    try:
        value = safe_pickle.load(path)
    except safe_pickle.UnsafePickle as err:
        assert str(path) in str(err), err
        return "refused"
    except safe_pickle.UnreadablePickle as err:
        assert str(path) in str(err), err
        return "unreadable"
    data_only(value)
    verdict = "original" if same(value, original) else "other-data"
    try:
        if path.name.startswith("rng_state"):
            folder.set_rng_state(folder.check_rng_state(value, path))
        elif isinstance(value, dict):
            data_only(engine_loads.revive(value, path))
    except ValueError as err:
        assert str(path) in str(err), err
        return "schema"
    return verdict


def worker(seed: int, files: list[Path], work: Path) -> None:
    """Read case indices on stdin; for each, print `TAG start I` and then `TAG done I KIND OUTCOME` (the outcome of
    an unexpected exception carries its traceback)."""
    from pipeline.checkpoints import safe_pickle

    originals = [safe_pickle.load(f) for f in files]
    pickles = [crafted.pickle_of(f)[1] for f in files]
    for line in sys.stdin:
        index = int(line)
        print(f"{TAG} start {index}", flush=True)
        path, kind, which = write_case(seed, index, files, pickles, work)
        try:
            outcome = classify(path.rename(work / f"{files[which].stem}.{index}.pt"), originals[which])
        except Exception:
            outcome = "exception:" + json.dumps(traceback.format_exc()[-2000:])
        for leftover in work.glob(f"*.{index}.pt"):
            leftover.unlink()
        print(f"{TAG} done {index} {kind} {outcome}", flush=True)


# -- the parent -------------------------------------------------------------------------------------------------------
def run(*, folder: Path, seconds: float, cases: int | None, seed: int, out: Path) -> dict:
    """Fuzz the files of `folder` for `seconds` (or `cases` cases); the report, with every failure kept in `out`."""
    files = sources(folder)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pickle-fuzz-", dir=SCRATCH if SCRATCH.is_dir() else None) as scratch:
        return _run(files=files, seconds=seconds, cases=cases, seed=seed, out=out, work=Path(scratch))


def _run(*, files: list[Path], seconds: float, cases: int | None, seed: int, out: Path, work: Path) -> dict:
    start = time.monotonic()
    counts: Counter = Counter()
    failures: list[dict] = []
    index = 0
    while time.monotonic() - start < seconds and (cases is None or index < cases):
        batch = list(range(index, index + BATCH if cases is None else min(index + BATCH, cases)))
        index = _run_batch(batch, seed=seed, files=files, work=work, counts=counts, failures=failures, out=out)
        if (work / "executed").exists():
            failures.append({"case": index, "outcome": "a payload ran (the marker file exists)"})
            break
    return {
        "seed": seed,
        "seconds": round(time.monotonic() - start, 1),
        "cases": sum(counts.values()),
        "files": [str(f) for f in files],
        "outcomes": dict(sorted(Counter(o for (_, o) in counts.elements()).items())),
        "by_mutation": {k: dict(sorted(Counter(o for (m, o) in counts.elements() if m == k).items())) for k in KINDS},
        "failures": failures,
    }


class Lines:
    """Lines of a worker's stdout, each within a deadline (None: the worker hung)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def next(self, timeout: float) -> str | None:
        """The next line; "" at end of output; None when none came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return ""
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def _run_batch(batch: list[int], *, seed, files, work, counts: Counter, failures: list, out: Path) -> int:
    """Feed `batch` to one worker; returns the next index to run (after a failure: the one after it)."""
    command = [sys.executable, "-m", "tests.helpers.pickle_fuzz", "--worker", "--seed", str(seed), "--work", str(work)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    worker_process = subprocess.Popen(
        [*command, *map(str, files)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    worker_process.stdin.write("".join(f"{i}\n" for i in batch).encode())
    worker_process.stdin.close()
    lines = Lines(worker_process.stdout.fileno())
    current, done = None, 0
    while done < len(batch):
        line = lines.next(CASE_SECONDS * 3 if current is None else CASE_SECONDS)  # 3x: the worker's imports
        if not line:
            failed = current if current is not None else batch[done]
            worker_process.kill()
            code = worker_process.wait()
            outcome = "hang" if line is None else f"signal {-code}" if code < 0 else f"worker-exit {code}"
            _keep(failed, outcome, seed=seed, files=files, work=work, failures=failures, out=out, counts=counts)
            return failed + 1
        if not line.startswith(TAG + " "):
            continue
        words = line[len(TAG) + 1 :].split(" ", 3)
        if words[0] == "start":
            current = int(words[1])
            continue
        case, kind, outcome = int(words[1]), words[2], words[3].strip()
        done += 1
        counts[(kind, outcome.split(":")[0])] += 1
        if outcome.startswith("exception"):
            failures.append({"case": case, "mutation": kind, "outcome": json.loads(outcome.split(":", 1)[1])})
        current = None
    worker_process.wait()
    return batch[-1] + 1


def _keep(case: int, outcome: str, *, seed, files, work, failures: list, out: Path, counts: Counter) -> None:
    """Record a case that killed or hung its worker, and keep its file for replay."""
    pickles = [crafted.pickle_of(f)[1] for f in files]
    path, kind, _ = write_case(seed, case, files, pickles, work)
    kept = out / f"failure-{case}.pt"
    shutil.move(path, kept)
    counts[(kind, outcome.split()[0])] += 1
    failures.append({"case": case, "mutation": kind, "outcome": outcome, "file": str(kept)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", type=Path, nargs="+", help="a checkpoint tag folder (or, for --worker, its files)")
    parser.add_argument("--seconds", type=float, default=600.0, help="time budget")
    parser.add_argument("--cases", type=int, help="stop after this many cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("fuzz-pickles"), help="report and failing cases")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.seed, args.files, args.work)
        return
    report = run(folder=args.files[0], seconds=args.seconds, cases=args.cases, seed=args.seed, out=args.out)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({**report, "files": len(report["files"]), "failures": len(report["failures"])}, indent=2))
    sys.exit(1 if report["failures"] else 0)


if __name__ == "__main__":
    main()
