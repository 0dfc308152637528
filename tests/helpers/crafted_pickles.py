"""Hostile checkpoint files written from the other side's definitions, never by our loader's code: pickles opcode by
opcode from pickle's own (pickletools' opcode table), each payload pushing one value that, under Python's unpickler,
would run `touch MARKER` (or build an object-dtype array whose items are forged pointers), or take minutes and
gigabytes (hashing bombs); and whole files from torch's and zip's own writers (a TorchScript archive whose
`__setstate__` writes MARKER, a DEFLATE bomb, tensors whose strides read one element many times).

`payloads(marker)` and `files(marker)` name each construct as the loader's refusal names it; `splice` puts a payload
into an existing pickle as one more item of its top-level dict; `rewrite_torch_file` writes a torch zip file with
its data.pkl replaced, as torch's own writer lays it out."""

from __future__ import annotations

import functools
import pickletools
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

OP = {op.name: op.code.encode("latin-1") for op in pickletools.opcodes}
EXT_CODE = 0xF0  # the copyreg extension code a test registers for posix.system
FORGED = b"\x41" * 8  # what an object-dtype array's item would be read as: the pointer 0x4141414141414141
# Every module the allowlist names a global of (dotted names under each must be refused).
ALLOWED_MODULES = (
    "collections", "builtins", "_codecs", "argparse", "torch", "torch._utils", "torch._tensor", "torch.nn.parameter",
    "numpy", "numpy.core.multiarray", "numpy._core.multiarray", "deepspeed.runtime.fp16.loss_scaler",
    "deepspeed.utils.tensor_fragment", "deepspeed.runtime.zero.config", "__builtin__", "copyreg", "copy_reg",
    "numpy.core.numeric", "numpy._core.numeric",
)  # fmt: skip


# A dotted name from each allowed module to the os module (deepspeed 0.19.8, torch 2.13, numpy 2.4), where one is
# within three attributes; the others get `os.system`, which Python's unpickler fails to resolve.
DOTTED = {
    "argparse": "_os", "torch": "os", "torch._utils": "os", "torch._tensor": "torch.os",
    "torch.nn.parameter": "torch.os", "numpy": "_pytesttester.os", "numpy._core.multiarray": "overrides.inspect.os",
    "deepspeed.runtime.fp16.loss_scaler": "dist.os", "deepspeed.utils.tensor_fragment": "dist.os",
    "deepspeed.runtime.engine": "os", "numpy._core.numeric": "arrayprint.contextlib.os",
}  # fmt: skip
DOTTED_LIVE = {f"{module}.{path}" for module, path in DOTTED.items()}


def text(value: str) -> bytes:
    """BINUNICODE: a str."""
    data = value.encode("utf-8")
    return OP["BINUNICODE"] + struct.pack("<I", len(data)) + data


def raw(value: bytes) -> bytes:
    """bytes as protocol 2 stores them (torch.save's protocol): _codecs.encode(the latin-1 text, 'latin1')."""
    return call(global_("_codecs", "encode"), text(value.decode("latin-1")), text("latin1"))


def small(value: int) -> bytes:
    """BININT: a 32-bit int."""
    return OP["BININT"] + struct.pack("<i", value)


def global_(module: str, name: str) -> bytes:
    return OP["GLOBAL"] + f"{module}\n{name}\n".encode()


def tuple_(*items: bytes) -> bytes:
    return OP["MARK"] + b"".join(items) + OP["TUPLE"]


def call(func: bytes, *args: bytes) -> bytes:
    """REDUCE: func(*args)."""
    return func + tuple_(*args) + OP["REDUCE"]


def system(marker: Path, func: bytes) -> bytes:
    return call(func, text(f"touch {marker}"))


def numpy_dtype(spec: str, state: tuple | None = None) -> bytes:
    """numpy.dtype(spec, False, True), with BUILD of (3, byteorder, subarray, names, fields, elsize, align, flags)."""
    made = call(global_("numpy", "dtype"), text(spec), OP["NEWFALSE"], OP["NEWTRUE"])
    if state is None:
        return made
    order, elsize, alignment, flags = state
    fields = small(3) + text(order) + OP["NONE"] * 3 + small(elsize) + small(alignment) + small(flags)
    return made + tuple_(fields) + OP["BUILD"]


def numpy_array(dtype: bytes, count: int, data: bytes) -> bytes:
    """numpy's _reconstruct(ndarray, (0,), b'b') then BUILD (1, (count,), dtype, False, data)."""
    empty = call(
        global_("numpy._core.multiarray", "_reconstruct"), global_("numpy", "ndarray"), tuple_(small(0)), raw(b"b")
    )
    state = tuple_(small(1), tuple_(small(count)), dtype, OP["NEWFALSE"], raw(data))
    return empty + state + OP["BUILD"]


def object_array() -> bytes:
    """An array of dtype 'O' whose one item is the forged pointer 0x4141414141414141."""
    return numpy_array(numpy_dtype("O8", ("|", -1, -1, 0)), 1, FORGED)


def forged_void_array() -> bytes:
    """A void dtype whose BUILD claims object items (numpy's NPY_ITEM_HASOBJECT and friends), over forged bytes."""
    return numpy_array(numpy_dtype("V8", ("|", 8, 1, 0x3F)), 1, FORGED)


SCRATCH_MEMO = struct.pack("<I", 0x7FFFFFF0)  # a memo index no torch.save pickle reaches


def dict_of(key: bytes) -> bytes:
    """{key: None}: the key hashed once."""
    return OP["EMPTY_DICT"] + key + OP["NONE"] + OP["SETITEM"]


def repeated_key(copies: int, items: int) -> bytes:
    """A dict whose keys are one tuple of `items` ints, memoized and set `copies` times: each insertion hashes the whole
    tuple again (work copies x items for a file of about 5 x (copies + items) bytes)."""
    key = OP["MARK"] + small(7) * items + OP["TUPLE"] + OP["LONG_BINPUT"] + SCRATCH_MEMO
    pairs = key + OP["NONE"] + (OP["LONG_BINGET"] + SCRATCH_MEMO + OP["NONE"]) * (copies - 1)
    return OP["EMPTY_DICT"] + OP["MARK"] + pairs + OP["SETITEMS"]


def doubled(levels: int) -> bytes:
    """A tuple (t, t) of a tuple (t, t)... `levels` deep through the memo: hashing it visits 2**levels elements."""
    step = OP["LONG_BINPUT"] + SCRATCH_MEMO + OP["LONG_BINGET"] + SCRATCH_MEMO + OP["TUPLE2"]
    return OP["EMPTY_TUPLE"] + step * levels


def payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    """{construct: (payload, what a refusal of it names)}; each payload pushes exactly one value, and those whose
    name says so would run `touch marker` under Python's unpickler (`live`)."""
    command = text(f"touch {marker}")
    new = OP["EMPTY_TUPLE"] + OP["NEWOBJ"]
    namespace = global_("argparse", "Namespace") + new + OP["EMPTY_DICT"] + text("hook")
    scaler = global_("deepspeed.runtime.fp16.loss_scaler", "LossScaler") + new + OP["EMPTY_DICT"] + text("__class__")
    outside = tuple_(text("storage"), global_("torch", "FloatStorage"), text("999"), text("cpu"), small(4))
    inst = OP["MARK"] + OP["STRING"] + f"'touch {marker}'\n".encode() + b"ios\nsystem\n"
    found = {
        "GLOBAL posix.system": (system(marker, global_("posix", "system")), "GLOBAL posix.system"),
        "INST os.system": (inst, "opcode STRING"),
        "INST of an allowed class": (OP["MARK"] + b"icollections\nOrderedDict\n", "opcode INST"),
        "OBJ os.system": (OP["MARK"] + global_("os", "system") + command + OP["OBJ"], "GLOBAL os.system"),
        "OBJ of an allowed class": (OP["MARK"] + global_("collections", "OrderedDict") + OP["OBJ"], "opcode OBJ"),
        "EXT1 posix.system": (OP["EXT1"] + bytes([EXT_CODE]) + tuple_(command) + OP["REDUCE"], "opcode EXT1"),
        "EXT2 posix.system": (OP["EXT2"] + struct.pack("<H", EXT_CODE) + tuple_(command) + OP["REDUCE"], "opcode EXT2"),
        "EXT4 posix.system": (OP["EXT4"] + struct.pack("<i", EXT_CODE) + tuple_(command) + OP["REDUCE"], "opcode EXT4"),
        "NEWOBJ_EX argparse.Namespace whose keyword argument calls posix.system": (
            global_("argparse", "Namespace")
            + OP["EMPTY_TUPLE"]
            + OP["EMPTY_DICT"]
            + text("hook")
            + system(marker, global_("posix", "system"))
            + OP["SETITEM"]
            + OP["NEWOBJ_EX"],
            "GLOBAL posix.system",
        ),
        "NEWOBJ_EX posix.system": (
            global_("posix", "system") + tuple_(command) + OP["EMPTY_DICT"] + OP["NEWOBJ_EX"],
            "GLOBAL posix.system",
        ),
        "NEWOBJ_EX with keyword arguments that are not names": (
            global_("argparse", "Namespace")
            + OP["EMPTY_TUPLE"]
            + OP["EMPTY_DICT"]
            + small(1)
            + command
            + OP["SETITEM"]
            + OP["NEWOBJ_EX"],
            "opcode NEWOBJ_EX",
        ),
        "NEWOBJ argparse.Namespace whose state calls posix.system": (
            namespace + system(marker, global_("posix", "system")) + OP["SETITEM"] + OP["BUILD"],
            "GLOBAL posix.system",
        ),
        "NEWOBJ of a loss scaler with a state of Python's own fields": (
            scaler + global_("numpy", "ndarray") + OP["SETITEM"] + OP["BUILD"],
            "LossScaler with a state other than plain values",
        ),
        "numpy array of object dtype": (object_array(), "numpy dtype 'O8'"),
        "numpy void dtype claiming object items": (forged_void_array(), "numpy dtype 'V8'"),
        "a persistent id naming a storage outside the file": (outside + OP["BINPERSID"], "which is not in the file"),
        "REDUCE of a list": (OP["EMPTY_LIST"] + OP["EMPTY_TUPLE"] + OP["REDUCE"], "not a global the pickle named"),
        "30,000 copies of one large tuple as dict keys": (repeated_key(30_000, 30_000), "element visits"),
        "tuples of tuples doubling 40 times as a dict key": (dict_of(doubled(40)), "element visits"),
        "100,000 nested tuples as a dict key": (dict_of(OP["EMPTY_TUPLE"] + OP["TUPLE1"] * 100_000), "nested deeper"),
    }
    for module in (*ALLOWED_MODULES, "deepspeed.runtime.engine"):  # protocol 4 walks a dotted name attribute-wise
        name = f"{DOTTED.get(module, 'os')}.system"
        found[f"STACK_GLOBAL {module}.{name}"] = (
            OP["PROTO"] + b"\x04" + call(text(module) + text(name) + OP["STACK_GLOBAL"], command),
            "opcode STACK_GLOBAL",
        )
    return found


class Writer(torch.nn.Module):
    """A module whose TorchScript `__setstate__` writes a file (torch.from_file with shared=True creates it): what
    torch.jit.load runs as it loads the archive."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.written = path, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.path, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.path, self.training = state[0], state[1]
        self.written = int(torch.from_file(self.path, shared=True, size=4, dtype=torch.uint8).fill_(65).sum())


def replace(target: Path, write: Callable[[Path], None]) -> None:
    """`write` a new file in `target`'s place (a new inode: a hard-linked copy's source stays as it was)."""
    temporary = target.with_name(target.name + ".crafting")
    write(temporary)
    temporary.replace(target)


def torchscript_archive(target: Path, marker: Path) -> None:
    """`target` replaced by a TorchScript archive (torch.jit.save) whose `__setstate__` writes `marker`."""
    replace(target, lambda out: torch.jit.save(torch.jit.script(Writer(str(marker))), str(out)))


def inflating(target: Path, inflated: int = 128 << 20) -> None:
    """`target` (a torch zip file) written again by zipfile's own writer with its data.pkl DEFLATE-compressed and
    followed by `inflated` zero bytes (the pickle ends at its STOP; a reader inflates the whole record first)."""
    with zipfile.ZipFile(target) as source:
        entries = [(info.filename, source.read(info)) for info in source.infolist()]

    def write(path: Path) -> None:
        with zipfile.ZipFile(path, "w") as out:
            for name, data in entries:
                if name.endswith("/data.pkl"):
                    out.writestr(name, data + bytes(inflated), compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
                else:
                    out.writestr(name, data)

    replace(target, write)


def with_tensor(target: Path, tensor: torch.Tensor) -> None:
    """`target` saved again by torch.save with one more top-level entry, `tensor` (its view as it is; a file whose
    value is not a dict becomes one holding it)."""
    value = torch.load(target, map_location="cpu", weights_only=False)  # the test's own fixture file
    value = {**value, "extra": tensor} if isinstance(value, dict) else {"value": value, "extra": tensor}
    replace(target, lambda out: torch.save(value, out))


def files(marker: Path) -> dict[str, tuple[Callable[[Path], None], str]]:
    """{construct: (rewrite the target file whole, what a refusal of it names)}."""
    return {
        "a TorchScript archive whose __setstate__ writes a file": (
            lambda target: torchscript_archive(target, marker),
            "a TorchScript archive",
        ),
        "a DEFLATE-compressed data.pkl inflating to 128 MB": (inflating, "inflate to"),
        "a 8 x 4096 tensor of stride 0 over one element": (
            lambda target: with_tensor(target, torch.zeros(1).expand(8, 4096)),
            "zero or overlapping strides",
        ),
        "a tensor whose strides overlap": (
            lambda target: with_tensor(target, torch.arange(16.0).as_strided((4, 4), (1, 1))),
            "zero or overlapping strides",
        ),
    }


LIVE = (
    "GLOBAL posix.system", "INST os.system", "OBJ os.system", "EXT1 posix.system", "EXT2 posix.system",
    "EXT4 posix.system", "NEWOBJ argparse.Namespace", "NEWOBJ_EX argparse.Namespace",
)  # fmt: skip


def live(construct: str) -> bool:
    """Whether Python's unpickler runs the payload's command (with EXT_CODE registered for posix.system)."""
    dotted = construct.startswith("STACK_GLOBAL") and construct.split()[1].rsplit(".", 1)[0] in DOTTED_LIVE
    return construct.startswith(LIVE) or dotted


def splice(pickle: bytes, key: str, payload: bytes) -> bytes:
    """`pickle` (whose value is a dict, ending in STOP) with `key` set to the payload's value, last."""
    if not pickle.endswith(OP["STOP"]):
        raise ValueError("expected a pickle ending in STOP")
    return pickle[:-1] + text(key) + payload + OP["SETITEM"] + OP["STOP"]


def pickle_of(path: Path) -> tuple[str, bytes]:
    """A torch zip file's data.pkl record name and bytes."""
    reader = torch._C.PyTorchFileReader(str(path))
    name = next(r for r in reader.get_all_records() if r.endswith("data.pkl"))
    return name, reader.get_record(name)


@functools.lru_cache(maxsize=16)
def records_of(path: Path, modified: int) -> dict[str, bytes]:
    """A torch zip file's records by name (cached per file version: `modified` is its mtime)."""
    reader = torch._C.PyTorchFileReader(str(path))
    return {r: reader.get_record(r) for r in reader.get_all_records()}


def rewrite_torch_file(path: Path, out: Path, pickle: bytes) -> None:
    """`path` (a torch zip file) copied to `out` with its data.pkl replaced, record by record through torch's own
    writer (storages aligned as torch.save aligns them)."""
    records = records_of(Path(path), Path(path).stat().st_mtime_ns)
    writer = torch._C.PyTorchFileWriter(str(out))
    for record, data in records.items():
        if record in (".data/version", ".data/serialization_id") or record == "version":
            continue  # the writer adds these itself
        body = pickle if record.endswith("data.pkl") else data
        writer.write_record(record, body, len(body))
    writer.write_end_of_file()


def carry(path: Path, key: str, payload: bytes, out: Path | None = None) -> Path:
    """Rewrite the torch file `path` (or write `out`) so that its top-level dict also holds `key`: the payload."""
    _, original = pickle_of(path)
    target = out or path
    replace(target, lambda temporary: rewrite_torch_file(path, temporary, splice(original, key, payload)))
    return target
