"""`make gpu-wheels`: the pinned packages a bare GPU machine lacks, as Python wheels in one folder (default .whl/,
git-ignored), to carry to a machine that cannot download (the lent GPU machine here: Python 3.12 with torch,
transformers, peft, pyarrow and numpy but none of the rest). Binary wheels come from the package index for the
target Python; DeepSpeed and ANTLR's runtime publish only source archives, built here into pure-Python wheels
(DeepSpeed's ops JIT-compile there with nvcc). Versions are constraints.txt's, so the GPU runs our pins; transformers
and peft too, since the machine's own differ. About 20 MB.

    python -m tools.gpu_wheels [--out .whl] [--python-version 3.12] [--bitsandbytes]   # QLoRA: 43 MB more

Then, on the GPU machine, in the project's root (with `make run`'s artifacts/tokenizer and data/corpus):

    python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 -m bench.gpu_check
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = (  # what our stages import that the machine lacks, with what those import in turn
    "deepspeed", "hjson", "hydra-core", "omegaconf", "antlr4-python3-runtime", "pydantic", "pydantic_core",
    "annotated-types", "typing-inspection", "datasets", "dill", "multiprocess", "transformers", "peft",
)  # fmt: skip
TEST_PACKAGES = ("pytest", "pluggy", "iniconfig", "pygments")  # gpu-check runs the `gpu`-marked unit tests
SOURCE_ONLY = ("deepspeed", "antlr4-python3-runtime")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pins(constraints: Path) -> dict[str, str]:
    """constraints.txt's `name==version` lines, by lower-case name."""
    lines = constraints.read_text(encoding="utf-8").splitlines()
    return {n.lower(): v for n, _, v in (line.partition("==") for line in lines if "==" in line)}


def pinned(name: str, versions: dict[str, str]) -> str:
    if name.lower() not in versions:
        raise SystemExit(f"tools.gpu_wheels: {name} is not pinned in constraints.txt; expected a `{name}==` line")
    return f"{name}=={versions[name.lower()]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".whl"))
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--bitsandbytes", action="store_true", help="also bitsandbytes (gpu-check's QLoRA step)")
    args = parser.parse_args(argv)
    versions = pins(Path("constraints.txt"))
    args.out.mkdir(exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    names = [*PACKAGES, *TEST_PACKAGES, *(["bitsandbytes"] if args.bitsandbytes else [])]
    binary = [pinned(n, versions) for n in names if n not in SOURCE_ONLY]
    platforms = [x for p in PLATFORMS for x in ("--platform", p)]
    subprocess.run([
        *pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", args.python_version,
        "--implementation", "cp", *platforms, "-d", str(args.out), *binary,
    ], check=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        sources = [pinned(n, versions) for n in SOURCE_ONLY]
        subprocess.run([*pip, "download", "-q", "--no-deps", "--no-binary=:all:", "-d", tmp, *sources], check=True)
        for archive in sorted(Path(tmp).iterdir()):
            subprocess.run(
                [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(args.out), str(archive)],
                check=True,
            )
    size = sum(f.stat().st_size for f in args.out.glob("*.whl"))
    print(f"gpu-wheels: {len(list(args.out.glob('*.whl')))} wheels, {size / 2**20:.1f} MB in {args.out}")


if __name__ == "__main__":
    main()
