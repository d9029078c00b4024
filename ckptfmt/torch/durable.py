"""The durable save engine: checkpoints written into the run directory, at once, in the background, or incremental.

An async save captures on the caller's thread only what the next forward pass may change (RNG, data position,
config, model buffers such as batch-norm statistics, scheduler); parameters and optimizer state, which only
``optimizer.step()`` changes, are copied into reusable host buffers by a background thread while the next forward
and backward run, and an optimizer step pre-hook holds the next ``step()`` until that copy is done. The background
thread then writes the checkpoint. At most one save is in flight, and a background failure is raised by the next
call into the manager, never swallowed.

An incremental save (spec/references.md) references the chunks of the previous durable checkpoint that it would
write unchanged; every ``full_every``-th save is self-contained, so a damaged base costs at most ``full_every``
saves and a chain of references never grows without bound.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ..chain import SINCE_FULL, depth_of, next_depth
from ..chain import since_full as since_full  # its home was here
from ..codecs.xor_zstd import keyframe
from ..collective import Collective
from ..decide import decide
from ..errors import CheckpointError
from ..incremental import RawDigests, log_referenced
from ..run import RunDirectory, checkpoint_name
from ..storage import open_store
from ..writer import CheckpointWriter
from . import state
from .engines import Due, StepGate
from .options import DurableOptions, RetentionOptions
from .state import HostBuffers, Snapshot
from .training_state import Lineage, TrainingState

log = logging.getLogger("ckptfmt")


class DurableEngine:
    """Saves into the run directory (every rank of ``collective`` together; rank 0 keeps the run directory)."""

    def __init__(
        self,
        run: RunDirectory,
        *,
        collective: Collective | None,
        lineage: Lineage,
        retention: RetentionOptions,
        options: DurableOptions,
    ) -> None:
        self.run = run
        self.collective = collective
        self.lineage = lineage
        self.retention = retention
        self.options = options
        self._base: tuple[str, int] | None = None  # (name, saves since the last full one) of the newest durable save
        self._base_content: RawDigests | None = None  # its encoded chunks' raw digests, when this process wrote it
        self._buffers = HostBuffers()
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-async") if options.async_save else None
        )
        self._inflight: Future[str] | None = None
        self._inflight_name: str | None = None
        self._gate = StepGate()

    @property
    def held_seconds(self) -> float:
        return self._gate.held_seconds

    @property
    def is_coordinator(self) -> bool:
        return self.collective is None or self.collective.rank == 0

    def due(self, step: int, *, every: int, preempted: bool) -> Due:
        write = preempted or step % every == 0
        return Due(write=write, durable=write)

    def save(self, step: int, state: TrainingState, *, persist: bool = True) -> None:
        """Write ``state`` as the run directory's checkpoint of ``step`` (in the background with ``async_save``)."""
        self.wait()
        asynchronous = self._pool is not None
        snap = self.lineage.capture(step, state, defer=asynchronous, buffers=self._buffers if asynchronous else None)
        name = checkpoint_name(step)
        self.lineage.step = step
        if self._pool is None:
            self.write(name, step, snap, group=self.collective)
            return
        # Parameters and optimizer state change only in optimizer.step(): they are copied in the
        # background while the next forward and backward run, and the next step waits for the copy.
        assert state.optimizer is not None
        self._gate.close_on(state.optimizer)
        self._inflight_name = name
        self._inflight = self._pool.submit(self._copy_and_write, name, step, snap)

    def _copy_and_write(self, name: str, step: int, snap: Snapshot) -> str:
        problem: CheckpointError | None = None
        try:
            snap.materialize(self._buffers)
        except CheckpointError as exc:
            if self.collective is None:
                raise
            # the others are about to meet in the writer's collective calls: this rank opens the writer too and
            # aborts it, so that they fail now instead of waiting out the peer timeout (a SourceChangedError here
            # is one rank's in-place change)
            problem = exc
        finally:
            self._gate.open()  # even on failure: never leave the trainer's optimizer blocked
        return self.write(name, step, snap, group=self.collective, problem=problem)

    def write(
        self,
        name: str,
        step: int,
        snap: Snapshot,
        *,
        group: Collective | None,
        problem: CheckpointError | None = None,
    ) -> str:
        """Write ``snap`` as the run directory's ``name`` and commit it (every rank of ``group`` together);
        ``problem``, this rank's reason not to write it, fails it on every rank, before any rank starts writing."""
        if group is not None:
            # Every rank agrees first: a rank that stopped inside the writer's exchanges (its commit, the rng
            # gather) would leave the others out of step with it, each reading the other's messages as its own.
            decide(group, problem if problem is not None else True, _all_ready, what=f"the save of step {step}")
        elif problem is not None:
            raise problem
        store = open_store(self.run.child_url(name), self.run.storage_options)
        base, depth = self._base_for(name)
        incremental = self.options.incremental

        def writer_on(base: str | None, depth: int) -> CheckpointWriter:
            return CheckpointWriter(
                store,
                profile="training",
                overwrite=True,
                collective=group,
                codec=self.options.codec if base is not None else keyframe(self.options.codec),  # xor-zstd: zstd
                base=base,
                frozen=self.options.frozen if base is not None else (),
                metadata={SINCE_FULL: str(depth)} if incremental else None,
                base_content=self._base_content if base is not None else None,
                before_replace=functools.partial(self.run.check_replaceable, name),
            )

        try:
            writer = writer_on(base, depth)
        except CheckpointError as exc:
            if base is None:
                raise
            # the base cannot be opened (deleted by hand, unreadable): this save is a full one
            log.warning("%s: saving in full, the base %s cannot be used: %s", name, base, exc)
            base, depth = None, 0
            writer = writer_on(base, depth)
        try:
            ckpt_id = state.write_snapshot(writer, snap)
        except BaseException:
            writer.abort()
            raise
        self._base = (name, depth)
        self._base_content = (ckpt_id, writer.raw_digests) if incremental else None
        log_referenced(name, base, writer.referenced)
        self.lineage.last_checkpoint_id = ckpt_id
        if self.is_coordinator:
            self.run.set_latest(name, step, ckpt_id)
            self.gc(protect={name})
        return ckpt_id

    def gc(self, protect: set[str]) -> list[str]:
        """Retention (rank 0 only): the run directory's checkpoints that fell out of it, deleted; their names."""
        if not self.is_coordinator:
            return []
        keep_last, keep_every = self.retention.keep_last, self.retention.keep_every
        return [e.name for e in self.run.gc(keep_last=keep_last, keep_every=keep_every, protect=protect)]

    def adopt_base(self, name: str, metadata: Mapping[str, str], *, referencing: bool) -> None:
        """A restore took the run directory's ``name``: the next incremental save references it (its depth from the
        manifest's metadata when it references a base itself, 0 when it is self-contained)."""
        if self.options.incremental:
            self._base = (name, depth_of(metadata, referencing=referencing))

    def _base_for(self, name: str) -> tuple[str | None, int]:
        """The base of the next durable save and its depth (saves since the last full one, 0: this one is full).

        The newest durable checkpoint this manager saved or restored, the same on every rank (saves commit
        collectively), so all ranks reference one base without asking storage."""
        if not self.options.incremental or self._base is None or self._base[0] == name:
            return None, 0
        base_name, depth = self._base
        following = next_depth(depth, self.options.full_every)
        if following is None:
            return None, 0
        return self.run.child_url(base_name), following

    def wait(self) -> str | None:
        future, self._inflight = self._inflight, None
        self._inflight_name = None
        if future is None:
            return self.lineage.last_checkpoint_id
        try:
            return future.result()
        finally:
            self._gate.remove()  # here, on the trainer's thread, never while step() runs

    def raise_background_error(self) -> None:
        if self._inflight is not None and self._inflight.done():
            self.wait()

    def protected(self) -> set[str]:
        return {self._inflight_name} if self._inflight_name else set()

    def close(self, *, persist: bool = True) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self._gate.remove()


def _all_ready(values: Sequence[object]) -> bool:
    """Every rank's state was captured: the save goes ahead (``decide`` only calls this when none failed)."""
    return True
