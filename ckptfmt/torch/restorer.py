"""The restore of a training run: the newest checkpoint every rank can use, from memory, other nodes or the run
directory, applied whole or not at all, and a report of what it took.

Call sequence (every rank together)::

    restorer = Restorer(run, collective=..., lineage=..., options=RestoreOptions(), memory=snapshots_or_None)
    report = restorer.restore(TrainingState(model=m, optimizer=o), skip_fields=())   # None: nothing to resume

One candidate at a time, newest step first (at the same step, memory before the run directory):

1. *fetch*: a checkpoint spread over several nodes' memory gathers what this node lacks (every rank together);
2. *read*: opened, verified (``verify_on_restore``) and read whole into host memory, touching nothing live;
3. *check*: the fields this resume needs are there;
4. *vote*: every rank says whether it can use it; one rank's "no" passes over it on every rank, so the job never
   splits over two checkpoints;
5. *apply*: compared with the run (``on_mismatch``) and applied, all of it or nothing (:func:`api.apply`);
6. *report*: :class:`RestoreReport`, gathered from every rank and written beside the checkpoints by rank 0.

Only a checkpoint that cannot be read, verified or used as a resume is skipped. Once it is in memory, whole and
verified, a refusal to apply it (a mismatch under "strict", a model of another shape, a sampler with another seed)
is the caller's to see: falling back to an older checkpoint, or to none, would silently train something else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..collective import Collective
from ..decide import decide
from ..errors import CheckpointError, MalformedMessageError, RestoreError
from ..jsonio import load_json
from ..manifest_parse import parse_manifest
from ..reader import Checkpoint, open_checkpoint
from ..run import RunDirectory
from ..tier.agreed import AgreedRestore, Fetched
from . import api, read_state, sharding
from .durable import DurableEngine
from .memory import MemorySnapshots
from .options import RestoreOptions
from .restore_report import Candidate, RestoreReport, Tier, estimated_state_bytes
from .state import Snapshot
from .training_state import Lineage, TrainingState

log = logging.getLogger("ckptfmt")
MAX_REPORT_BYTES = 1 << 20  # one rank's restore report (its skipped list names each checkpoint passed over)
_PLAIN_NAME = re.compile(r"[^/\\\x00]{1,255}")  # one path segment


@dataclass(slots=True)
class _Read:
    """One candidate as this rank read it: the snapshot (None: it could not be read or verified), the open
    checkpoint it came from, and what it cost."""

    snap: Snapshot | None = None
    ckpt: Checkpoint | None = None
    held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    referencing: bool = False  # it references a base (its depth is in its metadata)
    filled: bool = False  # read into the live tensors in one pass (a fresh restore): they may hold part of it
    seconds: float = 0.0


class Restorer:
    """Restores a manager's run (see the module docstring)."""

    def __init__(
        self,
        run: RunDirectory,
        *,
        collective: Collective | None,
        lineage: Lineage,
        options: RestoreOptions,
        memory: MemorySnapshots | None = None,
        durable: DurableEngine | None = None,
    ) -> None:
        self.run = run
        self.collective = collective
        self.lineage = lineage
        self.on_mismatch: api.Policy = options.on_mismatch or "warn"
        self.verify = options.verify_on_restore
        self.memory = memory
        self.durable = durable  # told which checkpoint was restored: the next incremental save's base
        self._agreed: AgreedRestore | None = None  # the restore across nodes in progress
        self._agree_seconds = 0.0

    def restore(
        self,
        state: TrainingState,
        *,
        skip_fields: Sequence[str] = (),
        at_most: int | None = None,
        fresh: bool = False,
    ) -> RestoreReport | None:
        """Resume from the newest checkpoint every rank can use; its report, or None when there is none.
        ``at_most``: only a checkpoint of that step or an older one (a rollback several steps back). ``fresh``: the
        live tensors hold nothing of value (a restore at start-up), so a candidate is read into them in one pass; a
        candidate refused after that leaves them part-written, so the next one overwrites them, and if none is
        left a :class:`RestoreError` is raised on every rank instead of None (the live state is no longer the
        fresh one a caller would train from)."""
        started = time.perf_counter()
        state = state.with_loader(self.lineage.loader)
        if self.memory is not None and state.optimizer is not None:
            self.memory.check_capacity(estimated_state_bytes(state.model, state.optimizer))
        skipped: list[str] = []
        overwritten = False  # a candidate was read into the live tensors in one pass (fresh) and then refused
        for candidate in self.candidates():
            if at_most is not None and (candidate.step is None or candidate.step > at_most):
                continue  # newer than the rollback asks for: not a candidate, not a failure
            if candidate.status != "committed":
                log.warning("skipping %s: %s", candidate.label, candidate.status)
                skipped.append(f"{candidate.label}: {candidate.status}")
                continue
            fetched: Fetched | None = None
            if candidate.option is not None:  # spread over nodes: gather what this node lacks (all ranks, together)
                try:
                    fetched = self._fetch(candidate, state)
                except CheckpointError as exc:  # the same error on every rank: all pass over it together
                    log.warning("skipping %s: its files could not be gathered: %s", candidate.label, exc)
                    skipped.append(f"{candidate.label}: {type(exc).__name__}: {exc}")
                    continue
            read = self._read(candidate, fetched, state, skip_fields, skipped, fresh=fresh)
            missing = self._missing(read.snap, state, skip_fields, candidate.label, read)
            agreed = self._agree(read.snap is not None and not missing)
            if fetched is not None and self._agreed is not None:
                self._agreed.clean_up()  # every rank has read what was fetched (or passed over it)
            if not agreed:
                overwritten = overwritten or read.filled
                if read.snap is not None:
                    read.snap.discard()  # checked here, refused elsewhere: not copied in, so not kept in the page cache
                read.held.close()
                if read.snap is not None and not missing:
                    log.warning("skipping %s: another rank cannot use it", candidate.label)
                    skipped.append(f"{candidate.label}: another rank cannot use it")
                continue
            return self._apply(candidate, fetched, read, state, skip_fields, skipped, started)
        if fresh and not self._agree(not overwritten):  # every rank raises, or none does
            raise RestoreError(
                "no checkpoint could be restored, and a refused one was read into the live tensors in one pass "
                "(fresh=True): they hold part of it, so this process must not train from them; passed over: "
                + "; ".join(skipped),
                path=self.run.url,
            )
        return None

    # ---------------------------------------------------------------- the steps of one candidate

    def _fetch(self, candidate: Candidate, state: TrainingState) -> Fetched:
        assert self._agreed is not None and candidate.option is not None
        manifest = parse_manifest(candidate.option.manifest_bytes)
        needed = read_state.files_needed(manifest, read_state.load_targets(state.model))
        return self._agreed.fetch(candidate.option, needed)

    def _read(
        self,
        candidate: Candidate,
        fetched: Fetched | None,
        state: TrainingState,
        skip_fields: Sequence[str],
        skipped: list[str],
        *,
        fresh: bool = False,
    ) -> _Read:
        """Open, verify and read ``candidate`` whole, touching nothing live (``fresh``: reading tensors loaded in
        place into them, once); whatever fails, it is "not this one".

        The checkpoint stays open until its snapshot is applied: tensors loaded in place are copied in from it then
        (in_place.py). Not for files fetched from other nodes: this node's leader deletes them after the vote."""
        read = _Read()
        started = time.perf_counter()
        live = api.live_targets(state.model, state.optimizer, skip_fields) if fetched is None else None
        try:
            if fetched is not None and candidate.option is not None:
                data = candidate.option.manifest_bytes
                ckpt = read.held.enter_context(Checkpoint(fetched.store, parse_manifest(data), data))
            else:
                ckpt = read.held.enter_context(open_checkpoint(candidate.url, self.run.storage_options))
            report = ckpt.verify() if self.verify else None
            if report is not None and not report.ok:
                log.warning("skipping %s: %s", candidate.label, "; ".join(map(str, report.problems[:3])))
            else:
                read.filled = fresh and bool(live)  # from here on, the live tensors may hold part of this one
                read.snap = read_state.read_snapshot(ckpt, read_state.load_targets(state.model), live, fresh=fresh)
                read.ckpt = ckpt
                read.referencing = bool(ckpt.manifest.bases)  # a self-contained checkpoint is a full save
        except Exception as exc:  # reading touches nothing live: whatever fails, it is "not this one"
            read.held.close()
            log.warning("skipping %s: cannot be read: %s: %s", candidate.label, type(exc).__name__, exc)
            skipped.append(f"{candidate.label}: {type(exc).__name__}: {exc}")
        read.seconds = time.perf_counter() - started
        return read

    def _missing(
        self, snap: Snapshot | None, state: TrainingState, skip_fields: Sequence[str], label: str, read: _Read
    ) -> list[str]:
        """The fields this resume needs that the snapshot lacks (a ``weights``-profile checkpoint has no optimizer)."""
        if snap is None:
            return []
        source = api.data_source(sampler=state.sampler, loader=state.loader)
        missing = api.missing_fields(
            snap,
            optimizer=None if "optimizer" in skip_fields else state.optimizer,
            sampler=None if "data" in skip_fields else source,
            scheduler=state.scheduler,
            scaler=state.scaler,
            stateful=state.stateful,
            restore_rng="rng" not in skip_fields,
        )
        if missing:
            profile = read.ckpt.profile if read.ckpt is not None else None
            log.warning(
                "skipping %s: it has no %s field (profile %r), which this resume needs",
                label,
                ", ".join(missing),
                profile,
            )
        return missing

    def _apply(
        self,
        candidate: Candidate,
        fetched: Fetched | None,
        read: _Read,
        state: TrainingState,
        skip_fields: Sequence[str],
        skipped: list[str],
        started: float,
    ) -> RestoreReport:
        """Apply the candidate every rank agreed on, tell the engines, and report."""
        snap, ckpt = read.snap, read.ckpt
        assert snap is not None and ckpt is not None
        with read.held:
            restored = api.restore(
                snap,
                checkpoint_id=ckpt.id,
                url=ckpt.url,
                **state.restore_targets(),
                on_mismatch=self.on_mismatch,
                skip_fields=skip_fields,
            )
        self.lineage.last_checkpoint_id = restored.checkpoint_id
        step = restored.step if restored.step is not None else candidate.step
        self.lineage.step = step
        if candidate.tier == "durable" and self.durable is not None:
            self.durable.adopt_base(candidate.label, ckpt.manifest.metadata, referencing=read.referencing)
        now = api.topology()
        live_mesh, _ = sharding.placements(state.model)  # the mesh the model is sharded on now, as a save records it
        if live_mesh:
            now.setdefault("mesh", live_mesh)
        _log_topology_change(candidate.label, snap.contexts.get("topology", {}), now)
        if self.memory is not None:
            self.memory.restored(step if step is not None else -1, candidate.memory)
        report = self._report(candidate, fetched, read, ckpt, step, skipped, started)
        self._record(report)
        log.info(
            "restored step %s from %s (%s) in %.3f s, %d bytes read",
            step,
            report.tier,
            report.url,
            report.seconds,
            report.bytes_read,
        )
        return report

    def _report(
        self,
        candidate: Candidate,
        fetched: Fetched | None,
        read: _Read,
        ckpt: Checkpoint,
        step: int | None,
        skipped: list[str],
        started: float,
    ) -> RestoreReport:
        sources = fetched.sources() if fetched is not None else {}
        tier: Tier = candidate.tier
        if fetched is not None and any(v.startswith("peer") for v in sources.values()):
            tier = "peer"  # some of what this rank read came from another node's memory
        gather = fetched.seconds if fetched is not None else 0.0
        total = time.perf_counter() - started
        return RestoreReport(
            step=step,
            tier=tier,
            url=ckpt.url,
            checkpoint_id=ckpt.id,
            seconds=total,
            bytes_read=ckpt.bytes_read,  # with the second pass of the tensors loaded in place
            skipped=tuple(skipped),
            sources=sources,
            bytes_between_nodes=fetched.bytes_moved if fetched is not None else 0,
            phases={
                "agree": round(self._agree_seconds, 6),
                "gather": round(gather, 6),
                "read": round(read.seconds, 6),
                "apply": round(total - self._agree_seconds - read.seconds - gather, 6),
            },
            held=tuple(self._agreed.held) if self._agreed is not None else (),
        )

    # ---------------------------------------------------------------- every rank together

    def _record(self, report: RestoreReport) -> None:
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
                what = f"the restore report of rank {rank}"
                ranks.append(load_json(data, error=MalformedMessageError, what=what, allow_float=True))
            except CheckpointError as exc:
                ranks.append({"rank": rank, "error": str(exc)})
        doc = {**report.to_dict(), "ranks": ranks}
        log.info("restore report: %s", json.dumps(report.to_dict()))
        try:
            self.run.record_restore(doc)
        except CheckpointError as exc:  # a report is a record, not a reason to fail a restore that worked
            log.warning("the restore report could not be written: %s", exc)

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

    def candidates(self) -> list[Candidate]:
        """Every checkpoint a restore may take, newest step first; at the same step, memory before durable."""
        found = [
            Candidate(label=name, step=step, status=status, url=self.run.child_url(name), tier="durable")
            for name, step, status in self._listing()
        ]
        self._agreed, self._agree_seconds = None, 0.0
        memory = self.memory
        if memory is not None and memory.across_nodes:
            started = time.perf_counter()
            self._agreed = memory.agreed()
            try:
                options = self._agreed.options()
            except CheckpointError as exc:  # the same error on every rank (ckptfmt.decide): all pass over memory
                log.warning("skipping the memory tier: its holdings could not be agreed on: %s", exc)
                options = []
            root = str(memory.tier.root)
            found += [
                Candidate(
                    label=f"memory step {o.step} ({o.checkpoint_id[:23]})",
                    step=o.step,
                    status="committed",
                    url=root,
                    tier="memory",
                    option=o,
                )
                for o in options
            ]
            self._agree_seconds = time.perf_counter() - started
        elif memory is not None:
            found += [
                Candidate(label=f"memory {c.url}", step=c.step, status="committed", url=c.url, tier="memory", memory=c)
                for c in memory.candidates()
            ]
        return sorted(found, key=lambda c: (c.step if c.step is not None else -1, c.tier == "memory"), reverse=True)

    def _listing(self) -> list[tuple[str, int | None, str]]:
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
