"""The checkpoint writer: the public face of the plan / execute / commit split.

:class:`CheckpointWriter` validates and plans each call (:mod:`ckptfmt.plan`), streams full data
files on a bounded pool (:mod:`ckptfmt.write_executor`), and at the end joins every rank's records into
the manifest, which the committer writes create-only (:mod:`ckptfmt.commit`, spec/commit.md).

One process, one rank: the writer is its own coordinator. Several ranks: each rank's writer writes
its own data files in parallel; they exchange records through a :class:`~ckptfmt.collective.Collective`,
and the coordinator (rank 0) holds the lock and commits. A failure on any rank aborts the save on
every rank with the same error, and no manifest is written.

Memory bound: besides the caller's own arrays, the writer holds references to at most
``workers + 1`` files' worth of pending tensors (never copies, except to make a non-contiguous or
big-endian array contiguous little-endian, or a GPU tensor host-resident), one I/O slice of
``SLICE_BYTES`` per worker thread, and the records. With a codec, each worker also holds one encoded
data file (at most ``plan.ENCODED_FILE_BYTES`` = 64 MiB of raw data; larger tensors are cut into
chunks of that size) and one frame's byte planes (4 MiB): about 2 x 68 MiB with the default 2
workers (tests/test_codecs_memory.py). Arrays passed in must therefore not be modified until the
writer commits (or :meth:`CheckpointWriter.flush` returns).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime, timezone
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from . import layout
from . import plan as plan_module
from ._version import __version__
from .arrays import as_array
from .bases import check_bases_still_there
from .blocks import DEFAULT_BLOCK_BYTES
from .blocks import valid_size as valid_block_size
from .canonical import config_hash, config_to_dict
from .codecs import WriteCodec, writer_codec
from .collective import Collective, decode_status, encode_status
from .commit import Committer
from .context import encode
from .digests import DEFAULT_ALGORITHM, algorithm_of, digest_of, new_hasher
from .errors import (
    CheckpointError,
    CollectiveError,
    DigestMismatchError,
    MissingFileError,
    SizeMismatchError,
    UsageError,
)
from .fields import check_standard_field
from .incremental import BaseIndex, ChunkKey, RawDigests, ReferenceStats, merge_bases
from .manifest import RAW, FileRecord
from .manifest_parse import parse_manifest
from .paths import check_field_name
from .plan import FilePlan, PlacedChunk, RankPlanner, RankResult, merge_results
from .profiles import PROFILES
from .references import BaseRecord
from .storage import Store
from .write_executor import WriteExecutor

if TYPE_CHECKING:
    from .reader import Checkpoint

log = logging.getLogger("ckptfmt")
DEFAULT_TARGET_FILE_SIZE = 1 << 30
COORDINATOR = 0
RECHECK_BYTES = 1 << 20  # the coordinator re-hashes other ranks' files up to this size before it commits


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_provenance() -> dict[str, object]:
    return {
        "writer": {"name": "ckptfmt", "version": __version__},
        "created_at": _now(),
        "host": socket.gethostname(),
    }


def _cut(
    data: np.ndarray[Any, Any], base: tuple[int, ...], limit: int
) -> list[tuple[np.ndarray[Any, Any], tuple[int, ...]]]:
    """Blocks of at most ``limit`` bytes along the first dimension longer than 1 (contiguous views, since
    every earlier dimension is 1), cutting a single slice further when it alone exceeds ``limit``."""
    axis = next((d for d, n in enumerate(data.shape) if n > 1), None)
    if data.nbytes <= limit or axis is None:
        return [(data, base)]
    row = data.nbytes // data.shape[axis]
    step = max(1, limit // max(1, row))
    out: list[tuple[np.ndarray[Any, Any], tuple[int, ...]]] = []
    for lo in range(0, data.shape[axis], step):
        index = tuple(slice(lo, lo + step) if d == axis else slice(None) for d in range(data.ndim))
        at = tuple(o + (lo if d == axis else 0) for d, o in enumerate(base))
        out.extend(_cut(data[index], at, limit) if row > limit else [(data[index], at)])
    return out


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
    ) -> None:
        if profile not in PROFILES:
            raise UsageError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
        if target_file_size <= 0 or workers <= 0 or rank < 0:
            raise UsageError("target_file_size and workers must be positive, rank non-negative")
        if collective is not None and collective.rank != rank:
            rank = collective.rank
        new_hasher(digest)  # fail early on an unknown algorithm
        if block_bytes is not None and not valid_block_size(block_bytes):
            raise UsageError(f"block_bytes must be a power of two from 4096 to 2**30 (or None), got {block_bytes!r}")
        if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise UsageError("metadata must map strings to strings")
        self.store = store
        self.profile = profile
        self.digest = digest
        self.rank = rank
        self.metadata = dict(metadata or {})
        self.collective = collective
        # Ranks whose stores are not shared (a memory slot on each node, spec/commit.md "Several stores"): the
        # store each rank writes to, by rank; None: one store every rank sees.
        self.store_of_rank = tuple(store_of_rank) if store_of_rank is not None and collective is not None else None
        if self.store_of_rank is not None and len(self.store_of_rank) != collective.world_size:  # type: ignore[union-attr]
            raise UsageError("store_of_rank needs one entry per rank")
        self.checkpoint_id: str | None = None
        # codec: None or "raw" stores raw chunks; "zstd" or "zstd:LEVEL" compresses floating chunks (spec/codecs.md)
        self._planner = RankPlanner(rank=rank, target_file_size=target_file_size, codec=codec)
        self._arrays: dict[tuple[str, str], np.ndarray[Any, Any]] = {}  # (field, key) -> pending array
        self._split: set[tuple[str, str]] = set()  # tensors cut into chunks for encoding
        self._contexts: dict[str, str] = {}
        self._closed = False
        self._committer: Committer | None = None
        # base: an earlier checkpoint beside this one; chunks equal to its chunks are referenced, not written
        # (spec/references.md). frozen: tensor names the caller declares unchanged since the base (not hashed).
        # base_content: ``raw_digests`` of the writer of this process that wrote the base, with its checkpoint id:
        # lets an unchanged encoded chunk be referenced after a hash (ignored unless the ids match)
        self._base = _base_index(store, base, frozen, base_content)
        # with overwrite: called under the lock before the old checkpoint is un-committed, to refuse replacing one
        # that others reference (RunDirectory.check_replaceable, REF-14)
        self._before_replace = before_replace
        self._references: list[PlacedChunk] = []
        # recorded in the writer lock, so that gc keeps the bases while this save is at work (REF-13)
        self._base_names = () if self._base is None else self._base.names
        # block_bytes: raw chunks larger than this get a digest per block, so partial reads are verified over
        # exactly the blocks they read (spec/blocks.md); None writes none (the checkpoint stays a 1.0 or 1.1 one)
        self._executor = WriteExecutor(store, algorithm=digest, workers=workers, block_bytes=block_bytes)
        try:
            self._start(overwrite)
        except BaseException:
            self._executor.shutdown()
            self._closed = True
            raise

    @property
    def is_coordinator(self) -> bool:
        return self.collective is None or self.collective.rank == COORDINATOR

    @property
    def is_store_leader(self) -> bool:
        """Whether this rank commits its store: the coordinator, or with several stores the lowest rank of each."""
        if self.store_of_rank is None:
            return self.is_coordinator
        return self.store_of_rank.index(self.store_of_rank[self.rank]) == self.rank

    def _start(self, overwrite: bool) -> None:
        """Step 1 of the commit protocol on the coordinator; the other ranks learn its outcome."""
        if self.collective is None:
            self._committer = Committer(
                self.store, overwrite=overwrite, bases=self._base_names, before_replace=self._before_replace
            )
            return
        if self.store_of_rank is not None:
            self._start_spread(overwrite)
            return
        error: CheckpointError | None = None
        if self.is_coordinator:
            try:
                self._committer = Committer(
                    self.store, overwrite=overwrite, bases=self._base_names, before_replace=self._before_replace
                )
            except CheckpointError as exc:
                error = exc
        try:
            status = self.collective.broadcast(encode_status(error) if self.is_coordinator else None, src=COORDINATOR)
        except BaseException:
            if self._committer is not None:
                # A rank is gone before the save began (COM-20): give the lock back, or this live process
                # holds it for good, gc keeps it and a retry here is refused. Nothing else was written.
                self._committer.abort([])
                self._committer = None
            raise
        if error is not None:
            raise error
        decode_status(status)

    def _start_spread(self, overwrite: bool) -> None:
        """Step 1 on the leader of every store; the first failure, as the coordinator saw it, fails all ranks."""
        assert self.collective is not None
        error: CheckpointError | None = None
        if self.is_store_leader:
            try:
                self._committer = Committer(
                    self.store, overwrite=overwrite, bases=self._base_names, before_replace=self._before_replace
                )
            except CheckpointError as exc:
                error = exc
        try:
            decode_status(self._exchange(encode_status(error), _first_status))
        except BaseException:
            if self._committer is not None:
                self._committer.abort([])
                self._committer = None
            raise

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
        if (field, name) in self._split:
            raise UsageError("tensor was already written", field=field, tensor=name)
        pieces = self._pieces(data, dtype, global_shape, offsets)
        if len(pieces) > 1:
            self._split.add((field, name))
            global_shape = data.shape if global_shape is None else global_shape
        for piece, piece_offsets in pieces:
            gshape, offs = self._planner.declare(
                field,
                name,
                dtype=dtype,
                shape=piece.shape,
                global_shape=global_shape,
                offsets=offsets if len(pieces) == 1 else piece_offsets,
            )
            if self._base is not None:
                found = self._base.match(field, name, dtype, gshape, offs, piece)
                if found is not None:
                    self._references.append(
                        PlacedChunk(field=field, tensor=name, dtype=dtype, global_shape=gshape, chunk=found[0])
                    )
                    continue
            entry, full = self._planner.place(field, name, dtype, piece.shape, gshape, offs, piece.nbytes)
            for plan in full:
                self._submit(plan)
            self._arrays[(field, entry.key)] = piece

    def _pieces(
        self,
        data: np.ndarray[Any, Any],
        dtype: str,
        global_shape: tuple[int, ...] | list[int] | None,
        offsets: tuple[int, ...] | list[int] | None,
    ) -> list[tuple[np.ndarray[Any, Any], tuple[int, ...]]]:
        """An array to encode that exceeds one encoded file is cut into chunks (views) of at most
        ``plan.ENCODED_FILE_BYTES``, so the memory of one encode stays bounded at any tensor size."""
        base = tuple(int(o) for o in offsets) if offsets is not None else (0,) * data.ndim
        limit = plan_module.ENCODED_FILE_BYTES
        if data.nbytes <= limit or writer_codec(self._planner.codec, dtype=dtype, nbytes=data.nbytes).name == RAW:
            return [(data, base)]
        return _cut(data, base, limit)

    def write_tensors(self, field: str, tensors: Mapping[str, object]) -> None:
        """Add a mapping of tensors to a field (an empty mapping declares an empty tensor field)."""
        self._check_open()
        self._planner.declare_field(field)
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
        check_standard_field(field, value)
        data = encode(value, where=f"field {field!r}")
        path = layout.context_path(field, self.rank if self.collective is not None else 0)
        self._executor.write_blob(path, data)
        self._contexts[field] = path

    def write_config(self, config: object) -> None:
        """Store a config (mapping or dataclass) with its canonical hash as the ``config`` field."""
        as_dict = config_to_dict(config)
        self.write_context("config", {"config": as_dict, "hash": config_hash(as_dict)})

    def flush(self) -> None:
        """Write every pending tensor and wait until its file is durable."""
        self._check_open()
        for plan in self._planner.finish():
            self._submit(plan)
        self._executor.drain(0)

    def result(self) -> RankResult:
        """This rank's records so far (after :meth:`flush`): what it hands the coordinator."""
        bases: tuple[BaseRecord, ...] = ()
        if self._base is not None and self._references:
            ids = {c.chunk.base: self._base.id_of(c.chunk.base) for c in self._references if c.chunk.base}
            bases = merge_bases(ids, [(loc, f) for (loc, _), f in self._base.stats.files.items()])
        return RankResult(
            rank=self.rank,
            files=tuple(self._executor.files[p] for p in sorted(self._executor.files)),
            chunks=(*self._executor.chunks, *self._references),
            contexts=dict(self._contexts),
            tensor_fields=tuple(sorted(self._planner.tensors)),
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
        if self.collective is None:
            assert self._committer is not None
            try:
                manifest = merge_results([mine], profile=self.profile, metadata=self.metadata)
                check_bases_still_there(self.store, manifest)
                self.checkpoint_id = self._committer.commit(manifest, self._executor.written)
            except BaseException:
                self.abort()
                raise
        elif self.store_of_rank is not None:
            self.checkpoint_id = self._commit_spread(mine)
        else:
            self.checkpoint_id = self._commit_collective(mine)
        self._closed = True
        self._executor.shutdown()
        return self.checkpoint_id

    def release(self) -> tuple[FileRecord, ...]:
        """Flush and stop without a manifest, keeping the files written (one rank, no collective): the lock is
        removed, the files' records are returned. For files that another writer's manifest commits (a replica
        written locally from the same state, spec/memory.md)."""
        if self.collective is not None:
            raise UsageError("release() is for a writer of one rank")
        self.flush()
        records = self.result().files
        self._closed = True
        self._executor.shutdown()
        if self._committer is not None:
            self._committer.abort([])  # the lock only
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

    def _submit(self, plan: FilePlan) -> None:
        arrays = [self._arrays.pop((plan.field, e.key)) for e in plan.entries]
        self._executor.submit(plan, arrays)

    def _fail(self, exc: BaseException) -> None:
        """Abort this rank's part; with several ranks, tell the coordinator, so every rank aborts."""
        self._closed = True
        self._executor.shutdown()
        if self.collective is not None:
            error = exc if isinstance(exc, CheckpointError) else CollectiveError(f"rank {self.rank} failed: {exc!r}")
            try:
                self._exchange(encode_status(error))
            except CheckpointError:
                pass  # the save is failing anyway; this rank raises its own error
        self._clean_up(self._executor.written)

    def _clean_up(self, paths: list[str]) -> None:
        """Delete ``paths`` (and, on the coordinator, the lock); stop at the first storage failure."""
        if self.store_of_rank is not None:
            # Several stores: nothing is committed before every rank's records merged, so each rank deletes
            # its own files, and each store's leader its lock.
            paths = list(self._executor.written)
        if self._committer is not None:
            self._committer.abort(paths)
            return
        try:
            for path in paths:
                self.store.delete(path)
        except CheckpointError:
            pass  # unreachable storage: what is left is an incomplete checkpoint that gc removes

    def _exchange(self, mine: bytes, decide: Callable[[list[bytes]], bytes] | None = None) -> bytes:
        """Gather every rank's status on the coordinator, which decides (by default: commits); broadcast its outcome."""
        assert self.collective is not None
        gathered = self.collective.gather(mine, dst=COORDINATOR)
        outcome: bytes | None = None
        if gathered is not None:
            outcome = (decide or self._coordinate)(gathered)
        return self.collective.broadcast(outcome, src=COORDINATOR)

    def _coordinate(self, gathered: list[bytes]) -> bytes:
        """On the coordinator: commit if every rank succeeded, else clean up every rank's files."""
        if self.store_of_rank is not None:
            return self._merge_spread(gathered)
        assert self._committer is not None
        results: list[RankResult] = []
        error: CheckpointError | None = None
        for rank, data in enumerate(gathered):
            try:
                results.append(_rank_result(rank, data))
            except CheckpointError as exc:
                error = error or exc.locate(path=f"rank {rank}")
        if error is None:
            try:
                _check_visible(self.store, results)
                manifest = merge_results(results, profile=self.profile, metadata=self.metadata)
                check_bases_still_there(self.store, manifest)
                written = [f.path for r in results for f in r.files]
                self.checkpoint_id = self._committer.commit(manifest, written)
                return encode_status(None, checkpoint_id=self.checkpoint_id)
            except CheckpointError as exc:
                error = exc
            except Exception as exc:  # every rank waits for an answer: whatever fails here, they get one
                error = CollectiveError(f"the coordinator failed to commit: {exc!r}")
        self._clean_up([f.path for r in results for f in r.files])
        return encode_status(error)

    def _merge_spread(self, gathered: list[bytes]) -> bytes:
        """Several stores, on the coordinator: the manifest every store's leader commits, and each rank's files
        (so that a leader checks its own store's: COM-21 applies per store). Nothing is committed here."""
        try:
            results = [_rank_result(rank, data) for rank, data in enumerate(gathered)]
            manifest = merge_results(results, profile=self.profile, metadata=self.metadata)
            files = {str(r.rank): [f.to_dict() for f in r.files] for r in results}
            return encode_status(None, manifest=manifest.to_bytes().decode("utf-8"), files=files)
        except CheckpointError as exc:
            return encode_status(exc)
        except Exception as exc:  # every rank waits for an answer: whatever fails here, they get one
            return encode_status(CollectiveError(f"the coordinator failed to merge: {exc!r}"))

    def _commit_spread(self, mine: RankResult) -> str:
        """Several stores: merge on the coordinator, then every store's leader commits the same manifest in its
        own store once its ranks' files are visible there; the checkpoint id is the same in every store."""
        assert self.collective is not None and self.store_of_rank is not None
        try:
            merged = decode_status(self._exchange(encode_status(None, result=mine.to_bytes().decode("utf-8"))))
        except BaseException:
            self._closed = True
            self._executor.shutdown()
            self._clean_up([])  # nothing was committed anywhere: each rank's own files, each leader's lock
            raise
        error: CheckpointError | None = None
        committed: str | None = None
        if self._committer is not None:
            try:
                manifest = parse_manifest(str(merged["manifest"]).encode("utf-8"))
                mine_store = self.store_of_rank[self.rank]
                ranks = [r for r, s in enumerate(self.store_of_rank) if s == mine_store]
                local = [_files_of(r, merged["files"]) for r in ranks]
                _check_visible(self.store, local, leader=self.rank)
                written = [f.path for r in local for f in r.files]
                # A file of this checkpoint that another store holds now, left here by an earlier save with another
                # placement (MEM-9): the manifest lists it, at its size, but its bytes are stale. Deleted before the
                # commit, so that no reader of this store ever counts it.
                elsewhere = {f.path for f in manifest.files} - set(written)
                for path in sorted(self._committer.old_files.keys() & elsewhere):
                    self.store.delete(path)
                committed = self._committer.commit(manifest, written)
            except CheckpointError as exc:
                error = exc
                self._committer.abort([])  # the lock only: the data files stay for gc or the next rewrite
        self._closed = True
        self._executor.shutdown()
        status = decode_status(self._exchange(encode_status(error, checkpoint_id=committed), _first_status))
        ids = {str(status.get("checkpoint_id"))} | ({committed} if committed else set())
        if len(ids) != 1:
            raise CollectiveError(f"the stores committed different manifests: {sorted(ids)}")
        return ids.pop()

    def _commit_collective(self, mine: RankResult) -> str:
        try:
            status = decode_status(self._exchange(encode_status(None, result=mine.to_bytes().decode("utf-8"))))
        except CheckpointError as exc:
            self._closed = True
            self._executor.shutdown()
            if self.is_coordinator and self.checkpoint_id is not None:
                # Committed, and only telling the other ranks failed (one died after the gather): the
                # checkpoint is whole and durable, so this rank's save succeeded.
                log.warning("%s: committed, but a rank did not learn it: %s", self.store.url, exc)
                return self.checkpoint_id
            if self.is_coordinator:
                # The gather failed (a rank vanished): no manifest was written. Drop this rank's own files and
                # the lock, so a retry in this process is not refused; other ranks' files are left to gc.
                self._clean_up(self._executor.written)
            # Any other rank handed its files' records to the coordinator, which may have committed a manifest
            # listing them before the exchange failed (spec/commit.md COM-19): they are never deleted here.
            # An uncommitted save's leftovers are the coordinator's to delete, or gc's.
            raise
        return str(status["checkpoint_id"])


def _base_index(
    store: Store,
    base: Checkpoint | str | os.PathLike[str] | None,
    frozen: Collection[str],
    content: RawDigests | None,
) -> BaseIndex | None:
    """The base's chunks, read from its manifest (opened beside ``store``, with its credentials, from a URL)."""
    if base is None:
        if frozen:
            raise UsageError("frozen= names tensors unchanged since a base: give base= too")
        return None
    from .reader import Checkpoint, open_store_checkpoint

    if isinstance(base, Checkpoint):
        return BaseIndex(base, store, frozen=frozen, content=content)
    url = os.fspath(base).rstrip("/")
    sibling = store.sibling(url.rpartition("/")[2] if "/" in url else url)
    expected = os.path.abspath(url) if store.capabilities.local and "://" not in url else url
    if "/" in url and sibling.url.rstrip("/") != expected.rstrip("/"):
        raise UsageError(f"the base {url} must be a checkpoint beside {store.url} (in the same run directory)")
    with open_store_checkpoint(sibling) as opened:
        return BaseIndex(opened, store, frozen=frozen, content=content)


def _rank_result(rank: int, data: bytes) -> RankResult:
    """A rank's report, parsed as the hostile input it may be: a CheckpointError naming the rank, never a raw one."""
    status = decode_status(data)  # raises the rank's own error if it reported one
    raw = status.get("result")
    if not isinstance(raw, str):
        raise CollectiveError(f"rank {rank} reported success without its result")
    result = RankResult.from_bytes(raw.encode("utf-8"))
    if result.rank != rank:
        raise CollectiveError(f"rank {rank} reported the result of rank {result.rank}")
    return result


def _first_status(gathered: list[bytes]) -> bytes:
    """The first failure among every rank's statuses, else the first success (the coordinator's decision)."""
    for rank, data in enumerate(gathered):
        try:
            decode_status(data)
        except CheckpointError as exc:
            return encode_status(exc.locate(path=f"rank {rank}"))
    for data in gathered:
        status = decode_status(data)
        if status.get("checkpoint_id"):
            return data
    return gathered[0]


def _files_of(rank: int, files: object) -> RankResult:
    """A rank's file records from the coordinator's merged status."""
    if not isinstance(files, dict) or not isinstance(files.get(str(rank)), list):
        raise CollectiveError(f"the coordinator sent no file list for rank {rank}")
    return RankResult(
        rank=rank,
        files=tuple(
            FileRecord(path=str(f["path"]), size=int(f["size"]), digest=str(f["digest"])) for f in files[str(rank)]
        ),
    )


def _check_visible(store: Store, results: list[RankResult], *, leader: int = COORDINATOR) -> None:
    """Every file a rank reported is there, at its size, for the coordinator (spec/commit.md COM-21).

    Ranks whose storage is not shared (a per-node local directory) each write successfully, and a manifest
    committed from their reports alone would list files the coordinator's storage does not hold. One
    listing, not one request per file (a thousand ranks' files on an object store).
    """
    present = store.list()
    for result in results:
        for record in result.files:
            size = present.get(record.path)
            if size is None:
                raise MissingFileError(
                    f"rank {result.rank} wrote it, but the coordinator does not see it: do all ranks write to "
                    "the same storage?",
                    path=record.path,
                    requirement="COM-21",
                )
            if size != record.size:
                raise SizeMismatchError(
                    f"is {size} bytes for the coordinator, rank {result.rank} reported {record.size}",
                    path=record.path,
                    requirement="COM-21",
                )
            if result.rank != leader and size <= RECHECK_BYTES:
                # Small files (context blobs, small data files) cost a read each: their digests are checked too.
                # Larger data files' digests are the ranks' word; re-reading them would double a save's I/O.
                got = digest_of(algorithm_of(record.digest), store.read(record.path, max_size=RECHECK_BYTES))
                if got != record.digest:
                    raise DigestMismatchError(
                        f"hashes to {got} for the coordinator, rank {result.rank} reported {record.digest}",
                        path=record.path,
                        requirement="COM-21",
                    )
