"""Loaded foreign state, bounded before anything walks it: object graphs and shared tensors.

A pickle (``torch.load``'s, or the opcodes of ``training_args.bin`` scanned symbolically) is an object
graph, not a tree: a memoised object may be referenced any number of times, so a 274-byte file can
hold a list of eight references to a list of eight references... nine levels down, 8**9 leaves once
expanded. Every converter then walks the value as a tree (splitting tensors from context, encoding,
checking), so the work is the expanded size, not the file's. :func:`check_graph` measures that size on
the graph itself (each distinct object visited once, iteratively: no recursion, so no RecursionError)
and refuses, with :class:`SourceFormatError`, a value that expands past ``max_nodes``, nests deeper
than ``max_depth`` (the context limit, CTX-7) or refers to itself (a tree walk would never end).

Shared tensors are the same problem in bytes: 1,024 references to one tensor would be stored 1,024
times. :func:`dedupe` keeps one of each (the ``aliases`` record :mod:`ckptfmt.torch` writes for tied
weights), and :func:`check_expansion` refuses what would still be stored far beyond the bytes loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..context import MAX_DEPTH
from ..errors import SourceFormatError

MAX_NODES = 1 << 22  # values once expanded; a large model's optimizer state dict holds well under 1M
# Bytes stored beyond the distinct storages loaded: no real state dict stores the same bytes twice once
# tied weights are aliases (overlapping views are rare and small), so this only stops amplification.
EXPANSION_FACTOR = 2
EXPANSION_SLACK = 16 << 20


def children(value: object) -> Iterable[object] | None:
    """The values inside a container a pickle builds (keys too: a tuple key is walked), None for a leaf."""
    if isinstance(value, Mapping):
        return [item for pair in value.items() for item in pair]
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    return None


def check_graph(
    value: object,
    url: str,
    *,
    max_nodes: int = MAX_NODES,
    max_depth: int = MAX_DEPTH,
    inside: Callable[[object], Iterable[object] | None] = children,
) -> int:
    """The number of values ``value`` holds once every shared reference is expanded (itself included);
    SourceFormatError naming ``url`` when that passes ``max_nodes``, the nesting passes ``max_depth`` or
    the value contains itself. Linear in the distinct objects and references, whatever the expansion."""
    size: dict[int, int] = {}  # distinct containers done: expanded size
    depth: dict[int, int] = {}
    open_ids: set[int] = set()  # containers on the current path: met again, the value contains itself
    top = inside(value)
    if top is None:
        return 1
    stack: list[tuple[object, list[object], int]] = [(value, list(top), 0)]
    open_ids.add(id(value))
    total, deepest = 1, 0
    while stack:
        node, items, i = stack[-1]
        if i < len(items):
            stack[-1] = (node, items, i + 1)
            child = items[i]
            if id(child) in size:
                continue
            if id(child) in open_ids:
                raise SourceFormatError("the pickled value contains itself (a cycle)", path=url)
            inner = inside(child)
            if inner is None:
                continue
            if len(stack) >= max_depth:
                raise SourceFormatError(f"the pickled value nests deeper than {max_depth} levels", path=url)
            open_ids.add(id(child))
            stack.append((child, list(inner), 0))
            continue
        stack.pop()
        open_ids.discard(id(node))
        total = 1 + sum(size.get(id(c), 1) for c in items)
        deepest = 1 + max((depth.get(id(c), 0) for c in items), default=0)
        if total > max_nodes:
            raise SourceFormatError(
                f"the pickled value holds more than {max_nodes} values once its shared references are expanded",
                path=url,
            )
        size[id(node)], depth[id(node)] = total, deepest
    return total


def tensor_key(tensor: Any) -> tuple[object, ...] | None:
    """What makes two torch tensors the same bytes (storage, offset, shape, strides, dtype); None when empty."""
    if not tensor.numel():
        return None
    storage = tensor.untyped_storage()
    return (storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def dedupe(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(each distinct torch tensor once, under its first name; alias name -> that name). Values that are not
    torch tensors are kept as they are."""
    from .torch_bridge import is_tensor

    kept: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[object, ...], str] = {}
    for name, tensor in tensors.items():
        key = tensor_key(tensor) if is_tensor(tensor) else None
        if key is not None and key in first:
            aliases[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        kept[name] = tensor
    return kept, aliases


def check_expansion(tensors: Iterable[Any], url: str) -> None:
    """Refuse torch tensors whose bytes, stored one by one, would exceed the distinct storages they view by
    more than :data:`EXPANSION_FACTOR` times (plus :data:`EXPANSION_SLACK`)."""
    from .torch_bridge import is_tensor

    stored = 0
    storages: dict[int, int] = {}
    for tensor in tensors:
        if not is_tensor(tensor) or not tensor.numel():
            continue
        stored += int(tensor.numel()) * int(tensor.element_size())
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = int(storage.nbytes())
    loaded = sum(storages.values())
    if stored > EXPANSION_FACTOR * loaded + EXPANSION_SLACK:
        raise SourceFormatError(
            f"its tensors would store {stored} bytes from {loaded} bytes of data (views of shared storage "
            "repeated); refusing the amplification",
            path=url,
        )
