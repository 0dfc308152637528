"""The one loader for every torch.save file another tool or person wrote (DeepSpeed's model and optimizer states, also
as a resuming engine reads them through `engine_loads`; RNG states; universal checkpoints; `.bin` bases and adapters):
torch's own weights-only loader, `torch.load(weights_only=True)`, memory-mapped where the format allows, under
`torch.serialization.safe_globals(checkpoint_globals())`: torch's defaults and the few classes such checkpoints hold
(DeepSpeed's loss scalers, fragment addresses and ZeRO stage, as stand-ins without importing DeepSpeed; numpy's
numeric arrays of RNG states, as HF Trainer allows them; `argparse.Namespace`). Around it, what torch's loader does
not bound (each measured in docs/checkpoints.md):

- the archive, before torch opens it: a TorchScript archive (torch.load hands one to torch.jit.load, which runs its
  code) is refused by name, as are records named twice, compressed storage records (a mapped file reads them as
  stored) and compressed records that would inflate past MAX_INFLATED (a bomb);
- the pickles, read opcode by opcode and never run (`pickle_scan`): hashing work, nesting, and each persistent id
  against the file (the size of its record; a legacy file's storages within the file and all of them filled);
- the value torch built (`check_value`): plain containers without cycles or deep nesting, every tensor a dense,
  strided CPU tensor inside its storage, without zero or overlapping strides or hooks, its attributes (ZeRO-3's
  `ds_id`) plain values under names none of torch's.

A refusal raises `UnsafePickle` naming the file and the construct; a damaged file `UnreadablePickle`; both are
ValueErrors (bad input). `trust=True` or TRUSTED (`--trust-pickles` of consolidate/convert, for a user's own files)
hands the file to torch.load(weights_only=False), which runs whatever it names (a TorchScript archive is still
refused)."""

from __future__ import annotations

import argparse
import contextvars
import pickle
import pickletools
import re
import tarfile
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np

from pipeline.checkpoints.pickle_scan import MAX_DEPTH, Malformed, Refused, StorageId, scan
from pipeline.core.imports import torch

TRUSTED = contextvars.ContextVar("trust_pickles", default=False)  # --trust-pickles of the CLI commands
HINT = (
    "it is not data a checkpoint writer we support stores, and unpickling it could run code; if the file is your own, "
    "pass --trust-pickles (python -m pipeline consolidate|convert), or save its tensors again as safetensors"
)
MAX_INFLATED = 64 << 20  # bytes all compressed records of an archive may inflate to (torch.save compresses none)
NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")  # numpy 1.x and 2.x pickle arrays under these
NUMERIC_DTYPE = re.compile(r"[<>|=]?[biufc][0-9]{1,2}")  # how numpy pickles a numeric dtype ('u4', '<f8', 'b1')
DEEPSPEED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
ZERO_STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"
LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None))  # values with nothing inside to check


class UnsafePickle(ValueError):
    """A file that asks for more than a checkpoint holds."""


class UnreadablePickle(ValueError):
    """A damaged torch file (truncated, corrupted); `detail` says what broke."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"{path}: cannot be read as a torch.save file (truncated or corrupted?): {detail}")
        self.detail = detail


class StandIn:
    """A DeepSpeed object of a checkpoint, its class never imported: the name it was pickled as and its fields (plain
    named values), read as attributes."""

    pickled_as = ""

    def __new__(cls, *args: object) -> StandIn:
        if args:
            raise Refused(f"{cls.pickled_as} made with arguments")
        made = object.__new__(cls)
        made.__dict__["fields"] = {}
        return made

    def __setstate__(self, state: object) -> None:
        plain = (*LEAVES, torch.dtype)
        if type(state) is not dict or not all(_field(name) and type(v) in plain for name, v in state.items()):
            raise Refused(f"{self.pickled_as} with a state other than plain values under plain names")
        self.fields.update(state)

    def __getattr__(self, name: str) -> object:
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"StandIn({self.pickled_as}, {sorted(self.fields)})"


STAND_INS = {name: type(name.rsplit(".", 1)[1], (StandIn,), {"pickled_as": name}) for name in DEEPSPEED_CLASSES}


def load(path: Path, *, trust: bool = False, mmap: bool = True) -> object:
    """The object a torch.save file holds, through torch's weights-only loader and the checks around it
    (memory-mapped where the format allows and `mmap`); `trust` or TRUSTED: through torch.load(weights_only=False)."""
    path = Path(path)
    try:
        zipped = _is_zip(path)
        records = _records(path) if zipped else None
        if not zipped and tarfile.is_tarfile(path):
            raise Refused("torch's tar format (before 1.0), which extracts files to read them")
        trusted = trust or TRUSTED.get()
        if not trusted:
            _scan(path, records)
        with torch.serialization.safe_globals(checkpoint_globals()):
            value = torch.load(path, map_location="cpu", mmap=mmap and zipped, weights_only=not trusted)
        if not trusted:
            check_value(value)
        return value
    except Refused as err:
        raise UnsafePickle(f"{path}: refused: {err}; {HINT}") from None
    except pickle.UnpicklingError as err:
        raise UnsafePickle(f"{path}: refused: {_torch_reason(str(err))}; {HINT}") from None
    except Exception as err:  # Malformed, and torch's RuntimeError, EOFError, KeyError... for a damaged file
        raise UnreadablePickle(path, f"{type(err).__name__}: {err}"[:600]) from None


def check(path: Path) -> None:
    """Load `path` and drop it: refused or unreadable files raise (mapped tensors are not read)."""
    load(path)


def check_folder(folder: Path) -> None:
    """`check` every torch file under `folder` (a universal checkpoint: a folder of files per parameter)."""
    for path in sorted(Path(folder).rglob("*.pt")):
        check(path)


def checkpoint_globals() -> list:
    """What checkpoints hold beyond torch's defaults, as (object, the name pickles give it)."""
    numeric = [type(np.dtype(code)) for code in "?bhilqBHILQefdgFD"]
    numpy = [(np.ndarray, "numpy.ndarray"), (_numeric_dtype, "numpy.dtype")]
    numpy += [(_empty_array, f"{module}._reconstruct") for module in NUMPY_MODULES]
    numpy += [(cls, f"numpy.dtypes.{cls.__name__}") for cls in numeric]  # a dtype's BUILD (its byte order)
    deepspeed = [(cls, name) for name, cls in STAND_INS.items()] + [(_zero_stage, ZERO_STAGE)]
    return [*numpy, *deepspeed, (argparse.Namespace, "argparse.Namespace")]


def _numeric_dtype(code: object, align: object = False, copy: object = True) -> np.dtype:
    """numpy.dtype as numpy pickles it, for numeric types only (never object, void or structured dtypes)."""
    if type(code) is not str or not NUMERIC_DTYPE.fullmatch(code) or align is not False or copy is not True:
        raise Refused(f"numpy dtype {str(code)[:20]!r} (checkpoints hold numeric arrays only)")
    return np.dtype(code)


def _empty_array(subtype: object, shape: object, typecode: object) -> np.ndarray:
    """numpy's _reconstruct as numpy pickles an array: an empty ndarray, filled by its BUILD."""
    if subtype is not np.ndarray or shape != (0,) or typecode != b"b":
        raise Refused("numpy's _reconstruct of anything but an empty ndarray")
    return np.ndarray((0,), "b")


def _zero_stage(value: object) -> int:
    """DeepSpeed's ZeroStageEnum as its int."""
    if type(value) is not int or not 0 <= value <= 3:
        raise Refused(f"{ZERO_STAGE} of {str(value)[:20]!r}")
    return value


def _field(name: object) -> bool:
    return type(name) is str and name.isidentifier() and not name.startswith("__")


def _is_zip(path: Path) -> bool:
    """What torch.load decides by: a zip archive's local-header magic at the start."""
    with open(path, "rb") as file:
        return file.read(4) == b"PK\x03\x04"


def _records(path: Path) -> dict[str, zipfile.ZipInfo]:
    """A torch zip file's records by name within the archive (the folder of its first record, as torch reads it),
    refused where torch would run code or inflate more than MAX_INFLATED."""
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    if not infos:
        raise Malformed("an empty zip archive")
    prefix = infos[0].filename.split("/")[0] + "/"
    records: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename.removeprefix(prefix)
        if name in records:
            raise Refused(f"record {name!r} stored twice (which one a reader takes is its own choice)")
        records[name] = info
    if "constants.pkl" in records:
        raise Refused("a TorchScript archive (constants.pkl): torch.load hands it to torch.jit.load (runs code)")
    inflated = 0
    for name, info in records.items():
        if info.compress_type != zipfile.ZIP_STORED:
            if name.startswith("data/"):
                raise Refused(f"storage record {name} is compressed (torch.save stores storages as they are)")
            inflated += info.file_size
    if inflated > MAX_INFLATED:
        raise Refused(f"compressed records that inflate to {inflated:,} bytes (at most {MAX_INFLATED:,})")
    return records


def _scan(path: Path, records: dict[str, zipfile.ZipInfo] | None) -> None:
    """The file's pickles read opcode by opcode (`pickle_scan`), their storages checked against the file."""
    size = path.stat().st_size
    budget = 4 * size + (1 << 20)  # element visits; a checkpoint's keys are strings, one visit each
    if records is not None:
        if "data.pkl" not in records:
            raise Malformed("a zip archive without data.pkl")
        with zipfile.ZipFile(path) as archive:
            found = scan(archive.read(records["data.pkl"]), budget=budget)
        _zip_storages(found.storages, records)
        return
    with open(path, "rb") as file:
        for _ in range(3):  # the magic number, the protocol version, the system's description
            scan(file, budget=budget)
        found = scan(file, budget=budget)
        keys = scan(file, budget=budget).literal
    _legacy_storages(found.storages, keys, size)


def _nbytes(storage: StorageId, declared: dict[str, StorageId]) -> int:
    """A storage's size in bytes; the same key declared twice must be declared alike."""
    first = declared.setdefault(storage.key, storage)
    if (first.type_name, first.numel) != (storage.type_name, storage.numel):
        raise Refused(f"storage {storage.key!r} declared twice with different sizes")
    try:
        dtype = (
            torch.uint8
            if storage.type_name == "UntypedStorage"
            else torch.serialization.StorageType(storage.type_name).dtype
        )
    except KeyError:
        raise Refused(f"a persistent id of storage type torch.{storage.type_name[:40]}") from None
    return storage.numel * torch.empty((), dtype=dtype).element_size()


def _zip_storages(storages: list[StorageId], records: dict[str, zipfile.ZipInfo]) -> None:
    """Each persistent id names a `data/<key>` record of exactly the size it declares (a mapped file reads a
    storage at the declared size, past its record)."""
    declared: dict[str, StorageId] = {}
    for storage in storages:
        record = records.get(f"data/{storage.key}")
        if record is None:
            raise Refused(f"a persistent id naming storage {storage.key[:40]!r}, which is not in the file")
        nbytes = _nbytes(storage, declared)
        if nbytes != record.file_size:
            raise Refused(f"storage {storage.key!r} declared as {nbytes} bytes; the file holds {record.file_size}")


def _legacy_storages(storages: list[StorageId], keys: object, size: int) -> None:
    """A legacy file's storages fit in the file and are all filled from it (torch fills the keys its last small
    pickle lists, and leaves any other storage as allocated); views lie within their storage."""
    if type(keys) is not list or not all(type(k) is str for k in keys) or len(set(keys)) != len(keys):
        raise Refused("a legacy file whose list of storages is not a list of distinct keys")
    declared: dict[str, StorageId] = {}
    total = 0
    for storage in storages:
        first = storage.key not in declared
        nbytes = _nbytes(storage, declared)
        total += nbytes if first else 0
        if storage.view is not None and storage.view[1] + storage.view[2] > storage.numel:
            raise Refused("a storage view outside its storage")
    if total > size:
        raise Refused("storages larger than the file that holds them")
    if set(declared) - set(keys):
        raise Refused("a storage whose bytes the file does not hold")


def _torch_reason(message: str) -> str:
    """What torch's weights-only loader refused, from its message (without its advice to allowlist or trust)."""
    if found := re.search(r"GLOBAL (\S+) (was not an allowed global|whose module \S+ is blocked)", message):
        return f"GLOBAL {found[1]}, which is not one of the classes a checkpoint holds"
    if found := re.search(r"Unsupported operand (\d+)", message):
        name = next((op.name for op in pickletools.opcodes if ord(op.code) == int(found[1])), found[1])
        return f"opcode {name}, which torch's weights-only loader does not read"
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation", "This file can still")
    lines = message.replace(torch.serialization.UNSAFE_MESSAGE, "").replace("WeightsUnpickler error:", "").splitlines()
    return next((line.strip() for line in lines if line.strip() and not line.strip().startswith(advice)), "")[:300]


def check_value(value: object) -> None:
    """Refused unless `value` is plain containers, no deeper than MAX_DEPTH and without cycles, of plain values,
    numeric arrays, DeepSpeed stand-ins and tensors each dense, strided, on the CPU and inside its storage."""
    heights: dict[int, int] = {}
    on_path: set[int] = set()
    todo: list[tuple[object, bool]] = [(value, False)]
    while todo:
        item, leaving = todo.pop()
        key = id(item)
        children = _children(item) if key not in heights or leaving else ()
        if leaving:
            on_path.discard(key)
            heights[key] = 1 + max((heights[id(c)] for c in children), default=0)
            if heights[key] > MAX_DEPTH:
                raise Refused(f"containers nested deeper than {MAX_DEPTH} levels")
        elif key in on_path:
            raise Refused("a container that contains itself")
        elif key not in heights:
            if children:
                on_path.add(key)
                todo.append((item, True))
                todo.extend((child, False) for child in children)
            else:
                heights[key] = 0


def _children(item: object) -> list:
    """What a value holds (checked on the way: tensors, arrays, anything that is not a checkpoint's kind)."""
    kind = type(item)
    if kind in (dict, OrderedDict, Counter):
        return [*item.keys(), *item.values(), *vars(item).values()] if kind is OrderedDict else [*item, *item.values()]
    if kind in (list, tuple, set, frozenset, torch.Size):
        return list(item)
    if kind is argparse.Namespace or isinstance(item, StandIn):
        return list(vars(item).values() if kind is argparse.Namespace else item.fields.values())
    if kind in (torch.Tensor, torch.nn.Parameter):
        _check_tensor(item)
    elif kind is np.ndarray:
        if item.dtype.kind not in "biufc":
            raise Refused(f"a numpy array of dtype {item.dtype}")
    elif kind not in (*LEAVES, torch.dtype, torch.device):
        raise Refused(f"a value of type {kind.__module__}.{kind.__qualname__}, which checkpoints do not hold")
    return []


def _check_tensor(tensor: torch.Tensor) -> None:
    """A dense, strided CPU tensor inside its storage, without zero or overlapping strides, hooks, or attributes but
    plain values under names none of torch's."""
    if tensor.layout != torch.strided or tensor.device.type != "cpu" or tensor.is_quantized or tensor.is_nested:
        raise Refused(f"a {tensor.layout} tensor on {tensor.device} (checkpoints hold dense CPU tensors)")
    plain = all(_field(n) and not hasattr(torch.Tensor, n) and type(v) in LEAVES for n, v in vars(tensor).items())
    if tensor._backward_hooks or not plain:  # ZeRO-3's flat groups carry their ds_id
        raise Refused("a tensor saved with backward hooks, or attributes other than plain values under plain names")
    if tensor.numel() == 0:
        return
    dims = sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n > 1)
    reach = 1  # one past the furthest element the smaller strides reach
    for stride, count in dims:
        if stride < reach:
            raise Refused(f"a tensor with zero or overlapping strides {tensor.stride()} over {tuple(tensor.shape)}")
        reach += stride * (count - 1)
    end = (tensor.storage_offset() + reach) * tensor.element_size()
    if end > tensor.untyped_storage().nbytes():
        raise Refused(f"a tensor that reads past its storage ({tensor.untyped_storage().nbytes()} bytes)")
