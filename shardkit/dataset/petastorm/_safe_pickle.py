"""A pickle reader that never runs the pickle: opcodes become an inert tree of `Global` and `Call`.

`load` walks the opcodes with `pickletools.genops` and plays the pickle machine's stack itself.
Where ``pickle.load`` would import a class and call it, this module records *what would have been
called*: a ``GLOBAL`` becomes a frozen `Global` (module, name) and ``REDUCE``/``NEWOBJ``/``BUILD``
become a `Call` holding the callable's `Global`, its arguments and its state. Nothing from the file
is ever imported, called or looked up, and every `Global` must be on the caller's whitelist, so a
pickle that names ``os.system`` fails at that opcode. Opcodes outside the set that protocols 2 to 5
use for plain data (extensions, persistent ids, out-of-band buffers, protocol 0/1 ``INST``/``OBJ``)
are refused too.

Containers (tuples, lists, dicts, sets and the `Call` objects) may nest at most `MAX_DEPTH` deep: a
crafted pickle of 100,000 nested lists costs nothing to read here, but whatever walks the tree
recursively afterwards (a ``repr`` in an error message, hashing a nested tuple as a dict key) would
end in a bare ``RecursionError``. A Petastorm schema nests about six deep.

Depth alone does not bound such a walk: the memo (and ``DUP``) let a pickle reuse one object, so 40
two-byte steps of ``t = (t, t)`` build a tuple of 2**40 elements when expanded, which hashing or a
``repr`` walks element by element (hours, or all memory). So each container also counts the values
it holds when expanded, shared ones once per use: at most `MAX_NODES`, and at most `MAX_KEY_NODES`
for a dict key or a set member, which is hashed as soon as it is read (a Petastorm schema's keys are
strings). Both counts are taken when a container is built or filled, so a list, dict, set or object
may not be filled after it was put into another container: filled later (in reverse order, say),
100,000 lists would nest 100,000 deep while each was counted two deep. A pickler fills each
container before using it, except in a reference cycle, which a schema does not have. `short_repr`
walks `Call` and `Global` with the same bounds as plain containers.
"""

from __future__ import annotations

import dataclasses
import pickletools
import reprlib
from collections.abc import Callable, Collection, Iterable
from typing import Any

from shardkit.errors import UnsafePickleError

__all__ = ["MAX_DEPTH", "MAX_KEY_NODES", "MAX_NODES", "Call", "Global", "load", "short_repr"]

#: How deep containers may nest in a pickle `load` reads (far below Python's recursion limit).
MAX_DEPTH = 100
#: How many values one container may hold when expanded (a value shared through the memo counts once
#: per place it is used). A Petastorm schema holds about 40 per field, so this admits ~25,000 fields.
MAX_NODES = 1_000_000
#: The same, for a value used as a dict key or a set member (hashed as soon as it is read).
MAX_KEY_NODES = 1_000


@dataclasses.dataclass(frozen=True)
class Global:
    """A reference to ``module.name`` that was looked up by name only, never imported."""

    module: str
    name: str

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


@dataclasses.dataclass(eq=False)
class Call:
    """What ``func(*args, **kwargs)`` (then ``__setstate__(state)``) would have built.

    ``items`` are the ``(key, value)`` pairs and ``list_items`` the values that the pickle added to
    the object with ``SETITEM(S)`` / ``APPEND(S)`` (e.g. the entries of an ``OrderedDict``).
    """

    func: Global
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    state: Any = None
    items: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    list_items: list[Any] = dataclasses.field(default_factory=list)


# Opcodes that only push their argument (ints, floats, strings, bytes).
_LITERALS = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
})
_CONSTANTS: dict[str, Any] = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_IGNORED = frozenset({"PROTO", "FRAME"})
_CONTAINERS = (tuple, list, dict, set, frozenset, Call)


class _Machine:
    """The stack, the mark stack and the memo of one `load`."""

    def __init__(self, allowed: Collection[str], where: str, advice: str) -> None:
        self.allowed, self.where, self.advice = allowed, where, advice
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        # id -> (container, how deep it nests, how many values it holds expanded); the container is kept
        # so that its id is not reused
        self.sizes: dict[int, tuple[Any, int, int]] = {}
        self.sealed: set[int] = set()  # ids of the mutable containers already put into another one

    def fail(self, problem: str) -> UnsafePickleError:
        return UnsafePickleError(f"{self.where}: {problem}; shardkit never runs pickled code, so it refuses "
                                 f"this pickle. {self.advice}".rstrip())

    def push(self, value: Any) -> None:
        self.stack.append(value)

    def measure(self, value: Any) -> tuple[int, int]:
        """How deep ``value`` nests (0 for a scalar, 1 for a container that holds none) and how many
        values it is when expanded (itself included)."""
        entry = self.sizes.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1], entry[2]
        return int(isinstance(value, _CONTAINERS)), 1

    def deeper(self, target: Any, children: Iterable[Any]) -> tuple[int, int]:
        """`measure` of ``target`` once it holds ``children`` too; refused beyond `MAX_DEPTH` or
        `MAX_NODES` (checked before anything hashes or walks them)."""
        depth, nodes = self.measure(target)
        for child_depth, child_nodes in map(self.measure, children):
            depth, nodes = max(depth, 1 + child_depth), nodes + child_nodes
        if depth > MAX_DEPTH:
            raise self.fail(f"the pickle nests containers more than {MAX_DEPTH} deep (a schema needs a "
                            "few levels; this one is crafted or broken)")
        if nodes > MAX_NODES:
            raise self.fail(f"the pickle's objects hold more than {MAX_NODES:,} values once its shared "
                            "references are expanded (a schema holds about 40 per field; this one is "
                            "crafted or broken)")
        return depth, nodes

    def nest(self, target: Any, children: list[Any]) -> Any:
        """Record that ``target`` holds ``children`` (see `deeper`); returns ``target``."""
        if id(target) in self.sealed or any(c is target for c in children):
            raise self.fail(f"the pickle fills a {type(target).__name__} after putting it into another "
                            "container (a reference cycle, or crafted to hide how deep or large its data is; "
                            "a schema has neither)")
        self.sizes[id(target)] = (target, *self.deeper(target, children))
        self.seal(children)
        return target

    def seal(self, children: list[Any]) -> None:
        """Mark the mutable ones of ``children`` as put into a container: they may not be filled any more."""
        self.sealed.update(id(c) for c in children if isinstance(c, list | dict | set | Call))

    def hashable(self, keys: Iterable[Any]) -> None:
        """Refuse dict keys or set members beyond `MAX_KEY_NODES` values, before they are hashed."""
        for key in keys:
            if self.measure(key)[1] > MAX_KEY_NODES:
                raise self.fail(f"the pickle uses a value of more than {MAX_KEY_NODES:,} values (its shared "
                                "references expanded) as a dict key or set member; a schema's keys are "
                                "strings, so this one is crafted or broken")

    def pop(self) -> Any:
        if not self.stack:
            raise self.fail("the pickle is malformed (it pops from an empty stack)")
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise self.fail("the pickle is malformed (it closes a MARK it never opened)")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def top(self) -> Any:
        if not self.stack:
            raise self.fail("the pickle is malformed (it reads from an empty stack)")
        return self.stack[-1]

    def global_(self, module: Any, name: Any) -> Global:
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.fail(f"the pickle is malformed (a global named by {short_repr(module)}, "
                            f"{short_repr(name)})")
        ref = Global(module, name)
        if ref.qualname not in self.allowed:
            raise self.fail(f"the pickle references {ref.qualname}, which is not among the allowed names")
        return ref

    def call(self, func: Any, args: Any, kwargs: Any = None) -> Call:
        if not isinstance(func, Global) or not isinstance(args, tuple) or not isinstance(kwargs or {}, dict):
            raise self.fail(f"the pickle is malformed (it calls {short_repr(func)} with {short_repr(args)})")
        call = Call(func, args, dict(kwargs or {}))
        self.nest(call, [args, kwargs])
        return call

    def set_items(self, target: Any, pairs: list[Any]) -> None:
        if len(pairs) % 2:
            raise self.fail("the pickle is malformed (SETITEMS with an odd number of values)")
        kv = list(zip(pairs[::2], pairs[1::2], strict=True))
        self.nest(target, pairs)  # before the keys are hashed (a deeply nested tuple key would recurse)
        self.hashable(pairs[::2])
        if isinstance(target, Call):
            target.items.extend(kv)
        elif isinstance(target, dict):
            try:
                target.update(kv)
            except TypeError as e:
                raise self.fail(f"the pickle is malformed (unhashable dict key: {e})") from e
        else:
            raise self.fail(f"the pickle is malformed (SETITEM on {type(target).__name__})")

    def append(self, target: Any, values: list[Any]) -> None:
        self.nest(target, values)
        if isinstance(target, Call):
            target.list_items.extend(values)
        elif isinstance(target, list):
            target.extend(values)
        else:
            raise self.fail(f"the pickle is malformed (APPEND on {type(target).__name__})")

    def build(self, target: Any, state: Any) -> None:
        if not isinstance(target, Call) or target.state is not None:
            raise self.fail(f"the pickle is malformed (BUILD on {type(target).__name__})")
        self.nest(target, [state])
        target.state = state

    def frozen(self, items: list[Any], kind: Callable[[list[Any]], Any]) -> Any:
        measured = self.deeper(None, items)  # before the items are hashed
        self.hashable(items)
        self.seal(items)
        try:
            out = kind(items)
        except TypeError as e:
            raise self.fail(f"the pickle is malformed (unhashable set item: {e})") from e
        self.sizes[id(out)] = (out, *measured)
        return out

    def step(self, op: str, arg: Any) -> None:
        push, pop = self.push, self.pop  # push must see self.stack as replaced by MARK / pop_mark
        if op in _LITERALS:
            push(arg)
        elif op in _CONSTANTS:
            push(_CONSTANTS[op])
        elif op == "BYTEARRAY8":
            push(bytearray(arg))
        elif op == "MARK":
            self.marks.append(self.stack)
            self.stack = []
        elif op == "POP":
            pop()
        elif op == "POP_MARK":
            self.pop_mark()
        elif op == "DUP":
            push(self.top())
        elif op == "EMPTY_TUPLE":
            push(())
        elif op in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(op[-1])
            if len(self.stack) < n:
                raise self.fail(f"the pickle is malformed ({op} on a stack of {len(self.stack)})")
            items = self.stack[-n:]
            del self.stack[-n:]
            push(self.nest(tuple(items), items))
        elif op == "TUPLE":
            items = self.pop_mark()
            push(self.nest(tuple(items), items))
        elif op == "EMPTY_LIST":
            push([])
        elif op == "LIST":
            items = self.pop_mark()
            push(self.nest(items, items))
        elif op == "APPEND":
            value = pop()
            self.append(self.top(), [value])
        elif op == "APPENDS":
            values = self.pop_mark()
            self.append(self.top(), values)
        elif op == "EMPTY_DICT":
            push({})
        elif op == "DICT":
            target: dict[Any, Any] = {}
            self.set_items(target, self.pop_mark())
            push(target)
        elif op == "SETITEM":
            value, key = pop(), pop()
            self.set_items(self.top(), [key, value])
        elif op == "SETITEMS":
            pairs = self.pop_mark()
            self.set_items(self.top(), pairs)
        elif op == "EMPTY_SET":
            push(set())
        elif op == "ADDITEMS":
            items = self.pop_mark()
            target_set = self.top()
            if not isinstance(target_set, set):
                raise self.fail("the pickle is malformed (ADDITEMS on a non-set)")
            target_set.update(self.frozen(items, set))
            self.nest(target_set, items)
        elif op == "FROZENSET":
            push(self.frozen(self.pop_mark(), frozenset))
        elif op == "GLOBAL":
            module, _, name = str(arg).partition(" ")
            push(self.global_(module, name))
        elif op == "STACK_GLOBAL":
            name = pop()
            push(self.global_(pop(), name))
        elif op in ("REDUCE", "NEWOBJ"):  # func(*args) and cls.__new__(cls, *args) look alike here
            args = pop()
            push(self.call(pop(), args))
        elif op == "NEWOBJ_EX":
            kwargs, args = pop(), pop()
            push(self.call(pop(), args, kwargs))
        elif op == "BUILD":
            state = pop()
            self.build(self.top(), state)
        elif op in ("PUT", "BINPUT", "LONG_BINPUT"):
            self.memo[int(arg)] = self.top()
        elif op == "MEMOIZE":
            self.memo[len(self.memo)] = self.top()
        elif op in ("GET", "BINGET", "LONG_BINGET"):
            if int(arg) not in self.memo:
                raise self.fail(f"the pickle is malformed (memo entry {arg} read before it was written)")
            push(self.memo[int(arg)])
        else:
            raise self.fail(f"the pickle uses the opcode {op}, which a data-only pickle does not need")


class _Repr(reprlib.Repr):
    """`reprlib.Repr` that also bounds `Call` and `Global` (whose dataclass ``repr`` would walk the whole
    tree before reprlib cut it to length)."""

    def repr_Global(self, x: Global, level: int) -> str:  # reprlib calls repr_<type name>
        return self.repr_str(x.qualname, level)[1:-1]

    def repr_Call(self, x: Call, level: int) -> str:
        name = self.repr_Global(x.func, level)
        if level <= 0:
            return f"{name}(...)"
        parts = [self.repr1(a, level - 1) for a in x.args[: self.maxtuple]]
        parts += ["..."] if len(x.args) > self.maxtuple else []
        parts += [f"{self.repr1(k, level - 1)}={self.repr1(v, level - 1)}"
                  for k, v in list(x.kwargs.items())[: self.maxdict]]
        parts += [] if x.state is None else [f"state={self.repr1(x.state, level - 1)}"]
        parts += [f"items={self.repr1(x.items, level - 1)}"] if x.items else []
        parts += [f"list_items={self.repr1(x.list_items, level - 1)}"] if x.list_items else []
        return f"{name}({', '.join(parts)})"


_REPR = _Repr()  # keyword options only from Python 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80


def short_repr(value: Any) -> str:
    """A bounded ``repr`` for messages: a value from a pickle can be huge, or nested without end."""
    return _REPR.repr(value)


def load(data: bytes, *, allowed: Collection[str], where: str, advice: str = "") -> Any:
    """Read a pickle as an inert tree, without importing or calling anything it names.

    Example:
        >>> tree = load(blob, allowed={"collections.OrderedDict"}, where="/data/_common_metadata")
        >>> tree.func.qualname, tree.items
        ('collections.OrderedDict', [('a', 1)])

    Args:
        data: the pickle bytes (protocols 2 to 5).
        allowed: qualified names (``"module.name"``) the pickle may reference.
        where: the file (or other origin) of ``data``, for messages.
        advice: what the user should do when the pickle is refused; appended to the message.

    Returns:
        Plain data (None, bool, int, float, str, bytes, tuple, list, dict, set) with `Global` for
        each referenced class and `Call` for each object the pickle would have constructed.

    Raises:
        UnsafePickleError: the pickle references a name outside ``allowed``, uses an opcode outside
            the data-only set, nests containers more than `MAX_DEPTH` deep, or is malformed or truncated.
    """
    machine = _Machine(allowed, where, advice)
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            if opcode.name == "STOP":
                if len(machine.stack) != 1 or machine.marks:
                    raise machine.fail("the pickle is malformed (its stack does not hold one object at STOP)")
                return machine.stack[0]
            if opcode.name not in _IGNORED:
                machine.step(opcode.name, arg)
    except (ValueError, IndexError, KeyError, EOFError, RecursionError) as e:
        if isinstance(e, UnsafePickleError):
            raise
        problem = f"{type(e).__name__}: {short_repr(e)}"
        raise machine.fail(f"the pickle is malformed or truncated ({problem})") from e
    raise machine.fail("the pickle is truncated (it ends before its STOP opcode)")
