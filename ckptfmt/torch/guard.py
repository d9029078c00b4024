"""A bad step costs one step: a non-finite or spiking loss rolls back from memory, is replayed, and bad data is
quarantined (issue 40).

Call sequence, in the training loop, between the backward pass and the optimizer step (every rank together)::

    mgr = CheckpointManager(run, memory=MemoryOptions(every=1), guard=GuardOptions(spike=SpikeRule()))
    while step < total:
        for batch in loader:
            loss = loss_fn(model(batch)); loss.backward()
            norm = clip_grad_norm_(model.parameters(), 1.0)
            verdict = mgr.guard(step + 1, state, loss=loss, grad_norm=norm)
            if verdict.rolled_back:
                step = verdict.step      # the state is the memory snapshot's; a new iterator starts from its position
                break
            optimizer.step(); optimizer.zero_grad(); step += 1
            mgr.checkpoint_if_due(step, state, every=100)

What trips the guard (:class:`GuardOptions`): a non-finite loss or gradient norm; a loss spike by
:class:`SpikeRule` (above the mean plus ``z`` standard deviations, or above ``ratio`` times the median, of the
losses of the last ``window`` accepted steps, once ``warmup`` of them are known); a user ``predicate``. Each rank
judges its own loss; every rank takes the same decision (one rank's NaN is every rank's rollback).

On a trip the job rolls back to the newest memory snapshot (the state before the bad step, with its data position
and RNG), and the step is replayed on the same data. A clean replay means the fault was transient: the run goes on,
and the event names the ranks and node that tripped (a hint at faulty hardware). A replay that trips again means the
data is at fault: by ``policy``, the samples of the bad step that the tripping ranks took (``"batch"``), or the shards
they come from (``"shard"``), are quarantined in the data position, with the step, the reason and the values (every
later checkpoint's ``data`` field records them), and the job rolls back once more and goes on past them. No state that
tripped the guard is ever saved: the optimizer step is not taken, and the gradients are cleared at a rollback.
``max_rollbacks`` within ``per_steps`` steps bounds it: a run that trips on every step stops with a
:class:`GuardError` that names the policy.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..collective import Collective
from ..decide import decide
from ..errors import CheckpointError, MalformedMessageError, UsageError

log = logging.getLogger("ckptfmt")
Policy = Literal["batch", "shard", "window"]
Reason = Literal["nonfinite", "spike", "predicate"]
MAX_GUARD_MESSAGE = 64 << 10


class GuardError(CheckpointError):
    """The guard rolled back more often than its options allow, or cannot roll back: training stops."""

    code = "guard"


@dataclass(frozen=True, slots=True, kw_only=True)
class SpikeRule:
    """A loss spike: above ``mean + z * stdev`` (``z``) or above ``ratio * median`` (``ratio``) of the losses of the
    last ``window`` accepted steps, judged once ``warmup`` of them are known. Either test may be None."""

    window: int = 100
    warmup: int = 20
    z: float | None = 6.0
    ratio: float | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.warmup <= self.window:
            raise UsageError("SpikeRule needs 2 <= warmup <= window")
        if self.z is None and self.ratio is None:
            raise UsageError("SpikeRule needs z= or ratio= (or both)")
        if (self.z is not None and self.z <= 0) or (self.ratio is not None and self.ratio <= 1):
            raise UsageError("SpikeRule needs z > 0 and ratio > 1")

    def judge(self, loss: float, history: Sequence[float]) -> str | None:
        """Why ``loss`` is a spike against ``history`` (oldest first), or None."""
        recent = list(history[-self.window :])
        if len(recent) < self.warmup:
            return None
        mean, stdev = statistics.fmean(recent), statistics.pstdev(recent)
        if self.z is not None and loss > mean + self.z * max(stdev, 1e-12 * max(abs(mean), 1.0)):
            return f"loss {loss:.6g} is above mean {mean:.6g} + {self.z:g} x stdev {stdev:.6g} of {len(recent)} steps"
        median = statistics.median(recent)
        if self.ratio is not None and loss > self.ratio * median:
            return f"loss {loss:.6g} is above {self.ratio:g} x median {median:.6g} of {len(recent)} steps"
        return None


Predicate = Callable[[int, float, "float | None"], "str | None"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardOptions:
    """What trips the guard and what it does then (module doc). ``predicate(step, loss, grad_norm)`` returns why
    the step is bad, or None."""

    nonfinite: bool = True
    spike: SpikeRule | None = None
    predicate: Predicate | None = None
    policy: Policy = "batch"
    window_steps: int = 0
    max_rollbacks: int = 3
    per_steps: int = 100

    def __post_init__(self) -> None:
        if self.policy not in ("batch", "shard", "window"):
            raise UsageError(f"guard policy must be 'batch', 'shard' or 'window', not {self.policy!r}")
        if (self.policy == "window") != (self.window_steps > 0):
            raise UsageError("policy='window' rolls back window_steps >= 1 steps; the other policies take none")
        if self.max_rollbacks < 1 or self.per_steps < 1:
            raise UsageError("max_rollbacks and per_steps must be at least 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardEvent:
    """What the guard did at ``step``: ``kind`` is "rolled_back" (a trip, replay next), "transient" (the replay
    was clean) or "quarantined" (the replay tripped again: ``samples`` or ``shards`` were quarantined)."""

    step: int
    kind: Literal["rolled_back", "transient", "quarantined"]
    reason: str
    ranks: tuple[int, ...]
    values: Mapping[str, float] = field(default_factory=dict)
    samples: tuple[int, ...] = ()
    shards: tuple[str, ...] = ()
    node: str = ""
    phases: Mapping[str, float] = field(default_factory=dict)  # seconds: detect, agree, restore
    restored: int | None = None  # the step the state was rolled back to (None: no rollback)


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardVerdict:
    """``ok``: take the optimizer step. ``rolled_back``: the state is back at ``step`` (start a new iterator over
    the data). ``event``: what happened, if anything."""

    ok: bool
    rolled_back: bool
    step: int
    event: GuardEvent | None = None

    def __bool__(self) -> bool:
        return self.ok


@dataclass(slots=True)
class _Pending:
    """A step that tripped, rolled back, and is being replayed."""

    step: int
    reason: str
    ranks: tuple[int, ...]
    values: dict[str, float]


class StepGuard:
    """The guard of one rank (module doc). ``roll_back(state)`` restores the newest memory snapshot and returns its
    step; ``node`` names this rank's node in events."""

    def __init__(
        self,
        options: GuardOptions,
        *,
        collective: Collective | None,
        roll_back: Callable[[Any, int | None], int],
        node: str = "",
    ) -> None:
        self.options = options
        self.collective = collective
        self.rank = collective.rank if collective is not None else 0
        self._roll_back = roll_back
        self.node = node
        self._losses: dict[int, float] = {}  # accepted steps' losses
        self._pending: _Pending | None = None
        self._rollbacks: list[int] = []  # the steps at which the guard rolled back
        self.events: list[GuardEvent] = []

    def check(self, step: int, state: Any, *, loss: float, grad_norm: float | None, source: Any) -> GuardVerdict:
        started = time.perf_counter()
        mine = self._judge(step, loss, grad_norm)
        judged = time.perf_counter()
        decision = decide(self.collective, mine, _any_trip, what="the guard's verdict", max_size=MAX_GUARD_MESSAGE)
        phases = {"detect": judged - started, "agree": time.perf_counter() - judged}
        pending = self._pending
        if not decision["trip"]:
            self._losses[step] = loss
            self._forget_before(step)
            if pending is not None and pending.step == step:
                self._pending = None
                event = GuardEvent(
                    step=step,
                    kind="transient",
                    reason=pending.reason,
                    ranks=pending.ranks,
                    values=pending.values,
                    node=self.node,
                )
                return self._record(GuardVerdict(ok=True, rolled_back=False, step=step - 1, event=event))
            return GuardVerdict(ok=True, rolled_back=False, step=step - 1)
        ranks = tuple(int(r) for r in decision["ranks"])
        reason = str(decision["reason"])
        values = {k: float(v) for k, v in decision["values"].items()}
        self._count_rollback(step, reason)
        if pending is not None and pending.step == step:  # the replay tripped again: the data is at fault
            samples: tuple[int, ...]
            shards: tuple[str, ...] = ()
            if self.options.policy == "window":
                restored, samples = self._skip_window(state, step, source, phases, values)
            else:
                samples, shards = self._quarantine(step, source, ranks, reason, values)
                restored = self._restore(state, step, phases)
                self._apply_quarantine(source, step, samples, shards, reason, values)
            self._pending = None
            event = GuardEvent(
                step=step,
                kind="quarantined",
                reason=reason,
                ranks=ranks,
                values=values,
                samples=samples,
                shards=shards,
                node=self.node,
                phases=phases,
                restored=restored,
            )
            return self._record(GuardVerdict(ok=False, rolled_back=True, step=restored, event=event))
        restored = self._restore(state, step, phases)
        self._pending = _Pending(step=step, reason=reason, ranks=ranks, values=values)
        event = GuardEvent(
            step=step,
            kind="rolled_back",
            reason=reason,
            ranks=ranks,
            values=values,
            node=self.node,
            phases=phases,
            restored=restored,
        )
        return self._record(GuardVerdict(ok=False, rolled_back=True, step=restored, event=event))

    # ---------------------------------------------------------------- parts

    def _judge(self, step: int, loss: float, grad_norm: float | None) -> dict[str, object]:
        """This rank's view of the step, as a plain value for the vote (floats as text: NaN is not JSON)."""
        options = self.options
        why: str | None = None
        kind = ""
        own = True  # judged on this rank's own loss (its data), not on all-reduced gradients
        if options.nonfinite and not math.isfinite(loss):
            why, kind = f"non-finite loss {loss!r}", "nonfinite"
        elif options.nonfinite and grad_norm is not None and not math.isfinite(grad_norm):
            why, kind, own = f"non-finite gradient norm {grad_norm!r}", "nonfinite", False
        if why is None and options.spike is not None and math.isfinite(loss):
            history = [self._losses[s] for s in sorted(self._losses) if s < step]
            why = options.spike.judge(loss, history)
            kind = "spike" if why else ""
        if why is None and options.predicate is not None:
            why = options.predicate(step, loss, grad_norm)
            kind = "predicate" if why else ""
        values = {"loss": repr(float(loss))}
        if grad_norm is not None:
            values["grad_norm"] = repr(float(grad_norm))
        trip = why is not None
        return {"rank": self.rank, "trip": trip, "own": own, "kind": kind, "why": why or "", "values": values}

    def _count_rollback(self, step: int, reason: str) -> None:
        recent = [s for s in self._rollbacks if s > step - self.options.per_steps]
        if len(recent) >= self.options.max_rollbacks:
            raise GuardError(
                f"step {step} tripped the guard ({reason}) after {len(recent)} rollbacks within "
                f"{self.options.per_steps} steps (GuardOptions(max_rollbacks={self.options.max_rollbacks}, "
                f"per_steps={self.options.per_steps}, policy={self.options.policy!r})): training stops"
            )
        self._rollbacks.append(step)

    def _skip_window(
        self, state: Any, step: int, source: Any, phases: dict[str, float], values: Mapping[str, float]
    ) -> tuple[int, tuple[int, ...]]:
        """Policy "window" (as PaLM did): roll back ``window_steps`` steps or more before the bad one (the newest
        checkpoint that old, in memory or on disk), and quarantine every sample from there to the end of the bad
        step. A window that starts in the epoch before the bad step's skips only its part in the bad step's epoch."""
        sampler = getattr(source, "resumable_sampler", source)
        epoch, consumed = sampler.epoch, sampler.consumed  # the end of the bad step's batch
        restored = self._restore(state, step, phases, at_most=step - 1 - self.options.window_steps)
        window: list[int] = []
        if sampler.epoch == epoch and sampler.consumed < consumed:
            window = sampler.upcoming(consumed - sampler.consumed)
        elif sampler.epoch == epoch - 1 and consumed:
            window = sampler.upcoming(consumed, from_next_epoch=True)
        if window:
            source.quarantine_samples(sorted(window), step=step, reason="window", values=dict(values))
        return restored, tuple(sorted(window))

    def _restore(self, state: Any, step: int, phases: dict[str, float], at_most: int | None = None) -> int:
        started = time.perf_counter()
        restored = self._roll_back(state, at_most)
        phases["restore"] = time.perf_counter() - started
        if restored >= step:
            raise GuardError(f"the rollback for step {step} restored step {restored}, not a step before it")
        for s in [s for s in self._losses if s > restored]:
            del self._losses[s]
        return restored

    def _quarantine(
        self, step: int, source: Any, ranks: tuple[int, ...], reason: str, values: Mapping[str, float]
    ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The samples (policy "batch") or shards (policy "shard") of the bad step that the tripping ranks took."""
        taken = getattr(source, "last_batch_samples", None)
        if taken is None:
            raise GuardError(
                f"step {step} is bad on replay, but its data source ({type(source).__name__}) cannot say which samples "
                "it used: use a ResumableDataLoader"
            )
        samples: list[int] = list(taken())
        world = getattr(getattr(source, "resumable_sampler", source), "world_size", 1)
        mine = sorted({samples[i] for r in ranks for i in range(r, len(samples), world)})  # round-robin shares
        if self.options.policy == "shard":
            sampler = getattr(source, "resumable_sampler", source)
            return (), tuple(sorted({str(sampler.shard_of(i)) for i in mine}, key=lambda s: (len(s), s)))
        return tuple(mine), ()

    def _apply_quarantine(
        self,
        source: Any,
        step: int,
        samples: Sequence[int],
        shards: Sequence[str],
        reason: str,
        values: Mapping[str, float],
    ) -> None:
        kind = _kind(reason)
        if samples:
            source.quarantine_samples(list(samples), step=step, reason=kind, values=dict(values))
        for shard in shards:
            source.quarantine(shard, step=step, reason=kind, values=dict(values))

    def _forget_before(self, step: int) -> None:
        window = self.options.spike.window if self.options.spike is not None else 0
        for s in [s for s in self._losses if s <= step - window]:
            del self._losses[s]

    def _record(self, verdict: GuardVerdict) -> GuardVerdict:
        event = verdict.event
        if event is not None:
            self.events.append(event)
            where = f"rank(s) {list(event.ranks)}" + (f" on node {event.node}" if event.node else "")
            if event.kind == "transient":
                log.warning("step %d: transient fault on %s (%s): replay clean", event.step, where, event.reason)
            elif event.kind == "quarantined":
                what = f"samples {list(event.samples)}" if event.samples else f"shards {list(event.shards)}"
                log.warning("step %d: bad data on %s (%s): %s quarantined", event.step, where, event.reason, what)
            else:
                log.warning(
                    "step %d tripped the guard on %s (%s): rolled back to step %d, replaying",
                    event.step,
                    where,
                    event.reason,
                    verdict.step,
                )
        return verdict


def _kind(reason: str) -> str:
    return reason.split(":", 1)[0]


def _any_trip(values: Sequence[Any]) -> dict[str, object]:
    """The coordinator's decision: the step is bad if any rank says so; which ranks, why, and their values."""
    tripped = []
    for rank, value in enumerate(values):
        if not isinstance(value, dict) or not isinstance(value.get("trip"), bool):
            raise MalformedMessageError(f"rank {rank} sent a malformed guard verdict")
        if value["trip"]:
            tripped.append((rank, value))
    if not tripped:
        return {"trip": False, "ranks": [], "reason": "", "values": {}}
    # the ranks whose own loss tripped are the ones whose data is suspect; a gradient norm all-reduced from them is
    # non-finite on every rank, so it names them all only when no loss tripped
    own = [(rank, value) for rank, value in tripped if value.get("own") is True]
    tripped = own or tripped
    first = tripped[0][1]
    values_out: dict[str, float] = {}
    for rank, value in tripped:
        for name, text in dict(value.get("values", {})).items():
            values_out[f"{name}@rank{rank}"] = text
    return {
        "trip": True,
        "ranks": [rank for rank, _ in tripped],
        "reason": f"{first.get('kind')}: {first.get('why')}",
        "values": values_out,
    }
