"""Checkpoint pickles read as data, never as code: the one loader for every `.pt`/`.bin` file the project reads
(DeepSpeed's model and optimizer states, on resume too through `engine_loads`; RNG states; universal checkpoints;
`.bin` bases and adapters).

`load` is torch.load with a pickle module of ours: its unpickler is `unpickler.Machine` under
`pickle_allowlist.policy` (exact names, checked calls and BUILDs), and its persistent ids must name storages of the
file itself: in a zip file a `data/<key>` record of exactly the declared size, stored uncompressed, inside the file;
in torch's legacy format storages whose sizes add up to no more than the file. torch's tar format (before 1.0) is
refused unread. Python's own unpickler never sees the file. A refusal raises `UnsafePickle` naming the file and the
construct; a damaged file `UnreadablePickle`; both are ValueErrors (bad input).

`trust=True` or TRUSTED (`--trust-pickles` of consolidate/convert, for a user's own files) lifts all of it: the file
goes to Python's unpickler, which runs whatever the file names (DeepSpeed's classes still become stand-ins)."""

from __future__ import annotations

import contextvars
import pickle
import struct
import tarfile
import types
import zipfile
from pathlib import Path

from pipeline.checkpoints import pickle_allowlist
from pipeline.checkpoints.unpickler import Machine, Malformed, Refused, brief
from pipeline.core.imports import torch

TRUSTED = contextvars.ContextVar("trust_pickles", default=False)  # --trust-pickles of the CLI commands
HINT = (
    "it is not data a checkpoint writer we support stores, and unpickling it could run code; if the file is your own, "
    "pass --trust-pickles (python -m pipeline consolidate|convert), or save its tensors again as safetensors"
)
MODULE_NAME = "pipeline_checkpoint_pickle"  # how a pickle module of ours is told apart (tests/instrumentation)


class UnsafePickle(ValueError):
    """A pickle that asks for something outside the allowlist."""


class UnreadablePickle(ValueError):
    """A damaged torch file (truncated, corrupted); `detail` says what broke."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"{path}: cannot be read as a torch.save file (truncated or corrupted?): {detail}")
        self.detail = detail


def load(path: Path, *, trust: bool = False, mmap: bool = True) -> object:
    """The object a torch.save file holds, through the restricted loader (memory-mapped where the format allows and
    `mmap`); `trust` or TRUSTED hands it to Python's unpickler instead."""
    path = Path(path)
    zipped = _is_zip(path)
    if trust or TRUSTED.get():
        return _load_with(path, _trusting_module(), mmap=mmap and zipped)
    try:
        if not zipped and tarfile.is_tarfile(path):
            raise Refused("torch's tar format (before 1.0), which extracts files to read them")
        storages = _zip_storages(path) if zipped else _LegacyStorages(path.stat().st_size)
        value = _load_with(path, restricted_module(storages), mmap=mmap and zipped)
        storages.finish()
        return value
    except Refused as err:
        raise UnsafePickle(f"{path}: refused: {err}; {HINT}") from None
    except Exception as err:  # Malformed, and torch's RuntimeError, EOFError, KeyError... for a damaged file
        raise UnreadablePickle(path, f"{type(err).__name__}: {err}"[:600]) from None


def check(path: Path) -> None:
    """Load `path` through the restricted loader and drop it: refused or unreadable files raise (mapped tensors are
    not read)."""
    load(path)


def check_folder(folder: Path) -> None:
    """`check` every torch file under `folder` (a universal checkpoint: a folder of files per parameter)."""
    for path in sorted(Path(folder).rglob("*.pt")):
        check(path)


def restricted_module(file_storages) -> types.SimpleNamespace:
    """A pickle module for torch.load: an Unpickler that is ours (its persistent ids checked by `file_storages` before
    torch's own storage loader sees them), and `load` for the small pickles around a legacy file's main one."""

    class Unpickler(Machine):
        def __init__(self, file, *, encoding: str = "ASCII", errors: str = "strict", **_ignored) -> None:
            storages = pickle_allowlist.Storages()
            policy = pickle_allowlist.policy(
                storage=lambda pid: storages.add(self.persistent_load(file_storages.check(pid))), storages=storages
            )
            super().__init__(file, policy, encoding=encoding, errors=errors)

        def persistent_load(self, pid: object) -> object:  # torch sets its storage loader here
            raise Refused("a persistent id outside torch.load")

    def load_one(file, *, encoding: str = "ASCII", errors: str = "strict", **_ignored) -> object:
        value = Machine(file, pickle_allowlist.policy(), encoding=encoding, errors=errors).load()
        file_storages.last_small_pickle = value  # a legacy file's last one lists the storages whose bytes follow
        return value

    return types.SimpleNamespace(Unpickler=Unpickler, load=load_one, __name__=MODULE_NAME)


def _load_with(path: Path, module: types.SimpleNamespace, *, mmap: bool) -> object:
    return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False, pickle_module=module)


def _is_zip(path: Path) -> bool:
    """What torch.load decides by: a zip archive's local-header magic at the start."""
    with open(path, "rb") as file:
        return file.read(4) == b"PK\x03\x04"


def _storage_id(pid: object, size: int) -> tuple[pickle_allowlist.StorageKind, str, str, int]:
    """The (kind, key, location, numel) of a persistent id of `size` fields as torch writes them."""
    if type(pid) is not tuple or len(pid) != size or pid[0] != "storage":
        raise Refused(f"a persistent id that is not one of torch's storages ({brief(pid)})")
    _, kind, key, location, numel = pid[:5]
    if not isinstance(kind, pickle_allowlist.StorageKind):
        raise Refused("a persistent id whose storage type is not one of torch's")
    if type(key) is not str or type(location) is not str or len(location) > 64:
        raise Refused("a persistent id whose key or location is not a short string")
    if type(numel) is not int or not 0 <= numel < 2**62:
        raise Refused("a persistent id with a storage size that is not a count")
    return kind, key, location, numel


class _ZipStorages:
    """The `data/<key>` records of a torch zip file; a persistent id must name one of them, of its exact size."""

    def __init__(self, records: dict[str, int]) -> None:
        self.records = records
        self.declared: dict[str, tuple[torch.dtype, int]] = {}
        self.last_small_pickle: object = None

    def check(self, pid: object) -> tuple:
        kind, key, location, numel = _storage_id(pid, 5)
        if key not in self.records:
            raise Refused(f"a persistent id naming storage {key[:40]!r}, which is not in the file")
        nbytes = numel * kind.dtype.itemsize
        if nbytes != self.records[key] or self.declared.setdefault(key, (kind.dtype, numel)) != (kind.dtype, numel):
            raise Refused(f"storage {key!r} declared as {nbytes} bytes of {kind.name}, the file holds another size")
        return ("storage", kind, key, location, numel)  # torch reads the kind's dtype

    def finish(self) -> None:
        """Nothing to check once a zip file is loaded (every storage was a record of it)."""


def _zip_storages(path: Path) -> _ZipStorages:
    """The file's storage records, each stored uncompressed and lying inside the file (checked before torch maps
    it)."""
    size = path.stat().st_size
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        infos = archive.infolist()
        prefix = infos[0].filename.split("/")[0] + "/data/" if infos else ""
        records = {}
        for info in infos:
            if not info.filename.startswith(prefix) or info.filename.endswith("/"):
                continue
            raw.seek(info.header_offset)
            header = raw.read(30)
            if len(header) != 30 or header[:4] != b"PK\x03\x04" or info.compress_type != zipfile.ZIP_STORED:
                raise Refused(f"storage record {info.filename} is compressed or has no local header")
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            if info.header_offset + 30 + name_length + extra_length + info.file_size > size:
                raise Malformed(f"storage record {info.filename} runs past the end of the file")
            records[info.filename[len(prefix) :]] = info.file_size
    return _ZipStorages(records)


class _LegacyStorages:
    """Storages of torch's legacy format: read from the file after the pickle, so together no larger than it."""

    def __init__(self, file_size: int) -> None:
        self.left = file_size
        self.declared: dict[str, tuple[torch.dtype, int]] = {}
        self.counted: set[str] = set()
        self.last_small_pickle: object = None

    def check(self, pid: object) -> tuple:
        kind, key, location, numel = _storage_id(pid, 6)
        view = pid[5]
        if view is not None:
            if type(view) is not tuple or len(view) != 3 or type(view[0]) is not str:
                raise Refused("a storage view that is not (key, offset, size)")
            if not all(type(v) is int and v >= 0 for v in view[1:]) or view[1] + view[2] > numel:
                raise Refused("a storage view outside its storage")
        if self.declared.setdefault(key, (kind.dtype, numel)) != (kind.dtype, numel):
            raise Refused(f"storage {key!r} declared twice with different sizes")
        if key not in self.counted:
            self.counted.add(key)
            self.left -= numel * kind.dtype.itemsize
            if self.left < 0:
                raise Refused("storages larger than the file that holds them")
        return ("storage", kind, key, location, numel, view)

    def finish(self) -> None:
        """Every storage the pickle made was filled from the file (torch fills those its last small pickle lists;
        any other would keep whatever memory it was given)."""
        listed = self.last_small_pickle
        if type(listed) is not list or not self.counted <= set(listed):
            raise Refused("a storage whose bytes the file does not hold")


def _trusting_module() -> types.SimpleNamespace:
    """Python's unpickler, whatever the file names, except that DeepSpeed's classes still become stand-ins (so
    consolidate needs no DeepSpeed)."""
    stand_ins = {(m, n): _trusted_stand_in(f"{m}.{n}") for m, n in pickle_allowlist.DEEPSPEED_CLASSES}
    stand_ins.update({name: int for name in pickle_allowlist.DEEPSPEED_ENUMS})

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            return stand_ins.get((module, name)) or super().find_class(module, name)

    return types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load, __name__="trusted_pickle")


def _trusted_stand_in(name: str) -> type:
    """A StandIn class for Python's unpickler (which makes objects with `__new__` and sets their state)."""

    class Trusted(pickle_allowlist.StandIn):
        def __new__(cls, *args, **kwargs):
            made = object.__new__(cls)
            pickle_allowlist.StandIn.__init__(made, name)
            return made

        def __init__(self, *args, **kwargs) -> None:
            pass

        def __setstate__(self, state: object) -> None:
            self.fields.update(state if isinstance(state, dict) else {})

    return Trusted
