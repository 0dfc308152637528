"""Ulysses sequence parallelism (`train.sequence_parallel: N`, DeepSpeed's ALST): the ranks of a group of N consecutive
ranks train on the same micro-batch, each holding 1/N of its sequence (pipeline.training.ulysses); attention
exchanges sequence shards for head shards and back. The world is world / N data-parallel groups: the schedule gives
each group its rows, and ZeRO partitions and reduces over every rank, each rank's gradient being its share of its
group's (DeepSpeed divides the sum by world / N, given the groups as its `mpu`). ZeRO-3 divides it by the whole
world instead (its reduce-scatter averages over all the ranks it reduces over, sequence-parallel or not: DeepSpeed
0.19's `__avg_scatter_grads`), so under ZeRO-3 each rank's loss is multiplied by N in its backward
(`Layout.gradient_scale`).

What cannot work is refused before a launch (`launching.settings.check_world`: a world N does not divide;
`check_model`): attention heads N does not split, an attention that needs a whole-sequence mask, a sliding window."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION = ("sdpa", "flash_attention_2")  # eager materialises a (sequence x sequence) mask in every layer


def check_model(size: int, *, config: dict, attention: str) -> None:
    """Refuse a model `size` ranks cannot split: its query heads over the ranks, its key-value heads over them (or
    the ranks over them, each head then repeated), an attention that needs a mask of the whole sequence, a window."""
    if size == 1:
        return
    text = config.get("text_config") or config
    heads, kv_heads = text["num_attention_heads"], text.get("num_key_value_heads") or text["num_attention_heads"]
    if heads % size:
        raise ValueError(
            f"train.sequence_parallel: the model's {heads} attention heads do not split over {size} ranks; expected "
            f"a divisor of {heads}"
        )
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"train.sequence_parallel: the model's {kv_heads} key-value heads neither split over {size} ranks nor "
            f"divide {size}; expected a divisor or a multiple of {kv_heads}"
        )
    if attention not in ATTENTION:
        raise ValueError(
            f"train.attention: {attention} with train.sequence_parallel {size}; expected one of {', '.join(ATTENTION)} "
            "(eager builds a mask of the whole sequence in every layer)"
        )
    layer_types = set(text.get("layer_types") or ())
    windowed = text.get("sliding_window") is not None and text.get("use_sliding_window", True) is not False
    if layer_types - {"full_attention"} or (windowed and not layer_types):
        raise ValueError(
            f"train.sequence_parallel: the model's attention has a sliding window or other layer kinds "
            f"({sorted(layer_types) or text.get('sliding_window')}), which the sequence-parallel attention does not "
            "apply; expected 1 for this model"
        )


@dataclass(frozen=True, kw_only=True)
class Layout:
    """This rank's place: its sequence-parallel group (`size` ranks, `rank` within it; `group` None when off) and its
    data-parallel group (the ranks holding the same shard of other rows: `data_world` of them, `data_rank` its)."""

    size: int = 1
    rank: int = 0
    group: object = None
    data_rank: int = 0
    data_world: int = 1
    data_group: object = None  # None: the whole world
    gradient_scale: int = 1  # what the loss is multiplied by in the backward (ZeRO-3: `size`; see the module)


_LAYOUT: Layout | None = None  # this process's, once `initialize` has run (DeepSpeed keeps its groups globally too)


def initialize(size: int, *, zero_stage: int) -> Layout:
    """Form this rank's groups (a collective: every rank calls it, after deepspeed.init_distributed): DeepSpeed's
    sequence-parallel groups of `size` consecutive ranks, and the data-parallel groups across them; under ZeRO
    `zero_stage` 3 the gradient's scale that makes the reduced gradient the data-parallel groups' mean."""
    import deepspeed.comm as dist

    global _LAYOUT
    rank, world = dist.get_rank(), dist.get_world_size()
    if size == 1:
        _LAYOUT = Layout(data_rank=rank, data_world=world)
        return _LAYOUT
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups

    groups.initialize_sequence_parallel(sequence_parallel_size=size)
    data_group = None
    for shard in range(size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(shard, world, size)))
        data_group = group if rank % size == shard else data_group
    _LAYOUT = Layout(
        size=size,
        rank=rank % size,
        group=groups.get_sequence_parallel_group(),
        data_rank=rank // size,
        data_world=world // size,
        data_group=data_group,
        gradient_scale=size if zero_stage == 3 else 1,
    )
    return _LAYOUT


def mpu(layout: Layout):
    """What deepspeed.initialize takes as `mpu` for `layout` (None without sequence parallelism)."""
    if layout.size == 1:
        return None
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups

    return groups


def current() -> Layout:
    """This rank's layout; where `initialize` has not run, every rank is its own data-parallel rank."""
    if _LAYOUT is not None:
        return _LAYOUT
    import deepspeed.comm as dist

    return Layout(data_rank=dist.get_rank(), data_world=dist.get_world_size())
