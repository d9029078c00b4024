"""Between torch objects and ckptfmt values: tensors bit for bit, nested state split into tensors and context.

Only the converters that need torch import this module, and it imports torch lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..arrays import TORCH_DTYPES, to_torch
from ..errors import SourceFormatError

__all__ = [
    "TORCH_DTYPES",
    "Split",
    "context_value",
    "find_optimizers",
    "is_tensor",
    "pop_path",
    "split_tree",
    "to_torch",
]


def is_tensor(value: object) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def context_value(value: object, where: str) -> object:
    """A non-tensor value loaded by torch (weights_only) as a context value (msgpack subset)."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Size):
        return [int(d) for d in value]
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [context_value(v, f"{where}.{i}") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for key, item in value.items():
            name = str(key)
            if name in out:
                raise SourceFormatError(f"keys {key!r} and {name!r} collide once written as strings", path=where)
            out[name] = context_value(item, f"{where}.{name}")
        return out
    if isinstance(value, torch.Tensor):
        raise SourceFormatError("a tensor where only plain values were expected", path=where)
    raise SourceFormatError(f"value of type {type(value).__name__} has no context equivalent", path=where)


def _has_tensor(value: object) -> bool:
    if is_tensor(value):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


@dataclass(slots=True)
class Split:
    """A nested state split in two: tensors by dotted name, and everything else as a nested map."""

    tensors: dict[str, Any] = field(default_factory=dict)
    rest: dict[str, object] = field(default_factory=dict)


def split_tree(tree: Mapping[Any, Any], prefix: str = "", into: Split | None = None) -> Split:
    """Flatten ``tree``'s tensors with dots (lists holding tensors by index); keep the rest nested."""
    out = into if into is not None else Split()
    _split(tree, prefix, out.tensors, out.rest)
    return out


def _split(node: Mapping[Any, Any], prefix: str, tensors: dict[str, Any], rest: dict[str, object]) -> None:
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        local = str(key)
        if is_tensor(value):
            if name in tensors:
                raise SourceFormatError("two tensors flatten to the same dotted name", path=name)
            tensors[name] = value
        elif isinstance(value, Mapping) and (_has_tensor(value) or not value):
            sub: dict[str, object] = {}
            _split(value, name, tensors, sub)
            if sub or not value:
                rest[local] = sub
        elif isinstance(value, (list, tuple)) and _has_tensor(value):
            sub = {}
            _split(dict(enumerate(value)), name, tensors, sub)
            if sub:
                rest[local] = sub
        else:
            rest[local] = context_value(value, name)


def is_optimizer_state(value: object) -> bool:
    """torch.optim.Optimizer.state_dict() shape: {"state": {...}, "param_groups": [...]}."""
    return isinstance(value, Mapping) and isinstance(value.get("state"), Mapping) and "param_groups" in value


def find_optimizers(tree: Mapping[Any, Any], keys: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Key paths of the optimizer state dicts inside ``tree`` (``()`` for the tree itself)."""
    if is_optimizer_state(tree):
        return [keys]
    found: list[tuple[Any, ...]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            found += find_optimizers(value, (*keys, key))
    return found


def pop_path(tree: dict[Any, Any], keys: tuple[Any, ...]) -> Any:
    """Remove and return the subtree at a key path found by :func:`find_optimizers`."""
    node: Any = tree
    for key in keys[:-1]:
        node = node[key]
    return node.pop(keys[-1])
