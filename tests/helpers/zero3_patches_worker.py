"""Started by tests/unit/core/test_deepspeed_patches.py as a process of its own (one rank over gloo, no launcher): a
model whose head reads the embedding's weight (a parameter external to the head, which ZeRO-3 gathers for it only
while the embedding's parameters are flagged as in a forward pass), every tensor partitioned, trained three steps
with stock DeepSpeed, then with `kernels.tune_engine` on a DeepSpeed the patches were not written for (all left off),
then with every ZeRO-3 patch of pipeline/core/deepspeed_patches.py. Writes each run's losses and trained tensors to
OUT/{deepspeed,other_version,patched}.safetensors, and what each run saw to OUT/seen.json: what was installed,
DeepSpeed's walks over the modules, and whether every parameter dict was flagged inside each forward and none after."""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline import kernels
from pipeline.core import deepspeed_patches
from pipeline.core.environment import free_port
from pipeline.training import ds_config, loop

VOCAB, WIDTH = 32, 8


class Head(torch.nn.Module):
    """Logits against the embedding's weight, read from the embedding module (not a submodule of this one)."""

    def __init__(self, embedding: torch.nn.Embedding, seen: dict):
        super().__init__()
        self.project = torch.nn.Linear(WIDTH, WIDTH)
        self.outside, self.seen = [embedding], seen

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flags = [module._parameters._in_forward for module in self.seen["model"].modules()]
        self.seen["flagged_inside"].append(all(flags))
        return self.project(hidden) @ self.outside[0].weight.t()


class Model(torch.nn.Module):
    def __init__(self, seen: dict):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, WIDTH)
        self.head = Head(self.embedding, seen)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.hidden(self.embedding(ids))))
        return torch.nn.functional.cross_entropy(logits[:-1], ids[1:])


def train(run: str) -> tuple[dict[str, torch.Tensor], dict]:
    from deepspeed.runtime import engine as deepspeed_engine

    torch.manual_seed(0)
    seen = {"flagged_inside": [], "flagged_after": [], "deepspeed_walks": 0}
    model = Model(seen)
    seen["model"] = model
    config = ds_config.build(
        zero=ds_config.ZeroSettings(stage=3), precision="fp32", micro=1, accumulation=1, world_size=1, lr=1e-2,
        weight_decay=0.0, adam_epsilon=1e-6, max_grad_norm=1.0,
    )  # fmt: skip
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every tensor partitioned, gathered
    deepspeed = deepspeed_patches.imported()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if run == "other_version":  # patched on a DeepSpeed they were not written for: each left off
        version, deepspeed.__version__ = deepspeed.__version__, "0.20.0"
        seen["installed"] = [kernels.tune_engine(engine, enabled="auto") for _ in range(2)]
        deepspeed.__version__ = version
    elif run == "patched":
        seen["installed"] = [kernels.tune_engine(engine, enabled="auto")]
    ensure = deepspeed_engine.ensure_zero_ordered_dict

    def counted(module):
        seen["deepspeed_walks"] += 1
        return ensure(module)

    deepspeed_engine.ensure_zero_ordered_dict = counted
    losses = []
    for step in range(3):
        ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(step))
        loss = engine(ids)
        seen["flagged_after"].append(any(module._parameters._in_forward for module in model.modules()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    deepspeed_engine.ensure_zero_ordered_dict = ensure
    del seen["model"]
    return {"losses": torch.stack(losses), **loop.gathered_trainable(engine)}, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed_patches.imported().init_distributed(dist_backend="gloo")
    seen = {}
    for name in ("deepspeed", "other_version", "patched"):  # the patches are process-wide: installed last
        tensors, seen[name] = train(name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / f"{name}.safetensors")
    (out / "seen.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
