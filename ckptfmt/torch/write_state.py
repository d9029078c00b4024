"""Writing a :class:`~ckptfmt.torch.snapshot.Snapshot` as one checkpoint: every rank its own tensors, the
coordinator the contexts (the ``rng`` field gathered from every rank), then the commit."""

from __future__ import annotations

from ..collective import Collective
from ..context import decode, encode
from ..errors import UsageError
from ..writer import COORDINATOR, CheckpointWriter
from . import rng
from .sharding import LocalShard, TargetShard, owners, replicated_sizes
from .snapshot import Snapshot


def write_snapshot(writer: CheckpointWriter, snap: Snapshot) -> str:
    """Write every field of ``snap`` and commit; returns the checkpoint id.

    With several ranks (``writer.collective``), each rank writes the shards it is the writer of and the
    replicated tensors assigned to it (:func:`~ckptfmt.torch.sharding.owners`), and the coordinator writes
    the context blobs; the commit is collective.
    """
    stage_snapshot(writer, snap)
    return writer.commit()


def stage_snapshot(writer: CheckpointWriter, snap: Snapshot) -> None:
    """Hand every field of ``snap`` to ``writer`` (not committed; on failure the writer is aborted).

    After ``writer.flush()`` returns, the snapshot's arrays are no longer needed: a snapshot of live
    tensors (views) may let the trainer change them from then on. Such a snapshot is flushed here and checked
    (:meth:`Snapshot.check_sources`): a view changed in place while it was written fails the save.
    """
    if snap.deferred:
        raise UsageError("the snapshot has tensors not copied yet: call materialize() first")
    try:
        collective = writer.collective
        assigned = owners(replicated_sizes(snap.tensors), collective.world_size) if collective is not None else {}
        if collective is not None and "rng" in snap.contexts:
            _gather_rng(snap, collective)
        for name, tensors in snap.tensors.items():
            writer.write_tensors(name, {})  # every rank declares the field, even with nothing to write
            for tname, value in tensors.items():
                if isinstance(value, LocalShard):
                    if value.writer:
                        writer.write_tensor(
                            name, tname, value.array, global_shape=value.global_shape, offsets=value.offsets
                        )
                elif isinstance(value, TargetShard):
                    raise UsageError("a snapshot read for loading cannot be written back", field=name, tensor=tname)
                elif collective is None or assigned[f"{name}/{tname}"] == collective.rank:
                    writer.write_tensor(name, tname, value)
        if writer.is_coordinator:
            for name, context in snap.contexts.items():
                writer.write_context(name, context)
        if snap.sources:  # views of live tensors: their bytes are taken once written
            writer.flush()
            snap.check_sources()
    except BaseException:
        writer.abort()
        raise


def _gather_rng(snap: Snapshot, collective: Collective) -> None:
    """Each rank's own generators into the coordinator's ``rng`` field (:func:`ckptfmt.torch.rng.with_ranks`)."""
    gathered = collective.gather(encode(snap.contexts["rng"], where="field 'rng'"), dst=COORDINATOR)
    if gathered is not None:
        snap.contexts["rng"] = rng.with_ranks([decode(g, field="rng") for g in gathered])
