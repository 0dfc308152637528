"""Which tensors of a model folder are which parameter of the model transformers builds, by transformers' own
checkpoint conversions (`get_model_conversion_mapping`, the list `from_pretrained` applies): renamed heads (GPT-NeoX's
`embed_out`), legacy names, per-expert MoE tensors fused into the model's experts, split or fused projections.

A parameter the files hold under one name reads straight from the files, any part of it (a ZeRO-3 rank reads its own
slice); one that a conversion builds from several tensors (an MoE layer's experts) is converted by transformers'
operation when first read, and held until `release`: never more than one conversion at a time."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from pipeline.checkpoints.model_files import FileTensor
from pipeline.core.imports import torch


@dataclass
class _Conversion:
    """One WeightConverter's group of file tensors (key, source pattern) and the parameters it makes: converted when
    first read, kept until every parameter it makes is released."""

    converter: object
    layer: str
    model: torch.nn.Module
    members: list[tuple[str, str, FileTensor]]
    targets: set[str] = field(default_factory=set)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)

    def value(self, name: str) -> torch.Tensor:
        if not self.values:
            converter = copy.deepcopy(self.converter)  # a converter collects the tensors of one conversion
            for key, pattern, tensor in self.members:
                converter.add_tensor(self.layer, key, pattern, tensor.read)
            converted = converter.convert(self.layer, model=self.model, config=self.model.config)
            self.values = {key: (v[0] if isinstance(v, list) else v).contiguous() for key, v in converted.items()}
        if name not in self.values:
            raise ValueError(f"transformers' conversion of {self.layer} made {sorted(self.values)}, not {name}")
        return self.values[name]


@dataclass
class Converted:
    """A parameter that a checkpoint conversion builds: a FileTensor whose values come from the conversion."""

    conversion: _Conversion
    name: str

    @property
    def shape(self) -> list[int]:
        return list(self.conversion.value(self.name).shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.conversion.value(self.name).dtype

    def read(self) -> torch.Tensor:
        return self.conversion.value(self.name)

    def read_flat(self, start: int, count: int) -> torch.Tensor:
        return self.conversion.value(self.name).view(-1)[start : start + count]

    def release(self) -> None:
        """This parameter is read: the conversion's values go once every parameter it makes is (a later read
        converts again)."""
        self.conversion.released.add(self.name)
        if self.conversion.released >= self.conversion.targets:
            self.conversion.values, self.conversion.released = {}, set()


def by_parameter(model: torch.nn.Module, tensors: dict[str, FileTensor]) -> dict[str, FileTensor]:
    """The file tensor of each name in `tensors` that the model has, under the model's parameter (or buffer) name:
    renamed as transformers renames it when loading, or converted as it converts it (`Converted`)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    known = dict.fromkeys([name for name, _ in model.named_parameters(remove_duplicate=False)], True)
    known.update(dict.fromkeys([name for name, _ in model.named_buffers()], True))
    found: dict[str, FileTensor] = {}
    groups: dict[tuple[int, str], tuple[WeightConverter, list[tuple[str, str, FileTensor]]]] = {}
    for key in sorted(tensors, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, known)
        if pattern is None:
            found.setdefault(name, tensors[key])
            continue
        converter = next(c for c in converters if c.rename_source_key(_renamed(key, renamings))[1] == pattern)
        groups.setdefault((id(converter), name), (converter, []))[1].append((key, pattern, tensors[key]))
    for (_, layer), (converter, members) in groups.items():
        conversion = _Conversion(converter, layer, model, members, targets=set(_targets(layer, converter, known)))
        found.update({target: Converted(conversion, target) for target in conversion.targets})
    return found


def _renamed(key: str, renamings: list) -> str:
    from transformers.core_model_loading import apply_renamings

    return apply_renamings(key, renamings)


def _targets(layer: str, converter, known: dict) -> list[str]:
    """The model names a conversion of `layer` makes: one per target pattern (`layer` names the first)."""
    first = converter.target_patterns[0]
    names = [layer.replace(first, target) for target in converter.target_patterns]
    return [name for name in names if name in known] or [layer]
