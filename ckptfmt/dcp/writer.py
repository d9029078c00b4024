"""``torch.distributed.checkpoint`` writes ckptfmt: a DCP ``StorageWriter`` (issue 41).

    dcp.save(state_dict, storage_writer=ckptfmt.dcp.StorageWriter(url))

DCP's planner decides what each rank writes (a replicated item by one rank, a DTensor or FSDP2 shard by its owner);
this writer writes it as one ckptfmt checkpoint (of the ``weights`` profile, or ``training`` with
:class:`TrainingFields`):

- every tensor item under its fully qualified name in the ``weights`` field (the optimizer's in ``optimizer`` with
  ``training=``), a shard as a chunk with its global shape and offsets, by
  :class:`~ckptfmt.writer.CheckpointWriter` (digests, blocks, an optional codec);
- every other item (DCP turns non-tensor state into ``torch.save`` bytes) loaded with ``weights_only=True`` and kept
  as plain values in an ``objects`` context (:mod:`ckptfmt.torch.state_tree`'s structure: int and str keys, tuples,
  non-finite floats); an item that holds a tensor, or does not load as plain values, is refused naming its key,
  unless ``pickled_objects=True`` keeps its bytes opaque (DCP's own planner unpickles them at load).

The commit is the project's (spec/commit.md), spread over DCP's phases, with no collective of its own (DCP's are
the only ones, so an ``async_save`` thread never interleaves with the trainer's):

1. ``prepare_global_plan``, on the coordinator: the writer lock is taken and an existing checkpoint un-committed
   (steps 1-2); a refusal fails every rank's ``dcp.save``. Each rank's RNG state travels in its local plan.
2. ``write_data``, on every rank: its data files and contexts, whose records (or the rank's error, once it deleted
   its files: COM-14) go back to the coordinator in a ``WriteResult``, the ``REPORT`` item.
3. ``finish``, on the coordinator: every record checked against the store (COM-21) and merged into the manifest,
   written last, create-only (steps 4-6). On any failure, every reported file and the lock are deleted (COM-19).
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..collective_commit import failed_report, rank_report, records_plan
from ..commit import Committer
from ..errors import CheckpointError, CollectiveError, MalformedMessageError, UsageError
from ..plan import RankResult
from ..read_executor import default_workers
from ..storage import Store, open_store
from ..torch.state_tree import flatten
from ..writer import CheckpointWriter

FIELD = "weights"
OPTIMIZER = "optimizer"
OBJECTS = "objects"  # the context of the non-tensor items, by fully qualified name (rank 0's; others' objects_rN)
PICKLED = "pickled"  # in an objects context: the names of the items kept as opaque torch.save bytes (opted in)
NAMES_ARE_FQNS = "ckptfmt.dcp.names"  # manifest metadata: every tensor is named by its DCP fully qualified name
REPORT = MetadataIndex(fqn="ckptfmt.dcp/report")  # the WriteResult that carries a rank's records to finish


def _capture_rng() -> dict[str, object]:
    from ..torch import rng

    return rng.capture()


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingFields:
    """What makes a DCP save a checkpoint of the ``training`` profile (spec/fields.md): which items are the
    optimizer's (fully qualified names starting with ``optimizer_prefix``, as ``{"optim": ...}`` gives them), the
    ``step``, and the fields a DCP state dict does not hold: ``config`` (a dict or dataclass), ``data`` (the data
    position: a loader or sampler with ``state_dict()``, or that state dict), ``mesh`` (the parallelism mesh, by
    dimension name), and ``rng``: this rank's generators (torch, numpy, Python) as they are when these fields are
    made, in the trainer's thread (an ``async_save`` plans later, in another). Rank 0 records every rank's."""

    step: int
    data: Any
    config: Any
    optimizer_prefix: str = "optim."
    mesh: Mapping[str, int] | None = None
    rng: Mapping[str, Any] = field(default_factory=_capture_rng)


class StorageWriter(_DcpStorageWriter):
    """Writes DCP's save plans as one ckptfmt checkpoint at ``url`` (module doc). ``codec``: as
    :class:`~ckptfmt.writer.CheckpointWriter`'s; ``thread_count``: the writer's I/O threads per rank (None: as the
    reader's, one per core this rank's share of the node has, 1 to 4, or 8 on an object store; more threads than
    cores only compete for the hashing: 2 ranks on 2 cores saved at 0.5x the speed with 2 threads each);
    ``overwrite``: replace a checkpoint committed at ``url`` (refused by default: ckptfmt never replaces one
    silently); ``pickled_objects``: keep state that only pickle carries as opaque bytes instead of refusing it."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        codec: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        thread_count: int | None = None,
        overwrite: bool = False,
        training: TrainingFields | None = None,
        pickled_objects: bool = False,
    ) -> None:
        super().__init__()
        self.training = training
        self.url = os.fspath(url)
        self.codec = codec
        self.storage_options = storage_options
        self.thread_count = thread_count
        self.overwrite = overwrite
        self.pickled_objects = pickled_objects
        self.profile = "weights" if training is None else "training"
        self.rank = 0
        self.save_id = uuid.uuid4().hex  # as DCP's own writers: a new one for every save (reset)
        self.committed_id: str | None = None  # the manifest's id, once finish committed it (on the coordinator)
        self._committer: Committer | None = None  # the coordinator's lock, from prepare_global_plan to finish
        self._rng: dict[str, Any] | None = None  # every rank's RNG, on the coordinator

    @property
    def checkpoint_id(self) -> str:
        """Where the checkpoint goes, as DCP's writers name it (``dcp.save(checkpoint_id=...)`` replaces it)."""
        return self.url

    # ---------------------------------------------------------------- DCP's StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # A save that failed outside this writer (a rank lost during DCP's own exchange) never reached finish:
        # its lock is given back here, at the next save; its files are left for gc.
        self._release()
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.committed_id = None
        self._rng = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else (dist.get_rank() if _distributed() else 0)
        if kwargs.get("use_collectives") is False and _distributed() and dist.get_world_size() > 1:
            raise UsageError("ckptfmt's commit needs DCP's collectives: use_collectives=False saves each rank alone")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.training is None:
            return plan
        from ..context import encode

        return dataclasses.replace(plan, storage_data=encode(dict(self.training.rng), where="field 'rng'"))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: every rank's RNG, and the lock (spec/commit.md steps 1-2)."""
        if self.training is not None:
            from ..context import decode
            from ..torch import rng

            states = [decode(_rng_of(rank, p.storage_data), field="rng") for rank, p in enumerate(plans)]
            self._rng = states[0] if len(states) == 1 else rng.with_ranks(states)
        self._release()
        self._committer = Committer(self._store(), overwrite=self.overwrite)
        return [dataclasses.replace(p, storage_data=None) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        writer: CheckpointWriter | None = None
        try:
            store = self._store()
            writer = CheckpointWriter(
                store,
                profile=self.profile,
                rank=self.rank,
                workers=self.thread_count if self.thread_count is not None else default_workers(store),
                codec=self.codec,
                metadata={NAMES_ARE_FQNS: "1"},
                committed_elsewhere=True,
            )
            results = self._write(writer, plan, planner)
            report = rank_report(writer.hand_over())
        except Exception as exc:  # this rank's files are deleted; the coordinator learns why, in its finish
            if writer is not None:
                writer.abort()
            error = exc if isinstance(exc, CheckpointError) else CollectiveError(f"rank {self.rank} failed: {exc!r}")
            results, report = [], failed_report(error)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        results.append(WriteResult(index=REPORT, size_in_bytes=0, storage_data=report))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: every rank's records checked (COM-21) and merged into the manifest, which is
        written last (spec/commit.md steps 4-6); on a failure every reported file and the lock are deleted
        (COM-19). As DCP's own writers do, the metadata ``dcp.save`` returns gets :meth:`storage_meta`."""
        committer, self._committer = self._committer, None
        if committer is None:
            raise UsageError("finish() without prepare_global_plan(): the save holds no lock", path=self.url)
        reported: list[str] = []
        try:
            reports = [_report_of(rank, written) for rank, written in enumerate(results)]
            plan = records_plan(committer.store, profile=self.profile, metadata={NAMES_ARE_FQNS: "1"})
            manifest, files = plan(reports, reported)
            self.committed_id = committer.commit(manifest, files)
        except BaseException:
            committer.abort(reported)
            raise
        metadata.storage_meta = self.storage_meta()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)

    # ---------------------------------------------------------------- internals

    def _store(self) -> Store:
        return open_store(self.url, self.storage_options)

    def _release(self) -> None:
        if self._committer is not None:
            committer, self._committer = self._committer, None
            committer.abort([])  # the lock only

    def _write(self, writer: CheckpointWriter, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """This rank's items (and, on the coordinator, the checkpoint's contexts) into ``writer``."""
        training = self.training
        if writer.rank == 0:
            writer.write_tensors(FIELD, {})  # the field exists even when every tensor is another rank's
            if training is not None:
                writer.write_tensors(OPTIMIZER, {})
                for name, value in _training_contexts(training, self._rng).items():
                    writer.write_context(name, value)
            else:
                writer.write_context("provenance", {})
        results: list[WriteResult] = []
        objects: dict[str, object] = {}
        pickled: list[str] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                objects[fqn], opaque = _object(fqn, data, pickled=self.pickled_objects)
                if opaque:
                    pickled.append(fqn)
                nbytes = len(data.getbuffer()) if isinstance(data, io.BytesIO) else 0
            else:
                if not isinstance(data, torch.Tensor):
                    raise UsageError(f"DCP item {fqn!r} is not a tensor", tensor=fqn)
                tensor = data.detach()
                chunk = item.tensor_data.chunk if item.tensor_data is not None else None
                size = item.tensor_data.size if item.tensor_data is not None else tensor.shape
                offsets = tuple(chunk.offsets) if chunk is not None else (0,) * tensor.dim()
                where = OPTIMIZER if training is not None and fqn.startswith(training.optimizer_prefix) else FIELD
                writer.write_tensor(where, fqn, tensor, global_shape=tuple(size), offsets=offsets)
                nbytes = tensor.numel() * tensor.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        mappings = getattr(plan, "planner_data", None)  # how DCP flattened the state dict: fqn -> path of keys
        planned = writer.rank == 0 and isinstance(mappings, dict) and bool(mappings)
        if objects or planned:
            doc: dict[str, object] = {"items": flatten(objects)[1]}
            if pickled:
                doc[PICKLED] = pickled
            if planned:
                assert isinstance(mappings, dict)
                doc["planner_data"] = flatten(dict(mappings))[1]
            writer.write_context(OBJECTS if writer.rank == 0 else f"{OBJECTS}_r{writer.rank}", doc)
        return results


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rng_of(rank: int, storage_data: object) -> bytes:
    if not isinstance(storage_data, bytes):
        raise MalformedMessageError(f"rank {rank}'s save plan carries no RNG state")
    return storage_data


def _report_of(rank: int, written: Sequence[WriteResult]) -> object:
    """A rank's report from its write results: the REPORT item's, or (a rank that was given nothing to write and
    wrote nothing) an empty one. Anything else is malformed, never guessed at."""
    reports = [r.storage_data for r in written if r.index == REPORT]
    if len(reports) == 1:
        return reports[0]
    if not reports and not written:
        return rank_report(RankResult(rank=rank))
    raise MalformedMessageError(f"rank {rank} returned {len(reports)} reports of what it wrote")


def _object(fqn: str, data: object, *, pickled: bool) -> tuple[object, bool]:
    """A byte item's value, loaded without unpickling anything but plain values (a tensor is refused); with
    ``pickled``, what does not load that way is kept as its opaque bytes instead. Returns (value, opaque)."""
    if not isinstance(data, io.BytesIO):
        raise UsageError(f"DCP item {fqn!r} is {type(data).__name__}, not the bytes of a torch.save", tensor=fqn)
    data.seek(0)
    try:
        value = torch.load(data, weights_only=True)
    except Exception as exc:  # torch's unpickler refuses anything but plain values and tensors
        if pickled:
            return data.getvalue(), True
        raise UsageError(
            f"DCP item {fqn!r} does not load as plain values (weights_only=True): ckptfmt stores no pickle unless "
            f"StorageWriter(pickled_objects=True) ({exc})",
            tensor=fqn,
        ) from exc
    try:
        tensors, _ = flatten({"value": value})
    except UsageError as exc:  # it names the place inside the value ("value/..."), not the item
        if pickled:
            return data.getvalue(), True
        raise UsageError(f"DCP item {fqn!r} is not plain values: {exc.message}", tensor=fqn) from exc
    if tensors:
        raise UsageError(f"DCP item {fqn!r} holds a tensor inside other state: give it as a tensor item", tensor=fqn)
    return value, False


def _training_contexts(training: TrainingFields, gathered: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The training profile's context fields, written by rank 0 (``gathered``: every rank's RNG)."""
    from .. import provenance
    from ..torch import api
    from ..torch.data_position import data_field
    from ..torch.state import config_field

    data = training.data
    return {
        "rng": dict(gathered if gathered is not None else training.rng),
        "data": dict(data) if isinstance(data, Mapping) else data_field(data),
        "config": config_field(training.config),
        "topology": api.topology(training.mesh),
        "provenance": provenance.capture(step=training.step),
    }
