"""Started by tests/unit/kernels/test_compiled_layers.py as a process of its own (one rank over gloo, no launcher): a
tiny LoRA model with a trained head under ZeRO-3, its decoder layers gathered whole as the rank gathers them, over
the layer paths a GPU installs; trained two steps with the layers eager, then compiled, then eager with the fetch of
`deepspeed_patches.zero3_fetch` (one rank: no gather), then with that fetch and its release (`zero3_release`).
Writes each run's losses and gathered trained tensors to OUT/{eager,compiled,fetched,released}.safetensors, and the
graphs compiled, the fetches without a host sync and the releases (direct, and through DeepSpeed's path) to
OUT/counts.json."""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.core import deepspeed_patches
from pipeline.core.deepspeed_patches import RELEASE, Fetched, zero3_fetch, zero3_release
from pipeline.core.environment import free_port
from pipeline.kernels import compiled_layers, fused_loss, lean_layers, linear, lora_linear
from pipeline.model.lora import parameter_groups
from pipeline.training import ds_config, loop
from pipeline.training.rank import gather_whole_layers
from tests.helpers.lora_model import tiny_lora
from tests.helpers.zero_worker import EPSILON  # Adam's, large enough not to amplify rounding residues


def train(*, compiled: bool, fetched: bool, released: bool, counts: dict) -> dict[str, torch.Tensor]:
    deepspeed = deepspeed_patches.imported()
    model = tiny_lora(torch.float32, layers=3)
    model.config.use_cache = False  # as load_lora_model sets it: no KV cache in training
    lean_layers.install(model)
    lora_linear.install(model, partitioned=True)
    fused_loss.install(model, partitioned=True)
    if compiled:
        assert compiled_layers.install(model) == 3
    gather_whole_layers(model)
    config = ds_config.build(
        zero=ds_config.ZeroSettings(stage=3), precision="fp32", micro=1, accumulation=1, world_size=1, lr=1e-2,
        weight_decay=0.0, adam_epsilon=EPSILON, max_grad_norm=1.0,
    )  # fmt: skip
    groups = parameter_groups(model, 0.0, lr=1e-2, lr_ratio=None)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    if fetched:
        assert zero3_fetch(engine)
    if released:
        assert zero3_release(engine)
        counting(RELEASE, counts, "direct_releases")
    engine.train()
    losses = []
    for step in range(2):
        ids = torch.randint(0, 101, (1, 17), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    return {"losses": torch.stack(losses), **loop.gathered_trainable(engine)}


def counting(name: str, counts: dict, key: str) -> None:
    """Count the calls of DeepSpeed's coordinator's method `name` (as installed now) under `key`."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as coordinator

    method = getattr(coordinator, name)

    def counted(*args, **kwargs):
        counts[key] = counts.get(key, 0) + 1
        return method(*args, **kwargs)

    counted.direct = getattr(method, "direct", False)
    setattr(coordinator, name, counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    linear._MATMUL = None  # a GPU's matmuls: torch's
    lean_layers._kernels = lambda x: None  # a GPU's MLP and norm: torch's operators
    deepspeed_patches.imported().init_distributed(dist_backend="gloo")
    waits, wait = [], Fetched.wait
    Fetched.wait = lambda handle, **kwargs: (waits.append(1), wait(handle, **kwargs))[1]  # counted
    counts = {}
    counting(RELEASE, counts, "deepspeed_releases")  # DeepSpeed's own release, every run
    for name in ("eager", "compiled", "fetched", "released"):
        before = compiled_layers.graphs()
        counts[f"deepspeed_releases_before_{name}"] = counts.get("deepspeed_releases", 0)
        fetched, released = name in ("fetched", "released"), name == "released"
        tensors = train(compiled=name == "compiled", fetched=fetched, released=released, counts=counts)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / f"{name}.safetensors"))
        counts[f"{name}_graphs"] = compiled_layers.graphs() - before
    (args.out / "counts.json").write_text(json.dumps({**counts, "fetches": len(waits)}))


if __name__ == "__main__":
    main()
