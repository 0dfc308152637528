"""What a checkpoint pickle may name, call and set, by exact (module, qualified name): the policy `unpickler.Machine`
runs under. Each allowed global checks its own arguments before anything is built:

- tensors: torch's rebuild functions, only over storages this file's persistent ids produced, within their bounds,
  without backward hooks; parameters; `torch.Size`, `torch.device`, the dtypes and storage types by name;
- numpy (RNG states): arrays and scalars of numeric dtypes only (bool, int, uint, float, complex; never the object
  dtype, structured or sub-array dtypes, or flags), the raw bytes exactly as long as the shape says;
- plain values: `OrderedDict`, sets of scalars, slices, complex numbers, bytes (`_codecs.encode` in latin-1, as
  protocol 2 stores them), `argparse.Namespace` (DeepSpeed-Chat's arguments);
- DeepSpeed's classes by exact name, never imported: its enums become their ints, every other class a `StandIn`
  holding the fields it was pickled with (`pipeline.checkpoints.engine_loads` turns a loss scaler back into
  DeepSpeed's own for a resuming engine).

BUILD sets state on stand-ins, Namespaces, numpy and an OrderedDict's own attributes (a state dict's `_metadata`)
only; everything else a pickle asks for is refused."""

from __future__ import annotations

import argparse
import math
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from pipeline.checkpoints.unpickler import Callee, Policy, Refused
from pipeline.core.imports import torch
from pipeline.core.precision import dtype_name

DEEPSPEED_CLASSES = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)
DEEPSPEED_ENUMS = (("deepspeed.runtime.zero.config", "ZeroStageEnum"),)
TORCH_DTYPES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
    "complex128",
)  # fmt: skip
NUMPY_CODES = ("?", "b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16")
NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")  # numpy 1.x and 2.x pickle under these
MAX_INT = 2**62
QUANTIZED = ("qint8", "qint32", "quint8", "quint4x2", "quint2x4")  # torch dtypes without a storage we read
MAX_DIMS = 32


class StandIn:
    """A DeepSpeed object of a checkpoint (a loss scaler, a fragment address), its class never imported: the name it
    was pickled as and its fields, read as attributes."""

    def __init__(self, pickled_as: str) -> None:
        self.__dict__["pickled_as"] = pickled_as
        self.__dict__["fields"] = {}

    def __getattr__(self, name: str) -> object:
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"StandIn({self.pickled_as}, {sorted(self.fields)})"


class Storages:
    """The storages a file's persistent ids produced (a tensor is rebuilt only over one of them)."""

    def __init__(self) -> None:
        self.made: dict[int, torch.storage.TypedStorage] = {}

    def add(self, storage: torch.storage.TypedStorage) -> torch.storage.TypedStorage:
        self.made[id(storage)] = storage
        return storage

    def owns(self, storage: object) -> bool:
        return self.made.get(id(storage)) is storage


class StorageKind:
    """A storage type named by a pickle (`torch.FloatStorage`): the dtype a persistent id says its storage holds."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype


def policy(storage: Callable[[object], object] | None = None, storages: Storages | None = None) -> Policy:
    """The checkpoint policy; `storage` checks a persistent id against the file (torch files), `storages` is
    where it records the storages it made."""
    storages = storages or Storages()
    unbuilt: dict[int, object] = {}  # numpy arrays and dtypes made here, until their one BUILD
    names: dict[tuple[str, str], object] = {}

    def callee(module: str, name: str, **uses: Callable) -> Callee:
        made = Callee(f"{module}.{name}", **uses)
        names[(module, name)] = made
        return made

    for module, name in DEEPSPEED_CLASSES:
        callee(module, name, new=_stand_in_maker(f"{module}.{name}"))
    for module, name in DEEPSPEED_ENUMS:
        callee(module, name, reduce=lambda value, n=f"{module}.{name}": _int(value, n))
    callee("collections", "OrderedDict", reduce=_ordered_dict)
    plain_object = set()
    for builtins in ("builtins", "__builtin__"):  # protocols 0-2 store Python 2's module name
        callee(builtins, "set", reduce=lambda items=(): set(_scalars(items, "set")))
        callee(builtins, "frozenset", reduce=lambda items=(): frozenset(_scalars(items, "frozenset")))
        callee(builtins, "slice", reduce=_slice)
        callee(builtins, "complex", reduce=_complex)
        callee(builtins, "bytearray", reduce=_bytearray)
        plain_object.add(callee(builtins, "object"))
    callee("_codecs", "encode", reduce=_latin1)
    namespace = callee("argparse", "Namespace", new=_namespace)

    def reconstructor(cls, base, state) -> argparse.Namespace:
        """Protocol 0/1's way to make an object: copyreg._reconstructor(cls, object, None), then BUILD."""
        if cls is not namespace or base not in plain_object or state is not None:
            raise Refused("copyreg._reconstructor of anything but an argparse.Namespace")
        return argparse.Namespace()

    callee("copyreg", "_reconstructor", reduce=reconstructor)
    callee("copy_reg", "_reconstructor", reduce=reconstructor)
    for dtype in TORCH_DTYPES:
        names[("torch", dtype)] = getattr(torch, dtype)
    for dtype, storage_name in torch.storage._dtype_to_storage_type_map().items():
        if dtype_name(dtype) not in QUANTIZED:
            names[("torch", storage_name)] = StorageKind(storage_name, dtype)
    names[("torch", "UntypedStorage")] = StorageKind("UntypedStorage", torch.uint8)
    callee("torch", "Size", reduce=_size)
    callee("torch", "device", reduce=_device)
    tensor_type = callee("torch", "Tensor")
    parameter_type = callee("torch.nn.parameter", "Parameter")

    def rebuild_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None) -> torch.Tensor:
        if _nonempty(metadata) or type(requires_grad) is not bool:
            raise Refused("tensor metadata or a requires_grad that is not a bool")
        tensor = rebuild(storage, offset, size, stride)
        _no_hooks(hooks)
        tensor.requires_grad = requires_grad
        return tensor

    def rebuild(storage, offset, size, stride) -> torch.Tensor:
        if not storages.owns(storage):
            raise Refused("a tensor over a storage that is not one of this file's")
        _within(storage._size(), _int(offset, "offset"), _shape(size), _shape(stride))
        return torch._utils._rebuild_tensor(storage, offset, tuple(size), tuple(stride))

    def parameter(data, requires_grad, hooks, state=None) -> torch.nn.Parameter:
        if type(data) is not torch.Tensor or type(requires_grad) is not bool:
            raise Refused("a Parameter of something other than a tensor")
        _no_hooks(hooks)
        return _with_state(torch.nn.Parameter(data, requires_grad=requires_grad), state)

    def from_type(func, new_type, args, state) -> torch.Tensor:
        if func not in (v2, v1) or new_type not in (tensor_type, parameter_type) or type(args) is not tuple:
            raise Refused("_rebuild_from_type_v2 of something other than a tensor rebuilt from storage")
        tensor = func.reduce(*args)
        if new_type is parameter_type:
            tensor = tensor.as_subclass(torch.nn.Parameter)
        return _with_state(tensor, state)

    v2 = callee("torch._utils", "_rebuild_tensor_v2", reduce=rebuild_v2)
    v1 = callee("torch._utils", "_rebuild_tensor", reduce=rebuild)
    callee("torch._utils", "_rebuild_parameter", reduce=parameter)
    callee("torch._utils", "_rebuild_parameter_with_state", reduce=parameter)
    callee("torch._tensor", "_rebuild_from_type_v2", reduce=from_type)

    def new_dtype(spec, align=False, copy=True) -> np.dtype:
        if type(spec) is not str or spec not in NUMPY_CODES or align is not False or copy is not True:
            what = "an object dtype: arrays of it hold pointers" if spec in ("O", "O8", "|O") else "not numeric"
            raise Refused(f"numpy dtype {str(spec)[:20]!r} ({what}; only bool, int, uint, float, complex)")
        made = np.dtype(spec, False, True)  # a copy: BUILD never touches numpy's shared dtypes
        unbuilt[id(made)] = made
        return made

    def build_dtype(dtype: np.dtype, state) -> None:
        _once(unbuilt, dtype, "numpy dtype")
        if type(state) is not tuple or len(state) != 8 or state[0] != 3 or state[1] not in ("<", ">", "|", "="):
            raise Refused("numpy dtype state of another layout")
        if state[2:] != (None, None, None, -1, -1, 0):
            raise Refused("numpy dtype with fields, a sub-array, a size or flags of its own (structured or object)")
        dtype.__setstate__((3, state[1], None, None, None, -1, -1, 0))

    def reconstruct(subtype, shape, typecode) -> np.ndarray:
        if subtype is not ndarray_type or type(shape) is not tuple or shape != (0,) or typecode != b"b":
            raise Refused("numpy _reconstruct of anything but an empty ndarray")
        made = np.ndarray((0,), np.int8)
        unbuilt[id(made)] = made
        return made

    def build_array(array: np.ndarray, state) -> None:
        _once(unbuilt, array, "numpy array")
        if type(state) is not tuple or len(state) != 5 or state[0] != 1:
            raise Refused("numpy array state of another layout")
        _, shape, dtype, fortran, raw = state
        _numeric(dtype, "numpy array")
        shape = _shape(shape)
        if type(fortran) is not bool or type(raw) is not bytes or len(raw) != math.prod(shape) * dtype.itemsize:
            raise Refused(f"numpy array whose raw bytes are not {shape} x {dtype.itemsize} bytes")
        array.__setstate__((1, shape, dtype, fortran, raw))

    def scalar(dtype, raw) -> np.generic:
        _numeric(dtype, "numpy scalar")
        if type(raw) is not bytes or len(raw) != dtype.itemsize:
            raise Refused("numpy scalar whose raw bytes do not fit its dtype")
        return np.frombuffer(raw, dtype=dtype)[0].copy()

    def from_buffer(buffer, dtype, shape, order) -> np.ndarray:
        """Protocol 5's numpy array: the bytes, a numeric dtype, the shape and the memory order."""
        _numeric(dtype, "numpy array")
        shape = _shape(shape)
        if type(buffer) not in (bytes, bytearray) or len(buffer) != math.prod(shape) * dtype.itemsize:
            raise Refused(f"numpy array whose raw bytes are not {shape} x {dtype.itemsize} bytes")
        if type(order) is not str or order not in ("C", "F"):
            raise Refused("numpy array of a memory order other than C or F")
        return np.frombuffer(bytes(buffer), dtype=dtype).reshape(shape, order=order).copy(order=order)

    callee("numpy", "dtype", reduce=new_dtype)
    ndarray_type = callee("numpy", "ndarray")
    for module in NUMPY_MODULES:
        callee(module, "_reconstruct", reduce=reconstruct)
        callee(module, "scalar", reduce=scalar)
        callee(module.replace("multiarray", "numeric"), "_frombuffer", reduce=from_buffer)
    builders = {StandIn: _build_stand_in, argparse.Namespace: _build_namespace, OrderedDict: _build_ordered_dict}
    builders.update({np.dtype: build_dtype, np.ndarray: build_array})
    builders.update({type(np.dtype(code)): build_dtype for code in NUMPY_CODES})  # numpy 2: a class per dtype
    return Policy(names=names, builders=builders, contents=_contents, storage=storage)


def _contents(item: object) -> list:
    """What a finished value holds below `item` ([] for a leaf); refused for any type a checkpoint does not hold."""
    if isinstance(item, StandIn):
        return list(item.fields.values())
    if type(item) is argparse.Namespace:
        return list(vars(item).values())
    if type(item) in (torch.Tensor, torch.nn.Parameter):
        return list(getattr(item, "__dict__", {}).values())
    if type(item) is np.ndarray:
        _numeric(item.dtype, "numpy array")
        return []
    if isinstance(item, np.generic) and not isinstance(item, np.object_):
        _numeric(item.dtype, "numpy scalar")
        return []
    if isinstance(item, np.dtype):
        _numeric(item, "numpy dtype")
        return []
    if type(item) in (torch.Size, torch.device, torch.dtype, torch.storage.TypedStorage, slice):
        return []
    raise Refused(f"{getattr(item, 'name', type(item).__qualname__)} used as a value")


def _stand_in_maker(name: str) -> Callable[[], StandIn]:
    def make() -> StandIn:
        return StandIn(name)

    return make


def _fields(state: object, what: str) -> dict:
    """A BUILD state as {name: value}: a dict of identifiers, or (dict, slots dict) as pickle stores slots."""
    if type(state) is tuple and len(state) == 2:
        merged = {}
        for part in state:
            if part is not None:
                merged.update(_fields(part, what))
        return merged
    if type(state) is not dict or not all(type(k) is str and k.isidentifier() for k in state):
        raise Refused(f"BUILD on {what} with a state that is not a dict of field names")
    if any(k.startswith("__") for k in state):
        raise Refused(f"BUILD on {what} with a field named like Python's own ({sorted(state)[0]})")
    return state


def _build_stand_in(obj: StandIn, state: object) -> None:
    obj.fields.update(_fields(state, obj.pickled_as))


def _build_ordered_dict(obj: OrderedDict, state: object) -> None:
    """A state dict's attributes (torch's `_metadata`), never one OrderedDict itself defines (its methods)."""
    for key, value in _fields(state, "collections.OrderedDict").items():
        if hasattr(OrderedDict, key):
            raise Refused(f"BUILD on collections.OrderedDict that replaces its {key}")
        setattr(obj, key, value)


def _build_namespace(obj: argparse.Namespace, state: object) -> None:
    for key, value in _fields(state, "argparse.Namespace").items():
        setattr(obj, key, value)


def _namespace(*args, **kwargs) -> argparse.Namespace:
    if args or kwargs:
        raise Refused("argparse.Namespace made with arguments")
    return argparse.Namespace()


def _with_state(tensor: torch.Tensor, state: object) -> torch.Tensor:
    """Attributes a tensor was saved with (torch's `__dict__` state), none of them one torch defines."""
    if not _nonempty(state):
        return tensor
    fields = _fields(state, "a tensor")
    taken = [k for k in fields if hasattr(type(tensor), k)]
    if taken:
        raise Refused(f"tensor state that overrides torch's own attribute {taken[0]}")
    for key, value in fields.items():
        setattr(tensor, key, value)
    return tensor


def _once(unbuilt: dict, obj: object, what: str) -> None:
    if unbuilt.pop(id(obj), None) is not obj:
        raise Refused(f"BUILD on a {what} that is already built")


def _numeric(dtype: object, what: str) -> None:
    if not isinstance(dtype, np.dtype):
        raise Refused(f"{what} without a numpy dtype")
    if dtype.hasobject or dtype.kind == "O":
        raise Refused(f"{what} of object dtype (its items would be pointers)")
    if dtype.kind not in "biufc" or dtype.names is not None or dtype.subdtype is not None or dtype.flags:
        raise Refused(f"{what} of dtype {dtype} (only bool, int, uint, float, complex)")


def _int(value: object, what: str) -> int:
    if type(value) is not int or not -MAX_INT < value < MAX_INT:
        raise Refused(f"{what}: expected an int, got {type(value).__name__}")
    return value


def _shape(value: object) -> tuple[int, ...]:
    if type(value) not in (tuple, list, torch.Size) or len(value) > MAX_DIMS:
        raise Refused("a shape that is not a short tuple of ints")
    shape = tuple(_int(v, "a shape's size") for v in value)
    if any(v < 0 for v in shape):
        raise Refused("a negative size or stride")
    return shape


def _within(numel: int, offset: int, size: tuple, stride: tuple) -> None:
    """A view of `size`/`stride` from `offset` reads inside a storage of `numel` items."""
    if len(size) != len(stride) or offset < 0:
        raise Refused("a tensor whose size and stride disagree")
    end = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else offset
    if end > numel:
        raise Refused(f"a tensor that reads past its storage ({numel} items)")


def _nonempty(value: object) -> bool:
    """Whether an optional dict argument holds something (anything but None, {} or an empty OrderedDict)."""
    if value is None:
        return False
    return type(value) not in (dict, OrderedDict) or bool(value)


def _no_hooks(hooks: object) -> None:
    if _nonempty(hooks):
        raise Refused("a tensor saved with backward hooks")


def _ordered_dict(*args) -> OrderedDict:
    if args and not (len(args) == 1 and type(args[0]) is list and not args[0]):
        raise Refused("OrderedDict made with items (pickle stores them as SETITEMS)")
    return OrderedDict()


def _scalars(items: object, what: str) -> list:
    if type(items) not in (list, tuple) or not all(type(v) in (str, int, float, bool, bytes) for v in items):
        raise Refused(f"{what} of anything but strings and numbers")
    return list(items)


def _slice(*args) -> slice:
    if len(args) != 3 or not all(v is None or type(v) is int for v in args):
        raise Refused("slice of anything but ints")
    return slice(*args)


def _complex(real=0.0, imag=0.0) -> complex:
    if type(real) not in (int, float) or type(imag) not in (int, float):
        raise Refused("complex of anything but two numbers")
    return complex(real, imag)


def _latin1(text, encoding="latin1") -> bytes:
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise Refused("_codecs.encode of anything but a string in latin-1 (how protocol 2 stores bytes)")
    return text.encode("latin-1")


def _bytearray(*args) -> bytearray:
    if args == ():
        return bytearray()
    if len(args) == 1 and type(args[0]) is bytes:
        return bytearray(args[0])
    return bytearray(_latin1(*args))


def _size(values=()) -> torch.Size:
    return torch.Size(_shape(values))


def _device(kind, index=None) -> torch.device:
    if type(kind) is not str or len(kind) > 32 or index is not None and _int(index, "device index") < 0:
        raise Refused("torch.device of anything but a short name and an index")
    return torch.device(kind) if index is None else torch.device(kind, index)
