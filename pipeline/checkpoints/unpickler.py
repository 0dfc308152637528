"""A pickle interpreter that builds data and nothing else: every opcode of protocols 0-5 (pickletools' list) is
implemented here, none is handed to Python's own unpickler, so what a file can make happen is decided in one place.

- Globals (GLOBAL, STACK_GLOBAL) resolve only through `names`, exact (module, qualified name) pairs mapped to what
  we hand back; a dotted name is never walked attribute by attribute and nothing is imported.
- Calls (REDUCE, NEWOBJ, NEWOBJ_EX) reach only a `Callee` of `names`, which checks its own arguments; INST and OBJ
  (protocol 0/1 class calls, which no writer we read emits), the extension registry (EXT1/2/4), text persistent ids
  (PERSID) and out-of-band buffers are refused, naming what the file asked for.
- BUILD (state set on an object) applies only where `builders` has a function for the object's exact type.
- Persistent ids (BINPERSID: torch's storages) go to `storage`, which checks them against the file.
- Items are appended or set only on plain lists, dicts and sets; tuples nest at most MAX_DEPTH deep (hashing a deeper
  one overflows the C stack), and the finished value is walked: containers at most MAX_DEPTH deep, no cycles, and
  only the types `names` may return (never a global used as a value).
Anything else raises `Refused` (the construct named) or `Malformed` (a damaged stream), both ValueErrors."""

from __future__ import annotations

import codecs
import copyreg
import pickletools
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MAX_DEPTH = 64  # containers nest this deep at most (checkpoints nest < 10)
MAX_PROTOCOL = 5


class Refused(ValueError):
    """The pickle asks for something outside the allowlist (the message names the construct)."""


class Malformed(ValueError):
    """The pickle stream is damaged (truncated, inconsistent, unknown opcode)."""


def brief(value: object, *, depth: int = 2) -> str:
    """A short description of an unpickled value for a refusal message: plain scalars shown (cut), containers to
    `depth`, anything else by its type's name only. Never the object's own str or repr: a crafted file can put a
    large tensor there (its str took 20 s in the fuzzer) or an object whose repr runs code."""
    if type(value) in (str, bytes, int, float, bool) or value is None:
        return repr(value)[:40]
    if type(value) in (tuple, list) and depth > 0:
        items = ", ".join(brief(v, depth=depth - 1) for v in value[:6])
        return f"({items}{', ...' if len(value) > 6 else ''})"
    return type(value).__name__


@dataclass(frozen=True, eq=False)
class Callee:
    """A global a pickle may call: `reduce(*args)` for REDUCE, `new(*args, **kwargs)` for NEWOBJ(_EX); either
    missing refuses that use. `name` is how refusals name it."""

    name: str
    reduce: Callable | None = None
    new: Callable | None = None


@dataclass(frozen=True)
class Policy:
    """What one kind of file may hold: `names` {(module, qualname): Callee or a value}, `builders` {exact type:
    f(obj, state)} for BUILD, `storage(pid)` for persistent ids (None: refused), `contents(item)` what a finished
    value holds below an item that is not a plain container ([] for a leaf; raises Refused for a type not allowed)."""

    names: Mapping[tuple[str, str], object]
    builders: Mapping[type, Callable[[object, object], None]]
    contents: Callable[[object], list]
    storage: Callable[[object], object] | None = None


_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray)
_OP = {ord(op.code): op.name for op in pickletools.opcodes}  # pickle's own definition of every opcode


class Machine:
    """Reads one pickle from `file` (anything with read/readline) under `policy`; `load()` returns the value."""

    def __init__(self, file, policy: Policy, *, encoding: str = "ASCII", errors: str = "strict") -> None:
        self.file = file
        self.read_exact, self.readline = _reader(file)
        self.policy, self.encoding, self.errors = policy, encoding, errors
        self.stack: list = []
        self.marks: list[list] = []
        self.memo: dict[int, object] = {}
        self.tuple_depth: dict[int, int] = {}  # id -> depth, for tuples this machine made

    def load(self) -> object:
        try:
            while True:
                code = self.read_exact(1)[0]
                name = _OP.get(code)
                if name is None:
                    raise Malformed(f"unknown opcode 0x{code:02x}")
                if name == "STOP":
                    if len(self.stack) != 1 or self.marks:
                        raise Malformed("STOP with an unbalanced stack")
                    return self.finish(self.stack.pop())
                getattr(self, "op_" + name)()
        except (Refused, Malformed) as err:
            raise type(err)(f"{err}{self.where()}") from None
        except Exception as err:  # an unhashable key, a bad encoding, a value of the wrong kind for an opcode...
            raise Malformed(f"{type(err).__name__}: {err}{self.where()}"[:400]) from None

    def where(self) -> str:
        try:
            return f" (at byte {self.file.tell()} of the pickle)"
        except (AttributeError, OSError, ValueError):
            return ""

    # -- the stack ------------------------------------------------------------------------------------------------
    def push(self, value: object) -> None:
        self.stack.append(value)

    def pop(self) -> object:
        if not self.stack:
            raise Malformed("pop from an empty stack")
        return self.stack.pop()

    def top(self) -> object:
        if not self.stack:
            raise Malformed("an opcode needs a value and the stack is empty")
        return self.stack[-1]

    def pop_mark(self) -> list:
        if not self.marks:
            raise Malformed("no MARK to pop to")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def hashable(self, key: object) -> object:
        """`key` once it is safe to hash: a tuple of at most MAX_DEPTH nested tuples."""
        if type(key) is tuple and self.tuple_depth.get(id(key), MAX_DEPTH + 1) > MAX_DEPTH:
            raise Refused(f"a tuple nested deeper than {MAX_DEPTH} used as a key")
        hash(key)
        return key

    def make_tuple(self, items) -> tuple:
        value = tuple(items)
        depth = 1 + max((self.tuple_depth.get(id(v), 0) for v in value if type(v) is tuple), default=0)
        self.tuple_depth[id(value)] = depth
        return value

    # -- scalars ----------------------------------------------------------------------------------------------------
    def op_PROTO(self) -> None:
        if self.read_exact(1)[0] > MAX_PROTOCOL:
            raise Malformed("a pickle protocol newer than 5")

    def op_FRAME(self) -> None:
        self.read_exact(8)

    def op_NONE(self) -> None:
        self.push(None)

    def op_NEWTRUE(self) -> None:
        self.push(True)

    def op_NEWFALSE(self) -> None:
        self.push(False)

    def op_INT(self) -> None:
        text = self.readline()
        self.push(False if text == b"00" else True if text == b"01" else _int(text))

    def op_LONG(self) -> None:
        text = self.readline()
        self.push(_int(text[:-1] if text.endswith(b"L") else text))

    def op_BININT(self) -> None:
        self.push(struct.unpack("<i", self.read_exact(4))[0])

    def op_BININT1(self) -> None:
        self.push(self.read_exact(1)[0])

    def op_BININT2(self) -> None:
        self.push(struct.unpack("<H", self.read_exact(2))[0])

    def op_LONG1(self) -> None:
        self.push(int.from_bytes(self.read_exact(self.read_exact(1)[0]), "little", signed=True))

    def op_LONG4(self) -> None:
        self.push(int.from_bytes(self.read_exact(self.length("<i")), "little", signed=True))

    def op_FLOAT(self) -> None:
        try:
            self.push(float(self.readline()))
        except ValueError as err:
            raise Malformed(f"FLOAT: {err}") from None

    def op_BINFLOAT(self) -> None:
        self.push(struct.unpack(">d", self.read_exact(8))[0])

    def length(self, fmt: str) -> int:
        size = struct.unpack(fmt, self.read_exact(struct.calcsize(fmt)))[0]
        if size < 0:
            raise Malformed("a negative length")
        return size

    def op_BINBYTES(self) -> None:
        self.push(self.read_exact(self.length("<I")))

    def op_SHORT_BINBYTES(self) -> None:
        self.push(self.read_exact(self.read_exact(1)[0]))

    def op_BINBYTES8(self) -> None:
        self.push(self.read_exact(self.length("<Q")))

    def op_BYTEARRAY8(self) -> None:
        self.push(bytearray(self.read_exact(self.length("<Q"))))

    def op_STRING(self) -> None:
        text = self.readline()
        if len(text) < 2 or text[0] != text[-1] or text[:1] not in (b"'", b'"'):
            raise Malformed("STRING: not a quoted string")
        self.push(self.decode_str(codecs.escape_decode(text[1:-1])[0]))

    def op_BINSTRING(self) -> None:
        self.push(self.decode_str(self.read_exact(self.length("<i"))))

    def op_SHORT_BINSTRING(self) -> None:
        self.push(self.decode_str(self.read_exact(self.read_exact(1)[0])))

    def decode_str(self, data: bytes) -> str | bytes:
        """A protocol 0-2 string (Python 2's str), as the caller's `encoding` says."""
        return data if self.encoding == "bytes" else data.decode(self.encoding, self.errors)

    def op_UNICODE(self) -> None:
        self.push(str(self.readline(), "raw-unicode-escape"))

    def op_BINUNICODE(self) -> None:
        self.push(str(self.read_exact(self.length("<I")), "utf-8", "surrogatepass"))

    def op_SHORT_BINUNICODE(self) -> None:
        self.push(str(self.read_exact(self.read_exact(1)[0]), "utf-8", "surrogatepass"))

    def op_BINUNICODE8(self) -> None:
        self.push(str(self.read_exact(self.length("<Q")), "utf-8", "surrogatepass"))

    # -- containers -------------------------------------------------------------------------------------------------
    def op_MARK(self) -> None:
        self.marks.append(self.stack)
        self.stack = []

    def op_POP(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self.pop_mark()

    def op_POP_MARK(self) -> None:
        self.pop_mark()

    def op_DUP(self) -> None:
        self.push(self.top())

    def op_EMPTY_TUPLE(self) -> None:
        self.push(self.make_tuple(()))

    def op_TUPLE(self) -> None:
        self.push(self.make_tuple(self.pop_mark()))

    def op_TUPLE1(self) -> None:
        self.push(self.make_tuple(self.pop_n(1)))

    def op_TUPLE2(self) -> None:
        self.push(self.make_tuple(self.pop_n(2)))

    def op_TUPLE3(self) -> None:
        self.push(self.make_tuple(self.pop_n(3)))

    def pop_n(self, n: int) -> list:
        if len(self.stack) < n:
            raise Malformed("a TUPLE opcode with too few values")
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def op_EMPTY_LIST(self) -> None:
        self.push([])

    def op_LIST(self) -> None:
        self.push(self.pop_mark())

    def op_EMPTY_DICT(self) -> None:
        self.push({})

    def op_DICT(self) -> None:
        items = self.pop_mark()
        self.push(self.set_items({}, items))

    def op_EMPTY_SET(self) -> None:
        self.push(set())

    def op_FROZENSET(self) -> None:
        self.push(frozenset(self.hashable(v) for v in self.pop_mark()))

    def op_APPEND(self) -> None:
        value = self.pop()
        self.target(list, "APPEND").append(value)

    def op_APPENDS(self) -> None:
        items = self.pop_mark()
        self.target(list, "APPENDS").extend(items)

    def op_SETITEM(self) -> None:
        value, key = self.pop(), self.pop()
        self.set_items(self.target(dict, "SETITEM"), [key, value])

    def op_SETITEMS(self) -> None:
        items = self.pop_mark()
        self.set_items(self.target(dict, "SETITEMS"), items)

    def op_ADDITEMS(self) -> None:
        items = self.pop_mark()
        target = self.target(set, "ADDITEMS")
        for item in items:
            target.add(self.hashable(item))

    def target(self, kind: type, opcode: str):
        value = self.top()
        if type(value) not in ((dict, OrderedDict) if kind is dict else (kind,)):
            raise Refused(f"{opcode} on {_type_name(value)} (only a plain {kind.__name__} takes items)")
        return value

    def set_items(self, target: dict, items: list) -> dict:
        if len(items) % 2:
            raise Malformed("an odd number of dict items")
        for i in range(0, len(items), 2):
            target[self.hashable(items[i])] = items[i + 1]
        return target

    # -- the memo ---------------------------------------------------------------------------------------------------
    def op_PUT(self) -> None:
        self.memo[_int(self.readline())] = self.top()

    def op_BINPUT(self) -> None:
        self.memo[self.read_exact(1)[0]] = self.top()

    def op_LONG_BINPUT(self) -> None:
        self.memo[self.length("<I")] = self.top()

    def op_MEMOIZE(self) -> None:
        self.memo[len(self.memo)] = self.top()

    def op_GET(self) -> None:
        self.get(_int(self.readline()))

    def op_BINGET(self) -> None:
        self.get(self.read_exact(1)[0])

    def op_LONG_BINGET(self) -> None:
        self.get(self.length("<I"))

    def get(self, index: int) -> None:
        if index not in self.memo:
            raise Malformed(f"memo entry {index} read before it was written")
        self.push(self.memo[index])

    # -- globals, calls, state --------------------------------------------------------------------------------------
    def op_GLOBAL(self) -> None:
        module = self.readline().decode("utf-8")
        name = self.readline().decode("utf-8")
        self.push(self.resolve("GLOBAL", module, name))

    def op_STACK_GLOBAL(self) -> None:
        name, module = self.pop(), self.pop()
        if type(module) is not str or type(name) is not str:
            raise Refused("STACK_GLOBAL of a name that is not a string")
        self.push(self.resolve("STACK_GLOBAL", module, name))

    def resolve(self, opcode: str, module: str, name: str) -> object:
        try:
            return self.policy.names[(module, name)]
        except KeyError:
            raise Refused(f"{opcode} {module}.{name}") from None

    def op_INST(self) -> None:
        module = self.readline().decode("utf-8", "replace")
        name = self.readline().decode("utf-8", "replace")
        raise Refused(f"INST {module}.{name} (a protocol-0 class call)")

    def op_OBJ(self) -> None:
        items = self.pop_mark()
        called = _callee_name(items[0]) if items else "nothing"
        raise Refused(f"OBJ {called} (a protocol-1 class call)")

    def ext(self, size: int, opcode: str) -> None:
        code = int.from_bytes(self.read_exact(size), "little")
        registered = copyreg._inverted_registry.get(code)  # what Python's unpickler would resolve, named only
        where = f" ({'.'.join(registered)} in copyreg's registry)" if registered else ""
        raise Refused(f"{opcode} extension code {code}{where}")

    def op_EXT1(self) -> None:
        self.ext(1, "EXT1")

    def op_EXT2(self) -> None:
        self.ext(2, "EXT2")

    def op_EXT4(self) -> None:
        self.ext(4, "EXT4")

    def op_PERSID(self) -> None:
        raise Refused(f"PERSID {self.readline()[:60]!r} (a text persistent id)")

    def op_BINPERSID(self) -> None:
        pid = self.pop()
        if self.policy.storage is None:
            raise Refused("BINPERSID (a persistent id where no storage is expected)")
        self.push(self.policy.storage(pid))

    def op_REDUCE(self) -> None:
        args = self.pop()
        func = self.pop()
        self.push(self.call(func, "REDUCE", args, None))

    def op_NEWOBJ(self) -> None:
        args = self.pop()
        cls = self.pop()
        self.push(self.call(cls, "NEWOBJ", args, None))

    def op_NEWOBJ_EX(self) -> None:
        kwargs, args, cls = self.pop(), self.pop(), self.pop()
        if type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
            raise Refused("NEWOBJ_EX with keyword arguments that are not a dict of names")
        self.push(self.call(cls, "NEWOBJ_EX", args, kwargs))

    def call(self, func: object, opcode: str, args: object, kwargs: dict | None) -> object:
        if not isinstance(func, Callee):
            raise Refused(f"{opcode} on {_type_name(func)} (only an allowed global may be called)")
        target = func.reduce if opcode == "REDUCE" else func.new
        if target is None:
            raise Refused(f"{opcode} {func.name} (not how that class is stored)")
        if type(args) is not tuple:
            raise Refused(f"{opcode} {func.name} with arguments that are not a tuple")
        try:
            return target(*args, **(kwargs or {}))
        except (Refused, Malformed):
            raise
        except Exception as err:  # the callee's own checks and the library's (torch, numpy) refusing the values
            detail = f"{type(err).__name__}: {err}"[:300]
            raise Refused(f"{opcode} {func.name} with arguments it does not take ({detail})") from None

    def op_BUILD(self) -> None:
        state = self.pop()
        obj = self.top()
        builder = self.policy.builders.get(type(obj))
        if builder is None:
            raise Refused(f"BUILD on {_callee_name(obj)} (state is set only on stand-ins, numpy and Namespaces)")
        try:
            builder(obj, state)
        except (Refused, Malformed):
            raise
        except Exception as err:
            raise Refused(f"BUILD on {_type_name(obj)} with a state it does not take ({err})"[:400]) from None

    def op_NEXT_BUFFER(self) -> None:
        raise Refused("NEXT_BUFFER (an out-of-band buffer)")

    def op_READONLY_BUFFER(self) -> None:
        raise Refused("READONLY_BUFFER (an out-of-band buffer)")

    # -- the result -------------------------------------------------------------------------------------------------
    def finish(self, value: object) -> object:
        """`value` once walked: containers nest at most MAX_DEPTH deep, hold no cycle, and every leaf is a type the
        policy allows (a global is never a value)."""
        on_path: set[int] = set()
        reached: dict[int, int] = {}  # id -> the deepest depth a container was walked at
        pending: list[tuple[object, int, bool]] = [(value, 0, False)]
        while pending:
            item, depth, leaving = pending.pop()
            if leaving:
                on_path.discard(id(item))
                continue
            if type(item) in _SCALARS:
                continue
            children = _children(item)
            if children is None:
                if isinstance(item, Callee):
                    raise Refused(f"{item.name} used as a value")
                children = self.policy.contents(item)
                if not children:
                    continue
            if id(item) in on_path:
                raise Refused("a container that contains itself")
            if reached.get(id(item), -1) >= depth:
                continue
            if depth >= MAX_DEPTH:
                raise Refused(f"containers nested deeper than {MAX_DEPTH}")
            reached[id(item)] = depth
            on_path.add(id(item))
            pending.append((item, depth, True))
            pending.extend((child, depth + 1, False) for child in children)
        return value


def _children(item: object) -> list | None:
    kind = type(item)
    if kind in (list, tuple, set, frozenset):
        return list(item)
    if kind is dict:
        return [v for pair in item.items() for v in pair]
    if kind is OrderedDict:  # with the attributes BUILD may have set (a state dict's _metadata)
        return [v for pair in item.items() for v in pair] + list(vars(item).values())
    return None


def _type_name(value: object) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def _callee_name(value: object) -> str:
    return value.name if isinstance(value, Callee) else _type_name(value)


def _int(text: bytes) -> int:
    try:
        return int(text)
    except ValueError as err:
        raise Malformed(f"not an integer: {text[:40]!r} ({err})") from None


def _reader(file) -> tuple[Callable[[int], bytes], Callable[[], bytes]]:
    """read_exact(n) and readline() (without its newline) over `file`, refusing a stream that ends early."""
    read, readline = file.read, file.readline

    def read_exact(n: int) -> bytes:
        data = read(n)
        if len(data) != n:
            raise Malformed("the pickle ends early (truncated?)")
        return data

    def read_line() -> bytes:
        line = readline()
        if not line.endswith(b"\n"):
            raise Malformed("the pickle ends inside a line (truncated?)")
        return line[:-1]

    return read_exact, read_line
