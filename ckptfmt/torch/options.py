"""The :class:`~ckptfmt.torch.CheckpointManager`'s options, in groups: frozen records, each checked where it is made.

The groups are the public way to configure a manager; its keyword arguments (``keep_last=``, ``memory_every=``, ...)
remain a compatible front that builds them (:func:`resolve`). A combination of options either works or is refused
here, at construction, with a :class:`~ckptfmt.errors.UsageError` naming the options, never silently ignored.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field, fields
from typing import TypeVar

from ..codecs.xor_zstd import is_delta
from ..errors import UsageError
from ..tier.placement import check_replicas
from .api import DEDICATED_TIMEOUT, Policy

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionOptions:
    """Which durable checkpoints gc keeps: the newest ``keep_last`` (None: all), and every ``keep_every``-th step."""

    keep_last: int | None = 3
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{name} must be None or a positive number, not {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DurableOptions:
    """How a durable save is written (spec/codecs.md, spec/references.md).

    ``async_save``: parameters and optimizer state are copied and written by a background thread.
    ``codec``: None (raw), ``"zstd"`` or ``"zstd:LEVEL"`` for floating tensors; with ``incremental``, ``"xor-zstd"``
    (or ``"xor-zstd:LEVEL"``) stores each changed floating tensor as its XOR with the previous save's (spec/delta.md),
    each full save in zstd.
    ``incremental``: a save references the chunks of the previous durable save that it would write unchanged;
    every ``full_every``-th save is self-contained. ``frozen``: tensors an incremental save references unhashed.
    """

    async_save: bool = False
    codec: str | None = None
    incremental: bool = False
    full_every: int = 10
    frozen: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.full_every < 1:
            raise UsageError("full_every must be at least 1 (1: every save is full)")
        if self.frozen and not self.incremental:
            raise UsageError("frozen= names tensors an incremental save references unhashed: give incremental=True")
        if is_delta(self.codec) and not self.incremental:
            raise UsageError(
                "codec 'xor-zstd' stores each save as its difference from the previous one: give incremental=True"
            )
        if self.full_every != 10 and not self.incremental:
            raise UsageError("full_every= bounds chains of incremental saves: give incremental=True")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryOptions:
    """The memory tier (spec/memory.md): a snapshot in node memory every ``every`` steps (0: off).

    ``memory_dir`` (default ``$CKPTFMT_MEMORY_DIR`` or ``/dev/shm/ckptfmt-<uid>``), ``slots`` in the ring,
    ``persist_duty`` (the share of time a durable copy from memory may take), ``replicate`` (a copy of each rank's
    share on another node), ``replicas`` (with ``replicate``: how many copies, each on a node of another failure
    domain, ``$CKPTFMT_FAILURE_DOMAIN``), ``replica_rate`` (bytes a second on each replica link; None: no limit),
    ``peer_timeout`` (seconds a rank waits for its peers), ``close_timeout``
    (seconds ``close()`` waits for a durable copy, None: until done).
    """

    every: int = 0
    memory_dir: str | os.PathLike[str] | None = None
    slots: int = 2
    persist_duty: float = 0.5
    replicate: bool = False
    replicas: int = 1
    replica_rate: float | None = None
    peer_timeout: float = DEDICATED_TIMEOUT.total_seconds()
    close_timeout: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or self.every < 0:
            raise UsageError("memory_every must be 0 (off) or a number of steps")
        if self.close_timeout is not None and self.close_timeout < 0:
            raise UsageError("close_timeout must be None (wait until done) or a number of seconds")
        check_replicas(self.replicas)
        if self.replicas != 1 and not self.replicate:
            raise UsageError(f"replicas={self.replicas} counts the copies replicate=True makes: give replicate=True")
        if self.replica_rate is not None and (not self.replicate or not self.replica_rate > 0):
            raise UsageError("replica_rate is a positive number of bytes a second for replicate=True's copies")
        if not self.every:
            # memory_dir= and peer_timeout= may be given for a run that turns the tier on elsewhere (they do nothing)
            given = [
                name
                for name, value, default in (
                    ("replicate", self.replicate, False),
                    ("memory_slots", self.slots, 2),
                    ("persist_duty", self.persist_duty, 0.5),
                    ("close_timeout", self.close_timeout, None),
                )
                if value != default
            ]
            if given:
                raise UsageError(f"{', '.join(given)} configure the memory tier, which is off: give memory_every=")

    @property
    def on(self) -> bool:
        return self.every > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PreemptionOptions:
    """What a preemption signal does: the step in progress finishes, a checkpoint is saved and made durable, and
    the process exits (``exit_on_preemption``)."""

    signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)
    exit_on_preemption: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreOptions:
    """How a restore judges what it reads: ``on_mismatch`` (None: config/code/dataset differences warn, a data
    position that would repeat data is refused), ``verify_on_restore`` (every file's digests, before reading)."""

    on_mismatch: Policy | None = None
    verify_on_restore: bool = False


def check_combination(durable: DurableOptions, memory: MemoryOptions) -> None:
    """Refuse what the memory tier cannot honour: its durable saves are copies of memory slots, written in the
    background already (re-encoded with ``codec`` where one is given; with ``incremental``, re-written referencing
    the previous durable save, ``full_every`` and ``frozen`` as for a direct save). ``incremental`` on several
    nodes is refused where the nodes are known (:class:`~.memory_engine.MemoryEngine`)."""
    if memory.on and durable.async_save:
        raise UsageError(
            "async_save=True cannot be combined with memory_every=: with the memory tier every snapshot is "
            "written in the background already; give either the memory tier or async_save"
        )


def _default(cls: type[object], name: str) -> object:
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name == name:
            return f.default_factory() if callable(f.default_factory) else f.default
    raise KeyError(name)


def merge(group: T | None, cls: type[T], given: dict[str, tuple[str, object]], *, what: str) -> T:
    """``group`` if given, else one built from the keyword arguments ``given`` (field -> (keyword, value)); both is
    an error naming the keywords that were given too (a keyword at its default counts as not given)."""
    if group is None:
        return cls(**{name: value for name, (_, value) in given.items()})
    if not isinstance(group, cls):
        raise UsageError(f"{what}= takes a {cls.__name__}, not {type(group).__name__}")
    clashing = sorted(keyword for name, (keyword, value) in given.items() if value != _default(cls, name))
    if clashing:
        raise UsageError(f"give {what}= or {'=, '.join(clashing)}=, not both")
    return group


Groups = tuple[RetentionOptions, DurableOptions, MemoryOptions, PreemptionOptions, RestoreOptions]


def resolve(
    *,
    retention: RetentionOptions | None,
    durable: DurableOptions | None,
    memory: MemoryOptions | None,
    preemption: PreemptionOptions | None,
    restore: RestoreOptions | None,
    keywords: dict[str, object],
) -> Groups:
    """The manager's option groups, from the groups given and the keyword arguments (by their keyword names), the
    combination checked (:func:`check_combination`)."""

    def given(*pairs: tuple[str, str]) -> dict[str, tuple[str, object]]:
        return {name: (keyword, keywords[keyword]) for name, keyword in pairs}

    out = (
        merge(
            retention,
            RetentionOptions,
            given(("keep_last", "keep_last"), ("keep_every", "keep_every")),
            what="retention",
        ),
        merge(
            durable,
            DurableOptions,
            given(*((n, n) for n in ("async_save", "codec", "incremental", "full_every", "frozen"))),
            what="durable",
        ),
        merge(
            memory,
            MemoryOptions,
            given(
                ("every", "memory_every"),
                ("memory_dir", "memory_dir"),
                ("slots", "memory_slots"),
                ("persist_duty", "persist_duty"),
                ("replicate", "replicate"),
                ("replicas", "replicas"),
                ("replica_rate", "replica_rate"),
                ("peer_timeout", "peer_timeout"),
                ("close_timeout", "close_timeout"),
            ),
            what="memory",
        ),
        merge(
            preemption,
            PreemptionOptions,
            given(("signals", "preemption_signals"), ("exit_on_preemption", "exit_on_preemption")),
            what="preemption",
        ),
        merge(
            restore,
            RestoreOptions,
            given(("on_mismatch", "on_mismatch"), ("verify_on_restore", "verify_on_restore")),
            what="restore",
        ),
    )
    check_combination(out[1], out[2])
    return out
