"""The trainer's checkpoint manager: save by step, retention, restore the newest good one, async and preemption saves.

Call sequence in a training loop::

    loader = ResumableDataLoader(dataset, batch_size=32, seed=1234, num_workers=4)
    mgr = CheckpointManager(run_url, keep_last=3, async_save=True, loader=loader)
    step = mgr.restore_latest(model=m, optimizer=o) or 0
    while step < total:
        for batch in loader:
            ...one optimizer step...; step += 1
            mgr.checkpoint_if_due(step, every=100, model=m, optimizer=o, config=cfg)
    mgr.wait()

(A custom loader passes ``sampler=`` a :class:`ResumableSampler` instead, and calls ``sampler.advance()``.)

An async save captures on the caller's thread only what the next forward pass may change (RNG,
data position, config, model buffers such as batch-norm statistics, scheduler); parameters and
optimizer state, which only ``optimizer.step()`` changes, are copied into reusable host buffers by a
background thread while the next forward and backward run, and an optimizer step pre-hook holds the
next ``step()`` until that copy is done. The background thread then writes the checkpoint. At most
one save is in flight, and a background failure is raised by the next call into the manager —
never swallowed. Contract: between ``save()`` and the next ``optimizer.step()``, the trainer must
not change parameters or optimizer state in place by other means.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from types import FrameType
from typing import Any

import torch

from .. import provenance as prov
from ..collective import Collective, PeerChannel
from ..decide import decide
from ..errors import CheckpointError, MalformedMessageError, UsageError
from ..incremental import RawDigests
from ..jsonio import load_json
from ..manifest_parse import parse_manifest
from ..reader import Checkpoint, open_checkpoint
from ..run import RunDirectory, checkpoint_name
from ..storage import open_store
from ..tier.agreed import AgreedRestore, Fetched
from ..tier.persist import Persisted
from ..tier.replica import RoundResult
from ..writer import CheckpointWriter
from . import api, read_state, sharding, state
from .api import Policy
from .memory import MemorySnapshots
from .restore_report import Candidate, RestoreReport, estimated_state_bytes
from .state import HostBuffers, Snapshot

log = logging.getLogger("ckptfmt")
SINCE_FULL = "ckptfmt.incremental.since_full"  # manifest metadata: saves since the last self-contained one
MAX_REPORT_BYTES = 1 << 20  # one rank's restore report (its skipped list names each checkpoint passed over)
_PLAIN_NAME = re.compile(r"[^/\\\x00]{1,255}")  # one path segment


class CheckpointManager:
    def __init__(
        self,
        run_url: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        on_mismatch: Policy | None = None,
        loader: Any = None,
        process_group: Any = None,
        collective: Collective | None = None,
        preemption_signals: Sequence[signal.Signals] = (signal.SIGTERM,),
        exit_on_preemption: bool = True,
        verify_on_restore: bool = False,
        codec: str | None = None,
        memory_every: int = 0,
        memory_dir: str | os.PathLike[str] | None = None,
        memory_slots: int = 2,
        persist_duty: float = 0.5,
        replicate: bool = False,
        peer_timeout: float = api.DEDICATED_TIMEOUT.total_seconds(),
        incremental: bool = False,
        full_every: int = 10,
        frozen: Collection[str] = (),
        close_timeout: float | None = None,
    ) -> None:
        if memory_every < 0:
            raise UsageError("memory_every must be 0 (off) or a number of steps")
        if full_every < 1:
            raise UsageError("full_every must be at least 1 (1: every save is full)")
        if frozen and not incremental:
            raise UsageError("frozen= names tensors an incremental save references unhashed: give incremental=True")
        self.run = RunDirectory(run_url, storage_options)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        # config/code/dataset differences warn by default; a data position that would repeat data is refused
        # by default (on_mismatch="warn" or "ignore" lets it through)
        self.on_mismatch: Policy = on_mismatch or "warn"
        self.data_policy: Policy = on_mismatch or "strict"
        self.loader = loader
        # Several ranks (torch.distributed initialized, or an explicit collective): every rank calls the same
        # methods together; each writes its shards, rank 0 keeps the run directory, and a restore agrees.
        self.collective: Collective | None = collective if collective is not None else api._collective(process_group)
        self._step: int | None = None  # the step of the last restore or save: did steps pass since?
        self.exit_on_preemption = exit_on_preemption
        self.verify_on_restore = verify_on_restore
        self.codec = codec  # None: raw; "zstd" / "zstd:LEVEL" compresses floating tensors (spec/codecs.md)
        # Incremental durable saves (spec/references.md): a save references the chunks of the previous durable
        # checkpoint that it would write unchanged; every full_every-th save is self-contained, so a damaged
        # base costs at most full_every saves and a chain of references never grows without bound.
        self.incremental = incremental
        self.full_every = full_every
        self.frozen = frozenset(frozen)
        self._base: tuple[str, int] | None = None  # (name, saves since the last full one) of the newest durable save
        self._base_content: RawDigests | None = None  # its encoded chunks' raw digests, when this process wrote it
        self.last_checkpoint_id: str | None = None
        # The code that runs is the code at start: look its git state up once, not on every (stalling) save.
        self._code: dict[str, object] = prov.git_state() or {}
        self._buffers = HostBuffers()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-async") if async_save else None
        self._inflight: Future[str] | None = None
        self._gate: Any = None  # the optimizer step pre-hook of the async save in flight
        self.held_seconds = 0.0  # total time optimizer.step() waited for an async save's copy
        self._inflight_name: str | None = None
        self._preempted = threading.Event()
        self.memory_every = memory_every
        self.last_restore: RestoreReport | None = None
        self._agreed: AgreedRestore | None = None  # the restore across nodes in progress
        self._agree_seconds = 0.0
        self._memory: MemorySnapshots | None = None
        if memory_every:
            # its own process group: snapshots commit from a background thread, while the trainer's thread
            # runs the model's collectives on the default group
            timeout = timedelta(seconds=peer_timeout)
            dedicated = (
                collective
                if collective is not None
                else api._collective(process_group, dedicated=True, timeout=timeout)
            )
            channel = collective if isinstance(collective, PeerChannel) else None
            if replicate and collective is None:  # its own group again: replica rounds run beside snapshots
                channel = api._collective(process_group, dedicated=True, timeout=timeout, purpose="replica")
            self._memory = MemorySnapshots(
                self.run,
                memory_dir=memory_dir,
                slots=memory_slots,
                collective=dedicated,
                persist_duty=persist_duty,
                codec=codec,
                on_persisted=self._on_persisted,
                replicate=replicate,
                channel=channel,
                write_durable=self._write_durable,
                close_timeout=close_timeout,
            )
        self._previous_handlers: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in preemption_signals:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
            if self._memory is not None:
                self._memory.start_watcher(tuple(preemption_signals))
        if self._memory is not None:
            atexit.register(self._at_exit)  # an interpreter that exits normally persists the newest snapshot

    def _at_exit(self) -> None:
        # Several nodes: a persist needs every rank, and an interpreter that exits may be one whose peers are
        # gone (it would wait out the peer timeout): the snapshot and its replicas stay in memory instead.
        spread = self._memory is not None and self._memory.nodes.multi_node
        try:
            self.close(persist=not spread)
        except Exception:  # at exit nothing can be raised to; the snapshot stays in memory for `ckpt rescue`
            log.exception("the newest memory snapshot could not be persisted at exit")

    # ---------------------------------------------------------------- preemption

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: the step in progress finishes, then checkpoint_if_due saves and exits.
        log.warning("signal %d received: an emergency checkpoint will be written after this step", signum)
        self._preempted.set()

    @property
    def preempted(self) -> bool:
        return self._preempted.is_set()

    def request_preemption(self) -> None:
        self._preempted.set()

    def checkpoint_if_due(self, step: int, *, every: int, **state_objects: Any) -> bool:
        """Save when ``step`` is a multiple of ``every``, or at once after a preemption signal.

        After a preemption save the manager waits until it is durable and, unless told otherwise,
        exits the process cleanly (``SystemExit(0)``).
        """
        preempted = self.preempted
        if self._memory is not None:
            return self._memory_checkpoint_if_due(step, every, preempted, state_objects)
        if not preempted and step % every:
            self._raise_background_error()
            return False
        self.save(step, **state_objects)
        if preempted:
            self.wait()
            log.warning("emergency checkpoint at step %d is durable", step)
            if self.exit_on_preemption:
                self.close()
                raise SystemExit(0)
        return True

    def _memory_checkpoint_if_due(self, step: int, every: int, preempted: bool, state_objects: Any) -> bool:
        """Memory tier: a snapshot every ``memory_every`` steps, persisted every ``every`` steps; after a
        preemption signal, one at once, persisted before the process exits."""
        assert self._memory is not None
        durable = step % every == 0
        if not (preempted or durable or step % self.memory_every == 0):
            self._memory.raise_background_error()
            return False
        self._snapshot(step, persist=durable or preempted, **state_objects)
        if preempted:
            self.wait()
            log.warning("emergency checkpoint at step %d is durable (from memory)", step)
            if self.exit_on_preemption:
                self.close()
                raise SystemExit(0)
        return durable

    def _snapshot(
        self,
        step: int,
        *,
        persist: bool,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: object,
        sampler: Any = None,
        loader: Any = None,
        **kwargs: Any,
    ) -> None:
        """A memory snapshot of the full training state (persisted afterwards when ``persist``)."""
        assert self._memory is not None
        self._memory.wait_snapshot()
        newest = self._memory.newest
        if newest is not None:
            self.last_checkpoint_id = newest[2]
            if newest[1] == step == self._step:  # this step is in a slot already (a save() after checkpoint_if_due)
                if persist:
                    self._memory.persist_slot(newest[0])
                return
        snap = self._capture(step, model, optimizer, config, sampler, loader, defer=True, **kwargs)
        self._step = step
        self._memory.snapshot(snap, optimizer, persist=persist)

    def _capture(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: object,
        sampler: Any,
        loader: Any,
        *,
        defer: bool,
        buffers: HostBuffers | None = None,
        **kwargs: Any,
    ) -> Snapshot:
        """The training state at ``step`` (the data position from ``loader``/``sampler``, else the manager's)."""
        if sampler is None and loader is None:
            loader = self.loader
        return api.capture(
            step=step,
            model=model,
            optimizer=optimizer,
            sampler=sampler,
            loader=loader,
            config=config,
            data_policy=self.data_policy,
            steps_passed=step > (self._step or 0),
            parent=self.last_checkpoint_id,
            buffers=buffers,
            code=self._code,
            defer=defer,
            **kwargs,
        )

    def _on_persisted(self, done: Persisted) -> None:
        """Rank 0's persist thread, after a memory snapshot became a durable checkpoint: retention."""
        if done.status == "persisted":
            self.run.gc(keep_last=self.keep_last, keep_every=self.keep_every, protect={done.name})

    def wait_replica(self) -> RoundResult | None:
        """Block until the memory snapshot in flight is committed and this rank's part of its replica round is
        done (sent to its partner, received from its sources); the round's result, None without replicas."""
        if self._memory is None:
            return None
        self._memory.wait_replica()
        return self._memory.replicator.last if self._memory.replicator is not None else None

    def wait_memory(self) -> None:
        """Block until the memory snapshot in flight is committed in its slot (not persisted)."""
        if self._memory is not None:
            self._memory.wait_snapshot()
            if self._memory.newest is not None:
                self.last_checkpoint_id = self._memory.newest[2]

    # ---------------------------------------------------------------- save

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: object,
        sampler: Any = None,
        loader: Any = None,
        **kwargs: Any,
    ) -> None:
        """Checkpoint the full training state at ``step`` (waits for a previous async save first).

        The data position comes from ``loader=`` (default: the manager's ``loader``) or ``sampler=``.
        With the memory tier (``memory_every``), the state goes to a memory slot and is persisted from there
        in the background (:meth:`wait` waits for it).
        """
        if self._memory is not None:
            self._snapshot(
                step,
                persist=True,
                model=model,
                optimizer=optimizer,
                config=config,
                sampler=sampler,
                loader=loader,
                **kwargs,
            )
            return
        self.wait()
        buffers = self._buffers if self.async_save else None
        snap = self._capture(
            step, model, optimizer, config, sampler, loader, defer=self.async_save, buffers=buffers, **kwargs
        )
        name = checkpoint_name(step)
        self._step = step
        if self._pool is None:
            self._persist(name, step, snap, group=self.collective)
            return
        # Parameters and optimizer state change only in optimizer.step(): they are copied in the
        # background while the next forward and backward run, and the next step waits for the copy.
        copied = threading.Event()

        def hold_step(opt: Any, args: Any, kwargs: Any) -> None:
            if not copied.is_set():
                start = time.perf_counter()
                copied.wait()
                self.held_seconds += time.perf_counter() - start

        self._gate = optimizer.register_step_pre_hook(hold_step)
        self._inflight_name = name
        self._inflight = self._pool.submit(self._copy_and_persist, name, step, snap, copied)

    def _copy_and_persist(self, name: str, step: int, snap: Snapshot, copied: threading.Event) -> str:
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
            copied.set()  # even on failure: never leave the trainer's optimizer blocked
        return self._persist(name, step, snap, group=self.collective, problem=problem)

    def _write_durable(self, step: int, snap: Snapshot, problem: CheckpointError | None) -> None:
        """The memory tier's background thread, on every rank together: a durable save fell due at a step whose memory
        snapshot was not taken, so ``snap`` (that step's state) is written straight to the run directory, as a save
        without the memory tier is, over the memory tier's own process group. ``problem``: this rank's state could
        not be taken, which fails the save on every rank."""
        assert self._memory is not None
        self._persist(checkpoint_name(step), step, snap, group=self._memory.collective, problem=problem)

    def _persist(
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

        def writer_on(base: str | None, depth: int) -> CheckpointWriter:
            return CheckpointWriter(
                store,
                profile="training",
                overwrite=True,
                collective=group,
                codec=self.codec,
                base=base,
                frozen=self.frozen if base is not None else (),
                metadata={SINCE_FULL: str(depth)} if self.incremental else None,
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
        self._base_content = (ckpt_id, writer.raw_digests) if self.incremental else None
        referenced = writer.referenced
        if referenced is not None:
            log.info(
                "%s: %d bytes referenced in %s (%d chunks), not written",
                name,
                referenced.bytes,
                base,
                referenced.chunks,
            )
        self.last_checkpoint_id = ckpt_id
        if self._is_coordinator:
            self.run.set_latest(name, step, ckpt_id)
            self.run.gc(keep_last=self.keep_last, keep_every=self.keep_every, protect={name})
        return ckpt_id

    def _base_for(self, name: str) -> tuple[str | None, int]:
        """The base of the next durable save and its depth (saves since the last full one, 0: this one is full).

        The newest durable checkpoint this manager saved or restored, the same on every rank (saves commit
        collectively), so all ranks reference one base without asking storage."""
        if not self.incremental or self._base is None or self._base[0] == name:
            return None, 0
        base_name, depth = self._base
        if depth + 1 >= self.full_every:
            return None, 0
        return self.run.child_url(base_name), depth + 1

    @property
    def _is_coordinator(self) -> bool:
        return self.collective is None or self.collective.rank == 0

    def _agree(self, ok: bool) -> bool:
        """Whether every rank can use the checkpoint at hand (one rank's failure fails it for all; a rank whose vote
        is not a boolean is named in the error every rank raises)."""

        def all_yes(votes: Sequence[object]) -> bool:
            for rank, vote in enumerate(votes):
                if not isinstance(vote, bool):
                    raise MalformedMessageError(f"rank {rank} voted {str(vote)[:40]} on a checkpoint, not a boolean")
            return all(votes)

        verdict = decide(self.collective, ok, all_yes, what="whether every rank can use the checkpoint", max_size=64)
        if not isinstance(verdict, bool):
            raise MalformedMessageError(f"rank 0 decided {str(verdict)[:40]} on a checkpoint, not a boolean")
        return verdict

    def _candidates(self) -> list[tuple[str, int | None, str]]:
        """(name, step, status) of the run's checkpoints, newest first: rank 0's listing, on every rank (each entry
        checked alike on every rank: a name is one plain path segment of the run directory)."""

        def listing(_: Sequence[object]) -> list[list[object]]:
            return [[e.name, e.step, e.status] for e in self.run.entries()]

        decided = decide(self.collective, None, listing, what="the run directory's checkpoints", max_size=64)
        if not isinstance(decided, list):
            raise MalformedMessageError("rank 0 sent a malformed listing of the run directory")
        out: list[tuple[str, int | None, str]] = []
        for entry in decided:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise MalformedMessageError(f"rank 0 sent a malformed run directory entry: {str(entry)[:80]}")
            name, step, status = entry
            if not isinstance(name, str) or _PLAIN_NAME.fullmatch(name) is None or name in (".", ".."):
                raise MalformedMessageError(f"rank 0 sent a run directory entry named {str(name)[:80]!r}")
            if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
                raise MalformedMessageError(f"rank 0 sent step {str(step)[:40]} for {name}")
            if not isinstance(status, str) or len(status) > 64:
                raise MalformedMessageError(f"rank 0 sent a malformed status for {name}")
            out.append((name, step, status))
        return out

    def wait(self) -> str | None:
        """Block until the save in flight is durable; raise its error if it failed."""
        if self._memory is not None:
            self._memory.wait()
            if self._memory.newest is not None:
                self.last_checkpoint_id = self._memory.newest[2]
            return self.last_checkpoint_id
        future, self._inflight = self._inflight, None
        self._inflight_name = None
        if future is None:
            return self.last_checkpoint_id
        try:
            return future.result()
        finally:
            if self._gate is not None:  # removed here, on the trainer's thread, never while step() runs
                self._gate.remove()
                self._gate = None

    def _raise_background_error(self) -> None:
        if self._memory is not None:
            self._memory.raise_background_error()
        if self._inflight is not None and self._inflight.done():
            self.wait()

    # ---------------------------------------------------------------- restore

    def restore_latest(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: Any = None,
        loader: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        config: object = None,
        generators: Any = None,
        skip_fields: Sequence[str] = (),
    ) -> int | None:
        """Resume from the newest checkpoint that is complete, reads and verifies; returns its step, or None.

        A checkpoint that cannot be opened or read whole (a corrupt chunk, an unreadable tensor, a context
        failing its schema) or lacks a field this resume needs (a ``weights``-profile checkpoint) is
        skipped with a WARNING naming why, and the next older one is tried. Nothing is applied until a
        checkpoint was read and checked whole, and then all of it or nothing (see :func:`api.apply`).
        ``loader=`` (default: the manager's ``loader``) or ``sampler=`` takes the data position back.
        ``skip_fields`` (``rng``, ``data``, ``optimizer``) are read and verified but not applied, e.g. to
        fine-tune with a fresh optimizer, or as a negative control showing that a resume needs them.
        """
        self.wait()
        started = time.perf_counter()
        if sampler is None and loader is None:
            loader = self.loader
        source = api.data_source(sampler=sampler, loader=loader)
        if self._memory is not None and optimizer is not None:
            self._memory.check_capacity(estimated_state_bytes(model, optimizer))
        skipped: list[str] = []
        for candidate in self._all_candidates():
            entry_name, entry_step, status, url = candidate.label, candidate.step, candidate.status, candidate.url
            if status != "committed":
                log.warning("skipping %s: %s", entry_name, status)
                skipped.append(f"{entry_name}: {status}")
                continue
            # Only a checkpoint that cannot be read, verified or used as a resume is skipped. Once it is in
            # memory, whole and verified, a refusal to apply it (a mismatch under "strict", a model of another
            # shape, a sampler with another seed) is the caller's to see: falling back to an older checkpoint,
            # or to none, would silently train something else. With several ranks, a checkpoint that one rank
            # cannot read is skipped by all: the job never splits over two checkpoints.
            snap: Snapshot | None = None
            fetched: Fetched | None = None
            if candidate.option is not None:  # spread over nodes: gather what this node lacks (all ranks, together)
                assert self._agreed is not None
                try:
                    manifest = parse_manifest(candidate.option.manifest_bytes)
                    needed = read_state.files_needed(manifest, read_state.load_targets(model))
                    fetched = self._agreed.fetch(candidate.option, needed)
                except CheckpointError as exc:  # the same error on every rank: all pass over it together
                    log.warning("skipping %s: its files could not be gathered: %s", entry_name, exc)
                    skipped.append(f"{entry_name}: {type(exc).__name__}: {exc}")
                    continue
            read_started = time.perf_counter()
            # Open until its snapshot is applied: tensors loaded in place are copied in from it then (in_place.py).
            # Not for files fetched from other nodes: this node's leader deletes them after the vote, before then.
            held = contextlib.ExitStack()
            live = api.live_targets(model, optimizer, skip_fields) if fetched is None else None
            try:
                ckpt = held.enter_context(
                    Checkpoint(fetched.store, manifest, candidate.option.manifest_bytes)
                    if fetched is not None and candidate.option is not None
                    else open_checkpoint(url, self.run.storage_options)
                )
                report = ckpt.verify() if self.verify_on_restore else None
                if report is not None and not report.ok:
                    log.warning("skipping %s: %s", entry_name, "; ".join(map(str, report.problems[:3])))
                else:
                    snap = read_state.read_snapshot(ckpt, read_state.load_targets(model), live)
                    ckpt_id, ckpt_url, profile = ckpt.id, ckpt.url, ckpt.profile
                    # a self-contained checkpoint is a full save whoever wrote it
                    depth = _since_full(ckpt.manifest.metadata) if ckpt.manifest.bases else 0
                    bytes_read = ckpt.bytes_read
            except Exception as exc:  # reading touches nothing live: whatever fails, it is "not this one"
                held.close()
                log.warning("skipping %s: cannot be read: %s: %s", entry_name, type(exc).__name__, exc)
                skipped.append(f"{entry_name}: {type(exc).__name__}: {exc}")
            missing = (
                api.missing_fields(
                    snap,
                    optimizer=None if "optimizer" in skip_fields else optimizer,
                    sampler=None if "data" in skip_fields else source,
                    scheduler=scheduler,
                    scaler=scaler,
                    restore_rng="rng" not in skip_fields,
                )
                if snap is not None
                else []
            )
            if missing:
                log.warning(
                    "skipping %s: it has no %s field (profile %r), which this resume needs",
                    entry_name,
                    ", ".join(missing),
                    profile,
                )
            agreed = self._agree(snap is not None and not missing)
            if fetched is not None and self._agreed is not None:
                self._agreed.clean_up()  # every rank has read what was fetched (or passed over it)
            if not agreed:
                if snap is not None:
                    snap.discard()  # checked here, refused elsewhere: not copied in, so not kept in the page cache
                held.close()
                if snap is not None and not missing:
                    log.warning("skipping %s: another rank cannot use it", entry_name)
                    skipped.append(f"{entry_name}: another rank cannot use it")
                continue
            assert snap is not None
            read_seconds = time.perf_counter() - read_started
            with held:
                restored = api.restore(
                    snap,
                    checkpoint_id=ckpt_id,
                    url=ckpt_url,
                    model=model,
                    optimizer=optimizer,
                    sampler=source,
                    scheduler=scheduler,
                    scaler=scaler,
                    config=config,
                    generators=generators,
                    on_mismatch=self.on_mismatch,
                    skip_fields=skip_fields,
                )
            if snap.copy_in is not None:
                bytes_read = ckpt.bytes_read  # with the second pass of the tensors loaded in place
            self.last_checkpoint_id = restored.checkpoint_id
            self._step = restored.step if restored.step is not None else entry_step
            if candidate.tier == "durable" and self.incremental:
                self._base = (entry_name, depth)
            now = api.topology()
            live_mesh, _ = sharding.placements(model)  # the mesh the model is sharded on now, as a save records it
            if live_mesh:
                now.setdefault("mesh", live_mesh)
            _log_topology_change(entry_name, snap.contexts.get("topology", {}), now)
            if self._memory is not None:
                self._memory.restored(self._step if self._step is not None else -1, candidate.memory)
            sources = fetched.sources() if fetched is not None else {}
            tier = candidate.tier
            if fetched is not None and any(v.startswith("peer") for v in sources.values()):
                tier = "peer"  # some of what this rank read came from another node's memory
            self.last_restore = RestoreReport(
                step=self._step,
                tier=tier,
                url=ckpt_url,
                checkpoint_id=ckpt_id,
                seconds=time.perf_counter() - started,
                bytes_read=bytes_read,
                skipped=tuple(skipped),
                sources=sources,
                bytes_between_nodes=fetched.bytes_moved if fetched is not None else 0,
                phases={
                    "agree": round(self._agree_seconds, 6),
                    "gather": round(fetched.seconds if fetched is not None else 0.0, 6),
                    "read": round(read_seconds, 6),
                    "apply": round(
                        time.perf_counter()
                        - started
                        - self._agree_seconds
                        - read_seconds
                        - (fetched.seconds if fetched is not None else 0.0),
                        6,
                    ),
                },
                held=tuple(h.to_summary() for h in self._agreed.held) if self._agreed is not None else (),
            )
            self._record_restore(self.last_restore)
            log.info(
                "restored step %s from %s (%s) in %.3f s, %d bytes read",
                self._step,
                tier,
                ckpt_url,
                self.last_restore.seconds,
                bytes_read,
            )
            return self._step
        return None

    def _record_restore(self, report: RestoreReport) -> None:
        """Every rank's report, gathered; rank 0 logs it and writes it beside the checkpoints (``ckpt ls`` shows it)."""
        mine = json.dumps(report.to_dict()).encode("utf-8")
        gathered = (
            self.collective.gather(mine, dst=0, max_size=MAX_REPORT_BYTES) if self.collective is not None else [mine]
        )
        if gathered is None:
            return
        ranks: list[object] = []
        for rank, data in enumerate(gathered):  # each rank's report, as hostile input: a bad one is recorded as such
            try:
                ranks.append(
                    load_json(
                        data, error=MalformedMessageError, what=f"the restore report of rank {rank}", allow_float=True
                    )
                )
            except CheckpointError as exc:
                ranks.append({"rank": rank, "error": str(exc)})
        doc = {**report.to_dict(), "ranks": ranks}
        log.info("restore report: %s", json.dumps(report.to_dict()))
        try:
            self.run.record_restore(doc)
        except CheckpointError as exc:  # a report is a record, not a reason to fail a restore that worked
            log.warning("the restore report could not be written: %s", exc)

    def _all_candidates(self) -> list[Candidate]:
        """Every checkpoint a restore may take, newest step first; at the same step, memory before durable."""
        found = [
            Candidate(label=name, step=step, status=status, url=self.run.child_url(name), tier="durable")
            for name, step, status in self._candidates()
        ]
        self._agreed, self._agree_seconds = None, 0.0
        if self._memory is not None and self._memory.across_nodes:
            started = time.perf_counter()
            self._agreed = self._memory.agreed()
            try:
                options = self._agreed.options()
            except CheckpointError as exc:  # the same error on every rank (ckptfmt.decide): all pass over memory
                log.warning("skipping the memory tier: its holdings could not be agreed on: %s", exc)
                options = []
            found += [
                Candidate(
                    label=f"memory step {o.step} ({o.checkpoint_id[:23]})",
                    step=o.step,
                    status="committed",
                    url=str(self._memory.tier.root),
                    tier="memory",
                    option=o,
                )
                for o in options
            ]
            self._agree_seconds = time.perf_counter() - started
        elif self._memory is not None:
            found += [
                Candidate(label=f"memory {c.url}", step=c.step, status="committed", url=c.url, tier="memory", memory=c)
                for c in self._memory.candidates()
            ]
        return sorted(found, key=lambda c: (c.step if c.step is not None else -1, c.tier == "memory"), reverse=True)

    # ---------------------------------------------------------------- housekeeping

    def pin(self, step: int) -> None:
        if self._is_coordinator:
            self.run.set_pinned(self.run.pinned() | {checkpoint_name(step)})

    def unpin(self, step: int) -> None:
        if self._is_coordinator:
            self.run.set_pinned(self.run.pinned() - {checkpoint_name(step)})

    def gc(self) -> list[str]:
        if not self._is_coordinator:
            return []
        protect = {self._inflight_name} if self._inflight_name else set()
        return [e.name for e in self.run.gc(keep_last=self.keep_last, keep_every=self.keep_every, protect=protect)]

    def close(self, *, persist: bool = True) -> None:
        """Wait for the save in flight, stop the background threads, restore signal handlers.

        With the memory tier, the newest snapshot is persisted first unless the run directory has it already
        (``persist=False``: leave it in memory only, as a crash would; ``ckpt rescue`` can still persist it). A wait
        for a durable copy still running (a restored snapshot's, say) is logged; ``close_timeout=`` (seconds, given
        to the constructor) bounds it, abandoning a copy that outlasts it, whose snapshot then stays in memory.
        """
        atexit.unregister(self._at_exit)
        try:
            if self._memory is None:  # the memory tier's close waits for its copies itself, saying so (bounded)
                self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            if self._memory is not None:
                self._memory.close(persist=persist)
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            self._previous_handlers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _all_ready(values: Sequence[object]) -> bool:
    """Every rank's state was captured: the save goes ahead (``decide`` only calls this when none failed)."""
    return True


def _since_full(metadata: Mapping[str, str]) -> int:
    """Saves since the last full one, as the checkpoint records it (unknown: as if full_every were reached)."""
    value = metadata.get(SINCE_FULL, "")
    return int(value) if value.isdigit() else 1 << 30


def _log_topology_change(name: str, saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Say so when a run resumes on another world size or mesh than it was saved on."""

    def shape(topology: Mapping[str, Any]) -> str:
        mesh = topology.get("mesh")
        dims = ""
        if isinstance(mesh, Mapping):
            dims = f" with mesh {dict(zip(mesh.get('dims', []), mesh.get('shape', []), strict=False))}"
        return f"{topology.get('world_size')} rank(s){dims}"

    if saved.get("world_size") != now.get("world_size") or saved.get("mesh") != now.get("mesh"):
        log.warning("resuming %s saved on %s on %s", name, shape(saved), shape(now))
