"""The compiled decoder layers (pipeline/kernels/compiled_layers.py), the GPU's path, run on the CPU: over the layer
paths a GPU installs (PyTorch's operators: no oneDNN matmul, no C++ kernels), the same loss and gradients as the
uncompiled model within fp32 rounding, and one graph shared by every layer (two: the first layer's input needs no
gradient, the others' do), none compiled again in a second step."""

from __future__ import annotations

import copy

import torch

from pipeline.data.batches import collate
from pipeline.kernels import compiled_layers, fused_loss, lean_layers, linear, lora_linear
from tests.helpers.lora_model import TARGETS, step, tiny_lora


def test_compiled_layers_train_as_the_eager_ones(monkeypatch):
    monkeypatch.setattr(linear, "_MATMUL", None)  # a GPU's matmuls: torch's
    monkeypatch.setattr(lean_layers, "_kernels", lambda x: None)  # a GPU's MLP and norm: torch's operators
    torch._dynamo.reset()
    eager = tiny_lora(torch.float32, layers=3)
    for install in (lean_layers.install, lora_linear.install, fused_loss.install):
        install(eager)
    compiled = copy.deepcopy(eager)
    assert compiled_layers.install(compiled) == 3
    before = compiled_layers.graphs()  # PyTorch's counters outlive torch._dynamo.reset()
    want_loss, want, _ = step(eager)
    got_loss, got, _ = step(compiled)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    graphs = compiled_layers.graphs() - before
    assert graphs == 2, graphs
    step(compiled)
    assert compiled_layers.graphs() - before == graphs, "a second step compiled again"


def test_rows_of_changing_length_compile_a_static_graph_for_each_bucketed_width(monkeypatch):
    """SFT rows and DPO pairs change length every step; the loop pads them to a few widths (bucketed_width), each
    compiled once, static (one graph for any length cost the host twice as much a call on torch 2.11; one graph per
    length cost an H200 9 s of compiling a step)."""
    monkeypatch.setattr(linear, "_MATMUL", None)
    monkeypatch.setattr(lean_layers, "_kernels", lambda x: None)
    torch._dynamo.reset()
    model = tiny_lora(torch.float32, layers=2)
    compiled_layers.install(model)
    before = compiled_layers.graphs()  # PyTorch's counters outlive torch._dynamo.reset()
    counts = []
    for length in (65, 70, 97, 72, 100):  # widths 72, 72, 104, 72, 104
        ids = torch.randint(0, 101, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        batch = collate([{"input_ids": ids, "labels": ids}] * 2, pad_id=0, bucketed=True)
        model(**batch).loss.backward()
        counts.append(compiled_layers.graphs() - before)
    assert counts == [2, 2, 4, 4, 4], f"graphs after each length: {counts}"


def test_checkpointed_layers_keep_only_their_inputs_once_compiled(monkeypatch):
    """Activation checkpointing around a compiled layer keeps what it keeps around the eager one (each layer's input,
    not its activations), with the same loss and gradients: compiled with the checkpoint inside the graph, PyTorch
    2.11 kept every activation (an 8B model at 4k tokens: 33.1 GB on an H100 where 19.7 GB was measured eager) and
    2.13 part of them (1.5x the eager bytes in this test)."""
    monkeypatch.setattr(linear, "_MATMUL", None)
    monkeypatch.setattr(lean_layers, "_kernels", lambda x: None)
    torch._dynamo.reset()
    eager = tiny_lora(torch.float32, layers=3)
    for install in (lean_layers.install, lora_linear.install, fused_loss.install):
        install(eager)
    _, _, whole = step(eager)
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = copy.deepcopy(eager)
    compiled_layers.install(compiled)
    want_loss, want, want_kept = step(eager)
    got_loss, got, got_kept = step(compiled)
    assert want_kept < whole / 2, (want_kept, whole)
    assert got_kept == want_kept, f"compiled and checkpointed: {got_kept} bytes kept, eager {want_kept}"
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_compiled_layers_under_the_tiled_mlp_and_offloaded_checkpoints_train_as_the_eager_ones(monkeypatch):
    """The long-sequence paths (issue 46) with the compiled layers, installed in the train stage's order: the MLP in
    tiles (two here, DeepSpeed's TiledMLP) between the layer's graphs, the offloaded checkpoint around the compiled
    forward; the same loss and gradients as the eager layers with the same paths, within fp32 rounding, every layer
    sharing the graphs (a tiled MLP bound per layer as its own object compiled each layer again: 64 graphs for the 8B
    on an H100), and no graph compiled again in a second step."""
    from pipeline.kernels import offloaded_checkpoints
    from pipeline.model import tiled_mlp

    monkeypatch.setattr(linear, "_MATMUL", None)
    monkeypatch.setattr(lean_layers, "_kernels", lambda x: None)
    torch._dynamo.reset()
    models = []
    for compiled in (False, True):
        model = tiny_lora(torch.float32, layers=3)
        for install in (lean_layers.install, lora_linear.install, fused_loss.install):
            install(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compiled:
            assert compiled_layers.install(model) == 3
        assert tiled_mlp.install(model) == 3 and offloaded_checkpoints.install(model) == 3
        models.append(model)
    eager, compiled = models
    before = compiled_layers.graphs()
    want_loss, want, _ = step(eager)
    got_loss, got, _ = step(compiled)
    graphs = compiled_layers.graphs() - before
    # shared by the 3 layers: one for the forward without gradients, five for the recomputation (DeepSpeed's TiledMLP,
    # whose backward runs autograd itself and assigns a tile's .grad, splits it: the graph before it, those after)
    assert graphs == 6, f"{graphs} graphs for 3 layers"
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    step(compiled)
    assert compiled_layers.graphs() - before == graphs, "a second step compiled again"


def test_compiled_layers_under_zero3_train_as_the_eager_ones(tmp_path):
    """Under ZeRO-3, which gathers each decoder layer whole before its forward and again before its backward, and
    releases it after: one rank over gloo in a process of its own (tests/helpers/compiled_zero3_worker.py), two steps
    of a tiny LoRA model with a trained head, the same losses and trained tensors compiled as eager, no graph compiled
    again in the second step; and with zero3_fetch's fetch (no host sync) the very tensors of DeepSpeed's, and with
    zero3_release's release as well (every release direct, none through DeepSpeed's partitioning path)."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    from pipeline.core.environment import with_venv_path
    from tests.conftest import REPO

    command = [sys.executable, "-m", "tests.helpers.compiled_zero3_worker", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, env=with_venv_path(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = ("eager", "compiled", "fetched", "released")
    eager, compiled, fetched, released = (load_file(tmp_path / f"{n}.safetensors") for n in runs)
    assert eager.keys() == compiled.keys() == fetched.keys() == released.keys()
    assert sum("lora_" in k for k in eager) == 3 * 2 * len(TARGETS)
    for name, tensor in eager.items():
        torch.testing.assert_close(compiled[name], tensor, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(fetched[name], tensor, atol=0, rtol=0, msg=name)  # the same tensors, no copy
        torch.testing.assert_close(released[name], tensor, atol=0, rtol=0, msg=name)
    counts = json.loads((tmp_path / "counts.json").read_text())
    # one graph for every layer and both steps: under ZeRO-3 the first layer's input needs a gradient too
    assert counts["compiled_graphs"] == 1
    # zero3_fetch fetched every layer, the embedding and the head without DeepSpeed's handle, both steps
    assert counts["fetches"] >= 2 * 2 * 3, counts
    # DeepSpeed released through its own path until zero3_release was installed, then never: each layer forward and
    # backward, both steps, and the persistent tensors at each step's end, all directly
    ours = counts["deepspeed_releases"] - counts["deepspeed_releases_before_released"]
    assert counts["deepspeed_releases_before_fetched"] > 0 and ours == 0, counts
    assert counts["direct_releases"] >= 2 * 2 * 3, counts
