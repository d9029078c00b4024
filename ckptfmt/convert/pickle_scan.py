"""A pickle read without unpickling: its opcodes decoded (``pickletools``) and interpreted symbolically.

Containers and plain values are rebuilt; every global reference and every call becomes an
:class:`Opaque` record, never imported, never called. So a pickled object's plain fields (a
``TrainingArguments``' learning rate, see :mod:`.training_args`) are read without running anything.
The work is bounded: so many opcodes, and so many values once shared references are expanded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import SourceFormatError
from .bounded import check_graph, children

MAX_PICKLE_OPS = 100_000  # a TrainingArguments pickles in under 2,000 opcodes; each costs ~10 us to decode and walk
MAX_PICKLE_VALUES = MAX_PICKLE_OPS  # once shared references are expanded: walking it costs what decoding did


@dataclass(slots=True)
class Opaque:
    """An object the pickle would have built by importing ``name`` and calling it: never imported, never called."""

    name: str
    args: object = None
    state: object = None


def scan_pickle(data: bytes, url: str) -> object:
    """Interpret a pickle's opcodes symbolically (``pickletools.genops`` only decodes them): containers and
    plain values are rebuilt, every global reference and call becomes an :class:`Opaque` record."""
    import pickletools

    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}

    def pop_mark() -> list[Any]:
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    try:
        for count, (op, arg, _) in enumerate(pickletools.genops(data)):
            if count > MAX_PICKLE_OPS:
                raise SourceFormatError(f"more than {MAX_PICKLE_OPS} pickle opcodes", path=url)
            name = op.name
            if name in ("PROTO", "FRAME", "STOP"):
                continue
            if name == "MARK":
                marks.append(len(stack))
            elif name in _PUSH_ARG:
                stack.append(arg)
            elif name in _PUSH_CONST:
                stack.append(_PUSH_CONST[name])
            elif name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET"):
                stack.append({"EMPTY_DICT": {}, "EMPTY_LIST": [], "EMPTY_TUPLE": (), "EMPTY_SET": []}[name])
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = stack[-n:]
                del stack[-n:]
                stack.append(tuple(items))
            elif name in ("TUPLE", "LIST", "FROZENSET"):
                items = pop_mark()
                stack.append(tuple(items) if name == "TUPLE" else list(items))
            elif name == "DICT":
                items = pop_mark()
                stack.append(_pairs(items))
            elif name == "SETITEM":
                value, key = stack.pop(), stack.pop()
                _setitems(stack[-1], [key, value])
            elif name == "SETITEMS":
                items = pop_mark()
                _setitems(stack[-1], items)
            elif name in ("APPEND", "APPENDS", "ADDITEMS"):
                items = [stack.pop()] if name == "APPEND" else pop_mark()
                if isinstance(stack[-1], list):
                    stack[-1].extend(items)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(str(arg))] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[int(str(arg))])
            elif name == "GLOBAL":
                stack.append(Opaque(str(arg).replace(" ", ".")))
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                stack.append(Opaque(f"{module}.{attr}"))
            elif name in ("REDUCE", "NEWOBJ"):
                args, func = stack.pop(), stack.pop()
                stack.append(Opaque(func.name if isinstance(func, Opaque) else "?", args))
            elif name == "NEWOBJ_EX":
                _kwargs, args, func = stack.pop(), stack.pop(), stack.pop()
                stack.append(Opaque(func.name if isinstance(func, Opaque) else "?", args))
            elif name == "BUILD":
                state = stack.pop()
                if isinstance(stack[-1], Opaque):
                    stack[-1].state = state
            elif name in ("BINPERSID", "PERSID"):
                stack[-1 if name == "BINPERSID" else len(stack) :] = [Opaque("persistent")]
            elif name == "POP":
                stack.pop()
            elif name == "POP_MARK":
                pop_mark()
            elif name == "DUP":
                stack.append(stack[-1])
            else:
                raise SourceFormatError(f"pickle opcode {name} is not read", path=url)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise SourceFormatError(f"not a readable pickle: {exc}", path=url) from exc
    if len(stack) != 1:
        raise SourceFormatError("the pickle does not end with one object", path=url)
    # Each opcode above is constant work (a mark pops what was pushed), but a memoised object may be
    # referenced again and again: what the callers walk is the expansion, bounded here on the graph.
    # (Depth is no matter here: the scan recursed nowhere, and fields deeper than _is_plain looks are left out.)
    check_graph(stack[0], url, max_nodes=MAX_PICKLE_VALUES, max_depth=MAX_PICKLE_OPS, inside=_scan_children)
    return stack[0]


def _scan_children(value: object) -> Iterable[object] | None:
    return [value.args, value.state] if isinstance(value, Opaque) else children(value)


_PUSH_ARG = {
    "BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG", "BINFLOAT", "FLOAT", "SHORT_BINUNICODE",
    "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING", "SHORT_BINBYTES",
    "BINBYTES", "BINBYTES8",
}  # fmt: skip
_PUSH_CONST: dict[str, object] = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


def _pairs(items: list[Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    _setitems(out, items)
    return out


def _setitems(target: object, items: list[Any]) -> None:
    if isinstance(target, dict):
        for key, value in zip(items[::2], items[1::2], strict=True):
            if isinstance(key, (str, int, float, bool, type(None))):
                target[key] = value
