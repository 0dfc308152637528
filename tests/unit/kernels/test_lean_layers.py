"""The lean SwiGLU MLP and RMSNorm (pipeline/kernels/lean_layers.py), with LoRA on the MLP's own projections and a
trained norm, in fp32 and bf16: with PyTorch's operators bit for bit transformers' loss and gradients, with the CPU
kernels within rounding of them (and the kernels against an fp64 reference as close as the operators); a third less of
the MLP's tensors and (in bf16) none of the norms' fp32 copies kept for the backward pass (with the operators fp32 norms
are left as they are: nothing to save); an MLP whose activation is not SiLU left alone. On a GPU (marked gpu) the
operators' path, bit for bit there too."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pipeline.kernels import cpp as cpu_kernels
from pipeline.kernels import lean_layers
from tests.helpers.devices import deterministic_attention
from tools.tiny_model import tiny_llama_config

LAYERS, HIDDEN, INTERMEDIATE, TOKENS = 2, 32, 96, 2 * 17
NORMS = 2 * LAYERS + 1


def tiny_lora(dtype: torch.dtype, hidden_act: str = "silu", device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=101, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, hidden_act=hidden_act
    )
    model = LlamaForCausalLM(config).to(dtype)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "gate_proj", "up_proj"],
        modules_to_save=["model.norm"],
    )
    model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    for name, param in model.named_parameters():  # B away from zero: every LoRA tensor gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model.to(device).train()


def step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[tuple, int]]:
    """Loss, the trained tensors' gradients, and how many activations of each (width, dtype) are kept for backward."""
    device = next(model.parameters()).device
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1)).to(device)
    kept: dict[int, tuple] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() and tensor.numel() == TOKENS * tensor.shape[-1]:
            kept[tensor.untyped_storage().data_ptr()] = (tensor.shape[-1], tensor.dtype)
        return tensor

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), deterministic_attention(device):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, Counter(kept.values())


@pytest.mark.parametrize(
    ("device", "kernels"),
    [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=pytest.mark.gpu)],
    ids=["operators", "cpu_kernels", "cuda_operators"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lean_layers_compute_transformers_and_keep_less(dtype, device, kernels, monkeypatch):
    """On a GPU the layers compute with PyTorch's operators (the C++ kernels are the CPU's): bit for bit there too."""
    if kernels:
        assert cpu_kernels.load() is not None, (
            "make setup builds pipeline/kernels/csrc/kernels.cpp; with gcc it must build"
        )
    else:
        monkeypatch.setattr(lean_layers, "_kernels", lambda x: None)
    reference = tiny_lora(dtype, device=device)
    lean = copy.deepcopy(reference)
    norms = NORMS + 1 if dtype == torch.bfloat16 or kernels else 0  # the final one twice: frozen, trained copy
    assert lean_layers.install(lean) == LAYERS + norms
    want, want_grads, want_kept = step(reference)
    got, got_grads, got_kept = step(lean)
    trained = ("mlp.gate_proj.lora_A", "mlp.up_proj.lora_B", "model.norm.modules_to_save")
    assert got_grads.keys() == want_grads.keys() and all(any(t in n for n in got_grads) for t in trained)
    if kernels:  # fp32: the operators' results to rounding; bf16: a rounding of the bf16 gradients' size
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6 if dtype == torch.float32 else 1e-2)
        relative = 1e-5 if dtype == torch.float32 else 2e-2
        for name, grad in want_grads.items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(got_grads[name], grad, atol=relative * scale, rtol=0, msg=name)
    else:
        assert torch.equal(got, want)
        for name, grad in want_grads.items():
            assert torch.equal(got_grads[name], grad), name
    assert (want_kept[INTERMEDIATE, dtype], got_kept[INTERMEDIATE, dtype]) == (3 * LAYERS, 2 * LAYERS)
    if dtype == torch.bfloat16:  # each layer's norms kept their input's fp32 copy; now nothing in fp32 that wide
        assert want_kept[HIDDEN, torch.float32] >= 2 * LAYERS and got_kept[HIDDEN, torch.float32] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_as_close_to_fp64_as_the_operators(compiled, dtype):
    generator = torch.Generator().manual_seed(0)
    gate = (torch.randn(3, 1000, generator=generator) * 4).to(dtype)
    up, grad = torch.randn(2, 3, 1000, generator=generator).to(dtype)

    def swiglu(g, u):
        return F.silu(g) * u

    inputs = [t.double().requires_grad_() for t in (gate, up)]
    swiglu(*inputs).backward(grad.double())
    exact = [swiglu(gate.double(), up.double()), *(t.grad for t in inputs)]
    ops = [swiglu(gate, up), torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)]
    ours = [compiled.silu_mul(gate, up), *compiled.silu_mul_backward(grad, gate, up)]
    for mine, theirs, reference in zip(ours, ops, exact, strict=True):
        assert (mine.double() - reference).abs().max() <= 1.5 * (theirs.double() - reference).abs().max()

    x = (torch.randn(6, 96, generator=generator) * 3).to(dtype)
    weight = (torch.rand(96, generator=generator) + 0.5).to(dtype)
    grad = grad.flatten()[: x.numel()].view(x.shape)
    x64 = x.double().requires_grad_()  # LlamaRMSNorm computes in fp32 whatever its dtype: the formula in fp64
    exact_out = weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    exact_out.backward(grad.double())
    norm = LlamaRMSNorm(96, eps=1e-6).to(dtype).requires_grad_(False)
    norm.weight.copy_(weight)
    x_ops = x.clone().requires_grad_()
    out_ops = norm(x_ops)
    out_ops.backward(grad)
    out, rms = compiled.rms_norm(x, weight, 1e-6)
    grad_x = compiled.rms_norm_backward(grad, x, weight, rms)
    # each row's two sums (of x^2, of grad * weight * x: 96 terms) are the compiler's, 16, 8 or 1 lanes at a time
    # (cpp.py): in any order within (n - 1) u of the sum of their terms' magnitudes (Higham's bound), carried into
    # every element of the row through the reciprocal RMS and the backward's coefficient
    order = (96 - 1) * torch.finfo(torch.float32).eps / 2
    x_double, gw = x.double(), grad.double() * weight.double()
    inv = torch.rsqrt(x_double.pow(2).mean(-1, keepdim=True) + 1e-6)
    coefficient = (gw * x_double).sum(-1, keepdim=True) * inv**3 / 96
    sums = {
        "out": exact_out.detach().abs() * order / 2,
        "grad": (gw * inv).abs() * order / 2
        + (x_double * coefficient).abs() * 1.5 * order
        + x_double.abs() * inv**3 / 96 * order * (gw * x_double).abs().sum(-1, keepdim=True),
    }
    for mine, theirs, reference, name in ((out, out_ops, exact_out, "out"), (grad_x, x_ops.grad, x64.grad, "grad")):
        error, theirs_error = (mine.double() - reference).abs(), (theirs.double() - reference).abs().max()
        assert (error <= 1.5 * theirs_error + sums[name]).all(), (name, error.max(), theirs_error)


def test_other_activations_keep_their_forward():
    model = tiny_lora(torch.bfloat16, hidden_act="gelu_pytorch_tanh")
    assert lean_layers.install(model) == NORMS + 1  # the norms only
