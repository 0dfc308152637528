"""The causal-LM loss without the full-vocabulary logits: the output head and the cross-entropy fused, a chunk of
positions at a time, only at positions whose label counts, the gradient computed in the same pass.

transformers computes `lm_head` on every position, upcasts the (tokens x vocabulary) logits to fp32, keeps them for the
backward pass and runs log-softmax forward and backward over them, several passes over it (figures: docs/kernels.md).
Here each chunk's logits live only while its loss and its gradient (softmax - one-hot) are computed; the backward pass
just scales what the forward pass kept (the gradient for the hidden states, and for a trained head its weight's). The
loss is the same mean cross-entropy over the labelled positions, the same arithmetic in a different summation order
(tests/unit/kernels/test_fused_loss.py). On a CPU, in bf16 or fp32, each row's softmax cross-entropy is one C++ pass
(pipeline/kernels/cpp.py) that writes the gradient over the row's logits, where PyTorch's operators make seven passes
over the chunk (upcast, max, subtract, exp, sum, divide, downcast). The preference objectives (DPO, ORPO, SimPO) take
each labelled position's log-probability the same way (`target_logps`), the gradient scaled per position in backward."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from types import MethodType

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from pipeline.data.batches import shifted
from pipeline.data.examples import IGNORE_INDEX
from pipeline.kernels import cpp
from pipeline.kernels.linear import matmul_nt

# Bytes of logits per chunk (in the head's dtype), by device. The chunk is memory the step holds on top of its
# activations, and each chunk streams the whole head weight from memory twice (its two matmuls): a CPU gains from
# fewer, larger chunks; a GPU needs a few hundred rows per chunk to compute at full rate (figures: docs/kernels.md).
CHUNK_BYTES = {"cpu": 2**25, "cuda": 2**27}


# Devices where picking the labelled rows by a boolean mask costs nothing (it reads the mask back to the host: on a
# GPU that waits for the forward pass mid-step); elsewhere every row is computed, the unlabelled ones weighted 0.
SELECTED_ROWS = ("cpu",)
TARGET_LOGPS = "fused_target_logps"  # the installed LM's flag; pipeline/training/preference.py reads it by name
KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # the C++ kernel's: fp16 logits are upcast by PyTorch's operators


def softmax_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's operators on any device: each row's cross-entropy (fp32) of `logits` (upcast to fp32) against
    `targets`, and softmax - one-hot (fp32; over `logits` when they already were)."""
    logits = logits.float()
    target_logits = logits.gather(1, targets[:, None]).squeeze(1)
    peak = logits.amax(dim=-1, keepdim=True)
    exp = logits.sub_(peak).exp_()  # in place: one pass for the loss and the gradient
    sums = exp.sum(dim=-1, keepdim=True)
    losses = peak.squeeze(1) + sums.log().squeeze(1) - target_logits
    grad = exp.div_(sums)  # softmax
    grad[torch.arange(len(targets), device=targets.device), targets] -= 1.0
    return losses, grad


def _head_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grads: bool):
    """The logits `hidden @ weight.T` a chunk of rows at a time: (the chunk's rows, its hidden states, each row's
    cross-entropy (fp32), and with `grads` softmax - one-hot in the head's dtype, else None)."""
    rows = max(1, CHUNK_BYTES.get(hidden.device.type, 2**26) // (weight.shape[0] * weight.element_size()))
    compiled = cpp.load() if hidden.device.type == "cpu" and weight.dtype in KERNEL_DTYPES else None
    for start in range(0, hidden.shape[0], rows):
        h, t = hidden[start : start + rows], targets[start : start + rows]
        logits = matmul_nt(h, weight)  # as transformers: the head in the module's dtype, then (here per row) upcast
        if compiled is not None:  # one pass over each row, the gradient written over its logits
            losses, grad = compiled.cross_entropy_rows(logits, t, grads), logits
        else:
            losses, grad = softmax_cross_entropy(logits, t)
            grad = grad.to(weight.dtype)
        yield slice(start, start + len(t)), h, losses, grad if grads else None


def _kept_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype a gradient for `hidden` waits in: fp16 would underflow before the loss scale multiplies it in
    backward; bf16 has fp32's range."""
    return torch.float32 if hidden.dtype == torch.float16 else hidden.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """mean over rows of cross_entropy(hidden @ weight.T, targets), gradients computed in the forward pass; with
    `weights` (0 or 1 a row) the mean over the rows weighted 1, the count kept on the device; with `denominator`,
    the sum over it."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, weights, grads: bool, denominator: int | None) -> torch.Tensor:
        n = denominator or (hidden.shape[0] if weights is None else weights.sum().clamp_min(1).float())
        grad_hidden = torch.empty_like(hidden, dtype=_kept_dtype(hidden)) if grads else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if grads and weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for part, h, losses, grad in _head_chunks(hidden, weight, targets, grads):
            total += losses.sum() if weights is None else (losses * weights[part]).sum()
            if grad is None:
                continue
            if weights is not None:  # a masked row's gradient is 0
                grad = grad * weights[part, None].to(grad.dtype)
            grad_hidden[part] = matmul_nt(grad, weight.T).div_(n)
            if grad_weight is not None:
                grad_weight.addmm_(grad.T.float(), h.float(), alpha=1.0 if weights is not None else 1.0 / n)
        if grad_weight is not None and weights is not None:
            grad_weight.div_(n)  # n is on the device: the same scale, applied once
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = (grad_hidden * grad_output).to(ctx.dtypes[0])
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output).to(ctx.dtypes[1])
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor | None = None,
    denominator: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the logits `hidden @ weight.T` (rows x vocabulary, never materialised whole) against
    `targets`: over every row, or with `weights` (a 0/1 mask) over the rows weighted 1 (those weighted 0 need a
    valid target, and cost their share of the head's work, but nothing is read back to the host). With
    `denominator`, their sum over it instead (transformers' `num_items_in_batch`: a sequence-parallel rank's share
    of its group's mean)."""
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, targets, weights, grads, denominator)


class _LinearTargetLogps(torch.autograd.Function):
    """Each row's log-probability of its target under log_softmax(hidden @ weight.T) (fp32; 0 where `weights` is),
    for a frozen weight: the gradient for `hidden` computed in the forward pass, scaled by each row's incoming
    gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, weights, grads: bool) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden, dtype=_kept_dtype(hidden)) if grads else None
        logps = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for part, _, losses, grad in _head_chunks(hidden, weight, targets, grads):
            logps[part] = -losses if weights is None else -losses * weights[part]
            if grad is not None:
                if weights is not None:
                    grad = grad * weights[part, None].to(grad.dtype)
                grad_hidden[part] = matmul_nt(grad, weight.T).neg_()
        ctx.save_for_backward(grad_hidden)
        ctx.dtype = hidden.dtype
        return logps

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_output[:, None]).to(ctx.dtype), None, None, None, None


def linear_target_logps(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's log-probability of its target under the logits `hidden @ weight.T` (rows x vocabulary, never
    materialised whole), for a frozen `weight` (a trained head's gradient would need every row's logits kept); 0
    at rows `weights` (a 0/1 mask) sets to 0."""
    if weight.requires_grad:
        raise ValueError("linear_target_logps: the head is trained; take its logits at these rows instead")
    grads = torch.is_grad_enabled() and hidden.requires_grad
    return _LinearTargetLogps.apply(hidden, weight, targets, weights, grads)


@dataclass
class TargetLogps(ModelOutput):
    """What `fused_forward` returns with `target_logps`: each position's log-probability of its next-token target
    (fp32, rows x positions), 0 where the label does not count."""

    logps: torch.Tensor | None = None


def plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The causal LM's output head when the fused loss computes what transformers' forward does (a
    bias-free Linear, frozen or trained in full; no logit scaling or soft-capping, no router loss), else None."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) is not None or hasattr(config, "logit_scale"):
        return None
    if getattr(config, "output_router_logits", False):  # a router's auxiliary loss
        return None
    head = model.get_output_embeddings()
    if hasattr(head, "modules_to_save"):  # PEFT's modules_to_save wrapper: the trained copy
        active = head.active_adapters
        usable = active and not head.disable_adapters and active[0] in head.modules_to_save
        head = head.modules_to_save[active[0]] if usable else head.original_module
    is_linear = type(head) is torch.nn.Linear and head.bias is None
    return head if is_linear else None


def fused_forward(
    self,
    input_ids=None,
    labels=None,
    shift_labels=None,
    position_ids=None,
    attention_mask=None,
    target_logps: bool = False,
    **kwargs,
) -> CausalLMOutputWithPast | TargetLogps:
    """`forward` of a causal LM with the fused loss when labels are given (`shift_labels`: targets already shifted,
    as packed rows need), or with `target_logps` each labelled position's log-probability (TargetLogps, what the
    preference objectives sum; a frozen head only); without labels, transformers' own forward."""
    if labels is None and shift_labels is None:
        return type(self).forward(
            self, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs
        )
    out = self.get_decoder()(
        input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False, **kwargs
    )
    targets = shifted(labels) if shift_labels is None else shift_labels
    denominator = kwargs.pop("num_items_in_batch", None)
    keep = targets != IGNORE_INDEX
    head = plain_head(self)
    if out.last_hidden_state.device.type in SELECTED_ROWS:  # only the labelled rows
        hidden, rows, weights = out.last_hidden_state[keep], targets[keep], None
    else:  # every row, the unlabelled ones weighted 0: nothing read back to the host mid-step
        hidden, weights = out.last_hidden_state.flatten(0, 1), keep.flatten()
        rows = targets.flatten().masked_fill(~weights, 0)
    with gathered(head.weight):
        if target_logps:
            values = linear_target_logps(hidden, head.weight, rows, weights)
            if weights is not None:
                return TargetLogps(logps=values.view(keep.shape))
            per_position = torch.zeros(keep.shape, dtype=values.dtype, device=values.device)
            per_position[keep] = values
            return TargetLogps(logps=per_position)
        loss = linear_cross_entropy(hidden, head.weight, rows, weights, int(denominator) if denominator else None)
    return CausalLMOutputWithPast(loss=loss)


def gathered(weight: torch.Tensor):
    """Under ZeRO-3 (a partitioned parameter), the whole weight for the duration (the head's module is never called,
    so ZeRO's hooks would not gather it), released after unless a module still holds it; otherwise nothing to do.
    Collective: every rank computes its loss."""
    if not hasattr(weight, "ds_id"):
        return nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if weight.ds_status == ZeroParamStatus.AVAILABLE:  # a tied embedding the decoder gathered and still holds
        return nullcontext()
    return deepspeed.zero.GatheredParameters([weight])


def install(model: torch.nn.Module, partitioned: bool = False) -> bool:
    """Give the causal LM inside `model` (a PEFT model or the LM itself) the fused loss; False (unchanged) where
    its head is not a plain Linear (see plain_head), or is trained and `partitioned` (ZeRO-3: its gradient must then
    reach ZeRO through the head module's own hooks, so transformers' loss computes it). A frozen head also gives
    the LM `TARGET_LOGPS = True`: its forward takes `target_logps` (the preference objectives read the flag)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = plain_head(lm)
    if head is None or lm.get_decoder() is lm:  # no separate decoder to run before the head
        return False
    if partitioned and head.weight.requires_grad:
        return False
    lm.forward = MethodType(fused_forward, lm)
    setattr(lm, TARGET_LOGPS, not head.weight.requires_grad)
    return True
