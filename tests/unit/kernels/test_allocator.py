"""The train ranks' CPU allocator (pipeline/kernels/allocator.py), in a fresh interpreter (it cannot be uninstalled):
large tensors from its region, small ones not; every live tensor keeps its bytes through random allocations and
frees (no two overlap); freed neighbours merge, and all freed leaves nothing split; a step-like pattern with small
tensors that live on reaches its high-water mark in the first step and not again; tensors from before, oneDNN's raw
buffers and frees from another thread all work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, random, threading
import torch
from pipeline.kernels import allocator as cpu_allocator
before = torch.zeros(1 << 20)  # from the allocator PyTorch had
assert cpu_allocator.install() and cpu_allocator.install()  # once; a second call changes nothing
seen = {}
small = torch.zeros(1000)
seen["small_in_region"] = cpu_allocator.usage()[0] > 0
large = torch.zeros(1 << 20)
seen["large_in_region"] = cpu_allocator.usage()[0] >= 4 << 20
del before, small, large

rng = random.Random(0)
live = {}
for i in range(3000):
    if live and rng.random() < 0.45:
        del live[rng.choice(list(live))]
    else:
        n = rng.choice([rng.randint(1, 5000), rng.randint(70_000, 3_000_000)])
        live[i] = torch.full((n,), float(i))
seen["intact"] = all(bool((t == float(i)).all()) for i, t in live.items())
live.clear()
seen["nothing_split_when_all_freed"] = cpu_allocator.usage()[1] == 0

def step(kept):
    activations = [torch.empty(n) for n in (300_000, 900_000, 300_000, 2_000_000, 600_000) * 6]
    kept.append(torch.empty(80_000))  # optimizer-like state that lives on, allocated mid-step
    grads = []
    while activations:
        activations.pop()
        grads.append(torch.empty(rng.choice([300_000, 600_000])))
        if len(grads) > 3:
            grads.pop(0)

kept, marks = [], []
for _ in range(5):
    step(kept)
    marks.append(cpu_allocator.usage()[0])
seen["no_growth_after_first_step"] = len(set(marks)) == 1

x = torch.randn(64, 96)
weight = torch.randn(80, 96)
out = torch.ops.mkldnn._linear_pointwise(torch.randn(700, 96), weight, None, "none", [], "")  # raw buffers
seen["onednn"] = tuple(out.shape) == (700, 80)
shared = [torch.empty(1 << 20) for _ in range(4)]
worker = threading.Thread(target=shared.clear)
worker.start()
worker.join()
seen["freed_in_thread"] = not shared
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_allocator_in_a_fresh_interpreter():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "small_in_region": False,
        "large_in_region": True,
        "intact": True,
        "nothing_split_when_all_freed": True,
        "no_growth_after_first_step": True,
        "onednn": True,
        "freed_in_thread": True,
    }
