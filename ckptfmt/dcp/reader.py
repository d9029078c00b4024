"""``torch.distributed.checkpoint`` reads ckptfmt: a DCP ``StorageReader`` (issue 41, first part).

    dcp.load(state_dict, storage_reader=ckptfmt.dcp.StorageReader(url))

DCP's metadata is built from the manifest: every tensor under its name when the checkpoint was written through DCP
(its names are DCP's fully qualified names, in the ``weights`` and ``optimizer`` fields), else the ``weights`` field's
under their names and another field's as ``<field>/<name>``, each with its global shape and its chunks; every item of
the ``objects`` contexts as bytes. A checkpoint with no ``objects`` context serves the ``weights`` field's context
map instead, by name: ``ckpt convert`` of a DCP directory keeps DCP's non-tensor items there (msgpack has no tuple: a
tuple saved through DCP and converted comes back a list).
DCP plans the load (resharding onto any world size is DCP's), and each rank's reads go through one ckptfmt read plan:
only the chunks, and of a chunk with block digests only the blocks, that its regions touch, every byte checked
before DCP gets any of it. A rank reads and checks all of its regions first and copies into DCP's destination
tensors only then, so a damaged checkpoint raises the library's error naming the file and tensor and changes no
destination tensor on that rank.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..arrays import to_torch
from ..errors import ContextError, UsageError
from ..read_plan import Target
from ..reader import Checkpoint, open_checkpoint
from ..torch.state_tree import unflatten
from .writer import FIELD, NAMES_ARE_FQNS, OBJECTS, PICKLED


class StorageReader(_DcpStorageReader):
    """Serves DCP's load plans from the ckptfmt checkpoint at ``url`` (module doc). ``pickled_objects``: hand DCP
    the opaque ``torch.save`` bytes of items a writer kept with ``pickled_objects=True``, each only once it loaded
    with ``weights_only=True`` (its classes allowed by ``torch.serialization.add_safe_globals``); without it, a load
    that asks for one is refused, naming it. Either check runs before anything is read or changed."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        pickled_objects: bool = False,
    ) -> None:
        super().__init__()
        self.url = os.fspath(url)
        self.storage_options = storage_options
        self.pickled_objects = pickled_objects
        self._names: dict[str, tuple[str, str]] = {}  # DCP's fully qualified name -> (field, tensor)
        self._objects: dict[str, object] = {}
        self._pickled: set[str] = set()  # the items kept as opaque pickle bytes
        self._planner_data: object = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)
        self._names, self._objects, self._pickled = {}, {}, set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open_checkpoint(self.url, self.storage_options) as ckpt:
            entries: dict[str, Any] = {}
            fqns = ckpt.manifest.metadata.get(NAMES_ARE_FQNS) == "1"  # written through DCP: names are its own
            for field, record in ckpt.fields.items():
                if record.kind == "tensors":
                    for name, tensor in record.tensors.items():
                        fqn = name if fqns or field == FIELD else f"{field}/{name}"
                        if fqn in self._names:
                            raise ContextError(f"tensor {fqn!r} is in two fields", field=field)
                        self._names[fqn] = (field, name)
                        entries[fqn] = TensorStorageMetadata(
                            properties=TensorProperties(dtype=_torch_dtype(tensor.dtype)),
                            size=torch.Size(tensor.shape),
                            chunks=[
                                ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.shape))
                                for c in tensor.chunks
                            ],
                        )
            self._objects, self._pickled, self._planner_data = _objects(ckpt)
        for fqn in self._objects:
            if fqn in entries:
                raise ContextError(f"item {fqn!r} is both a tensor and an object", field=OBJECTS)
            entries[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=entries, planner_data=self._planner_data)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._names and not self._objects:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        tensors = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        objects = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        for item in objects:  # before anything is read or changed
            if item.storage_index.fqn in self._pickled:
                self._check_pickled(item.storage_index.fqn)
        with open_checkpoint(self.url, self.storage_options) as ckpt:
            arrays = ckpt.read_regions([self._target(ckpt, item) for item in tensors]) if tensors else []
        # every region read and checked: only now does anything reach DCP's destination tensors
        for item, array in zip(tensors, arrays, strict=True):
            field, name = self._names[item.storage_index.fqn]
            source = to_torch(array, ckpt.tensor(field, name).dtype)
            target = planner.resolve_tensor(item).detach()
            target.copy_(source.reshape(target.shape))
            planner.commit_tensor(item, target)
        for item in objects:
            fqn = item.storage_index.fqn
            value = self._objects[fqn]
            buffer = io.BytesIO()
            if fqn in self._pickled:
                assert isinstance(value, bytes)
                buffer.write(value)  # the writer's torch.save bytes, as they were (opted in and checked above)
            else:
                torch.save(value, buffer)  # plain values only (the writer refused anything else)
            buffer.seek(0)
            planner.load_bytes(item, buffer)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _check_pickled(self, fqn: str) -> None:
        """Refuse opaque pickle bytes unless opted in, and then unless they load with ``weights_only=True`` (the
        classes they build allowed with ``torch.serialization.add_safe_globals``): DCP's planner unpickles what it
        is handed without restriction, so it is handed only bytes that the restricted unpickler accepted."""
        if not self.pickled_objects:
            raise UsageError(
                f"DCP item {fqn!r} is kept as opaque pickle bytes; StorageReader(pickled_objects=True) loads it "
                "if its classes are allowed by torch.serialization.add_safe_globals",
                tensor=fqn,
                path=self.url,
            )
        value = self._objects[fqn]
        assert isinstance(value, bytes)
        try:
            torch.load(io.BytesIO(value), map_location="cpu", weights_only=True)
        except Exception as error:
            raise UsageError(
                f"DCP item {fqn!r}: its pickle bytes do not load with weights_only=True ({error.__class__.__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); allow its classes with "
                "torch.serialization.add_safe_globals if this checkpoint is trusted",
                tensor=fqn,
                path=self.url,
            ) from error

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)

    def _target(self, ckpt: Checkpoint, item: ReadItem) -> Target:
        index: MetadataIndex = item.storage_index
        field, name = self._names[index.fqn]
        chunk_offsets = tuple(index.offset) if index.offset is not None else ()
        offsets = tuple(int(c) + int(s) for c, s in zip(chunk_offsets, item.storage_offsets, strict=True))
        shape = tuple(int(n) for n in item.lengths)
        return Target(field, name, ckpt.tensor(field, name).dtype, offsets, shape)


def _objects(ckpt: Checkpoint) -> tuple[dict[str, object], set[str], object]:
    """Every rank's ``objects`` context merged, by fully qualified name (a name in two of them is refused), the
    names of those kept as opaque pickle bytes, and how DCP flattened the saved state dict (rank 0's
    ``planner_data``: a load without a template needs it)."""
    out: dict[str, object] = {}
    pickled: set[str] = set()
    planner_data: object = None
    fields = [f for f in sorted(ckpt.fields) if f == OBJECTS or f.startswith(OBJECTS + "_r")]
    if not fields:
        return _converted_objects(ckpt), pickled, planner_data
    for field in fields:
        doc = ckpt.read_context(field)
        items = unflatten(doc.get("items"), {})
        if not isinstance(items, dict):
            raise ContextError("its items are not a map", field=field)
        for fqn, value in items.items():
            if not isinstance(fqn, str) or fqn in out:
                raise ContextError(f"item {fqn!r} is named twice, or not by a string", field=field)
            out[fqn] = value
        listed = doc.get(PICKLED, [])
        if not isinstance(listed, list) or any(not isinstance(out.get(n), bytes) or n not in items for n in listed):
            raise ContextError(f"its {PICKLED!r} list names an item that is not its own opaque bytes", field=field)
        pickled.update(listed)
        if field == OBJECTS and doc.get("planner_data") is not None:
            planner_data = unflatten(doc["planner_data"], {})
    return out, pickled, planner_data


def _converted_objects(ckpt: Checkpoint) -> dict[str, object]:
    """The ``weights`` field's context map: a DCP directory's non-tensor items, by name, as ``ckpt convert`` keeps
    them (nothing if the field has no context, or a context that is not a map of names)."""
    record = ckpt.fields.get(FIELD)
    if record is None or record.context is None:
        return {}
    doc = ckpt.read_context(FIELD)
    if not isinstance(doc, dict) or not all(isinstance(k, str) for k in doc):
        return {}
    return dict(doc)


def _torch_dtype(name: str) -> torch.dtype:
    from ..arrays import TORCH_DTYPES

    return getattr(torch, TORCH_DTYPES[name])  # type: ignore[no-any-return]
