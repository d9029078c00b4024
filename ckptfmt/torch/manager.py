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

The manager is a thin front over named parts, each in its own module:

- options in groups (:mod:`.options`: :class:`RetentionOptions`, :class:`DurableOptions`, :class:`MemoryOptions`,
  :class:`PreemptionOptions`, :class:`RestoreOptions`), given as such or through the keyword arguments; a
  combination that cannot work is refused here, naming the options;
- one save engine, chosen here (:mod:`.engines`): :class:`~.durable.DurableEngine` (sync, async, incremental) or,
  with ``memory_every``, :class:`~.memory_engine.MemoryEngine` (snapshots in node memory, persists, replicas);
- a :class:`~.restorer.Restorer` (candidates, the vote, fetch, apply, the report);
- what a save captures, as a :class:`~.training_state.TrainingState` record.

Contract of an async save or a memory snapshot: between ``save()`` and the next ``optimizer.step()``, the trainer
must not change parameters or optimizer state in place by other means (a change is detected and refused).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from types import FrameType
from typing import Any

import numpy as np
import torch

from ..collective import Collective
from ..errors import UsageError
from ..run import RunDirectory, checkpoint_name
from ..tier.binding import node_key
from ..tier.replica import RoundResult
from ..tier.ring import SlotRef
from . import api
from .api import Policy
from .durable import DurableEngine
from .engines import SaveEngine
from .guard import GuardError, GuardEvent, GuardOptions, GuardVerdict, StepGuard
from .memory import MemorySnapshots
from .memory_engine import MemoryEngine
from .options import DurableOptions, MemoryOptions, PreemptionOptions, RestoreOptions, RetentionOptions, resolve
from .replica_rounds import ReplicaLag
from .restore_report import RestoreReport
from .restorer import Restorer
from .snapshot import Snapshot
from .training_state import Lineage, Stateful, TrainingState

log = logging.getLogger("ckptfmt")


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
        loader: Stateful | None = None,
        process_group: object = None,
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
        replicas: int = 1,
        replica_rate: float | None = None,
        peer_timeout: float = api.DEDICATED_TIMEOUT.total_seconds(),
        incremental: bool = False,
        full_every: int = 10,
        frozen: Collection[str] = (),
        close_timeout: float | None = None,
        retention: RetentionOptions | None = None,
        durable: DurableOptions | None = None,
        memory: MemoryOptions | None = None,
        preemption: PreemptionOptions | None = None,
        restore: RestoreOptions | None = None,
        guard: GuardOptions | None = None,
    ) -> None:
        """Options come in groups (``retention=``, ``durable=``, ``memory=``, ``preemption=``, ``restore=``, see
        :mod:`ckptfmt.torch.options`), or as the keyword arguments each group's fields are named after; a group and
        its keywords together are refused, as is a combination that cannot work (:class:`UsageError`)."""
        groups = resolve(
            retention=retention,
            durable=durable,
            memory=memory,
            preemption=preemption,
            restore=restore,
            keywords={
                "keep_last": keep_last,
                "keep_every": keep_every,
                "async_save": async_save,
                "codec": codec,
                "incremental": incremental,
                "full_every": full_every,
                "frozen": frozenset(frozen),
                "memory_every": memory_every,
                "memory_dir": memory_dir,
                "memory_slots": memory_slots,
                "persist_duty": persist_duty,
                "replicate": replicate,
                "replicas": replicas,
                "replica_rate": replica_rate,
                "peer_timeout": peer_timeout,
                "close_timeout": close_timeout,
                "preemption_signals": tuple(preemption_signals),
                "exit_on_preemption": exit_on_preemption,
                "on_mismatch": on_mismatch,
                "verify_on_restore": verify_on_restore,
            },
        )
        self.retention, self.durable, self.memory, self.preemption, self.restore_options = groups
        self.run = RunDirectory(run_url, storage_options)
        # Several ranks (torch.distributed initialized, or an explicit collective): every rank calls the same
        # methods together; each writes its shards, rank 0 keeps the run directory, and a restore agrees.
        self.collective: Collective | None = collective if collective is not None else api._collective(process_group)
        # config/code/dataset differences warn by default; a data position that would repeat data is refused
        # by default (on_mismatch="warn" or "ignore" lets it through)
        self._lineage = Lineage.start(data_policy=self.restore_options.on_mismatch or "strict", loader=loader)
        self._durable = DurableEngine(
            self.run, collective=self.collective, lineage=self._lineage, retention=self.retention, options=self.durable
        )
        self._memory_engine: MemoryEngine | None = None
        self._engine: SaveEngine = self._durable
        if self.memory.on:
            self._memory_engine = MemoryEngine(
                self.run,
                options=self.memory,
                durable=self.durable,
                lineage=self._lineage,
                retention=self.retention,
                collective=collective,
                process_group=process_group,
            )
            self._engine = self._memory_engine
        self.last_restore: RestoreReport | None = None
        self._restorer = Restorer(
            self.run,
            collective=self.collective,
            lineage=self._lineage,
            options=self.restore_options,
            memory=self._memory,
            durable=self._durable,
        )
        self._guard: StepGuard | None = None
        if guard is not None:
            if self._memory_engine is None:
                raise UsageError("guard= rolls back from the memory tier: give memory_every >= 1 (1: every step)")
            self._guard = StepGuard(guard, collective=self.collective, roll_back=self._roll_back, node=node_key())
        self._preempted = threading.Event()
        self._previous_handlers: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.preemption.signals:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
            if self._memory_engine is not None:
                self._memory_engine.start_watcher(self.preemption.signals)
        if self._memory_engine is not None:
            atexit.register(self._at_exit)  # an interpreter that exits normally persists the newest snapshot

    # ---------------------------------------------------------------- what the parts hold, by the names of old

    @property
    def _memory(self) -> MemorySnapshots | None:
        """The memory tier's snapshots (slots, persists, replicas), or None without ``memory_every``."""
        return self._memory_engine.snapshots if self._memory_engine is not None else None

    @property
    def _inflight(self) -> Future[str] | None:
        return self._durable._inflight

    @property
    def last_checkpoint_id(self) -> str | None:
        return self._lineage.last_checkpoint_id

    @property
    def held_seconds(self) -> float:
        """Total time ``optimizer.step()`` waited for an async save's or a snapshot's copy of the state."""
        return self._engine.held_seconds

    @property
    def keep_last(self) -> int | None:
        return self.retention.keep_last

    @property
    def keep_every(self) -> int | None:
        return self.retention.keep_every

    @property
    def memory_every(self) -> int:
        return self.memory.every

    def _at_exit(self) -> None:
        # Several nodes: a persist needs every rank, and an interpreter that exits may be one whose peers are
        # gone (it would wait out the peer timeout): the snapshot and its replicas stay in memory instead.
        spread = self._memory_engine is not None and self._memory_engine.multi_node
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

    # ---------------------------------------------------------------- save

    def checkpoint_if_due(
        self,
        step: int,
        state: TrainingState | None = None,
        *,
        every: int,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        config: object = None,
        sampler: Stateful | None = None,
        loader: Stateful | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        generators: Mapping[str, np.random.Generator] | None = None,
        extra: Mapping[str, object] | None = None,
        mesh: Mapping[str, int] | None = None,
    ) -> bool:
        """Save when ``step`` is a multiple of ``every``, or at once after a preemption signal.

        With the memory tier, a snapshot every ``memory_every`` steps, persisted every ``every`` steps. The state is
        ``state`` or the keyword arguments (as :meth:`save`). After a preemption save the manager waits until it is
        durable and, unless told otherwise, exits the process cleanly (``SystemExit(0)``). Returns whether a
        durable save was made (or started) at this step.
        """
        preempted = self.preempted
        due = self._engine.due(step, every=every, preempted=preempted)
        if not due.write:
            self._engine.raise_background_error()
            return False
        live = TrainingState.of(
            state, model, optimizer, config, sampler, loader, scheduler, scaler, generators, extra, mesh
        )
        self._engine.save(step, live, persist=due.durable or preempted)
        if preempted:
            self.wait()
            where = " (from memory)" if self._memory_engine is not None else ""
            log.warning("emergency checkpoint at step %d is durable%s", step, where)
            if self.preemption.exit_on_preemption:
                self.close()
                raise SystemExit(0)
        return due.durable

    def save(
        self,
        step: int,
        state: TrainingState | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        config: object = None,
        sampler: Stateful | None = None,
        loader: Stateful | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        generators: Mapping[str, np.random.Generator] | None = None,
        extra: Mapping[str, object] | None = None,
        mesh: Mapping[str, int] | None = None,
    ) -> None:
        """Checkpoint the full training state at ``step`` (waits for a previous async save first).

        The state is a :class:`TrainingState`, or its fields as keyword arguments. The data position comes from
        ``loader=`` (default: the manager's ``loader``) or ``sampler=``. With the memory tier (``memory_every``),
        the state goes to a memory slot and is persisted from there in the background (:meth:`wait` waits for it).
        """
        live = TrainingState.of(
            state, model, optimizer, config, sampler, loader, scheduler, scaler, generators, extra, mesh
        )
        self._engine.save(step, live, persist=True)

    def wait(self) -> str | None:
        """Block until the save in flight is durable; raise its error if it failed."""
        return self._engine.wait()

    def wait_memory(self) -> None:
        """Block until the memory snapshot in flight is committed in its slot (not persisted)."""
        if self._memory_engine is not None:
            self._memory_engine.wait_written()

    @property
    def replica_lag(self) -> ReplicaLag | None:
        """How far this rank's replicas trail its snapshots (steps and seconds); None without replicas."""
        return self._memory_engine.replica_lag() if self._memory_engine is not None else None

    def wait_replica(self) -> RoundResult | None:
        """Block until the memory snapshot in flight is committed and this rank's part of its replica round is
        done (sent to its partner, received from its sources); the round's result, None without replicas."""
        return self._memory_engine.wait_replica() if self._memory_engine is not None else None

    # ---------------------------------------------------------------- restore

    def restore_latest(
        self,
        state: TrainingState | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: Stateful | None = None,
        loader: Stateful | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        config: object = None,
        generators: Mapping[str, np.random.Generator] | None = None,
        skip_fields: Sequence[str] = (),
        fresh: bool = False,
    ) -> int | None:
        """Resume from the newest checkpoint that is complete, reads and verifies; returns its step, or None.

        A checkpoint that cannot be opened or read whole (a corrupt chunk, an unreadable tensor, a context
        failing its schema) or lacks a field this resume needs (a ``weights``-profile checkpoint) is
        skipped with a WARNING naming why, and the next older one is tried. Nothing is applied until a
        checkpoint was read and checked whole, and then all of it or nothing (see :func:`api.apply`).
        ``loader=`` (default: the manager's ``loader``) or ``sampler=`` takes the data position back.
        ``skip_fields`` (``rng``, ``data``, ``optimizer``) are read and verified but not applied, e.g. to
        fine-tune with a fresh optimizer, or as a negative control showing that a resume needs them.
        :attr:`last_restore` reports what was taken, from where, and what was passed over.

        ``fresh=True`` says the live tensors hold nothing of value (a restore at start-up, into a model just built):
        tensors loaded in place are then read, hashed and placed in one pass instead of checked first and copied in
        after. All or nothing still holds at the checkpoint level, but differently: a checkpoint refused after it was
        partly placed is passed over and the next one overwrites it, and if none is left a ``RestoreError`` is raised
        (never None: the model no longer holds its fresh initialization). The default, for a live state (a reload
        mid-run), changes no live tensor unless all of the checkpoint is good.
        """
        self.wait()
        live = TrainingState.of(
            state, model, optimizer, config, sampler, loader, scheduler, scaler, generators, None, None
        )
        report = self._restorer.restore(live, skip_fields=skip_fields, fresh=fresh)
        if report is None:
            return None
        self.last_restore = report
        return self._lineage.step

    def _agree(self, ok: bool) -> bool:
        """Whether every rank can use the checkpoint at hand (the restorer's vote)."""
        return self._restorer._agree(ok)

    def _record_restore(self, report: RestoreReport) -> None:
        """Every rank's report, gathered and recorded by rank 0 (the restorer's last step)."""
        self._restorer._record(report)

    # ---------------------------------------------------------------- the guard (issue 40)

    def guard(self, step: int, state: TrainingState, *, loss: object, grad_norm: object = None) -> GuardVerdict:
        """Judge step ``step`` before its optimizer step (every rank together; see :mod:`ckptfmt.torch.guard`): a
        verdict that is true means go on; ``verdict.rolled_back`` means the state is back at ``verdict.step``."""
        if self._guard is None:
            raise UsageError("mgr.guard() needs CheckpointManager(guard=GuardOptions(...))")
        source = api.data_source(sampler=state.sampler, loader=state.loader) or self._lineage.loader
        norm = None if grad_norm is None else _scalar(grad_norm)
        return self._guard.check(step, state, loss=_scalar(loss), grad_norm=norm, source=source)

    @property
    def guard_events(self) -> list[GuardEvent]:
        """What the guard did so far, oldest first."""
        return list(self._guard.events) if self._guard is not None else []

    def _roll_back(self, state: TrainingState, at_most: int | None = None) -> int:
        """Restore the newest memory snapshot (the state before the step that tripped the guard), or the newest
        checkpoint of step ``at_most`` or older (a rollback several steps back); its step."""
        self.wait_memory()
        source = api.data_source(sampler=state.sampler, loader=state.loader) or self._lineage.loader
        sampler = getattr(source, "resumable_sampler", source)
        end = getattr(sampler, "end_iterator", None)
        if end is not None:
            end()  # the loop's iterator hands out nothing more: the loop starts a new one at the restored position
        report = self._restorer.restore(state, at_most=at_most)
        if report is None or self._lineage.step is None:
            raise GuardError("the guard tripped, but there is no snapshot to roll back to")
        if report.tier == "durable" and at_most is None:
            log.warning("the guard rolled back from the run directory: the memory tier held no snapshot")
        self.last_restore = report
        if state.optimizer is not None:
            state.optimizer.zero_grad(set_to_none=True)  # the bad step's gradients go with it
        return self._lineage.step

    # ---------------------------------------------------------------- a heal between replica groups (ft_transport)

    @property
    def memory_root(self) -> str | None:
        """This run's directory in node memory (slots, replicas, staged heals); None without the memory tier."""
        return str(self._memory.tier.root) if self._memory is not None else None

    def newest_snapshot(self) -> tuple[str, SlotRef] | None:
        """The newest committed memory snapshot: its slot's directory and reference; None without one."""
        memory = self._memory
        newest = memory.newest if memory is not None else None
        return (memory.tier.slot_path(newest.slot), newest) if memory is not None and newest is not None else None

    def capture(self, step: int, state: TrainingState) -> Snapshot:
        """The training state at ``step``, copied now, as a synchronous save captures it (for a peer to take)."""
        return self._lineage.capture(step, state.with_loader(self._lineage.loader), defer=False)

    def load_healed(self, url: str, state: TrainingState, report: RestoreReport) -> None:
        """Apply the checked checkpoint at ``url`` (a heal's staging copy) to ``state``, all of it or nothing, as a
        restore does; then it is this run's newest state (the next save's parent) and :attr:`last_restore`."""
        targets = state.with_loader(self._lineage.loader).restore_targets()
        api.load(url, **targets, on_mismatch=self.restore_options.on_mismatch or "warn")
        self._lineage.step = report.step
        self._lineage.last_checkpoint_id = report.checkpoint_id
        self.last_restore = report

    # ---------------------------------------------------------------- housekeeping

    @property
    def _is_coordinator(self) -> bool:
        return self.collective is None or self.collective.rank == 0

    def pin(self, step: int) -> None:
        if self._is_coordinator:
            self.run.set_pinned(self.run.pinned() | {checkpoint_name(step)})

    def unpin(self, step: int) -> None:
        if self._is_coordinator:
            self.run.set_pinned(self.run.pinned() - {checkpoint_name(step)})

    def gc(self) -> list[str]:
        return self._durable.gc(protect=self._engine.protected())

    def close(self, *, persist: bool = True) -> None:
        """Wait for the save in flight, stop the background threads, restore signal handlers.

        With the memory tier, the newest snapshot is persisted first unless the run directory has it already
        (``persist=False``: leave it in memory only, as a crash would; ``ckpt rescue`` can still persist it). A wait
        for a durable copy still running (a restored snapshot's, say) is logged; ``close_timeout=`` (seconds, given
        to the constructor) bounds it, abandoning a copy that outlasts it, whose snapshot then stays in memory.
        """
        atexit.unregister(self._at_exit)
        try:
            self._engine.close(persist=persist)
        finally:
            if self._engine is not self._durable:
                self._durable.close()
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            self._previous_handlers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scalar(value: object) -> float:
    """A loss or norm as a float: a tensor's value (detached), or the number itself."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().item())
    return float(value)  # type: ignore[arg-type]
