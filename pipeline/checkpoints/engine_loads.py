"""DeepSpeed's engine reads its checkpoint files through `safe_pickle`, never through its own torch.load.

An engine reads every file of `load_checkpoint` (model states, each rank's optimizer shard) through its
`checkpoint_engine.load`, which DeepSpeed 0.19.8's TorchCheckpointEngine implements as torch.load(weights_only=False).
`restrict(engine)` wraps that checkpoint engine: loads go to the restricted loader, saving and everything else stay
DeepSpeed's. What the loader hands back holds DeepSpeed's classes as stand-ins; the ZeRO optimizers keep and call the
loss scaler they load, so a loss scaler's stand-in becomes DeepSpeed's own class again, its fields checked first.
(DeepSpeed's own universal-checkpoint loading, `"load_universal": true`, reads with torch.load directly; the
pipeline never turns it on: `universal.load_universal` places a universal checkpoint through this loader instead.)"""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import safe_pickle
from pipeline.checkpoints.safe_pickle import StandIn

LOSS_SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"
NUMBER, INT, FLAG = (int, float, type(None)), (int, type(None)), (bool, type(None))
LOSS_SCALER_FIELDS = {  # DeepSpeed 0.19.8's fields, and `dtype` (a torch dtype)
    "cur_scale": NUMBER, "dynamic": FLAG, "cur_iter": INT, "last_overflow_iter": INT, "scale_factor": NUMBER,
    "scale_window": INT, "min_scale": NUMBER, "delayed_shift": INT, "cur_hysteresis": INT,
    "consecutive_hysteresis": FLAG, "raise_error_at_min_scale": FLAG,
}  # fmt: skip


class RestrictedLoads:
    """A DeepSpeed checkpoint engine whose `load` is the restricted loader; anything else is the wrapped engine's."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def load(self, path: str, map_location=None) -> object:
        """The file through safe_pickle, on the CPU (where DeepSpeed's own loads map it too)."""
        return revive(safe_pickle.load(Path(path), mmap=False), Path(path))

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def restrict(engine) -> None:
    """Make `engine` read checkpoint files through safe_pickle from now on."""
    if not isinstance(engine.checkpoint_engine, RestrictedLoads):
        engine.checkpoint_engine = RestrictedLoads(engine.checkpoint_engine)


def revive(value: object, path: Path) -> object:
    """`value` with each loss scaler stand-in replaced, in place, by DeepSpeed's own class holding the same,
    checked fields (dicts keep their type and attributes: a state dict's `_metadata`)."""
    if isinstance(value, StandIn) and value.pickled_as.startswith(LOSS_SCALER_MODULE + "."):
        return loss_scaler(value, path)
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = revive(item, path)
    elif type(value) is list:
        value[:] = [revive(item, path) for item in value]
    return value


def loss_scaler(stand_in: StandIn, path: Path):
    """DeepSpeed's LossScaler or DynamicLossScaler with the stand-in's fields, each of the type DeepSpeed uses."""
    import torch
    from deepspeed.runtime.fp16 import loss_scaler as module

    classes = {f"{LOSS_SCALER_MODULE}.{c.__name__}": c for c in (module.LossScaler, module.DynamicLossScaler)}
    cls = classes.get(stand_in.pickled_as)
    for name, value in stand_in.fields.items():
        expected = (torch.dtype,) if name == "dtype" else LOSS_SCALER_FIELDS.get(name)
        if cls is None or expected is None or type(value) not in expected:
            raise safe_pickle.UnsafePickle(
                f"{path}: refused: {stand_in.pickled_as} with field {name}={str(value)[:40]!r} (DeepSpeed's loss "
                f"scalers hold {sorted(LOSS_SCALER_FIELDS)} and dtype, numbers and flags only); {safe_pickle.HINT}"
            )
    revived = cls.__new__(cls)
    revived.__dict__.update(stand_in.fields)
    return revived
