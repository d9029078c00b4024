"""Where a rank's tensors sit in their global tensors, and which rank writes which piece.

A ``DTensor`` (FSDP2 ``fully_shard``, tensor parallelism; any ``Shard(d)``/``Replicate()`` placements,
uneven shards included) is saved as its local tensor plus its global shape and offsets, by one of
its replicas. Plain tensors in a multi-rank save are taken to be replicated (the same on every rank,
as DDP keeps them): each is written once, by a rank chosen deterministically so that the bytes are
spread evenly over the ranks. Loading reads, for each target, only the region that rank holds.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..arrays import as_array
from ..errors import UsageError


@dataclass(frozen=True, slots=True)
class LocalShard:
    """This rank's piece of a global tensor, and whether this rank is the one that writes it."""

    array: np.ndarray[Any, Any]
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    writer: bool = True
    # the global ranks holding this same piece (its replicas), and which of them writes it
    holders: tuple[int, ...] = ()
    writer_rank: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape (what a whole-tensor check compares)."""
        return self.global_shape


@dataclass(frozen=True, slots=True)
class TargetShard:
    """A region read for a live DTensor: ``array`` becomes a DTensor placed like ``like`` when applied."""

    array: np.ndarray[Any, Any]
    like: Any

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape of the target (what a whole-tensor check compares)."""
        return tuple(int(d) for d in self.like.shape)


def is_dtensor(value: object) -> bool:
    if not (type(value).__name__ == "DTensor" and torch.distributed.is_available()):  # the cheap test first
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_region(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of this rank's local tensor within the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape)


def _is_replica_writer(name: str, dtensor: Any) -> bool:
    """Among the ranks holding the same piece (the mesh dims it is replicated on), exactly one writes it:
    the replica chosen by the tensor's name, so that the writing is spread over the replicas."""
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return False
    index, count = 0, 1
    for dim, placement in enumerate(dtensor.placements):
        if placement.is_partial():
            raise UsageError(f"{name!r} has a Partial placement: reduce it before saving")
        if placement.is_replicate():
            index = index * mesh.size(dim) + coordinate[dim]
            count *= mesh.size(dim)
    return index == zlib.crc32(name.encode("utf-8")) % count


def replicas_of(name: str, dtensor: Any) -> tuple[tuple[int, ...], int | None]:
    """The global ranks that hold this rank's piece of ``dtensor`` (its coordinate on every mesh dim but the
    replicated ones), in the order :func:`_is_replica_writer` counts them, and the one of them that writes it."""
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return (), None
    index = tuple(
        slice(None) if placement.is_replicate() else coordinate[dim] for dim, placement in enumerate(dtensor.placements)
    )
    holders = tuple(int(r) for r in mesh.mesh[index].flatten().tolist())
    return holders, holders[zlib.crc32(name.encode("utf-8")) % len(holders)]


def shard_of(name: str, dtensor: Any, host: np.ndarray[Any, Any] | None = None) -> LocalShard:
    """A DTensor as a :class:`LocalShard` (``host``: its local tensor already copied to host memory)."""
    offsets, shape = local_region(dtensor)
    array = host if host is not None else as_array(dtensor.to_local())[0]
    if tuple(array.shape) != shape:
        raise UsageError(f"{name!r}: local tensor of shape {list(array.shape)}, its placements say {list(shape)}")
    holders, writer_rank = replicas_of(name, dtensor)
    return LocalShard(
        array,
        tuple(int(d) for d in dtensor.shape),
        offsets,
        _is_replica_writer(name, dtensor),
        holders=holders,
        writer_rank=writer_rank,
    )


def owners(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """The rank that writes each replicated tensor: largest first onto the least-loaded rank.

    Deterministic (ties broken by name and rank), so every rank computes the same answer alone.
    """
    load = [0] * world_size
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += sizes[name]
    return out


def replicated_sizes(tensors: Mapping[str, Mapping[str, object]]) -> dict[str, int]:
    """``field/name`` -> bytes of every whole (non-shard) array of a snapshot."""
    return {
        f"{field}/{name}": int(value.nbytes)
        for field, named in tensors.items()
        for name, value in named.items()
        if isinstance(value, np.ndarray)
    }


def to_target(tensor: torch.Tensor, like: Any) -> Any:
    """``tensor`` (this rank's region) as a DTensor placed like ``like``."""
    from torch.distributed.tensor import DTensor

    local = tensor.to(like.to_local().device)
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def _placement(placement: Any) -> str:
    """``Shard(d)``, ``Replicate()`` or ``<Kind>()``, as spec/fields.md spells them (torch's str() varies)."""
    if placement.is_shard():
        return f"Shard({placement.dim})"
    if placement.is_replicate():
        return "Replicate()"
    return f"{type(placement).__name__}()"


def placements(model: Any) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """The model's device mesh (``{"dims", "shape"}``, from its first DTensor) and, per sharded weight
    (``weights/<name>``), its placements on that mesh: what ``topology`` records of the saving layout."""
    mesh: dict[str, Any] | None = None
    tensors: dict[str, dict[str, Any]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not is_dtensor(tensor):
            continue
        device_mesh = tensor.device_mesh
        names = device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(device_mesh.ndim))
        record = {"dims": list(names), "shape": [int(d) for d in device_mesh.shape]}
        mesh = mesh or record
        tensors[f"weights/{name}"] = {"placements": [_placement(p) for p in tensor.placements], "mesh": record}
    return mesh, tensors
