"""A causal LM trained by a sequence-parallel group (pipeline.training.sequence_parallel): its forward still takes the
whole micro-batch, as every caller builds it (packed rows with their restarting positions, padded rows, preference
pairs), and computes this rank's shard of it; attention is DeepSpeed's `UlyssesSPAttentionHF` around the model's own.

A forward lays the micro-batch's rows end to end as one sequence (positions restarting at each row, each row's
next-token targets: as `pipeline.data.batches.pack` does), pads it to a multiple of N (a row of its own, no target)
and gives rank r the r-th N-th. Attention gathers the whole sequence for 1/N of the heads (an all-to-all, and back),
and attends each row on its own (causal within a row: no row sees another, no mask is built).

What a forward returns is what the unsplit forward returns, on every rank of the group: the micro-batch's mean loss
(its value the group's; its gradient this rank's share, so the group's gradients sum to the whole sequence's), or
each labelled position's log-probability (preference objectives), or logits, gathered; the gradient of a gathered
value reaches each rank for its own positions only (every rank computes the same thing after the gather)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from pipeline.data.batches import shifted
from pipeline.data.examples import IGNORE_INDEX
from pipeline.training.sequence_parallel import Layout

NAME = "ulysses"  # the attention implementation the model is switched to
VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # the unsplit rows' bounds: not a shard's


@dataclass
class Rows:
    """The rows of the current forward, end to end: where each starts and ends in the gathered sequence."""

    bounds: list[tuple[int, int]] | None = None


@dataclass(frozen=True, kw_only=True)
class Sequence:
    """A micro-batch as one sequence padded to a multiple of the group's size ([1, length] tensors)."""

    ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor | None  # each position's next token (IGNORE_INDEX where none counts)
    keep: torch.Tensor | None  # the positions whose logits the caller asked for
    shape: tuple[int, int]  # the caller's (rows, width): the unpadded positions are rows x width

    def shard(self, rank: int, size: int) -> dict[str, torch.Tensor | None]:
        """Rank `rank`'s contiguous N-th of every tensor."""
        width = self.ids.shape[1] // size
        part = slice(rank * width, (rank + 1) * width)
        pick = {"ids": self.ids, "positions": self.positions, "targets": self.targets, "keep": self.keep}
        return {name: None if t is None else t[:, part] for name, t in pick.items()}


def flattened(
    input_ids: torch.Tensor,
    *,
    position_ids: torch.Tensor | None,
    targets: torch.Tensor | None,
    keep: torch.Tensor | None,
    size: int,
) -> Sequence:
    """The rows of `input_ids` ([rows, width]) end to end, padded to a multiple of `size` by a row of its own."""
    rows, width = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(width, device=input_ids.device).expand(rows, width)
    pad = -(rows * width) % size

    def flat(t: torch.Tensor | None, fill) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.expand(rows, width).reshape(1, rows * width)
        tail = torch.full((1, pad), fill, dtype=t.dtype, device=t.device)
        return torch.cat([t, tail], dim=1) if pad else t

    tail_positions = torch.arange(pad, device=input_ids.device)[None]
    positions = torch.cat([position_ids.expand(rows, width).reshape(1, -1), tail_positions], dim=1)
    return Sequence(
        ids=flat(input_ids, 0),
        positions=positions,
        targets=flat(targets, IGNORE_INDEX),
        keep=flat(keep, False),
        shape=(rows, width),
    )


def row_bounds(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each row of a sequence whose positions restart at every row (one read back to the host)."""
    flat = positions[0]
    starts = torch.nonzero(flat[1:] != flat[:-1] + 1).flatten().add_(1).tolist()
    edges = [0, *starts, len(flat)]
    return list(zip(edges[:-1], edges[1:], strict=True))


class _Gathered(torch.autograd.Function):
    """The group's pieces of a tensor (each rank's own length along dim 0) end to end; backward: this rank's piece
    of the gradient (every rank computed the same function of the whole, so its gradient is the same everywhere)."""

    @staticmethod
    def forward(ctx, piece: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        import deepspeed.comm as dist

        lengths = [torch.zeros(1, dtype=torch.int64, device=piece.device) for _ in range(size)]
        dist.all_gather(lengths, torch.tensor([piece.shape[0]], device=piece.device), group=group)
        lengths = [int(n) for n in lengths]
        longest = max(lengths)
        padded = torch.zeros((longest, *piece.shape[1:]), dtype=piece.dtype, device=piece.device)
        padded[: piece.shape[0]] = piece
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.span = (sum(lengths[:rank]), lengths[rank])
        return torch.cat([part[:n] for part, n in zip(parts, lengths, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, length = ctx.span
        return grad[start : start + length], None, None, None


def gathered(piece: torch.Tensor, layout: Layout) -> torch.Tensor:
    return _Gathered.apply(piece, layout.group, layout.rank, layout.size)


def sharded_forward(
    inner,
    layout: Layout,
    rows: Rows,
    input_ids=None,
    labels=None,
    shift_labels=None,
    position_ids=None,
    attention_mask=None,
    target_logps: bool = False,
    logits_to_keep=0,
    **kwargs,
):
    """`inner` (the causal LM's forward: transformers' or the fused loss's) on this rank's shard of the micro-batch;
    returns what `inner` returns for the whole one (see the module's docstring)."""
    if input_ids is None:
        raise ValueError("train.sequence_parallel: the forward needs input_ids (embeddings are not split)")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("train.sequence_parallel: rows with masked positions (left padding); expected right padding")
    for key in VARLEN:
        kwargs.pop(key, None)
    targets = shift_labels if shift_labels is not None else None if labels is None else shifted(labels)
    keep = logits_to_keep if isinstance(logits_to_keep, torch.Tensor) else None
    if keep is not None and (keep.dtype != torch.bool or keep.shape != input_ids.shape):
        raise ValueError("train.sequence_parallel: logits_to_keep must be a boolean mask of the rows' positions")
    whole = flattened(input_ids, position_ids=position_ids, targets=targets, keep=keep, size=layout.size)
    local = whole.shard(layout.rank, layout.size)
    rows.bounds = row_bounds(whole.positions)
    common = {"input_ids": local["ids"], "position_ids": local["positions"], **kwargs}
    if target_logps:
        out = inner(shift_labels=local["targets"], target_logps=True, **common)
        # the fused head gives rows x positions (0 where a label does not count): here one row, the shard; the
        # whole sequence's positions gathered, then cut back into the micro-batch's rows
        n_rows, width = whole.shape
        logps = gathered(out.logps[0], layout)[: n_rows * width]
        return type(out)(logps=logps.view(n_rows, width))
    if targets is not None:
        counted = max(int((whole.targets != IGNORE_INDEX).sum()), 1)
        out = inner(labels=local["targets"], shift_labels=local["targets"], num_items_in_batch=counted, **common)
        group_loss = out.loss.detach().clone()
        import deepspeed.comm as dist

        dist.all_reduce(group_loss, group=layout.group)
        return CausalLMOutputWithPast(loss=out.loss + (group_loss - out.loss).detach())
    if keep is not None:
        return CausalLMOutputWithPast(logits=gathered(inner(logits_to_keep=local["keep"], **common).logits, layout))
    logits = gathered(inner(**common).logits[0], layout)
    n_rows, width = whole.shape
    return CausalLMOutputWithPast(logits=logits[: n_rows * width].view(n_rows, width, -1))


def row_attention(core, rows: Rows, module, query, key, value, attention_mask, *args, **kwargs):
    """`core` attention (transformers' interface) on the gathered sequence, each row on its own (causal)."""
    if rows.bounds is None or len(rows.bounds) == 1:
        return core(module, query, key, value, None, *args, **kwargs)
    kwargs.pop("position_ids", None)  # the whole sequence's; each call below sees one row
    outputs = [
        core(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, *args, **kwargs)[0]
        for a, b in rows.bounds
    ]
    return torch.cat(outputs, dim=1), None


def install(model: torch.nn.Module, layout: Layout) -> bool:
    """Make the causal LM inside `model` (a PEFT model, after the kernels are installed, before DeepSpeed wraps it)
    train as one rank of `layout`'s group; False (unchanged) without sequence parallelism."""
    if layout.size == 1:
        return False
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    current = lm.config._attn_implementation
    core = ALL_ATTENTION_FUNCTIONS[current]
    rows = Rows()
    # flash-attention finds the rows from the gathered positions itself (variable-length kernel)
    per_row = core if current.startswith("flash_attention") else partial(row_attention, core, rows)
    text = lm.config.get_text_config()
    heads = text.num_attention_heads
    ulysses = UlyssesSPAttentionHF(
        attn=per_row,
        batch_size=1,
        attn_head_count=heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
        kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=layout.group,
        seq_length_is_variable=True,
    )
    ulysses.core_attn_implementation = current

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        return ulysses(module, query, key, value, None, *args, **kwargs)

    AttentionInterface.register(NAME, attention)
    lm.set_attn_implementation(NAME)
    lm.forward = partial(sharded_forward, lm.forward, layout, rows)
    return True
