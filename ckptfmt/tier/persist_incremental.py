"""An incremental persist: a memory snapshot re-written into the run directory, referencing what is unchanged.

A plain persist (:func:`~ckptfmt.tier.persist.persist`) copies a slot byte for byte, so the durable checkpoint is
the snapshot (spec/memory.md, MEM-7). With ``incremental=True`` a durable save from memory does what a direct
incremental save does (spec/references.md): its chunks that equal the chunks of the previous durable checkpoint
(the run directory's ``latest``, when its step is older) are referenced there, not written again. The snapshot is
read from its slot chunk by chunk, every chunk's digest checked (MEM-1), and written by a
:class:`~ckptfmt.writer.CheckpointWriter` opened on that base, with the snapshot's metadata, the chain's depth
(:mod:`ckptfmt.chain`) and a provenance whose ``converted_from`` names the snapshot, as a persist re-encoded with a
codec does: the durable checkpoint has a checkpoint id of its own (MEM-7).

Every ``full_every``-th durable save is self-contained; without a codec it is the plain byte-for-byte copy, which
keeps the snapshot's id. A base that cannot be opened makes the save a full one, with a warning.

One node only: a snapshot spread over several nodes' slots is persisted by every rank at once
(:func:`~ckptfmt.tier.persist.persist_spread`), which copies; the manager refuses ``incremental=True`` there.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Collection

from ..chain import SINCE_FULL, depth_of, next_depth
from ..convert.native import reencoded_provenance
from ..errors import CheckpointError, CheckpointExistsError
from ..incremental import RawDigests, log_referenced
from ..manifest import Manifest
from ..manifest_io import read_manifest_bytes
from ..manifest_parse import parse_manifest
from ..reader import Checkpoint, open_checkpoint
from ..run import RunDirectory, step_of
from ..storage import open_store
from ..writer import CheckpointWriter
from .persist import Persisted, Throttle, advance_latest, persist, persisted_since, rewritten_status, snapshot_source

log = logging.getLogger("ckptfmt")


class IncrementalPersist:
    """Persists one node's committed slots as incremental durable checkpoints (a
    :class:`~ckptfmt.torch.persist_queue.CopySlot`: ``copy(source, run, *, throttle, codec)``).

    It remembers the raw digests of the encoded chunks it wrote last (with a codec), so that the next persist can
    reference unchanged encoded chunks after one hash, as the durable engine does (``base_content``).
    """

    def __init__(self, *, full_every: int, frozen: Collection[str] = ()) -> None:
        self.full_every = full_every
        self.frozen = frozenset(frozen)
        self._lock = threading.Lock()  # the persist thread and a SIGTERM's copy may both persist
        self._content: RawDigests | None = None

    def __call__(self, source: str, run: RunDirectory, *, throttle: Throttle, codec: str | None) -> Persisted:
        started = time.perf_counter()
        src, manifest, snapshot_id, step, name = snapshot_source(source, None, run)
        destination = run.child_url(name)
        base, depth = self.base_for(run, step)
        if base is None and codec in (None, "raw"):
            return persist(source, run, throttle=throttle)  # a full one: the snapshot itself, byte for byte
        found = rewritten_status(destination, run, snapshot_id)
        if found is not None:
            status, ckpt_id = found
            return persisted_since(started, src, destination, name, step, ckpt_id, status)
        with self._lock:
            content = self._content
        try:
            ckpt_id, written, content = self._rewrite(
                source, run, name, manifest, base, depth, codec=codec, content=content, throttle=throttle
            )
        except CheckpointExistsError:  # written meanwhile by another process: look again
            return self(source, run, throttle=throttle, codec=codec)
        with self._lock:
            self._content = content
        advance_latest(run, name, step, ckpt_id)
        return persisted_since(started, src, destination, name, step, ckpt_id, "persisted", written)

    def base_for(self, run: RunDirectory, step: int) -> tuple[str | None, int]:
        """The base of the durable save of ``step`` and its depth: the run directory's ``latest`` when it is an
        older step and the chain may grow (:func:`~ckptfmt.chain.next_depth`); else (None, 0), a full save."""
        latest = run.latest()
        name = latest.get("name") if latest is not None else None
        base_step = step_of(name) if isinstance(name, str) else None
        if name is None or base_step is None or base_step >= step or self.full_every <= 1:
            return None, 0
        try:
            base = parse_manifest(read_manifest_bytes(open_store(run.child_url(name), run.storage_options)))
        except CheckpointError as exc:
            log.warning("%s: persisting step %d in full, its base cannot be read: %s", run.url, step, exc)
            return None, 0
        following = next_depth(depth_of(base.metadata, referencing=bool(base.bases)), self.full_every)
        return (None, 0) if following is None else (run.child_url(name), following)

    def _rewrite(
        self,
        source: str,
        run: RunDirectory,
        name: str,
        manifest: Manifest,
        base: str | None,
        depth: int,
        *,
        codec: str | None,
        content: RawDigests | None,
        throttle: Throttle,
    ) -> tuple[str, int, RawDigests | None]:
        """Write the snapshot at ``source`` as the run directory's ``name`` on ``base``; its checkpoint id, the bytes
        it stored, and the raw digests of its encoded chunks (for the next save's ``base_content``)."""
        store = open_store(run.child_url(name), run.storage_options)
        with open_checkpoint(source) as ckpt:

            def writer_on(base: str | None, depth: int) -> CheckpointWriter:
                return CheckpointWriter(
                    store,
                    profile=ckpt.profile,
                    digest=manifest.digest_algorithm,
                    codec=codec,
                    metadata={**manifest.metadata, SINCE_FULL: str(depth)},
                    base=base,
                    frozen=self.frozen if base is not None else (),
                    base_content=content if base is not None else None,
                    before_replace=functools.partial(run.check_replaceable, name),
                )

            try:
                writer = writer_on(base, depth)
            except CheckpointError as exc:
                if base is None or isinstance(exc, CheckpointExistsError):
                    raise
                log.warning("%s: persisting in full, the base %s cannot be used: %s", name, base, exc)
                base = None
                writer = writer_on(None, 0)
            try:
                _copy_into(writer, ckpt, manifest, throttle)
                ckpt_id = writer.commit()
            except BaseException:
                writer.abort()
                raise
            log_referenced(name, base, writer.referenced)
            raw = (ckpt_id, writer.raw_digests)
        stored = parse_manifest(read_manifest_bytes(store))
        return ckpt_id, sum(f.size for f in stored.files), raw


def _copy_into(writer: CheckpointWriter, ckpt: Checkpoint, manifest: Manifest, throttle: Throttle) -> None:
    """Every tensor (chunk by chunk, as the snapshot holds them) and context of ``ckpt`` into ``writer``, each
    chunk's digest checked as it is read; the provenance names the snapshot (``converted_from``)."""
    for fname, record in manifest.fields.items():
        if record.kind == "tensors":
            writer.write_tensors(fname, {})
        for tname, tensor in record.tensors.items():
            whole = len(tensor.chunks) == 1
            for chunk in tensor.chunks:
                started = time.perf_counter()
                if whole:
                    writer.write_tensor(fname, tname, ckpt.read_tensor(fname, tname))
                else:
                    data = ckpt.read_slice(fname, tname, chunk.offsets, chunk.shape)
                    writer.write_tensor(fname, tname, data, global_shape=tensor.shape, offsets=chunk.offsets)
                throttle.after(time.perf_counter() - started)
        if record.context is not None and fname != "provenance":
            writer.write_context(fname, ckpt.read_context(fname))
    writer.write_context("provenance", reencoded_provenance(ckpt))
