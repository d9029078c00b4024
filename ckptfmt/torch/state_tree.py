"""A state dict of any shape as a checkpoint: its tensors as tensors, its structure and plain values as a context.

torchft hands its checkpoint transport a nested state dict: ``{"user": {...}, "torchft": {...}}`` whose leaves
are tensors (a model's, an optimizer's), DTensors, and plain values (steps, learning rates, a scheduler's
counters), under string and integer keys, in dicts, lists and tuples. Its own transports pickle it whole. Here the
tensors go to a checkpoint's ``weights`` field and everything else to a ``tree`` context of plain values (``bytes``
kept as opaque bytes, never interpreted), so the
same tree comes back on the other side with nothing unpickled: a leaf that is neither a tensor nor a plain value
is refused when it is sent, naming where it is.

The context is a peer's message, hostile input: :func:`unflatten` bounds its depth and size, checks every node's
shape, and requires each tensor it names to be one the checkpoint holds, used once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ContextError, UsageError
from ..paths import tensor_name_problem

FIELD = "tree"  # the context that holds the structure
TENSORS = "weights"  # the field that holds the tensors
MAX_DEPTH = 64
MAX_NODES = 1 << 20


def flatten(tree: object) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The tensors of ``tree`` by name, and its structure as a plain value (the ``tree`` context's ``root``).

    A DTensor is sent as its local shard with its mesh and placements described; it is rebuilt on a mesh of
    the same devices on the other side."""
    tensors: dict[str, torch.Tensor] = {}

    def name_for(path: tuple[str, ...]) -> str:
        name = "/".join(path) or "root"
        if tensor_name_problem(name) is not None or name in tensors:
            name = f"leaf.{len(tensors)}"
        return name

    def walk(value: object, path: tuple[str, ...], depth: int) -> dict[str, object]:
        if depth > MAX_DEPTH:
            raise UsageError(f"the state dict nests deeper than {MAX_DEPTH} levels", field="/".join(path))
        if isinstance(value, torch.Tensor):
            name = name_for(path)
            local = value
            node: dict[str, object] = {"tensor": name}
            if _is_dtensor(value):
                local = value.to_local()  # type: ignore[attr-defined]
                node = {"tensor": name, "dtensor": _describe_dtensor(value)}
            tensors[name] = local.detach()
            return node
        if isinstance(value, Mapping):
            items = []
            for key, sub in value.items():
                if type(key) not in (str, int):
                    raise UsageError(
                        f"a state dict key of type {type(key).__name__} cannot be sent (str and int keys only)",
                        field="/".join(path),
                    )
                items.append([key, walk(sub, (*path, str(key)), depth + 1)])
            return {"dict": items}
        if isinstance(value, list | tuple):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [walk(sub, (*path, str(i)), depth + 1) for i, sub in enumerate(value)]}
        if value is None or type(value) in (bool, int, str):
            return {"value": value}
        if type(value) is bytes:  # opaque to ckptfmt (msgpack bin): kept, never interpreted, never unpickled
            return {"bytes": value}
        if type(value) is float:
            return {"value": value} if math.isfinite(value) else {"float": repr(value)}
        raise UsageError(
            f"a {type(value).__name__} is neither a tensor nor a plain value: it cannot be sent without pickle",
            field="/".join(path) or "root",
        )

    return tensors, walk(tree, (), 0)


def unflatten(root: object, tensors: Mapping[str, torch.Tensor]) -> object:
    """The tree ``root`` describes, its tensors taken from ``tensors`` (each exactly once)."""
    used: set[str] = set()
    count = 0

    def bad(message: str) -> ContextError:
        return ContextError(message, field=FIELD)

    def build(node: object, depth: int) -> object:
        nonlocal count
        count += 1
        if depth > MAX_DEPTH or count > MAX_NODES:
            raise bad(f"the tree is deeper than {MAX_DEPTH} or larger than {MAX_NODES:,} nodes")
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise bad("a node is not a one-member map")
        if "tensor" in node:
            name = node["tensor"]
            if not isinstance(name, str) or name not in tensors or name in used:
                raise bad(f"a node names tensor {name!r}, which is not in the checkpoint or is named twice")
            used.add(name)
            return _dtensor(tensors[name], node["dtensor"]) if "dtensor" in node else tensors[name]
        if len(node) != 1:
            raise bad("a node that is not a tensor has one member")
        ((kind, body),) = node.items()
        if kind == "dict" and isinstance(body, list):
            out: dict[object, object] = {}
            for item in body:
                if not isinstance(item, list) or len(item) != 2 or type(item[0]) not in (str, int) or item[0] in out:
                    raise bad("a dict entry is not a [key, node] pair of a str or int key seen once")
                out[item[0]] = build(item[1], depth + 1)
            return out
        if kind in ("list", "tuple") and isinstance(body, list):
            items = [build(sub, depth + 1) for sub in body]
            return items if kind == "list" else tuple(items)
        if kind == "value" and (body is None or type(body) in (bool, int, str, float)):
            return body
        if kind == "float" and body in ("inf", "-inf", "nan"):
            return float(body)
        if kind == "bytes" and isinstance(body, bytes):
            return body
        raise bad(f"a node of kind {kind!r} has a body of type {type(body).__name__}")

    tree = build(root, 0)
    unused = set(tensors) - used
    if unused:
        raise bad(f"{len(unused)} tensors of the checkpoint are not in its tree, e.g. {sorted(unused)[0]!r}")
    return tree


def _is_dtensor(value: object) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local") and hasattr(value, "device_mesh")


def _describe_dtensor(value: Any) -> dict[str, object]:
    mesh = value.device_mesh
    placements = []
    for p in value.placements:
        if p.is_shard():
            placements.append(["shard", int(p.dim)])
        elif p.is_replicate():
            placements.append(["replicate"])
        elif p.is_partial():
            placements.append(["partial", str(getattr(p, "reduce_op", "sum"))])
        else:
            raise UsageError(f"a DTensor placement {p!r} cannot be described")
    return {
        "device_type": str(mesh.device_type),
        "mesh": mesh.mesh.tolist(),
        "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": placements,
        "shape": list(value.shape),
        "stride": list(value.stride()),
    }


def _dtensor(local: torch.Tensor, doc: object) -> object:
    """A DTensor of ``local`` on the mesh ``doc`` describes (the same devices must form a mesh here)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if not isinstance(doc, dict):
        raise ContextError("a DTensor's description is not a map", field=FIELD)
    try:
        names = doc.get("dim_names")
        mesh = DeviceMesh(
            str(doc["device_type"]), torch.tensor(doc["mesh"]), mesh_dim_names=tuple(names) if names else None
        )
        placements: list[Any] = []
        for p in doc["placements"]:
            placements.append(
                Shard(int(p[1]))
                if p[0] == "shard"
                else Replicate()
                if p[0] == "replicate"
                else Partial(str(p[1]))
                if p[0] == "partial"
                else None
            )
            if placements[-1] is None:
                raise ValueError(f"unknown placement {p!r}")
        shape = torch.Size(int(n) for n in doc["shape"])
        stride = tuple(int(n) for n in doc["stride"])
        # built from its spec, as it was sent: from_local would recompute this rank's share of the mesh
        spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
        return DTensor(local, spec, requires_grad=local.requires_grad)  # type: ignore[no-untyped-call]
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise ContextError(f"a DTensor cannot be rebuilt here: {exc}", field=FIELD) from exc
