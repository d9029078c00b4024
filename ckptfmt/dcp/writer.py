"""``torch.distributed.checkpoint`` writes ckptfmt: a DCP ``StorageWriter`` (issue 41, first part).

    dcp.save(state_dict, storage_writer=ckptfmt.dcp.StorageWriter(url))

DCP's planner decides what each rank writes (a replicated item by one rank, a DTensor or FSDP2 shard by its owner);
this writer writes it as one ckptfmt checkpoint of the ``weights`` profile:

- every tensor item under its fully qualified name in the ``weights`` field, a shard as a chunk with its global shape
  and offsets, by :class:`~ckptfmt.writer.CheckpointWriter` (digests, blocks, an optional codec);
- every other item (DCP turns non-tensor state into ``torch.save`` bytes) loaded with ``weights_only=True`` and kept
  as plain values in an ``objects`` context (:mod:`ckptfmt.torch.state_tree`'s structure: int and str keys, tuples,
  non-finite floats); an item that holds a tensor, or does not load as plain values, is refused naming its key;
- the commit is the project's multi-rank commit (lock, un-commit first, manifest last; spec/commit.md), run inside
  ``write_data`` by every rank together over the default process group, after DCP's planning and before DCP
  gathers the results: DCP's ``finish`` then has nothing left to do.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import UsageError
from ..storage import open_store
from ..torch.collective import TorchCollective
from ..torch.state_tree import flatten
from ..writer import CheckpointWriter

FIELD = "weights"
OPTIMIZER = "optimizer"
OBJECTS = "objects"  # the context of the non-tensor items, by fully qualified name (rank 0's; others' objects_rN)
NAMES_ARE_FQNS = "ckptfmt.dcp.names"  # manifest metadata: every tensor is named by its DCP fully qualified name


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingFields:
    """What makes a DCP save a checkpoint of the ``training`` profile (spec/fields.md): which items are the
    optimizer's (fully qualified names starting with ``optimizer_prefix``, as ``{"optim": ...}`` gives them), the
    ``step``, and the fields a DCP state dict does not hold: ``config`` (a dict or dataclass), ``data`` (the data
    position: a loader or sampler with ``state_dict()``, or that state dict), ``mesh`` (the parallelism mesh, by
    dimension name). Every rank's RNG (torch, numpy, Python) is gathered by rank 0 into the ``rng`` field."""

    step: int
    data: Any
    config: Any
    optimizer_prefix: str = "optim."
    mesh: Mapping[str, int] | None = None


class StorageWriter(_DcpStorageWriter):
    """Writes DCP's save plans as one ckptfmt checkpoint at ``url`` (module doc). ``codec``: as
    :class:`~ckptfmt.writer.CheckpointWriter`'s; ``thread_count``: the writer's I/O threads per rank."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        codec: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        thread_count: int = 2,
        overwrite: bool = False,
        training: TrainingFields | None = None,
    ) -> None:
        super().__init__()
        self.training = training
        self.url = os.fspath(url)
        self.codec = codec
        self.storage_options = storage_options
        self.thread_count = thread_count
        self.overwrite = overwrite
        self.rank = 0
        self.checkpoint_id: str | None = None  # ckptfmt's id of the committed checkpoint

    # ---------------------------------------------------------------- DCP's StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)
        self.checkpoint_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else (dist.get_rank() if _distributed() else 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        collective = TorchCollective() if _distributed() and dist.get_world_size() > 1 else None
        store = open_store(self.url, self.storage_options)
        training = self.training
        writer = CheckpointWriter(
            store,
            profile="weights" if training is None else "training",
            overwrite=self.overwrite,
            rank=self.rank,
            workers=self.thread_count,
            collective=collective,
            codec=self.codec,
            metadata={NAMES_ARE_FQNS: "1"},
        )
        results: list[WriteResult] = []
        objects: dict[str, object] = {}
        try:
            contexts = _training_contexts(training, collective) if training is not None else {}
            if writer.is_coordinator:
                writer.write_tensors(FIELD, {})  # the field exists even when every tensor is another rank's
                if training is not None:
                    writer.write_tensors(OPTIMIZER, {})
                for name, value in contexts.items():
                    writer.write_context(name, value)
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    objects[item.index.fqn] = _plain_object(item.index.fqn, data)
                    nbytes = len(data.getbuffer()) if isinstance(data, io.BytesIO) else 0
                else:
                    if not isinstance(data, torch.Tensor):
                        raise UsageError(f"DCP item {item.index.fqn!r} is not a tensor", tensor=item.index.fqn)
                    tensor = data.detach()
                    chunk = item.tensor_data.chunk if item.tensor_data is not None else None
                    size = item.tensor_data.size if item.tensor_data is not None else tensor.shape
                    offsets = tuple(chunk.offsets) if chunk is not None else (0,) * tensor.dim()
                    fqn = item.index.fqn
                    field = OPTIMIZER if training is not None and fqn.startswith(training.optimizer_prefix) else FIELD
                    writer.write_tensor(field, fqn, tensor, global_shape=tuple(size), offsets=offsets)
                    nbytes = tensor.numel() * tensor.element_size()
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
            mappings = getattr(plan, "planner_data", None)  # how DCP flattened the state dict: fqn -> path of keys
            if objects or (self.rank == 0 and isinstance(mappings, dict) and mappings):
                name = OBJECTS if self.rank == 0 else f"{OBJECTS}_r{self.rank}"
                doc: dict[str, object] = {"items": flatten(objects)[1]}
                if self.rank == 0 and isinstance(mappings, dict) and mappings:
                    doc["planner_data"] = flatten(dict(mappings))[1]
                writer.write_context(name, doc)
        except BaseException:
            writer.abort()
            raise
        self.checkpoint_id = writer.commit()  # every rank together: the manifest is written once all reported
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing left: the checkpoint was committed in ``write_data`` (DCP's own metadata file is not written;
        :class:`~ckptfmt.dcp.StorageReader` builds DCP's metadata from the manifest). As DCP's own writers do,
        the metadata that ``dcp.save`` returns gets :meth:`storage_meta`: the URL and the committed id."""
        metadata.storage_meta = self.storage_meta()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.checkpoint_id or "")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _plain_object(fqn: str, data: object) -> object:
    """A byte item's value, loaded without unpickling anything but plain values and tensors (refused)."""
    if not isinstance(data, io.BytesIO):
        raise UsageError(f"DCP item {fqn!r} is {type(data).__name__}, not the bytes of a torch.save", tensor=fqn)
    data.seek(0)
    try:
        value = torch.load(data, weights_only=True)
    except Exception as exc:  # torch's unpickler refuses anything but plain values and tensors
        raise UsageError(
            f"DCP item {fqn!r} does not load as plain values (weights_only=True): ckptfmt stores no pickle ({exc})",
            tensor=fqn,
        ) from exc
    try:
        tensors, _ = flatten({"value": value})
    except UsageError as exc:  # it names the place inside the value ("value/..."), not the item
        raise UsageError(f"DCP item {fqn!r} is not plain values: {exc.message}", tensor=fqn) from exc
    if tensors:
        raise UsageError(f"DCP item {fqn!r} holds a tensor inside other state: give it as a tensor item", tensor=fqn)
    return value


def _training_contexts(training: TrainingFields, collective: TorchCollective | None) -> dict[str, dict[str, Any]]:
    """The training profile's context fields (every rank takes part in the RNG's gather; rank 0 gets them all)."""
    from .. import provenance
    from ..context import decode, encode
    from ..torch import api, rng
    from ..torch.data_position import data_field
    from ..torch.state import config_field

    mine = rng.capture()
    if collective is not None:
        gathered = collective.gather(encode(mine, where="field 'rng'"), dst=0)
        if gathered is None:
            return {}
        mine = rng.with_ranks([decode(g, field="rng") for g in gathered])
    data = training.data
    return {
        "rng": mine,
        "data": dict(data) if isinstance(data, Mapping) else data_field(data),
        "config": config_field(training.config),
        "topology": api.topology(training.mesh),
        "provenance": provenance.capture(step=training.step),
    }
