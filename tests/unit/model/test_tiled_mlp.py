"""The tiled MLP (pipeline/model/tiled_mlp.py, DeepSpeed's TiledMLP) on a LoRA LLaMA: the loss and every gradient of
the untiled model (fp32, with our other kernels and without, LoRA on the MLP only too); the tile count one per hidden
size positions, which torch.chunk always gives; each weight reported ready to ZeRO once; only the MLP's input kept
for the backward pass."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from pipeline import kernels
from pipeline.model import tiled_mlp
from tools.tiny_model import tiny_llama_config

HIDDEN, INTERMEDIATE = 16, 64


def tiny_lora(targets: tuple[str, ...] = ("q_proj", "gate_proj", "up_proj", "down_proj")) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=101, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                               tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets))
    model = get_peft_model(model, lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model.train()


def step(model, tokens: int = 70) -> tuple[float, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 101, (1, tokens), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("speed_paths", ["off", "auto"])
@pytest.mark.parametrize("targets", [("q_proj", "gate_proj", "up_proj", "down_proj"), ("gate_proj", "down_proj")])
def test_tiled_mlp_trains_as_the_whole_mlp(speed_paths, targets):
    """Also with LoRA on the MLP only: the first layer's MLP input then needs no gradient, its weights do."""
    whole = tiny_lora(targets)
    kernels.apply(whole, device="cpu", zero_stage=0, enabled=speed_paths)
    tiles = copy.deepcopy(whole)
    assert tiled_mlp.install(tiles) == 2
    expected_loss, expected = step(whole)
    loss, grads = step(tiles)
    assert abs(loss - expected_loss) < 1e-6
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_zero_reduces_each_weight_once(checkpointing):
    """DeepSpeed's ZeRO-1/2 reduce a weight's gradient when its accumulation hook fires with `ds_grad_is_ready`
    (unset: ready), and refuse a second ("Gradient computed twice for this partition"): in one backward, every
    trained weight of a tiled MLP is reported ready exactly once, after its last tile (with checkpointing too, as the
    long_context benchmark trains). DeepSpeed's class takes them as a list: as inputs they would fire once more."""
    model = tiny_lora(("gate_proj", "down_proj"))  # the first layer's MLP input then needs no gradient
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiled_mlp.install(model)
    ready = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(
                lambda p, name=name: ready.__setitem__(name, ready.get(name, 0) + getattr(p, "ds_grad_is_ready", True))
            )
    step(model)
    assert ready and all(count == 1 for count in ready.values()), ready


def test_one_tile_per_hidden_size_positions_which_torch_chunk_gives():
    """DeepSpeed tiles with torch.chunk, which gives fewer tiles than asked for some counts (4 for 5 positions: 3),
    and then never reports the weights ready to ZeRO; one tile per `hidden` positions it always gives."""
    for hidden in range(1, 40):
        for tokens in range(1, 600):
            tiles = tiled_mlp.tiles_for(tokens, hidden)
            assert len(torch.arange(tokens).chunk(tiles)) == tiles, (tokens, hidden)
    model = tiny_lora(("gate_proj", "down_proj"))
    tiled_mlp.install(model)
    mlp = model.get_base_model().model.layers[0].mlp
    calls = []
    mlp.gate_proj.base_layer.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    step(model, tokens=70)
    assert calls == [14] * 5 * 2  # forward, then the backward's recomputation
    assert all(p.ds_grad_is_ready for p in mlp.parameters() if p.requires_grad)


def kept_widths(forward, x: torch.Tensor) -> set[int]:
    """The last dimension of every (1, positions, width) or (positions, width) tensor autograd keeps for the backward
    pass of `forward(x)`."""
    widths = set()

    def keep(tensor):
        if tensor.dim() >= 2 and tensor.shape[-2] == x.shape[1]:
            widths.add(tensor.shape[-1])
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        forward(x)
    return widths


def test_only_the_input_is_kept_for_the_backward_pass():
    model = tiny_lora()
    mlp = model.get_base_model().model.layers[0].mlp
    x = torch.randn(1, 96, HIDDEN, requires_grad=True)
    assert INTERMEDIATE in kept_widths(mlp.forward, x)
    tiled_mlp.install(model)
    assert kept_widths(mlp.forward, x) == {HIDDEN}


def test_long_evaluation_windows_score_the_same_in_tiles(monkeypatch):
    """The evaluate stage's likelihood at a window of 8 tiles or more runs the MLPs in tiles (memory bounded by a
    tile, not the window), scoring what the whole MLPs score; shorter windows are left as they are."""
    from pipeline.evaluation.likelihood import Example, score

    model = tiny_lora().eval()
    whole = copy.deepcopy(model)
    ids = torch.randint(1, 101, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    examples = [Example(ids, [False] + [True] * 299, 1000)]
    assert score(model, examples, context=64, stride=32, batch_size=2).tokens == 299  # 64 < 8 tiles of 16
    assert not tiled_mlp.tiled(model.get_base_model().model.layers[0].mlp)
    got = score(model, examples, context=128, stride=128, batch_size=2)
    assert tiled_mlp.tiled(model.get_base_model().model.layers[0].mlp)
    monkeypatch.setattr(tiled_mlp, "LONG_WINDOW", 10**6)  # the same window, untiled
    reference = score(whole, examples, context=128, stride=128, batch_size=2)
    assert not tiled_mlp.tiled(whole.get_base_model().model.layers[0].mlp)
    assert got.tokens == reference.tokens == 299 and abs(got.nll - reference.nll) < 1e-5 * reference.nll
