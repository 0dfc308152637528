"""A checkpoint pickle read opcode by opcode (pickletools.genops) and never run, for what torch's weights-only loader
does not bound (measured: docs/checkpoints.md):

- the work its hashing takes: dict keys, set items and call arguments reached through the memo many times over (30,000
  copies of one large tuple as keys took torch's loader 21 s for a 284 KB file, growing with the square of the file;
  tuples of tuples double with each level) are counted, element by element, against a budget linear in the file;
- the nesting of its tuples (CPython's tuple hash recurses in C: 100,000 levels are a segfault);
- what it calls: a REDUCE or NEWOBJ of anything but a global it named (torch's loader formats such a callee into
  its refusal: the repr of a 6 MB storage took minutes, a hang the fuzzer found);
- its persistent ids: each one of torch's storages as torch.save writes it, with the storage's key, type and size,
  which `safe_pickle` checks against the file (torch maps a zip record at the size the id declares, past the record,
  and allocates a legacy storage at that size, leaving one its key list omits unfilled).

Each value on the simulated stack is a `Node`: how many objects it holds counting repeats (`weight`), how deep its
containers nest, and its value where it is a plain literal (strings, numbers, tuples of them, globals' names)."""

from __future__ import annotations

import pickletools
from dataclasses import dataclass
from typing import BinaryIO

MAX_DEPTH = 64  # containers nest this deep at most (checkpoints nest < 10)
CAP = 1 << 50  # weights saturate here (a doubling DAG would otherwise make huge integers)
LITERAL_ITEMS = 64  # tuples and lists longer than this keep no literal (persistent ids have 5 or 6 items)
KEY_PICKLE_ITEMS = 1 << 20  # the legacy format's list of storage keys
UNSET = object()
HASHING = ("SETITEM", "SETITEMS", "DICT", "ADDITEMS", "FROZENSET")  # hash what they consume (keys, items)
CALLS = ("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST", "BUILD")  # pass what they consume to a callable
MUTATORS = ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD")  # add to the object below them
ARGUMENT = object()
LITERALS = (  # opcodes that push their own argument: a number or a string
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING",
    "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
)  # fmt: skip
PUSHES = {  # opcodes that push one value without reading the stack: their argument, or a constant literal
    **dict.fromkeys(LITERALS, ARGUMENT), "NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": (),
    "EMPTY_LIST": [], "EMPTY_DICT": UNSET, "EMPTY_SET": UNSET,
}  # fmt: skip


class Refused(ValueError):
    """A pickle that asks for more than a checkpoint does (named in the message)."""


class Malformed(ValueError):
    """A pickle that is not well formed (truncated, a bad opcode or argument, a stack underflow)."""


@dataclass(frozen=True)
class Global:
    """A GLOBAL's name, as a literal."""

    module: str
    name: str


@dataclass(frozen=True)
class StorageId:
    """A persistent id as torch.save writes it: ('storage', torch.<Type>Storage, key, location, numel[, view])."""

    type_name: str
    key: str
    numel: int
    view: tuple[str, int, int] | None = None


class Node:
    __slots__ = ("weight", "depth", "literal", "origin")

    def __init__(self, origin: str, *, weight: int = 1, depth: int = 0, literal: object = UNSET) -> None:
        self.weight, self.depth, self.literal, self.origin = weight, depth, literal, origin  # origin: the opcode

    def add(self, child: Node) -> None:
        """`child` put into this container (APPEND, SETITEM, BUILD...): no literal kept, unless a short list's."""
        self.weight = min(CAP, self.weight + child.weight)
        self.depth = max(self.depth, child.depth + 1)
        if type(self.literal) is list and child.literal is not UNSET and len(self.literal) < KEY_PICKLE_ITEMS:
            self.literal.append(child.literal)
        else:
            self.literal = UNSET


@dataclass
class Scan:
    """What one pickle holds: its storages' persistent ids in order, its value where it is a literal."""

    storages: list[StorageId]
    literal: object


def scan(source: BinaryIO | bytes, *, budget: int) -> Scan:
    """Read one pickle from `source` (a file is left just after its STOP); Refused if its hashing and calls would
    visit more than `budget` elements or its tuples nest deeper than MAX_DEPTH, Malformed if it is not a pickle."""
    stack: list[Node] = []
    marks: list[int] = []  # where each open MARK is on the stack
    memo: dict[int, Node] = {}
    storages: list[StorageId] = []
    work = 0
    try:
        for op, arg, _ in pickletools.genops(source):
            name = op.name
            if name == "MARK":
                marks.append(len(stack))
                continue
            if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                if len(stack) <= (marks[-1] if marks else 0):
                    raise Malformed(f"{name} with nothing to memoize")
                memo[int(arg) if name != "MEMOIZE" else len(memo)] = stack[-1]
                continue
            if name in PUSHES:  # a number, a string, a constant or an empty container: no stack read
                literal = arg if PUSHES[name] is ARGUMENT else PUSHES[name]
                stack.append(Node(name, literal=list(literal) if type(literal) is list else literal))
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                if int(arg) not in memo:
                    raise Malformed(f"{name} {arg}: a memo entry never written")
                stack.append(memo[int(arg)])
                continue
            consumed = _pop(stack, marks, op.stack_before)
            if name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX") and type(consumed[0].literal) is not Global:
                made_by = consumed[0].origin  # torch's loader would print the value in its refusal
                raise Refused(f"{name} of a value made by opcode {made_by}, not a global the pickle named")
            if name in HASHING:
                keys = consumed[1::2] if name in ("SETITEM", "SETITEMS", "DICT") else consumed
                work += sum(node.weight for node in keys)
            elif name in CALLS:
                work += sum(node.weight for node in consumed)
            if work > budget:
                raise Refused(f"dict keys and call arguments that take {work:,}+ element visits to hash or pass")
            stack.extend(_results(op, arg, consumed, storages))
            if name == "STOP":
                return Scan(storages, consumed[0].literal)
    except (ValueError, IndexError) as err:
        if isinstance(err, Refused | Malformed):
            raise
        raise Malformed(str(err)) from None
    raise Malformed("no STOP")


def _pop(stack: list[Node], marks: list[int], before: list) -> list[Node]:
    """What an opcode takes from the stack, bottom first: everything above the last mark where it takes a mark, and
    the items below it (an object it adds to stays on the stack, and comes first)."""
    below, taken = before, []
    if pickletools.markobject in before:
        if not marks:
            raise Malformed("no MARK for an opcode that needs one")
        at = marks.pop()
        below, taken = before[: before.index(pickletools.markobject)], stack[at:]
        del stack[at:]
    for _ in below:
        if len(stack) <= (marks[-1] if marks else 0):
            raise Malformed("stack underflow")
        taken.insert(0, stack.pop())
    return taken


def _results(op: pickletools.OpcodeInfo, arg: object, consumed: list, storages: list[StorageId]) -> list[Node]:
    """What an opcode leaves on the stack."""
    name = op.name
    if name in MUTATORS:
        target, *items = consumed
        for item in items:
            target.add(item)
        if name == "BUILD":
            target.literal = UNSET
        return [target]
    if not op.stack_after:  # POP, POP_MARK, STOP, PROTO, FRAME
        return []
    if name == "DUP":
        return consumed * 2
    if name == "BINPERSID":
        storages.append(_storage_id(consumed[0]))
        return [Node(name)]
    if name == "PERSID":
        raise Refused(f"a protocol-0 persistent id ({str(arg)[:40]!r}); torch writes storages as tuples")
    if name == "GLOBAL":
        module, _, attribute = str(arg).partition(" ")
        return [Node(name, literal=Global(module, attribute))]
    made = Node(
        name,
        weight=min(CAP, 1 + sum(node.weight for node in consumed)),
        depth=1 + max((node.depth for node in consumed), default=-1),
    )
    if name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST"):
        if made.depth > MAX_DEPTH:
            raise Refused(f"containers nested deeper than {MAX_DEPTH} levels")
        if len(consumed) <= LITERAL_ITEMS and all(node.literal is not UNSET for node in consumed):
            items = [node.literal for node in consumed]
            made.literal = items if name == "LIST" else tuple(items)
    return [made]


def _storage_id(pid: Node) -> StorageId:
    """A persistent id as torch writes it, else Refused."""
    value = pid.literal
    if type(value) is not tuple or len(value) not in (5, 6) or value[0] != "storage":
        raise Refused("a persistent id that is not one of torch's storages")
    _, kind, key, location, numel, *view = value
    view = view[0] if view else None
    if type(kind) is not Global or kind.module != "torch" or not kind.name.endswith("Storage"):
        raise Refused(f"a persistent id whose storage type is not one of torch's ({kind!r:.60})")
    if type(key) is not str or type(location) is not str or type(numel) is not int or not 0 <= numel < 1 << 62:
        raise Refused("a persistent id whose key, location or size is not a string, a string and a count")
    if view is not None and not (
        type(view) is tuple and len(view) == 3 and type(view[0]) is str and all(type(v) is int for v in view[1:])
    ):
        raise Refused("a storage view that is not (key, offset, size)")
    return StorageId(kind.name, key, numel, view)
