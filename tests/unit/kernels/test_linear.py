"""Frozen fp32 Linear layers through oneDNN (pipeline/kernels/linear.py): the product within fp32 rounding of an fp64
reference, forward and backward; in a LoRA model the loss and every trained gradient those of nn.Linear's MKL path
within fp32 rounding, only frozen fp32 layers changed and nothing more kept for the backward pass."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.kernels import linear as cpu_linear
from tests.helpers.lora_model import step, tiny_lora

pytestmark = pytest.mark.needs("this PyTorch has no oneDNN" if cpu_linear._MATMUL is None else None)
UNIT = 2**-24  # fp32's unit roundoff


@pytest.mark.parametrize("shape", [(512, 576, 1536), (85, 1536, 4099), (3, 7, 5)], ids=str)
def test_product_within_fp32_rounding(shape):
    rows, inner, outer = shape
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(rows, inner, generator=generator), torch.randn(outer, inner, generator=generator)
    bias = torch.randn(outer, generator=generator)
    exact = x.double() @ weight.double().T + bias.double()
    bound = (x.double().abs() @ weight.double().abs().T + bias.double().abs()) * UNIT
    got = cpu_linear.matmul_nt(x, weight, bias)
    assert got.dtype == torch.float32
    error = (got.double() - exact).abs()
    # a few units of rounding per element where the worst case of a sum of `inner` products is `inner` units
    assert (error / bound).max() < 8, (error / bound).max()
    assert error.norm() / exact.norm() < 1e-6
    mkl = (x @ weight.T + bias).double()
    assert error.norm() < 3 * (mkl - exact).norm()  # as close as MKL's within a small factor


def test_gradient_is_the_transposed_product():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 48, generator=generator, requires_grad=True)
    layer = torch.nn.Linear(48, 40).requires_grad_(False)
    grad = torch.randn(2, 9, 40, generator=generator)
    reference = layer(x)
    reference.backward(grad)
    want = x.grad.clone()
    x.grad = None
    assert cpu_linear.install(layer) == 1
    out = layer(x)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-6)
    out.backward(grad)
    torch.testing.assert_close(x.grad, want, atol=1e-6, rtol=1e-6)
    assert layer.weight.grad is None and layer.bias.grad is None


def test_lora_model_trains_as_with_nn_linear():
    reference = tiny_lora(torch.float32)
    model = copy.deepcopy(reference)
    # 2 layers x 7 projections and the head's frozen original; not LoRA's A and B, not the head's trained copy
    assert cpu_linear.install(model) == 15
    want_loss, want_grads, want_kept = step(reference)
    loss, grads, kept = step(model)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == want_grads.keys() and any("lm_head" in n for n in grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert kept <= want_kept  # the input, as nn.Linear keeps it; the weight is a parameter


def test_other_dtypes_are_left_to_pytorch():
    assert cpu_linear.install(tiny_lora(torch.bfloat16)) == 0
    assert not cpu_linear.applies(torch.zeros(2, 2, dtype=torch.float16))


def test_the_kernels_products_skip_deepspeed_s_replacement_of_linear(monkeypatch):
    """ZeRO-3's zero.Init replaces torch.nn.functional.linear for the whole process with DeepSpeed's memory-efficient
    autograd function; the kernels' products (inside autograd functions of their own) call ATen's linear: the same
    values as PyTorch's linear bit for bit, and DeepSpeed's wrapper not called."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    calls = []

    def replaced(*args, **kwargs):  # as zero.Init leaves it, counted
        calls.append(1)
        return zero3_linear_wrap(*args, **kwargs)

    x, weight, bias = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    want = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16())
    monkeypatch.setattr(torch.nn.functional, "linear", replaced)
    torch.nn.functional.linear(x, weight)
    assert calls == [1]  # the replacement is in place
    got = cpu_linear.matmul_nt(x.bfloat16(), weight.bfloat16(), bias.bfloat16())  # bf16: not oneDNN's path here
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
