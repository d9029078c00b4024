"""The checkpoint writer: the public face of the plan / execute / commit split.

:class:`CheckpointWriter` validates and plans each call (:mod:`ckptfmt.plan`), streams full data
files on a bounded pool (:mod:`ckptfmt.write_executor`), and at the end joins every rank's records into
the manifest, which the committer writes create-only (:mod:`ckptfmt.commit`, spec/commit.md).

One process, one rank: the writer is its own coordinator. Several ranks: each rank's writer writes
its own data files in parallel; they exchange records through a :class:`~ckptfmt.collective.Collective`,
and the coordinator (rank 0) holds the lock and commits (:mod:`ckptfmt.collective_commit`, which also
commits a save whose ranks write to several stores). A failure on any rank aborts the save on every
rank with the same error, and no manifest is written.

Memory bound: besides the caller's own arrays, the writer holds references to at most
``workers + 1`` files' worth of pending tensors (``workers=0``: each file is written on the caller's thread as it
fills, for a caller that is a background thread already) (never copies, except to make a non-contiguous or
big-endian array contiguous little-endian, or a GPU tensor host-resident), one I/O slice of
``SLICE_BYTES`` per worker thread, and the records. With a codec, each worker also holds one encoded
data file (at most ``plan.ENCODED_FILE_BYTES`` = 64 MiB of raw data; larger tensors are cut into
chunks of that size) and one frame's byte planes (4 MiB): about 2 x 68 MiB with the default 2
workers (tests/test_codecs_memory.py). With ``xor-zstd`` (spec/delta.md) each worker also holds, while it encodes
a chunk, the chunk's XOR and its base chunk's raw bytes (at most 2 x 64 MiB), read through the base's reader.
Arrays passed in must therefore not be modified until the writer commits (or :meth:`CheckpointWriter.flush`
returns).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from . import layout
from .arrays import as_array
from .blocks import DEFAULT_BLOCK_BYTES
from .canonical import config_hash, config_to_dict
from .codecs import WriteCodec
from .codecs.xor_zstd import NAME as XOR_ZSTD
from .collective import Collective
from .collective_commit import COORDINATOR, SoloCommit, start_commit
from .context import encode
from .digests import DEFAULT_ALGORITHM
from .errors import CheckpointError, CollectiveError, UsageError
from .fields import check_standard_field
from .incremental import ChunkKey, RawDigests, ReferenceStats, open_base_index
from .manifest import FileRecord
from .paths import check_field_name
from .plan import RAW_WRITE, FilePlan, RankPlanner, RankResult
from .plan_cache import Call, PlanCache, PlanReplay
from .profiles import PROFILES
from .provenance import default_provenance
from .references import BaseRecord
from .storage import Store
from .write_executor import WriteExecutor
from .write_options import WriteOptions

if TYPE_CHECKING:
    from .reader import Checkpoint

DEFAULT_TARGET_FILE_SIZE = 1 << 30


class CheckpointWriter:
    """Writes one checkpoint. Use as a context manager: leaving the block commits, an exception aborts.

    With ``collective`` (several ranks), every rank constructs its writer, writes its own tensors
    (chunks with global offsets) and contexts, and leaves the block; the constructor and
    :meth:`commit` / :meth:`abort` are collective calls that every rank makes.
    """

    def __init__(
        self,
        store: Store,
        *,
        profile: str = "training",
        overwrite: bool = False,
        target_file_size: int = DEFAULT_TARGET_FILE_SIZE,
        digest: str = DEFAULT_ALGORITHM,
        rank: int = 0,
        workers: int = 2,
        metadata: Mapping[str, str] | None = None,
        collective: Collective | None = None,
        codec: str | WriteCodec | None = None,
        store_of_rank: Sequence[int] | None = None,
        block_bytes: int | None = DEFAULT_BLOCK_BYTES,
        base: Checkpoint | str | os.PathLike[str] | None = None,
        frozen: Collection[str] = (),
        base_content: RawDigests | None = None,
        before_replace: Callable[[], None] | None = None,
        committed_elsewhere: bool = False,
        check_manifest: bool = True,
        plan_cache: PlanCache | None = None,
    ) -> None:
        options = WriteOptions.check(
            profile=profile,
            target_file_size=target_file_size,
            digest=digest,
            rank=rank,
            workers=workers,
            metadata=metadata,
            collective=collective,
            codec=codec,
            store_of_rank=store_of_rank,
            block_bytes=block_bytes,
        )
        self.store = store
        self.profile = options.profile
        self.digest = options.digest
        self.rank = options.rank
        self.metadata = options.metadata
        self.collective = collective
        self.store_of_rank = options.store_of_rank
        self.checkpoint_id: str | None = None
        # committed_elsewhere: this rank writes its files and :meth:`hand_over` gives their records to a commit
        # made outside this writer (ckptfmt.dcp: DCP's finish, on the coordinator, which took the lock)
        self.committed_elsewhere = committed_elsewhere
        # check_manifest=False: the manifest is committed without being parsed back first (commit.Committer says
        # for which stores)
        # base: an earlier checkpoint beside this one; chunks equal to its chunks are referenced, not written
        # (spec/references.md). frozen: tensor names the caller declares unchanged since the base (not hashed).
        # base_content: ``raw_digests`` of the writer of this process that wrote the base, with its checkpoint id:
        # lets an unchanged encoded chunk be referenced after a hash (ignored unless the ids match)
        if options.codec.name == XOR_ZSTD and base is None:
            raise UsageError(f"codec {XOR_ZSTD!r} encodes each chunk against the same chunk of a base: give base= too")
        self._base = open_base_index(store, base, frozen, base_content)
        self._planner = RankPlanner(
            rank=self.rank, target_file_size=options.target_file_size, codec=options.codec, base=self._base
        )
        # plan_cache: the plan of the last writer given it, taken instead of planning while the calls are the same
        # (ckptfmt/plan_cache.py); raw writes without a base only
        cacheable = plan_cache is not None and options.codec == RAW_WRITE and self._base is None
        self._replay = PlanReplay(plan_cache) if plan_cache is not None and cacheable else None
        self._arrays: dict[tuple[str, str], np.ndarray[Any, Any]] = {}  # (field, key) -> pending array
        self._contexts: dict[str, str] = {}
        self._closed = False
        self._executor = WriteExecutor(
            store, algorithm=options.digest, workers=options.workers, block_bytes=options.block_bytes
        )
        try:
            self._commit = start_commit(
                store,
                collective,
                store_of_rank=options.store_of_rank,
                profile=options.profile,
                metadata=self.metadata,
                overwrite=overwrite,
                bases=() if self._base is None else self._base.names,
                before_replace=before_replace,
                committed_elsewhere=committed_elsewhere,
                check_manifest=check_manifest,
            )
        except BaseException:
            self._close()
            raise

    @property
    def is_coordinator(self) -> bool:
        return self.collective is None or self.collective.rank == COORDINATOR

    # ------------------------------------------------------------ public API

    def write_tensor(
        self,
        field: str,
        name: str,
        array: object,
        *,
        global_shape: tuple[int, ...] | list[int] | None = None,
        offsets: tuple[int, ...] | list[int] | None = None,
    ) -> None:
        """Add one tensor, or one chunk of a sharded tensor (``global_shape`` and ``offsets`` given)."""
        self._check_open()
        self._executor.raise_background_error()
        check_field_name(field)
        data, dtype = as_array(array)
        replay = self._replay
        if replay is not None:
            call: Call = (
                field,
                name,
                dtype,
                data.shape,
                None if global_shape is None else tuple(global_shape),
                None if offsets is None else tuple(offsets),
            )
            if replay.matching:
                planned = replay.match(call)
                if planned is not None and planned.entry is not None:
                    for plan in planned.full:
                        self._submit(plan, replayed=True)
                    self._arrays[(field, planned.entry.key)] = data
                    return
                self._leave_plan_cache()
        placements = self._planner.add_array(field, name, data, dtype, global_shape=global_shape, offsets=offsets)
        for placed in placements:
            for plan in placed.full:
                self._submit(plan)
            self._arrays[(field, placed.entry.key)] = placed.data
        if replay is not None:
            (placed,) = placements  # raw and without a base: one chunk per call
            replay.record(call, placed.entry, placed.full)

    def write_tensors(self, field: str, tensors: Mapping[str, object]) -> None:
        """Add a mapping of tensors to a field (an empty mapping declares an empty tensor field)."""
        self._check_open()
        replay = self._replay
        if replay is None or not replay.matching or replay.match((field,)) is None:
            if replay is not None:
                self._leave_plan_cache()
            self._planner.declare_field(field)
            if replay is not None:
                replay.record((field,), None, ())
        for name, array in tensors.items():
            self.write_tensor(field, name, array)

    def write_context(self, field: str, value: Mapping[str, object]) -> None:
        """Store a field's context map (alone, or beside the field's tensors). One rank per field."""
        self._check_open()
        self._executor.raise_background_error()
        check_field_name(field)
        if field in self._contexts:
            raise UsageError("context was already written", field=field)
        if not isinstance(value, Mapping):
            raise UsageError(f"a context must be a mapping, got {type(value).__name__}", field=field)
        if field == "provenance":
            value = {**default_provenance(), **value}
        check_standard_field(field, value, writing=True)
        data = encode(value, where=f"field {field!r}")
        several = self.collective is not None or self.committed_elsewhere
        path = layout.context_path(field, self.rank if several else 0)
        self._executor.write_blob(path, data)
        self._contexts[field] = path

    def write_config(self, config: object) -> None:
        """Store a config (mapping or dataclass) with its canonical hash as the ``config`` field."""
        as_dict = config_to_dict(config)
        self.write_context("config", {"config": as_dict, "hash": config_hash(as_dict)})

    def flush(self) -> None:
        """Write every pending tensor and wait until its file is durable."""
        self._check_open()
        replay = self._replay
        tail = None
        if replay is not None and not replay.flushed:
            tail = replay.tail()
            if tail is None:
                self._leave_plan_cache()
        if tail is not None:
            for plan in tail:
                self._submit(plan, replayed=True)
        else:
            tail = tuple(self._planner.finish())
            for plan in tail:
                self._submit(plan)
        self._executor.drain(0)
        if replay is not None:
            replay.keep(tail, self._executor.headers)

    def result(self) -> RankResult:
        """This rank's records so far (after :meth:`flush`): what it hands the coordinator."""
        references = self._planner.references
        bases: tuple[BaseRecord, ...] = ()
        if self._base is not None and self._base.stats.files:  # referenced chunks, and the bases of deltas
            bases = self._base.records(c.chunk for c in references)
        return RankResult(
            rank=self.rank,
            files=tuple(self._executor.files[p] for p in sorted(self._executor.files)),
            chunks=(*self._executor.chunks, *references),
            contexts=dict(self._contexts),
            tensor_fields=tuple(sorted({*self._planner.tensors, *(self._replay.fields if self._replay else ())})),
            bases=bases,
        )

    @property
    def raw_digests(self) -> dict[ChunkKey, str]:
        """(field, tensor, offsets) -> digest of the raw bytes of every encoded chunk this rank wrote or
        referenced: give it, with the checkpoint id, as ``base_content`` to the next save on this checkpoint."""
        known = dict(self._executor.raw_digests)
        if self._base is not None:
            known.update(self._base.referenced_raw)
        return known

    @property
    def referenced(self) -> ReferenceStats | None:
        """What this rank referenced in the base instead of writing (None without a base)."""
        return None if self._base is None else self._base.stats

    def commit(self) -> str:
        """Finish the checkpoint: flush, check completeness, write the manifest. Returns the checkpoint id.

        With several ranks this is a collective call; every rank returns the same id or raises the
        same error.
        """
        self._check_open()
        try:
            self.flush()
            if self.is_coordinator and "provenance" not in self._contexts and "provenance" in PROFILES[self.profile]:
                self.write_context("provenance", {})
            mine = self.result()
        except BaseException as exc:
            self._fail(exc)
            raise
        try:
            if isinstance(self._commit, SoloCommit) and self._replay is not None:
                # the manifest of a plan that repeats: a template, filled (manifest_template.py)
                cache = self._replay.cache if self._replay.matching else None
                self.checkpoint_id = self._commit.commit_result(mine, written=self._executor.written, cache=cache)
            else:
                self.checkpoint_id = self._commit.commit_result(mine, written=self._executor.written)
        finally:
            self._close()
        return self.checkpoint_id

    def hand_over(self) -> RankResult:
        """Flush and stop, keeping the files written, and return their records for the commit made elsewhere
        (a writer made with ``committed_elsewhere``). On a failure this rank's files are deleted (COM-14)."""
        if not self.committed_elsewhere:
            raise UsageError("hand_over() is for a writer whose records are committed elsewhere")
        self._check_open()
        try:
            self.flush()
            mine = self.result()
        except BaseException as exc:
            self._fail(exc)
            raise
        self._close()
        return mine

    def release(self) -> tuple[FileRecord, ...]:
        """Flush and stop without a manifest, keeping the files written (one rank, no collective): the lock is
        removed, the files' records are returned. For files that another writer's manifest commits (a replica
        written locally from the same state, spec/memory.md)."""
        if self.collective is not None:
            raise UsageError("release() is for a writer of one rank")
        self.flush()
        records = self.result().files
        self._close()
        self._commit.release([])  # the lock only
        return records

    def abort(self) -> None:
        """Discard everything written; no manifest is left. Safe to call more than once.

        With several ranks this is a collective call: the other ranks' :meth:`commit` fails too.
        """
        if self._closed:
            return
        self._fail(UsageError("the save was aborted"))

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        elif not self._closed:
            self._fail(exc if exc is not None else UsageError("the save was aborted"))

    # ------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("the writer is closed (committed or aborted)")

    def _close(self) -> None:
        self._closed = True
        self._executor.shutdown()
        if self._base is not None:
            self._base.close()

    def _submit(self, plan: FilePlan, *, replayed: bool = False) -> None:
        arrays = [self._arrays.pop((plan.field, e.key)) for e in plan.entries]
        header = self._replay.header(plan.path) if replayed and self._replay is not None else None
        self._executor.submit(plan, arrays, header=header)

    def _leave_plan_cache(self) -> None:
        """A call differs from the recorded plan: hand the calls matched so far to the planner (its files were
        submitted already: the planner closes the same ones again, and they are not submitted twice)."""
        replay = self._replay
        assert replay is not None
        matched = replay.handover()
        for planned in matched:
            call = planned.call
            if len(call) == 1:
                self._planner.declare_field(call[0])
            else:
                fname, name, dtype, shape, global_shape, offsets = call
                assert planned.entry is not None
                self._planner.add(
                    fname,
                    name,
                    dtype=dtype,
                    shape=shape,
                    nbytes=planned.entry.nbytes,
                    global_shape=global_shape,
                    offsets=offsets,
                )
        if matched and replay.flushed:
            self._planner.finish()  # the recorded tail, written by that flush

    def _fail(self, exc: BaseException) -> None:
        """Abort this rank's part; with several ranks, tell the coordinator, so every rank aborts."""
        self._close()
        error = exc if isinstance(exc, CheckpointError) else CollectiveError(f"rank {self.rank} failed: {exc!r}")
        self._commit.fail(error, written=self._executor.written)


__all__ = ["COORDINATOR", "DEFAULT_TARGET_FILE_SIZE", "CheckpointWriter", "default_provenance"]
